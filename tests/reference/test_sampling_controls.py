"""Penalties and ``min_new_tokens`` through the engine equal transformers' ``generate()``.

Every algorithm, both loops, drafters that agree only part of the time (so runs are cut in the
middle and verify position ``j`` must see the penalties of drafts ``d1 .. dj``), one batch
whose rows each use different controls, and the invariant checker after every step. The oracle
is HF's own ``RepetitionPenaltyLogitsProcessor`` and ``MinNewTokensLengthLogitsProcessor`` (the
OpenAI frequency / presence penalties as a custom processor: transformers has none).
"""

from __future__ import annotations

import pytest
from controls_oracle import Controls, hf_greedy
from engine_driver import DriveLog, run_checked
from spec_checkpoints import (
    ALGORITHMS,
    FAMILIES,
    MIXED_PROMPTS,
    SpecCheckpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol

NEW_TOKENS = 16
STEPS = 3  # D = 4
ROW_CONTROLS = (
    Controls(repetition_penalty=1.5),
    Controls(frequency_penalty=0.8, presence_penalty=0.5),
    Controls(repetition_penalty=1.2, frequency_penalty=0.3, min_new_tokens=6),
    Controls(min_new_tokens=4),
    Controls(),  # a plain greedy row riding along
)


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


@pytest.fixture(scope="module")
def eos(ckpt: SpecCheckpoints) -> int:
    """An EOS id that row 2 would emit early without ``min_new_tokens`` (so the mask matters)."""
    early, _ = hf_greedy(
        ckpt.hf, MIXED_PROMPTS[2], NEW_TOKENS, controls=Controls(repetition_penalty=1.2)
    )
    return early[2]


@pytest.fixture(scope="module")
def stop_for_row3(ckpt: SpecCheckpoints, eos: int) -> int:
    """A stop id row 3 would emit early (masked by its ``min_new_tokens`` too)."""
    early, _ = hf_greedy(ckpt.hf, MIXED_PROMPTS[3], NEW_TOKENS, eos=[eos])
    return early[1] if early[1] != eos else early[0]


def params_of(row: int, controls: Controls, stop: int) -> SamplingParams:
    """The request of ``row``: its controls, logprobs on, row 3 with an extra stop id."""
    return SamplingParams(
        max_new_tokens=NEW_TOKENS,
        repetition_penalty=controls.repetition_penalty,
        frequency_penalty=controls.frequency_penalty,
        presence_penalty=controls.presence_penalty,
        min_new_tokens=controls.min_new_tokens,
        stop_token_ids=(stop,) if row == 3 else (),
        logprobs=True,
    )


@pytest.fixture(scope="module")
def expected(
    ckpt: SpecCheckpoints, eos: int, stop_for_row3: int
) -> list[tuple[list[int], list[float]]]:
    """HF's tokens and logprobs per row (EOS stops every row; row 3 also stops at its id)."""
    return [
        hf_greedy(
            ckpt.hf,
            prompt,
            NEW_TOKENS,
            controls=controls,
            eos=[eos, stop_for_row3] if row == 3 else [eos],
        )
        for row, (prompt, controls) in enumerate(zip(MIXED_PROMPTS, ROW_CONTROLS, strict=True))
    ]


def serve(
    worker: WorkerProtocol, ckpt: SpecCheckpoints, eos: int, stop: int, **config: object
) -> tuple[list[tuple[int, ...]], list[tuple[float, ...]], list[tuple[int, ...]], DriveLog]:
    """Serve every row in one engine with every check on: tokens, logprobs, accept lengths."""
    engine_config = EngineConfig(
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **config,  # type: ignore[arg-type]
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64, eos_token_ids={eos})
    with Engine(worker, limits=limits, config=engine_config) as engine:
        reqs = [
            engine.submit(f"c{row}", prompt, params_of(row, controls, stop))
            for row, (prompt, controls) in enumerate(zip(MIXED_PROMPTS, ROW_CONTROLS, strict=True))
        ]
        log = run_checked(engine)
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    logprobs = []
    for req in reqs:
        assert req.logprobs is not None
        logprobs.append(req.logprobs)
    return [r.emitted_ids for r in reqs], logprobs, [r.accept_lengths for r in reqs], log


def assert_matches(
    got: list[tuple[int, ...]],
    logprobs: list[tuple[float, ...]],
    expected: list[tuple[list[int], list[float]]],
) -> None:
    """Tokens equal HF's exactly; logprobs within float tolerance."""
    assert got == [tuple(tokens) for tokens, _ in expected]
    for lps, (_, want) in zip(logprobs, expected, strict=True):
        assert lps == pytest.approx(want, abs=2e-4)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, *FAMILIES])
def test_penalties_and_min_new_tokens_equal_hf(
    ckpt: SpecCheckpoints,
    eos: int,
    stop_for_row3: int,
    expected: list[tuple[list[int], list[float]]],
    algorithm: str,
    overlap: bool,
) -> None:
    """Each row's controls, with speculation, give exactly HF's tokens; runs are cut mid-way."""
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=False)
    got, logprobs, accepts, _ = serve(
        worker, ckpt, eos, stop_for_row3, overlap=overlap, kv_tokens=2048
    )
    assert_matches(got, logprobs, expected)
    assert got[3][0] != stop_for_row3 and got[2][2] != eos  # the masks changed the output
    if algorithm != "none":  # speculation really happened, and stopped mid-run
        controlled = [a for row in accepts[:4] for a in row]
        assert any(1 < a < STEPS + 1 for a in controlled), accepts


def test_controls_survive_chunked_prefill_mixed_chunks_and_retraction(
    ckpt: SpecCheckpoints,
    eos: int,
    stop_for_row3: int,
    expected: list[tuple[list[int], list[float]]],
) -> None:
    """Chunked prefill, mixed chunks, page 16 and retraction re-prefills keep the history exact."""
    worker = ckpt.worker("draft_model", num_steps=STEPS, agreeing=False)
    got, logprobs, _, log = serve(
        worker,
        ckpt,
        eos,
        stop_for_row3,
        overlap=True,
        page_size=16,
        kv_tokens=96,
        chunked_prefill=4,
        mixed_chunk=True,
    )
    assert log.retracted, "the pool was meant to force a retraction"
    assert_matches(got, logprobs, expected)
