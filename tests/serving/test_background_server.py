"""`BackgroundServer`: given the front door it serves, closing it ends the live requests first
and returns within the bound ``specstate serve`` keeps on Ctrl-C."""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest

from specstate import AsyncEngine, Engine, EngineConfig, RequestLimits
from specstate.serving.background import BackgroundServer
from specstate.serving.openai_server import ServedModel, create_app
from specstate.serving.uvicorn_server import SHUTDOWN_BOUND_S
from specstate.tools.timed_worker import TimedWaitWorker

LIMITS = RequestLimits(vocab_size=32, max_context_len=8192)
LONG = {"model": "slow", "prompt": [1, 2, 3], "max_tokens": 4000, "stream": True}


def _lines(response: http.client.HTTPResponse) -> Iterator[str]:
    for raw in response:
        line = raw.decode().strip()
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


@pytest.mark.parametrize("with_front", [True, False])
def test_closing_with_a_stream_open(with_front: bool) -> None:
    """A stream with a minute of tokens to go: with ``front=``, `close` aborts it (a last chunk
    with ``finish_reason: "abort"``, then ``[DONE]``) and returns within `SHUTDOWN_BOUND_S`;
    without, uvicorn's grace period cancels the response instead, also within the bound."""
    worker = TimedWaitWorker(device_seconds=0.02)  # two tokens per 20 ms: ~40 s of stream
    front = AsyncEngine(Engine(worker, limits=LIMITS, config=EngineConfig(kv_tokens=16384)))
    app = create_app(front, ServedModel(name="slow", limits=LIMITS), close_on_shutdown=True)
    server = BackgroundServer(app, front=front if with_front else None).start()
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=60)
    rest: list[str] = []
    try:
        conn.request("POST", "/v1/completions", json.dumps(LONG).encode())
        response = conn.getresponse()
        assert response.status == 200
        events = _lines(response)
        assert json.loads(next(events))["choices"][0]["finish_reason"] is None
        reader = threading.Thread(target=lambda: rest.extend(_safe(events)), daemon=True)
        reader.start()
        started = time.monotonic()
        server.close()
        closed = time.monotonic() - started
        reader.join(10)
    finally:
        conn.close()
    assert closed < SHUTDOWN_BOUND_S, f"close took {closed:.1f} s"
    if with_front:
        assert rest[-1] == "[DONE]", rest[-3:]
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
    else:  # the response was cut, not ended: no [DONE]
        assert "[DONE]" not in rest


def _safe(events: Iterator[str]) -> list[str]:
    """The events until the connection ends, however it ends."""
    got: list[str] = []
    with contextlib.suppress(http.client.HTTPException, OSError):
        got.extend(events)
    return got
