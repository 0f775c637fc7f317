"""Tree rounds leave the KV a chain would: compaction, drafter catch-up, the write window.

Driven by the hand-made scheduler loop (`worker_harness.WorkerLoop`), with drafters that agree
with the target only partly, so paths of every length, through non-first branches, are
accepted and moved. After several rounds, the target's and the drafter's KV of every committed
position equals a dense prefill of the row's settled tokens, and no round wrote a KV slot outside
``[S, kv_allocated_len)`` of its rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spec_checkpoints import SpecCheckpoints, make_partial_drafters, make_spec_checkpoints
from worker_harness import WorkerLoop

from specstate import (
    InvalidConfig,
    Req,
    RequestLimits,
    SamplingParams,
)
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.eagle_head import load_eagle_head
from specstate.reference.model import AttentionBatch, KvCache
from specstate.reference.workers import (
    DraftModelWorker,
    EagleWorker,
    TreeRoundWorker,
    VerifiedTree,
    default_registry,
)

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [79, 32], [38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19]]
NUM_STEPS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A one-layer target with a draft model and an EAGLE head that agree with it partly."""
    root = tmp_path_factory.mktemp("tree_kv")
    return make_partial_drafters(make_spec_checkpoints(root), root)


def tree_worker(
    ckpt: SpecCheckpoints, algorithm: str, *, topk: int = 2, nodes: int = 6
) -> TreeRoundWorker:
    """An ``algorithm`` tree worker of NUM_STEPS levels on the partial drafters."""
    options: dict[str, object] = {
        "target": ckpt.target,
        "num_steps": NUM_STEPS,
        "topk": topk,
        "num_draft_tokens": nodes,
    }
    options["eagle" if algorithm == "eagle" else "draft"] = (
        ckpt.eagle if algorithm == "eagle" else ckpt.draft
    )
    worker = default_registry().create(algorithm, **options)
    assert isinstance(worker, TreeRoundWorker)
    return worker


def drafter_cache(worker: TreeRoundWorker) -> KvCache:
    """The drafter's own KV cache."""
    if isinstance(worker, EagleWorker):
        return worker.head.kv_cache
    assert isinstance(worker, DraftModelWorker)
    return worker.draft_model.kv_cache


