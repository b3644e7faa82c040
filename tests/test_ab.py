"""A/B routing: sticky, weighted assignment; admin-only overrides; the arm named on every response; and
`dspark ab report` on the request log of a real two-arm server."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from dspark.bench.ab_report import ab_report, load_log
from dspark.cluster.ingress.ab import Arm, assign_arm, chosen_arm, validate_arms
from dspark.cluster.ingress.access import KeyRing, key_digest
from dspark.cluster.ingress.routes import build_fastapi
from dspark.config.engine import EngineConfig
from dspark.verify_service.async_engine import AsyncEngine
from dspark.verify_service.engine import Engine
from tests.test_http_guards import _uvicorn

ARMS = [Arm("dspark", 0.7), Arm("mtp1", 0.3)]


def test_assignment_is_sticky_and_the_split_follows_the_weights() -> None:
    users = [f"user-{i}" for i in range(5000)]
    first = [assign_arm(ARMS, u, None, f"r{i}") for i, u in enumerate(users)]
    again = [assign_arm(ARMS, u, "any-session", f"other{i}") for i, u in enumerate(users)]
    assert first == again  # the same user, every time, whatever the session or request
    share = Counter(first)["dspark"] / len(users)
    assert abs(share - 0.7) <= 0.03
    # sessions stick when there is no user
    assert {assign_arm(ARMS, None, "s-1", f"r{i}") for i in range(50)} == {assign_arm(ARMS, None, "s-1", "x")}


def test_changing_weights_moves_only_the_users_between_the_cut_points() -> None:
    users = [f"user-{i}" for i in range(4000)]
    before = [assign_arm(ARMS, u, None, "r") for u in users]
    after = [assign_arm([Arm("dspark", 0.5), Arm("mtp1", 0.5)], u, None, "r") for u in users]
    moved = [(b, a) for b, a in zip(before, after) if b != a]
    assert all(b == "dspark" and a == "mtp1" for b, a in moved)  # nobody moves the other way
    assert abs(len(moved) / len(users) - 0.2) <= 0.03


def test_overrides_are_honoured_for_admins_only_and_checked() -> None:
    user_arm = assign_arm(ARMS, "u", None, "r")
    other = "mtp1" if user_arm == "dspark" else "dspark"
    assert chosen_arm(ARMS, "u", None, "r", other, is_admin=False) == user_arm
    assert chosen_arm(ARMS, "u", None, "r", other, is_admin=True) == other
    with pytest.raises(ValueError, match="unknown arm"):
        chosen_arm(ARMS, "u", None, "r", "nope", is_admin=True)
    with pytest.raises(ValueError):
        validate_arms([Arm("a", 1), Arm("a", 1)])


def test_a_two_arm_server_routes_stickily_names_the_arm_and_reports_with_intervals(tiny_target, tmp_path) -> None:
    def engine(drafter: str) -> AsyncEngine:
        return AsyncEngine(Engine(EngineConfig(target=str(tiny_target.path), drafter=drafter, scheduler="fixed",
                                               scheduler_kwargs={"k": 1} if drafter != "none" else {},
                                               num_draft_tokens=1 if drafter != "none" else 0, max_num_seqs=4,
                                               max_model_len=128, draft_gate=False), target=tiny_target))
    engines = {"dspark": engine("ngram"), "mtp1": engine("none")}
    log = tmp_path / "requests.jsonl"
    app = build_fastapi(lambda: engines["dspark"], "tiny", keys=KeyRing([key_digest("u")], [key_digest("a")]),
                        arm_engines={k: (lambda e=e: e) for k, e in engines.items()}, arms=ARMS, request_log=log)
    try:
        with _uvicorn(app) as url, httpx.Client(base_url=url, timeout=60) as c:
            seen: dict[str, set[str]] = {}
            for i in range(60):
                user = f"user-{i % 20}"
                resp = c.post("/v1/completions", headers={"Authorization": "Bearer u"},
                              json={"model": "tiny", "prompt": "a b c a b c", "max_tokens": 8, "ignore_eos": True,
                                    "temperature": 0, "user": user})
                assert resp.status_code == 200
                seen.setdefault(user, set()).add(resp.headers["x-dspark-arm"])
            assert all(len(arms) == 1 for arms in seen.values())  # sticky
            assert {a for arms in seen.values() for a in arms} == {"dspark", "mtp1"}
            forced = c.post("/v1/completions", headers={"Authorization": "Bearer a", "x-dspark-arm": "mtp1"},
                            json={"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "user-0"})
            assert forced.headers["x-dspark-arm"] == "mtp1"
    finally:
        for e in engines.values():
            e.shutdown()
    records = load_log(log)
    assert len(records) == 61 and {r["arm"] for r in records} == {"dspark", "mtp1"}
    report = ab_report(records, num_resamples=200)
    assert report["alpha"] == 0.05 and set(report["arms"]) == {"dspark", "mtp1"}
    diff = report["differences"][[a for a in report["arms"] if a != report["baseline"]][0]]
    assert all(len(d["ci"]) == 2 and d["ci"][0] <= d["ci"][1] for d in diff.values() if d["ci"][0] == d["ci"][0])
    assert "is_sample_large_enough" in report["verdict"]
    print(json.dumps(report["verdict"]))
