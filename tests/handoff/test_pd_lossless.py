"""Prefill → decode is lossless: every algorithm × loop × page size, prefix cache on.

A prefill engine runs each request's prefill and first token, the record crosses in its wire
form, a decode engine continues it. Greedy requests (every other one stopping inside an accepted
run) must emit exactly transformers' ``generate()`` tokens and one engine's; seeded sampled
requests exactly one engine's. A second wave repeats each prompt with a longer tail, so the
decode engine's prefix cache supplies part of an arriving request's KV (the import writes only
the rest). The decode engine prefills nothing for a handed-off request, target or drafter.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import checked_config, run_checked, with_stops
from handoff_harness import PrefillCounter, linked, pools_full, run_one, run_pd
from hf_oracle import greedy
from spec_checkpoints import (
    ALGORITHMS,
    MIXED_PROMPTS,
    SpecCheckpoints,
    make_partial_drafters,
    make_spec_checkpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol, handoff_worker
from specstate.handoff.link import serve_disaggregated
from specstate.reference.workers import default_registry

NEW_TOKENS = 12
WAVE1 = [list(p) for p in MIXED_PROMPTS]
WAVE2 = [[*p, (7 * i + 3) % 90 + 1, 11] for i, p in enumerate(WAVE1)]  # wave 1's prefixes
PROMPTS = WAVE1 + WAVE2


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Drafters that agree with the target for a few tokens, then diverge."""
    root = tmp_path_factory.mktemp("pd")
    return make_partial_drafters(make_spec_checkpoints(root), Path(root))


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """transformers' greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


def _worker(ckpt: SpecCheckpoints, algorithm: str) -> WorkerProtocol:
    return ckpt.worker(algorithm, agreeing=False)


def _requests(
    stops: list[int | None], *, sampled: bool
) -> list[tuple[str, list[int], SamplingParams]]:
    out = []
    for i, (prompt, stop) in enumerate(zip(PROMPTS, stops, strict=True)):
        if sampled:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=100 + i)
        else:
            params = SamplingParams(
                max_new_tokens=NEW_TOKENS, stop_token_ids=() if stop is None else (stop,)
            )
        out.append((f"r{i}", prompt, params))
    return out


def _waves(
    requests: list[tuple[str, list[int], SamplingParams]],
) -> list[list[tuple[str, list[int], SamplingParams]]]:
    return [requests[: len(WAVE1)], requests[len(WAVE1) :]]


MATRIX = list(itertools.product(ALGORITHMS, [False, True], [1, 16]))
SEEDED = list(itertools.product((*ALGORITHMS, "mtp", "eagle3"), [False, True], [1, 16]))


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "overlap", "page_size"), MATRIX)
def test_greedy_through_prefill_and_decode_equals_hf_and_one_engine(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
) -> None:
    """Greedy requests, stops inside runs: HF's tokens, one engine's tokens, no recompute."""
    stops, wants = with_stops(expected)
    requests = _requests(stops, sampled=False)
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size, "prefix_cache": True}
    run = run_pd(
        _worker(ckpt, algorithm),
        _worker(ckpt, algorithm),
        _waves(requests),
        vocab_size=ckpt.vocab_size,
        **options,
    )
    one, one_accepts = run_one(
        _worker(ckpt, algorithm), _waves(requests), vocab_size=ckpt.vocab_size, **options
    )
    got = [run.outputs[f"r{i}"] for i in range(len(PROMPTS))]
    assert got == wants
    assert run.outputs == one
    assert run.accepts == one_accepts  # the drafter's state crossed whole: the same drafts
    # A request that stops at its first token ends on the prefill engine and never crosses.
    assert run.handoffs == sum(len(w) > 1 for w in wants) > 0
    assert run.prefill_tokens_on_decode == 0
    assert run.drafter_prefill_tokens_on_decode == 0
    if algorithm != "none":
        assert 1.0 < run.mean_accept < 4.0  # partial acceptance on the decode side
    if page_size == 1:
        assert run.decode_cached_tokens > 0  # wave 2 arrived onto cached prefixes


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "overlap", "page_size"), SEEDED)
def test_seeded_sampling_through_prefill_and_decode_equals_one_engine(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool, page_size: int
) -> None:
    """Seeded sampled requests: a token is a function of (seed, position), so the split does
    not change one (the hidden-state families MTP and EAGLE-3 too)."""
    requests = _requests([None] * len(PROMPTS), sampled=True)
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size, "prefix_cache": True}
    run = run_pd(
        _worker(ckpt, algorithm),
        _worker(ckpt, algorithm),
        _waves(requests),
        vocab_size=ckpt.vocab_size,
        **options,
    )
    one, one_accepts = run_one(
        _worker(ckpt, algorithm), _waves(requests), vocab_size=ckpt.vocab_size, **options
    )
    assert run.outputs == one
    assert run.accepts == one_accepts
    assert run.prefill_tokens_on_decode == 0 and run.drafter_prefill_tokens_on_decode == 0


def test_one_engine_prefills_what_the_decode_engine_does_not(ckpt: SpecCheckpoints) -> None:
    """The counter sees a drafter prefill where one happens (one engine, same requests)."""
    worker = _worker(ckpt, "draft_model")
    counter = PrefillCounter(worker)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=checked_config()) as engine:
        engine.generate(WAVE1, SamplingParams(max_new_tokens=4))
    assert counter.drafter_tokens == sum(map(len, WAVE1))
    assert counter.target_tokens == sum(map(len, WAVE1))


@pytest.mark.parametrize("algorithm", ["ngram", "draft_model", "eagle", "mtp", "eagle3"])
def test_a_decode_engine_prefills_on_top_of_imported_state(
    ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """After wave 1 crossed, wave 2 is submitted to the decode engine itself: its prefix cache
    maps the imported KV, features and histories into the new rows, and its prefill continues
    from them: the same tokens and the same accept lengths as one engine serving both waves."""
    requests = _requests([None] * len(PROMPTS), sampled=False)
    waves = _waves(requests)
    options: dict[str, Any] = {"page_size": 1, "prefix_cache": True}
    want, want_accepts = run_one(
        _worker(ckpt, algorithm), waves, vocab_size=ckpt.vocab_size, **options
    )
    with linked(
        _worker(ckpt, algorithm), _worker(ckpt, algorithm), vocab_size=ckpt.vocab_size, **options
    ) as link:
        first = serve_disaggregated(link, waves[0], after_step=check_engine)
        second = [link.decode.submit(rid, p, s) for rid, p, s in waves[1]]
        run_checked(link.decode)
        assert sum(r.cached_tokens for r in second) > 0
        assert pools_full(link.prefill) and pools_full(link.decode)
        reqs = {**first, **{r.request_id: r for r in second}}
    assert {rid: list(r.emitted_ids) for rid, r in reqs.items()} == want
    assert {rid: r.accept_lengths for rid, r in reqs.items()} == want_accepts


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size"),
    list(itertools.product(["mtp", "eagle3"], [False, True], [1, 16])),
)
def test_hidden_state_families_through_prefill_and_decode(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
) -> None:
    """MTP (its feature store by slot, [L, slots, H]) and EAGLE-3 (features of three layers):
    HF's tokens, one engine's tokens and accept lengths, no drafter prefill on the decode side."""
    requests = _requests([None] * len(PROMPTS), sampled=False)
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size, "prefix_cache": True}
    run = run_pd(
        _worker(ckpt, algorithm),
        _worker(ckpt, algorithm),
        _waves(requests),
        vocab_size=ckpt.vocab_size,
        **options,
    )
    one, one_accepts = run_one(
        _worker(ckpt, algorithm), _waves(requests), vocab_size=ckpt.vocab_size, **options
    )
    assert [run.outputs[f"r{i}"] for i in range(len(PROMPTS))] == expected
    assert run.outputs == one and run.accepts == one_accepts
    assert run.prefill_tokens_on_decode == 0 and run.drafter_prefill_tokens_on_decode == 0
    assert 1.0 < run.mean_accept < 3.0  # partial acceptance (two MTP layers; eagle3 at 2 steps+)


def _tree(ckpt: SpecCheckpoints, algorithm: str) -> WorkerProtocol:
    """A tree drafter: two branches a node, five nodes verified a round."""
    options = ckpt.options(algorithm, agreeing=False)
    return default_registry().create(algorithm, **options, topk=2, num_draft_tokens=5)


TREES = ("draft_model", "eagle", "eagle3")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size"), list(itertools.product(TREES, [False, True], [1, 16]))
)
def test_trees_through_prefill_and_decode(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
) -> None:
    """Tree drafters (``topk`` 2) cross like chains: between rounds a tree keeps nothing but
    what a chain keeps by slot (its accepted path is compacted) and the relay. Greedy: HF's
    tokens, one engine's tokens and accept lengths; seeded sampled: one engine's."""
    stops, wants = with_stops(expected)
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size, "prefix_cache": True}
    for requests in (_requests(stops, sampled=False), _requests(stops, sampled=True)):
        run = run_pd(
            _tree(ckpt, algorithm),
            _tree(ckpt, algorithm),
            _waves(requests),
            vocab_size=ckpt.vocab_size,
            **options,
        )
        one, one_accepts = run_one(
            _tree(ckpt, algorithm), _waves(requests), vocab_size=ckpt.vocab_size, **options
        )
        assert run.outputs == one and run.accepts == one_accepts
        assert run.prefill_tokens_on_decode == 0 and run.drafter_prefill_tokens_on_decode == 0
        assert 1.0 < run.mean_accept < 4.0
        if requests[0][2].temperature == 0.0:
            assert [run.outputs[f"r{i}"] for i in range(len(PROMPTS))] == wants


@pytest.mark.parametrize(
    ("algorithm", "topk"),
    [*((a, 1) for a in (*ALGORITHMS, "mtp", "eagle3")), *((a, 2) for a in TREES)],
)
def test_the_decode_engine_holds_exactly_the_state_that_crossed(
    ckpt: SpecCheckpoints, algorithm: str, topk: int
) -> None:
    """After its import batch, every slot-kept buffer of the decode worker (target and drafter
    KV, features, histories) holds the record's values bit for bit at the request's new slots
    (the relayed draft state is checked by the accept lengths of the tests above); a tree
    drafter's too."""
    make = _worker if topk == 1 else _tree
    prefill_worker, decode_worker = make(ckpt, algorithm), make(ckpt, algorithm)
    with linked(prefill_worker, decode_worker, vocab_size=ckpt.vocab_size, page_size=4) as link:
        link.prefill.submit_prefill("r", WAVE1[2], SamplingParams(max_new_tokens=5))
        run_checked(link.prefill)
        record = link.prefill.export_handoff("r")
        parked = link.prefill.request("r")
        prefill_locs = link.prefill.allocator.req_to_token[
            link.prefill.allocator.slot_of(parked), : record.committed_len
        ]
        req = link.decode.admit_handoff(record)
        while req.num_outputs == 0:  # the import batch settles (a decode round may follow)
            link.decode.step()
        assert req.output_ids[:1] == record.output_ids
        slot = link.decode.allocator.slot_of(req)  # rounds write only at C and above
        locs = link.decode.allocator.req_to_token[slot, : record.committed_len]
        held = handoff_worker(decode_worker).export_handoff(locs)
        assert list(held) == list(record.slot_state)
        for name, tensor in record.slot_state.items():
            assert torch.equal(held[name], tensor), name
        # Read apart from the export: every KV cache, and a feature store ([slots, W] for the
        # EAGLE heads, [L, slots, H] for MTP), equal at both engines' slots of the request.
        for owner, cache in decode_worker.kv_caches().items():  # type: ignore[attr-defined]
            source = prefill_worker.kv_caches()[owner]  # type: ignore[attr-defined]
            for layer in range(cache.num_layers):
                for ours, theirs in zip(
                    cache.gather(layer, locs), source.gather(layer, prefill_locs), strict=True
                ):
                    assert torch.equal(ours, theirs), (owner, layer)
        features = getattr(decode_worker, "features", None)
        if features is not None:
            source = prefill_worker.features  # type: ignore[attr-defined]
            dim = features.dim() - 2
            assert torch.equal(
                features.index_select(dim, locs), source.index_select(dim, prefill_locs)
            )
        link.prefill.release_handoff("r")
        run_checked(link.decode)
