"""The engine as a library: import boundary, the public names, and the LlamaDraftModel adapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_engine_imports_no_ui() -> None:
    code = ("import sys, localspec.engine, localspec.loading, localspec.engine.gguf_meta, "
            "localspec.benchmarking; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('textual', 'starlette', 'uvicorn') or m.startswith('localspec.tui') or "
            "m.startswith('localspec.server')]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cli_help_does_not_load_llama_cpp() -> None:
    code = ("import sys; from localspec.cli import build_parser; build_parser(); "
            "sys.exit(1 if 'llama_cpp' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_top_level_names(target_gguf: Path, draft_gguf: Path) -> None:
    import localspec

    with localspec.SpeculativeEngine.load(target_gguf, draft_gguf,
                                          localspec.ModelSettings(n_ctx=256)) as eng:
        req = localspec.GenerationRequest(prompt_tokens=eng.tokenize("the", chat=False),
                                          max_tokens=5)
        assert len(eng.generate(req).tokens) == 5


def test_llama_draft_model_adapter_keeps_output(target_gguf: Path, draft_gguf: Path) -> None:
    from llama_cpp import Llama

    from localspec import LlamaDraftModel

    plain = Llama(model_path=str(target_gguf), n_ctx=256, verbose=False)
    prompt = plain.tokenize(b"the model and the draft")
    expected = plain.create_completion(prompt, max_tokens=40, temperature=0.0)["choices"][0]
    plain.close()
    drafter = LlamaDraftModel(draft_gguf, num_pred_tokens=4)
    spec = Llama(model_path=str(target_gguf), n_ctx=256, verbose=False, logits_all=True,
                 draft_model=drafter)
    got = spec.create_completion(prompt, max_tokens=40, temperature=0.0)["choices"][0]
    spec.close()
    assert got["text"] == expected["text"]
    assert len(drafter(__import__("numpy").array(prompt, dtype="intc"))) == 4
    drafter.close()
