"""`dspark train` end to end on the tiny model: every stage runs, resumes, and exports a loadable drafter."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from dspark.cli import app
from dspark.config.engine import EngineConfig
from dspark.models.drafters.ar.drafter import ARDrafter
from dspark.models.drafters.dspark.drafter import DSparkDrafter
from dspark.models.drafters.registry import make_drafter
from dspark.training.pipeline import build_model
from dspark.training.pipeline_config import PipelineConfig
from dspark.verify_service.engine import Engine
from dspark.verify_service.request import SamplingParams


def test_pipeline_runs_every_stage_then_skips_them_and_the_drafter_serves(tiny_target_dir, tiny_target, tmp_path):
    cfg = {
        "name": "tiny", "target": str(tiny_target_dir), "work_dir": str(tmp_path / "work"),
        "output": str(tmp_path / "ckpt"),
        "synth": {"num_prompts": 6, "num_stdlib_prompts": 2, "shard_size": 3, "prompt_max_tokens": 12,
                  "response_max_tokens": 24, "data_dir": str(tmp_path / "data")},  # as committed data: not in work_dir
        "engine": {"drafter": "none", "scheduler": "fixed", "max_num_seqs": 4, "max_model_len": 256},
        "model": {"num_layers": 1, "block_size": 4, "markov_rank": 8, "draft_vocab_size": 40},
        "train": {"num_steps": 4, "batch_size": 2, "num_anchors": 3, "warmup_steps": 1, "checkpoint_every": 2,
                  "heldout_fraction": 0.3, "num_calibration_prompts": 2, "calibration_max_tokens": 12},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    runner = CliRunner()
    res = runner.invoke(app, ["train", "--config", str(path)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(report) == {"synth", "vocab", "cache", "train", "calibrate", "export"}
    assert report["train"]["num_steps"] == 4 and len(report["calibrate"]["sts_temperatures"]) == 4
    # features: auto with no cache on disk trains online: no cache is built
    assert report["cache"]["skipped"] and report["train"]["features"]["source"] == "online"
    assert not (tmp_path / "work" / "cache").exists()
    assert (tmp_path / "ckpt" / "model.safetensors").exists()
    # a second run finds every output and skips every stage
    again = json.loads(runner.invoke(app, ["train", "--config", str(path)]).stdout.strip().splitlines()[-1])
    assert all(again[s].get("skipped") for s in ("synth", "vocab", "cache", "train", "calibrate"))
    # the exported checkpoint serves through the engine, losslessly
    drafter = make_drafter("dspark", tiny_target, path=str(tmp_path / "ckpt"))
    assert isinstance(drafter, DSparkDrafter) and drafter.model.config.sts_temperatures
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = Engine(EngineConfig(target=str(tiny_target_dir), scheduler="fixed", num_draft_tokens=4,
                               max_num_seqs=1, max_model_len=128), target=tiny_target, drafter=drafter)
    base = Engine(EngineConfig(target=str(tiny_target_dir), drafter="none", scheduler="fixed", num_draft_tokens=0,
                               max_num_seqs=1, max_model_len=128), target=tiny_target)
    assert spec.generate([prompt], params)[0].output_ids == base.generate([prompt], params)[0].output_ids
    # the run's learning curve from its real training state; drawn again as if a run continued it, with a forecast
    state = str(tmp_path / "work" / "runs" / "tiny" / "train_state.pt")
    res = runner.invoke(app, ["train-curve", "--state", state, "--window", "2", "--out", str(tmp_path / "c.json")])
    curve = json.loads(res.stdout.strip().splitlines()[-1])
    steps = [p["step"] for p in curve["points"]]
    assert len(steps) == 3 and steps == sorted(steps) and "forecast" not in curve  # too few points to fit
    res = runner.invoke(app, ["train-curve", "--state", state, "--window", "2", "--after", str(tmp_path / "c.json"),
                              "--plot", str(tmp_path / "c.png")])
    more = json.loads(res.stdout.strip().splitlines()[-1])
    assert [p["step"] for p in more["points"]] == [s + steps[-1] for s in steps]
    assert more["previous"] == curve["points"] and "tau_per_doubling" in more["forecast"]
    assert (tmp_path / "c.png").stat().st_size > 0
    # continued training (model.init_checkpoint) starts from the exported weights, in a run of its own
    more = PipelineConfig.model_validate({**cfg, "name": "tiny_more",
                                          "model": {**cfg["model"], "init_checkpoint": str(tmp_path / "ckpt")}})
    saved = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    start = build_model(more).state_dict()
    assert set(saved) == set(start) and all(torch.equal(start[k], v) for k, v in saved.items())
    # a checkpoint of another shape is refused with the reason, not loaded in part
    other = PipelineConfig.model_validate({**cfg, "model": {**cfg["model"], "markov_rank": 4,
                                                            "init_checkpoint": str(tmp_path / "ckpt")}})
    with pytest.raises(ValueError, match="does not fit this run's drafter"):
        build_model(other)


def test_baselines_train_on_one_shared_work_dir_and_serve_by_name(tiny_target_dir, tiny_target, tmp_path):
    """dflash, then eagle3 and mtp1 on the same work_dir: data, vocab and cache are built once; each trains
    with its own objective into runs/<name>, exports a checkpoint that `make_drafter(<kind>)` serves losslessly."""
    base = {
        "target": str(tiny_target_dir), "work_dir": str(tmp_path / "work"),
        "synth": {"num_prompts": 6, "num_stdlib_prompts": 2, "shard_size": 3, "prompt_max_tokens": 12,
                  "response_max_tokens": 24},
        "engine": {"drafter": "none", "scheduler": "fixed", "max_num_seqs": 4, "max_model_len": 256},
        "train": {"num_steps": 3, "batch_size": 2, "num_anchors": 3, "warmup_steps": 1, "checkpoint_every": 2,
                  "heldout_fraction": 0.3, "features": "cache"},  # the cache path: built once, shared
    }
    model = {"dflash": {"num_layers": 1, "block_size": 4, "head_type": "none", "use_confidence": False},
             "eagle3": {"block_size": 4}, "mtp1": {"block_size": 1}}
    expected_loss = {"dflash": "ce", "eagle3": "kl", "mtp1": "kl"}
    runner = CliRunner()
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    target_only = Engine(EngineConfig(target=str(tiny_target_dir), drafter="none", scheduler="fixed",
                                      num_draft_tokens=0, max_num_seqs=1, max_model_len=128), target=tiny_target)
    expected = target_only.generate([prompt], params)[0].output_ids
    for i, kind in enumerate(("dflash", "eagle3", "mtp1")):
        cfg = {**base, "name": f"tiny_{kind}", "drafter": kind, "output": str(tmp_path / kind),
               "model": {**model[kind], "draft_vocab_size": 40, "init_from_target": True}}
        path = tmp_path / f"{kind}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        res = runner.invoke(app, ["train", "--config", str(path)])
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert all(report[s].get("skipped") for s in ("synth", "vocab", "cache")) == (i > 0)
        assert (tmp_path / "work" / "cache" / "train" / "meta.json").exists() and "features" not in report["train"]
        assert report["train"]["drafter"] == kind and report["train"]["loss"] == expected_loss[kind]
        assert report["train"]["num_steps"] == 3 and report["calibrate"]["skipped"]
        assert (tmp_path / "work" / "runs" / f"tiny_{kind}" / "trained" / "model.safetensors").exists()
        drafter = make_drafter(kind, tiny_target, path=str(tmp_path / kind))
        assert drafter.name == kind and isinstance(drafter, DSparkDrafter if kind == "dflash" else ARDrafter)
        spec = Engine(EngineConfig(target=str(tiny_target_dir), scheduler="fixed", num_draft_tokens=4,
                                   max_num_seqs=1, max_model_len=128), target=tiny_target, drafter=drafter)
        assert spec.generate([prompt], params)[0].output_ids == expected
    # every run keeps its own weights under runs/<name>: two runs of one kind (an ablation) never share them
    assert sorted(p.name for p in (tmp_path / "work" / "runs").iterdir()) == ["tiny_dflash", "tiny_eagle3", "tiny_mtp1"]
    assert not (tmp_path / "work" / "trained").exists()
    a, b = (PipelineConfig.model_validate({**base, "name": n, "output": "/tmp/x"}) for n in ("dspark_g4", "dspark_g8"))
    assert a.run_dir != b.run_dir and a.run_dir.parent == b.run_dir.parent == tmp_path / "work" / "runs"


def test_bad_pipeline_config_is_refused_with_a_reason(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({"name": "x", "work_dir": "/tmp/x", "output": "/tmp/y", "trian": {}}))
    res = CliRunner().invoke(app, ["train", "--config", str(path)])
    assert res.exit_code == 2 and "trian" in res.output
    for bad, reason in (({"drafter": "medusa"}, "drafter must be one of"),
                        ({"drafter": "dflash"}, "head_type: none"),
                        ({"drafter": "mtp1"}, "block_size: 1"),
                        ({"train": {"loss": "mse"}}, "train.loss")):
        path.write_text(yaml.safe_dump({"name": "x", "work_dir": "/tmp/x", "output": "/tmp/y", **bad}))
        res = CliRunner().invoke(app, ["train", "--config", str(path)])
        assert res.exit_code == 2 and reason in res.output, res.output


def test_calibration_without_held_out_prompts_is_skipped_with_the_reason(tiny_target_dir, tmp_path):
    """A corpus with no held-out prompt: STS is not fitted on zero rounds; the drafter is exported uncalibrated."""
    cfg = {
        "name": "tiny", "target": str(tiny_target_dir), "work_dir": str(tmp_path / "work"),
        "output": str(tmp_path / "ckpt"),
        "synth": {"num_prompts": 4, "num_stdlib_prompts": 1, "shard_size": 4, "prompt_max_tokens": 12,
                  "response_max_tokens": 16, "data_dir": str(tmp_path / "data")},
        "engine": {"drafter": "none", "scheduler": "fixed", "max_num_seqs": 4, "max_model_len": 128},
        "model": {"num_layers": 1, "block_size": 4, "markov_rank": 8, "draft_vocab_size": 40},
        "train": {"num_steps": 2, "batch_size": 2, "num_anchors": 3, "warmup_steps": 1, "heldout_fraction": 0.0},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    res = CliRunner().invoke(app, ["train", "--config", str(path)])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["calibrate"]["skipped"] and "no held-out prompts" in report["calibrate"]["reason"]
    assert not json.loads((tmp_path / "ckpt" / "config.json").read_text())["sts_temperatures"]  # none fitted
