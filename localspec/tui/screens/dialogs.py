"""Small modal dialogs: an error message, a line of text, a yes/no question."""

from __future__ import annotations

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static


class ErrorScreen(ModalScreen[None]):
    """A dismissible error: the error's title and its one-line message, never a traceback."""

    BINDINGS = [Binding("escape,enter", "dismiss_error", "Dismiss")]

    def __init__(self, title: str, message: str) -> None:
        super().__init__(classes="dialog-screen")
        self.error_title = title
        self.error_message = message

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog error"):
            yield Label(self.error_title, classes="dialog-title")
            yield Static(self.error_message, classes="dialog-body", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="error", id="ok")

    @on(Button.Pressed, "#ok")
    def action_dismiss_error(self) -> None:
        self.dismiss(None)


class TextPromptScreen(ModalScreen[str | None]):
    """Ask for one line of text (rename, pull name)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "", placeholder: str = "") -> None:
        super().__init__(classes="dialog-screen")
        self.prompt_title = title
        self.value = value
        self.placeholder = placeholder

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.prompt_title, classes="dialog-title")
            yield Input(self.value, placeholder=self.placeholder, id="text")
            with Horizontal(classes="dialog-buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def submit(self) -> None:
        self.dismiss(self.query_one(Input).value)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; the buttons may say what each answer does."""

    BINDINGS = [Binding("escape", "no", "No"), Binding("y", "yes", "Yes")]

    def __init__(self, question: str, *, title: str | None = None, yes: str = "Yes",
                 no: str = "No") -> None:
        super().__init__(classes="dialog-screen")
        self.question = question
        self.question_title = title
        self.yes_label, self.no_label = yes, no

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            if self.question_title:
                yield Label(self.question_title, classes="dialog-title")
            yield Static(self.question, classes="dialog-body", markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button(self.yes_label, variant="warning", id="yes")
                yield Button(self.no_label, id="no")

    @on(Button.Pressed, "#yes")
    def action_yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def action_no(self) -> None:
        self.dismiss(False)
