"""The launch path is GPU-ready by construction, proven on a CPU with `DeviceAudit`.

The engine runs on ``device="cpu:0"``: CPU memory with a device identity of its own, so the
engine takes its device code paths (a separate ``req_to_token`` with a host copy, one packed
result copy, value checks after the copy). `DeviceAudit` tags every tensor placed on that
device and fails on what would break or serialize a GPU run:

* no op anywhere — scheduling, launch, the reference worker, settlement — mixes a device tensor
  with a host tensor (every algorithm, both loops, page 1 and 16, chunked prefill with mixed
  chunks), and the tokens still equal HF ``generate()``;
* a steady overlap decode round reads no device value on the host outside the worker (0 syncs
  in the launch and in settlement), copies nothing host-to-device inside the launch, and makes
  exactly one device-to-host copy (the packed result).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hf_oracle import greedy
from spec_checkpoints import (
    ALGORITHMS,
    FAMILIES,
    MIXED_PROMPTS,
    SpecCheckpoints,
    family_options,
    make_spec_checkpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.testing.device_audit import DeviceAudit

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("audit"))


def _build(
    ckpt: SpecCheckpoints, audit: DeviceAudit, algorithm: str, config: EngineConfig
) -> Engine:
    engine = Engine(
        ckpt.worker(algorithm),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=config,
    )
    launcher = engine.rounds.launcher
    launcher._run = audit.wrap(launcher._run, "launch")  # type: ignore[method-assign]
    worker = engine.worker
    worker.forward_batch_generation = audit.wrap(  # type: ignore[method-assign]
        worker.forward_batch_generation, "worker"
    )
    return engine


def _drive(engine: Engine, max_steps: int = 300) -> None:
    for _ in range(max_steps):
        if engine.is_idle:
            return
        engine.step()
        check_engine(engine)
    raise AssertionError("engine not idle")


@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size", "chunking"),
    [
        (a, o, p, c)
        for a, o, (p, c) in itertools.product(
            [*ALGORITHMS, *FAMILIES], [False, True], [(1, (None, False)), (16, (4, True))]
        )
    ],
)
def test_no_op_mixes_host_and_device_tensors(
    ckpt: SpecCheckpoints,
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Every op keeps to one side; the device-path engine is still exact."""
    if algorithm in FAMILIES:  # its drafter is built by test code: before the audit starts
        family_options(ckpt.target, algorithm)
    audit = DeviceAudit()
    config = EngineConfig(
        device="cpu:0",
        overlap=overlap,
        page_size=page_size,
        kv_tokens=1024,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
        check_invariants=True,
        check_ownership=True,
    )
    with audit.on_this_thread("host"):
        engine = _build(ckpt, audit, algorithm, config)
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
        _drive(engine)
        engine.close()
    assert audit.mixes() == [], "\n".join(map(str, audit.mixes()[:10]))
    assert audit.of("sync", "launch") == [], "\n".join(map(str, audit.of("sync", "launch")[:10]))
    assert audit.of("h2d", "launch") == [], "\n".join(map(str, audit.of("h2d", "launch")[:10]))
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert list(req.emitted_ids) == greedy(ckpt.hf, prompt, NEW_TOKENS), req.request_id


def _stream_done(engine: Engine) -> None:
    """Wait for the forward stream to finish the batch in flight (a stream event: no torch op,
    so the audit records nothing), so that its launch's copy falls on a known side of a count."""
    flight = engine.in_flight
    if flight is not None and flight.done is not None:
        flight.done.synchronize()


@pytest.mark.parametrize("algorithm", ["none", "eagle"])
def test_a_steady_overlap_decode_round_syncs_only_its_result_copy(
    ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """Launch and settlement read no device value; one device-to-host copy per round."""
    audit = DeviceAudit()
    config = EngineConfig(device="cpu:0", overlap=True, kv_tokens=1024, check_invariants=True)
    rounds = 6
    with audit.on_this_thread("host"):
        engine = _build(ckpt, audit, algorithm, config)
        params = SamplingParams(max_new_tokens=40)
        for i, p in enumerate(MIXED_PROMPTS):
            engine.submit(f"r{i}", p, params)
        for _ in range(50):  # until every request decodes and a decode round is in flight
            engine.step()
            flight = engine.in_flight
            running = engine.snapshot().num_running == len(MIXED_PROMPTS)
            if running and flight is not None and flight.plan.is_decode:
                break
        engine.step()  # one more: the round settled next is a decode round too
        _stream_done(engine)  # the launch in flight made its copy before the count starts
        audit.clear()
        for _ in range(rounds):
            report = engine.step()
            assert report.launched_mode == "decode" and not report.finished
        _stream_done(engine)  # ... and the last one launched made its copy before it ends
        counts = Counter((f.kind, f.phase) for f in audit.findings)
        engine.close()
    assert audit.of("sync", "launch") == [] and audit.of("sync", "host") == [], counts
    assert audit.of("h2d", "launch") == [] and audit.mixes() == [], counts
    assert counts[("d2h", "launch")] == rounds, counts  # the packed result, once a round
