"""Saved chats: open, rename, delete, export to Markdown."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import TYPE_CHECKING

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Label

from .dialogs import ConfirmScreen, TextPromptScreen

if TYPE_CHECKING:
    from ..app import LocalspecApp


class ChatListScreen(ModalScreen[int | None]):
    """Dismisses with the chat id to open, or None."""

    BINDINGS = [
        Binding("escape", "back", "Back"),
        Binding("r", "rename", "Rename"),
        Binding("d", "delete", "Delete"),
        Binding("e", "export", "Export"),
    ]

    def __init__(self, export_dir: Path) -> None:
        super().__init__(classes="dialog-screen")
        self.export_dir = export_dir

    @property
    def lsapp(self) -> LocalspecApp:
        return self.app  # type: ignore[return-value]

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
        for c in self.lsapp.store.list_chats():
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
        chat = self.lsapp.store.get_chat(chat_id) if chat_id is not None else None
        if chat is None:
            return

        def renamed(title: str | None) -> None:
            if title:
                self.lsapp.store.rename_chat(chat.id, title)
                self.refresh_chats()

        self.app.push_screen(TextPromptScreen("Rename chat", chat.title), renamed)

    def action_delete(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return

        def confirmed(yes: bool | None) -> None:
            if yes:
                self.lsapp.store.delete_chat(chat_id)
                if self.lsapp.chat.chat_id == chat_id:
                    self.lsapp.chat.chat_id = None
                self.refresh_chats()

        self.app.push_screen(ConfirmScreen("Delete this chat?"), confirmed)

    def action_export(self) -> None:
        chat_id = self._selected()
        if chat_id is None:
            return
        try:
            path = self.lsapp.store.export_to(chat_id, self.export_dir)
        except OSError as exc:
            self.lsapp.show_error(exc)
            return
        self.notify(f"Exported to {path}")

    def action_back(self) -> None:
        self.dismiss(None)
