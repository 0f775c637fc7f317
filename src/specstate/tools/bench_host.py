"""``specstate bench host``: the host cost of one speculative decode round, `Engine.step` whole.

Each timed sample is one `Engine.step` of a decode round in the normal loop — schedule (the
persistent rows, the 2L reservation), launch (relay, isolation, the worker, the result check,
publish, stash), settle (commit, outputs, finishes), the end of finished requests and the
release of their KV — plus what a streaming server reads after it: the new tokens of every
request, each run counted and dropped as it is read (as the peer harness does). Only the
forward is left out (as on a peer's side): the worker replays precomputed results, and the
time inside its call is subtracted.

The workloads (`specstate.tools.host_workload`): **churned** (default; requests finish on EOS
inside accepted runs or on their cap, and new ones join every round at a steady batch size)
and **steady** (nobody finishes). Joiners' prefill runs in an untimed step between rounds.

Device work is modelled the same way on both sides of a comparison: every write into
``req_to_token`` — a kernel launch on a GPU — costs a fixed ``launch_us`` (a spin), as each of
the peer's Triton kernels does in its harness; the relay's gathers of the stashed payload
(`specstate.relay.write_log`'s ``_gather`` and ``_patch_rows``: on a GPU, kernels over device
tensors, as the peer's fused ``gather_spec_extras`` kernel is) do their work untimed and cost
one ``launch_us`` per gather and per scatter, where the peer's fused kernel costs one for all
four buffers. Every other torch operation runs (on the CPU) inside the timed region.

``--launch-model ops`` is the launch model every side of ``benchmarks/run_host_comparison.sh``
shares instead (`specstate.tools.host_ops`): each run is first replayed untimed with its tensor
operations counted (a store into ``req_to_token`` and each gather or scatter of the relay count
as one each, their work untimed as above; on the device path, ``--device cpu:0``, the store
into the table's device copy counts as its two launches, a host-to-device copy and an indexed
store, its work untimed too), then replayed timed without any spin, and each
round is charged ``launch_us`` per counted operation. ``--handoff`` also times each round with
its output hand-off in place of the streaming read: what an `AsyncEngine` does after a step to
hand the step's tokens to its request streams (`specstate.tools.host_handoff`).
``--device cpu:0`` runs the engine's device path on the CPU (the device audit's device: the
result is copied, not viewed, the slot table is mirrored in a tensor, the decode columns are
copied over), as a peer harness runs its peer's device path on the CPU; ``cpu`` (the default)
is the host path. glibc's
allocator thresholds are set at start (``mallopt``), the same values the peer harness sets,
because allocator state changes host figures severalfold.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch

import specstate
import specstate.relay.write_log as write_log
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvariantViolation
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.engine.capabilities.delivery import Deliveries
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.memory.host_arrays import IntArray
from specstate.memory.slots import ReqToTokenPool
from specstate.relay.future_map import RelayPayload
from specstate.relay.streams import CpuStream
from specstate.tools import host_workload as wl
from specstate.tools.draft_shapes import DRAFT_SHAPES, DraftShape
from specstate.tools.host_handoff import StreamHandOff
from specstate.tools.host_ops import OpCounter

__all__ = ["HostSettings", "host_benchmark"]

STEPS = 3
DRAFT_TOKENS = 4
HIDDEN = 256
CONTEXT = 4096
PAYLOAD_SETS = 4
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


@attrs.frozen(kw_only=True)
class HostSettings:
    """Everything that defines a run, echoed in the report."""

    workload: str = "churn"
    page_sizes: tuple[int, ...] = (1, 16)
    batch_sizes: tuple[int, ...] = (1, 64, 256, 1024)
    iters: int = 300
    warmup: int = 20
    repeats: int = 5
    launch_us: float = 5.0
    mmap_threshold: int = 64 << 20
    trim_threshold: int = 256 << 20
    algorithm: str = "eagle"
    launch_model: str = "stand-ins"
    handoff: bool = False
    device: str = "cpu"


def set_allocator(settings: HostSettings) -> bool:
    """Set glibc's mmap and trim thresholds (``mallopt``); False where that is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, settings.mmap_threshold) == 1
    return bool(ok and mallopt(M_TRIM_THRESHOLD, settings.trim_threshold) == 1)


