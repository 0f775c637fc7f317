"""`AsyncEngine`: the asyncio front door of one engine, driven by a thread of its own.

Every test bounds its coroutine with ``asyncio.wait_for`` (a hang fails, it does not block
the suite), runs the engine with the invariant checker after every step, and ends with every
stream ended. Tokens are checked against HF ``generate()`` (greedy) on a tiny checkpoint whose
drafter agrees with the target only partly, so accept lengths lie strictly between 1 and the
maximum.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest
from hf_oracle import greedy
from spec_checkpoints import FAMILIES, MIXED_PROMPTS, SpecCheckpoints
from spy_worker import SpyWorker

from specstate import (
    AsyncEngine,
    Engine,
    EngineConfig,
    EngineUnavailable,
    FinishReason,
    FinishState,
    InvalidRequest,
    QueueFull,
    RequestLimits,
    RequestStream,
    SamplingParams,
    UsageError,
)
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.request import Req, TopLogprobs
from specstate.engine.worker import OnPublish, WorkerProtocol
from specstate.tools.timed_worker import TimedWaitWorker

_T = TypeVar("_T")
NEW = 12
BOUND_S = 120.0  # generous: a hang fails the test instead of blocking the suite


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """Run ``coro`` on a fresh event loop, failing it if it takes more than `BOUND_S`."""
    return asyncio.run(asyncio.wait_for(coro, BOUND_S))


def checked_config(**overrides: Any) -> EngineConfig:
    """Overlap, a small pool, and every check after every step."""
    options: dict[str, Any] = {
        "overlap": True,
        "kv_tokens": 2048,
        "check_invariants": True,
        "check_ownership": True,
        **overrides,
    }
    return EngineConfig(**options)


def spec_engine(
    ckpt: SpecCheckpoints, worker: WorkerProtocol | None = None, **config: Any
) -> Engine:
    """An engine on the partly agreeing draft-model worker (or ``worker``)."""
    if worker is None:
        worker = ckpt.worker("draft_model", num_steps=3, agreeing=False)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=256)
    return Engine(worker, limits=limits, config=checked_config(**config))


def timed_engine(**config: Any) -> Engine:
    """An engine on the timed-wait stand-in worker (constant tokens, 2 accepted a round)."""
    return Engine(
        TimedWaitWorker(device_seconds=0.0),
        limits=RequestLimits(vocab_size=32, max_context_len=4096),
        config=checked_config(**{"kv_tokens": 8192, **config}),
    )


async def collect(stream: RequestStream) -> tuple[list[int], FinishState]:
    """Every token of ``stream`` and its finish."""
    tokens: list[int] = []
    async with stream:
        async for event in stream:
            tokens.extend(event.tokens)
    assert stream.finish is not None
    return tokens, stream.finish


async def assert_released(front: AsyncEngine) -> None:
    """Once idle: no open stream, no open slot, every KV page free."""
    await front.wait_idle()
    snap = await front.snapshot()
    assert snap.engine is not None
    assert snap.num_streams == 0
    assert snap.engine.num_open_slots == 0
    assert snap.engine.num_free_pages == snap.engine.num_pages
    assert snap.engine.deferred_releases == () and snap.engine.quarantined == ()


def test_concurrent_streams_emit_hf_greedy_tokens(partial_ckpt: SpecCheckpoints) -> None:
    """Concurrent greedy requests stream exactly HF generate()'s tokens, each once, then end."""

    async def main() -> list[tuple[list[int], FinishState]]:
        async with AsyncEngine(spec_engine(partial_ckpt)) as front:
            streams = [
                await front.submit(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
                for i, p in enumerate(MIXED_PROMPTS)
            ]
            outs = await asyncio.gather(*(collect(s) for s in streams))
            accept = [n for s in streams for n in s.accept_lengths]
            assert 1 < sum(accept) / len(accept) < 4  # partial acceptance, strictly inside
            assert any(1 < n < 4 for n in accept)
            await assert_released(front)
            return outs

    outs = run(main())
    for prompt, (tokens, finish) in zip(MIXED_PROMPTS, outs, strict=True):
        assert tokens == greedy(partial_ckpt.hf, prompt, NEW)
        assert finish.reason is FinishReason.LENGTH


@pytest.mark.parametrize("algorithm", FAMILIES)
def test_every_hidden_state_family_streams_hf_greedy_tokens(
    partial_ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """mtp, eagle3 and frozen_kv_mtp behind the async front: HF's tokens, partial acceptance."""

    async def main() -> list[tuple[list[int], FinishState]]:
        worker = partial_ckpt.worker(algorithm, num_steps=3, agreeing=False)
        async with AsyncEngine(spec_engine(partial_ckpt, worker, overlap=True)) as front:
            streams = [
                await front.submit(f"r{i}", p, SamplingParams(max_new_tokens=NEW))
                for i, p in enumerate(MIXED_PROMPTS)
            ]
            outs = await asyncio.gather(*(collect(s) for s in streams))
            accept = [n for s in streams for n in s.accept_lengths]
            assert 1 < sum(accept) / len(accept) < 4
            await assert_released(front)
            return outs

    for prompt, (tokens, _) in zip(MIXED_PROMPTS, run(main()), strict=True):
        assert tokens == greedy(partial_ckpt.hf, prompt, NEW)


def test_generate_yields_tokens_then_the_finish_last(partial_ckpt: SpecCheckpoints) -> None:
    """generate(): events in order, only the last one carries the finish."""

    async def main() -> list[tuple[tuple[int, ...], FinishState | None]]:
        async with AsyncEngine(spec_engine(partial_ckpt)) as front:
            sampling = SamplingParams(max_new_tokens=NEW, logprobs=True)
            return [(e.tokens, e.finish) async for e in front.generate("g", [5, 6, 7], sampling)]

    events = run(main())
    assert all(finish is None for _, finish in events[:-1])
    assert events[-1][1] is not None
    assert [t for tokens, _ in events for t in tokens] == greedy(partial_ckpt.hf, [5, 6, 7], NEW)


def test_a_stream_carries_logprobs_and_top_logprobs_aligned(partial_ckpt: SpecCheckpoints) -> None:
    """A stream's ``logprobs`` and ``top_logprobs`` grow with its events, one per token, and
    end equal to the request's; greedy: each token is the first of its alternatives."""

    async def main() -> tuple[list[int], list[float], list[TopLogprobs], Req]:
        worker = partial_ckpt.worker("draft_model", num_steps=3, agreeing=False)
        async with AsyncEngine(spec_engine(partial_ckpt, worker, overlap=True)) as front:
            sampling = SamplingParams(max_new_tokens=NEW, logprobs=True, top_logprobs=4)
            stream = await front.submit("t", [5, 6, 7], sampling)
            tokens: list[int] = []
            async with stream:
                async for event in stream:
                    tokens += event.tokens
                    assert stream.top_logprobs is not None and stream.logprobs is not None
                    assert len(stream.top_logprobs) == len(stream.logprobs) == len(tokens)
            assert max(stream.accept_lengths) > 1  # runs of several tokens per event
            assert stream.logprobs is not None and stream.top_logprobs is not None
            req = await front.read(lambda e: e.request("t"))
            return tokens, stream.logprobs, stream.top_logprobs, req

    tokens, logprobs, tops, req = run(main())
    assert tokens == greedy(partial_ckpt.hf, [5, 6, 7], NEW)
    assert tuple(tops) == req.top_logprobs and tuple(logprobs) == req.logprobs
    assert [top[0][0] for top in tops] == tokens
    assert [top[0][1] for top in tops] == pytest.approx(logprobs, abs=1e-6)


def test_cancelling_the_consumer_aborts_and_releases_kv() -> None:
    """A consumer task cancelled mid-stream aborts its request; its KV is released."""

    async def main() -> None:
        engine = timed_engine()
        async with AsyncEngine(engine) as front:
            first = asyncio.Event()

            async def consume() -> None:
                sampling = SamplingParams(max_new_tokens=3000, ignore_eos=True)
                async for _ in front.generate("long", [1, 2, 3], sampling):
                    first.set()

            task = asyncio.create_task(consume())
            await first.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await assert_released(front)
            snap = await front.snapshot()
            assert snap.num_cancelled == 1 and snap.num_ended == 1
            finish = await front.read(lambda e: e.request("long").finish)
            assert finish is not None and finish.reason is FinishReason.ABORT
            assert finish.finished_len < 3000

    run(main())


def test_leaving_a_stream_block_early_aborts_the_request() -> None:
    """Leaving ``async with stream`` before the end aborts the request at the next turn."""

    async def main() -> None:
        async with AsyncEngine(timed_engine()) as front:
            sampling = SamplingParams(max_new_tokens=3000, ignore_eos=True)
            stream = await front.submit("s", [1, 2], sampling)
            async with stream:
                async for event in stream:
                    assert event.tokens
                    break
            assert stream.is_over and stream.finish is None
            await assert_released(front)
            finish = await front.read(lambda e: e.request("s").finish)
            assert finish is not None and finish.reason is FinishReason.ABORT

    run(main())


def test_submit_from_many_threads_at_once(partial_ckpt: SpecCheckpoints) -> None:
    """Eight threads, each with its own event loop, submit at once; every stream is exact."""
    front_ready = threading.Event()
    holder: dict[str, AsyncEngine] = {}
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    async def client(t: int) -> None:
        front = holder["front"]
        barrier.wait()  # every thread submits at the same moment
        streams = [
            await front.submit(f"t{t}-{i}", prompt, SamplingParams(max_new_tokens=8))
            for i, prompt in enumerate(MIXED_PROMPTS[:3])
        ]
        for stream in streams:
            tokens, _ = await collect(stream)
            results[stream.request_id] = tokens

    def thread_main(t: int) -> None:
        front_ready.wait()
        try:
            run(client(t))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=thread_main, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()

    async def main() -> None:
        async with AsyncEngine(spec_engine(partial_ckpt)) as front:
            holder["front"] = front
            front_ready.set()
            for thread in threads:
                await asyncio.to_thread(thread.join, BOUND_S)
            await assert_released(front)
            assert (await front.snapshot()).num_submitted == 24

    run(main())
    assert errors == []
    expected = [greedy(partial_ckpt.hf, p, 8) for p in MIXED_PROMPTS[:3]]
    assert sorted(results) == sorted(f"t{t}-{i}" for t in range(8) for i in range(3))
    for rid, tokens in results.items():
        assert tokens == expected[int(rid.rpartition("-")[2])]


@pytest.mark.parametrize("drain", [True, False])
def test_close_ends_every_stream(partial_ckpt: SpecCheckpoints, drain: bool) -> None:
    """close(drain=True) finishes every live request; close(drain=False) aborts them."""

    async def main() -> None:
        front = AsyncEngine(spec_engine(partial_ckpt))
        sampling = SamplingParams(max_new_tokens=40)
        streams = [await front.submit(f"c{i}", p, sampling) for i, p in enumerate(MIXED_PROMPTS)]
        consumers = [asyncio.create_task(collect(s)) for s in streams]
        await front.close(drain=drain)
        outs = await asyncio.gather(*consumers)
        for prompt, (tokens, finish) in zip(MIXED_PROMPTS, outs, strict=True):
            if drain:
                assert finish.reason is FinishReason.LENGTH
                assert tokens == greedy(partial_ckpt.hf, prompt, 40)
            else:
                assert finish.reason is FinishReason.ABORT
        snap = await front.snapshot()
        assert snap.healthy and snap.engine is not None
        assert snap.engine.num_open_slots == 0
        assert snap.engine.num_free_pages == snap.engine.num_pages
        with pytest.raises(UsageError, match="after close"):
            await front.submit("late", [1, 2], sampling)
        with pytest.raises(UsageError, match="after close"):
            await front.read(lambda e: e.is_idle)
        await front.close()  # idempotent

    run(main())


class _RaisesOn(SpyWorker):
    """Delegates; the first forward whose batch holds ``victim`` raises, once."""

    def __init__(self, inner: WorkerProtocol, *, victim: str) -> None:
        super().__init__(inner)
        self._victim = victim
        self.failed_ids: tuple[str, ...] = ()

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Raise for the victim's first batch (remembering its requests), else delegate."""
        if not self.failed_ids and self._victim in batch.request_ids:
            self.failed_ids = batch.request_ids
            raise RuntimeError("device lost")
        return super().forward_batch_generation(batch, on_publish=on_publish)


def test_a_worker_that_raises_ends_only_its_batch(partial_ckpt: SpecCheckpoints) -> None:
    """A raising forward ends only its batch's streams (ERROR); the others finish exactly."""
    worker = _RaisesOn(
        partial_ckpt.worker("draft_model", num_steps=3, agreeing=False), victim="victim"
    )

    async def main() -> None:
        async with AsyncEngine(spec_engine(partial_ckpt, worker)) as front:
            sampling = SamplingParams(max_new_tokens=NEW)
            running = [await front.submit(f"w{i}", MIXED_PROMPTS[i], sampling) for i in range(2)]
            # both are decoding before the victim arrives
            firsts = [list((await anext(stream)).tokens) for stream in running]
            victim = await front.submit("victim", MIXED_PROMPTS[2], sampling)
            _, victim_finish = await collect(victim)
            outs = [await collect(s) for s in running]
            assert worker.failed_ids == ("victim",)
            assert victim_finish.reason is FinishReason.ERROR
            assert "device lost" in victim_finish.detail
            for i, (rest, finish) in enumerate(outs):
                assert finish.reason is FinishReason.LENGTH
                assert firsts[i] + rest == greedy(partial_ckpt.hf, MIXED_PROMPTS[i], NEW)
            later = await collect(await front.submit("later", MIXED_PROMPTS[3], sampling))
            assert later[0] == greedy(partial_ckpt.hf, MIXED_PROMPTS[3], NEW)
            assert front.is_healthy
            await assert_released(front)

    run(main())


class _Wedges(SpyWorker):
    """Delegates; its ``wedge_on``-th forward sets `wedged` and blocks until `release` (at
    most a minute)."""

    def __init__(self, inner: WorkerProtocol, *, wedge_on: int) -> None:
        super().__init__(inner)
        self._wedge_on = wedge_on
        self.wedged = threading.Event()
        self.release = threading.Event()

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Delegate; the wedged call first waits for `release`."""
        if len(self.calls) + 1 == self._wedge_on:
            self.wedged.set()
            self.release.wait(60)
        return super().forward_batch_generation(batch, on_publish=on_publish)


def test_a_wedged_worker_ends_every_stream_and_reports_unhealthy(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """A forward past forward_timeout_s: every stream ends, the front door reports unhealthy."""
    worker = _Wedges(partial_ckpt.worker("draft_model", num_steps=3, agreeing=False), wedge_on=3)

    async def outcome(stream: RequestStream) -> str:
        try:
            _, finish = await collect(stream)
        except EngineUnavailable as exc:
            return "unavailable" if "ForwardTimeout" in str(exc) else f"other: {exc}"
        assert finish.reason is FinishReason.ERROR and "ForwardTimeout" in finish.detail
        return "timed out"

    async def main() -> None:
        front = AsyncEngine(spec_engine(partial_ckpt, worker, forward_timeout_s=1.0))
        try:
            sampling = SamplingParams(max_new_tokens=200)
            streams = await asyncio.gather(
                *(front.submit(f"x{i}", p, sampling) for i, p in enumerate(MIXED_PROMPTS))
            )
            ends = await asyncio.gather(*(outcome(s) for s in streams))
            assert "timed out" in ends and set(ends) <= {"timed out", "unavailable"}
            assert not front.is_healthy
            failure = front.failure
            assert failure is not None and "ForwardTimeout" in str(failure)
            with pytest.raises(EngineUnavailable, match="ForwardTimeout"):
                await front.submit("after", [1, 2], sampling)
            snap = await front.snapshot()
            assert not snap.healthy and snap.num_streams == 0
            await front.close()  # returns at once: the driver already stopped
        finally:
            worker.release.set()

    run(main())


def test_a_close_with_a_timeout_returns_while_a_forward_hangs() -> None:
    """``close(timeout_s=...)`` while a forward hangs (no forward timeout): it raises
    `EngineUnavailable` after about ``timeout_s``, not when the forward ends; once the forward
    returns, the driver carries the close out (the stream ends with ABORT, the engine closes)."""
    worker = _Wedges(TimedWaitWorker(device_seconds=0.0), wedge_on=3)

    async def main() -> None:
        front = AsyncEngine(
            Engine(
                worker,
                limits=RequestLimits(vocab_size=32, max_context_len=512),
                config=checked_config(kv_tokens=1024),
            )
        )
        try:
            sampling = SamplingParams(max_new_tokens=200, ignore_eos=True)
            stream = await front.submit("x", [1, 2, 3], sampling)
            assert await asyncio.to_thread(worker.wedged.wait, BOUND_S)  # it hangs now
            started = asyncio.get_running_loop().time()
            with pytest.raises(EngineUnavailable, match="did not stop within 0.5 s"):
                await front.close(timeout_s=0.5)
            assert asyncio.get_running_loop().time() - started < 5.0
        finally:
            worker.release.set()
        _, finish = await collect(stream)
        assert finish.reason is FinishReason.ABORT
        await front.close(timeout_s=30)  # the driver stops once the forward returned
        snap = await front.snapshot()
        assert snap.healthy and snap.num_streams == 0 and snap.engine is not None
        assert snap.engine.num_free_pages == snap.engine.num_pages

    run(main())


def test_an_exception_out_of_step_fails_every_stream() -> None:
    """The driver dying (an error out of Engine.step) ends every stream; no hang."""

    async def main() -> None:
        engine = timed_engine()
        front = AsyncEngine(engine)
        sampling = SamplingParams(max_new_tokens=500, ignore_eos=True)
        streams = [await front.submit(f"d{i}", [1, 2, 3], sampling) for i in range(4)]

        def break_the_engine(e: Engine) -> None:
            def step() -> Any:
                raise RuntimeError("scheduler bug")

            e.step = step  # type: ignore[method-assign]

        await front.read(break_the_engine)
        for stream in streams:
            with pytest.raises(EngineUnavailable, match="scheduler bug") as info:
                await collect(stream)
            assert isinstance(info.value.__cause__, RuntimeError)
        assert not front.is_healthy
        with pytest.raises(EngineUnavailable):
            await front.submit("after", [1], sampling)
        await front.close()

    run(main())


class _Halt(BaseException):
    """A `BaseException` that is not an `Exception` (as a library's own cancellation is)."""


@pytest.mark.parametrize("kind", [_Halt, KeyboardInterrupt, SystemExit, GeneratorExit])
def test_a_read_that_raises_a_base_exception_fails_only_that_read(
    kind: type[BaseException],
) -> None:
    """``read(fn)`` whose ``fn`` raises a `BaseException` that is no `Exception`: the caller
    gets `UsageError` caused by it (its own loop goes on); the driver keeps running: a stream
    open across it ends with all its tokens, a new request is served, the front door is healthy."""

    async def main() -> None:
        async with AsyncEngine(timed_engine()) as front:
            sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
            stream = await front.submit("open", [1, 2, 3], sampling)

            def raise_it(engine: Engine) -> None:
                raise kind("raised by the read")

            with pytest.raises(UsageError, match=f"read.*fn raised {kind.__name__}") as info:
                await asyncio.wait_for(front.read(raise_it), 30)  # a hang fails here, fast
            assert isinstance(info.value.__cause__, kind)
            assert front.is_healthy and front.failure is None
            tokens, finish = await collect(stream)
            assert len(tokens) == 40 and finish.reason is FinishReason.LENGTH
            after = await collect(await front.submit("after", [1, 2, 3], sampling))
            assert len(after[0]) == 40 and after[1].reason is FinishReason.LENGTH
            assert await front.read(lambda engine: engine.is_closed) is False
            await assert_released(front)

    run(main())


def test_a_full_waiting_queue_refuses_with_queue_full() -> None:
    """With max_waiting requests waiting for admission, one more is refused; nothing is lost."""

    async def main() -> None:
        async with AsyncEngine(timed_engine(), max_waiting=2) as front:
            hold = threading.Event()
            blocked = asyncio.create_task(front.read(lambda e: hold.wait(60)))
            await asyncio.sleep(0)  # the read is queued first: the driver sits in it
            sampling = SamplingParams(max_new_tokens=5, ignore_eos=True)
            pending = [asyncio.create_task(front.submit(f"q{i}", [1], sampling)) for i in range(2)]
            await asyncio.sleep(0)
            assert front.num_waiting == 2
            with pytest.raises(QueueFull, match="max_waiting 2"):
                await front.submit("one-too-many", [1], sampling)
            hold.set()
            await blocked
            outs = [await collect(await task) for task in pending]
            assert [len(tokens) for tokens, _ in outs] == [5, 5]
            await assert_released(front)

    run(main())


def test_a_refused_request_raises_invalid_request() -> None:
    """Engine.submit's refusal (or a wrong type) reaches the caller; the front door stays up."""

    async def main() -> None:
        async with AsyncEngine(timed_engine()) as front:
            with pytest.raises(InvalidRequest, match="vocab"):
                await front.submit("bad", [1, 99], SamplingParams(max_new_tokens=4))
            sampling = SamplingParams(max_new_tokens=400, ignore_eos=True)
            live = await front.submit("dup", [1], sampling)
            with pytest.raises(InvalidRequest, match="live request already has this id"):
                await front.submit("dup", [2], sampling)
            await live.aclose()
            with pytest.raises(InvalidRequest, match="SamplingParams"):
                await front.submit("typo", [1], {"max_new_tokens": 4})  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="prompt_ids"):
                await front.submit("typo", 7, SamplingParams())  # type: ignore[arg-type]
            with pytest.raises(InvalidRequest, match="request id"):
                await front.submit(None, [1], SamplingParams())  # type: ignore[arg-type]
            assert front.is_healthy
            assert (await front.snapshot()).num_refused == 3

    run(main())


def test_abort_by_id_ends_the_stream_with_abort() -> None:
    """abort(id) ends a live request's stream with ABORT; an unknown id is not live."""

    async def main() -> None:
        async with AsyncEngine(timed_engine()) as front:
            sampling = SamplingParams(max_new_tokens=3000, ignore_eos=True)
            stream = await front.submit("a", [1, 2], sampling)
            assert await front.abort("a")
            tokens, finish = await collect(stream)
            assert finish.reason is FinishReason.ABORT and len(tokens) < 3000
            assert not await front.abort("a")
            assert not await front.abort("never")
            await assert_released(front)

    run(main())


def test_the_driver_sleeps_while_idle() -> None:
    """An idle driver blocks on the inbox's condition: it does not spin."""

    def driver_waits(thread: threading.Thread) -> bool:
        frame = sys._current_frames().get(thread.ident or 0)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        return "take" in names and "wait" in names

    async def main() -> None:
        async with AsyncEngine(timed_engine()) as front:
            await collect(await front.submit("s", [1], SamplingParams(max_new_tokens=9)))
            await front.wait_idle()
            (driver,) = [t for t in threading.enumerate() if t.name == "specstate-driver"]
            for _ in range(500):  # the driver gets to its wait right after answering
                if driver_waits(driver):
                    break
                await asyncio.sleep(0.01)
            assert driver_waits(driver)

    run(main())


def test_max_waiting_must_be_a_positive_integer() -> None:
    """A bad max_waiting is refused before any thread starts."""
    from specstate import InvalidConfig

    with timed_engine() as engine, pytest.raises(InvalidConfig, match="max_waiting"):
        AsyncEngine(engine, max_waiting=0)
