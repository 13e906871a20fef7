"""One message of the conversation. Answers render as Markdown, or with drafted text marked."""

from __future__ import annotations

from collections.abc import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Markdown, Static

from ...engine import TextChunk

DRAFTED_STYLE = "bold #7ee787 on #12261a"


class ChatMessage(Vertical):
    """A user or assistant message; an assistant message can grow while it streams."""

    def __init__(self, role: str, content: str = "",
                 spans: Iterable[tuple[int, bool]] = (), stats_line: str | None = None,
                 show_drafted: bool = False, **kwargs: object) -> None:
        super().__init__(classes=f"message {role}", **kwargs)  # type: ignore[arg-type]
        self.role = role
        self.chunks: list[TextChunk] = _chunks_from_spans(content, spans)
        self.stats_line = stats_line
        self.show_drafted = show_drafted

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def spans(self) -> list[tuple[int, bool]]:
        """(length, drafted) runs, as the chat store keeps them."""
        runs: list[tuple[int, bool]] = []
        for c in self.chunks:
            if runs and runs[-1][1] == c.drafted:
                runs[-1] = (runs[-1][0] + len(c.text), c.drafted)
            elif c.text:
                runs.append((len(c.text), c.drafted))
        return runs

    def compose(self) -> ComposeResult:
        yield Static("You" if self.role == "user" else "Assistant", classes="role")
        if self.role == "user":
            yield Static(visible(self.text), classes="body", markup=False)
        else:
            md = Markdown(visible(self.text), classes="body")
            md.display = not self.show_drafted
            yield md
            marked = Static(self._marked(), classes="body drafted-view")
            marked.display = self.show_drafted
            yield marked
        footer = Static(self.stats_line or "", classes="stats")
        footer.display = bool(self.stats_line)
        yield footer

    def _marked(self) -> Text:
        text = Text()
        for c in self.chunks:
            text.append(visible(c.text), style=DRAFTED_STYLE if c.drafted else "")
        return text

    async def append(self, chunks: Iterable[TextChunk]) -> None:
        """Add streamed text."""
        new = list(chunks)
        self.chunks.extend(new)
        if self.role == "user" or not self.is_mounted:
            return
        if self.show_drafted:
            self.query_one(".drafted-view", Static).update(self._marked())
        else:
            await self.query_one(Markdown).append(visible("".join(c.text for c in new)))

    def set_stats(self, line: str | None) -> None:
        self.stats_line = line
        footer = self.query_one(".stats", Static)
        footer.update(line or "")
        footer.display = bool(line)

    async def set_show_drafted(self, show: bool) -> None:
        if self.role == "user" or show == self.show_drafted:
            return
        self.show_drafted = show
        md = self.query_one(Markdown)
        marked = self.query_one(".drafted-view", Static)
        if show:
            marked.update(self._marked())
        else:
            await md.update(visible(self.text))
        md.display = not show
        marked.display = show


# Control characters (models emit them; tiny demo models often) would reach the terminal raw
# and make saved SVG screenshots invalid XML: show them as Unicode "control pictures".
_CONTROL_PICTURES = {i: 0x2400 + i for i in range(32) if chr(i) not in "\n\t"} | {0x7F: 0x2421}


def visible(text: str) -> str:
    """``text`` with control characters (but newline and tab) made visible and harmless."""
    return text.translate(_CONTROL_PICTURES)


def _chunks_from_spans(content: str, spans: Iterable[tuple[int, bool]]) -> list[TextChunk]:
    out: list[TextChunk] = []
    pos = 0
    for n, drafted in spans:
        out.append(TextChunk(content[pos:pos + n], drafted))
        pos += n
    if pos < len(content):
        out.append(TextChunk(content[pos:], False))
    return out
