"""Saved chats: open, rename, delete, export to Markdown."""

from __future__ import annotations

import datetime as dt
import sqlite3
from collections.abc import Callable
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label

from ...chat_store import ChatStore
from ..messages import ChatDeleted, WorkFailed
from .dialogs import ConfirmScreen, TextPromptScreen


class ChatListScreen(ModalScreen[int | None]):
    """The chats saved in ``store``; dismisses with the chat id to open, or None.

    Deleting a chat posts ChatDeleted (the chat screen may be showing it); a rename, deletion
    or export that fails posts WorkFailed. Both bubble up to the app.
    """

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("e", "export", "Export"),
    ]

    def __init__(self, store: ChatStore, export_dir: Path) -> None:
        super().__init__(classes="dialog-screen")
        self.store = store
        self.export_dir = export_dir

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog help"):
            yield Label("Saved chats — Enter opens", classes="dialog-title")
            table: DataTable[str] = DataTable(cursor_type="row", id="chats")
            table.add_columns("Title", "Pair", "Last used")
            yield table
            yield Footer()

    def on_mount(self) -> None:
        self.refresh_chats()
        self.query_one(DataTable).focus()

    def refresh_chats(self) -> None:
        table = self.query_one(DataTable)
        table.clear()
        for c in self.store.list_chats():
            when = dt.datetime.fromtimestamp(c.updated).strftime("%Y-%m-%d %H:%M")
            table.add_row(c.title, c.pair or "—", when, key=str(c.id))

    def _selected(self) -> int | None:
        table = self.query_one(DataTable)
        if not table.row_count:
            return None
        key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        return int(key) if key else None

    @on(DataTable.RowSelected)
    def open_chat(self) -> None:
        chat_id = self._selected()
        if chat_id is not None:
            self.dismiss(chat_id)

    def action_rename(self) -> None:
        chat_id = self._selected()
        chat = self.store.get_chat(chat_id) if chat_id is not None else None
        if chat is None:
            return

        def renamed(title: str | None) -> None:
            if title and self._written(lambda: self.store.rename_chat(chat.id, title)):
                self.refresh_chats()

        self.app.push_screen(TextPromptScreen("Rename chat", chat.title), renamed)

    def action_delete(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes and self._written(lambda: self.store.delete_chat(chat_id)):
                self.post_message(ChatDeleted(chat_id))
                self.refresh_chats()

        self.app.push_screen(ConfirmScreen("Delete this chat?"), confirmed)

    def action_export(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return
        written: list[Path] = []
        if self._written(lambda: written.append(self.store.export_to(chat_id, self.export_dir))):
            self.notify(f"Exported to {written[0]}")

    def _written(self, write: Callable[[], object]) -> bool:
        """Run a write to the chat history or an export; a failure (a locked or full database,
        a folder that cannot be written) is shown in the app, which goes on."""
        try:
            write()
        except (sqlite3.Error, OSError) as exc:
            self.post_message(WorkFailed(exc))
            return False
        return True

    def action_back(self) -> None:
        self.dismiss(None)
