"""A worker conformance kit: drive any `WorkerProtocol` through the engine and report each rule.

``check_worker(factory, vocab_size=...)`` builds a fresh worker per configuration and serves a
small workload through the real `Engine` with every check on (invariants, ownership, the
consume-once relay), over the configurations the worker declares it supports: the normal and
the overlap loop, page size 1 and 16, whole and chunked prefill, mixed chunks; one
configuration runs under KV pressure (retraction) and aborts a request mid-flight. Every
capability the worker declares is exercised: an adaptive draft length runs a configuration whose
rounds cycle through every width from 0 to ``num_steps``; per-request speculation runs one with
every other request ``speculative=False``; sampling, seeds, penalties, ``min_new_tokens`` and
logprobs each add a request to the workload (`specstate.testing.kit_workload`). Each worker is
watched (`specstate.testing.watched_worker`) for the rules the engine cannot see at once.
It returns a `ConformanceReport` whose findings each name the broken rule:

==================  ===============================================================
``result``          a result that breaks the forward contract (dtypes, shapes, accept
                    lengths outside ``[1, max_accept]``, tokens outside the vocabulary,
                    a published frontier that is not ``seq_lens + accept_lens``)
``relay``           a forward read relayed state nobody wrote (a missing stash or
                    publish), published twice, or called ``on_publish`` from another
                    thread or after it returned
``commit-order``    a forward read state that a post-publish commit of an earlier
                    forward had not written yet (a worker that records its commits in a
                    `specstate.relay.commit_order.CommitOrderLedger`, like ``dflash``)
``ownership``       the worker wrote a counter it does not own, or ``req_to_token``
``isolation``       the worker wrote a scheduler-owned tensor in place
``adaptive``        a round launched with ``num_draft_steps`` drafts settled a longer
                    run or a wider stride (the worker ignored the round's width)
``speculation``     a ``speculative=False`` request accepted more than one token
``controls``        a declared sampling control not honoured (a stop token before
                    ``min_new_tokens``, logprobs missing for some tokens)
``capabilities``    the worker's capabilities changed during its life
``invariant``       another engine invariant broke after a step (its name is given)
``error``           the worker raised anything else
``tokens``          greedy (or seeded) tokens that differ from the oracle (if one is
                    given) or between configurations (the same requests must emit the
                    same tokens in every loop, page size and chunking)
``unfinished``      a request that did not end by length or stop
``draft_state``     (a worker that shares prefixes, when no other rule broke) a relayed hidden
                    state or a decode round's accept length that disagrees with another
                    forward's at the same greedy request and frontier: the draft state must
                    depend only on the committed tokens (`specstate.testing.draft_state`)
``frontier``        (a worker exposing ``kv_caches()``) a KV slot at or past a row's frontier
                    read before the forward wrote it (`specstate.testing.frontier_watch`)
``window``          (the same) a KV write outside the window the capabilities reserve
``recurrent``       (a worker with recurrent state) the committed state is not the
                    checkpoint of the accepted run (`specstate.testing.recurrent_conformance`)
``rank``            (``world_size > 1``) ranks diverged, failed or emitted different tokens
                    (`specstate.testing.tp_conformance`)
==================  ===============================================================

Findings are reported once per rule and request: the first configuration where it broke, and
how many other configurations broke it too. The engine logs every failed batch on the
``specstate`` logger; the kit keeps those records in `ConformanceReport.log` and out of the
output unless asked (``check_worker(..., log=True)`` lets them through too).

``assert_worker_conforms`` raises `AssertionError` listing the findings (for pytest).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.params import RequestLimits
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerCapabilities, WorkerProtocol
from specstate.memory.prefix_cache import PrefixSharing
from specstate.testing.draft_state import (
    DecodeRound,
    RelayedState,
    RoundRecorder,
    draft_state_problems,
)
from specstate.testing.frontier_watch import FrontierWatch, WatchableWorker
from specstate.testing.kit_findings import (
    ConfigRun,
    ConformanceReport,
    FindingLog,
    described,
    rule_of_detail,
    rule_of_error,
)
from specstate.testing.kit_workload import DEFAULT_PROMPTS, Job, build_jobs, job_problems
from specstate.testing.recurrent_conformance import check_recurrent_state
from specstate.testing.watched_worker import WatchedWorker

__all__ = ["assert_worker_conforms", "check_worker"]

Oracle = Callable[[Sequence[int], int], Sequence[int]]

_MAX_STEPS = 2000  # steps a configuration may take before the kit calls it stuck


@attrs.frozen(kw_only=True)
class _KitConfig:
    """One configuration the kit runs."""

    name: str
    config: EngineConfig
    abort: bool = False
    adaptive: bool = False
    no_speculation: bool = False


class _CyclingWidths:
    """The kit's draft policy: every width from ``max_steps`` down to 0, then again."""

    def __init__(self, max_steps: int) -> None:
        self._widths: list[int] = [max_steps, *range(max_steps)]
        self._next = 0

    @property
    def max_steps(self) -> int:
        """The worker's draft steps."""
        return self._widths[0]

    def choose(self, batch_size: int) -> int:
        """The next width of the cycle."""
        width = self._widths[self._next % len(self._widths)]
        self._next += 1
        return width

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Nothing to learn: the cycle is fixed."""


class _Records(logging.Handler):
    """Keeps the formatted ``specstate`` log records of the kit's runs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@contextmanager
