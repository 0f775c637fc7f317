"""``specstate bench serve --workload chat``: multi-turn chats, with and without speculation.

C concurrent clients (in a separate process, over HTTP) each hold conversations of ``--turns``
turns against ``POST /v1/chat/completions``: every turn sends the whole history so far (a system
message, the turns before with the assistant's replies, a new user message), streamed with
``stream_options.include_usage``, so each turn's prompt repeats the one before and the prefix
cache serves it (``usage.prompt_tokens_details.cached_tokens``). The server is
``specstate serve``'s app in this process, with the embedded model's byte codec and chat
template over a `TimedWaitWorker` device (asynchronous). R conversations run per round, twice:
``spec`` (every verify accepts ``--accept`` tokens) and ``nospec`` (the same device, one token
a forward: what the target alone makes in a step), alternated over ``--rounds``.

The report gives, per mode, medians over rounds of conversations/s, output tokens/s, TTFT and
ITL (the time between a turn's content deliveries) at p50/p90/p99, and the share of prompt
tokens the prefix cache supplied.
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
from typing import Any, Final

import attrs

from specstate.tools.bench_serve import Run, Timings, stream_chunks, summary_row

__all__ = ["run_chat"]

MODES: Final = ("spec", "nospec")
_SYSTEM: Final = "You are a terse assistant."


def _context(args: argparse.Namespace) -> int:
    """Tokens a conversation's last turn may hold: the history and its reply, generously."""
    return int(128 + args.turns * (args.max_tokens + 96))


def _serve_round(args: argparse.Namespace, speculative: bool) -> tuple[Run, float]:
    """One round of one mode: the server up, the clients' process run; its timings and the
    cached share of the prompt tokens."""
    from specstate import Engine, EngineConfig, RequestLimits
    from specstate.reference import embedded
    from specstate.serving.async_engine import AsyncEngine
    from specstate.serving.background import BackgroundServer
    from specstate.serving.chat_template import load_chat_template
    from specstate.serving.openai_server import ServedModel, create_app
    from specstate.serving.text import load_codec
    from specstate.tools.timed_worker import TimedWaitWorker

    context = _context(args)
    accept = args.accept if speculative else 1
    worker = TimedWaitWorker(device_seconds=args.device_ms * 1e-3, asynchronous=True, accept=accept)
    config = EngineConfig(
        overlap=True,
        page_size=16,
        kv_tokens=2 * args.clients * (context + 64),
        max_running=args.clients,
    )
    limits = RequestLimits(vocab_size=embedded.VOCAB_SIZE, max_context_len=context)
    model = ServedModel(
        name="bench",
        limits=limits,
        codec=load_codec(embedded.target_dir()),
        chat_template=load_chat_template(embedded.target_dir()),
    )
    front = AsyncEngine(Engine(worker, limits=limits, config=config), max_waiting=args.requests)
    try:
        with BackgroundServer(create_app(front, model), front=front) as server:
            host, port = server.url.removeprefix("http://").rsplit(":", 1)
            job = {
                "host": host,
                "port": int(port),
                "clients": args.clients,
                "conversations": args.requests,
                "turns": args.turns,
                "max_tokens": args.max_tokens,
            }
            code = "from specstate.tools.bench_serve_chat import client_main; client_main()"
            proc = subprocess.run(
                [sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True
            )
    finally:
        asyncio.run(front.close())
    if proc.returncode != 0:
        raise RuntimeError(f"the chat clients failed: {proc.stderr.strip()[-2000:]}")
    found = json.loads(proc.stdout)
    timings = Run(
        wall_s=found["wall_s"],
        ttft=tuple(found["ttft"]),
        itl=tuple(found["itl"]),
        tokens=found["tokens"],
        requests=found["requests"],
    )
    return timings, float(found["cached_share"])


async def _turn(
    job: dict[str, Any], history: list[dict[str, str]], rid: str, clock: Timings
) -> tuple[str, dict[str, Any]]:
    """One streamed chat turn over a raw connection; the reply and the usage."""
    payload = {
        "model": "bench",
        "messages": history,
        "max_completion_tokens": job["max_tokens"],
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    reply: list[str] = []
    usage: dict[str, Any] = {}
    async for chunk in stream_chunks(job, "/v1/chat/completions", payload, rid, clock):
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            piece = choice["delta"].get("content") or ""
            reply.append(piece)
            clock.tokens_in(rid, len(piece))  # a byte-level model: a character a token
    return "".join(reply), usage


def client_main() -> None:
    """The chat clients' process: run the job in ``sys.argv[1]``; print timings as JSON."""
    job = json.loads(sys.argv[1])
    clock = Timings()
    todo = deque(range(job["conversations"]))
    prompt_tokens = cached_tokens = 0

    async def conversation(index: int) -> None:
        nonlocal prompt_tokens, cached_tokens
        history = [{"role": "system", "content": _SYSTEM}]
        for turn in range(job["turns"]):
            history.append({"role": "user", "content": f"Question {turn} of talk {index}?"})
            reply, usage = await _turn(job, history, f"c{index}-t{turn}", clock)
            history.append({"role": "assistant", "content": reply})
            prompt_tokens += usage["prompt_tokens"]
            cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]

    async def client() -> None:
        while todo:
            await conversation(todo.popleft())

    async def main() -> float:
        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(job["clients"])))
        return time.perf_counter() - start

    wall = asyncio.run(main())
    result = attrs.asdict(clock.result(wall, job["conversations"]))
    print(json.dumps({**result, "cached_share": cached_tokens / max(prompt_tokens, 1)}))


