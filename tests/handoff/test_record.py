"""The handoff record and its wire form: a round trip keeps everything; a truncated, corrupted or
mismatched record is refused with a typed error naming what is wrong, before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import pytest
import torch
from engine_driver import checked_config, run_checked
from handoff_harness import linked, pools_full
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints
from successor_worker import SuccessorWorker

from specstate import FinishReason, RequestLimits, SamplingParams
from specstate.core.errors import (
    HandoffMismatch,
    HandoffUnsupported,
    MalformedRecord,
    UsageError,
)
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.handoff import HANDOFF_VERSION, HandoffRecord, decode, encode
from specstate.handoff.codec import header_tensor
from specstate.reference.workers import default_registry

PROMPT = list(MIXED_PROMPTS[2])
PARAMS = SamplingParams(max_new_tokens=6, stop_sequences=((5, 6),), seed=3, temperature=0.7)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("record"))


def _record(
    ckpt: SpecCheckpoints, algorithm: str, params: SamplingParams = PARAMS, **options: Any
) -> HandoffRecord:
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    config = checked_config(**options)
    with Engine(ckpt.worker(algorithm), limits=limits, config=config) as engine:
        engine.submit_prefill("r", PROMPT, params)
        run_checked(engine)
        return engine.export_handoff("r")


@pytest.fixture(scope="module")
def eagle_record(ckpt: SpecCheckpoints) -> HandoffRecord:
    """An EAGLE request's record, right after its first token."""
    return _record(ckpt, "eagle", page_size=4)


def test_a_record_crosses_its_wire_form_unchanged(eagle_record: HandoffRecord) -> None:
    """Every field, every tensor (bit for bit), and the draft state survive encode/decode."""
    back = decode(encode(eagle_record))
    for field in ("version", "request_id", "prompt_ids", "output_ids", "sampling"):
        assert getattr(back, field) == getattr(eagle_record, field)
    assert back.committed_len == len(PROMPT) == eagle_record.committed_len
    assert back.descriptor == eagle_record.descriptor
    assert list(back.slot_state) == [n for n, _, _ in eagle_record.descriptor.layout]
    for name, tensor in eagle_record.slot_state.items():
        assert torch.equal(back.slot_state[name], tensor)
    hidden = eagle_record.draft_state.hidden_states
    back_hidden = back.draft_state.hidden_states
    assert hidden is not None and back_hidden is not None and torch.equal(back_hidden, hidden)
    assert back.draft_state.bonus_token == eagle_record.output_ids[-1]
    assert {"target.k0", "head.k0", "features", "target.history"} <= set(back.slot_state)
    assert back.sampler_position == len(PROMPT) + 1


def _refused(tensors: list[torch.Tensor], match: str) -> None:
    with pytest.raises(MalformedRecord, match=match):
        decode(tensors)


def test_logprobs_cross_the_wire_form_and_bad_ones_are_refused(ckpt: SpecCheckpoints) -> None:
    """The first token's logprob and top alternatives round-trip exactly; logprobs missing,
    of the wrong length, unasked for, or with the wrong number of alternatives are refused."""
    params = attrs.evolve(PARAMS, logprobs=True, top_logprobs=2)
    record = _record(ckpt, "ngram", params, page_size=4)
    assert record.output_logprobs is not None and len(record.output_logprobs) == 1
    assert record.output_top_logprobs is not None and len(record.output_top_logprobs[0]) == 2
    back = decode(encode(record))
    assert back.sampling == params
    assert back.output_logprobs == record.output_logprobs
    assert back.output_top_logprobs == record.output_top_logprobs
    _refused(encode(attrs.evolve(record, output_logprobs=None)), "one logprob per emitted")
    _refused(encode(attrs.evolve(record, output_logprobs=(-1.0, -2.0))), "one logprob per")
    _refused(encode(attrs.evolve(record, output_top_logprobs=None)), "2 top logprobs")
    one = (record.output_top_logprobs[0][:1],)
    _refused(encode(attrs.evolve(record, output_top_logprobs=one)), "2 top logprobs")
    plain = attrs.evolve(record, sampling=PARAMS, output_top_logprobs=None)
    _refused(encode(plain), "does not ask for")


def test_a_truncated_record_is_refused(eagle_record: HandoffRecord) -> None:
    """A missing tensor, a cut header, a cut tensor, no tensors at all."""
    wire = encode(eagle_record)
    _refused(wire[:-1], "truncated")
    _refused([wire[0][:-7], *wire[1:]], "not JSON")
    _refused([wire[0], wire[1][:-1], *wire[2:]], "target.k0")
    _refused([], "no tensors")


def test_a_corrupted_record_is_refused(eagle_record: HandoffRecord) -> None:
    """A wrong dtype, another version, a clock that does not add up, a bonus that is not the
    last output, slot state out of the layout's order."""
    wire = encode(eagle_record)
    _refused([wire[0], wire[1].double(), *wire[2:]], "target.k0")
    _refused(
        [header_tensor(attrs.evolve(eagle_record, version=HANDOFF_VERSION + 1)), *wire[1:]],
        "version",
    )
    bad_clock = attrs.evolve(eagle_record, committed_len=eagle_record.committed_len + 1)
    _refused(encode(bad_clock), "committed_len")
    bad_bonus = attrs.evolve(eagle_record, output_ids=(eagle_record.output_ids[0] + 1,))
    _refused(encode(bad_bonus), "bonus token")
    reordered = dict(reversed(list(eagle_record.slot_state.items())))
    _refused(encode(attrs.evolve(eagle_record, slot_state=reordered)), "layout")
    _refused([torch.zeros(4, dtype=torch.uint8), *wire[1:]], "not JSON")


