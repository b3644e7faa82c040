"""`dspark bench decode`: HF generate vs our target-only engine vs speculative decoding, side by side.

Greedy (T=0), fixed prompts from the shared eval sets, fixed output length (EOS ignored so every
arm decodes the same number of tokens), a warm-up per arm. Figures are ratios from one run.

At batch 1 the arms take turns prompt by prompt (target-only among them, the order rotated each prompt), so a
slow spell of a shared host lands on every arm instead of on whichever ran then: run one after another, two
runs on one 2-core KVM EPYC put the same suffix arm (same τ, same verify lengths) at 1.78x and 2.10x of a
target-only measured once before it. Each speedup comes with the spread of its per-prompt ratios. At batch
B > 1 with continuous batching a run is one whole batch, so there the arms take turns run by run, `rounds` runs
each, and each speedup comes with its per-round ratios.
"""

from __future__ import annotations

import copy
import gc
import time
from collections.abc import Callable
from dataclasses import dataclass
from statistics import fmean

import torch
from tqdm import tqdm

from dspark.bench.quartiles import quartiles
from dspark.config.engine import EngineConfig
from dspark.models.drafters.base import Drafter
from dspark.models.drafters.oracle import OracleDrafter
from dspark.models.drafters.registry import make_drafter
from dspark.models.target.loader import TargetModel, load_target
from dspark.prompts.eval_sets import mixed_prompts
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams


@dataclass
class ArmResult:
    tok_s: float
    tau: float  # tokens emitted per verification round (accepted + 1)
    mean_verify_len: float
    draft_ms: float  # mean per step
    verify_ms: float  # mean per step
    outputs: list[list[int]]
    group_s: list[float]  # wall time of each batch_size group, in order
    steady: tuple[int, float] | None = None  # continuous batching: (tokens, s) until the queue ran dry

    @property
    def steady_tok_s(self) -> float | None:
        """Continuous batching: tok/s until the queue ran dry (see _generate_refilled)."""
        return self.steady[0] / self.steady[1] if self.steady else None


BASE = "target-only"


def _summary(engine: Engine, outs: list[list[int]], group_s: list[float],
             steady: tuple[int, float] | None = None) -> ArmResult:
    """An arm's figures from its engine's step stats (every step it ran), its outputs and the wall time of each
    group of prompts."""
    stats = engine.stats
    num_rounds = sum(s.num_requests for s in stats)
    emitted = sum(sum(s.num_accepted) + s.num_requests for s in stats)
    verified = sum(sum(s.lengths) for s in stats)
    num_steps = max(len(stats), 1)
    return ArmResult(tok_s=sum(map(len, outs)) / sum(group_s), tau=emitted / max(num_rounds, 1),
                     mean_verify_len=verified / max(num_rounds, 1),
                     draft_ms=sum(s.draft_ms for s in stats) / num_steps,
                     verify_ms=sum(s.verify_ms for s in stats) / num_steps, outputs=outs,
                     group_s=group_s, steady=steady)


def _tenant(round_: int) -> str:
    """Whose served text a round's outputs join (the suffix proposer's served source): one store per round.
    Round 2 decodes round 1's prompts again; sharing a store, the served source drafted round 1's outputs
    back (an oracle): on a Xeon the hybrid's second round at batch 8 read 2.42x target-only against 1.23x in
    its first (s39)."""
    return f"bench-round-{round_}"


def _rotated(names: list[str], shift: int) -> list[str]:
    """The arms' order at prompt `shift`: rotated, with the oracle after target-only (it replays its output)."""
    shift %= len(names)
    order = names[shift:] + names[:shift]
    if "oracle" in order and order.index("oracle") < order.index(BASE):
        order.remove("oracle")
        order.append("oracle")
    return order


