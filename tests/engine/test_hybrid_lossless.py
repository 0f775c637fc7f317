"""Hybrid (Mamba2 + attention) targets under speculation are lossless against HF generate().

Every drafting algorithm that serves a hybrid target (``none``, ``ngram``, ``draft_model`` with a
hybrid or a Llama drafter), both loops, page sizes 1 and 16, whole and chunked prefill with
mixed chunks, stops inside accepted runs, aborts, a worker that declares prefix sharing (it
gets no prefix cache), and n-gram rounds that draft nothing right after rounds that accepted
drafts (retraction under KV pressure, for both hybrids, is in
test_hybrid_retraction.py). Every step runs the invariant checker (the recurrent-state
invariants included), ownership checks and the consume-once relay. The recurrent layers steer
the output, so a state selected for the wrong accept length, a state not carried over a round or
a row read by batch index shows up as a wrong token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import attrs
import pytest
from engine_driver import (
    checked_config,
    run_checked,
    serve_to_completion,
    with_stops,
)
from hf_oracle import greedy
from hybrid_oracle import HYBRID_PROMPTS, HybridCheckpoints, make_hybrid_checkpoints
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerProtocol
from specstate.memory.prefix_cache import PrefixSharing

PROMPTS = HYBRID_PROMPTS
NEW_TOKENS = 14
ALGORITHMS = ("none", "ngram", "draft_model", "draft_model:llama")
SMALL_VOCAB = 12
"""A vocabulary so small that greedy outputs repeat: n-gram drafts get accepted."""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> HybridCheckpoints:
    """The hybrid target and its drafters, shared by the module."""
    return make_hybrid_checkpoints(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def expected(ckpt: HybridCheckpoints) -> list[list[int]]:
    """transformers' greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> HybridCheckpoints:
    """A hybrid target over a 12-token vocabulary (repetitive: n-gram drafts are accepted)."""
    return make_hybrid_checkpoints(tmp_path_factory.mktemp("hybrid12"), vocab_size=SMALL_VOCAB)


class RoundSpy(SpyWorker):
    """Delegates to a worker; records the width and accept lengths of every decode round."""

    def __init__(self, inner: WorkerProtocol) -> None:
        super().__init__(inner)
        self.rounds: list[tuple[int, list[int]]] = []

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Delegate; remember (stride, accept lengths) of a decode round."""
        result = super().forward_batch_generation(batch, on_publish=on_publish)
        if batch.forward_mode is ForwardMode.DECODE:
            self.rounds.append((result.stride, result.accept_lens.tolist()))
        return result


def _serve(
    ckpt: HybridCheckpoints,
    worker: WorkerProtocol,
    prompts: Sequence[Sequence[int]],
    stops: Sequence[int | None],
    config: EngineConfig,
) -> list[list[int]]:
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = serve_to_completion(engine, prompts, max_new_tokens=NEW_TOKENS, stops=stops)
    return [list(r.emitted_ids) for r in reqs]


def _partial_accepts(rounds: list[tuple[int, list[int]]], max_accept: int) -> bool:
    return any(1 < a < max_accept for _, accepts in rounds for a in accepts)


MATRIX = list(itertools.product(ALGORITHMS, [False, True], [1, 16], [(None, False), (4, True)]))


@pytest.mark.parametrize(("algorithm", "overlap", "page_size", "chunking"), MATRIX)
def test_hybrid_lossless_matrix(
    ckpt: HybridCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate token for token, stops inside accepted runs included."""
    stops, wants = with_stops(expected)
    spy = RoundSpy(ckpt.worker(algorithm))
    config = checked_config(
        overlap=overlap, page_size=page_size, chunked_prefill=chunking[0], mixed_chunk=chunking[1]
    )
    assert _serve(ckpt, spy, PROMPTS, stops, config) == wants
    if algorithm == "draft_model":  # a hybrid drafter that agrees for a while
        assert _partial_accepts(spy.rounds, spy.capabilities.max_accept)


