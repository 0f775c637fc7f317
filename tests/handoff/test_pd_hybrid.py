"""A hybrid model crosses a handoff: its recurrent state after the committed tokens (one row of
every state buffer, target and hybrid drafter) travels with the KV and lands in the decode
engine's state row of the same position; output equals transformers' ``generate()`` and one
engine's, accept lengths included."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from handoff_harness import run_one, run_pd
from hf_oracle import greedy
from hybrid_oracle import HYBRID_PROMPTS, HybridCheckpoints, make_hybrid_checkpoints

from specstate import SamplingParams
from specstate.handoff.record import ROW

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> HybridCheckpoints:
    """A NemotronH-style target and a partly agreeing hybrid drafter."""
    return make_hybrid_checkpoints(tmp_path_factory.mktemp("pdhybrid"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size"),
    list(itertools.product(["none", "draft_model"], [False, True], [1, 16])),
)
def test_a_hybrid_model_through_prefill_and_decode(
    hybrid: HybridCheckpoints, algorithm: str, overlap: bool, page_size: int
) -> None:
    """Greedy: HF's tokens, one engine's tokens and accept lengths, no recompute."""
    requests = [
        (f"h{i}", list(p), SamplingParams(max_new_tokens=NEW_TOKENS))
        for i, p in enumerate(HYBRID_PROMPTS)
    ]
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size}
    run = run_pd(
        hybrid.worker(algorithm),
        hybrid.worker(algorithm),
        [requests],
        vocab_size=hybrid.vocab_size,
        **options,
    )
    one, accepts = run_one(
        hybrid.worker(algorithm), [requests], vocab_size=hybrid.vocab_size, **options
    )
    assert run.outputs == {rid: greedy(hybrid.hf, p, NEW_TOKENS) for rid, p, _ in requests}
    assert run.outputs == one and run.accepts == accepts
    assert run.prefill_tokens_on_decode == 0 and run.drafter_prefill_tokens_on_decode == 0
    if algorithm == "draft_model":
        assert 1.0 < run.mean_accept < 4.0


def test_a_hybrid_record_carries_the_state_rows(hybrid: HybridCheckpoints) -> None:
    """The descriptor lists every state buffer (target and drafter); the record one row each."""
    from engine_driver import checked_config, run_checked

    from specstate import RequestLimits
    from specstate.engine.engine import Engine
    from specstate.handoff import decode, encode

    limits = RequestLimits(vocab_size=hybrid.vocab_size, max_context_len=64)
    with Engine(hybrid.worker("draft_model"), limits=limits, config=checked_config()) as engine:
        engine.submit_prefill("h", list(HYBRID_PROMPTS[2]), SamplingParams(max_new_tokens=4))
        run_checked(engine)
        record = decode(encode(engine.export_handoff("h")))
    rows = [n for n, _, _ in record.descriptor.layout if n.startswith(ROW)]
    assert list(record.recurrent_state) == rows
    assert any(n.startswith(ROW + "target.") for n in rows)
    assert any(n.startswith(ROW + "draft.") for n in rows)
    shapes = {n: s for n, _, s in record.descriptor.layout}
    assert all(tuple(record.recurrent_state[n].shape) == shapes[n] for n in rows)
