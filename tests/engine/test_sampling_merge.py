"""A seeded sampled request that joins a running all-greedy batch is sampled, not argmaxed.

The scheduler keeps the running batch's per-row sampling tensors and appends the rows of
requests that join (`SamplingInfo.concat`), including the host's "every row is greedy" flag. A
seeded request emits the same tokens whatever its batch mates (its draws are a function of the
seed and the position), so joining greedy requests mid-decode must give exactly the tokens it
gives alone, which differ from the greedy ones; the greedy requests stay Hugging Face's.
"""

from __future__ import annotations

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine

PROMPT = [9, 41, 7, 7, 30]
SEEDED = SamplingParams(max_new_tokens=12, temperature=1.5, seed=11, ignore_eos=True)


def _engine(ckpt: SpecCheckpoints, algorithm: str, overlap: bool) -> Engine:
    return Engine(
        ckpt.worker(algorithm),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(
            overlap=overlap, kv_tokens=1024, check_invariants=True, check_ownership=True
        ),
    )


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", ["none", "eagle"])
def test_a_seeded_request_joining_a_greedy_batch_is_sampled(
    partial_ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Alone and after joining two decoding greedy requests: the same sampled tokens."""
    with _engine(partial_ckpt, algorithm, overlap) as engine:
        alone = engine.submit("alone", PROMPT, SEEDED)
        run_checked(engine)
    assert list(alone.emitted_ids) != greedy(partial_ckpt.hf, PROMPT, 12)
    greedy_prompts = [[3, 14, 15], [92, 65, 35, 89]]
    with _engine(partial_ckpt, algorithm, overlap) as engine:
        mates = [
            engine.submit(f"g{i}", p, SamplingParams(max_new_tokens=24, ignore_eos=True))
            for i, p in enumerate(greedy_prompts)
        ]
        while min(len(m.output_ids) for m in mates) < 6:  # several all-greedy decode rounds
            engine.step()
        joined = engine.submit("joined", PROMPT, SEEDED)
        run_checked(engine)
    assert list(joined.emitted_ids) == list(alone.emitted_ids)
    for mate, prompt in zip(mates, greedy_prompts, strict=True):
        assert list(mate.emitted_ids) == greedy(partial_ckpt.hf, prompt, 24)
