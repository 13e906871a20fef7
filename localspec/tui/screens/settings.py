"""Settings: draft mode, sampling, GPU layers, context, threads, system prompt."""

from __future__ import annotations

import dataclasses

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from ...config import DRAFT_CHOICES, Settings
from ...errors import ConfigError

# (field, label, input type) in display order; draft_mode is a Select.
FIELDS: tuple[tuple[str, str, str], ...] = (
    ("k", "K (fixed mode)", "integer"),
    ("temperature", "Temperature (0 = greedy)", "number"),
    ("top_k", "Top-k", "integer"),
    ("top_p", "Top-p", "number"),
    ("min_p", "Min-p", "number"),
    ("repeat_penalty", "Repeat penalty", "number"),
    ("max_tokens", "Max tokens per answer", "integer"),
    ("gpu_layers_target", "GPU layers, target (-1 all)", "integer"),
    ("gpu_layers_draft", "GPU layers, draft (-1 all)", "integer"),
    ("ctx", "Context size", "integer"),
    ("threads", "Threads (empty: cores)", "text"),
    ("system_prompt", "System prompt", "text"),
)


class SettingsScreen(ModalScreen[Settings | None]):
    """Dismisses with the new Settings (the app saves them) or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: Settings) -> None:
        super().__init__(classes="dialog-screen")
        self.settings = settings

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="settings-dialog"):
            yield Label("Settings (model fields apply on the next load)", classes="dialog-title")
            with VerticalScroll(id="settings-form"):
                with Horizontal(classes="field"):
                    yield Label("Draft mode")
                    yield Select([(c, c) for c in DRAFT_CHOICES], value=self.settings.draft_mode,
                                 allow_blank=False, id="draft_mode")
                for name, label, kind in FIELDS:
                    value = getattr(self.settings, name)
                    with Horizontal(classes="field"):
                        yield Label(label)
                        yield Input("" if value is None else str(value), type=kind, id=name)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def read_form(self) -> Settings:
        """The settings as typed; ConfigError names the first bad field."""
        values: dict[str, object] = {"draft_mode": self.query_one("#draft_mode", Select).value}
        for name, label, kind in FIELDS:
            raw = self.query_one(f"#{name}", Input).value.strip()
            try:
                if name == "threads":
                    values[name] = int(raw) if raw else None
                elif kind == "integer":
                    values[name] = int(raw)
                elif kind == "number":
                    values[name] = float(raw)
                else:
                    values[name] = raw
            except ValueError:
                raise ConfigError(f"{label}: {raw!r} is not a number") from None
        new = dataclasses.replace(self.settings, **values)  # type: ignore[arg-type]
        new.validate()
        return new

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            new = self.read_form()
        except ConfigError as exc:
            self.notify(exc.message, title=exc.title, severity="error")
            return
        self.dismiss(new)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
