"""A sparse (MoE) target and its MTP layers, sharded over two ranks, compute the whole model.

The ranks are two threads of this process behind a small barrier-based `ParallelGroup` (the
spawned gloo ranks of the other tensor-parallel tests serve the Llama targets): each loads its
shard of an Ernie MoE checkpoint (experts split by width, the router replicated) and of its MTP
layers, and both compute the unsharded model's logits and MTP outputs.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from mtp_oracle import make_mtp_target

from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.model import AttentionBatch, ModelOutput, PagedLlama
from specstate.reference.mtp import load_mtp_layers
from specstate.reference.tensor_parallel import shard_state

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


class ThreadGroup:
    """One rank of a group whose ranks are threads: collectives meet at a barrier."""

    def __init__(self, rank: int, slots: list[torch.Tensor | None], barrier: threading.Barrier):
        self._rank = rank
        self._slots = slots
        self._barrier = barrier

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many ranks."""
        return len(self._slots)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, in rank order (the same bits everywhere)."""
        self._slots[self._rank] = tensor
        self._barrier.wait()
        parts = [t for t in self._slots if t is not None]
        total = torch.stack(parts).sum(0)
        self._barrier.wait()
        return total

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor."""
        self._slots[self._rank] = tensor
        self._barrier.wait()
        first = self._slots[0]
        assert first is not None
        out = first.clone()
        self._barrier.wait()
        return out


def batch_of(ids: list[int]) -> AttentionBatch:
    """One request's prefill at slots 1..n."""
    n = len(ids)
    table = torch.zeros(2, 32, dtype=torch.int64)
    table[1, :n] = torch.arange(1, n + 1)
    return AttentionBatch(
        input_ids=torch.tensor(ids),
        positions=torch.arange(n),
        out_cache_loc=torch.arange(1, n + 1),
        req_pool_indices=torch.tensor([1]),
        req_to_token=table,
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([n]),
    )


def run(model: PagedLlama, root: Path) -> tuple[ModelOutput, ModelOutput]:
    """The target's prefill and MTP layer 1 over it (hidden: the target's, normed)."""
    batch = batch_of(PROMPT)
    out = model(batch)
    layers = load_mtp_layers(root, model)
    mtp: ModelOutput = layers(1, batch_of(PROMPT), layers.target_hidden(out.hidden_states))
    return out, mtp


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Ernie MoE target (both layers sparse, shared experts) with two MTP layers."""
    root = tmp_path_factory.mktemp("ernie_tp")
    make_mtp_target(root, num_mtp_layers=2, layers=2, hidden=32)
    return root


def test_two_shards_compute_the_whole_sparse_model_and_its_mtp_layers(ernie: Path) -> None:
    """Logits, hidden states and MTP outputs of the shards equal the whole model's."""
    torch.set_num_threads(1)
    whole_out, whole_mtp = run(load_paged_llama(ernie, num_token_slots=32), ernie)
    slots: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2, timeout=60)
    results: list[tuple[ModelOutput, ModelOutput] | BaseException] = [
        RuntimeError(),
        RuntimeError(),
    ]

    def rank_main(rank: int) -> None:
        try:
            group = ThreadGroup(rank, slots, barrier)
            model = load_paged_llama(ernie, num_token_slots=32, parallel=group)
            results[rank] = run(model, ernie)
        except BaseException as error:  # handed to the test thread
            barrier.abort()
            results[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        assert not isinstance(result, BaseException), result
        out, mtp = result
        assert torch.allclose(out.logits, whole_out.logits, atol=1e-5)
        assert torch.allclose(out.hidden_states, whole_out.hidden_states, atol=1e-5)
        assert torch.allclose(mtp.hidden_states, whole_mtp.hidden_states, atol=1e-5)


def test_experts_split_by_width_and_the_router_is_replicated(ernie: Path) -> None:
    """Rank 1 holds the second half of every expert's gate rows and down columns."""
    model = load_paged_llama(ernie, num_token_slots=4)
    state = model.state_dict()
    second = shard_state(state, model.config, rank=1, world_size=2)
    gate = "layers.0.mlp.experts.3.gate_proj.weight"
    down = "layers.0.mlp.experts.3.down_proj.weight"
    half = state[gate].shape[0] // 2
    assert torch.equal(second[gate], state[gate][half:])
    assert torch.equal(second[down], state[down][:, half:])
    assert second["layers.0.mlp.gate.weight"] is state["layers.0.mlp.gate.weight"]
