"""The ingress's readiness probe of a verify pool: "not yet" until the pool answers; once it has, a slow probe
(a busy pool) keeps it ready and a failing one (no replica, a dead one) does not."""

from __future__ import annotations

import asyncio

from dspark.cluster.pools.readiness import ReadinessProbe


def test_a_slow_probe_keeps_a_pool_that_answered_ready_and_a_failing_one_does_not() -> None:
    mode = {"now": "slow"}

    async def probe() -> None:
        if mode["now"] == "slow":
            await asyncio.sleep(0.5)
        elif mode["now"] == "fail":
            raise RuntimeError("no replica")

    async def run() -> list[bool]:
        ready = ReadinessProbe(probe, ttl_s=0.0, timeout_s=0.05)
        seen = [await ready.is_ready()]  # slow before it ever answered: warming up
        mode["now"] = "ok"
        seen.append(await ready.is_ready())
        mode["now"] = "slow"
        seen.append(await ready.is_ready())  # busy, not gone
        mode["now"] = "fail"
        seen.append(await ready.is_ready())
        mode["now"] = "slow"
        seen.append(await ready.is_ready())  # slow after a failure: not ready until it answers again
        return seen

    assert asyncio.run(run()) == [False, True, True, False, False]
