"""A prefill process and a decode process on one machine: `run_pair`.

`run_pair` starts two ranks (`specstate.distributed.spawn_ranks`: fresh interpreters joined by a
gloo group on 127.0.0.1, or NCCL with ``device="cuda"``): rank 0 builds the worker, serves the
requests' prefills and sends each record (`serve_prefill`); rank 1 builds the same worker and
decodes them (`serve_decode`). Each process reports what it did; a process that fails or hangs
past ``timeout_s`` is reported, never waited on forever. On two machines, run the same two
programs under ``torchrun`` (docs/handoff.md).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import attrs

from specstate.core.params import RequestLimits, SamplingParams
from specstate.distributed.groups import RankGroup
from specstate.distributed.spawn import RankOutcome, spawn_ranks
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.handoff.transport import TorchDistributedTransport, serve_decode, serve_prefill

__all__ = ["PairResult", "PairSpec", "requests_of", "run_pair", "serve_rank"]


@attrs.frozen(kw_only=True)
class PairSpec:
    """What both processes run (picklable: it crosses to them).

    Attributes:
        algorithm: the registry name of the worker (`default_registry`).
        worker_options: its options (checkpoint paths, ``num_steps``, ...).
        config: both engines' `EngineConfig`.
        limits: both engines' `RequestLimits`.
        requests: (id, prompt, sampling) of every request, submitted to the prefill process.
        device: ``cpu`` (gloo) or ``cuda`` (NCCL; rank ``r`` on ``cuda:r``).
        ack_timeout_s: how long the prefill side waits for each acknowledgement.
        idle_timeout_s: how long an idle decode side waits for the next record.
    """

    algorithm: str
    worker_options: dict[str, Any]
    config: EngineConfig
    limits: RequestLimits
    requests: tuple[tuple[str, tuple[int, ...], SamplingParams], ...]
    device: str = "cpu"
    ack_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0


@attrs.frozen(kw_only=True)
class PairResult:
    """What each process reported.

    Attributes:
        outputs: every request's emitted tokens, from the side it ended on.
        finish: every request's finish reason and detail, from the side it ended on.
        handoffs: records the prefill side handed off (acknowledged).
        num_bytes: bytes of tensor data that crossed.
        failure: the decode side's transport failure, if any.
        prefill: rank 0's outcome, decode: rank 1's (errors, timing).
    """

    outputs: dict[str, list[int]]
    finish: dict[str, tuple[str, str]]
    handoffs: int
    num_bytes: int
    failure: str | None
    prefill: RankOutcome
    decode: RankOutcome


def serve_rank(group: RankGroup, spec: PairSpec) -> dict[str, Any]:
    """One process of the pair: rank 0 prefill, rank 1 decode; a plain report."""
    from specstate.reference.workers import default_registry

    worker = default_registry().create(spec.algorithm, **spec.worker_options)
    started = time.monotonic()
    check = check_engine if spec.config.check_invariants else None
    with Engine(worker, limits=spec.limits, config=spec.config) as engine:
        transport = TorchDistributedTransport(1 - group.rank, device=spec.device)
        failure, num_bytes = None, 0
        if group.rank == 0:
            requests = [(rid, list(p), s) for rid, p, s in spec.requests]
            reqs = serve_prefill(
                engine, transport, requests, ack_timeout_s=spec.ack_timeout_s, after_step=check
            )
        else:
            outcome = serve_decode(
                engine, transport, idle_timeout_s=spec.idle_timeout_s, after_step=check
            )
            reqs, failure, num_bytes = outcome.requests, outcome.failure, outcome.num_bytes
        return {
            "outputs": {rid: list(r.emitted_ids) for rid, r in reqs.items()},
            "finish": {
                rid: (r.finish.reason.value, r.finish.detail) for rid, r in reqs.items() if r.finish
            },
            "failure": failure,
            "num_bytes": num_bytes,
            "seconds": time.monotonic() - started,
        }


def run_pair(spec: PairSpec, *, timeout_s: float = 300.0) -> PairResult:
    """Run ``spec`` in a prefill process and a decode process (module docstring)."""
    prefill, decode = spawn_ranks(
        serve_rank, (spec,), world_size=2, timeout_s=timeout_s, device=spec.device
    )
    pre: dict[str, Any] = prefill.result or {}
    dec: dict[str, Any] = decode.result or {}
    outputs = dict(pre.get("outputs", {}))
    finish = dict(pre.get("finish", {}))
    handed = {rid for rid, (reason, _) in finish.items() if reason == "handed_off"}
    outputs.update(dec.get("outputs", {}))
    finish.update(dec.get("finish", {}))
    return PairResult(
        outputs=outputs,
        finish=finish,
        handoffs=len(handed),
        num_bytes=int(dec.get("num_bytes", 0)),
        failure=dec.get("failure"),
        prefill=prefill,
        decode=decode,
    )


def requests_of(
    prompts: Sequence[Sequence[int]], sampling: SamplingParams
) -> tuple[tuple[str, tuple[int, ...], SamplingParams], ...]:
    """``PairSpec.requests`` for ``prompts`` with ids ``r0``, ``r1``, ..."""
    return tuple((f"r{i}", tuple(p), sampling) for i, p in enumerate(prompts))
