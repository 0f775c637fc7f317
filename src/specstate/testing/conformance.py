"""A worker conformance kit: drive any `WorkerProtocol` through the engine and report each rule.

``check_worker(factory, vocab_size=...)`` builds a fresh worker per configuration and serves a
small workload through the real `Engine` with every check on (invariants, ownership, the
consume-once relay), over the configurations the worker declares it supports: the normal and
the overlap loop, page size 1 and 16, whole and chunked prefill, mixed chunks; one
configuration runs under KV pressure (retraction) and aborts a request mid-flight. It returns a
`ConformanceReport` whose findings each name the broken rule:

``result``          a result that breaks the forward contract (dtypes, shapes, accept
                    lengths outside ``[1, max_accept]``, tokens outside the vocabulary,
                    a published frontier that is not ``seq_lens + accept_lens``)
``relay``           a forward read relayed state nobody wrote (a missing stash or
                    publish), or published twice
``ownership``       the worker wrote a counter it does not own
``isolation``       the worker wrote a scheduler-owned tensor in place
``error``           the worker raised anything else
``tokens``          greedy tokens that differ from the oracle (if one is given) or
                    between configurations (the same requests must emit the same
                    tokens in every loop, page size and chunking)
``unfinished``      a request that did not end by length or stop
``recurrent``       (a worker with recurrent state) a recurrent-state invariant failed:
                    the committed state is not the checkpoint of the accepted run
                    (`specstate.testing.recurrent_conformance`)
==================  ===============================================================
=======
| rule | what broke |
|---|---|
| ``result`` | a result breaks the forward contract: dtypes, shapes, accept lengths, vocabulary |
| ``relay`` | a forward read relayed state nobody wrote (no stash or publish), or published twice |
| ``ownership`` | the worker wrote a counter it does not own |
| ``isolation`` | the worker wrote a scheduler-owned tensor in place |
| ``error`` | the worker raised anything else |
| ``tokens`` | greedy tokens differ from the oracle's, or between configurations |
| ``unfinished`` | a request did not end by length or stop |
| ``recurrent`` | a worker's recurrent state is not the state after the accepted run |

A ``result`` finding covers accept lengths outside ``[1, max_accept]``, tokens outside the
vocabulary and a published frontier that is not ``seq_lens + accept_lens``; ``tokens`` compares
with ``oracle(prompt, n)`` when one is given, and the same requests must emit the same tokens in
every loop, page size and chunking.

``assert_worker_conforms`` raises `AssertionError` listing the findings (for pytest).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import attrs

from specstate.core.errors import InvalidConfig, OwnershipError, RelayError, WorkerResultError
from specstate.core.request import FinishReason, RequestLimits, SamplingParams
from specstate.engine.engine import Engine, EngineConfig
from specstate.engine.worker import WorkerProtocol
from specstate.relay.isolation import IsolationError
from specstate.testing.recurrent_conformance import check_recurrent_state

__all__ = [
    "DEFAULT_PROMPTS",
    "ConformanceReport",
    "Finding",
    "assert_worker_conforms",
    "check_worker",
]

_RULES = (
    (WorkerResultError, "result"),
    (RelayError, "relay"),
    (OwnershipError, "ownership"),
    (IsolationError, "isolation"),
)


@attrs.frozen
class Finding:
    """One broken rule, in one configuration."""

    rule: str
    config: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.config}: {self.detail}"


@attrs.frozen
class ConformanceReport:
    """What `check_worker` found; ``ok`` when nothing."""

    findings: tuple[Finding, ...]
    configs: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when every configuration ran clean."""
        return not self.findings

    def rules(self) -> set[str]:
        """The names of the broken rules."""
        return {f.rule for f in self.findings}

    def __str__(self) -> str:
        if self.ok:
            return f"worker conforms ({len(self.configs)} configurations)"
        return "\n".join(str(f) for f in self.findings)


DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (3, 14, 15, 92, 65, 35, 89),
    (79, 32),
    (38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93),
    (5, 5, 5, 5),
)
"""`check_worker`'s workload when none is given: four prompts of 2 to 15 ids, each below 94."""


def _rule_of(detail: str) -> str:
    """The rule a finish detail names (``Type: message``, or a ``[name]`` prefix)."""
    if "[isolation]" in detail:
        return "isolation"
    if "[relay]" in detail:  # also a result without the relay payload (WorkerResultError)
        return "relay"
    for error, rule in _RULES:
        if detail.startswith(f"{error.__name__}:"):
            return rule
    return "error"


