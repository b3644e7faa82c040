"""A drafter for a Qwen3 and a Qwen3-MoE target, end to end as a platform team would do it: a tiny random target
built from its config and saved as a Hugging Face folder, `dspark train` for 300 steps, the exported checkpoint
(safetensors + config.json) served by the shipped configs/serve.yaml (`target:` the folder, `drafter: dspark` the
checkpoint; deployed the declarative way, as `serve run` does) on a real local Ray cluster, and the official
`openai` client answered over HTTP: greedy text identical to the single-process target-only engine's."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
import yaml
from typer.testing import CliRunner

from dspark.cli import app
from dspark.config.engine import EngineConfig
from dspark.models.target.loader import load_target
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams
from tests.families import make_family_dir
from tests.test_serve_autoscaling import SLA_OUT_OF_REACH, deployed
from tests.tiny import tiny_sps_path

ROOT = Path(__file__).resolve().parents[1]
NUM_STEPS = 300
NUM_NEW = 24
PROMPTS = [[5, 9, 11, 7, 5, 9, 11, 7, 5, 9], [12, 13, 14, 15, 16, 17], [30, 31, 30, 31, 30, 31, 30]]


def _train(target_dir: Path, tmp_path: Path) -> dict:
    """`dspark train` on the target: a small self-distilled corpus, NUM_STEPS steps, calibration, export."""
    cfg = {
        "name": "tiny", "target": str(target_dir), "work_dir": str(tmp_path / "work"),
        "output": str(tmp_path / "dspark"),
        "synth": {"num_prompts": 24, "num_stdlib_prompts": 4, "shard_size": 12, "prompt_max_tokens": 16,
                  "response_max_tokens": 48, "data_dir": str(tmp_path / "data")},
        "engine": {"drafter": "none", "scheduler": "fixed", "max_num_seqs": 12, "max_model_len": 128,
                   "dtype": "fp32"},
        "model": {"num_layers": 1, "block_size": 4, "markov_rank": 16, "draft_vocab_size": 48,
                  "init_from_target": True},
        "train": {"num_steps": NUM_STEPS, "batch_size": 4, "num_anchors": 8, "warmup_steps": 20,
                  "checkpoint_every": 100, "max_seq_len": 96, "feature_dtype": "fp32", "heldout_fraction": 0.3,
                  "num_calibration_prompts": 4, "calibration_max_tokens": 24},
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(app, ["train", "--config", str(path)])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def _serve_args(target_dir: Path, drafter_dir: Path, kind: str) -> tuple[dict, dict]:
    """The shipped app config with `target:` the folder and the trained drafter; what a tiny target on a shared
    2-core test machine needs changed (no A/B arm without its own checkpoint, fp32, the test SPS profile)."""
    (shipped,) = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())["applications"]
    args = {**shipped["args"], "target": str(target_dir), "model_name": kind, "drafter": "dspark",
            "drafter_kwargs": {"path": str(drafter_dir)}, "dtype": "fp32", "sps_profile": tiny_sps_path(target_dir),
            "num_draft_tokens": 4, "max_num_seqs": 4, "max_model_len": 256, "cluster_name": f"dspark-{kind}",
            "ab_arms": [], "request_log": None, "sla": SLA_OUT_OF_REACH,
            # a tiny model verifies in ~1 ms, so the draft gate would (rightly) stop paying for remote drafts,
            # and the central scheduler may rightly verify none of a weak drafter's tokens at this profile; this
            # test is about serving the trained drafter, so every round verifies its 4 tokens
            "draft_gate": False, "scheduler": "fixed", "scheduler_kwargs": {"k": 4}}
    return args, shipped["autoscaling_policy"]


def _verify_replica_account() -> dict:
    from ray import serve

    st = serve.get_deployment_handle("default-verify", "dspark").stats.remote().result()
    keys = ("draft_worker", "reconnect_pending", "draft_gate", "num_steps", "draft_channel_error", "num_pushes",
            "draft_wait_ms_mean")
    return {k: st.get(k) for k in keys} | {"verified": [t["num_verified"] for t in st.get("timeline", [])[-12:]],
                                           "draft_rounds": len(st.get("draft_timeline", []))}


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_a_drafter_trained_for_the_target_serves_it_through_serve_to_the_openai_client(
        kind, tiny_target_dir, tmp_path):
    target_dir = make_family_dir(kind, tmp_path / kind, tiny_target_dir)
    report = _train(target_dir, tmp_path)
    assert report["train"]["num_steps"] == NUM_STEPS and report["train"]["drafter"] == "dspark"
    assert report["calibrate"]["num_rounds"] > 0 and report["calibrate"]["tau_heldout"] >= 1  # on held-out prompts
    print(f"\n{kind}: {NUM_STEPS} steps in {report['train']['stage_wall_s']:.0f} s, final loss "
          f"{report['train']['final']['loss']:.3f}, acceptance by position {report['train']['final']['acceptance']}, "
          f"held-out tau {report['calibrate']['tau_heldout']:.2f}")
    checkpoint = Path(report["export"]["output"])
    assert (checkpoint / "model.safetensors").exists() and (checkpoint / "config.json").exists()
    drafter_cfg = json.loads((checkpoint / "config.json").read_text())
    assert drafter_cfg["target"]["architecture"] == json.loads((target_dir / "config.json").read_text())[
        "architectures"][0]

    target = load_target(str(target_dir))
    engine = Engine(EngineConfig(target=str(target_dir), drafter="none", scheduler="fixed", max_num_seqs=4,
                                 max_model_len=256, sps_profile=tiny_sps_path(target_dir)), target=target)
    expected = [target.tokenizer.decode(r.output_ids, skip_special_tokens=True)
                for r in engine.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW, ignore_eos=True))]

    args, policy = _serve_args(target_dir, checkpoint, kind)
    with deployed(args, policy) as http:
        client = openai.OpenAI(base_url=f"{str(http.base_url).rstrip('/')}/v1", api_key="unused", max_retries=0,
                               timeout=120)
        assert [m.id for m in client.models.list().data] == [kind]
        answers = [client.completions.create(model=kind, prompt=p, max_tokens=NUM_NEW, temperature=0,
                                             extra_body={"ignore_eos": True}) for p in PROMPTS]
        assert [a.choices[0].text for a in answers] == expected  # lossless through the served drafter
        assert all(a.usage.completion_tokens == NUM_NEW for a in answers)
        # its drafts are verified and used: the first requests may run target-only while the verify replica
        # pairs with its draft partner (readiness admits target-only by design), so ask until they are, over
        # every prompt: a drafter of held-out τ ~2 still has prompts it never gets right (session 36 found
        # this case's intermittent failure to be just that: pairing came after the three answers, and the
        # prompt asked again was the one this Qwen3-MoE drafter drafts wrong every time, identically in runs
        # that passed)
        stats = [a.model_extra["dspark"] for a in answers]
        deadline = time.monotonic() + 60
        while sum(st["num_accepted"] for st in stats) == 0 and time.monotonic() < deadline:
            i = len(stats) % len(PROMPTS)
            again = client.completions.create(model=kind, prompt=PROMPTS[i], max_tokens=NUM_NEW, temperature=0,
                                              extra_body={"ignore_eos": True})
            assert again.choices[0].text == expected[i]
            stats.append(again.model_extra["dspark"])
        # on failure, the verify replica's own account (its draft partner, gate, recent rounds) says why
        if sum(st["num_accepted"] for st in stats) == 0:
            pytest.fail(f"no drafted token verified in {len(stats)} answers: {json.dumps(_verify_replica_account())}")
        chat = client.chat.completions.create(model=kind, messages=[{"role": "user", "content": "the cat and"}],
                                              max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 8
        streamed = client.chat.completions.create(model=kind, messages=[{"role": "user", "content": "the cat and"}],
                                                  max_tokens=8, temperature=0, stream=True,
                                                  extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            chat.choices[0].message.content