def run_interleaved(engines: dict[str, Engine], prompts: list[list[int]], max_new_tokens: int,
                    rounds: int = 1) -> dict[str, ArmResult]:
    """Batch 1, the arms in turn on each prompt (order rotated per prompt and round), `rounds` times over the
    prompts; each arm's time per prompt is its mean over the rounds. An oracle arm (OracleDrafter) is handed
    target-only's output for a prompt before its turn on it."""
    params = [SamplingParams(max_tokens=max_new_tokens, ignore_eos=True, tenant=_tenant(r)) for r in range(rounds)]
    names = list(engines)
    for engine in engines.values():
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        engine.stats.clear()
    outs: dict[str, list[list[int] | None]] = {n: [None] * len(prompts) for n in names}
    secs = {n: [0.0] * len(prompts) for n in names}
    bar = tqdm(total=rounds * len(prompts) * len(names), desc="engine b=1, arms in turn", leave=False)
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            for name in _rotated(names, i + r):
                engine = engines[name]
                if r == 0 and isinstance(engine.drafter, OracleDrafter):  # it keeps it for the later rounds
                    engine.drafter.set_continuation(prompt, prompt + outs[BASE][i])
                t0 = time.perf_counter()
                out = engine.generate([prompt], params[r])[0].output_ids
                if engine.runner.device.type == "cuda":
                    torch.cuda.synchronize()
                secs[name][i] += time.perf_counter() - t0
                if outs[name][i] is None:
                    outs[name][i] = out
                elif out != outs[name][i]:  # greedy: a round that decodes otherwise is a bug, not noise
                    raise RuntimeError(f"{name}: prompt {i} decoded differently in round {r}")
                bar.update()
    bar.close()
    return {n: _summary(engines[n], outs[n], [s / rounds for s in secs[n]]) for n in names}


def run_refilled_in_turn(engines: dict[str, Engine], prompts: list[list[int]], batch_size: int,
                         max_new_tokens: int, rounds: int = 1) -> tuple[dict[str, ArmResult], dict[str, list[float]]]:
    """Batch > 1, continuous batching: each arm's whole run (every prompt through the `batch_size` slots) in
    turn, the order rotated per round, `rounds` rounds. An arm's figures pool its rounds (tokens over seconds);
    also returns each arm's tok/s per round, to pair with target-only's of the same round. An oracle arm is
    handed target-only's outputs before its first turn."""
    names = list(engines)
    runs: dict[str, list[ArmResult]] = {n: [] for n in names}
    for r in range(rounds):
        for name in _rotated(names, r):
            engine = engines[name]
            if r == 0 and name != BASE:  # _rotated runs target-only before the oracle
                _hand_continuations(engine, prompts, runs[BASE][0].outputs)
            run = run_engine(engine, prompts, batch_size, max_new_tokens, refill=True, tenant=_tenant(r))
            if runs[name] and run.outputs != runs[name][0].outputs:  # greedy: a bug, not noise
                raise RuntimeError(f"{name}: batch {batch_size} decoded differently in round {r}")
            runs[name].append(run)
    return {n: _pooled(rs) for n, rs in runs.items()}, {n: [run.tok_s for run in rs] for n, rs in runs.items()}


