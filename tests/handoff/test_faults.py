"""Aborts during a handoff free the request on both sides; nothing leaks.

The two-process faults (a process dying mid-transfer, a malformed record on the wire) are in
test_pd_processes.py; these are the aborts a user makes while a request is between engines.
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import run_checked
from handoff_harness import PrefillCounter, linked, pools_full
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import FinishReason, SamplingParams
from specstate.core.errors import InvariantViolation, KvPoolExhausted, UsageError
from specstate.core.status import ReqStatus
from specstate.engine.invariants import check_engine
from specstate.handoff.codec import decode, encode

PROMPT = list(MIXED_PROMPTS[0])
PARAMS = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("faults"))


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_during_transfer_frees_both_sides(ckpt: SpecCheckpoints, overlap: bool) -> None:
    """Exported and admitted, not yet acknowledged: the user aborts on both engines. Each
    ends it with ABORT and frees everything; the decode side never imported it."""
    decode_worker = ckpt.worker("eagle")
    counter = PrefillCounter(decode_worker)
    with linked(
        ckpt.worker("eagle"), decode_worker, vocab_size=ckpt.vocab_size, overlap=overlap
    ) as link:
        prefill_req = link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        record = link.prefill.export_handoff("r")
        decode_req = link.decode.admit_handoff(decode(encode(record)))
        assert link.prefill.abort("r") and link.decode.abort("r")
        run_checked(link.prefill)
        run_checked(link.decode)
        for req in (prefill_req, decode_req):
            assert req.finish is not None and req.finish.reason is FinishReason.ABORT
        assert pools_full(link.prefill) and pools_full(link.decode)
        assert counter.target_tokens == 0 and decode_req.num_outputs == 0
        with pytest.raises(UsageError, match="not parked"):
            link.prefill.release_handoff("r")  # the acknowledgement came too late


def test_abort_of_a_parked_request_frees_its_pages(ckpt: SpecCheckpoints) -> None:
    """A request parked after its prefill (never exported) is aborted like any other."""
    with linked(ckpt.worker("none"), ckpt.worker("none"), vocab_size=ckpt.vocab_size) as link:
        req = link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        assert not pools_full(link.prefill)  # parked: its pages are held
        link.prefill.abort("r")
        link.prefill.step()
        assert req.finish is not None and req.finish.reason is FinishReason.ABORT
        assert pools_full(link.prefill) and link.prefill.handoff_ready() == ()


def test_closing_a_decode_engine_ends_arriving_requests(ckpt: SpecCheckpoints) -> None:
    """A record admitted but not imported when the decode engine closes ends with ABORT."""
    with linked(ckpt.worker("ngram"), ckpt.worker("ngram"), vocab_size=ckpt.vocab_size) as link:
        link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        req = link.transfer("r")
        link.decode.close()
        assert req.finish is not None and req.finish.reason is FinishReason.ABORT
        assert pools_full(link.prefill)


def test_the_handoff_invariant_catches_a_request_in_two_places(ckpt: SpecCheckpoints) -> None:
    """A parked request that also sits in the running set (it would be decoded here while the
    decode engine owns it), or an arriving one holding a slot, fails the checker by name."""
    with linked(ckpt.worker("none"), ckpt.worker("none"), vocab_size=ckpt.vocab_size) as link:
        req = link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        check_engine(link.prefill.rounds)
        link.prefill.scheduler._running[req] = None  # injected: parked and running
        with pytest.raises(InvariantViolation, match=r"\[handoff\] request r: parked"):
            check_engine(link.prefill.rounds)
        del link.prefill.scheduler._running[req]
        arriving = link.decode.admit_handoff(link.prefill.export_handoff("r"))
        check_engine(link.decode.rounds)
        arriving.transition(ReqStatus.PREFILL)  # injected: arriving, not waiting
        with pytest.raises(InvariantViolation, match=r"\[handoff\] request r: arriving"):
            check_engine(link.decode.rounds)


def test_a_closed_decode_engine_fails_the_transfer_and_frees_the_pages(
    ckpt: SpecCheckpoints,
) -> None:
    """The decode engine closed before the record arrived: the prefill side ends the request
    with ERROR naming it and frees its pages."""
    with linked(ckpt.worker("none"), ckpt.worker("none"), vocab_size=ckpt.vocab_size) as link:
        req = link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        link.decode.close()
        with pytest.raises(UsageError, match="after close"):
            link.pump()
        assert req.finish is not None and req.finish.reason is FinishReason.ERROR
        assert "UsageError" in req.finish.detail and pools_full(link.prefill)


def test_the_link_catches_a_request_live_on_both_engines(ckpt: SpecCheckpoints) -> None:
    """Admitted on the decode side but never released on the prefill side: both own it."""
    with linked(ckpt.worker("none"), ckpt.worker("none"), vocab_size=ckpt.vocab_size) as link:
        link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        link.check()
        link.decode.admit_handoff(link.prefill.export_handoff("r"))
        with pytest.raises(InvariantViolation, match=r"\[handoff-owner\].*'r'"):
            link.check()
        link.prefill.release_handoff("r")
        link.check()


def test_an_import_that_cannot_allocate_waits_and_is_never_prefilled(
    ckpt: SpecCheckpoints,
) -> None:
    """The pool refuses the import batch's allocation once (after admission): the arrival
    keeps its slot, the next step imports it; the decode engine prefills nothing."""
    decode_worker = ckpt.worker("draft_model")
    counter = PrefillCounter(decode_worker)
    with linked(ckpt.worker("draft_model"), decode_worker, vocab_size=ckpt.vocab_size) as link:
        link.prefill.submit_prefill("r", PROMPT, PARAMS)
        run_checked(link.prefill)
        req = link.transfer("r")
        allocator = link.decode.allocator
        real = allocator.alloc_for_extend
        refusals: list[torch.Tensor] = []

        def refuse_once(slots: torch.Tensor, ends: torch.Tensor) -> None:
            if not refusals:
                refusals.append(ends)
                raise KvPoolExhausted("injected: the pool refuses once")
            real(slots, ends)

        allocator.alloc_for_extend = refuse_once  # type: ignore[method-assign,assignment]
        link.decode.step()
        assert refusals and req.num_outputs == 0
        run_checked(link.decode)
        assert counter.target_tokens == 0 and counter.drafter_tokens == 0
        assert list(req.emitted_ids) == greedy(ckpt.hf, PROMPT, PARAMS.max_new_tokens)
        assert pools_full(link.decode) and pools_full(link.prefill)
