"""The real Ray Serve app with two A/B arms and API keys from the serve config: keys guard every route, each
user sticks to one arm named in a header, an admin may pick the arm, and the request log feeds the report."""

from __future__ import annotations

from pathlib import Path

from dspark.bench.ab_report import ab_report, load_log
from dspark.cluster.ingress.access import key_digest
from tests.test_serve_http import MAX_MODEL_LEN, MODEL, serving

USER, ADMIN = "sk-user-1", "sk-admin-1"


def test_two_arms_behind_keys_on_serve(tiny_target_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    args = {"target": str(tiny_target_dir), "model_name": MODEL, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4,
            "num_threads": 1, "drafter": "ngram", "scheduler": "fixed", "num_draft_tokens": 3,
            "api_key_sha256": [key_digest(USER)], "admin_api_key_sha256": [key_digest(ADMIN)],
            "request_log": str(log),
            "ab_arms": [{"name": "dspark", "weight": 0.5},
                        {"name": "mtp1", "weight": 0.5,
                         "overrides": {"drafter": "none", "num_draft_tokens": 0}}]}
    user = {"Authorization": f"Bearer {USER}"}
    with serving(args, headers=user) as client:
        assert client.get("/health", headers={"Authorization": ""}).status_code == 401
        assert client.get("/health", headers=user).status_code == 200
        assert client.get("/v1/dspark/stats", headers=user).status_code == 403
        arms: dict[str, set[str]] = {}
        for i in range(24):
            u = f"u{i % 8}"
            resp = client.post("/v1/completions", headers=user, json={
                "model": MODEL, "prompt": "the cat and the dog", "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "user": u})
            assert resp.status_code == 200, resp.text
            arms.setdefault(u, set()).add(resp.headers["x-dspark-arm"])
        assert all(len(a) == 1 for a in arms.values()) and set().union(*arms.values()) == {"dspark", "mtp1"}
        forced = client.post("/v1/completions", headers={"Authorization": f"Bearer {ADMIN}", "x-dspark-arm": "mtp1"},
                             json={"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u0"})
        assert forced.headers["x-dspark-arm"] == "mtp1"
        ignored = client.post("/v1/completions", headers={**user, "x-dspark-arm": "mtp1"},
                              json={"model": MODEL, "prompt": "x", "max_tokens": 2, "user": "u0"})
        assert ignored.headers["x-dspark-arm"] == next(iter(arms["u0"]))  # a user key cannot override
    report = ab_report(load_log(log), num_resamples=200)
    assert report["arms"]["dspark"]["num_requests"] + report["arms"]["mtp1"]["num_requests"] == 26
