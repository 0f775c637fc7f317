"""``specstate bench serve``: serving under load, and what the front door costs.

C concurrent clients (closed loop: each sends its next request when the last one ended) run R
requests of ``--max-tokens`` tokens against a `TimedWaitWorker` device (asynchronous: a forward
is enqueued and its result is ready ``--device-ms`` later, as on a GPU), three ways:

* ``direct``: one thread drives the `Engine` itself (`StreamCursor`), submitting a client's
  next request right after the step that ended its last one: the baseline;
* ``async``: the same clients as coroutines on an event loop, through `AsyncEngine` (the
  front door: driver thread, inbox, per-step hand-off to the loop);
* ``http``: the same clients in a separate process, over HTTP with server-sent events, against
  ``specstate serve``'s app (uvicorn) in this process.

``--workload chat`` runs multi-turn conversations over ``/v1/chat/completions`` instead, with and
without speculation (`specstate.tools.bench_serve_chat`).

Each mode runs ``--rounds`` times, alternated (direct, async, http, direct, ...), and the report
gives medians over rounds: requests/s, output tokens/s, time to first token (TTFT) and the
time between a request's token deliveries (ITL; a delivery carries the tokens one verify
accepted) at p50/p90/p99 of all requests of the round, and the throughput loss of each mode
against ``direct``. Times are taken where the client sees the tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import attrs

if TYPE_CHECKING:
    from specstate.core.params import SamplingParams
    from specstate.engine.engine import Engine

__all__ = ["add_parser", "run"]

_PROMPT: Final = tuple(range(1, 9))
_VOCAB: Final = 32
_MODES: Final = ("direct", "async", "http")


def add_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``serve`` on ``bench``'s subparsers."""
    parser: argparse.ArgumentParser = benches.add_parser(
        "serve", help="serving load: the front door and HTTP against the engine driven directly"
    )
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--requests", type=int, default=256, help="requests per round")
    parser.add_argument("--max-tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument("--device-ms", type=float, default=10.0, help="forward time")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds per mode")
    parser.add_argument(
        "--modes", default=",".join(_MODES), help="comma-separated: direct,async,http"
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    parser.add_argument(
        "--workload",
        choices=("completions", "chat"),
        default="completions",
        help="completions (the modes above) or chat: multi-turn conversations over HTTP, with "
        "and without speculation (specstate.tools.bench_serve_chat)",
    )
    parser.add_argument("--turns", type=int, default=4, help="chat: turns per conversation")
    parser.add_argument(
        "--accept", type=int, default=2, help="chat: tokens a verify accepts with speculation"
    )


@attrs.frozen(kw_only=True)
class Run:
    """One round of one mode: every request's timings, seconds."""

    wall_s: float
    ttft: tuple[float, ...]
    itl: tuple[float, ...]
    tokens: int
    requests: int


class Timings:
    """Per-request clocks, filled as tokens reach the client."""

    def __init__(self) -> None:
        self.sent: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0

    def send(self, rid: str) -> None:
        self.sent[rid] = time.perf_counter()

    def tokens_in(self, rid: str, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        self.tokens += count
        last = self.last.get(rid)
        if last is None:
            self.ttft.append(now - self.sent[rid])
        else:
            self.itl.append(now - last)
        self.last[rid] = now

    def result(self, wall_s: float, requests: int) -> Run:
        return Run(
            wall_s=wall_s,
            ttft=tuple(self.ttft),
            itl=tuple(self.itl),
            tokens=self.tokens,
            requests=requests,
        )


def _engine(args: argparse.Namespace) -> Engine:
    from specstate import Engine, EngineConfig, RequestLimits
    from specstate.tools.timed_worker import TimedWaitWorker

    worker = TimedWaitWorker(device_seconds=args.device_ms * 1e-3, asynchronous=True)
    context = len(_PROMPT) + args.max_tokens
    per_request = context + 64  # the reservation and page rounding, generously
    config = EngineConfig(
        overlap=True,
        page_size=16,
        kv_tokens=args.clients * per_request + 64,
        max_running=args.clients,
        max_prefill_tokens=max(4096, args.clients * len(_PROMPT)),
    )
    limits = RequestLimits(vocab_size=_VOCAB, max_context_len=context)
    return Engine(worker, limits=limits, config=config)


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from specstate import SamplingParams

    return SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)


# ---------------------------------------------------------------------- direct
def _run_direct(args: argparse.Namespace) -> Run:
    from specstate.engine.stream import StreamCursor

    sampling = _sampling(args)
    clock = Timings()
    todo = deque(f"r{i}" for i in range(args.requests))
    with _engine(args) as engine:
        cursor = StreamCursor(engine)
        start = time.perf_counter()
        for _ in range(min(args.clients, len(todo))):
            rid = todo.popleft()
            clock.send(rid)
            engine.submit(rid, _PROMPT, sampling)
        while not engine.is_idle:
            for event in cursor.step():
                clock.tokens_in(event.request_id, len(event.tokens))
                if event.finish is not None and todo:
                    rid = todo.popleft()
                    clock.send(rid)
                    engine.submit(rid, _PROMPT, sampling)
        wall = time.perf_counter() - start
    return clock.result(wall, args.requests)


# ------------------------------------------------------------------------ async
def _run_async(args: argparse.Namespace) -> Run:
    from specstate.serving.async_engine import AsyncEngine

    sampling = _sampling(args)
    clock = Timings()
    todo = deque(f"r{i}" for i in range(args.requests))

    async def client(front: AsyncEngine) -> None:
        while todo:
            rid = todo.popleft()
            clock.send(rid)
            async for event in front.generate(rid, _PROMPT, sampling):
                clock.tokens_in(rid, len(event.tokens))

    async def main() -> float:
        async with AsyncEngine(_engine(args), max_waiting=args.requests) as front:
            start = time.perf_counter()
            await asyncio.gather(*(client(front) for _ in range(args.clients)))
            return time.perf_counter() - start

    wall = asyncio.run(main())
    return clock.result(wall, args.requests)


# ------------------------------------------------------------------------- http
def _run_http(args: argparse.Namespace) -> Run:
    from specstate import RequestLimits
    from specstate.serving.async_engine import AsyncEngine
    from specstate.serving.background import BackgroundServer
    from specstate.serving.openai_server import ServedModel, create_app

    front = AsyncEngine(_engine(args), max_waiting=args.requests)
    context = len(_PROMPT) + args.max_tokens
    model = ServedModel(
        name="bench", limits=RequestLimits(vocab_size=_VOCAB, max_context_len=context)
    )
    try:
        with BackgroundServer(create_app(front, model), front=front) as server:
            host, port = server.url.removeprefix("http://").rsplit(":", 1)
            job = {
                "host": host,
                "port": int(port),
                "clients": args.clients,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
            }
            code = "from specstate.tools.bench_serve import client_main; client_main()"
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(job)],
                capture_output=True,
                text=True,
                check=True,
            )
    finally:
        asyncio.run(front.close())
    found = json.loads(proc.stdout)
    return Run(
        wall_s=found["wall_s"],
        ttft=tuple(found["ttft"]),
        itl=tuple(found["itl"]),
        tokens=found["tokens"],
        requests=found["requests"],
    )


