"""Keys and what the gauges mean."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

HELP = """\
# localspec

A small **draft** model proposes tokens; the large **target** checks them all in one pass and
keeps those it would have produced itself. The answer is the target's; it just arrives sooner.

| Key | Action |
|---|---|
| Enter | send the message |
| Shift+Enter, Ctrl+J | new line in the message (a paste keeps all its lines) |
| Esc | stop the answer being generated |
| Ctrl+R | regenerate the last answer |
| Ctrl+N | new chat |
| Ctrl+Y | copy the last answer |
| Ctrl+T | mark text accepted from the draft (green) / Markdown view |
| F2 | pick a pair to load |
| F3 | model manager: local Ollama models, pull, delete, inspect, suggest drafts |
| F4 | settings (draft mode, sampling, GPU layers, context, threads) |
| F5 | saved chats: open, rename, delete, export to Markdown |
| Ctrl+P | command palette |
| F1 | this help |
| Ctrl+Q | quit |

**Under each answer**: tokens, tokens/s, acceptance (drafted tokens the target kept), mean
accepted length per drafting round, K (tokens drafted per round), time to first token.

**Token rate**: live tokens/s and its recent history; *plain* is the rate without drafting on
this pair when it has been measured (an answer with draft mode *off*, or `localspec bench`).
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "dismiss_help", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Markdown(HELP)

    def action_dismiss_help(self) -> None:
        self.dismiss(None)