def check_worker(
    factory: Callable[[], WorkerProtocol],
    *,
    vocab_size: int,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_new_tokens: int = 12,
    oracle: Callable[[Sequence[int], int], Sequence[int]] | None = None,
    world_size: int = 1,
) -> ConformanceReport:
    """Serve ``prompts`` through the engine in every supported configuration; report the rules.

    Args:
        factory: makes a fresh worker (one per configuration).
        vocab_size: the model's vocabulary (token ids the prompts and outputs must use).
        prompts: the workload (greedy, ``max_new_tokens`` each).
        max_new_tokens: tokens per request.
        oracle: ``oracle(prompt, n)`` -> the expected greedy tokens (say, HF ``generate``).
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
    findings: list[Finding] = []
    seen: dict[int, tuple[tuple[int, ...], str]] = {}  # prompt index -> first tokens, config
    configs = []
    loops = [False, True] if caps.supports_overlap else [False]
    chunking = [(None, False), (4, caps.supports_mixed_chunk)]
    for overlap, page, (chunk, mixed) in itertools.product(loops, [1, 16], chunking):
        configs.append(
            EngineConfig(
                overlap=overlap,
                page_size=page,
                kv_tokens=4096,
                chunked_prefill=chunk,
                mixed_chunk=mixed,
                check_invariants=True,
                check_ownership=True,
                debug_relay=True,
            )
        )
    # A pool that holds the longest request alone but not the whole workload, whatever the
    # worker's speculative window (a draft tree reserves far more than a chain).
    page = 4
    reserve = caps.spec_window(page).reserve
    longest = max(len(p) for p in prompts) + max_new_tokens + reserve
    need = -(-longest // page) * page + page
    pressure = attrs.evolve(
        configs[-1], kv_tokens=max(128, need + need // 2 + page), page_size=page
    )
    configs.append(pressure)
    names = []
    for config in configs:
        name = (
            f"{'overlap' if config.overlap else 'normal'} loop, page {config.page_size}, "
            f"chunk {config.chunked_prefill}{', mixed' if config.mixed_chunk else ''}"
            f"{', KV pressure + abort' if config is pressure else ''}"
        )
        names.append(name)
        findings += _run_config(
            factory, config, name, vocab_size, prompts, max_new_tokens, oracle, seen,
            abort=config is pressure,
        )  # fmt: skip
    more, scenarios = check_recurrent_state(
        factory,
        vocab_size=vocab_size,
        prompts=prompts,
        max_new_tokens=max_new_tokens,
        oracle=oracle,
    )  # a hybrid worker's state commit (nothing without recurrent state)
    findings += [Finding(*f) for f in more]
    return ConformanceReport(findings=tuple(findings), configs=(*names, *scenarios))


def _run_config(
    factory: Callable[[], WorkerProtocol],
    config: EngineConfig,
    name: str,
    vocab_size: int,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    oracle: Callable[[Sequence[int], int], Sequence[int]] | None,
    seen: dict[int, tuple[tuple[int, ...], str]],
    *,
    abort: bool,
) -> list[Finding]:
    findings: list[Finding] = []
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=256)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    try:
        engine = Engine(factory(), limits=limits, config=config)
    except InvalidConfig as exc:
        return [Finding("error", name, f"engine refused the worker: {exc}")]
    with engine:
        reqs = [engine.submit(f"c{i}", p, params) for i, p in enumerate(prompts)]
        aborted = reqs[0].request_id if abort else None
        try:
            for step in range(2000):
                if engine.is_idle:
                    break
                if aborted is not None and step == 3:
                    engine.abort(aborted)
                engine.step()
            else:
                findings.append(Finding("unfinished", name, "the engine made no progress"))
        except Exception as exc:  # NOTE: a finding, not a crash of the kit
            rule = next((r for e, r in _RULES if isinstance(exc, e)), "error")
            return [*findings, Finding(rule, name, f"{type(exc).__name__}: {exc}")]
    for i, req in enumerate(reqs):
        finish = req.finish
        if finish is None:
            findings.append(Finding("unfinished", name, f"request {req.request_id} never ended"))
            continue
        if finish.reason is FinishReason.ERROR:
            findings.append(Finding(_rule_of(finish.detail), name, finish.detail))
            continue
        if req.request_id == aborted:
            continue
        if finish.reason not in (FinishReason.LENGTH, FinishReason.STOP):
            findings.append(
                Finding("unfinished", name, f"request {req.request_id} ended {finish.reason}")
            )
            continue
        got = tuple(req.emitted_ids)
        if oracle is not None:
            want = tuple(oracle(prompts[i], max_new_tokens))[: len(got)]
            if got != want:
                findings.append(
                    Finding("tokens", name, f"prompt {i}: {list(got)} but the oracle {list(want)}")
                )
        first = seen.setdefault(i, (got, name))
        if first[0] != got:
            findings.append(
                Finding(
                    "tokens",
                    name,
                    f"prompt {i}: {list(got)} but {list(first[0])} with {first[1]}",
                )
            )
    return findings


def assert_worker_conforms(
    factory: Callable[[], WorkerProtocol],
    *,
    vocab_size: int,
    oracle: Callable[[Sequence[int], int], Sequence[int]] | None = None,
) -> None:
    """`check_worker`, raising `AssertionError` with every finding (for a pytest test)."""
    report = check_worker(factory, vocab_size=vocab_size, oracle=oracle)
    if not report.ok:
        raise AssertionError(f"worker does not conform:\n{report}")
