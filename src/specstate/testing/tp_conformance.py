"""The conformance kit for a tensor-parallel worker: every rank must decide what rank 0 decides.

``check_tp_worker(factory, vocab_size=..., world_size=2)`` spawns ``world_size`` ranks on this
machine (`specstate.distributed.spawn_ranks`; gloo on a CPU), builds a fresh worker per
configuration on every rank with ``factory()`` (a module-level function or a
``functools.partial`` of one: the ranks import it), and serves the kit's workload through a
`DistributedEngine` with ``check_agreement`` and every engine check on, in three
configurations: the normal loop at page 1, the overlap loop at page 16 with chunked prefill
(and mixed chunks when supported), and the overlap loop under KV pressure with an abort. Its
findings use the kit's rules (`specstate.testing.conformance`), and one more:

==================  ===============================================================
``rank``            the ranks planned or settled a round differently (`RankDivergence`),
                    a rank failed or did not answer (`RankFailure`), or a request's
                    tokens differ between ranks
==================  ===============================================================

Greedy tokens are compared with ``oracle`` and across configurations as the single-rank kit
does (``tokens``). A worker that shards its model computes in another summation order than a
single device, so give it an oracle only on prompts whose greedy margins are wide.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from specstate.core.errors import InvalidConfig
from specstate.core.params import RequestLimits, SamplingParams
from specstate.distributed.engine import DistributedEngine
from specstate.distributed.groups import RankGroup
from specstate.distributed.spawn import RankOutcome, spawn_ranks
from specstate.engine.config import EngineConfig
from specstate.engine.worker import WorkerProtocol
from specstate.testing.kit_findings import ConformanceReport, Finding
from specstate.testing.kit_workload import DEFAULT_PROMPTS

__all__ = ["check_tp_worker"]

_RANK_ERRORS = ("RankDivergence", "RankFailure", "RankError")
_Outputs = dict[str, tuple[tuple[int, ...], str | None, str]]


def _configs(caps_overlap: bool, caps_mixed: bool, pressure_tokens: int) -> dict[str, EngineConfig]:
    checked = EngineConfig(check_invariants=True, check_ownership=True, debug_relay=True)
    overlap = caps_overlap
    return {
        "normal loop, page 1": attrs.evolve(checked, overlap=False, page_size=1, kv_tokens=4096),
        "overlap loop, page 16, chunk 4": attrs.evolve(
            checked,
            overlap=overlap,
            page_size=16,
            kv_tokens=4096,
            chunked_prefill=4,
            mixed_chunk=caps_mixed,
        ),
        "KV pressure + abort": attrs.evolve(
            checked, overlap=overlap, page_size=4, kv_tokens=pressure_tokens
        ),
    }


def _serve_rank(
    group: RankGroup,
    factory: Callable[[], WorkerProtocol],
    vocab_size: int,
    prompts: tuple[tuple[int, ...], ...],
    max_new_tokens: int,
    configs: dict[str, EngineConfig],
) -> dict[str, tuple[_Outputs, tuple[str, str] | None]]:
    """One rank: serve the workload in every configuration; outputs and error per config."""
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=256)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    results: dict[str, tuple[_Outputs, tuple[str, str] | None]] = {}
    for name, config in configs.items():
        error: tuple[str, str] | None = None
        outputs: _Outputs = {}
        try:
            engine = DistributedEngine(
                factory(), group=group, limits=limits, config=config, check_agreement=True
            )
        except InvalidConfig as exc:
            results[name] = ({}, ("InvalidConfig", str(exc)))
            continue
        with engine:
            try:
                if engine.is_leader:
                    for i, prompt in enumerate(prompts):
                        engine.submit(f"c{i}", prompt, params)
                    for step in range(2000):
                        if engine.is_idle:
                            break
                        if name.endswith("abort") and step == 3:
                            engine.abort("c0")
                        engine.step()
                else:
                    engine.follow()
            except Exception as exc:  # NOTE: a finding, not a crash of the kit
                error = (type(exc).__name__, str(exc))
            for i in range(len(prompts)):
                req = engine.request(f"c{i}")
                finish = req.finish
                reason = None if finish is None else finish.reason.value
                outputs[f"c{i}"] = (
                    req.emitted_ids,
                    reason,
                    "" if finish is None else finish.detail,
                )
        results[name] = (outputs, error)
        if group.failure is not None:
            break  # the group cannot run another configuration
    return results


def check_tp_worker(
    factory: Callable[[], WorkerProtocol],
    *,
    vocab_size: int,
    world_size: int = 2,
    prompts: Sequence[Sequence[int]] = DEFAULT_PROMPTS,
    max_new_tokens: int = 12,
    oracle: Callable[[Sequence[int], int], Sequence[int]] | None = None,
    timeout_s: float = 600.0,
) -> ConformanceReport:
    """Serve ``prompts`` on ``world_size`` spawned ranks in three configurations; the findings.

    Args:
        factory: makes a fresh worker on a rank (picklable by reference).
        vocab_size: the model's vocabulary.
        world_size: ranks to spawn.
        prompts: the workload (greedy, ``max_new_tokens`` each).
        max_new_tokens: tokens per request.
        oracle: ``oracle(prompt, n)`` -> the expected greedy tokens.
        timeout_s: the most wall time for the whole check (a hang is a ``rank`` finding).
    """
    caps = factory().capabilities
    page = 4
    longest = max(len(p) for p in prompts) + max_new_tokens + caps.spec_window(page).reserve
    need = -(-longest // page) * page + page
    configs = _configs(caps.supports_overlap, caps.supports_mixed_chunk, max(128, need * 3 // 2))
    workload = tuple(tuple(p) for p in prompts)
    outcomes = spawn_ranks(
        _serve_rank,
        (factory, vocab_size, workload, max_new_tokens, configs),
        world_size=world_size,
        timeout_s=timeout_s,
    )
    findings = _rank_findings(outcomes)
    if not findings:
        findings = _token_findings(outcomes, workload, max_new_tokens, oracle)
    return ConformanceReport(
        findings=tuple(findings), configs=tuple(f"TP={world_size}, {n}" for n in configs)
    )


def _rank_findings(outcomes: list[RankOutcome]) -> list[Finding]:
    """Ranks that did not finish, configurations that raised, outputs that differ by rank."""
    findings = []
    for outcome in outcomes:
        if not outcome.ok:
            where = f"rank {outcome.rank}"
            findings.append(Finding("rank", where, f"{outcome.error_type}: {outcome.error}"))
    if findings:
        return findings
    leader = outcomes[0].result
    for name, (outputs, error) in leader.items():
        if error is not None:
            rule = "rank" if error[0] in _RANK_ERRORS else "error"
            findings.append(Finding(rule, name, f"{error[0]}: {error[1]}"))
            continue
        for other in outcomes[1:]:
            theirs = other.result.get(name, ({}, None))[0]
            for rid, mine in outputs.items():
                if theirs.get(rid) != mine:
                    findings.append(
                        Finding("rank", name, f"{rid}: rank 0 {mine}, rank {other.rank} "
                                f"{theirs.get(rid)}")
                    )  # fmt: skip
    return findings


def _token_findings(
    outcomes: list[RankOutcome],
    prompts: tuple[tuple[int, ...], ...],
    max_new_tokens: int,
    oracle: Callable[[Sequence[int], int], Sequence[int]] | None,
) -> list[Finding]:
    """Finishes, tokens against the oracle and across configurations (rank 0's)."""
    findings = []
    seen: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (outputs, _) in outcomes[0].result.items():
        for i, (rid, (tokens, reason, detail)) in enumerate(outputs.items()):
            if reason == "abort" and name.endswith("abort"):
                continue
            if reason not in ("length", "stop"):
                rule = "unfinished" if reason is None else "error"
                findings.append(Finding(rule, name, f"{rid} ended {reason}: {detail}"))
                continue
            if oracle is not None:
                want = tuple(oracle(prompts[i], max_new_tokens))[: len(tokens)]
                if tokens != want:
                    findings.append(
                        Finding(
                            "tokens", name, f"{rid}: {list(tokens)} but the oracle {list(want)}"
                        )
                    )
            first = seen.setdefault(rid, (tokens, name))
            if first[0] != tokens:
                findings.append(
                    Finding("tokens", name, f"{rid}: {list(tokens)} but {list(first[0])} with "
                            f"{first[1]}")
                )  # fmt: skip
    return findings
