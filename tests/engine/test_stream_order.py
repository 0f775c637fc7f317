"""Stream order: a forward reads a relay slot only after the publish that produced it.

The overlap loop is correct on a GPU only if every read of the FutureMap is ordered after the
write it needs by stream order, never by the host happening to be slow. The checker: the forward
stream is a `CpuStream` with a random delay before every item (a slow, jittery device), and the
FutureMap runs in debug mode (consume once: a slot read before its publish or stash raises).

* The engine, every algorithm, chunked prefill with mixed chunks, under that stream: the tokens
  equal HF ``generate()`` and no relay error occurs.
* The checker can fail: a launcher that resolves the next round's frontier on the host at
  launch time (before its forward is on the stream, as a GPU port that "optimizes" the resolve
  might) is caught — the resolve reads a slot whose publish has not run yet.
"""

from __future__ import annotations

import random

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import ALGORITHMS, MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.batch.plan import LaunchPlan
from specstate.batch.relay_inputs import resolve_batch_seq_lens
from specstate.core.errors import RelayError
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.launch import launcher as launch
from specstate.engine.launch.launcher import Launcher
from specstate.relay.future_map import Unresolved
from specstate.relay.streams import CpuStream, Stream

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("order"))


@pytest.fixture
def jittery_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward stream the engine makes sleeps 0-3 ms before each item."""
    rng = random.Random(0)

    def make(device: object, *, name: str = "forward") -> Stream:
        return CpuStream(name, delay=lambda: rng.uniform(0.0, 0.003))

    monkeypatch.setattr(launch, "make_stream", make)


def _engine(ckpt: SpecCheckpoints, algorithm: str) -> Engine:
    config = EngineConfig(
        overlap=True,
        kv_tokens=1024,
        chunked_prefill=4,
        mixed_chunk=True,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    return Engine(
        ckpt.worker(algorithm),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=config,
    )


@pytest.mark.usefixtures("jittery_stream")
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_relay_reads_follow_their_publish_on_a_jittery_stream(
    ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """Stream order alone orders publish before resolve: exact tokens, no relay error."""
    engine = _engine(ckpt, algorithm)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    run_checked(engine, max_steps=300)
    engine.close()
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH, req.finish
        assert list(req.emitted_ids) == greedy(ckpt.hf, prompt, NEW_TOKENS)


class _ResolvesOnTheHost(Launcher):
    """A broken port: resolves a decode round's frontier at launch, on the host thread."""

    def launch(self, plan: LaunchPlan, *, batch_id: int) -> None:
        """Resolve before the forward is on the stream, then launch as usual."""
        if plan.is_decode and isinstance(plan.batch.seq_lens, Unresolved):
            resolve_batch_seq_lens(self.future_map, plan.batch)
        super().launch(plan, batch_id=batch_id)


@pytest.mark.usefixtures("jittery_stream")
def test_the_checker_catches_a_resolve_that_is_not_stream_ordered(
    ckpt: SpecCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broken launcher reads a slot whose publish has not run: the relay check fires."""
    monkeypatch.setattr("specstate.engine.compose.Launcher", _ResolvesOnTheHost)
    engine = _engine(ckpt, "eagle")
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    for i, p in enumerate(MIXED_PROMPTS):
        engine.submit(f"r{i}", p, params)
    with pytest.raises(RelayError, match="no publish since their last read"):
        run_checked(engine, max_steps=300)