def snapshot(cache: KvCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of every layer's K and V."""
    slots = torch.arange(cache.num_token_slots)
    return [cache.gather(layer, slots) for layer in range(cache.num_layers)]


def changed_slots(cache: KvCache, before: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``[num_token_slots]`` bool: slots whose K or V changed in some layer since ``before``."""
    changed = torch.zeros(cache.num_token_slots, dtype=torch.bool)
    for (k0, v0), (k1, v1) in zip(before, snapshot(cache), strict=True):
        changed |= (k0 != k1).flatten(1).any(1) | (v0 != v1).flatten(1).any(1)
    return changed


def dense_kv(
    ckpt: SpecCheckpoints, algorithm: str, tokens: list[int]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """KV of ``tokens`` from one causal prefill: (target layers, drafter layers)."""
    n = len(tokens)
    table = torch.arange(1, n + 1)[None, :].repeat(2, 1)
    batch = AttentionBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(n),
        out_cache_loc=table[1],
        req_pool_indices=torch.tensor([1]),
        req_to_token=table,
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([n]),
    )
    target = load_paged_llama(ckpt.target, num_token_slots=n + 1)
    hidden = target(batch).hidden_states
    if algorithm == "eagle":
        head = load_eagle_head(ckpt.eagle, target, num_token_slots=n + 1)
        head(batch, torch.cat([torch.zeros_like(hidden[:1]), hidden[:-1]]))
        draft = head.kv_cache
    else:
        drafter = load_paged_llama(ckpt.draft, num_token_slots=n + 1)
        drafter(batch)
        draft = drafter.kv_cache
    slots = table[1]
    return (
        [target.kv_cache.gather(layer, slots) for layer in range(target.kv_cache.num_layers)],
        [draft.gather(layer, slots) for layer in range(draft.num_layers)],
    )


@pytest.mark.parametrize(
    ("algorithm", "topk", "nodes", "page_size", "chunk"),
    [
        pytest.param("eagle", 2, 6, 1, None, id="eagle-k2-D6-page1"),
        pytest.param("eagle", 4, 8, 16, 4, id="eagle-k4-D8-page16-chunked"),
        pytest.param("draft_model", 2, 6, 16, 4, id="draft-k2-D6-page16-chunked"),
        pytest.param("draft_model", 4, 8, 1, None, id="draft-k4-D8-page1"),
    ],
)
def test_committed_kv_equals_a_dense_prefill_and_writes_stay_in_the_window(
    ckpt: SpecCheckpoints,
    algorithm: str,
    topk: int,
    nodes: int,
    page_size: int,
    chunk: int | None,
) -> None:
    """After 8 tree rounds every committed position's KV (target, drafter) is the dense one.

    Every round's accepted path was moved into ``[S, S + a)``; paths through non-first
    branches and paths whose nodes had to move both happened; each decode forward changed only
    KV slots of ``req_to_token[slot, S : kv_allocated_len]``.
    """
    worker = tree_worker(ckpt, algorithm, topk=topk, nodes=nodes)
    rounds: list[VerifiedTree] = []
    worker.observer = rounds.append
    loop = WorkerLoop(
        worker,
        vocab_size=ckpt.vocab_size,
        page_size=page_size,
        max_len=max(map(len, PROMPTS)) + 64,
        num_requests=len(PROMPTS),
    )
    params = SamplingParams(max_new_tokens=64)
    reqs = [
        Req.new(f"r{i}", p, params, loop.limits, checker=loop.mem.checker)
        for i, p in enumerate(PROMPTS)
    ]
    loop.admit(reqs)
    loop.prefill(reqs, chunk)
    table, ledger = loop.mem.allocator.req_to_token, loop.mem.ledger
    caches = (worker.target_model.kv_cache, drafter_cache(worker))
    for _ in range(8):
        slots = loop.mem.slots(*reqs)
        start = ledger.committed(slots)
        before = [snapshot(cache) for cache in caches]
        loop.decode_round()
        allowed = torch.zeros(caches[0].num_token_slots, dtype=torch.bool)
        allowed[0] = True  # the padding slot
        for slot, s, end in zip(slots, start, ledger.allocated(slots), strict=True):
            allowed[table[slot, int(s) : int(end)]] = True
        for cache, old in zip(caches, before, strict=True):
            outside = changed_slots(cache, old) & ~allowed
            assert not bool(outside.any()), torch.nonzero(outside).flatten().tolist()
    assert not any(r.is_finished for r in reqs)
    verdicts = [r.verdict for r in rounds]
    accepted = torch.cat([v.accept_lens for v in verdicts])
    assert int(accepted.max()) > 1 and bool(((accepted > 1) & (accepted < 4)).any())
    assert any(bool(r.verdict.non_first_branch(r.tree).any()) for r in rounds)
    depth = torch.arange(NUM_STEPS + 1)[None, :]
    assert any(bool(((v.path != depth) & (depth < v.accept_lens[:, None])).any()) for v in verdicts)
    for req in reqs:
        slot = loop.mem.slots(req)
        committed = int(ledger.committed(slot)[0])
        tokens = (list(req.prompt_ids) + list(req.output_ids))[:committed]
        target_kv, draft_kv = dense_kv(ckpt, algorithm, tokens)
        row = table[int(slot[0]), :committed]
        for cache, dense in zip(caches, (target_kv, draft_kv), strict=True):
            for layer, (keys, values) in enumerate(dense):
                got_k, got_v = cache.gather(layer, row)
                torch.testing.assert_close(got_k, keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(got_v, values, atol=1e-4, rtol=1e-4)


def test_a_tree_worker_serves_sampling_and_the_per_request_controls(ckpt: SpecCheckpoints) -> None:
    """supports_sampling and every per-request control: the engine serves sampled, seeded,
    penalized, logprobs and non-speculative requests on a tree (`test_tree_controls` checks
    their outputs); adaptive steps are not declared."""
    worker = tree_worker(ckpt, "eagle")
    caps = worker.capabilities
    assert caps.supports_sampling and caps.supports_seeds and caps.supports_logprobs
    assert caps.supports_penalties and caps.supports_min_new_tokens
    assert caps.supports_per_request_speculation and not caps.supports_adaptive_steps
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=1024)) as engine:
        reqs = [
            engine.submit("hot", [1, 2, 3], SamplingParams(temperature=0.7, max_new_tokens=6)),
            engine.submit("cold", [1, 2, 3], SamplingParams(max_new_tokens=4)),
            engine.submit(
                "seeded", [1, 2, 3], SamplingParams(temperature=0.7, seed=1, max_new_tokens=5)
            ),
            engine.submit(
                "logprobs",
                [1, 2, 3],
                SamplingParams(logprobs=True, repetition_penalty=1.3, max_new_tokens=5),
            ),
            engine.submit("plain", [1, 2, 3], SamplingParams(speculative=False, max_new_tokens=5)),
        ]
        engine.run_until_idle()
    assert [len(r.emitted_ids) for r in reqs] == [6, 4, 5, 5, 5]
    assert reqs[3].logprobs is not None and len(reqs[3].logprobs) == 5
    assert set(reqs[4].accept_lengths) == {1}


def test_topk_one_is_the_chain_worker(ckpt: SpecCheckpoints, tmp_path: Path) -> None:
    """topk 1 (the default) keeps the chain capabilities and the chain round."""
    for worker in (
        EagleWorker(target=ckpt.target, eagle=ckpt.eagle, num_steps=3),
        DraftModelWorker(target=ckpt.target, draft=ckpt.draft, num_steps=3, topk=1),
    ):
        caps = worker.capabilities
        assert worker.tree_shape is None
        assert (caps.topk, caps.num_draft_tokens, caps.supports_sampling) == (1, 4, True)
    with pytest.raises(InvalidConfig, match="exceeds the 10 candidates"):
        DraftModelWorker(target=ckpt.target, draft=ckpt.draft, topk=2, num_draft_tokens=12)


def test_publish_comes_after_the_verify_and_before_the_drafter_catches_up(
    ckpt: SpecCheckpoints,
) -> None:
    """Decode: K drafter forwards (root + K-1 levels), target verify, publish, drafter extend."""
    worker = tree_worker(ckpt, "draft_model", topk=2, nodes=5)
    events: list[str] = []
    loop = WorkerLoop(
        worker,
        vocab_size=ckpt.vocab_size,
        page_size=4,
        max_len=40,
        num_requests=2,
        events=events,
    )
    worker.target_model.register_forward_pre_hook(lambda *_: events.append("target"))
    assert isinstance(worker, DraftModelWorker)
    worker.draft_model.register_forward_pre_hook(lambda *_: events.append("draft"))
    params = SamplingParams(max_new_tokens=20)
    reqs = [
        Req.new(f"r{i}", p, params, loop.limits, checker=loop.mem.checker)
        for i, p in enumerate(PROMPTS[:2])
    ]
    loop.admit(reqs)
    loop.prefill(reqs, None)
    del events[:]
    loop.decode_round()
    loop.decode_round()
    one = ["forward:decode", *["draft"] * NUM_STEPS, "target", "publish", "draft", "return"]
    assert events == one + one