async def stream_chunks(
    job: dict[str, Any], path: str, payload: dict[str, Any], rid: str, clock: Timings
) -> AsyncIterator[dict[str, Any]]:
    """POST ``payload`` to ``path`` over a raw connection (``job``'s host and port) and yield
    each streamed chunk, parsed, as it arrives; the request is sent at ``clock.send(rid)``.

    Raises:
        RuntimeError: a chunk carries an error.
    """
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {job['host']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    reader, writer = await asyncio.open_connection(job["host"], job["port"])
    clock.send(rid)
    writer.write(head + body)
    await writer.drain()
    try:
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue  # status, headers, chunk sizes, blank lines
            if line.startswith(b"data: [DONE]"):
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"request {rid}: {chunk['error']}")
            yield chunk
    finally:
        writer.close()


async def _http_request(job: dict[str, Any], rid: str, clock: Timings) -> None:
    """One streamed completion over a raw connection; its chunks timed as they arrive."""
    payload = {
        "model": "bench",
        "prompt": list(_PROMPT),
        "max_tokens": job["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async for chunk in stream_chunks(job, "/v1/completions", payload, rid, clock):
        clock.tokens_in(rid, len(chunk["choices"][0]["token_ids"]))


def client_main() -> None:
    """The HTTP clients' process: run the job in ``sys.argv[1]``; print timings as JSON."""
    job = json.loads(sys.argv[1])
    clock = Timings()
    todo = deque(f"r{i}" for i in range(job["requests"]))

    async def client() -> None:
        while todo:
            await _http_request(job, todo.popleft(), clock)

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(job["clients"])))
        return time.perf_counter() - start

    wall = asyncio.run(main())
    result = clock.result(wall, job["requests"])
    print(json.dumps(attrs.asdict(result)))


