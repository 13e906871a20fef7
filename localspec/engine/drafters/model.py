"""Drafting with a small model that shares the target's vocabulary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ...errors import LocalspecError
from .. import activity
from .base import DraftContext, Drafter
from .proposal import Proposal

if TYPE_CHECKING:
    from ..llama_backend import LlamaRunner
    from .base import DraftSettings


class ModelDrafter(Drafter):
    """Drafts with a small model that shares the target's vocabulary. Its KV cache follows the
    accepted sequence lazily: tokens it missed (plain or lookup steps) are decoded in one batch
    the next time it drafts."""

    name = "model"
    title = "the draft model"
    prior_rate = 0.6
    costly = True
    needs_draft_model = True

    def __init__(self, runner: LlamaRunner) -> None:
        self.runner = runner

    @classmethod
    def create(cls, settings: DraftSettings, draft_model: LlamaRunner | None) -> ModelDrafter:
        if draft_model is None:  # DraftSettings.validate says so first, in the user's words
            raise LocalspecError("draft mode 'model' needs a draft model")
        return cls(draft_model)

    def behind(self, seq: Sequence[int]) -> int:
        """Tokens of ``seq`` the draft has not processed (it follows the target lazily)."""
        return len(seq) - self.runner.common_prefix(seq)

    def propose(self, ctx: DraftContext, budget: int) -> Proposal:
        """Draft up to ``budget`` tokens after ``ctx.seq``; ``ctx.pick`` turns the draft's
        logits at the j-th drafted position into (token, confidence, distribution or None)."""
        prop = Proposal(source=self.name)
        if budget <= 0:
            return prop
        pick, keep_going, seq = ctx.pick, ctx.keep_going, ctx.seq
        if pick is None:
            raise ValueError("a model drafter needs DraftContext.pick")
        t0 = time.perf_counter()
        prop.catch_up_tokens = self.behind(seq)
        activity.report("drafting", self.runner.path)
        logits = self.runner.sync(seq, 1)[0]
        history = list(seq)
        while True:
            tok, conf, dist = pick(logits, history, len(prop.tokens))
            if dist is not None:
                if prop.dists is None:
                    prop.dists = []
                prop.dists.append(dist)
            prop.tokens.append(tok)
            prop.confidences.append(conf)
            history.append(tok)
            if len(prop.tokens) >= budget or not keep_going(len(prop.tokens), prop):
                break
            t_step = time.perf_counter()
            logits = self.runner.decode([tok], 1)[0]
            prop.step_seconds.append(time.perf_counter() - t_step)
        prop.seconds = time.perf_counter() - t0
        return prop
