"""``LlamaDraftModel``: a GGUF draft model for plain llama-cpp-python's ``Llama(draft_model=...)``.

llama-cpp-python ships only prompt-lookup drafting. This adapter lets its users pass a real draft
model; it keeps the draft's KV cache in step with the sequence it is shown, so each call decodes
only the new tokens. Note llama-cpp-python 0.3.36 needs ``logits_all=True`` on the target when a
draft model is used (see the README), which localspec's own engine avoids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from llama_cpp.llama_speculative import LlamaDraftModel as _Base

from ..gguf_meta import read_gguf_info
from .llama_backend import LlamaRunner, ModelSettings


class LlamaDraftModel(_Base):
    """Greedy drafts of ``num_pred_tokens`` tokens from a small GGUF model."""

    def __init__(self, model_path: str | Path, num_pred_tokens: int = 5,
                 settings: ModelSettings = ModelSettings()) -> None:
        read_gguf_info(model_path)  # a clear error instead of a llama.cpp abort
        self.num_pred_tokens = num_pred_tokens
        self.runner = LlamaRunner(model_path, settings)

    def __call__(self, input_ids: npt.NDArray[np.intc], /, **kwargs: Any) -> npt.NDArray[np.intc]:
        seq = [int(t) for t in input_ids]
        if not seq:
            return np.array([], dtype=np.intc)
        room = self.runner.n_ctx - len(seq)
        out: list[int] = []
        logits = self.runner.sync(seq, 1)[0]
        for _ in range(max(0, min(self.num_pred_tokens, room - 1))):
            tok = int(np.argmax(logits))
            out.append(tok)
            if len(out) == self.num_pred_tokens:
                break
            logits = self.runner.decode([tok], 1)[0]
        return np.array(out, dtype=np.intc)

    def close(self) -> None:
        self.runner.close()
