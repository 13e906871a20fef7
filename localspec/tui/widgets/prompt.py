"""The message box: several lines, so a pasted text arrives whole (Textual's Input keeps only
the first line of a paste)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import TextArea

# Keys that start a new line in the message. Terminals send Enter and Shift+Enter alike unless
# they report modifiers (the kitty protocol); Ctrl+J (a line feed) works in every terminal.
NEWLINE_KEYS = ("shift+enter", "ctrl+j", "alt+enter")


def _without_ctrl_y(bindings: list[BindingType]) -> list[BindingType]:
    """TextArea's bindings less Ctrl+Y (its redo; in the chat it copies the last answer)."""
    kept: list[BindingType] = []
    for b in bindings:
        if isinstance(b, Binding):
            keys = [k for k in b.key.split(",") if k.strip() != "ctrl+y"]
            if not keys:
                continue
            b = replace(b, key=",".join(keys))
        kept.append(b)
    return kept


class PromptBox(TextArea, inherit_bindings=False):
    """Enter sends (``Submitted``); Shift+Enter or Ctrl+J start a new line; a paste is kept
    whole, however many lines it has."""

    BINDINGS = _without_ctrl_y(list(TextArea.BINDINGS))

    @dataclass
    class Submitted(Message):
        prompt_box: PromptBox
        text: str

        @property
        def control(self) -> PromptBox:
            return self.prompt_box

    def __init__(self, placeholder: str = "", id: str | None = None) -> None:  # noqa: A002
        super().__init__(placeholder=placeholder, id=id, soft_wrap=True, show_line_numbers=False,
                         tab_behavior="focus", highlight_cursor_line=False)

    def take(self, sent: str) -> None:
        """Remove the text that was sent, keeping what was typed after Enter (keys that came
        in the same burst arrive before the screen handles ``Submitted``)."""
        if not self.text.startswith(sent):
            return  # edited before it could be taken: leave it all rather than lose any
        self.text = self.text[len(sent):]
        self.move_cursor(self.document.end)

    def on_key(self, event: events.Key) -> None:
        # Before TextArea's own key handling (which inserts a newline on Enter).
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self, self.text))
        elif event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self.replace("\n", start, end, maintain_selection_offset=False)
