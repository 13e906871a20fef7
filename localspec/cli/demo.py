"""``localspec demo``: the whole engine on a tiny model pair built on the spot (no download)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..errors import LocalspecError
from ..params import DEMO_MAX_TOKENS

if TYPE_CHECKING:  # the engine (and llama_cpp) load only when a command runs
    from ..engine import SpeculativeEngine

DEMO_PROMPT = "the draft model proposes and the target model checks"
DEMO_K = 4
DEMO_PROMPT_ROOM = 128  # the chat-templated prompt (54 tokens), with room to spare
DEMO_MAX_CONTEXT = 32768  # the tiny models' cache is small, but a demo is not a soak test


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from .params import cli_type

    p = sub.add_parser("demo", help="run the engine on a tiny built-in pair (works offline)",
                       description="Builds (once, cached) a tiny real draft/target GGUF pair, "
                                   "runs the target alone, the adaptive engine and a fixed draft "
                                   "length on it and prints the statistics; on a terminal it "
                                   "opens the pair in the chat app. The tiny models' text is "
                                   "noise.")
    p.add_argument("--max-tokens", "-n", type=cli_type("max_tokens"), default=DEMO_MAX_TOKENS)
    p.add_argument("--json", action="store_true", help="statistics as JSON")
    p.add_argument("--tui", action="store_true", default=None,
                   help="open the demo pair in the chat app (the default on a terminal)")
    p.add_argument("--no-tui", dest="tui", action="store_false",
                   help="print the statistics even on a terminal")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from ..engine import DraftSettings, ModelSettings, SpeculativeEngine, repack
    from ..loading import EngineSpec
    from ..models.tiny import build_demo_pair
    from ..paths import demo_models_dir
    from ..requests import ChatOptions, build_request, prompt_tokens
    from ..tui import can_ask

    # Said before the models are built and the three runs made, not after.
    if args.json and args.tui:
        raise LocalspecError("--json prints the statistics for a program to read; it does not "
                             "open the chat app (drop --tui)")
    if args.tui and not can_ask():
        raise LocalspecError("the chat app needs a terminal (stdin and stderr on one); for "
                             "the statistics alone: localspec demo --no-tui")
    if args.max_tokens > DEMO_MAX_CONTEXT - DEMO_PROMPT_ROOM:
        raise LocalspecError(f"the demo generates at most "
                             f"{DEMO_MAX_CONTEXT - DEMO_PROMPT_ROOM} tokens, not "
                             f"{args.max_tokens}")
    target, draft = build_demo_pair(demo_models_dir())
    repack.settle_before_measuring()
    # A context that holds the prompt and every token asked for: none is cut unsaid.
    settings = ModelSettings(n_ctx=max(2048, args.max_tokens + DEMO_PROMPT_ROOM))
    modes = {"target alone": DraftSettings(mode="none"), "auto": DraftSettings(mode="model"),
             f"fixed K={DEMO_K}": DraftSettings(mode="model", k=DEMO_K)}
    with SpeculativeEngine.load(target, draft, settings, settings) as engine:
        prompt = prompt_tokens(engine, DEMO_PROMPT)
        for mode in modes.values():  # warm-up: llama.cpp builds its graphs, auto calibrates
            engine.generate(build_request(engine, prompt, ChatOptions(max_tokens=8, draft=mode)))
        results = {}
        for label, mode in modes.items():
            engine.clear_caches()
            req = build_request(engine, prompt, ChatOptions(max_tokens=args.max_tokens,
                                                            draft=mode))
            results[label] = engine.generate(req)
        costs = _costs_line(engine)
    plain = results["target alone"]
    identical = all(r.tokens == plain.tokens for r in results.values())

    def speedup(label: str) -> float:
        tps = plain.stats.tokens_per_second
        return results[label].stats.tokens_per_second / tps if tps else 0.0

    if args.json:
        json.dump({"identical": identical, "speedup": round(speedup("auto"), 3),
                   "fixed_k": DEMO_K, "fixed_k_speedup": round(speedup(f"fixed K={DEMO_K}"), 3),
                   "why": results["auto"].stats.policy, "costs": costs,
                   "plain": plain.stats.to_json(), "speculative": results["auto"].stats.to_json(),
                   "fixed": results[f"fixed K={DEMO_K}"].stats.to_json()},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"localspec demo: a tiny random-weight pair built in {target.parent}")
    print("(the demo models are random numbers: their text is noise; the numbers are real)")
    for label, res in results.items():
        extra = "" if label == "target alone" else f"  [{speedup(label):.2f}x]"
        print(f"{label + ':':<14}{res.stats.summary()}{extra}")
    print(f"identical output in all three: {'yes' if identical else 'NO'}")
    print(f"measured here: {costs}")
    print(f"why auto did what it did: {results['auto'].stats.policy}")
    print("Next: `localspec pull PAIR` for real models, `localspec list` to see pairs.")
    if args.tui if args.tui is not None else sys.stdout.isatty():
        from ..tui import open_tui

        # The statistics above stay in the terminal's scrollback once the app closes.
        return int(open_tui(EngineSpec(target=str(target), draft=str(draft),
                                       target_settings=settings, draft_settings=settings,
                                       pair_name="demo")))
    return 0


def _costs_line(engine: SpeculativeEngine) -> str:
    """What a (K+1)-token verification costs against a one-token step on this machine."""
    cal = engine.calibration
    if cal is None:
        return "costs not measured"
    t1 = cal.target_points[1]
    k = DEMO_K + 1
    tk = engine.verify_seconds(k)
    return (f"a one-token target step takes {t1 * 1000:.2f} ms, verifying {k} tokens "
            f"{tk * 1000:.2f} ms ({tk / t1:.2f} steps), a draft token "
            f"{cal.draft_token * 1000:.2f} ms")
