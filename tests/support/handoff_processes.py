"""Test-only: the programs of a prefill process (rank 0) and a decode process (rank 1), run by
`spawn_ranks`, each with every engine check on, and the faults a test injects into one of them.

``spec`` (picklable) holds: ``algorithm``, ``worker`` (registry options), ``config``
(`EngineConfig` options), ``vocab_size``, ``requests`` (id, prompt, `SamplingParams`),
``device``, ``fault`` (None, ``"decode_dies"``, ``"prefill_dies"``, ``"malformed"``) and the
timeouts. Each rank returns a plain dict the parent checks.
"""

from __future__ import annotations

import os
import time
from typing import Any

import attrs
import torch
import torch.distributed as dist
from engine_driver import checked_config
from handoff_harness import pools_full

from specstate import RequestLimits
from specstate.distributed.groups import RankGroup
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.handoff.codec import encode
from specstate.handoff.record import HandoffRecord
from specstate.handoff.transport import TorchDistributedTransport, serve_decode, serve_prefill
from specstate.reference.workers import default_registry


def _engine(spec: dict[str, Any]) -> Engine:
    worker = default_registry().create(spec["algorithm"], **spec["worker"])
    limits = RequestLimits(vocab_size=spec["vocab_size"], max_context_len=64)
    return Engine(worker, limits=limits, config=checked_config(**spec["config"]))


def _corrupt(record: HandoffRecord) -> HandoffRecord:
    """A record whose bonus token is not its last output (the decoder refuses it)."""
    return attrs.evolve(record, output_ids=(record.output_ids[0] + 1,))


def pd_rank(group: RankGroup, spec: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 serves prefill, rank 1 decode (module docstring)."""
    engine = _engine(spec)
    fault = spec.get("fault")
    started = time.monotonic()
    if group.rank == 0:
        if fault == "prefill_dies":
            _die_mid_send(engine, spec)
        transport = TorchDistributedTransport(1, device=spec["device"])
        reqs = serve_prefill(
            engine,
            transport,
            spec["requests"],
            ack_timeout_s=spec["ack_timeout_s"],
            after_step=check_engine,
            on_export=_corrupt if fault == "malformed" else None,
        )
    else:
        if fault == "decode_dies":
            _die_mid_receive()
        transport = TorchDistributedTransport(0, device=spec["device"])
        outcome = serve_decode(
            engine, transport, idle_timeout_s=spec["idle_timeout_s"], after_step=check_engine
        )
        reqs = outcome.requests
    result = {
        "outputs": {rid: list(r.emitted_ids) for rid, r in reqs.items()},
        "logprobs": {rid: r.logprobs for rid, r in reqs.items()},
        "finish": {
            rid: (r.finish.reason.value, r.finish.detail) for rid, r in reqs.items() if r.finish
        },
        "pools_full": pools_full(engine),
        "seconds": time.monotonic() - started,
        "failure": None if group.rank == 0 else outcome.failure,
        "handoffs": engine.handoff_counts,
    }
    engine.close()
    return result


def _die_mid_receive() -> None:
    """The decode process takes a record's frame and header, then dies."""
    frame = torch.empty(3, dtype=torch.int64)
    dist.recv(frame, src=0, tag=0)
    dist.recv(torch.empty(int(frame[1]), dtype=torch.uint8), src=0, tag=0)
    os._exit(1)


def _die_mid_send(engine: Engine, spec: dict[str, Any]) -> None:
    """The prefill process sends a real record's frame, header and first tensor, then dies."""
    rid, prompt, sampling = spec["requests"][0]
    engine.submit_prefill(rid, prompt, sampling)
    engine.run_until_idle()
    wire = encode(engine.export_handoff(rid))
    frame = torch.tensor([1, wire[0].numel(), len(wire) - 1], dtype=torch.int64)
    for tensor in (frame, wire[0], wire[1]):
        dist.send(tensor.contiguous(), dst=1, tag=0)
    time.sleep(0.2)
    os._exit(1)
