"""What the HTTP layer needs from an engine: an AsyncEngine-shaped `generate()` and a `tokenizer` (the
in-process AsyncEngine and the pool engines behind a Serve deployment both satisfy it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from dspark.verify_service.request import RequestOutput, SamplingParams


class GenerateEngine(Protocol):
    """What the HTTP layer needs from an engine (AsyncEngine satisfies it)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def is_alive(self) -> bool: ...

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]: ...
