"""The engine as a library: import boundary, the public names, and the LlamaDraftModel adapter."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

# The front ends: they may import Textual, Starlette and uvicorn; nothing else may.
FRONT_ENDS = ("localspec.tui", "localspec.cli", "localspec.server")
# Not a module to import: ``python -m localspec`` runs the CLI (and exits) when imported.
ENTRY_POINT = "localspec.__main__"
UI_PACKAGES = ("textual", "starlette", "uvicorn")


def domain_modules() -> list[str]:
    """Every module of the package but the front ends, found on disk, so a new one is covered
    without touching this test. (walk_packages imports each package to look inside it; that
    happens here, in the test process, never in the child that checks the imports.)"""
    import localspec

    def front_end(name: str) -> bool:
        return name == ENTRY_POINT or any(name == f or name.startswith(f + ".")
                                          for f in FRONT_ENDS)

    def unwalkable(name: str) -> None:
        raise ImportError(f"cannot import the package {name} to list its modules")

    names = ["localspec"] + [m.name for m in pkgutil.walk_packages(
        localspec.__path__, "localspec.", onerror=unwalkable)]
    return sorted(n for n in names if not front_end(n))


# Run in a fresh interpreter (pytest's has Textual loaded already): imports the modules one by
# one and names each that fails to import or brings in a UI package or a front end, and what.
CHECK_IMPORTS = """
import importlib, json, sys
modules, ui_packages, front_ends = json.loads(sys.argv[1])
def ui_loaded():
    return {m if m.startswith('localspec.') else m.split('.')[0] for m in sys.modules
            if m.split('.')[0] in ui_packages
            or any(m == f or m.startswith(f + '.') for f in front_ends)}
problems = {}
for name in modules:
    before = ui_loaded()
    try:
        importlib.import_module(name)
    except Exception as exc:
        problems[name] = f'fails to import: {type(exc).__name__}: {exc}'
        continue
    if ui_loaded() - before:
        problems[name] = 'imports ' + ', '.join(sorted(ui_loaded() - before))
print(json.dumps(problems, indent=1))
sys.exit(1 if problems else 0)
"""


def test_engine_imports_no_ui() -> None:
    """The engine and every domain module import without Textual, Starlette or uvicorn, and
    without the TUI or the server."""
    modules = domain_modules()
    # The walk found the domain (a broken walk must not pass by checking nothing).
    assert {"localspec.engine", "localspec.loading", "localspec.gguf_meta",
            "localspec.benchmarking", "localspec.models.library",
            "localspec.chat_store"} <= set(modules)
    args = json.dumps([modules, UI_PACKAGES, ["localspec.tui", "localspec.server"]])
    proc = subprocess.run([sys.executable, "-c", CHECK_IMPORTS, args], capture_output=True,
                          text=True, timeout=300)
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


def test_a_request_of_the_wrong_types_is_one_value_error(target_gguf: Path) -> None:
    """A library caller's slip is said plainly, before anything is decoded, not as an
    AttributeError or TypeError from deep inside."""
    import dataclasses

    import numpy as np

    import localspec
    from localspec.errors import DraftSettingsError

    with localspec.SpeculativeEngine.load(target_gguf, None,
                                          localspec.ModelSettings(n_ctx=256)) as eng:
        good = localspec.GenerationRequest(prompt_tokens=eng.tokenize("the", chat=False),
                                           max_tokens=3,
                                           draft=localspec.DraftSettings(mode="lookup"))
        slips = {
            "sampling": ({"sampling": None}, "sampling must be a SamplingParams"),
            "draft": ({"draft": {"mode": "none"}}, "draft must be a DraftSettings"),
            "stop": ({"stop": (1,)}, "stop must be a sequence of strings"),
            "text": ({"prompt_tokens": "the"}, "prompt_tokens must be a sequence of token ids"),
            "float": ({"prompt_tokens": (1.5, 2.0)}, "token ids are whole numbers, got 1.5"),
            "bool": ({"prompt_tokens": (True, True)}, "token ids are whole numbers, got True"),
        }
        for change, said in slips.values():
            with pytest.raises(ValueError, match=said):
                eng.generate(dataclasses.replace(good, **change))
        for low, high in ((0, 4), (-3, 4), (5, 4), (2, 10**6), (2, "4")):
            draft = localspec.DraftSettings(mode="lookup", lookup_ngram_min=low,
                                            lookup_ngram_max=high)  # type: ignore[arg-type]
            with pytest.raises(DraftSettingsError, match="lookup_ngram_min and lookup_n"):
                eng.generate(dataclasses.replace(good, draft=draft))
        # numpy ids, as a caller's arrays hold them, are ids like any other
        as_array = dataclasses.replace(good, prompt_tokens=np.asarray(good.prompt_tokens))
        assert eng.generate(as_array).tokens == eng.generate(good).tokens
