"""Where drafted tokens come from: one module per drafter, each registered here by name.

Adding a drafter is one module with a ``Drafter`` subclass and one ``register`` line (or a
``register`` call from outside, as the tests do). Registration order is the order of the draft
modes front ends list, and the order in which auto tries the free drafters.
"""

from __future__ import annotations

from .base import (
    NO_DRAFT,
    DraftContext,
    Drafter,
    DraftMode,
    DraftSettings,
    KeepGoing,
    Pick,
    costly_default,
    create,
    draft_modes,
    get,
    names,
    register,
    unregister,
)
from .history import HistoryDrafter
from .lookup import PromptLookupDrafter
from .model import ModelDrafter
from .proposal import ROOT, Proposal, TreeRequest, chain, check_tree

register(ModelDrafter)
register(PromptLookupDrafter)
register(HistoryDrafter)

__all__ = [
    "NO_DRAFT", "ROOT", "DraftContext", "DraftMode", "DraftSettings", "Drafter", "HistoryDrafter",
    "KeepGoing", "ModelDrafter", "Pick", "PromptLookupDrafter", "Proposal", "TreeRequest",
    "chain", "check_tree", "costly_default", "create", "draft_modes", "get", "names", "register",
    "unregister",
]
