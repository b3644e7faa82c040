"""Session 58: how far better survival estimates could carry the hybrid at batch 1, 4 and 8 with today's drafts, by
simulation on recorded proposals (no timing noise: a decoding's time is the shipped SPS profile's step time).

Recorded (T = 0, N mixed eval prompts, evaluation only): the target's greedy continuation of 128 tokens (target-only
engine), and at EVERY output position p the suffix drafter's chosen proposal (γ = 7, the request and corpus sources,
the shipped calibration frozen, no served text), its conditional survivals, both sources' walks, and how many of its
tokens the greedy text accepts; plus the target's confidence (its largest probability, teacher-forced) on the row the
round's last committed token came from.

Simulated: B slots decoding all prompts (refilled in order); each step every slot's proposal at its position, lengths
from Algorithm 1 (`GreedyEarlyStop`, or `GlobalSearch` with --global: lossless here, the drafts are deterministic)
on the SPS profile the engine loads, emitted = min(length, accepted) + 1; a step costs the profile's time at its rows
plus 0.2 ms a slot past the first (attention over each slot's cache) plus 0.5 ms when it drafted (the proposal,
`s57/b8/step_split.json`). Speedup = target-only time (one row a slot a step) / the variant's. Variants of the survival
curve the scheduler reads:
- shipped: the drafter's own (Π c_k);
- hindsight: 1 where the token is accepted, else 0 (a perfect predictor: the bound for these drafts);
- recal / hist / agree / pmax / pmax_agree: the shipped survival recalibrated per (position, shipped-survival tenth,
  feature bin) on half the prompts and simulated on the other half (both halves, summed; 8 pseudo-trials of shrinkage
  toward the shipped value), the feature being none / the request's first-token hit rate over its last 4 rounds /
  whether the other source's walk agrees through position k / the target's confidence (<0.5, <0.8, <0.95, ≥0.95) /
  both of the last two.
Per batch and variant: speedup, tokens verified a step, the share of them accepted; at batch 1 also the Brier score of
the survival against the outcome on the evaluated halves. One JSON line.
    .venv/bin/python docs/results/suffix/s58/sched_sim/sched_sim.py [N] [--global] > sched_sim.json"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from dspark.bench.decode import BASE, _engine, mixed_frame
from dspark.kernels.machine import cpu_signature
from dspark.models.drafters.base import DraftRequest
from dspark.models.drafters.suffix.drafter import DEFAULT_SUFFIX_DIR, SuffixDrafter
from dspark.models.target.profiles import load_sps
from dspark.spec.schedulers import GlobalSearch, GreedyEarlyStop
from dspark.verify_service.request import SamplingParams

args = [a for a in sys.argv[1:] if not a.startswith("--")]
N = int(args[0]) if args else 160
SCHED = GlobalSearch if "--global" in sys.argv else GreedyEarlyStop
NEW, GAMMA, DRAFT_MS, SLOT_MS, SHRINK, HIST = 128, 7, 0.5, 0.2, 8.0, 4
VARIANTS = ("shipped", "hindsight", "recal", "hist", "agree", "pmax", "pmax_agree")

target, labelled, max_len = mixed_frame(N, NEW)
sps = load_sps(None, target)
engine = _engine(BASE, target, 8, max_len, "greedy", 0, None, False, {})
greedy = [o.output_ids for o in engine.generate([p for _, p in labelled],
                                                 SamplingParams(max_tokens=NEW, ignore_eos=True))]
drafter = SuffixDrafter.from_pretrained(DEFAULT_SUFFIX_DIR, sources=["request", "corpus"], live_calibration=False,
                                        live_bias_rate=0.0)


def accepted(walk: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(walk) and n < len(truth) and walk[n] == truth[n]:
        n += 1
    return n


records = []  # per prompt: per position the round's record (None: nothing to draft)
with torch.inference_mode():
    for i, ((_, prompt), out) in enumerate(zip(labelled, greedy)):
        logits = target.model(torch.tensor([prompt + out])).logits[0].float()
        conf = torch.softmax(logits, -1).max(-1).values.tolist()
        per: list[dict | None] = []
        for p in range(len(out)):
            k = min(GAMMA, len(out) - 1 - p)
            best = drafter.choose_batch([DraftRequest(f"r{i}", prompt + out[:p], 0.0)], k)[0] if k > 0 else None
            if best is None:
                per.append(None)
                continue
            truth = out[p:p + k]
            walks = [drafter._batch.walk(0, s).tokens for s in (0, 1)]
            per.append({"tokens": best.walk.tokens, "surv": np.cumprod(best.conditional).tolist(),
                        "acc": accepted(best.walk.tokens, truth), "walks": walks,
                        "conf": conf[len(prompt) + p - 2]})
        drafter.release(f"r{i}")
        records.append(per)


def agree(e: dict, k: int) -> int:
    """1 if the other source's walk has the chosen walk's first k + 1 tokens, 0 if not, 2 if it has none."""
    for walk in e["walks"]:
        if walk and walk != e["tokens"]:
            return int(walk[:k + 1] == e["tokens"][:k + 1])
    return 2


def feature(kind: str, e: dict, hist: list[float], k: int) -> int:
    conf = 0 if e["conf"] < 0.5 else 1 if e["conf"] < 0.8 else 2 if e["conf"] < 0.95 else 3
    return {"recal": lambda: 0,
            "hist": lambda: 0 if not hist else 1 + min(3, int(4 * sum(hist[-HIST:]) / len(hist[-HIST:]))),
            "agree": lambda: agree(e, k), "pmax": lambda: conf, "pmax_agree": lambda: 3 * conf + agree(e, k)}[kind]()


def rounds(prompts: list[int]):
    """Each prompt's rounds as a batch-1 decoding verifying whole drafts visits them, with the request's history."""
    for r in prompts:
        p, hist = 0, []
        while p < len(records[r]):
            e = records[r][p]
            if e is None:
                p += 1
                continue
            yield e, hist
            hist.append(float(e["acc"] > 0))
            p += e["acc"] + 1


def fitted(kind: str, prompts: list[int]):
    """The survival curve of `kind`, recalibrated on `prompts`' rounds."""
    cells: dict[tuple, list[float]] = {}
    for e, hist in rounds(prompts):
        for k, a in enumerate(e["surv"]):
            c = cells.setdefault((k, min(9, int(10 * a)), feature(kind, e, hist, k)), [0.0, 0.0, 0.0])
            c[0] += float(e["acc"] > k)
            c[1] += 1
            c[2] += a
    table = {key: (s + SHRINK * a / t) / (t + SHRINK) for key, (s, t, a) in cells.items()}

    def curve(e: dict, hist: list[float]) -> list[float]:
        out: list[float] = []
        for k, a in enumerate(e["surv"]):
            v = table.get((k, min(9, int(10 * a)), feature(kind, e, hist, k)), a)
            out.append(min(v, out[-1]) if out else v)
        return out
    return curve


