"""``localspec demo``: the whole engine on a tiny model pair built on the spot (no download)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("demo", help="run the engine on a tiny built-in pair (works offline)",
                       description="Builds (once, cached) a tiny real draft/target GGUF pair, "
                                   "runs the speculative engine and the target alone on it and "
                                   "prints the statistics; on a terminal it opens the pair in "
                                   "the chat app. The tiny models' text is noise.")
    p.add_argument("--max-tokens", "-n", type=int, default=200)
    p.add_argument("--json", action="store_true", help="statistics as JSON")
    p.add_argument("--tui", action="store_true", default=None,
                   help="open the demo pair in the chat app (the default on a terminal)")
    p.add_argument("--no-tui", dest="tui", action="store_false",
                   help="print the statistics even on a terminal")
    p.set_defaults(func=run)


DEMO_PROMPT = "the draft model proposes and the target model checks"


def run(args: argparse.Namespace) -> int:
    import json

    from ..engine import DraftSettings, GenerationRequest, ModelSettings, SpeculativeEngine
    from ..loading import EngineSpec
    from ..models.tiny import build_demo_pair
    from ..paths import demo_models_dir

    target, draft = build_demo_pair(demo_models_dir())
    settings = ModelSettings(n_ctx=2048)
    with SpeculativeEngine.load(target, draft, settings, settings) as engine:
        prompt = engine.tokenize(DEMO_PROMPT, chat=False)
        results = {}
        for mode in ("none", "model"):  # warm-up: llama.cpp builds its graphs on first use
            engine.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=8,
                                              draft=DraftSettings(mode=mode)))  # type: ignore[arg-type]
        for label, mode in (("target alone", "none"), ("speculative", "model")):
            engine.target.reset()
            req = GenerationRequest(prompt_tokens=prompt, max_tokens=args.max_tokens,
                                    draft=DraftSettings(mode=mode))  # type: ignore[arg-type]
            results[label] = engine.generate(req)
    plain, spec = results["target alone"], results["speculative"]
    identical = plain.tokens == spec.tokens
    speedup = (spec.stats.tokens_per_second / plain.stats.tokens_per_second
               if plain.stats.tokens_per_second else 0.0)
    if args.json:
        json.dump({"identical": identical, "speedup": round(speedup, 3),
                   "plain": plain.stats.to_json(), "speculative": spec.stats.to_json()},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"localspec demo: a tiny random-weight pair built in {target.parent}")
    print("(the demo models are random numbers: their text is noise; the numbers are real)")
    print(f"target alone: {plain.stats.summary()}")
    print(f"speculative:  {spec.stats.summary()}")
    print(f"identical output: {'yes' if identical else 'NO'}; speedup {speedup:.2f}x")
    print("Next: `localspec pull PAIR` for real models, `localspec list` to see pairs.")
    if args.tui if args.tui is not None else sys.stdout.isatty():
        from ..tui import open_tui

        # The statistics above stay in the terminal's scrollback once the app closes.
        return int(open_tui(EngineSpec(target=str(target), draft=str(draft),
                                       target_settings=settings, draft_settings=settings,
                                       pair_name="demo")))
    return 0
