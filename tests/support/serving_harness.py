"""Test-only: the real server on 127.0.0.1 on a free port, and clients for it.

`serving` starts ``specstate serve``'s app over an engine with uvicorn on a thread
(`BackgroundServer`) and stops it, then closes the front door, at the end of the ``with``.
"""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import attrs
import openai
from openai.types import Completion, CompletionChoice

from specstate import AsyncEngine, AsyncEngineSnapshot, Engine
from specstate.serving.background import BackgroundServer
from specstate.serving.openai_server import DEFAULT_MAX_N, ServedModel, create_app

_T = TypeVar("_T")
BOUND_S = 300.0
"""Every wait of a serving test is bounded: a hang fails the test instead of the suite."""


def bounded(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on a fresh loop, failing it after `BOUND_S`."""
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


@attrs.frozen
class Served:
    """A running server: its URL, its front door and its model's name."""

    url: str
    front: AsyncEngine
    model: str

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.url.rsplit(":", 1)[1])

    def client(self) -> openai.OpenAI:
        """The real openai client, pointed here (no retries: a failure shows at once)."""
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
        )

    def async_client(self) -> openai.AsyncOpenAI:
        """The asyncio openai client, pointed here."""
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
        )

    def snapshot(self) -> AsyncEngineSnapshot:
        """The front door's snapshot once the engine is idle."""

        async def idle_snapshot() -> AsyncEngineSnapshot:
            await self.front.wait_idle()
            return await self.front.snapshot()

        return bounded(idle_snapshot())

    def request(
        self, method: str, path: str, body: bytes | None = None
    ) -> tuple[int, dict[str, Any]]:
        """A raw HTTP request; the status and the JSON body."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=BOUND_S)
        try:
            headers = {"Content-Type": "application/json"}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        return response.status, json.loads(payload)


@contextmanager
def serving(engine: Engine, model: ServedModel, *, max_n: int = DEFAULT_MAX_N) -> Iterator[Served]:
    """Serve ``engine`` as ``model`` for the ``with`` block; then stop and close everything."""
    front = AsyncEngine(engine)
    try:
        app = create_app(front, model, max_n=max_n)
        with BackgroundServer(app, front=front) as server:
            yield Served(url=server.url, front=front, model=model.name)
    finally:
        bounded(front.close())


def token_ids(choice: CompletionChoice) -> list[int]:
    """The output token ids of a choice (the server's ``token_ids`` extension)."""
    extra = choice.model_extra or {}
    return [int(t) for t in extra["token_ids"]]


def speculative_usage(completion: Completion) -> dict[str, float]:
    """The usage's speculative statistics (the server's extension)."""
    assert completion.usage is not None
    extra = completion.usage.model_extra or {}
    stats: dict[str, float] = extra["speculative"]
    return stats
