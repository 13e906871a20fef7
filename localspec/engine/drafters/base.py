"""The protocol every drafter implements, the registry of drafters by name, and the settings
that choose among them (``DraftSettings``).

A drafter is one module: a ``Drafter`` subclass, registered once (``drafters/__init__.py`` for
the built-in ones, ``register`` for any other). The draft modes every front end offers, the
controller's acceptance models and the per-drafter statistics all come from this registry.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

from ... import params
from ...errors import DraftSettingsError, LocalspecError
from .proposal import Proposal, TreeRequest

if TYPE_CHECKING:
    import numpy as np

    from ..history_store import HistoryStore
    from ..llama_backend import LlamaRunner
    from ..sampling import Candidates

# A request's draft mode: a registered drafter's name, or NO_DRAFT.
DraftMode = str
NO_DRAFT = "none"

# keep_going(j, proposal) -> whether to draft token j+1 after j tokens drafted.
KeepGoing = Callable[[int, Proposal], bool]
# pick(logits, history, j) -> (token, confidence, the distribution it was drawn from or None).
Pick = Callable[["np.ndarray", list[int], int], tuple[int, float, "Candidates | None"]]


def _always(j: int, proposal: Proposal) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class DraftContext:
    """What a drafter may draft from, one step: the accepted tokens (prompt and output so
    far) and, for a drafter that samples a model, how the request's rule picks a token and
    auto's test of whether one more drafted token pays."""

    seq: Sequence[int]
    pick: Pick | None = None
    keep_going: KeepGoing = _always
    # The engine's index of earlier requests, where it keeps one and the request allows it.
    history: HistoryStore | None = None


class Drafter(abc.ABC):
    """Proposes tokens for the target to verify. One instance serves one request.

    ``costly``: its tokens cost model decodes, so the controller prices them, paces them with
    ``keep_going`` and peeks at it while auto decodes plainly; a free drafter's proposal is
    verified where its own acceptance predicts more than the costly drafter's. A request has at
    most one costly drafter: its draft mode's; under auto it tries every free one first."""

    name: ClassVar[str]
    # How the policy explains a request drafting with it ("auto with prompt lookup ...").
    title: ClassVar[str] = ""
    # The acceptance believed before any outcome (the controller's prior for its tokens).
    prior_rate: ClassVar[float] = 0.5
    costly: ClassVar[bool] = False
    needs_draft_model: ClassVar[bool] = False
    # Drafts from ``DraftContext.history``: left out where the engine keeps none or the request
    # turns it off (DraftSettings.history).
    needs_history: ClassVar[bool] = False
    # Under auto, tried beside whatever the draft mode's drafter is, free or costly (a free
    # drafter otherwise joins only a costly one): it sees what the mode's drafter cannot.
    companion: ClassVar[bool] = False
    # A free drafter whose confidences rank its tokens' odds (not just its own name's): the
    # controller prices each token by its confidence bin instead of one rate for every token.
    calibrated: ClassVar[bool] = False

    @classmethod
    def create(cls, settings: DraftSettings, draft_model: LlamaRunner | None) -> Drafter:
        """This drafter for one request (``draft_model``: the engine's, when it has one)."""
        return cls()

    @abc.abstractmethod
    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        """At most ``budget`` tokens to continue ``ctx.seq`` (none: a plain step)."""

    def propose_tree(self, ctx: DraftContext, request: TreeRequest) -> Proposal:
        """A token tree within ``request`` (the planner's). A drafter of chains keeps this
        default: its chain, as long as the tree may be deep, is the width-1 tree."""
        return self.propose(ctx, request.depth)

    def observe(self, proposal: Proposal, n_accepted: int) -> None:
        """The target accepted the first ``n_accepted`` tokens of ``proposal`` (a drafter that
        learns from outcomes overrides this)."""
        return None

    def behind(self, seq: Sequence[int]) -> int:
        """Tokens of ``seq`` this drafter must take in before it can draft (a costly drafter's
        catching up, weighed before peeking at it)."""
        return 0


