"""The agent trace's acceptance priced by several cost curves: what drafting from history gives
on machines this one is not, and the most any drafting from history could give here.

    .venv/bin/python benchmarks/trace_model.py --target T.gguf [--draft D.gguf] --json OUT.json
    .venv/bin/python benchmarks/trace_model.py --from OUT.json [--json OUT2.json]   # re-price
    .venv/bin/python benchmarks/trace_model.py --target T.gguf --draft D.gguf --steps   # + steps
    .venv/bin/python benchmarks/trace_model.py --target T.gguf --draft D.gguf --stated AMX.json

Which tokens a draft gets right is a property of the pair and the texts, not of the machine;
what a target pass of n tokens costs is the machine's. So this records the trace of
``agent_trace.py`` once, in process (greedy, the history drafter on, a fresh in-memory index,
the same requests in the same order), keeping every request's prompt and output tokens, the
engine's target passes by width, and its seconds inside each model's ``llama_decode``. Then
it prices three ways of drafting the same texts with each cost curve (verification of n tokens
as a multiple of a one-token pass):

* ``engine``: the passes the engine made in the recording (chosen for *this* machine's curve,
  so on another curve a lower estimate of what the engine would do there);
* ``policy``: at every step, the free drafters' proposals (history, prompt lookup) with their
  own confidences read as acceptance probabilities, the length that maximises expected tokens
  per pass cost, or a plain step where none beats 1 (a calibrated planner, without near-ties);
* ``bound``: the fewest passes any chain drafted from history and prompt lookup could take,
  knowing where every proposal stops matching (dynamic programming over positions): an upper
  bound for those two drafters' chains (a draft model can add where its guesses beat them, and
  a tree of their several continuations where a wide pass costs little more than a narrow one).

Curves: ``here`` (the recording's calibration: this pair's, measured or cached on this
machine), ``amx-q4_k_m`` and ``amx-f16`` (issue #27's table, measured on a 2-core AMX machine
with this pair), and ``gpu``/``offload`` (``tree_budget.py``'s stated shapes).

Speedups are decode-only (tokens after the first over the passes' cost) and for the whole trace
with prefill (the uncached prompt tokens priced as passes of their width up to the curve's
widest, the same on both sides: a curve that stops at 16 prices a long prompt dearer than
llama.cpp's 512-token batches), against the target alone decoding one token a pass. History
and prompt lookup cost nothing to draft. The draft model (``engine`` only) is priced by the
tokens it drafted, at the draft-to-target cost ratio this run measured, on every curve; its
prompt prefill and its catch-up on tokens other drafters got accepted are not priced, so on a
target where the draft model drafts (F16 here) ``engine`` is optimistic. The warm-up request is
in the index the other requests see, as in the engine.

``--stated REC.json`` has the engine decide with another machine's recorded costs instead of
this one's (fixed for the trace, after the warm-up): which passes it would choose there, so
``here`` then prices an estimate of that machine's run, made on this one. ``--stated
amx-q4_k_m`` (or any curve named below) states that curve's shape at this machine's one-token
cost.

``--steps`` also logs the engine's every step (which drafter, how many tokens it verified, how
many were accepted) and sorts them against what the free drafters' proposals matched at the same
position: where the engine's passes went, beside the bound's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np

Curve = dict[int, float]
# Issue #27's table (2-core AMX machine, this pair, 200-token prefix, repacking off).
AMX_Q4 = {1: 1.0, 4: 2.47, 8: 2.92, 16: 3.13, 32: 4.60, 64: 8.0}
AMX_F16 = {1: 1.0, 4: 1.30, 8: 1.72, 16: 2.47, 32: 3.95, 64: 7.43}
MAX_DRAFT = 63  # a copy's longest draft: the engine's widest pass is 64


def named_curves() -> dict[str, Curve]:
    """The curves every recording is priced on (and ``--stated`` may name): the AMX ones, and
    tree_budget.py's stated shapes (assumptions until a GPU run measures them), the same
    curves the tree budgets are priced with."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tree_budget import GPU, OFFLOAD

    return {"amx-q4_k_m": AMX_Q4, "amx-f16": AMX_F16, "gpu": GPU, "offload": OFFLOAD}


