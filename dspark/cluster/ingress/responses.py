"""From the engine's output stream to the HTTP response: submit and wait for the first output, hold the
admission ticket until the stream closes, then SSE chunks or one full body."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from dspark.cluster.ingress.ab import ARM_HEADER
from dspark.cluster.ingress.api_models import ErrorInfo, ErrorResponse
from dspark.cluster.ingress.engine import GenerateEngine
from dspark.cluster.ingress.errors import ApiError
from dspark.cluster.ingress.request_log import RequestRecord
from dspark.cluster.ingress.text_stream import TextStream
from dspark.verify_service.async_engine import EngineDeadError
from dspark.verify_service.request import RequestOutput, SamplingParams

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def start_request(engine: GenerateEngine, prompt_ids: list[int], params: SamplingParams
                 ) -> tuple[AsyncIterator[RequestOutput], RequestOutput]:
    """Submit the request and wait for its first output, so a rejected request is still a 400."""
    gen = engine.generate(prompt_ids, params)
    try:
        first = await anext(gen)
    except ValueError as exc:
        await gen.aclose()
        raise ApiError(400, str(exc)) from exc
    except BaseException:
        await gen.aclose()
        raise
    return gen, first


class Released:  # noqa: N801 - used like the generator it wraps
    """The engine's output stream holding an admission ticket, given back exactly once on close
    (an async generator that never started would skip its `finally`, and leak the ticket)."""

    def __init__(self, gen: Any, on_close: Callable[[], None] | None) -> None:
        self.gen, self.on_close, self.is_closed = gen, on_close, False

    def __aiter__(self) -> Released:
        return self

    async def __anext__(self) -> RequestOutput:
        try:
            return await anext(self.gen)
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        if self.is_closed:
            return
        self.is_closed = True
        try:
            await self.gen.aclose()
        finally:
            if self.on_close is not None:
                self.on_close()


async def outputs_of(first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    yield first
    if first.is_finished:
        return
    async for out in gen:
        yield out


async def respond(is_stream: bool, first: RequestOutput, gen: AsyncIterator[RequestOutput], stream: TextStream,
                   chunk: Callable[[str, bool], str], full: Callable[[], Any], record: RequestRecord) -> Any:
    """SSE of `chunk`s when streaming; otherwise run the request to the end and build `full()`."""
    if is_stream:
        return StreamingResponse(sse(first, gen, stream, chunk, record), media_type="text/event-stream",
                                 headers={**SSE_HEADERS, ARM_HEADER: record.arm})
    await drain(first, gen, stream, record)
    return full()


async def drain(first: RequestOutput, gen: AsyncIterator[RequestOutput], stream: TextStream,
                 record: RequestRecord) -> None:
    # aclose in finally: a client that hangs up cancels us here, and closing the engine's
    # generator is what aborts the request and frees its cache slot
    is_error, is_aborted = True, False
    try:
        async for out in outputs_of(first, gen):
            stream.add(out)
            record.on_output(out)
        is_error = False
    except (asyncio.CancelledError, GeneratorExit):
        is_aborted = True
        raise
    finally:
        await gen.aclose()
        record.write(stream, is_error and not is_aborted, is_aborted)


async def sse(first: RequestOutput, gen: AsyncIterator[RequestOutput], stream: TextStream,
               chunk: Callable[[str, bool], str], record: RequestRecord) -> AsyncIterator[str]:
    is_error, is_aborted = True, False
    try:
        async for out in outputs_of(first, gen):
            stream.add(out)
            record.on_output(out)
            text = stream.delta()
            if out.is_finished:
                yield chunk(text, True)
            elif text:
                yield chunk(text, False)
    except EngineDeadError as exc:  # headers are sent: report in-band, without internals
        log.warning("stream failed: %s", exc)
        info = ErrorInfo(message="the engine became unavailable; retry later", type="service_unavailable_error")
        yield f"data: {ErrorResponse(error=info).model_dump_json()}\n\n"
    except (asyncio.CancelledError, GeneratorExit):  # the client hung up mid-stream
        is_aborted = True
        raise
    else:
        is_error = False
    finally:
        await gen.aclose()
        record.write(stream, is_error and not is_aborted, is_aborted)
    yield "data: [DONE]\n\n"
