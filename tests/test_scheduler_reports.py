"""A verify worker's reports to the real SchedulerActor go out at most once a `min_interval_s` (each is an actor call
on both ends, made after engine steps of tens of milliseconds), and every one of them is answered."""

from __future__ import annotations

import time

import ray

from dspark.actors.cluster_scheduler import WorkerLoad
from dspark.actors.scheduler_actor import SchedulerClient, get_or_create_scheduler


def _step_loop(client: SchedulerClient, seconds: float) -> None:
    """What VerifyWorker._after_step does after each engine step (a step every 5 ms here)."""
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        step += 1
        client.poll()
        if client.is_due:
            client.report(WorkerLoad("w0", 4, 0, 32, step, 5.0, 8.0, [[0.9, 0.7]] * 4))
        time.sleep(0.005)
    deadline = time.perf_counter() + 10
    while not client.is_due and time.perf_counter() < deadline:  # the last report's answer
        client.poll()
        time.sleep(0.01)


def test_reports_go_out_at_most_once_an_interval_and_each_is_answered() -> None:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        scheduler = get_or_create_scheduler("dspark-report-test", "dspark")
        ray.get(scheduler.ping.remote(), timeout=60)  # started
        every_step = SchedulerClient("dspark-report-test", "dspark")
        _step_loop(every_step, 1.0)
        num_every_step = ray.get(scheduler.snapshot.remote())["num_reports"]
        spaced = SchedulerClient("dspark-report-test", "dspark", min_interval_s=0.2)
        _step_loop(spaced, 1.0)
        num_spaced = ray.get(scheduler.snapshot.remote())["num_reports"] - num_every_step
        print(f"reports in 1 s of 5 ms steps: {num_every_step} after every answered step, {num_spaced} at most "
              "every 0.2 s")
        assert 4 <= num_spaced <= 6, num_spaced  # at 0, 0.2, ..., 1.0 s (a sent report waits for its answer)
        assert spaced.num_answers == num_spaced and spaced.is_reachable
        assert num_every_step > 3 * num_spaced
        ray.kill(scheduler)
    finally:
        ray.shutdown()