D = TypeVar("D", bound=type[Drafter])
_registry: dict[str, type[Drafter]] = {}


def register(cls: D) -> D:
    """Make a drafter available by its name (usable as a class decorator)."""
    name = getattr(cls, "name", "")
    if not name or name == NO_DRAFT or name in _registry:
        raise ValueError(f"cannot register a drafter named {name!r}: taken or reserved")
    _registry[name] = cls
    _publish()
    return cls


def unregister(name: str) -> None:
    _registry.pop(name, None)
    _publish()


def _publish() -> None:
    # The parameters (a leaf below the engine) cannot ask this registry, so it tells them: the
    # CLI, config.toml, the chat app and the server offer and check the modes as they are now.
    params.set_choices("draft_mode", draft_modes())


def names() -> tuple[str, ...]:
    """Registered drafters, in registration order."""
    return tuple(_registry)


def draft_modes() -> tuple[DraftMode, ...]:
    """Every draft mode: a registered drafter's name, or plain decoding."""
    return (*_registry, NO_DRAFT)


def get(name: str) -> type[Drafter]:
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(f"no drafter named {name!r} (registered: "
                         f"{', '.join(_registry)})") from None


def create(name: str, settings: DraftSettings, draft_model: LlamaRunner | None) -> Drafter:
    return get(name).create(settings, draft_model)


def costly_default() -> str | None:
    """The first registered costly drafter: whose acceptance a controller prices by default."""
    return next((n for n, cls in _registry.items() if cls.costly), None)


RuleSetting = Literal["auto", "coupled", "rejection", "match"]


# Prompt lookup's longest n-gram: its index grows with the n-grams it keeps per position, and
# a match longer than this says no more about what follows.
LOOKUP_NGRAM_LIMIT = 32


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """How to draft. ``mode``: a registered drafter's name, or ``none``.
    ``k=None`` is adaptive; an int is a fixed draft length.

    ``rule`` applies to sampled requests: ``coupled`` (the default through ``auto``) makes the
    text a function of the seed alone, whatever is drafted. ``exact``: auto drafting only where
    batched logits do not drift (see ``decoder.EXACT_DRIFT_LIMIT``). ``tree``: under auto,
    greedy and coupled requests draft a token tree where the measured costs make one pay more
    than a chain (``tree_planner``); off, always a chain."""

    mode: DraftMode = "model"
    k: int | None = None
    k_max: int = 12
    rule: RuleSetting = "auto"
    exact: bool = False
    lookup_ngram_max: int = 4
    lookup_ngram_min: int = 2
    tree: bool = True
    # Draft from the engine's history of earlier requests, and add this one to it.
    history: bool = True

    def validate(self, has_draft_model: bool) -> None:
        params.check("draft_mode", self.mode)  # the registry's modes now (see _publish)
        params.check("k", self.k)
        params.check("k_max", self.k_max)
        params.check("accept_rule", self.rule)
        params.check("exact", self.exact)
        if not isinstance(self.tree, bool):
            raise LocalspecError(f"tree must be true or false, got {self.tree!r}")
        if not isinstance(self.history, bool):
            raise LocalspecError(f"history must be true or false, got {self.history!r}")
        low, high = self.lookup_ngram_min, self.lookup_ngram_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (low, high)) \
                or not 1 <= low <= high <= LOOKUP_NGRAM_LIMIT:
            raise DraftSettingsError(
                f"lookup_ngram_min and lookup_ngram_max must be whole numbers with 1 <= min "
                f"<= max <= {LOOKUP_NGRAM_LIMIT}, got {low!r} and {high!r}")
        if self.mode != NO_DRAFT and get(self.mode).needs_history and not self.history:
            raise DraftSettingsError(f"draft mode {self.mode!r} drafts from the history, which "
                                     "this request turns off (--history off)")
        if self.mode != NO_DRAFT and get(self.mode).needs_draft_model and not has_draft_model:
            raise DraftSettingsError(
                f"draft mode {self.mode!r} needs a draft model (or use --draft-mode lookup)")
