"""Tree drafting through the real engine is lossless: HF ``generate()`` token for token.

EAGLE and draft-model trees (topk 2 and 4, several tree sizes) × overlap on/off × page size 1
and 16 × whole / chunked prefill with mixed chunks, with drafters that agree with the target only
partly. Every step runs the invariant checker (`run_checked`); every other request stops at a
token from the middle of its output (a stop inside an accepted run). Each case also shows that
the tree was exercised: accept lengths strictly between 1 and the maximum occurred, and at least
one accepted path left the drafter's first-choice chain (a non-top-1 branch won). A wrapper
audits every forward: the worker changed only KV slots inside ``[S, kv_allocated_len)`` of its
decode rows (``out_cache_loc`` in an extend), also under overlap.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from engine_driver import checked_config, serve_to_completion, with_stops
from hf_oracle import greedy
from spec_checkpoints import (
    MIXED_PROMPTS,
    SpecCheckpoints,
)

from specstate import RequestLimits
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.reference.model import KvCache
from specstate.reference.workers import (
    DraftModelWorker,
    EagleWorker,
    TreeRoundWorker,
    VerifiedTree,
    default_registry,
)
from specstate.testing.conformance import assert_worker_conforms

PROMPTS = [list(p) for p in MIXED_PROMPTS]
NEW_TOKENS = 14
NUM_STEPS = 3


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A one-layer target, a draft model and an EAGLE head that agree with it partly."""
    return partial_ckpt


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """The oracle's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


def tree_worker(ckpt: SpecCheckpoints, algorithm: str, topk: int, nodes: int) -> TreeRoundWorker:
    """An ``algorithm`` tree worker of NUM_STEPS levels on the partial drafters."""
    drafter = {"eagle": ckpt.eagle} if algorithm == "eagle" else {"draft": ckpt.draft}
    worker = default_registry().create(
        algorithm,
        target=ckpt.target,
        num_steps=NUM_STEPS,
        topk=topk,
        num_draft_tokens=nodes,
        **drafter,
    )
    assert isinstance(worker, TreeRoundWorker)
    return worker


def _caches(worker: TreeRoundWorker) -> tuple[KvCache, KvCache]:
    if isinstance(worker, EagleWorker):
        return worker.target_model.kv_cache, worker.head.kv_cache
    assert isinstance(worker, DraftModelWorker)
    return worker.target_model.kv_cache, worker.draft_model.kv_cache


def _snapshot(cache: KvCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    slots = torch.arange(cache.num_token_slots)
    return [cache.gather(layer, slots) for layer in range(cache.num_layers)]


@attrs.define
class AuditedWorker:
    """A `WorkerProtocol` wrapper that records every KV slot written outside the allowance."""

    inner: TreeRoundWorker
    memory: WorkerMemory | None = None
    violations: list[str] = attrs.Factory(list)
    forwards: int = 0

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's."""
        return self.inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the inner worker and keep the memory to read the reservations."""
        self.memory = memory
        self.inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Run the inner forward; record slots it changed outside what the batch allows."""
        assert self.memory is not None
        caches = _caches(self.inner)
        before = [_snapshot(cache) for cache in caches]
        result = self.inner.forward_batch_generation(batch, on_publish=on_publish)
        self.forwards += 1
        allowed = torch.zeros(caches[0].num_token_slots, dtype=torch.bool)
        allowed[0] = True  # the padding slot
        if batch.forward_mode is ForwardMode.DECODE:
            table = self.memory.req_to_token
            ends = self.memory.ledger.allocated(batch.req_pool_indices)
            for slot, start, end in zip(batch.req_pool_indices, batch.seq_lens, ends, strict=True):
                allowed[table[int(slot), int(start) : int(end)]] = True
        elif batch.out_cache_loc is not None:
            allowed[batch.out_cache_loc.long()] = True
        for cache, old in zip(caches, before, strict=True):
            changed = torch.zeros_like(allowed)
            for (k0, v0), (k1, v1) in zip(old, _snapshot(cache), strict=True):
                changed |= (k0 != k1).flatten(1).any(1) | (v0 != v1).flatten(1).any(1)
            if bool((changed & ~allowed).any()):
                slots = torch.nonzero(changed & ~allowed).flatten().tolist()
                self.violations.append(f"{batch.forward_mode.value}: slots {slots}")
        return result


@attrs.frozen
class TreeRun:
    """What one engine run produced and what its trees did."""

    outputs: list[list[int]]
    accept_lens: list[int]
    non_first_branch: int


