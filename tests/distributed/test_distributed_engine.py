"""A `DistributedEngine` of one rank runs in-process: the API, the snapshot and the invariant."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from spec_checkpoints import SpecCheckpoints
from tp_programs import reference_worker

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams, UsageError
from specstate.core.errors import InvariantViolation
from specstate.distributed import DistributedEngine, RankGroup, result_digest
from specstate.engine.invariants import check_engine
from specstate.engine.launch.result_copy import HostResult

CONFIG = EngineConfig(kv_tokens=1024, check_invariants=True, check_ownership=True)
LIMITS = RequestLimits(vocab_size=97, max_context_len=256)
PROMPTS = [(3, 14, 15, 92), (79, 32), (38, 46, 26, 43, 38, 32, 79)]


@pytest.fixture
def paths(partial_ckpt: SpecCheckpoints) -> dict[str, str]:
    """The partly agreeing checkpoints, as paths."""
    return {k: str(getattr(partial_ckpt, k)) for k in ("target", "draft", "eagle")}


def test_one_rank_serves_like_an_engine(paths: dict[str, str]) -> None:
    """Same tokens as a plain Engine; every step's plan and every result were checked."""
    params = SamplingParams(max_new_tokens=10)
    with Engine(reference_worker(paths, "eagle"), limits=LIMITS, config=CONFIG) as engine:
        want = engine.generate(PROMPTS, params)
    with RankGroup.init(rank=0, world_size=1) as group:
        worker = reference_worker(paths, "eagle")
        with DistributedEngine(
            worker, group=group, limits=LIMITS, config=CONFIG, check_agreement=True
        ) as engine:
            assert engine.is_leader and engine.rank == 0
            assert engine.generate(PROMPTS, params) == want
            snap = engine.agreement.snapshot()
            assert snap.last_launched == engine.rounds.num_launched > 0
            assert snap.last_settled == engine.rounds.num_retired
            assert snap.num_failed == 0 and snap.fatal is None
            assert engine.agreement.num_checked >= engine.rounds.num_launched


def test_the_leaders_and_the_followers_calls_are_apart(paths: dict[str, str]) -> None:
    """follow() is for followers; after close every call raises UsageError."""
    with RankGroup.init(rank=0, world_size=1) as group:
        engine = DistributedEngine(
            reference_worker(paths, "none"), group=group, limits=LIMITS, config=CONFIG
        )
        with pytest.raises(UsageError, match=r"follow\(\) is for a follower"):
            engine.follow()
        engine.close()
        engine.close()  # idempotent
        with pytest.raises(UsageError, match=r"step\(\) after close"):
            engine.step()


def test_a_missed_launch_point_breaks_the_rank_agreement_invariant(paths: dict[str, str]) -> None:
    """The checker names ``rank-agreement`` when the agreement and the engine disagree."""
    with RankGroup.init(rank=0, world_size=1) as group:
        worker = reference_worker(paths, "ngram")
        with DistributedEngine(worker, group=group, limits=LIMITS, config=CONFIG) as engine:
            engine.submit("a", PROMPTS[0], SamplingParams(max_new_tokens=4))
            engine.step()
            check_engine(engine)
            engine.agreement.on_launch(None, engine.rounds.num_launched + 1)
            with pytest.raises(InvariantViolation, match=r"\[rank-agreement\] .* launch point 2"):
                check_engine(engine)


def test_result_digest_sees_every_settled_field() -> None:
    """Equal results digest equally; one accept length, token, log-probability (one ulp) or
    invalid row different does not."""

    def host(accept: list[int], tokens: list[list[int]]) -> HostResult:
        return HostResult(
            tokens=np.array(tokens, dtype=np.int64),
            accept=np.array(accept, dtype=np.int64),
            stride=2,
            frontier=np.array([5, 6]) + np.array(accept),
            invalid=None,
            seq_lens=np.array([5, 6]),
        )

    base = result_digest(host([2, 1], [[4, 5], [6, 0]]))
    assert np.array_equal(base, result_digest(host([2, 1], [[4, 5], [6, 0]])))
    assert not np.array_equal(base, result_digest(host([1, 1], [[4, 5], [6, 0]])))
    assert not np.array_equal(base, result_digest(host([2, 1], [[4, 5], [7, 0]])))
    logprobs = np.array([[-0.5, -1.25], [-2.0, 0.0]], dtype=np.float32)
    with_logprobs = attrs.evolve(host([2, 1], [[4, 5], [6, 0]]), logprobs=logprobs)
    assert not np.array_equal(base, result_digest(with_logprobs))
    assert np.array_equal(
        result_digest(with_logprobs),
        result_digest(attrs.evolve(with_logprobs, logprobs=logprobs.copy())),
    )
    nudged = logprobs.copy()
    nudged[1, 0] = np.nextafter(nudged[1, 0], np.float32(0))  # one ulp: other bits
    assert not np.array_equal(
        result_digest(with_logprobs), result_digest(attrs.evolve(with_logprobs, logprobs=nudged))
    )
    invalid = attrs.evolve(host([2, 1], [[4, 5], [6, 0]]), invalid=np.array([False, True]))
    assert not np.array_equal(base, result_digest(invalid))
    ids = np.array([[[4, 3], [5, 1]], [[6, 2], [0, 0]]], dtype=np.int64)
    values = np.array([[[-0.5, -1.0], [-1.25, -2.0]], [[-2.0, -3.0], [0.0, 0.0]]], np.float32)
    with_top = attrs.evolve(with_logprobs, top_ids=ids, top_values=values)
    assert not np.array_equal(result_digest(with_logprobs), result_digest(with_top))
    other_ids = ids.copy()
    other_ids[0, 0] = [3, 4]  # the same alternatives in another order
    assert not np.array_equal(
        result_digest(with_top), result_digest(attrs.evolve(with_top, top_ids=other_ids))
    )
    other_values = values.copy()
    other_values[1, 0, 1] = np.nextafter(values[1, 0, 1], np.float32(0))
    assert not np.array_equal(
        result_digest(with_top), result_digest(attrs.evolve(with_top, top_values=other_values))
    )
