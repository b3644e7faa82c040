"""Session 57: record the hybrid's proposal rounds on real decoding contexts, once, for `replay_rounds.py`.
B mixed eval prompts decoded 128 tokens through B slots by the hybrid (Algorithm 1 without the draft gate, so every
step proposes; greedy); every full round's requests (id, tokens, tenant) pickled to OUT.
    .venv/bin/python docs/results/suffix/s57/propose/record_rounds.py OUT [B]"""

from __future__ import annotations

import pickle
import sys

from dspark.bench.decode import _engine, mixed_frame
from dspark.verify_service.request import SamplingParams

OUT = sys.argv[1]
B = int(sys.argv[2]) if len(sys.argv) > 2 else 32
target, labelled, max_len = mixed_frame(B, 128)
engine = _engine("hybrid", target, B, max_len, "greedy", 7, None, False, {})
drafter = engine.drafter
rounds: list[list[tuple[str, list[int], str]]] = []
propose = drafter.propose


def recording(requests, max_num_tokens):  # noqa: ANN001, ANN202 - the drafter's own signature
    rounds.append([(r.request_id, list(r.token_ids), r.tenant) for r in requests])
    return propose(requests, max_num_tokens)


drafter.propose = recording
engine.generate([p for _, p in labelled], SamplingParams(max_tokens=128, ignore_eos=True))
with open(OUT, "wb") as f:
    pickle.dump([r for r in rounds if len(r) == B], f)
print(f"{sum(len(r) == B for r in rounds)} rounds of {B} requests -> {OUT}")