@pytest.fixture
def none_record(ckpt: SpecCheckpoints) -> HandoffRecord:
    """A plain request's record at page size 4."""
    return _record(ckpt, "none", page_size=4)


def _decode_engine(worker: WorkerProtocol, ckpt: SpecCheckpoints, **options: Any) -> Engine:
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    config = checked_config(**options)
    return Engine(worker, limits=limits, config=config)


def _mismatch_cases(
    ckpt: SpecCheckpoints,
) -> Iterator[tuple[str, WorkerProtocol, dict[str, object]]]:
    registry = default_registry()
    yield "page_size", ckpt.worker("none"), {"page_size": 16}
    yield (
        "dtype",
        registry.create("none", target=ckpt.target, dtype=torch.float64),
        {"page_size": 4},
    )
    yield "model_digest", registry.create("none", target=ckpt.draft), {"page_size": 4}
    yield "algorithm", ckpt.worker("ngram"), {"page_size": 4}


@pytest.mark.parametrize("field", ["page_size", "dtype", "model_digest", "algorithm"])
def test_a_mismatched_record_is_refused_before_anything_is_written(
    ckpt: SpecCheckpoints, none_record: HandoffRecord, field: str
) -> None:
    """The decode engine names the field and both values; it holds nothing afterwards."""
    worker, options = next((w, o) for f, w, o in _mismatch_cases(ckpt) if f == field)
    with _decode_engine(worker, ckpt, **options) as engine:
        with pytest.raises(HandoffMismatch) as info:
            engine.admit_handoff(decode(encode(none_record)))
        assert info.value.field == field
        assert info.value.found == getattr(none_record.descriptor, field)
        assert info.value.expected == getattr(engine.handoff_descriptor(), field)
        assert "'r'" in str(info.value) and field in str(info.value)
        assert engine.is_idle and pools_full(engine)
        with pytest.raises(KeyError):
            engine.request("r")


def test_a_refused_record_fails_the_request_on_the_prefill_side(ckpt: SpecCheckpoints) -> None:
    """Through a link, a refusal ends the request with ERROR naming it; both pools are full."""
    with linked(
        ckpt.worker("none"),
        ckpt.worker("none"),
        vocab_size=ckpt.vocab_size,
        prefill_options={"page_size": 4},
        page_size=16,
    ) as link:
        req = link.prefill.submit_prefill("r", PROMPT, SamplingParams(max_new_tokens=5))
        run_checked(link.prefill)
        with pytest.raises(HandoffMismatch, match="page_size"):
            link.pump()
        assert req.finish is not None and req.finish.reason is FinishReason.ERROR
        assert "page_size" in req.finish.detail
        assert pools_full(link.prefill) and pools_full(link.decode)
        assert link.stats.refused == 1 and link.stats.handoffs == 0


def test_a_worker_family_that_does_not_export_is_refused(ckpt: SpecCheckpoints) -> None:
    """A chain family that does not say what its drafter keeps: the default refusal, at
    submit_prefill, before any request exists."""
    with _decode_engine(SuccessorWorker(target=ckpt.target), ckpt) as engine:
        with pytest.raises(HandoffUnsupported, match="successor"):
            engine.submit_prefill("r", PROMPT, SamplingParams(max_new_tokens=4))
        with pytest.raises(KeyError):
            engine.request("r")


def test_a_worker_without_the_handoff_methods_is_refused(ckpt: SpecCheckpoints) -> None:
    """A worker that implements only WorkerProtocol."""

    class Bare:
        def __init__(self, inner: WorkerProtocol) -> None:
            self._inner = inner
            self.capabilities = inner.capabilities
            self.attach = inner.attach
            self.forward_batch_generation = inner.forward_batch_generation

    engine = _decode_engine(Bare(ckpt.worker("none")), ckpt)
    with engine, pytest.raises(HandoffUnsupported, match="Bare"):
        engine.handoff_descriptor()


def test_export_needs_a_parked_settled_request(ckpt: SpecCheckpoints) -> None:
    """An ordinary request, or a parked one before its first token settles, is not exported;
    an exported one is never decoded on the prefill side."""
    with _decode_engine(ckpt.worker("none"), ckpt, overlap=True) as engine:
        engine.submit("plain", PROMPT, SamplingParams(max_new_tokens=3))
        engine.submit_prefill("r", PROMPT, SamplingParams(max_new_tokens=3))
        engine.step()  # launched, not settled (overlap)
        with pytest.raises(UsageError, match="not settled"):
            engine.export_handoff("r")
        with pytest.raises(UsageError, match="not parked"):
            engine.export_handoff("plain")
        run_checked(engine)
        assert engine.handoff_ready() == ("r",)
        record = engine.export_handoff("r")
        assert engine.handoff_ready() == ()
        engine.step()
        assert engine.request("r").output_ids == record.output_ids
        engine.release_handoff("r")
        finish = engine.request("r").finish
        assert finish is not None and finish.reason is FinishReason.HANDED_OFF
        assert pools_full(engine)