def _hand_continuations(engine: Engine, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """An oracle arm replays target-only's greedy continuation of each prompt; other arms: nothing to do."""
    if isinstance(engine.drafter, OracleDrafter):
        for p, o in zip(prompts, outputs):
            engine.drafter.set_continuation(p, p + o)


def _pooled(runs: list[ArmResult]) -> ArmResult:
    """One arm's figures over runs of the same prompts: tok/s (and the steady state's) as tokens over seconds,
    the per-step means as means over the runs."""
    tokens = sum(map(len, runs[0].outputs))
    steadies = [run.steady for run in runs if run.steady]
    return ArmResult(tok_s=tokens * len(runs) / sum(sum(run.group_s) for run in runs),
                     tau=fmean(run.tau for run in runs), mean_verify_len=fmean(run.mean_verify_len for run in runs),
                     draft_ms=fmean(run.draft_ms for run in runs), verify_ms=fmean(run.verify_ms for run in runs),
                     outputs=runs[0].outputs, group_s=[s for run in runs for s in run.group_s],
                     steady=(sum(t for t, _ in steadies), sum(s for _, s in steadies)) if steadies else None)


def spread(base: ArmResult, arm: ArmResult) -> dict:
    """Quartiles of the per-prompt speedups (target-only's time over the arm's on the same prompt and tokens):
    how far one prompt's ratio sits from another's."""
    return quartiles([b / a for b, a in zip(base.group_s, arm.group_s)])


def hf_generate_tok_s(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int,
                      eos_id: int) -> tuple[float, list[list[int]]]:
    """Batch-1 end-to-end tokens/s of transformers' generate (greedy, EOS ignored)."""
    dev = next(model.parameters()).device
    total_tokens, total_s, outs = 0, 0.0, []
    for p in tqdm(prompts, desc="hf generate", leave=False):
        ids = torch.tensor([p], device=dev)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=eos_id)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        total_s += time.perf_counter() - t0
        outs.append(out[0, len(p):].tolist())
        total_tokens += len(outs[-1])
    return total_tokens / total_s, outs


def run_engine(engine: Engine, prompts: list[list[int]], batch_size: int, max_new_tokens: int,
               refill: bool = False, tenant: str = "") -> ArmResult:
    """Decode all prompts end to end incl. prefill: batch_size at a time (each group admitted together and
    run to its end), or with `refill` all at once through the engine's slots (continuous batching). `tenant`:
    whose served text the outputs join (see `_tenant`)."""
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True, tenant=tenant)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    engine.stats.clear()
    outs: list[list[int]] = []
    group_s: list[float] = []
    group = len(prompts) if refill else batch_size
    steady: tuple[int, float] | None = None
    for i in tqdm(range(0, len(prompts), group), desc=f"engine b={batch_size}", leave=False):
        tg = time.perf_counter()
        if refill:
            done, steady = _generate_refilled(engine, prompts[i:i + group], params, batch_size)
            outs += done
        else:
            outs += [r.output_ids for r in engine.generate(prompts[i:i + group], params)]
        group_s.append(time.perf_counter() - tg)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
    return _summary(engine, outs, group_s, steady)


def _generate_refilled(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                       batch_size: int) -> tuple[list[list[int]], tuple[int, float]]:
    """All prompts through the engine's `batch_size` slots, each finished slot refilled at the next step.
    Also returns (tokens emitted, seconds) up to the first step after which a slot stays empty (the queue
    ran dry): the steady state of continuous batching, before the last requests drain one by one. A
    serving engine under steady load never drains; a finite benchmark always does, and with speculation
    its requests finish at different steps, so the drain is a tail of small batches that target-only
    decoding (every request ends at the same step here) does not have."""
    t0, emitted, steady = time.perf_counter(), 0, None

    def note(outputs: list) -> None:
        nonlocal emitted, steady
        emitted += sum(len(o.new_token_ids) for o in outputs)
        if steady is None and not engine.waiting and len(engine.running) < batch_size:
            steady = (emitted, time.perf_counter() - t0)

    done = engine.generate(prompts, params, on_step=note)
    return [r.output_ids for r in done], steady or (emitted, time.perf_counter() - t0)