def run_chat(args: argparse.Namespace) -> int:
    """Run the alternated rounds of the chat workload; print the table (or JSON); 2 on bad
    options or without the ``serve`` extra."""
    if min(args.clients, args.requests, args.rounds, args.turns) < 1 or not 1 <= args.accept <= 4:
        print(
            "specstate bench serve: --clients, --requests, --rounds and --turns must be >= 1, "
            "--accept in [1, 4]",
            file=sys.stderr,
        )
        return 2
    try:
        import jinja2  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("specstate bench serve: chat needs pip install 'specstate[serve]'", file=sys.stderr)
        return 2
    runs: dict[str, list[Run]] = {m: [] for m in MODES}
    shares: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(args.rounds):
        for mode in MODES:
            print(f"bench serve chat: round {i + 1}/{args.rounds}, {mode}", file=sys.stderr)
            found, share = _serve_round(args, speculative=mode == "spec")
            runs[mode].append(found)
            shares[mode].append(share)
    rows = {mode: summary_row(found) for mode, found in runs.items()}
    for mode, row in rows.items():
        row["conversations_per_s"] = row.pop("requests_per_s")
        row["cached_share"] = round(statistics.median(shares[mode]), 4)
    keys = ("clients", "requests", "turns", "max_tokens", "device_ms", "accept", "rounds")
    config = {k: getattr(args, k) for k in keys}
    if args.json:
        print(json.dumps({"bench": "serve", "workload": "chat", "config": config,
                          "results": rows}, indent=2))  # fmt: skip
        return 0
    print(
        f"{args.clients} clients, {args.requests} conversations of {args.turns} turns of "
        f"{args.max_tokens} tokens, device {args.device_ms:g} ms, {args.accept} tokens a "
        f"verify with speculation; medians of {args.rounds} alternated rounds"
    )
    print(f"{'mode':>7} {'conv/s':>8} {'tok/s':>9} {'cached':>7} {'TTFT p50':>9} {'p90':>7} "
          f"{'p99':>7} {'ITL p50':>8} {'p90':>7} {'p99':>7}")  # fmt: skip
    for mode, r in rows.items():
        print(
            f"{mode:>7} {r['conversations_per_s']:>8.2f} {r['tokens_per_s']:>9.0f} "
            f"{100 * r['cached_share']:>6.1f}% "
            f"{r['ttft_p50_ms']:>9.1f} {r['ttft_p90_ms']:>7.1f} {r['ttft_p99_ms']:>7.1f} "
            f"{r['itl_p50_ms']:>8.1f} {r['itl_p90_ms']:>7.1f} {r['itl_p99_ms']:>7.1f}"
        )
    return 0
