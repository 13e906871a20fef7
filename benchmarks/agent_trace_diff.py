"""Where an agent_trace.py run parts from the target alone, and the target's top-2 margin there.

    .venv/bin/python benchmarks/agent_trace_diff.py RESULT.json TARGET.gguf [CONFIG [REQUEST]]

RESULT.json is agent_trace.py's --json output (it keeps each text); CONFIG defaults to
history-on. The first request whose text differs is replayed with the target alone (its input
is the same in both runs: every earlier answer matched), or REQUEST, a differing request whose
input was the same too (a tool call resends no earlier answer); the margin is the target's
top-2 gap at the first differing token, from one pass over the prompt and the text before it.
A margin under the batched drift of the target's weights (0.3-0.7 logits for Q8_0/Q4_K_M on
a CPU) is a near-tie: which side wins then depends on how the KV cache was computed.
"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import agent_trace as at  # noqa: E402

from localspec.engine import (  # noqa: E402
    DraftSettings,
    GenerationRequest,
    ModelSettings,
    SpeculativeEngine,
)

d = json.loads(Path(sys.argv[1]).read_text())
config = sys.argv[3] if len(sys.argv) > 3 else "history-on"
alone = {r["name"]: r["text"] for r in d["configs"]["alone"]["per_request"]}
hist = {r["name"]: r["text"] for r in d["configs"][config]["per_request"]}
steps = at.trace()
named = sys.argv[4] if len(sys.argv) > 4 else None
first = next((s for s in steps if alone[s.name] != hist[s.name]
              and (named is None or s.name == named)), None)
print("differing:", [s.name for s in steps if alone[s.name] != hist[s.name]])
if first is None:
    sys.exit(0)
eng = SpeculativeEngine.load(sys.argv[2], None,
                             ModelSettings(n_ctx=4096, repack="off", n_gpu_layers=0))
msgs = first.build(alone)
prompt = eng.tokenize(eng.chat_prompt(msgs), chat=True)
fin = eng.generate(GenerationRequest(prompt_tokens=prompt, max_tokens=160,
                                     draft=DraftSettings(mode="none", history=False)))
print("plain matches alone text:", fin.text == alone[first.name])
a, h = alone[first.name], hist[first.name]
c = next(i for i in range(min(len(a), len(h)) + 1) if i == min(len(a), len(h)) or a[i] != h[i])
print("first differing char", c, repr(a[max(0, c-40):c+20]), "|", repr(h[max(0, c-40):c+20]))
pos, n = 0, 0
for i, t in enumerate(fin.tokens):
    piece = eng.target.piece(t).decode("utf-8", "replace")
    if pos + len(piece) > c:
        n = i
        break
    pos += len(piece)
eng.clear_caches()
logits = np.array(eng.target.sync(list(prompt) + list(fin.tokens[:n]), 1)[0])
top = np.argsort(logits)[::-1][:2]
best, second = (eng.target.piece(int(t)) for t in top)
print(f"token {n}: the target's top two, {best!r} and {second!r}, are "
      f"{float(logits[top[0]] - logits[top[1]]):.3f} logits apart (one pass over the prompt "
      "and the text before)")