def bench_decode(target: TargetModel, drafters: list[str], batch_sizes: list[int], num_prompts: int,
                 max_new_tokens: int, scheduler: str, num_draft_tokens: int, sps_profile: str | None,
                 hf_dtypes: list[str], checkpoints: dict[str, str] | None = None, draft_gate: bool = True,
                 waves: int = 1, rounds: int = 1) -> dict:
    """At batch 1 the arms take turns on each prompt, `rounds` times over the prompts (`run_interleaved`).
    `waves` > 1: at batch B > 1, waves x B prompts go through B slots, each finished request's slot
    refilled at the next step (how a serving engine batches). One closed batch of B (waves 1) runs until
    its slowest request is done: with speculation the batch shrinks to its straggler, whose acceptance
    then sets the speed of the whole batch."""
    torch.manual_seed(0)
    max_bs = max(batch_sizes)
    n = max(num_prompts, max_bs * waves)
    picked = mixed_prompts(target.tokenizer, n)
    prompts = [p for _, p in picked]
    eos = target.eos_token_ids[0] if target.eos_token_ids else 0
    result: dict = {"model": target.name, "device": str(target.device), "dtype": str(target.dtype),
                    "num_threads": torch.get_num_threads(), "max_new_tokens": max_new_tokens,
                    "num_prompts_batch1": num_prompts, "datasets": [d for d, _ in picked],
                    "scheduler": scheduler, "num_draft_tokens": num_draft_tokens, "draft_gate": draft_gate,
                    "waves": waves}
    # HF reference, batch 1, in each dtype
    hf: dict[str, float] = {}
    for dt in hf_dtypes:
        model = target.model if dt == "fp32" and target.dtype == torch.float32 else \
            copy.deepcopy(target.model).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dt])
        hf_generate_tok_s(model, [prompts[0][:8]], 4, eos)  # warm-up
        hf[dt], _ = hf_generate_tok_s(model, prompts[:num_prompts], max_new_tokens, eos)
        if model is not target.model:
            del model
            gc.collect()
    result["hf_generate_tok_s"] = hf
    best_hf = max(hf.values()) if hf else None
    max_len = max(map(len, prompts)) + max_new_tokens + num_draft_tokens + 2
    for bs in batch_sizes:
        arm_prompts = prompts[:num_prompts] if bs == 1 else prompts[:bs * waves]
        refill = bs > 1 and waves > 1

        def engine_for(name: str, bs: int = bs) -> Engine:
            return _engine(name, target, bs, max_len, scheduler, num_draft_tokens, sps_profile, draft_gate,
                           checkpoints or {})

        engines: dict[str, Engine]
        by_round: dict[str, list[float]] = {}
        if bs == 1:  # every arm at once, taking turns prompt by prompt
            engines = {name: engine_for(name) for name in [BASE, *drafters]}
            arms = run_interleaved(engines, arm_prompts, max_new_tokens, rounds)
        elif refill:  # every arm at once, taking turns run by run (each continuous batch runs whole)
            engines = {name: engine_for(name) for name in [BASE, *drafters]}
            arms, by_round = run_refilled_in_turn(engines, arm_prompts, bs, max_new_tokens, rounds)
        else:  # one arm after another, closed batches of bs
            engines = {BASE: engine_for(BASE)}
            arms = {BASE: run_engine(engines[BASE], arm_prompts, bs, max_new_tokens, refill)}
            for name in drafters:
                engines[name] = engine_for(name)
                _hand_continuations(engines[name], arm_prompts, arms[BASE].outputs)
                arms[name] = run_engine(engines[name], arm_prompts, bs, max_new_tokens, refill)
        base = arms[BASE]
        block: dict = {"target_only_tok_s": base.tok_s, "target_only_step_ms": base.verify_ms, "drafters": {},
                       "num_prompts": len(arm_prompts), "continuous_batching": refill,
                       "arms_in_turn": bs == 1 or refill, **({"rounds": rounds} if bs == 1 or refill else {})}
        if refill:
            block["target_only_steady_tok_s"] = base.steady_tok_s
        if bs == 1 and "fp32" in hf:
            block["target_only_vs_hf_same_dtype"] = base.tok_s / hf.get(_dtype_key(target.dtype), hf["fp32"])
        for name in drafters:
            arm, engine = arms[name], engines[name]
            block["drafters"][name] = {
                **({"per_domain": _per_domain(picked[:len(arm_prompts)], base, arm),
                    "speedup_by_prompt": spread(base, arm)} if bs == 1 else {}),
                "spec_tok_s": arm.tok_s, "tau": arm.tau, "mean_verify_len": arm.mean_verify_len,
                "speedup_vs_target_only": arm.tok_s / base.tok_s,
                **({"steady_tok_s": arm.steady_tok_s,
                    "steady_speedup_vs_target_only": arm.steady_tok_s / base.steady_tok_s}
                   if refill and arm.steady_tok_s and base.steady_tok_s else {}),
                **({"speedup_by_round": [a / b for a, b in zip(by_round[name], by_round[BASE])]} if by_round else {}),
                "speedup_vs_hf": arm.tok_s / best_hf if best_hf else None,
                "scheduler": engine.config.scheduler,
                "draft_ms_per_step": arm.draft_ms, "verify_ms_per_step": arm.verify_ms,
                "draft_over_verify": arm.draft_ms / arm.verify_ms if arm.verify_ms else None,
                "greedy_identical_to_target_only": arm.outputs == base.outputs,
                # ms per verified draft token the scheduler used, per batch band (measured or the profile's)
                "token_cost": engine.token_cost.summary(engine.sps)
                if engine.token_cost is not None and engine.sps is not None else None,
            }
        del engines, arms
        gc.collect()
        result[f"batch{bs}"] = block
    if 1 in batch_sizes and len(batch_sizes) > 1:
        b1 = result["batch1"]["target_only_tok_s"]
        result["batch_scaling_target_only"] = {f"batch{b}_over_batch1": result[f"batch{b}"]["target_only_tok_s"] / b1
                                               for b in batch_sizes if b != 1}
    return result


