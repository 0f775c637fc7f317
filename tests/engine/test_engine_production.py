"""With every check off (production), the engine emits exactly what HF generate emits.

Production mode skips the per-row validation of the ledger, the pools and the relay
(``check_invariants=False``, no ownership checks, no consume-once relay); the hot path then
runs its fast branches: host-array ledger writes, grow without per-row checks, and the relay
by reference. These cases step the engine by hand and still run the invariant checker after
every step, and put stop tokens inside accepted runs so the vectorized finish scan decides
where requests end.
"""

from __future__ import annotations

import itertools

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import ALGORITHMS, MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine, EngineConfig

PROMPTS = [list(p) for p in MIXED_PROMPTS]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("production"))


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """The oracle's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


def _stop_cases(expected: list[list[int]]) -> list[tuple[int | None, list[int]]]:
    """Per prompt: a stop id taken from the middle of its output (or none), and the output."""
    cases: list[tuple[int | None, list[int]]] = []
    for i, out in enumerate(expected):
        if i % 2:  # every other request runs to its cap
            cases.append((None, out))
            continue
        stop = out[5 + i]
        cases.append((stop, out[: out.index(stop) + 1]))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size", "chunking"),
    list(itertools.product(ALGORITHMS, [False, True], [1, 16], [(None, False), (4, True)])),
)
def test_production_mode_is_lossless(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Checks off: greedy outputs and stops inside runs equal HF generate token for token."""
    config = EngineConfig(
        kv_tokens=2048,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    cases = _stop_cases(expected)
    with Engine(ckpt.worker(algorithm), limits=limits, config=config) as engine:
        reqs = [
            engine.submit(
                f"p{i}",
                prompt,
                SamplingParams(
                    max_new_tokens=NEW_TOKENS, stop_token_ids=() if stop is None else (stop,)
                ),
            )
            for i, (prompt, (stop, _)) in enumerate(zip(PROMPTS, cases, strict=True))
        ]
        run_checked(engine, max_steps=500)
        snap = engine.snapshot()
    assert [list(r.emitted_ids) for r in reqs] == [want for _, want in cases]
    assert [r.finish is not None and r.finish.reason.value for r in reqs] == [
        "length" if stop is None else "stop" for stop, _ in cases
    ]
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    if algorithm in ("draft_model", "eagle"):
        assert snap.metrics.mean_accept_length > 2.0  # stops fell inside multi-token runs