def pass_cost(curve: Curve, n: int) -> float:
    """A pass over ``n`` tokens, in one-token passes: linear between measured widths, and past
    the widest in passes of the widest (as a long prompt is prefilled in batches)."""
    widths = sorted(curve)
    base = curve[1]
    top = widths[-1]
    if n > top:
        full, rest = divmod(n, top)
        return full * curve[top] / base + (pass_cost(curve, rest) if rest else 0.0)
    return float(np.interp(n, widths, [curve[w] for w in widths])) / base


def matched(tokens: Sequence[int], out: Sequence[int], p: int) -> int:
    """How many of ``tokens`` the target's text continues with from position ``p``."""
    n = 0
    while n < len(tokens) and p + n < len(out) and tokens[n] == out[p + n]:
        n += 1
    return n


Candidate = tuple[list[int], list[float]]  # a proposal's tokens and confidences


def bound_passes(cands: Sequence[Sequence[Candidate]], out: Sequence[int],
                 cost: Callable[[int], float]) -> float:
    """The fewest passes' cost to write ``out[1:]`` (``out[0]`` comes with the prefill) when
    each step may verify any prefix of a candidate at that position, knowing how far each
    matches. ``cands[p - 1]``: the candidates at position p."""
    n = len(out)
    best = [float("inf")] * (n + 1)
    best[1] = 0.0
    for p in range(1, n):
        if best[p] == float("inf"):
            continue
        best[p + 1] = min(best[p + 1], best[p] + 1.0)
        for tokens, _ in cands[p - 1]:
            # Any matching prefix, not only the whole match: stopping short can land where
            # another proposal starts, or on a cheaper width.
            for b in range(1, matched(tokens, out, p) + 1):
                q = min(n, p + b + 1)
                best[q] = min(best[q], best[p] + cost(b + 1))
    return best[n]


def policy_passes(cands: Sequence[Sequence[Candidate]], out: Sequence[int],
                  cost: Callable[[int], float]) -> float:
    """The passes' cost of a planner that reads each proposal's confidences as the chance the
    target accepts each token (given the ones before) and verifies the prefix that maximises
    expected tokens per cost, where that beats a plain step's 1."""
    n = len(out)
    p, total = 1, 0.0
    while p < n:
        best_rate, best = 1.0, None
        for tokens, confs in cands[p - 1]:
            expected, survive = 1.0, 1.0
            for length in range(1, min(len(tokens), n - p) + 1):
                survive *= confs[length - 1]
                expected += survive
                rate = expected / cost(length + 1)
                if rate > best_rate:
                    best_rate, best = rate, (tokens, length)
        if best is None:
            total += 1.0
            p += 1
            continue
        tokens, length = best
        total += cost(length + 1)
        p += min(length, matched(tokens, out, p)) + 1
    return total


# -- the recording ---------------------------------------------------------------------------
Step = tuple[str, int, int]  # the drafter ("plain" for none), tokens verified, tokens accepted