NO_STS = "-nosts"
TOKEN_COST = "-tokencost"  # the arm schedules on the measured token cost, not the profile's slope


def _kind(name: str) -> str:
    return name.removesuffix(TOKEN_COST).removesuffix(NO_STS)


def _engine(name: str, target: TargetModel, batch_size: int, max_len: int, scheduler: str, num_draft_tokens: int,
            sps_profile: str | None, draft_gate: bool, checkpoints: dict[str, str]) -> Engine:
    """The engine of arm `name`: target-only, or drafter `name` under `scheduler` (the oracle: a fixed k)."""
    if name == BASE:
        return Engine(EngineConfig(target=target.name, drafter="none", scheduler="fixed", num_draft_tokens=0,
                                   max_num_seqs=batch_size, max_model_len=max_len), target=target, drafter=None)
    sched = "fixed" if name == "oracle" else scheduler
    cfg = EngineConfig(target=target.name, drafter=_kind(name), scheduler=sched, num_draft_tokens=num_draft_tokens,
                       sps_profile=sps_profile, max_num_seqs=batch_size, max_model_len=max_len,
                       draft_gate=draft_gate, measured_token_cost=name.endswith(TOKEN_COST),
                       scheduler_kwargs={"k": num_draft_tokens} if sched == "fixed" else {})
    return Engine(cfg, target=target, drafter=_drafter(name, target, checkpoints))


def _drafter(name: str, target: TargetModel, checkpoints: dict[str, str]) -> Drafter:
    """Drafter `name`; `<kind>-nosts` is the same checkpoint with its STS temperatures dropped (the raw
    confidences reach the scheduler), for the STS on/off ablation; `<name>-tokencost` schedules on the
    measured token cost instead of the profile's slope (spec/token_cost.py), for that ablation."""
    kind = _kind(name)
    kwargs = {"path": checkpoints[kind]} if kind in checkpoints else {}
    drafter = make_drafter(kind, target, **kwargs)
    if name.removesuffix(TOKEN_COST).endswith(NO_STS):
        model = getattr(drafter, "model", None)
        if model is None or not getattr(model.config, "sts_temperatures", None):
            raise ValueError(f"{name}: the {kind} drafter has no STS temperatures to drop")
        model.config.sts_temperatures = None
    return drafter