# ----------------------------------------------------------------------- report
def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def summary_row(runs: list[Run]) -> dict[str, float]:
    """Medians over rounds of one mode's numbers (latencies in ms)."""

    def median(fn: Callable[[Run], float]) -> float:
        return round(statistics.median(fn(r) for r in runs), 3)

    row = {
        "requests_per_s": median(lambda r: r.requests / r.wall_s),
        "tokens_per_s": median(lambda r: r.tokens / r.wall_s),
        "tokens": median(lambda r: r.tokens),  # every request's every token reached its client
    }
    for name in ("ttft", "itl"):
        for q in (0.5, 0.9, 0.99):

            def latency_ms(r: Run, name: str = name, q: float = q) -> float:
                return 1e3 * _percentile(getattr(r, name), q)

            row[f"{name}_p{round(q * 100)}_ms"] = median(latency_ms)
    return row


_RUNNERS: Final = {"direct": _run_direct, "async": _run_async, "http": _run_http}


def run(args: argparse.Namespace) -> int:
    """Run the alternated rounds; print the table (or JSON); 2 on bad options."""
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(_MODES) or min(args.clients, args.requests, args.rounds) < 1:
        print(f"specstate bench serve: modes are {','.join(_MODES)}", file=sys.stderr)
        return 2
    if "http" in modes:
        try:
            import starlette  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError:
            print(
                "specstate bench serve: http needs pip install 'specstate[serve]'", file=sys.stderr
            )
            return 2
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for i in range(args.rounds):
        for mode in modes:
            print(f"bench serve: round {i + 1}/{args.rounds}, {mode}", file=sys.stderr, flush=True)
            runs[mode].append(_RUNNERS[mode](args))
    rows = {mode: summary_row(found) for mode, found in runs.items()}
    base = rows.get("direct")
    for row in rows.values():
        if base is not None:
            row["throughput_loss"] = round(1 - row["tokens_per_s"] / base["tokens_per_s"], 4)
    config = {k: getattr(args, k) for k in ("clients", "requests", "max_tokens", "device_ms")}
    if args.json:
        print(json.dumps({"bench": "serve", "config": {**config, "rounds": args.rounds},
                          "results": rows}, indent=2))  # fmt: skip
        return 0
    print(
        f"{args.clients} clients, {args.requests} requests of {args.max_tokens} tokens, "
        f"device {args.device_ms:g} ms; medians of {args.rounds} alternated rounds"
    )
    print(f"{'mode':>7} {'req/s':>8} {'tok/s':>9} {'loss':>7} {'TTFT p50':>9} {'p90':>7} "
          f"{'p99':>7} {'ITL p50':>8} {'p90':>7} {'p99':>7}")  # fmt: skip
    for mode, r in rows.items():
        loss = f"{100 * r['throughput_loss']:.1f}%" if "throughput_loss" in r else "-"
        print(
            f"{mode:>7} {r['requests_per_s']:>8.1f} {r['tokens_per_s']:>9.0f} {loss:>7} "
            f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p90_ms']:>7.1f} {r['ttft_p99_ms']:>7.1f} "
            f"{r['itl_p50_ms']:>8.1f} {r['itl_p90_ms']:>7.1f} {r['itl_p99_ms']:>7.1f}"
        )
    return 0
