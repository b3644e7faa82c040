"""Resuming a request whose verify worker died: on another worker, from its prompt plus the tokens already
streamed. The target conditioned on the same prefix continues the same distribution (lossless); no token the
client has seen is sent again or changed; greedy outputs are identical to a fault-free run."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import ray

from dspark.verify_service.async_engine import EngineDeadError
from dspark.verify_service.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

# how a worker's death shows up in its stream (killed, restarting, its node gone, a Serve replica gone)
WORKER_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ray.exceptions.ObjectLostError,
               ray.exceptions.RayTaskError)


@dataclass
class OpenedStream:
    outputs: AsyncIterator[RequestOutput]
    cancel: Callable[[], None]  # abort it worker-side (the client went away)
    worker: str  # who serves it ("" when the router chose and did not say)


async def resuming_stream(open_stream: Callable[[list[int], SamplingParams, str], Awaitable[OpenedStream]],
                          prompt_ids: list[int], params: SamplingParams, request_id: str, max_attempts: int,
                          on_failure: Callable[[str], None]) -> AsyncIterator[RequestOutput]:
    """Yield the request's outputs; when its stream breaks, `on_failure(worker)` and open it again for the
    rest (max_tokens less what was streamed; a seed moves on by as much). Counts stay per request."""
    emitted: list[int] = []
    base_verified = base_accepted = base_steps = 0
    for attempt in range(max_attempts):
        resumed = params if not emitted else dataclasses.replace(
            params, max_tokens=params.max_tokens - len(emitted),
            seed=None if params.seed is None else params.seed + len(emitted))
        opened = await open_stream(prompt_ids + emitted, resumed,
                                   request_id if attempt == 0 else f"{request_id}-r{attempt}")
        finished = failed = False
        last: RequestOutput | None = None
        try:
            async for out in opened.outputs:
                last = out
                emitted += out.new_token_ids
                yield dataclasses.replace(
                    out, request_id=request_id, num_prompt_tokens=len(prompt_ids),
                    output_ids=list(emitted) if out.is_finished else out.output_ids,
                    num_verified=base_verified + out.num_verified, num_accepted=base_accepted + out.num_accepted,
                    num_steps=base_steps + out.num_steps)
                if out.is_finished:
                    finished = True
                    return
            failed = True  # the stream ended without a finished output: its worker is gone
        except WORKER_GONE as exc:
            failed = True
            log.warning("worker %s failed under request %s (%d tokens streamed): resuming elsewhere (%r)",
                        opened.worker or "?", request_id, len(emitted), exc)
        finally:
            if not finished and not failed:
                opened.cancel()
            aclose = getattr(opened.outputs, "aclose", None)
            if aclose is not None:
                await aclose()
        on_failure(opened.worker)
        if last is not None:
            base_verified += last.num_verified
            base_accepted += last.num_accepted
            base_steps += last.num_steps
        if len(emitted) >= params.max_tokens:
            yield RequestOutput(request_id, [], list(emitted), True, "length", len(prompt_ids), base_verified,
                                base_accepted, num_steps=base_steps)
            return
    raise EngineDeadError(f"request {request_id}: no verify worker could finish it")