def _per_domain(picked: list[tuple[str, list[int]]], base: ArmResult, arm: ArmResult) -> dict:
    """Batch-1 tokens/s per domain (math, code, chat), target-only vs this arm."""
    from dspark.prompts.eval_sets import DOMAINS

    out: dict = {}
    for dom in sorted({DOMAINS[d] for d, _ in picked}):
        idx = [i for i, (d, _) in enumerate(picked) if DOMAINS[d] == dom]
        toks = sum(len(arm.outputs[i]) for i in idx)
        spec = toks / sum(arm.group_s[i] for i in idx)
        tgt = sum(len(base.outputs[i]) for i in idx) / sum(base.group_s[i] for i in idx)
        out[dom] = {"spec_tok_s": spec, "target_only_tok_s": tgt, "speedup_vs_target_only": spec / tgt}
    return out


def _dtype_key(dtype: torch.dtype) -> str:
    return "bf16" if dtype == torch.bfloat16 else "fp32"


def mixed_frame(num_prompts: int, max_new_tokens: int, dtype: str = "bf16",
                num_threads: int = 2) -> tuple[TargetModel, list[tuple[str, list[int]]], int]:
    """The frame of the side-by-side scripts under docs/results: `num_threads` torch threads, the default target in
    `dtype`, `num_prompts` mixed eval prompts ((dataset, prompt ids), round-robin over the shared sets) and the model
    length their engines need to decode `max_new_tokens` more (and a draft block) after the longest."""
    torch.set_num_threads(num_threads)
    target = load_target(dtype=dtype)
    labelled = mixed_prompts(target.tokenizer, num_prompts)
    return target, labelled, max(len(p) for _, p in labelled) + max_new_tokens + 9


def hybrid_variants_in_turn(target: TargetModel, prompts: list[list[int]], max_len: int, batch_size: int,
                            max_new_tokens: int, rounds: int,
                            variants: dict[str, Callable[[Engine], None]]) -> tuple[dict, dict[str, Engine]]:
    """Target-only and one hybrid engine per variant (Algorithm 1, the draft gate on; `variants[name]` adjusts its
    engine: a table, a rate), all prompts through `batch_size` slots in turn (`run_refilled_in_turn`): per variant
    the speedup, the steady state's, each round's, τ, tokens verified a request and whether greedy output matched
    target-only's; and the engines (for what a variant learnt)."""
    engines = {BASE: _engine(BASE, target, batch_size, max_len, "greedy", 7, None, True, {})}
    for name, adjust in variants.items():
        engines[name] = _engine("hybrid", target, batch_size, max_len, "greedy", 7, None, True, {})
        adjust(engines[name])
    arms, by_round = run_refilled_in_turn(engines, prompts, batch_size, max_new_tokens, rounds)
    base = arms[BASE]

    def steady(arm: ArmResult) -> float | None:
        return arm.steady[0] / arm.steady[1] if arm.steady else None

    summary: dict = {"target_only_tok_s": round(base.tok_s, 1)}
    for name in variants:
        arm = arms[name]
        summary[name] = {
            "speedup": round(arm.tok_s / base.tok_s, 3),
            "steady_speedup": round(steady(arm) / steady(base), 3) if steady(arm) and steady(base) else None,
            "by_round": [round(a / b, 3) for a, b in zip(by_round[name], by_round[BASE])],
            "tau": round(arm.tau, 3), "verify_len": round(arm.mean_verify_len, 3),
            "greedy_identical": arm.outputs == base.outputs}
    return summary, engines


def run_at(engines: dict[str, Engine], prompts: list[list[int]], batch_size: int, max_new_tokens: int, rounds: int,
           num_batch1: int, waves: int) -> tuple[dict[str, ArmResult], dict[str, list[float]] | None]:
    """The side-by-side scripts' run at one batch size: batch 1, the first `num_batch1` prompts with the arms in turn
    on each (`run_interleaved`; no per-round figures: None); batch B > 1, `waves` x B prompts through B slots, arm
    by arm in turn (`run_refilled_in_turn`); `rounds` rounds."""
    if batch_size == 1:
        return run_interleaved(engines, prompts[:num_batch1], max_new_tokens, rounds), None
    return run_refilled_in_turn(engines, prompts[:batch_size * waves], batch_size, max_new_tokens, rounds)