def _kept_log(*, passthrough: bool) -> Iterator[_Records]:
    """Capture the ``specstate`` logger; unless ``passthrough``, nothing reaches the root."""
    logger = logging.getLogger("specstate")
    records = _Records()
    propagate = logger.propagate
    logger.addHandler(records)
    logger.propagate = propagate and passthrough
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.propagate = propagate


def check_worker(
    factory: Callable[[], WorkerProtocol],
    *,
    vocab_size: int,
    eos_token_ids: Collection[int] = frozenset(),
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_new_tokens: int = 12,
    oracle: Oracle | None = None,
    log: bool = False,
    world_size: int = 1,
) -> ConformanceReport:
    """Serve the workload through the engine in every supported configuration; report the rules.

    Args:
        factory: makes a fresh worker (one per configuration).
        vocab_size: the model's vocabulary (token ids the prompts and outputs must use).
        eos_token_ids: the model's end-of-sequence ids: requests stop at them, and the
            oracle's tokens are cut after the first (as Hugging Face ``generate`` stops there).
        prompts: the greedy workload (``max_new_tokens`` each), plus a request per declared
            sampling control.
        max_new_tokens: tokens per request.
        oracle: ``oracle(prompt, n)`` -> the expected greedy tokens (say, HF ``generate``).
        log: also let the engine's log records through to your logging (they are always kept
            in `ConformanceReport.log`).
        world_size: above 1, check a tensor-parallel worker on that many spawned ranks
            (`specstate.testing.tp_conformance.check_tp_worker`).
    """
    if world_size > 1:  # the tensor-parallel kit: its own module, the same report
        from specstate.testing.tp_conformance import check_tp_worker

        return check_tp_worker(
            factory, vocab_size=vocab_size, world_size=world_size, prompts=prompts,
            max_new_tokens=max_new_tokens, oracle=oracle,
        )  # fmt: skip
    caps = factory().capabilities
    eos = frozenset(eos_token_ids)
    jobs = build_jobs(caps, prompts, max_new_tokens=max_new_tokens, vocab_size=vocab_size)
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=256, eos_token_ids=eos)
    findings = FindingLog()
    seen: dict[str, tuple[tuple[int, ...], str]] = {}  # job -> first tokens, configuration
    runs = []
    rounds: dict[str, list[DecodeRound]] = {}
    relays: dict[str, list[RelayedState]] = {}
    configs = _configs(caps, jobs)
    with _kept_log(passthrough=log) as records:
        for kit in configs:
            run, reqs, recorder = _run_config(factory, kit, jobs, limits, findings)
            rounds[kit.name], relays[kit.name] = recorder.rounds(), recorder.relays()
            runs.append((run, reqs))
            _judge(kit, jobs, runs[-1], findings, seen, oracle, eos)
        # Judged last, and only when every other rule held: a forward that broke the contract
        # relayed something the engine refused (or never used), so its state says nothing.
        if caps.prefix_sharing is not PrefixSharing.NONE and not findings.all():
            for name, detail, rid in draft_state_problems(rounds, caps.num_steps, relays):
                findings.add("draft_state", name, detail, rid)
        more, scenarios = check_recurrent_state(
            factory,
            vocab_size=vocab_size,
            prompts=prompts,
            max_new_tokens=max_new_tokens,
            oracle=oracle,
        )  # a hybrid worker's state commit (nothing without recurrent state)
    for finding in more:
        findings.add(*finding)
    return ConformanceReport(
        findings=findings.all(),
        configs=(*(k.name for k in configs), *scenarios),
        runs=tuple(r for r, _ in runs),
        log=tuple(records.lines),
    )


