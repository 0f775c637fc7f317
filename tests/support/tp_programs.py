"""Test-only: programs that spawned ranks run (`specstate.distributed.spawn_ranks`).

Each is a module-level function ``program(group, *args)`` whose return value travels back to
the test in the parent; one spawn runs a whole matrix, because starting a rank costs seconds.
"""

from __future__ import annotations

import random

import torch

from specstate.core.errors import InvalidConfig
from specstate.distributed.groups import RankGroup
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.model import AttentionBatch, TreeAttentionBatch, TreeMask
from specstate.reference.workers.sources import build_model

NUM_SLOTS = 256
ROW_WIDTH = 48


def _table(seed: int) -> torch.Tensor:
    """A req_to_token table of 4 rows of scattered slots (row 0 padding)."""
    gen = random.Random(seed)
    slots = list(range(1, NUM_SLOTS))
    gen.shuffle(slots)
    table = torch.zeros(4, ROW_WIDTH, dtype=torch.int64)
    for row in range(1, 4):
        table[row] = torch.tensor(slots[(row - 1) * ROW_WIDTH : row * ROW_WIDTH])
    return table


def _batch(table: torch.Tensor, parts: list[tuple[int, int, list[int]]]) -> AttentionBatch:
    ids: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    for row, prefix, new in parts:
        ids += new
        positions += range(prefix, prefix + len(new))
        locs += table[row, prefix : prefix + len(new)].tolist()
    return AttentionBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(locs),
        req_pool_indices=torch.tensor([p[0] for p in parts]),
        req_to_token=table,
        prefix_lens=torch.tensor([p[1] for p in parts]),
        extend_lens=torch.tensor([len(p[2]) for p in parts]),
    )


def _forwards(vocab: int) -> list[list[tuple[int, int, list[int]]]]:
    """Packed prefill of three prompts, a chunk, 1-token decodes and a 4-token verify."""
    gen = random.Random(5)

    def ids(n: int) -> list[int]:
        return [gen.randrange(vocab) for _ in range(n)]

    return [
        [(3, 0, ids(7)), (1, 0, ids(12)), (2, 0, ids(3))],
        [(2, 3, ids(5))],
        [(3, 7, ids(1)), (1, 12, ids(1)), (2, 8, ids(1))],
        [(1, 13, ids(4)), (3, 8, ids(4))],
    ]


def _tree(table: torch.Tensor, vocab: int) -> TreeAttentionBatch:
    """A 4-node tree (root, two children, a grandchild) on row 1 after 17 tokens."""
    base = _batch(table, [(1, 17, [random.Random(9).randrange(vocab) for _ in range(4)])])
    visible = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    return TreeAttentionBatch(
        input_ids=base.input_ids,
        positions=torch.tensor([17, 18, 18, 19]),
        out_cache_loc=base.out_cache_loc,
        req_pool_indices=base.req_pool_indices,
        req_to_token=table,
        prefix_lens=base.prefix_lens,
        extend_lens=base.extend_lens,
        tree=TreeMask(start=torch.tensor([17]), visible=visible),
    )


def sharded_forwards(group: RankGroup, checkpoint: str) -> dict[str, object]:
    """The sharded model's outputs next to the whole model's, on every extend shape.

    Returns the largest logit and hidden-state differences, this rank's sharded logits (the
    parent compares the ranks bit for bit), the KV cache's head count, and the refusals.
    """
    whole = load_paged_llama(checkpoint, num_token_slots=NUM_SLOTS)
    sharded = load_paged_llama(checkpoint, num_token_slots=NUM_SLOTS, parallel=group.worker)
    copied = build_model(whole, num_token_slots=NUM_SLOTS, device="cpu", parallel=group.worker)
    table = _table(seed=1)
    logit_diff = hidden_diff = copy_diff = 0.0
    outputs: list[torch.Tensor] = []
    batches: list[AttentionBatch] = [
        _batch(table, parts) for parts in _forwards(whole.config.vocab_size)
    ]
    batches.append(_tree(table, whole.config.vocab_size))
    for batch in batches:
        ref, ours, other = whole(batch), sharded(batch), copied(batch)
        logit_diff = max(logit_diff, float((ours.logits - ref.logits).abs().max()))
        hidden_diff = max(hidden_diff, float((ours.hidden_states - ref.hidden_states).abs().max()))
        copy_diff = max(copy_diff, float((other.logits - ours.logits).abs().max()))
        outputs += [ours.logits, ours.hidden_states]
    refusals = []
    try:
        build_model(sharded, num_token_slots=NUM_SLOTS, device="cpu")
    except InvalidConfig as exc:
        refusals.append(str(exc))
    return {
        "logit_diff": logit_diff,
        "hidden_diff": hidden_diff,
        "copy_diff": copy_diff,
        "outputs": outputs,
        "kv_heads": sharded.kv_cache.gather(0, torch.tensor([0]))[0].shape[1],
        "q_rows": sharded.state_dict()["layers.0.self_attn.q_proj.weight"].shape[0],
        "refusals": refusals,
    }
