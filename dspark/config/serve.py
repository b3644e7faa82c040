"""The `args:` of the dspark Serve application (serve.yaml), validated with clear errors.

Modes: `inline` runs one engine inside each Serve replica (small deployments, no actor pools);
`colocated` runs a pool of VerifyWorker actors, each with its drafter in-process; `decoupled` runs
separate VerifyWorker and DraftWorker pools, paired 1:1, exchanging tensors over `transport`.
In both pool modes a central SchedulerActor places requests and (scheduler `central`) sets each
verify worker's capacity K.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dspark.config.cpu_priority import renice_process
from dspark.config.engine import EngineConfig
from dspark.metrics.series import Metrics
from dspark.models.target.loader import DEFAULT_TARGET
from dspark.spec.schedulers import SCHEDULER_NAMES


class WorkerResources(BaseModel):
    """Ray resources and thread budget of one pool worker."""

    model_config = ConfigDict(extra="forbid")

    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per worker.")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per worker (its device is then cuda).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom logical resources, e.g. {'draft_node': 1} to pin a pool "
                                          "to nodes started with `ray start --resources`.")
    num_threads: int | None = Field(None, ge=1, description="Torch CPU threads; null: num_cpus rounded, >= 1.")
    nice: int = Field(0, ge=0, le=19, description="CPU niceness the worker takes before it starts computing. "
                                                  "Where pools share cores with Serve's proxy and the ingress "
                                                  "(one machine), a few points keep the request path - "
                                                  "admission, 429s, streaming - answering while the model "
                                                  "computes; on dedicated nodes it changes nothing.")

    def threads(self) -> int:
        return self.num_threads or max(1, round(self.num_cpus))

    def apply_nice(self) -> None:
        """Lower this process's CPU priority by `nice`: every thread it has now (Linux sets niceness per
        thread, and a Serve replica's constructor runs on one of several: Ray's and Serve's own threads
        were started before it) and, through inheritance, the threads they start later (torch's pool)."""
        if self.nice:
            renice_process(self.nice)

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.num_gpus:
            options["num_gpus"] = self.num_gpus
        if self.resources:
            options["resources"] = dict(self.resources)
        return options


class SLAConfig(BaseModel):
    """The service level the deployment promises: admission admits by it, the autoscaler scales for it."""

    model_config = ConfigDict(extra="forbid")

    ttft_s: float = Field(2.0, gt=0, description="Time to first token a request may take (admission admits a "
                                                 "request only when its predicted TTFT is within it; the "
                                                 "autoscaler scales when the measured p50 is over it).")
    tpot_s: float = Field(0.25, gt=0, description="Time per output token after the first (admission keeps the "
                                                  "running batch's predicted TPOT within it).")
    headroom: float = Field(0.85, gt=0, le=1, description="Admission aims at this fraction of the SLA, so that "
                                                          "the measured latency, which varies around the "
                                                          "prediction, stays within it.")


class KeyQuota(BaseModel):
    """A quota of one API key: token buckets of requests and tokens per minute (see cluster/ingress/quotas.py)."""

    model_config = ConfigDict(extra="forbid")

    key_sha256: str = Field(..., pattern=r"^[0-9a-fA-F]{64}$", description="SHA-256 hex digest of the key.")
    requests_per_minute: float | None = Field(None, gt=0, description="Requests per minute; null: unlimited.")
    tokens_per_minute: float | None = Field(None, gt=0, description="Prompt + completion tokens per minute "
                                            "(charged when a request ends); null: unlimited.")


SERVER_STEP_STATS = 4096  # per-step records a serving engine keeps (timelines, load reports)


class ABArm(BaseModel):
    """One arm of an A/B test: a name, a traffic weight, and what it changes of the base config."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="Arm name (response header x-dspark-arm).")
    weight: float = Field(..., ge=0, description="Share of users (relative to the other arms' weights).")
    overrides: dict[str, Any] = Field(default_factory=dict,
                                      description="ServeAppConfig fields this arm sets, e.g. {drafter: mtp1}.")


class ServeAppConfig(BaseModel):
    """The `args:` of the dspark application in serve.yaml."""

    # a typo in serve.yaml must fail loudly rather than silently fall back to a default
    model_config = ConfigDict(extra="forbid")

    target: str = Field(DEFAULT_TARGET, description="Target model: the embedded default or a HF folder.")
    device: str = Field("cpu", description="Torch device of the target, e.g. 'cpu' or 'cuda'.")
    dtype: str | None = Field(None, description="fp32/bf16/fp16, or auto (the fastest for verification, "
                                                "measured on this machine); null: fp32 on CPU, bf16 on GPU.")
    drafter: str = Field("ngram", description="Drafter name (ngram, dspark, dflash, eagle3, mtp, ...).")
    drafter_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra drafter arguments.")
    scheduler: str = Field("fixed", description="Prefix scheduler: fixed, threshold, greedy (Algorithm 1), async, "
                                                 "or central (K from the SchedulerActor; pool modes only).")
    scheduler_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra scheduler arguments.")
    num_draft_tokens: int = Field(7, ge=0, description="γ: most tokens drafted per request and step.")
    draft_gate: bool = Field(True, description="Skip drafting at batch sizes where it measurably costs more "
                                               "than it returns (load-aware schedulers only).")
    measured_token_cost: bool = Field(False, description="Schedule verification on the measured cost of one more "
                                      "verified token per batch band, not the profile's slope (load-aware "
                                      "schedulers only; measured slower at batch 8 and 32: spec/token_cost.py).")
    prefix_cache_mb: int = Field(256, ge=0, description="Automatic prefix caching, per engine: MiB of prompt-block "
                                 "K/V kept so a prompt that starts like an earlier one (system turn, repeated or "
                                 "multi-turn prompt) computes only its new part. 0 turns it off.")
    merge_stream_outputs: bool = Field(False, description="A stream that fell behind the engine gets the steps "
                                       "it missed as one output (one message downstream, not one per step).")
    stream_interval_ms: float = Field(
        0.0, ge=0, le=5000, description="A stream sends at most once every this many ms, the steps between merged "
        "(its first token and its end at once): fewer messages from the verify replica to the ingress and "
        "to the client for the same tokens, which leaves the engine more of the CPU at high concurrency. 0: "
        "every step's tokens at once.")
    sps_profile: str | None = Field(
        None, description="SPS profile JSON; null: the one measured on this machine for this target and dtype "
                          "(configs/profiles/, else measured at start-up and cached; unused by 'fixed').")
    max_num_seqs: int = Field(16, ge=1, description="Most requests batched at once per replica.")
    max_model_len: int = Field(2048, ge=2, description="Most tokens (prompt + output) per request.")
    num_threads: int | None = Field(
        None, ge=1, description="Torch CPU threads; null: num_cpus_per_replica rounded, at least 1.")
    model_name: str | None = Field(None, description="Name served as `model` in the API; null: target.")
    num_replicas: int = Field(1, ge=1, description="Serve replicas, each with its own engine.")
    num_cpus_per_replica: float | None = Field(
        None, gt=0, description="Ray CPUs reserved per Serve replica; null: 1 inline, 0.1 in pool modes "
                                "(the ingress only routes there).")
    num_gpus_per_replica: float = Field(0.0, ge=0, description="Ray GPUs reserved per replica.")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests Serve lets into an ingress replica; null: four times the admission "
                                "limit (capacity + max_queued_requests, per arm) plus 64. Past the limit the "
                                "replica answers 429 itself (per arm; when every arm is full, before reading the "
                                "body; Retry-After from the measured drain rate). Past max_ongoing_requests "
                                "Serve's proxy queues up to the admission limit more (its queue also holds "
                                "requests it has not assigned yet, so a burst of the limit fits) and answers "
                                "the rest 429 + Retry-After itself, without a round trip to the replica.")
    proxy_retry_after_s: float = Field(
        2.0, ge=0, description="Retry-After of the 429s Serve's proxy answers past max_ongoing_requests.")

    mode: Literal["inline", "colocated", "decoupled"] = Field(
        "inline", description="inline: engine in the Serve replica; colocated: VerifyWorker pool with "
                              "in-process drafters; decoupled: separate VerifyWorker and DraftWorker pools.")
    pools: Literal["actors", "serve"] = Field(
        "actors", description="How the pool modes run their workers: named Ray actors started by the ingress, "
                              "or Ray Serve deployments `<arm>-verify` / `<arm>-draft` (Serve scales and heals "
                              "them; `serve status` lists them).")
    verify_autoscaling: dict[str, Any] | None = Field(
        None, description="pools: serve: the verify deployment's Serve `autoscaling_config` (min_replicas, "
                          "max_replicas, ...); null: num_verify_workers fixed replicas.")
    draft_autoscaling: dict[str, Any] | None = Field(
        None, description="pools: serve: the draft deployment's Serve `autoscaling_config`; null: "
                          "num_draft_workers fixed replicas.")
    max_verify_per_draft: int = Field(1, ge=1, description="pools: serve: how many verify replicas one draft "
                                      "replica drafts for (M:N); the draft pool is autoscaled between "
                                      "ceil(verify / this) and verify replicas on its own signals.")
    drain_timeout_s: float = Field(120.0, gt=0, description="pools: serve: how long a replica being removed "
                                   "may take to finish its requests (Serve's graceful_shutdown_timeout_s).")
    num_verify_workers: int = Field(1, ge=1, description="VerifyWorker actors (pool modes).")
    num_draft_workers: int = Field(1, ge=1, description="DraftWorker actors (decoupled; paired 1:1 with verifiers).")
    verify_worker: WorkerResources = Field(default_factory=WorkerResources, description="Per VerifyWorker.")
    draft_worker: WorkerResources = Field(default_factory=WorkerResources, description="Per DraftWorker.")
    transport: Literal["socket", "gloo", "ray"] = Field(
        "socket", description="Draft<->verify messages: one TCP connection per pair (`SocketChannel`), "
                              "torch.distributed point-to-point (gloo on CPU) or Ray object references. Session "
                              "56, Zen 4, `dspark bench transport` (16 / 128 / 512 feature rows): socket 0.32 / "
                              "0.64 / 1.95 ms a round trip, gloo 0.55 / 0.87 / 2.57, Ray 4.1 / 5.9 / 17.8.")
    num_micro_batches: int | None = Field(
        None, ge=1, description="Ping-pong micro-batches per verify worker: a draft round of one overlaps the "
                                "verification of another. null: 2 in decoupled mode, 1 in colocated mode (an "
                                "in-process drafter overlaps nothing: more micro-batches only split each verify "
                                "forward; session 42, the hybrid colocated over HTTP at C = 4: 1.03x no-spec "
                                "TPS/user with 2, 1.55x with 1).")
    free_threads_while_drafting: bool = Field(
        True, description="Decoupled mode on a CPU with one micro-batch: a verify worker frees its OpenMP threads "
                          "while it waits for a draft round, rather than leave them spinning on the cores the draft "
                          "worker answers on.")
    scheduler_report_interval_ms: float = Field(
        0.0, ge=0, description="A verify worker reports its load and survival table to the SchedulerActor (whose "
                               "answer sets its capacity K) at most this often; 0: after every step whose previous "
                               "report was answered.")
    draft_device: str | None = Field(None, description="Drafter device in decoupled mode; null: same as device.")
    cluster_name: str = Field("dspark", pattern=r"^[A-Za-z0-9_.-]+$",
                              description="Prefix of the named actors (pools, scheduler).")
    api_key_sha256: list[str] = Field(
        default_factory=list, description="SHA-256 hex digests of the accepted API keys (bearer); also "
                                          "DSPARK_API_KEYS (plain, comma-separated) in the environment. None at "
                                          "all: every route is open.")
    admin_api_key_sha256: list[str] = Field(
        default_factory=list, description="Digests of admin keys (stats, A/B overrides); also "
                                          "DSPARK_ADMIN_API_KEYS. Admin keys are user keys too.")
    max_queued_requests: int = Field(
        32, ge=0, description="Requests an ingress replica lets wait beyond what its engines batch "
                              "(max_num_seqs per verify worker); past it: 429 with Retry-After, before any work.")
    sla: SLAConfig = Field(default_factory=SLAConfig, description="The SLA, in one place: read by admission "
                           "(cluster/ingress/admission.py) and reported by the verify pools to the autoscaling policy.")
    admission: Literal["sla", "static"] = Field(
        "static", description="sla (what configs/serve.yaml ships): admit a request when its predicted TTFT and "
                              "the batch's predicted TPOT are within the SLA (from rates measured at the ingress), "
                              "never past the static limit; static: only the static limit (capacity + "
                              "max_queued_requests), the default for configs that do not name an SLA policy "
                              "(closed-loop benchmarks and tests that size their load by the limit).")
    api_key_quotas: list[KeyQuota] = Field(default_factory=list, description="Per-key token buckets (requests "
                                           "and tokens per minute); keys without one are not limited.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body; larger: 413.")
    ab_arms: list[ABArm] = Field(default_factory=list, description="A/B arms, each with its own engine or "
                                 "pools; users are assigned stickily by weight (see cluster/ingress/ab.py). "
                                 "Empty: one arm.")
    request_log: str | None = Field(None, description="JSONL file each ingress replica appends one record per "
                                    "finished request to (for `dspark ab report`); null: none.")
    arm_name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]+$",
                          description="The `arm` label of this config's metrics (set per arm from ab_arms).")

    @field_validator("api_key_sha256", "admin_api_key_sha256")
    @classmethod
    def _hex_digests(cls, digests: list[str]) -> list[str]:
        bad = [d for d in digests if not re.fullmatch(r"[0-9a-fA-F]{64}", d)]
        if bad:
            raise ValueError(f"{len(bad)} entries are not SHA-256 hex digests (64 hex digits); hash a key "
                             "with: python -c \"import hashlib,sys; print(hashlib.sha256(sys.argv[1].encode())"
                             ".hexdigest())\" KEY")
        return [d.lower() for d in digests]

    def metrics(self, pool: str, replica: str) -> Metrics:
        """Metric handles labelled for a process of this config (see metrics/series.py)."""
        return Metrics(self.model_name or self.target, self.arm_name, pool, replica)

    def arm_config(self, arm: ABArm) -> ServeAppConfig:
        """The full config of one arm: this one with the arm's overrides, its pools named apart."""
        base = self.model_dump(exclude={"ab_arms"})
        base.update({"max_ongoing_requests": None, **arm.overrides,
                     "cluster_name": f"{self.cluster_name}-{arm.name}", "arm_name": arm.name})
        return ServeAppConfig.model_validate(base)

    @property
    def micro_batches(self) -> int:
        """`num_micro_batches`, or its default for the mode (see the field)."""
        return self.num_micro_batches or (2 if self.mode == "decoupled" else 1)

    @property
    def capacity(self) -> int:
        """Requests the engines behind one ingress replica batch at once (all arms together)."""
        if self.ab_arms:
            return sum(self.arm_config(a).capacity for a in self.ab_arms)
        workers = 1 if self.mode == "inline" else self.num_verify_workers
        return max(1, self.max_num_seqs * workers // (1 if self.mode == "inline" else self.num_replicas))

    @model_validator(mode="after")
    def _fill_defaults(self) -> ServeAppConfig:
        if self.num_cpus_per_replica is None:
            self.num_cpus_per_replica = 1.0 if self.mode == "inline" else 0.1
        if self.scheduler not in (*SCHEDULER_NAMES, "global_search", "central"):
            raise ValueError(f"unknown scheduler {self.scheduler!r}")
        if self.scheduler == "central" and self.mode == "inline":
            raise ValueError("scheduler 'central' needs mode colocated or decoupled (it is the SchedulerActor's K)")
        if self.mode == "decoupled" and self.pools == "actors" and self.num_draft_workers != self.num_verify_workers:
            raise ValueError(f"decoupled mode pairs workers 1:1: num_draft_workers ({self.num_draft_workers}) "
                             f"must equal num_verify_workers ({self.num_verify_workers})")
        if self.mode == "decoupled" and self.drafter == "none":
            raise ValueError("decoupled mode needs a drafter (drafter: none has nothing to decouple)")
        if self.model_name is None:
            self.model_name = self.target
        if self.ab_arms:
            names = [a.name for a in self.ab_arms]
            if len(set(names)) != len(names) or sum(a.weight for a in self.ab_arms) <= 0:
                raise ValueError(f"ab_arms need unique names and a positive total weight, got {names}")
            for arm in self.ab_arms:
                if {"ab_arms", "cluster_name", "arm_name"} & set(arm.overrides):
                    raise ValueError(f"arm {arm.name!r} may not override ab_arms, cluster_name or arm_name")
                self.arm_config(arm)  # each arm's config is valid on its own, or this one is not
        if self.max_ongoing_requests is None:
            self.max_ongoing_requests = self.admission_limit + self.admission_slack
        return self

    @property
    def admission_limit(self) -> int:
        """Requests one ingress replica admits (batched or queued), all arms together; past it: 429."""
        return self.capacity + self.max_queued_requests * max(1, len(self.ab_arms))

    @property
    def admission_slack(self) -> int:
        """Requests past the admission limit Serve lets into the replica, to be refused there."""
        return 3 * self.admission_limit + 64

    def engine_config(self, num_threads: int | None = None) -> EngineConfig:
        num_threads = num_threads or self.num_threads or max(1, round(self.num_cpus_per_replica))
        return EngineConfig(target=self.target, device=self.device, dtype=self.dtype, drafter=self.drafter,
                            drafter_kwargs=dict(self.drafter_kwargs), scheduler=self.scheduler,
                            scheduler_kwargs=dict(self.scheduler_kwargs),
                            num_draft_tokens=self.num_draft_tokens, sps_profile=self.sps_profile,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            num_threads=num_threads, draft_gate=self.draft_gate,
                            measured_token_cost=self.measured_token_cost, max_step_stats=SERVER_STEP_STATS,
                            merge_stream_outputs=self.merge_stream_outputs,
                            stream_interval_ms=self.stream_interval_ms,
                            prefix_cache_mb=self.prefix_cache_mb)

    def worker_engine_config(self) -> EngineConfig:
        """A VerifyWorker's engine; `central` runs Algorithm 1 locally until the first K arrives."""
        cfg = self.engine_config(self.verify_worker.threads())
        if self.verify_worker.num_gpus and self.device == "cpu":
            cfg.device = "cuda"
        if self.scheduler == "central":
            cfg.scheduler, cfg.scheduler_kwargs = "greedy", {}
        if self.mode == "decoupled":
            cfg.drafter = "none"  # the drafter lives on the paired DraftWorker
        return cfg


