"""The sampling controls keep the placement rule: audited on ``device="cpu:0"``.

With every control in one batch (penalties, ``min_new_tokens``, seeds, logprobs and top
logprobs, a non-speculative row, stop sequences) no op mixes host and device tensors anywhere,
the launch reads no device value and copies nothing host-to-device, and a steady overlap decode
round still makes exactly one device-to-host copy (the packed result, logprobs and top logprobs
included) and no host read of a device value in settlement.
"""

from __future__ import annotations

from collections import Counter

import pytest
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.testing.device_audit import DeviceAudit

PARAMS = (
    SamplingParams(max_new_tokens=30, repetition_penalty=1.3, logprobs=True, top_logprobs=4),
    SamplingParams(max_new_tokens=30, temperature=0.8, seed=3, frequency_penalty=0.2),
    SamplingParams(max_new_tokens=30, speculative=False, presence_penalty=0.4),
    SamplingParams(max_new_tokens=30, min_new_tokens=5, stop_sequences=[(1, 2, 3)]),
    SamplingParams(max_new_tokens=30, temperature=1.0, logprobs=True, speculative=False),
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("audit_controls"))


def _settle_stream(engine: Engine) -> None:
    """Wait until the batch in flight has run on the forward stream (its findings recorded)."""
    flight = engine.in_flight
    if flight is not None and flight.done is not None:
        flight.done.synchronize()


@pytest.mark.parametrize("algorithm", ["draft_model", "ngram"])
def test_controls_keep_the_placement_rule(ckpt: SpecCheckpoints, algorithm: str) -> None:
    """No mixed op, no launch sync or upload; steady rounds: one d2h copy, no host sync."""
    audit = DeviceAudit()
    config = EngineConfig(device="cpu:0", overlap=True, kv_tokens=1024, check_invariants=True)
    rounds = 4
    with audit.on_this_thread("host"):
        engine = Engine(
            ckpt.worker(algorithm, num_steps=3, agreeing=False),
            limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
            config=config,
        )
        launcher = engine.rounds.launcher
        launcher._run = audit.wrap(launcher._run, "launch")  # type: ignore[method-assign]
        worker = engine.worker
        worker.forward_batch_generation = audit.wrap(  # type: ignore[method-assign]
            worker.forward_batch_generation, "worker"
        )
        reqs = [
            engine.submit(f"r{i}", prompt, params)
            for i, (prompt, params) in enumerate(zip(MIXED_PROMPTS, PARAMS, strict=True))
        ]
        for _ in range(50):  # until every request decodes and a decode round is in flight
            engine.step()
            flight = engine.in_flight
            if engine.snapshot().num_running == len(reqs) and flight and flight.plan.is_decode:
                break
        engine.step()
        _settle_stream(engine)  # the launch before the window records its copy before the mark
        steady = Counter[tuple[str, str]]()
        mark = len(audit.findings)
        for _ in range(rounds):
            report = engine.step()
            assert report.launched_mode == "decode" and not report.finished
            check_engine(engine)
        _settle_stream(engine)  # ...and the window's last launch, before the count
        steady.update((f.kind, f.phase) for f in audit.findings[mark:])
        engine.run_until_idle()
        engine.close()
    assert audit.mixes() == [], "\n".join(map(str, audit.mixes()[:10]))
    assert audit.of("sync", "launch") == [] and audit.of("h2d", "launch") == []
    assert steady[("sync", "host")] == 0 and steady[("d2h", "launch")] == rounds, steady
    assert all(r.finish is not None for r in reqs)
    assert reqs[0].logprobs is not None and len(reqs[0].logprobs) == len(reqs[0].emitted_ids)
    tops = reqs[0].top_logprobs
    assert tops is not None and [top[0][0] for top in tops] == list(reqs[0].emitted_ids)