def arms_vs_target(arms: dict[str, ArmResult], by_round: dict[str, list[float]] | None,
                   labelled: list[tuple[str, list[int]]]) -> dict:
    """Each arm against target-only (`BASE`), as the side-by-side scripts under docs/results print it: the speedup,
    τ, tokens verified a request and whether greedy output matched; at batch 1 (`by_round` None, `run_interleaved`
    over `labelled`'s prompts in order) the speedup per eval set, else (`run_refilled_in_turn`) each round's and
    the steady state's."""
    base = arms[BASE]
    out: dict = {"target_only_tok_s": round(base.tok_s, 1)}
    for name, arm in arms.items():
        if name == BASE:
            continue
        r: dict = {"speedup": round(arm.tok_s / base.tok_s, 3), "tau": round(arm.tau, 3),
                   "verify_len": round(arm.mean_verify_len, 3), "greedy_identical": arm.outputs == base.outputs}
        if by_round is None:
            by_set: dict[str, list[float]] = {}
            for (dataset, _), b, a in zip(labelled, base.group_s, arm.group_s):
                acc = by_set.setdefault(dataset, [0.0, 0.0])
                acc[0], acc[1] = acc[0] + b, acc[1] + a
            r["by_domain"] = {d: round(b / a, 3) for d, (b, a) in by_set.items()}
        else:
            r["by_round"] = [round(a / b, 3) for a, b in zip(by_round[name], by_round[BASE])]
            if arm.steady and base.steady:
                r["steady_speedup"] = round((arm.steady[0] / arm.steady[1]) / (base.steady[0] / base.steady[1]), 3)
        out[name] = r
    return out


def change_ab(engines: dict[str, Engine], old: str, new: str, prompts: list[list[int]], batch_size: int,
              max_new_tokens: int, rounds: int, num_batch1: int, waves: int) -> dict:
    """A change's A/B in the engine, four engines in one process: target-only and the hybrid each without it
    (`BASE`, f"hybrid-{old}") and with it (f"target-{new}", f"hybrid-{new}"). Batch 1: the first `num_batch1`
    prompts, the arms in turn on each (`run_interleaved`); batch B > 1: `waves` x B prompts through B slots, arm by
    arm in turn (`run_refilled_in_turn`); `rounds` rounds. Tok/s and τ per arm, hybrid / target-only on each side,
    new / old for each, whether greedy outputs agree across all four, and at B > 1 each round's tok/s and the
    steady state's hybrid / target-only."""
    t_new, h_old, h_new = f"target-{new}", f"hybrid-{old}", f"hybrid-{new}"
    arms, per_round = run_at(engines, prompts, batch_size, max_new_tokens, rounds, num_batch1, waves)
    tok = {n: a.tok_s for n, a in arms.items()}
    steady = {n: a.steady_tok_s for n, a in arms.items()}
    res = {"tok_s": {n: round(v, 1) for n, v in tok.items()},
           "tau": {n: round(a.tau, 3) for n, a in arms.items()},
           "hybrid_over_target": {old: round(tok[h_old] / tok[BASE], 3), new: round(tok[h_new] / tok[t_new], 3)},
           f"{new}_over_{old}": {"target": round(tok[t_new] / tok[BASE], 3),
                                 "hybrid": round(tok[h_new] / tok[h_old], 3)},
           "greedy_identical_across_arms": all(a.outputs == arms[BASE].outputs for a in arms.values())}
    if per_round:
        res["per_round_tok_s"] = {n: [round(v, 1) for v in r] for n, r in per_round.items()}
        st = {n: v for n, v in steady.items() if v}
        if len(st) == len(steady):
            res["steady_hybrid_over_target"] = {old: round(st[h_old] / st[BASE], 3),
                                                new: round(st[h_new] / st[t_new], 3)}
    return res
