"""Tests for specstate.relay.streams: in-order work, event fences, errors and real overlap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from specstate.core.errors import InvalidConfig, RelayError
from specstate.relay.streams import CpuEvent, CpuStream, CudaStream, Stream, make_stream

GATE_TIMEOUT_S = 10.0  # a broken fence fails the test instead of hanging the suite
SLEEP_S = 0.2

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def stream() -> Iterator[CpuStream]:
    """A CPU stream closed after the test."""
    s = CpuStream("test")
    yield s
    s.close()


def _gate_wait(gate: threading.Event) -> None:
    if not gate.wait(GATE_TIMEOUT_S):
        raise TimeoutError("gate never opened")


def _open_later(gate: threading.Event) -> None:
    """Open ``gate`` from another thread shortly; passing never depends on the delay."""
    threading.Timer(0.05, gate.set).start()


def _raise(message: str) -> None:
    raise ValueError(message)


def test_work_runs_in_submission_order(stream: CpuStream) -> None:
    """Many tiny items append to a list in exactly the order they were submitted."""
    seen: list[int] = []
    for i in range(500):
        stream.submit(seen.append, i)
    stream.synchronize()
    assert seen == list(range(500))


def test_work_runs_on_the_worker_thread(stream: CpuStream) -> None:
    """Submitted work runs on the stream's own thread, not on the host's."""
    threads: list[int] = []
    stream.submit(lambda: threads.append(threading.get_ident()))
    stream.synchronize()
    assert threads != [threading.get_ident()]


def test_event_query_before_and_after(stream: CpuStream) -> None:
    """An event is pending while earlier work is blocked and complete once it has run."""
    gate = threading.Event()
    stream.submit(_gate_wait, gate)
    event = stream.record_event()
    assert not event.query()
    gate.set()
    event.synchronize()
    assert event.query()


def test_cross_stream_wait_orders_work_without_blocking_host() -> None:
    """Work on B after wait_event(A's event) sees all of A's earlier work; the host never waits."""
    seen: list[str] = []
    observed: list[list[str]] = []
    gate = threading.Event()
    with CpuStream("a") as a, CpuStream("b") as b:
        a.submit(_gate_wait, gate)
        a.submit(seen.append, "a")
        b.wait_event(a.record_event())  # returns at once although A is blocked
        b.submit(lambda: observed.append(list(seen)))
        b_done = b.record_event()
        assert not b_done.query()
        _open_later(gate)  # a broken wait lets B run (and see nothing) before this fires
        b.synchronize()
    assert observed == [["a"]]


def test_wait_stream_waits_for_everything_submitted(stream: CpuStream) -> None:
    """wait_stream orders later work after all work submitted to the other stream so far."""
    seen: list[str] = []
    gate = threading.Event()
    with CpuStream("sched") as sched:
        sched.submit(_gate_wait, gate)
        sched.submit(seen.append, "schedule")
        stream.wait_stream(sched)
        stream.submit(seen.append, "forward")
        _open_later(gate)
        stream.synchronize()
    assert seen == ["schedule", "forward"]


def test_error_is_reraised_at_sync_and_later_work_refused(stream: CpuStream) -> None:
    """A failing item's error surfaces at the next sync points; work behind it never runs."""
    seen: list[int] = []
    stream.submit(_raise, "boom in forward")
    stream.submit(seen.append, 1)
    event = stream.record_event()
    with pytest.raises(ValueError, match="boom in forward") as info:
        event.synchronize()
    assert any("stream 'test'" in note for note in info.value.__notes__)
    with pytest.raises(ValueError, match="boom in forward"):
        stream.synchronize()
    stream.submit(seen.append, 2)  # the stream was reset by synchronize
    stream.synchronize()
    assert seen == [2]


def test_error_crosses_a_stream_wait() -> None:
    """A stream that waits for a failed stream's event refuses its later work and reports it."""
    seen: list[str] = []
    with CpuStream("a") as a, CpuStream("b") as b:
        a.submit(_raise, "boom on a")
        b.wait_event(a.record_event())
        b.submit(seen.append, "b")
        with pytest.raises(ValueError, match="boom on a"):
            b.synchronize()
        with pytest.raises(ValueError, match="boom on a"):
            a.synchronize()
    assert seen == []


def test_submit_after_close_raises() -> None:
    """A closed stream refuses work with a RelayError; close is idempotent."""
    s = CpuStream("closing")
    s.close()
    s.close()
    with pytest.raises(RelayError, match="'closing' is closed"):
        s.submit(print, "never")


def test_close_runs_pending_work_and_reports_its_error() -> None:
    """close drains submitted work and re-raises an error nobody synchronized on."""
    seen: list[int] = []
    s = CpuStream("drain")
    s.submit(seen.append, 1)
    s.submit(_raise, "late failure")
    with pytest.raises(ValueError, match="late failure"):
        s.close()
    assert seen == [1]


def test_context_manager_is_single_use() -> None:
    """A stream context cannot be re-entered, during or after its use."""
    s = CpuStream("ctx")
    with s, pytest.raises(RelayError, match="single-use"):
        s.__enter__()
    with pytest.raises(RelayError, match="single-use"), s:
        pass


def _leave_context_by_exception() -> None:
    with CpuStream("mask") as s:
        s.submit(_raise, "inner")
        raise KeyError("outer")


def test_context_exit_does_not_mask_the_inflight_exception() -> None:
    """Leaving the context by an exception keeps that exception, not the stream's error."""
    with pytest.raises(KeyError, match="outer"):
        _leave_context_by_exception()


def test_own_work_runs_inline_and_own_events_are_complete(stream: CpuStream) -> None:
    """Work that submits to its own stream runs inline; its own recorded event is complete."""
    seen: list[str] = []
    events: list[CpuEvent] = []

    def outer() -> None:
        stream.submit(seen.append, "inner")
        events.append(stream.record_event())
        seen.append("outer-after")

    stream.submit(outer)
    stream.synchronize()
    assert seen == ["inner", "outer-after"]
    assert events[0].query()


def test_synchronize_from_own_work_is_refused(stream: CpuStream) -> None:
    """A stream item that synchronizes its own stream gets a RelayError, not a deadlock."""
    stream.submit(stream.synchronize)
    with pytest.raises(RelayError, match="deadlock"):
        stream.synchronize()


def test_synchronize_within_gives_up_and_abandon_does_not_wait() -> None:
    """A wedged item: the event times out, abandon returns at once, queued work runs later."""
    stream = CpuStream("wedge")
    release = threading.Event()
    ran: list[str] = []
    stream.submit(release.wait)
    stream.submit(ran.append, "queued")
    event = stream.record_event()
    assert event.synchronize_within(0.05) is False
    stream.abandon()  # returns without joining the wedged thread
    with pytest.raises(RelayError, match="closed"):
        stream.submit(ran.append, "refused")
    assert ran == []
    release.set()
    assert event.synchronize_within(10.0) is True
    assert ran == ["queued"]


def test_make_stream_picks_the_backend() -> None:
    """make_stream gives a CpuStream for the CPU and refuses device types it cannot order."""
    s = make_stream(torch.device("cpu"))
    assert isinstance(s, CpuStream)
    s.close()
    with pytest.raises(InvalidConfig, match="'meta'"):
        make_stream(torch.device("meta"))


def _overlap_ratio(device_work: Callable[[], object], host_work: Callable[[], object]) -> float:
    """Return elapsed(host ∥ device) / (host + device), each side timed alone first."""
    with CpuStream("overlap") as s:
        t0 = time.perf_counter()
        s.submit(device_work)
        s.synchronize()
        device_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        host_work()
        host_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        s.submit(device_work)
        host_work()
        s.synchronize()
        both_s = time.perf_counter() - t0
    return both_s / (host_s + device_s)


def test_timed_wait_device_overlaps_host_work(
    record_property: Callable[[str, object], None],
) -> None:
    """A 0.2 s device wait beside 0.2 s of host work costs about the max, not the sum."""
    ratio = _overlap_ratio(lambda: time.sleep(SLEEP_S), lambda: time.sleep(SLEEP_S))
    record_property("overlap_ratio_sleep", ratio)
    print(f"overlap ratio (timed wait): {ratio:.3f} (ideal 0.5, serial 1.0)")
    assert ratio < 0.85


def test_matmul_device_overlap_is_reported(
    record_property: Callable[[str, object], None],
) -> None:
    """A real torch matmul on the stream beside Python host work: the ratio is only reported."""
    a = torch.randn(1024, 1024)

    def forward() -> None:
        for _ in range(2):
            a @ a

    def host() -> None:
        total = 0
        for i in range(1_000_000):
            total += i

    ratio = min(_overlap_ratio(forward, host) for _ in range(3))
    record_property("overlap_ratio_matmul", ratio)
    print(f"overlap ratio (matmul vs Python, best of 3): {ratio:.3f} (ideal 0.5, serial 1.0)")
    assert ratio > 0.0


@pytest.mark.cuda
@needs_cuda
def test_cuda_stream_orders_kernels_and_events() -> None:
    """On CUDA, work and events are stream ordered and a cross-stream wait fences them."""
    device = torch.device("cuda")
    with make_stream(device, name="a") as a, make_stream(device, name="b") as b:
        assert isinstance(a, CudaStream)
        x = torch.zeros(1 << 20, device=device)
        torch.cuda.synchronize()
        a.submit(lambda: torch.cuda._sleep(50_000_000))  # type: ignore[no-untyped-call]
        a.submit(x.add_, 1.0)
        done = a.record_event()
        assert not done.query()
        b.wait_event(done)
        out: list[torch.Tensor] = []
        b.submit(lambda: out.append(x.sum()))
        b.synchronize()
        assert done.query()
        assert out[0].item() == float(1 << 20)


@pytest.mark.cuda
@needs_cuda
def test_cuda_stream_captures_host_errors() -> None:
    """On CUDA, an error of submitted host code surfaces at the next synchronize."""
    stream: Stream = make_stream(torch.device("cuda"), name="err")
    stream.submit(_raise, "cuda boom")
    with pytest.raises(ValueError, match="cuda boom"):
        stream.synchronize()
    stream.close()