@contextmanager
def logged_steps(log: list[list[Step]]) -> Iterator[None]:
    """Every step the engine's controllers learn from, one list per request (a controller
    is made per request), for as long as this is entered. A probe of this script only: the
    engine keeps no per-step record, and timing it would cost every user a step's bookkeeping."""
    from localspec.engine.controller import DraftController

    saved = {name: getattr(DraftController, name)
             for name in ("__init__", "observe", "observe_plain_step", "observe_tree")}

    def init(self: Any, *a: Any, **k: Any) -> None:
        saved["__init__"](self, *a, **k)
        log.append([])

    def observe(self: Any, prop: Any, n_verified: int, n_accepted: int,
                tied: bool = False) -> None:
        log[-1].append((prop.source, len(prop.tokens), n_accepted))
        saved["observe"](self, prop, n_verified, n_accepted, tied)

    def plain(self: Any, tied: bool | None = None, token: int | None = None) -> None:
        log[-1].append(("plain", 0, 0))
        saved["observe_plain_step"](self, tied, token)

    def tree(self: Any, prop: Any, path: Sequence[int], choices: Sequence[Any]) -> None:
        log[-1].append((prop.source + " tree", len(prop.tokens), len(path)))
        saved["observe_tree"](self, prop, path, choices)

    for name, fn in (("__init__", init), ("observe", observe),
                     ("observe_plain_step", plain), ("observe_tree", tree)):
        setattr(DraftController, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(DraftController, name, fn)


def step_report(rec: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The recording's steps by kind, with their count and their passes' cost on its own
    curve: plain steps with or without a free proposal that matched; free drafts rejected at
    once, taken whole where the copy went further, cut short by another proposal, or right;
    the draft model's, with or without a free proposal that matched further."""
    curve = {int(k): v for k, v in rec["here"].items()}
    cands = candidates(rec["requests"], rec.get("warmup"))
    kinds: Counter[str] = Counter()
    spent: dict[str, float] = {}
    for cs, r in zip(cands, rec["requests"], strict=True):
        out, p = r["output"], 1
        for source, drafted, accepted in r["steps"]:
            if p >= len(out):
                break
            best = max((matched(t, out, p) for t, _ in cs[p - 1]), default=0)
            if source == "plain":
                kind = "plain, a free proposal matched" if best else "plain, nothing matched"
            elif source == "model":
                kind = "model, a free proposal matched further" if best > accepted else "model"
            elif accepted == 0:
                kind = f"{source}, rejected at once"
            elif accepted == drafted and best > drafted:
                kind = f"{source}, all accepted, the copy went further"
            elif accepted < best:
                kind = f"{source}, cut short where another proposal went further"
            else:
                kind = f"{source}, as far as any proposal matched"
            kinds[kind] += 1
            spent[kind] = spent.get(kind, 0.0) + pass_cost(curve, drafted + 1)
            p += accepted + 1
    return {k: {"steps": kinds[k], "passes": round(spent[k], 1)} for k in sorted(kinds)}


def record(args: argparse.Namespace) -> dict[str, Any]:
    """The trace, in process: per request its prompt and output tokens, the engine's target
    passes by width and the uncached prompt tokens; and this run's measured cost curve."""
    sys.path.insert(0, str(Path(__file__).parent))
    import agent_trace

    from localspec.engine import ModelSettings, SamplingParams
    from localspec.engine.decoder import GenerationRequest, SpeculativeEngine
    from localspec.engine.drafters import DraftSettings
    from localspec.engine.history_store import HistoryStore

    settings = ModelSettings(n_ctx=args.ctx, repack=args.repack)
    engine = SpeculativeEngine.load(args.target, args.draft, settings,
                                    history=HistoryStore.in_memory())
    mode = "model" if args.draft else "lookup"

    def run(messages: list[dict[str, str]]) -> tuple[list[int], Any, Any]:
        prompt = engine.tokenize(engine.chat_prompt(messages), chat=True)
        req = GenerationRequest(prompt_tokens=prompt, max_tokens=args.max_tokens,
                                sampling=SamplingParams(temperature=0.0),
                                draft=DraftSettings(mode=mode, history=True))
        return list(prompt), engine.generate(req), req

    steps: list[list[Step]] = []
    with engine, (logged_steps(steps) if args.steps else nullcontext()):
        # The first-use calibration, as agent_trace.py does; its answer is in the index too.
        warm_prompt, warm, _ = run(agent_trace._WARMUP)
        if args.stated:
            _state_costs(engine, args.stated)
        answers: dict[str, str] = {}
        requests = []
        t0 = time.perf_counter()
        for step in agent_trace.trace():
            before = _decode_seconds(engine)
            prompt, fin, _ = run(step.build(answers))
            target_s, draft_s = (b - a for a, b in zip(before, _decode_seconds(engine),
                                                         strict=True))
            answers[step.name] = fin.text
            s = fin.stats
            requests.append({"name": step.name, "prompt": prompt, "output": list(fin.tokens),
                             "uncached_prompt": s.prompt_tokens - s.prompt_cached_tokens,
                             "draft_model_tokens": s.draft_model_tokens,
                             "passes": {str(k): c for k, c in sorted(s.k_counts.items())},
                             "seconds": s.total_seconds,
                             # Where the seconds went: inside each model's llama_decode (the
                             # draft's catching up and prompt included), the rest host work.
                             "target_decode_seconds": round(target_s, 3),
                             "draft_decode_seconds": round(draft_s, 3)})
            print(f"{step.name}: {len(fin.tokens)} tokens, {s.target_passes} passes, "
                  f"{s.total_seconds:.1f} s", file=sys.stderr, flush=True)
        if args.steps:
            for r, logged in zip(requests, steps[1:], strict=True):  # the warm-up's first
                r["steps"] = logged
        cal = engine.calibration
        here = {int(k): float(v) for k, v in (cal.target_points.items() if cal else [])}
        draft_ratio = cal.draft_token / here[1] if cal and here.get(1) else 0.0
    return {"target": str(args.target), "draft": str(args.draft) if args.draft else None,
            "draft_ratio": round(draft_ratio, 4), "max_tokens": args.max_tokens,
            "stated": args.stated,
            "seconds": round(time.perf_counter() - t0, 1),
            "here": {str(k): v for k, v in sorted(here.items())}, "requests": requests,
            "warmup": {"prompt": warm_prompt, "output": list(warm.tokens)}}


def _state_costs(engine: Any, source: str) -> None:
    """Decide the rest of the trace with another machine's costs, fixed: as recorded there
    (its target curve and draft-to-target ratio), or a named curve's shape at this machine's
    one-token cost and draft ratio. The drift stays this machine's (the kernels that drift
    are this machine's). The passes, priced on that curve, estimate that machine."""
    from localspec.engine.calibration import Calibration

    cal = engine.calibration
    assert cal is not None, "the warm-up calibrates"
    t1, ratio = cal.target_points[1], cal.draft_token / cal.target_points[1]
    named = named_curves()
    if source in named:
        points = {n: t1 * c for n, c in named[source].items()}
    else:
        rec = json.loads(Path(source).read_text())["recording"]
        points = {int(k): float(v) for k, v in rec["here"].items()}
        ratio = rec["draft_ratio"]
    engine.use_calibration(Calibration(points, ratio * points[1], cal.drift), learn=False)


def _decode_seconds(engine: Any) -> tuple[float, float]:
    """Seconds each model has spent inside llama_decode so far (the draft's 0 without one)."""
    draft = engine.draft
    return engine.target.decode_seconds, draft.decode_seconds if draft is not None else 0.0


def candidates(requests: Sequence[dict[str, Any]],
               warmup: dict[str, Any] | None = None) -> list[list[list[Candidate]]]:
    """Per request and position, what history and prompt lookup would propose there, with the
    history index holding the requests before it (as the engine's did, the warm-up first)."""
    from localspec.engine.drafters import DraftContext, HistoryDrafter, PromptLookupDrafter
    from localspec.engine.history_store import HistoryStore

    store = HistoryStore.in_memory()
    if warmup:
        store.record(warmup["prompt"], warmup["output"])
    out: list[list[list[Candidate]]] = []
    for r in requests:
        prompt, text = r["prompt"], r["output"]
        # One of each per request, as in the engine (history's remembers where a copy parted).
        history, lookup = HistoryDrafter(), PromptLookupDrafter()
        per: list[list[Candidate]] = []
        for p in range(1, len(text)):
            ctx = DraftContext(seq=prompt + text[:p], history=store)
            cands = []
            for drafter in (history, lookup):
                prop = drafter.propose(ctx, MAX_DRAFT)
                if prop.tokens:
                    cands.append((list(prop.tokens), list(prop.confidences)))
            per.append(cands)
        out.append(per)
        store.record(prompt, text)
    return out


def price(rec: dict[str, Any], curves: dict[str, Curve]) -> dict[str, Any]:
    cands = candidates(rec["requests"], rec.get("warmup"))
    alone = sum(len(r["output"]) - 1 for r in rec["requests"])
    drafting = rec.get("draft_ratio", 0.0) * sum(r.get("draft_model_tokens", 0)
                                                 for r in rec["requests"])
    table: dict[str, Any] = {}
    for name, curve in curves.items():
        def cost(n: int, c: Curve = curve) -> float:
            return pass_cost(c, n)
        prefill = sum(cost(r["uncached_prompt"]) for r in rec["requests"]
                      if r["uncached_prompt"] > 0)
        ways = {
            "engine": drafting + sum(cost(int(k) + 1) * c for r in rec["requests"]
                                     for k, c in r["passes"].items()),
            "policy": sum(policy_passes(cs, r["output"], cost)
                          for cs, r in zip(cands, rec["requests"], strict=True)),
            "bound": sum(bound_passes(cs, r["output"], cost)
                         for cs, r in zip(cands, rec["requests"], strict=True)),
        }
        table[name] = {way: {"passes": round(p, 1), "decode_speedup": round(alone / p, 3),
                             "trace_speedup": round((alone + prefill) / (p + prefill), 3)}
                       for way, p in ways.items()}
        table[name]["alone_passes"] = alone
        table[name]["prefill_passes"] = round(prefill, 1)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target .gguf (records the trace)")
    ap.add_argument("--draft", help="draft .gguf (optional: history and lookup need none)")
    ap.add_argument("--from", dest="source", help="a recording (this script's --json) to "
                    "price again instead of recording")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repack", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--json", help="write the recording and the prices here")
    ap.add_argument("--stated", help="a recording from another machine, or a curve "
                    f"({', '.join(named_curves())}): decide with its costs (fixed), so its curve "
                    "prices what the engine would do there")
    ap.add_argument("--steps", action="store_true",
                    help="log the engine's steps and sort them against the free proposals")
    args = ap.parse_args(argv)
    if args.source:
        try:
            rec = json.loads(Path(args.source).read_text())["recording"]
            if not isinstance(rec.get("here"), dict) or not isinstance(rec.get("requests"), list):
                raise ValueError("not a trace_model.py recording")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            print(f"trace_model.py: cannot read {args.source}: {exc}", file=sys.stderr)
            return 2
    elif args.target:
        rec = record(args)
    else:
        ap.error("give --target (record) or --from (price a recording)")
    curves = named_curves()
    here = {int(k): float(v) for k, v in rec["here"].items()}
    if 1 in here:
        curves = {"here": here, **curves}
    table = price(rec, curves)
    reqs = rec["requests"]
    if reqs and "target_decode_seconds" in reqs[0]:  # recordings before 2026-12-06 lack it
        total = sum(r["seconds"] for r in reqs)
        target = sum(r["target_decode_seconds"] for r in reqs)
        draft = sum(r["draft_decode_seconds"] for r in reqs)
        print(f"recorded {total:.1f} s: target decoding {target:.1f} s, draft decoding "
              f"{draft:.1f} s, the rest {total - target - draft:.1f} s")
    print(f"{'curve':<12} {'engine':>14} {'policy':>14} {'bound':>14}   (decode / with prefill)")
    for name, row in table.items():
        cells = [f"{row[w]['decode_speedup']:.2f}x/{row[w]['trace_speedup']:.2f}x"
                 for w in ("engine", "policy", "bound")]
        print(f"{name:<12} {cells[0]:>14} {cells[1]:>14} {cells[2]:>14}")
    report = None
    if reqs and "steps" in reqs[0]:
        report = step_report(rec)
        print(f"{'steps on this curve':<58} {'steps':>6} {'passes':>8}")
        for kind, row in report.items():
            print(f"{kind:<58} {row['steps']:>6} {row['passes']:>8.1f}")
    if args.json:
        from localspec.files import atomic_write

        atomic_write(Path(args.json), json.dumps({"prices": table, "steps": report,
                                                  "recording": rec}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