@pytest.mark.parametrize("overlap", [False, True])
def test_zero_draft_rounds_after_accepted_drafts(small: HybridCheckpoints, overlap: bool) -> None:
    """n-gram rounds that draft nothing follow rounds that accepted drafts (vLLM #52942's case).

    One request runs at a time, so a round drafts nothing whenever its request's trailing
    n-gram never occurred before.
    """
    prompts = [[p % SMALL_VOCAB for p in prompt] for prompt in PROMPTS]
    want = [greedy(small.hf, p, NEW_TOKENS) for p in prompts]
    spy = RoundSpy(small.worker("ngram"))
    config = checked_config(overlap=overlap, max_running=1)
    got = _serve(small, spy, prompts, [None] * len(prompts), config)
    assert got == want
    widths = [stride for stride, _ in spy.rounds]
    after_accepted = [
        widths[i + 1] == 1
        for i, (_, accepts) in enumerate(spy.rounds[:-1])
        if any(a > 1 for a in accepts)
    ]
    assert any(after_accepted), f"no zero-draft round after an accepted run: {spy.rounds}"
    assert _partial_accepts(spy.rounds, spy.capabilities.max_accept)


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_leave_the_others_lossless(
    ckpt: HybridCheckpoints, expected: list[list[int]], overlap: bool
) -> None:
    """Requests aborted mid-flight end with a prefix of their output; the rest are exact, and
    their state records close with their slots (checked after every step)."""
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    config = checked_config(overlap=overlap, chunked_prefill=4, mixed_chunk=True)
    with Engine(ckpt.worker("draft_model"), limits=limits, config=config) as engine:
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(PROMPTS)]
        for _ in range(4):
            engine.step()
        assert engine.abort("p0") and engine.abort("p2")
        run_checked(engine)
        pool = engine.allocator.recurrent
        assert pool is not None and pool.snapshot().num_open == 0
    for i, (req, want) in enumerate(zip(reqs, expected, strict=True)):
        got = list(req.emitted_ids)
        assert got == want[: len(got)] if i in (0, 2) else got == want
    assert reqs[0].finish is not None and reqs[0].finish.reason.value == "abort"


@pytest.mark.parametrize(("algorithm", "overlap"), [("ngram", True), ("draft_model", True)])
def test_production_mode_is_lossless(
    ckpt: HybridCheckpoints, expected: list[list[int]], algorithm: str, overlap: bool
) -> None:
    """Checks off (the fast branches of every commit): the same tokens."""
    stops, wants = with_stops(expected)
    config = checked_config(checks=False, overlap=overlap, page_size=16, chunked_prefill=4)
    assert _serve(ckpt, ckpt.worker(algorithm), PROMPTS, stops, config) == wants


class DeclaresSharing(SpyWorker):
    """A hybrid worker that declares token-level prefix sharing, which its recurrent state
    (checkpointed where rounds end, not at cache boundaries) cannot honour."""

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's, declaring `PrefixSharing.TOKEN`."""
        return attrs.evolve(super().capabilities, prefix_sharing=PrefixSharing.TOKEN)


@pytest.mark.parametrize("checks", [True, False], ids=["checked", "production"])
def test_a_stateful_worker_declaring_prefix_sharing_shares_nothing(
    ckpt: HybridCheckpoints, checks: bool
) -> None:
    """The engine gives a worker with recurrent state no prefix cache, whatever it declares: a
    request repeating an earlier one's prompt and part of its output is prefilled whole and
    emits HF's tokens (in production mode too, where no invariant checker would notice)."""
    worker = DeclaresSharing(ckpt.worker("draft_model"))
    assert worker.capabilities.recurrent is not None
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    config = checked_config(checks=checks, page_size=1)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(worker, limits=limits, config=config) as engine:
        first = engine.submit("first", PROMPTS[2], params)
        run_checked(engine) if checks else engine.run_until_idle()
        again = [*PROMPTS[2], *first.emitted_ids[:5], 7]  # diverges inside the first's output
        later = engine.submit("later", again, params)
        run_checked(engine) if checks else engine.run_until_idle()
        assert engine.snapshot().prefix_cache is None
    assert list(first.emitted_ids) == greedy(ckpt.hf, PROMPTS[2], NEW_TOKENS)
    assert later.cached_tokens == 0
    assert list(later.emitted_ids) == greedy(ckpt.hf, again, NEW_TOKENS)


def test_trees_and_eagle_are_refused(ckpt: HybridCheckpoints, tmp_path: Path) -> None:
    """A recurrent state follows one chain: tree drafting and EAGLE (Llama only) are refused."""
    from specstate.core.errors import InvalidConfig
    from specstate.reference.workers import default_registry

    registry = default_registry()
    with pytest.raises(InvalidConfig, match="verifies chains only; topk 2 drafts a tree"):
        registry.create("draft_model", target=ckpt.target, draft=ckpt.partial, topk=2)
    with pytest.raises(InvalidConfig, match="eagle worker needs a Llama target"):
        registry.create("eagle", target=ckpt.target, eagle=tmp_path)


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_is_independent_of_the_drafts(
    ckpt: HybridCheckpoints, overlap: bool
) -> None:
    """Seeded sampled requests emit the same tokens with speculation as without it: the state
    committed after a sampled verify is the one of its accepted run."""
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=7 + i) for i in range(5)
    ]
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    outputs = {}
    spies = {}
    for algorithm in ("none", "ngram", "draft_model"):
        spies[algorithm] = spy = RoundSpy(ckpt.worker(algorithm))
        with Engine(spy, limits=limits, config=checked_config(overlap=overlap)) as engine:
            reqs = [engine.submit(f"s{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
            run_checked(engine)
        outputs[algorithm] = [list(r.emitted_ids) for r in reqs]
    assert outputs["ngram"] == outputs["none"]
    assert outputs["draft_model"] == outputs["none"]
    assert _partial_accepts(
        spies["draft_model"].rounds, spies["draft_model"].capabilities.max_accept
    )