def run_engine(
    ckpt: SpecCheckpoints,
    worker: TreeRoundWorker,
    stops: list[int | None],
    **config: Any,
) -> TreeRun:
    """Serve PROMPTS to completion with every check on; audit writes; collect the verdicts."""
    rounds: list[VerifiedTree] = []
    worker.observer = rounds.append
    audited = AuditedWorker(worker)
    engine_config = checked_config(**config)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(audited, limits=limits, config=engine_config) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
    assert audited.forwards > 0 and audited.violations == []
    return TreeRun(
        outputs=[list(r.emitted_ids) for r in reqs],
        accept_lens=[a for r in rounds for a in r.verdict.accept_lens.tolist()],
        non_first_branch=sum(int(r.verdict.non_first_branch(r.tree).sum()) for r in rounds),
    )


def check_tree_exercised(run: TreeRun, nodes: int) -> None:
    """Accept lengths strictly inside (1, max) occurred, a path below depth 1 was accepted (a
    tree of 4 nodes or more), and an accepted path left the drafter's first-choice chain (a
    non-top-1 branch won)."""
    longest = min(nodes, NUM_STEPS + 1)
    assert all(1 <= a <= longest for a in run.accept_lens)
    assert any(1 < a < longest for a in run.accept_lens), run.accept_lens
    assert longest < 4 or max(run.accept_lens) >= 3, run.accept_lens
    assert run.non_first_branch > 0, "no accepted path left the first-choice chain"


CHUNKING = [pytest.param(None, False, id="whole"), pytest.param(4, True, id="chunked4-mixed")]


@pytest.mark.parametrize(("chunked", "mixed"), CHUNKING)
@pytest.mark.parametrize("page_size", [1, 16], ids=lambda p: f"page{p}")
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize(("topk", "nodes"), [(2, 6), (4, 8)], ids=["k2-D6", "k4-D8"])
@pytest.mark.parametrize("algorithm", ["eagle", "draft_model"])
def test_tree_is_lossless(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    topk: int,
    nodes: int,
    overlap: bool,
    page_size: int,
    chunked: int | None,
    mixed: bool,
) -> None:
    """Greedy outputs equal HF generate, stops inside runs included; the tree was exercised."""
    stops, wants = with_stops(expected)
    run = run_engine(
        ckpt,
        tree_worker(ckpt, algorithm, topk, nodes),
        stops,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunked,
        mixed_chunk=mixed,
    )
    assert run.outputs == wants
    check_tree_exercised(run, nodes)


@pytest.mark.parametrize(
    ("algorithm", "topk", "nodes", "overlap", "page_size", "chunking"),
    [
        # D = 3 < K + 1: the stride D cuts the path width; accept <= 3
        ("eagle", 2, 3, True, 16, (3, True)),
        ("draft_model", 2, 3, False, 1, (None, False)),
        # D = K + 1: as many nodes as a chain
        ("eagle", 2, 4, False, 16, (None, False)),
        ("draft_model", 2, 4, True, 1, (3, True)),
        # D = K * k + 1 with k = 4 (the default tree size)
        ("eagle", 4, 13, True, 1, (None, False)),
        ("draft_model", 4, 13, False, 16, (3, True)),
    ],
)
def test_other_tree_sizes_are_lossless(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    topk: int,
    nodes: int,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Small, chain-sized and large trees: lossless, exercised."""
    stops, wants = with_stops(expected)
    run = run_engine(
        ckpt,
        tree_worker(ckpt, algorithm, topk, nodes),
        stops,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    assert run.outputs == wants
    check_tree_exercised(run, nodes)


@pytest.mark.parametrize(("algorithm", "topk", "nodes"), [("eagle", 2, 6), ("draft_model", 2, 5)])
def test_tree_workers_conform(ckpt: SpecCheckpoints, algorithm: str, topk: int, nodes: int) -> None:
    """The conformance suite (both loops, pages 1 and 16, chunks, KV pressure with an abort).

    topk 2: the kit's pressure run has a fixed 128-token pool at page 4, where the paged-tree
    window of topk 4 (L = 32, R = 64; as large as a 31-step chain's) leaves a request unable to
    fit alone, which the kit reports as an abort.
    """
    assert_worker_conforms(
        lambda: tree_worker(ckpt, algorithm, topk, nodes),
        vocab_size=ckpt.vocab_size,
        oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n),
    )
