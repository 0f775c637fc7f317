"""Random workloads against the oracle: arrivals, lengths, budgets, aborts, stops, pool sizes.

Hypothesis draws the algorithm, the loop, the page size, chunking and mixing, the pool size
(small pools force retraction), and requests that arrive at random steps, some with a stop
token taken from the oracle's own output and some aborted at a random step. Every request that
was not aborted must emit exactly the oracle's tokens up to its stop or cap; an aborted one, a
prefix of them. The invariant checker runs after every step; the pool balances at the end.
"""

from __future__ import annotations

from functools import cache

import pytest
from hf_oracle import greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from spec_checkpoints import ALGORITHMS, SpecCheckpoints, make_spec_checkpoints

from specstate import FinishReason, InvalidRequest, Req, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine

MAX_NEW = 16
PROMPT_POOL = [
    [3, 14, 15],
    [92, 65, 35, 89, 79, 32, 38],
    [46],
    [26, 43, 38, 32, 79, 50, 28, 84, 19, 71],
    [5, 5, 5, 5],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("random"), seed=7)


def _oracle(ckpt: SpecCheckpoints) -> dict[tuple[int, ...], list[int]]:
    return _cached_oracle(ckpt)


@cache
def _cached_oracle(ckpt: SpecCheckpoints) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): greedy(ckpt.hf, p, MAX_NEW) for p in PROMPT_POOL}


def _expected(full: list[int], params: SamplingParams) -> list[int]:
    out = full[: params.max_new_tokens]
    for i, t in enumerate(out):
        if t in params.stop_token_ids:
            return out[: i + 1]
    return out


request = st.tuples(
    st.integers(0, len(PROMPT_POOL) - 1),  # prompt
    st.integers(1, MAX_NEW),  # max_new_tokens
    st.one_of(st.none(), st.integers(0, MAX_NEW - 1)),  # stop at the oracle's token k
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(0, 12)),  # abort step
)


@pytest.mark.slow
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    overlap=st.booleans(),
    page_size=st.sampled_from([1, 4, 16]),
    chunking=st.sampled_from([(None, False), (3, False), (5, True)]),
    kv_tokens=st.sampled_from([96, 160, 512]),
    max_running=st.integers(1, 5),
    requests=st.lists(request, min_size=1, max_size=6),
)
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_random_workloads_match_the_oracle(
    ckpt: SpecCheckpoints,
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
    kv_tokens: int,
    max_running: int,
    requests: list[tuple[int, int, int | None, int, int | None]],
) -> None:
    """Non-aborted requests emit exactly the oracle's tokens; aborted ones a prefix."""
    oracle = _oracle(ckpt)
    config = EngineConfig(
        overlap=overlap,
        page_size=page_size,
        kv_tokens=kv_tokens,
        max_running=max_running,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    engine = Engine(ckpt.worker(algorithm), limits=limits, config=config)
    live: list[tuple[Req, list[int], bool]] = []
    step = 0
    pending = sorted(enumerate(requests), key=lambda x: x[1][3])
    while pending or not engine.is_idle:
        for n, (pi, max_new, stop_k, arrival, abort_at) in [p for p in pending if p[1][3] <= step]:
            pending.remove((n, (pi, max_new, stop_k, arrival, abort_at)))
            full = oracle[tuple(PROMPT_POOL[pi])]
            stops = frozenset() if stop_k is None else frozenset({full[stop_k]})
            params = SamplingParams(max_new_tokens=max_new, stop_token_ids=stops)
            try:
                req = engine.submit(f"q{n}", PROMPT_POOL[pi], params)
            except InvalidRequest:
                continue  # can never fit this pool: refused up front
            live.append((req, _expected(full, params), abort_at is not None))
        for req, _, _ in live:
            n = int(req.request_id[1:])
            abort_at = requests[n][4]
            if abort_at is not None and abort_at == step:
                engine.abort(req.request_id)
        engine.step()
        step += 1
        assert step < 2000, "the engine made no progress"
    snap = engine.snapshot()
    engine.close()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    for req, want, may_abort in live:
        got = list(req.emitted_ids)
        finish = req.finish
        assert finish is not None
        if finish.reason is FinishReason.ABORT:  # by the user, or by a pool too small for it
            assert got == want[: len(got)], req.request_id
            assert may_abort or "KV pool" in finish.detail, finish
        else:
            assert got == want, (req.request_id, finish)