def _configs(caps: WorkerCapabilities, jobs: Sequence[Job]) -> list[_KitConfig]:
    """Every loop, page size and chunking the worker allows; pressure; its capabilities."""
    loops = [False, True] if caps.supports_overlap else [False]
    chunking = [(None, False), (4, caps.supports_mixed_chunk)]
    out = []
    for overlap, page, (chunk, mixed) in itertools.product(loops, [1, 16], chunking):
        config = EngineConfig(
            overlap=overlap,
            page_size=page,
            kv_tokens=4096,
            chunked_prefill=chunk,
            mixed_chunk=mixed,
            check_invariants=True,
            check_ownership=True,
            debug_relay=True,
        )
        name = (
            f"{'overlap' if overlap else 'normal'} loop, page {page}, chunk {chunk}"
            f"{', mixed' if mixed else ''}"
        )
        out.append(_KitConfig(name=name, config=config))
    # A pool that holds the longest request alone but not the whole workload, whatever the
    # worker's speculative window (a draft tree reserves far more than a chain).
    last = out[-1]
    page = 4
    longest = max(len(j.prompt) + j.params.max_new_tokens for j in jobs)
    need = -(-(longest + caps.spec_window(page).reserve) // page) * page + page
    pressure = attrs.evolve(last.config, kv_tokens=need + need // 2 + page, page_size=page)
    out.append(_KitConfig(name=f"{last.name}, KV pressure + abort", config=pressure, abort=True))
    # The normal loop when there is one: its forwards are watched for req_to_token writes.
    first = next(k for k in reversed(out) if not k.config.overlap)
    if caps.speculative and caps.supports_adaptive_steps:
        out.append(
            attrs.evolve(
                last, name=f"{last.name}, widths 0..{caps.num_steps} (adaptive)", adaptive=True
            )
        )
    if caps.speculative and caps.supports_per_request_speculation:
        out.append(
            attrs.evolve(
                first, name=f"{first.name}, every other request speculative=False",
                no_speculation=True,
            )
        )  # fmt: skip
    return out


def _run_config(
    factory: Callable[[], WorkerProtocol],
    kit: _KitConfig,
    jobs: Sequence[Job],
    limits: RequestLimits,
    findings: FindingLog,
) -> tuple[ConfigRun, dict[str, Req], RoundRecorder]:
    """Serve the jobs in one configuration; its run, its requests by job id, what it relayed
    and accepted."""
    steps = retracted = 0
    reqs: dict[str, Req] = {}
    frontier: FrontierWatch | None = None
    try:
        inner = factory()
        if isinstance(inner, WatchableWorker):  # its KV caches can be watched
            inner = frontier = FrontierWatch(inner, page_size=kit.config.page_size)
        worker = WatchedWorker(inner, watch_table=not kit.config.overlap)
        policy = _CyclingWidths(worker.capabilities.num_steps) if kit.adaptive else None
        engine = Engine(worker, limits=limits, config=kit.config, draft_policy=policy)
    except Exception as exc:  # NOTE: a finding, not a crash of the kit
        findings.add(rule_of_error(exc), kit.name, f"building the engine: {described(exc)}")
        empty = RoundRecorder(0)
        return ConfigRun(name=kit.name, steps=0, retracted=0, aborted=()), reqs, empty
    target = jobs[0].request_id if kit.abort else None
    try:
        with engine:
            for i, job in enumerate(jobs):
                params = job.params
                if kit.no_speculation and i % 2:
                    params = attrs.evolve(params, speculative=False)
                reqs[job.request_id] = engine.submit(job.request_id, job.prompt, params)
            while not engine.is_idle:
                if steps == _MAX_STEPS:
                    findings.add("unfinished", kit.name, "the engine made no progress")
                    break
                if target is not None and reqs[target].output_ids:
                    engine.abort(target)  # mid-flight: it has emitted, and is not done
                    target = None
                retracted += len(engine.step().retracted)
                steps += 1
    except Exception as exc:  # NOTE: a finding, not a crash of the kit
        findings.add(rule_of_error(exc), kit.name, described(exc))
        reqs = {}
    for rule, detail in worker.take() + ([] if frontier is None else frontier.take()):
        findings.add(rule, kit.name, detail)
    aborted = tuple(
        rid for rid, r in reqs.items() if r.finish and r.finish.reason is FinishReason.ABORT
    )
    run = ConfigRun(name=kit.name, steps=steps, retracted=retracted, aborted=aborted)
    return run, reqs, worker.rounds


def _judge(
    kit: _KitConfig,
    jobs: Sequence[Job],
    run: tuple[ConfigRun, dict[str, Req]],
    findings: FindingLog,
    seen: dict[str, tuple[tuple[int, ...], str]],
    oracle: Oracle | None,
    eos: frozenset[int],
) -> None:
    """Every request of one configuration against its job, the oracle and the others."""
    _, reqs = run
    for job in jobs:
        req = reqs.get(job.request_id)
        if req is None:
            continue
        rid, finish = job.request_id, req.finish
        if finish is None:
            findings.add("unfinished", kit.name, f"request {rid} never ended", rid)
            continue
        if finish.reason is FinishReason.ERROR:
            findings.add(rule_of_detail(finish.detail), kit.name, finish.detail, rid)
            continue
        got = tuple(req.emitted_ids)
        first = seen.get(rid)
        if finish.reason is FinishReason.ABORT and kit.abort:
            if job.same_everywhere and first is not None and got != first[0][: len(got)]:
                findings.add("tokens", kit.name, f"aborted {rid}: {list(got)} is not a "
                             f"prefix of {list(first[0])} ({first[1]})", rid)  # fmt: skip
            continue
        if finish.reason not in (FinishReason.LENGTH, FinishReason.STOP):
            findings.add("unfinished", kit.name, f"request {rid} ended {finish.reason}", rid)
            continue
        for problem in job_problems(job, req):
            findings.add("controls", kit.name, problem, rid)
        if job.oracle and oracle is not None:
            want = _cut(tuple(oracle(job.prompt, job.params.max_new_tokens)), eos)
            if got != want:
                findings.add("tokens", kit.name, _mismatch(rid, got, want), rid)
        if job.same_everywhere:
            if first is None:
                seen[rid] = (got, kit.name)
            elif first[0] != got:
                detail = f"{rid}: {list(got)} but {list(first[0])} with {first[1]}"
                findings.add("tokens", kit.name, detail, rid)


def _cut(tokens: tuple[int, ...], eos: frozenset[int]) -> tuple[int, ...]:
    """``tokens`` up to and including the first EOS."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _mismatch(rid: str, got: tuple[int, ...], want: tuple[int, ...]) -> str:
    hint = ""
    if len(want) < len(got) and got[: len(want)] == want:
        hint = (
            f" (the oracle stopped after {len(want)} tokens: if it stops at an end-of-sequence "
            "token, pass the model's eos_token_ids)"
        )
    return f"{rid}: {list(got)} but the oracle {list(want)}{hint}"


def assert_worker_conforms(
    factory: Callable[[], WorkerProtocol],
    *,
    vocab_size: int,
    eos_token_ids: Collection[int] = frozenset(),
    oracle: Oracle | None = None,
) -> None:
    """`check_worker`, raising `AssertionError` with every finding (for a pytest test)."""
    report = check_worker(
        factory, vocab_size=vocab_size, eos_token_ids=eos_token_ids, oracle=oracle
    )
    if not report.ok:
        raise AssertionError(f"worker does not conform:\n{report}")