LAUNCH_NS = [5000]
"""The modelled cost of one device launch (``--launch-us``), set by `host_benchmark`."""
UNCHARGED = [0, 0]
"""Wall and CPU ns inside the timed region that the round is not charged: the modelled device
work's own time (its launches are charged), and with ``--handoff`` the delivery record's."""
COUNTER = OpCounter()
"""Counts a round's tensor operations in the counting replay of ``--launch-model ops``."""
SPIN = [True]
"""Whether modelled launches spin (``stand-ins``) or are counted and charged (``ops``)."""


def _device_kernel(fn: Callable[..., Any], launches: Callable[..., int]) -> Callable[..., Any]:
    """``fn``, device work: its effect untimed, then ``launches(*args)`` modelled launches
    (spun, or counted by `COUNTER`)."""

    def kernel(*args: Any) -> Any:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return COUNTER.kernel(launches(*args), fn, *args)
        finally:
            UNCHARGED[1] += time.thread_time_ns() - c0
            UNCHARGED[0] += time.perf_counter_ns() - t0
            if SPIN[0]:
                for _ in range(launches(*args)):
                    _spin(LAUNCH_NS[0])

    return kernel


def _uncharged(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, its time not charged to the round (the delivery record, timed as hand-off)."""

    def call(*args: Any) -> Any:
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args)
        finally:
            UNCHARGED[1] += time.thread_time_ns() - c0
            UNCHARGED[0] += time.perf_counter_ns() - t0
            HANDOFF[1] += time.thread_time_ns() - c0
            HANDOFF[0] += time.perf_counter_ns() - t0

    return call


HANDOFF = [0, 0]
"""Wall and CPU ns of the delivery record inside a step (``--handoff``): part of the hand-off."""


def _spin(ns: int) -> None:
    end = time.perf_counter_ns() + ns
    while time.perf_counter_ns() < end:
        pass


class _ReplayWorker:
    """Returns precomputed results: per-slot accept lengths and runs set between rounds."""

    def __init__(self, max_slots: int, bs: int, shape: DraftShape) -> None:
        self.accept = np.ones(max_slots, dtype=np.int64)
        self.tokens = np.full((max_slots, DRAFT_TOKENS), wl.FILLER, dtype=np.int64)
        self._accept_t = torch.from_numpy(self.accept)
        self._tokens_t = torch.from_numpy(self.tokens)
        self._shape = shape
        gen = torch.Generator().manual_seed(9012)
        self._payloads = [_payload(max(bs, 1), gen, shape) for _ in range(PAYLOAD_SETS)]
        self._round = 0
        self.spent = [0, 0]  # wall and CPU ns inside forwards since the loop reset it

    @property
    def capabilities(self) -> WorkerCapabilities:
        return WorkerCapabilities(
            algorithm=self._shape.algorithm,
            num_steps=STEPS,
            num_draft_tokens=DRAFT_TOKENS,
            keeps_draft_kv=self._shape.keeps_draft_kv,
        )

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The forward: not timed (its wall and CPU time are added to `spent`)."""
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        counting, COUNTER.enabled = COUNTER.enabled, False
        try:
            return self._forward(batch)
        finally:
            COUNTER.enabled = counting
            self.spent[0] += time.perf_counter_ns() - t0
            self.spent[1] += time.thread_time_ns() - c0

    def _forward(self, batch: ForwardBatch) -> GenerationBatchResult:
        b = batch.batch_size
        self._round += 1
        payload = self._payloads[self._round % PAYLOAD_SETS]
        if b != payload.bonus_tokens.shape[0]:
            payload = _rows(payload, b)
        if not batch.forward_mode.is_decode():
            return GenerationBatchResult(
                next_token_ids=payload.bonus_tokens,
                accept_lens=torch.ones(b, dtype=torch.int64),
                stride=1,
                new_seq_lens=batch.seq_lens,
                next_draft_input=payload,
            )
        slots = batch.req_pool_indices
        accept = self._accept_t[slots]
        return GenerationBatchResult(
            next_token_ids=self._tokens_t[slots].view(-1),
            accept_lens=accept,
            stride=DRAFT_TOKENS,
            new_seq_lens=batch.seq_lens + accept,
            next_draft_input=payload,
        )


def _payload(b: int, gen: torch.Generator, shape: DraftShape) -> RelayPayload:
    """A relay payload of ``b`` rows with ``shape``'s extras."""
    width = HIDDEN * shape.hidden_multiple
    return RelayPayload(
        bonus_tokens=torch.full((b,), wl.FILLER, dtype=torch.int64),
        topk_p=torch.rand((b, 1), generator=gen) if shape.topk else None,
        topk_index=torch.randint(0, wl.VOCAB - 1, (b, 1), generator=gen) if shape.topk else None,
        hidden_states=torch.randn((b, width), generator=gen).to(torch.bfloat16) if width else None,
    )


def _rows(p: RelayPayload, b: int) -> RelayPayload:
    def first(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:b].clone()

    return RelayPayload(
        bonus_tokens=p.bonus_tokens[:b].clone(),
        topk_p=first(p.topk_p),
        topk_index=first(p.topk_index),
        hidden_states=first(p.hidden_states),
    )


@attrs.define
class _Run:
    samples: list[float] = attrs.Factory(list)
    cpu: list[float] = attrs.Factory(list)  # the thread's CPU time per sample
    host: list[float] = attrs.Factory(list)  # ``ops``: wall time without the launches
    handoff: list[float] = attrs.Factory(list)  # ``--handoff``: with the output hand-off
    ops: list[int] = attrs.Factory(list)  # ``ops``: counted operations per round
    moves: list[int] = attrs.Factory(list)  # ``ops``: of which host-device moves
    finished: list[tuple[int, int, int]] = attrs.Factory(list)
    emitted: int = 0
    loop_s: float = 0.0


class _Replay:
    """One run: an engine, its requests and the draws they replay."""

    def __init__(self, page: int, bs: int, settings: HostSettings) -> None:
        self.bs = bs
        self.churn = settings.workload == "churn"
        rounds = self.rounds = settings.warmup + settings.iters
        config = EngineConfig(
            overlap=False,
            page_size=page,
            kv_tokens=wl.kv_tokens(bs, page, rounds, churn=self.churn),
            max_running=bs,
            max_prefill_tokens=bs * wl.PROMPT_RANGE[1] + 1,
            prefix_cache=False,  # as on the peers' side (`specstate bench prefix` times it)
            device=settings.device,
        )
        self.worker = _ReplayWorker(2 * bs + 2, bs, DRAFT_SHAPES[settings.algorithm])
        limits = RequestLimits(vocab_size=wl.VOCAB, max_context_len=CONTEXT, eos_token_ids={wl.EOS})
        self.engine = Engine(self.worker, limits=limits, config=config)
        self.draws = wl.Draws(bs)
        self.live: dict[Req, wl.Request] = {}
        self.slot: dict[Req, int] = {}
        self.steady = wl.steady_accepts(bs, rounds) if not self.churn else []
        self.order: list[Req] = []
        self.handoff = StreamHandOff(self.engine) if settings.handoff else None

    def start(self) -> None:
        if self.churn:
            self.join(self.bs)
        else:
            for i, n in enumerate(wl.steady_prompts(self.bs)):
                d = wl.Request(index=i, prompt_len=n, length=1 << 30, by_eos=False, accepts=[])
                cap = wl.MAX_ACCEPT * self.rounds + 8  # never reached in the run
                self._submit(d, SamplingParams(max_new_tokens=cap))
        self.prefill()

    def join(self, n: int) -> None:
        for _ in range(n):
            d = self.draws.next()
            self._submit(d, SamplingParams(max_new_tokens=d.max_new_tokens))

    def _submit(self, d: wl.Request, params: SamplingParams) -> None:
        rid, prompt = f"r{d.index}", range(d.prompt_len)
        if self.handoff is None:
            req = self.engine.submit(rid, prompt, params)
        else:
            req = self.handoff.submit(rid, prompt, params)
        self.live[req] = d
        self.order.append(req)

    def prefill(self) -> None:
        engine = self.engine
        while engine.scheduler.waiting or engine.scheduler.prefilling:
            report = engine.step()  # untimed: the joiners' prefill (their first token)
            assert report.launched_mode == "extend" and not report.finished
            if self.handoff is not None:
                self.handoff.hand_off()  # untimed too: the first tokens go out with the prefill
        for req in self.order:
            self.slot[req] = engine.allocator.slot_of(req)
        self.order = []

    def prepare(self, round_: int) -> None:
        """Untimed: every running request's next run, into the worker's per-slot tables."""
        w = self.worker
        if self.churn:
            for req, d in self.live.items():
                slot = self.slot[req]
                w.accept[slot], w.tokens[slot] = d.next_run()
        else:
            accepts = self.steady[round_]
            for i, (req, d) in enumerate(self.live.items()):
                w.accept[self.slot[req]] = accepts[i]
                d.emitted += accepts[i]


def _one_run(page: int, bs: int, settings: HostSettings) -> _Run:
    ops = _count_run(page, bs, settings) if settings.launch_model == "ops" else None
    replay = _Replay(page, bs, settings)
    engine = replay.engine
    try:
        replay.start()
        run = _loop(replay, settings, ops)
        _check(replay, run)
        return run
    finally:
        if replay.handoff is not None:
            replay.handoff.close()
        engine.close()


def _count_run(page: int, bs: int, settings: HostSettings) -> list[tuple[int, int]]:
    """An untimed replay of the same draws under `COUNTER`: the operations of every round."""
    submit = CpuStream.submit

    # NOTE: the launch runs on the CPU stream's worker thread; torch's modes are per thread.
    def counted_submit(self: CpuStream, fn: Callable[..., object], *a: Any, **k: Any) -> None:
        submit(self, COUNTER.bound(fn), *a, **k)

    CpuStream.submit = counted_submit  # type: ignore[method-assign,assignment]
    replay = _Replay(page, bs, settings)
    try:
        replay.start()
        with COUNTER:
            run = _loop(replay, settings, None, counting=True)
        _check(replay, run)
        return list(zip(run.ops, run.moves, strict=True))
    finally:
        COUNTER.enabled = False
        CpuStream.submit = submit  # type: ignore[method-assign]
        if replay.handoff is not None:
            replay.handoff.close()
        replay.engine.close()


def _loop(
    replay: _Replay,
    settings: HostSettings,
    ops: list[tuple[int, int]] | None,
    *,
    counting: bool = False,
) -> _Run:
    """Every round of one run; ``ops``: the counted operations of each round (and the moves
    among them), charged one launch each; ``counting``: the counting replay (every round's
    counts in ``run.ops`` and ``run.moves``)."""
    engine, outputs = replay.engine, replay.engine.outputs
    handoff = replay.handoff
    run = _Run()
    seen = outputs.all_lengths()
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    gc.collect()
    gc.freeze()
    start = clock()
    for r in range(settings.warmup + settings.iters):
        replay.prepare(r)
        replay.worker.spent[:] = (0, 0)
        UNCHARGED[:] = (0, 0)
        HANDOFF[:] = (0, 0)
        COUNTER.enabled = counting
        c0 = cpu()
        t0 = clock()
        report = engine.step()
        ta = clock()
        # What a streaming server reads: each request's new tokens, sent on and dropped (as
        # the peer harness does: it counts them).
        sent = 0
        for _req, new in outputs.read_all_since(seen):
            sent += len(new)
        for req in report.ended:
            sent += len(req.emitted_ids[int(seen[replay.slot[req]]) :])
        t1 = clock()
        c1 = cpu()
        if handoff is not None:  # the hand-off: the step's events to the request streams
            handoff.hand_off()
        t2 = clock()
        COUNTER.enabled = False
        if counting:
            counted, moves = COUNTER.take()
            run.ops.append(counted)
            run.moves.append(moves)
        if report.launched_mode != "decode" or report.launched_size != replay.bs:
            raise RuntimeError(
                f"round {r}: launched {report.launched_mode} of {report.launched_size}"
            )
        if r >= settings.warmup:  # the forward is not timed (as on the peer's side)
            spent = replay.worker.spent
            charge = 0 if ops is None else ops[r][0] * LAUNCH_NS[0]
            wall = t1 - t0 - spent[0] - UNCHARGED[0]
            run.samples.append((wall + charge) / 1e3)
            run.cpu.append((c1 - c0 - spent[1] - UNCHARGED[1] + charge) / 1e3)
            if ops is not None:
                run.host.append(wall / 1e3)
                run.ops.append(ops[r][0])
                run.moves.append(ops[r][1])
            if handoff is not None:
                with_handoff = wall - (t1 - ta) + HANDOFF[0] + (t2 - t1)
                run.handoff.append((with_handoff + charge) / 1e3)
        run.emitted += sent
        for req in report.ended:
            d = replay.live.pop(req)
            replay.slot.pop(req)
            run.finished.append((r, d.index, len(req.emitted_ids)))
        if report.ended:
            replay.join(len(report.ended))
            replay.prefill()
        if handoff is not None:
            handoff.consume()  # untimed: the callers' event loop takes what was handed off
        seen = outputs.all_lengths()
    run.loop_s = (clock() - start) / 1e9
    gc.unfreeze()
    return run


def _check(replay: _Replay, run: _Run) -> None:
    """Untimed: every finish is where the draws put it; the engine's invariants hold."""
    check_engine(replay.engine)
    by_index = {d.index: d for d in replay.draws.requests}
    for _, index, emitted in run.finished:
        d = by_index[index]
        req = replay.engine.request(f"r{index}")
        want = FinishReason.STOP if d.by_eos else FinishReason.LENGTH
        if emitted != d.length or req.finish is None or req.finish.reason is not want:
            raise InvariantViolation(
                "finish", f"request r{index}: emitted {emitted} ({req.finish}); drawn {d}"
            )
    for req, d in replay.live.items():
        if req.num_outputs != d.emitted:
            raise InvariantViolation("commit-settlement", f"{req.request_id}: {req.num_outputs}")


def _stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    p90 = ordered[max(1, math.ceil(0.9 * n)) - 1]
    return {"median": round(median, 2), "p90": round(p90, 2)}


def host_benchmark(
    settings: HostSettings, progress: Callable[[str], None] | None = None
) -> dict[str, object]:
    """Run the workload; a JSON-able report in the shape peers' harnesses print."""
    allocator_set = set_allocator(settings)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    LAUNCH_NS[0] = int(settings.launch_us * 1e3)
    store, store_device = ReqToTokenPool._store, ReqToTokenPool._store_device
    gather, patch_rows = write_log._gather, write_log._patch_rows

    on_end = Deliveries.on_end
    SPIN[0] = settings.launch_model != "ops"

    def store_with_launch(self: ReqToTokenPool, flat: IntArray, values: IntArray) -> None:
        store(self, flat, values)
        if not self._mirrored:  # a mirrored table's device write is counted as torch calls
            COUNTER.add(1)  # the device write, one operation
        if SPIN[0]:
            _spin(LAUNCH_NS[0])  # the device write's launch, as on a GPU

    runs: dict[tuple[int, int], list[_Run]] = {}
    ReqToTokenPool._store = store_with_launch  # type: ignore[method-assign]
    # The device path's write into the table (a mirrored one): a host-to-device copy and an
    # indexed store, two launches on a GPU whose work is the device's, as SGLang's
    # `assign_req_to_token_pool` kernel is on its side.
    ReqToTokenPool._store_device = _device_kernel(  # type: ignore[method-assign]
        store_device, lambda pool, both, n: 2
    )
    if settings.handoff:  # the delivery record's work is the hand-off's, not the round's
        Deliveries.on_end = _uncharged(on_end)  # type: ignore[method-assign]
    write_log._gather = _device_kernel(
        gather, lambda buffers, indices: sum(b is not None for b in buffers)
    )
    write_log._patch_rows = _device_kernel(
        patch_rows, lambda value, gather, rows, joined: 1 + (joined is not None)
    )
    try:
        for rep in range(settings.repeats):
            for page in settings.page_sizes:
                for bs in settings.batch_sizes:
                    if progress is not None:
                        progress(f"repeat {rep + 1}/{settings.repeats}: page {page}, bs {bs}")
                    runs.setdefault((page, bs), []).append(_one_run(page, bs, settings))
    finally:
        ReqToTokenPool._store = store  # type: ignore[method-assign]
        ReqToTokenPool._store_device = store_device  # type: ignore[method-assign]
        Deliveries.on_end = on_end  # type: ignore[method-assign]
        write_log._gather, write_log._patch_rows = gather, patch_rows
        torch.set_num_threads(threads)
    return {
        "peer": "specstate",
        "version": specstate.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {
            **attrs.asdict(settings),
            "algorithm": f"{settings.algorithm}, 3 drafts past the bonus, 4 draft tokens "
            "(L = 4, R = 8)",
            "timed": "Engine.step of a decode round (normal loop) but the forward, "
            "+ the streaming read; req_to_token writes and the relay's payload gathers "
            "modelled as device launches"
            + (
                "; every tensor operation counted and charged one launch"
                if settings.launch_model == "ops"
                else ""
            )
            + (
                "; handoff_total_us: with the hand-off to AsyncEngine streams"
                if settings.handoff
                else ""
            ),
            "allocator_set": allocator_set,
            "torch_threads": 1,
        },
        "results": [_row(page, bs, rs) for (page, bs), rs in runs.items()],
    }


def _row(page: int, bs: int, runs: list[_Run]) -> dict[str, object]:
    samples = [x for r in runs for x in r.samples]
    per_repeat = [_stats(r.samples)["median"] for r in runs]
    total = _stats(samples)
    first = runs[0]
    row: dict[str, object] = {
        "page_size": page,
        "bs": bs,
        "repeats": len(runs),
        "samples": len(samples),
        "total_us": total,
        "total_us_per_req": {k: round(v / bs, 3) for k, v in total.items()},
        "total_us_median_per_repeat": per_repeat,
        "total_us_best_repeat_median": min(per_repeat),
        "cpu_us": _stats([x for r in runs for x in r.cpu]),
        "finished_requests": len(first.finished),
        "emitted_tokens": first.emitted,
        "workload_digest": wl.digest(first.finished),
        "cohort_digest": wl.cohort_digest(first.finished, bs),
        "loop_s": [round(r.loop_s, 2) for r in runs],
    }
    if all(r.ops for r in runs):  # --launch-model ops
        ops = [x for r in runs for x in r.ops]
        row["device_ops"] = {**_stats(ops), "mean": round(sum(ops) / len(ops), 2)}
        moves = [x for r in runs for x in r.moves]
        row["device_moves"] = {**_stats(moves), "mean": round(sum(moves) / len(moves), 2)}
        row["host_us"] = _stats([x for r in runs for x in r.host])
    if all(r.handoff for r in runs):  # --handoff
        row["handoff_total_us"] = _stats([x for r in runs for x in r.handoff])
        row["handoff_us_median_per_repeat"] = [_stats(r.handoff)["median"] for r in runs]
    return row
