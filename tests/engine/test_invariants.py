"""The invariant checker catches a broken clock, a leaked slot and an unbalanced pool."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_oracle import make_checkpoint
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.core.errors import InvariantViolation
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.internals import Role

LIMITS = RequestLimits(vocab_size=97, max_context_len=64)


def _running_engine(tmp_path: Path) -> Engine:
    make_checkpoint(tmp_path)
    engine = Engine(
        SpyWorker.plain(tmp_path),
        limits=LIMITS,
        config=EngineConfig(overlap=False, kv_tokens=256, check_ownership=True),
    )
    engine.submit("r", [1, 2, 3], SamplingParams(max_new_tokens=8))
    engine.step()
    engine.step()
    check_engine(engine)  # healthy
    return engine


def test_a_clock_moved_behind_the_engines_back(tmp_path: Path) -> None:
    """A commit that no result paid for breaks seqlen == committed + 1."""
    engine = _running_engine(tmp_path)
    slot = engine.allocator.slot_of(engine.request("r"))
    with engine.checker.acting(Role.RESULT_PROCESSOR):
        engine.ledger.advance_committed(torch.tensor([slot]), torch.tensor([1]))
    with pytest.raises(InvariantViolation, match=r"request r: seqlen 5 != committed 5 \+ 1"):
        check_engine(engine)
    engine.close()


def test_a_slot_held_by_nobody(tmp_path: Path) -> None:
    """A request dropped from the scheduler while holding KV is a leak."""
    engine = _running_engine(tmp_path)
    engine.scheduler.drop(engine.request("r"))
    with pytest.raises(InvariantViolation, match=r"open slots \['r'\] != live or deferred"):
        check_engine(engine)
    engine.close()


def test_an_unbalanced_pool(tmp_path: Path) -> None:
    """Pages taken from the pool and owned by no row break the balance."""
    engine = _running_engine(tmp_path)
    engine.allocator.token_pool.alloc_pages(2)
    with pytest.raises(InvariantViolation, match="KV pool does not balance"):
        check_engine(engine)
    engine.close()


def test_a_prefill_chunk_that_speculates(tmp_path: Path) -> None:
    """A request still prefilling must not hold a speculative reservation."""
    make_checkpoint(tmp_path)
    config = EngineConfig(overlap=False, kv_tokens=256, chunked_prefill=2, check_ownership=True)
    engine = Engine(SpyWorker.plain(tmp_path), limits=LIMITS, config=config)
    engine.submit("p", [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=4))
    engine.step()
    check_engine(engine)  # one chunk of two launched: healthy
    req = engine.request("p")
    with engine.checker.acting(Role.SCHEDULER):
        engine.allocator.reserve_for_spec_decode(torch.tensor([engine.allocator.slot_of(req)]))
    with pytest.raises(InvariantViolation, match="p: prefilling with committed 2, allocated 4"):
        check_engine(engine)
    engine.close()


def test_an_output_row_that_lost_its_request(tmp_path: Path) -> None:
    """A running request whose output row was closed behind its back is reported."""
    engine = _running_engine(tmp_path)
    slot = engine.allocator.slot_of(engine.request("r"))
    engine.outputs.detach(slot)  # the row closes while the request still runs
    with pytest.raises(InvariantViolation, match=f"request r: slot {slot}'s output row"):
        check_engine(engine)
    engine.close()
