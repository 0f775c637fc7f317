"""Stop sequences through the engine: HF's greedy output cut at the first complete occurrence.

Each request stops on a 3-token sequence taken from its own continuation (plus one that never
occurs); one request has ``min_new_tokens`` past an early occurrence, which must not stop it.
With drafters that agree part of the time, sequences span rounds and end inside accepted runs
(both asserted from the accept lengths), in both loops, with the invariant checker on.
"""

from __future__ import annotations

import pytest
from controls_oracle import cut_at_stop_sequences, round_of, run_bounds
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import (
    ALGORITHMS,
    MIXED_PROMPTS,
    SpecCheckpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine

NEW_TOKENS = 20
STEPS = 3
NEVER = (96, 95, 94, 93, 92)  # a sequence no continuation holds
MIN_NEW_ROW = 4


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


@pytest.fixture(scope="module")
def full(ckpt: SpecCheckpoints) -> list[list[int]]:
    """HF's uncut greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]


def sequences_of(row: int, tokens: list[int]) -> tuple[tuple[int, ...], ...]:
    """Row ``row``'s stop sequences: 3 tokens of its own continuation, and one never seen."""
    start = 1 if row == MIN_NEW_ROW else 5 + row
    return (NEVER, tuple(tokens[start : start + 3]))


def params_of(row: int, tokens: list[int]) -> SamplingParams:
    """Row ``row``'s request; the last row's early occurrence is below its min_new_tokens."""
    return SamplingParams(
        max_new_tokens=NEW_TOKENS,
        stop_sequences=sequences_of(row, tokens),
        min_new_tokens=8 if row == MIN_NEW_ROW else 0,
    )


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_stop_sequences_cut_hf_output(
    ckpt: SpecCheckpoints, full: list[list[int]], algorithm: str, overlap: bool
) -> None:
    """Outputs equal HF's cut at the first occurrence; spans and mid-run cuts both occur."""
    config = EngineConfig(
        kv_tokens=2048,
        overlap=overlap,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=False)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(f"s{row}", prompt, params_of(row, full[row]))
            for row, prompt in enumerate(MIXED_PROMPTS)
        ]
        run_checked(engine)
    spans = inside = 0
    for row, req in enumerate(reqs):
        sequences = sequences_of(row, full[row])
        min_new = req.sampling.min_new_tokens
        want, index = cut_at_stop_sequences(full[row], sequences, min_new_tokens=min_new)
        assert list(req.emitted_ids) == want, row
        assert index == 1, row  # every row stops on its own sequence
        assert req.finish is not None and req.finish.reason is FinishReason.STOP
        assert req.finish.detail == f"stop sequence {sequences[1]}"
        end = len(want) - 1
        bounds = run_bounds(req.accept_lengths)
        last_round = round_of(end, bounds)
        spans += round_of(end - 2, bounds) != last_round
        inside += end != bounds[last_round] - 1  # tokens after it were settled, not emitted
        if end != bounds[last_round] - 1:
            assert len(req.output_ids) > len(req.emitted_ids)
    early = cut_at_stop_sequences(full[MIN_NEW_ROW], sequences_of(MIN_NEW_ROW, full[MIN_NEW_ROW]))
    assert len(early[0]) < len(reqs[MIN_NEW_ROW].emitted_ids)  # min_new_tokens skipped one
    assert spans > 0
    if algorithm != "none":  # a verify accepted tokens past a sequence's end
        assert inside > 0