def step_ms(slots: int, rows: int, drafted: bool) -> float:
    return sps.step_time_ms_at(rows) + SLOT_MS * (slots - 1) + (DRAFT_MS if drafted else 0.0)


def simulate(batch: int, curve, prompts: list[int]) -> tuple[float, int, int, int]:
    """(time, steps, tokens verified beyond the next, accepted) of decoding `prompts` through `batch` slots."""
    scheduler, queue, slots = SCHED(), list(prompts), []
    hist: dict[int, list[float]] = {r: [] for r in prompts}
    ms = steps = verified = acc = 0
    while queue or slots:
        while len(slots) < batch and queue:
            slots.append((queue.pop(0), 0))
        entries = [records[r][p] for r, p in slots]
        survival = [curve(e, hist[r]) if e else [] for (r, _), e in zip(slots, entries)]
        lengths = scheduler.schedule(survival, sps) if any(survival) else [0] * len(slots)
        ms += step_ms(len(slots), sum(1 + n for n in lengths), any(survival))
        steps += 1
        kept = []
        for (r, p), e, n in zip(slots, entries, lengths):
            a = min(n, e["acc"]) if e else 0
            if e:
                hist[r].append(float(e["acc"] > 0))  # live: the draft's first token against the one committed
            verified, acc = verified + n, acc + a
            if p + a + 1 < len(records[r]):
                kept.append((r, p + a + 1))
        slots = kept
    return ms, steps, verified, acc


def target_only_ms(batch: int, prompts: list[int]) -> float:
    left, slots, ms = [len(records[r]) for r in prompts], [], 0.0
    while left or slots:
        while len(slots) < batch and left:
            slots.append(left.pop(0))
        ms += step_ms(len(slots), len(slots), False)
        slots = [n - 1 for n in slots if n > 1]
    return ms


def brier(curve, prompts: list[int]) -> float:
    err = [(v - float(e["acc"] > k)) ** 2 for e, hist in rounds(prompts) for k, v in enumerate(curve(e, hist))]
    return float(np.mean(err))


everyone = list(range(N))
halves = (everyone[0::2], everyone[1::2])
out: dict = {"cpu": cpu_signature(), "prompts": N, "gamma": GAMMA, "scheduler": SCHED.name, "by_batch": {}}
for batch in (1, 4, 8):
    base = target_only_ms(batch, everyone)
    res = {}
    for kind in VARIANTS:
        ms = steps = verified = acc = 0
        score = 0.0
        for fit_on, run_on in (halves, halves[::-1]):
            if kind == "shipped":
                curve = lambda e, hist: e["surv"]  # noqa: E731
            elif kind == "hindsight":
                curve = lambda e, hist: [float(k < e["acc"]) for k in range(len(e["tokens"]))]  # noqa: E731
            else:
                curve = fitted(kind, fit_on)
            a, b, c, d = simulate(batch, curve, run_on)
            ms, steps, verified, acc = ms + a, steps + b, verified + c, acc + d
            score += brier(curve, run_on) / 2
        res[kind] = {"speedup": round(base / ms, 3), "verified_per_step": round(verified / steps, 2),
                     "accepted_share": round(acc / max(verified, 1), 3)}
        if batch == 1:
            res[kind]["brier"] = round(score, 4)
    out["by_batch"][batch] = res
    print(json.dumps({batch: res}), file=sys.stderr, flush=True)
print(json.dumps(out))
