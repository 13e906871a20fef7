"""Settings: drafting, sampling, GPU layers, context, threads, system prompt.

Every field is a parameter of ``params.PARAMS``: the same ranges and meanings as the CLI's flags
and config.toml. A value out of range is shown in a modal naming the parameter, the value and the
allowed range; the screen stays open with what was typed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from ...options import Settings
from ...params import PARAMS, InvalidOptionError
from .dialogs import ErrorScreen

# (field, label) in display order. Choices and booleans are Selects, the rest are Inputs.
FIELDS: tuple[tuple[str, str], ...] = (
    ("draft_mode", "Draft mode"),
    ("k", "K (auto or a number)"),
    ("k_max", "Longest auto draft"),
    ("accept_rule", "Acceptance rule (sampling)"),
    ("exact", "Exact (no drift-prone drafting)"),
    ("temperature", "Temperature (0 = greedy)"),
    ("top_k", "Top-k"),
    ("top_p", "Top-p"),
    ("min_p", "Min-p"),
    ("repeat_penalty", "Repeat penalty"),
    ("seed", "Seed (empty: random)"),
    ("max_tokens", "Max tokens per answer"),
    ("gpu_layers", "GPU layers, target (auto, -1 all)"),
    ("draft_gpu_layers", "GPU layers, draft (auto, -1 all)"),
    ("ctx", "Context size"),
    ("threads", "Threads (empty: cores)"),
    ("repack", "Repacked CPU kernels"),
    ("system_prompt", "System prompt"),
)


def _shown(name: str, value: Any) -> str:
    if value is None:
        return "auto" if PARAMS[name].kind == "k" else ""
    return str(value)


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
                for name, label in FIELDS:
                    p = PARAMS[name]
                    value = getattr(self.settings, name)
                    with Horizontal(classes="field"):
                        yield Label(label, classes="field-label")
                        if p.kind == "choice":
                            yield Select([(c, c) for c in p.choices], value=value,
                                         allow_blank=False, id=name, tooltip=p.meaning)
                        elif p.kind == "bool":
                            yield Select([("no", False), ("yes", True)], value=value,
                                         allow_blank=False, id=name, tooltip=p.meaning)
                        else:
                            yield Input(_shown(name, value), id=name, tooltip=p.meaning)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def read_form(self) -> Settings:
        """The settings as typed; InvalidOptionError names the first bad field."""
        values: dict[str, Any] = {}
        for name, label in FIELDS:
            p = PARAMS[name]
            if p.kind in ("choice", "bool"):
                values[name] = self.query_one(f"#{name}", Select).value
            elif p.kind == "str":
                values[name] = self.query_one(f"#{name}", Input).value
            else:
                values[name] = p.parse(self.query_one(f"#{name}", Input).value, label=label)
        return dataclasses.replace(self.settings, **values).validate()

    @on(Button.Pressed, "#save")
    def action_save(self) -> None:
        try:
            new = self.read_form()
        except InvalidOptionError as exc:
            self.app.push_screen(ErrorScreen(exc.title, exc.message))
            return
        self.dismiss(new)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
