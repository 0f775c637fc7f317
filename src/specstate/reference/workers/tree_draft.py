"""Draft trees: their shape, how a drafter grows one, and the verify forward's attention.

`TreeShape` is the size of a tree (``num_steps`` levels, ``topk`` branches, ``num_draft_tokens``
nodes) and `tree_capabilities` the worker capabilities it implies; `DraftTree` holds one tree per
row (tokens, parents, depths, ranks, scores and the ancestor mask); `grow_tree` drafts it with
``num_steps`` drafter forwards (level 1: the root's top-k children, every one expanded; each
later level: the ``topk`` best of the ``topk**2`` children of the expanded nodes, by cumulative
draft log-probability) and `select_tree` keeps the root and the ``num_draft_tokens - 1`` best
candidates, depth-major, so a parent precedes its children; `tree_attention` is the target's
verify forward over the selected nodes (node ``n`` at KV position ``S + n``, RoPE position
``S + depth(n)``, visible: the prefix and its ancestors-or-self).

The drafter grows its tree from raw logits (no controls): only acceptance depends on that.


Invariant: every tree has its root at node 0 and every other node's parent before it; the
drafter writes KV only at ``req_to_token[slot, S .. S + scratch_width)``.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerCapabilities
from specstate.reference.model import AttentionBatch, ModelOutput, TreeAttentionBatch, TreeMask
from specstate.reference.workers.layout import chain_attention
from specstate.reference.workers.round import with_sampling_controls

__all__ = [
    "DraftForward",
    "DraftTree",
    "TreeShape",
    "grow_tree",
    "select_tree",
    "tree_attention",
    "tree_capabilities",
]

DraftForward = Callable[[AttentionBatch, torch.Tensor | None], ModelOutput]
"""``forward(attention, features)``: one drafter forward (``features`` ``[T, hidden]`` or None)."""


@attrs.frozen(kw_only=True)
class TreeShape:
    """The draft tree's size: ``num_steps`` levels, ``topk`` branches, ``num_draft_tokens`` nodes.

    Raises:
        InvalidConfig: ``num_steps < 1``, ``topk < 1``, ``num_draft_tokens < 2``, or more nodes
            than the candidates the expansion produces (``topk + (num_steps-1) * topk**2``).
    """

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __attrs_post_init__(self) -> None:
        steps, topk, nodes = self.num_steps, self.topk, self.num_draft_tokens
        if steps < 1 or topk < 1 or nodes < 2:
            raise InvalidConfig(
                f"a draft tree needs num_steps >= 1, topk >= 1 and num_draft_tokens >= 2; got "
                f"{steps}, {topk}, {nodes}"
            )
        if nodes - 1 > self.num_candidates:
            raise InvalidConfig(
                f"num_draft_tokens {nodes} exceeds the {self.num_candidates} candidates of "
                f"{steps} steps of topk {topk} plus the root"
            )

    @property
    def num_candidates(self) -> int:
        """Candidates the expansion scores: ``topk`` at level 1, ``topk**2`` per later level."""
        return self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def scratch_width(self) -> int:
        """Drafter KV positions drafting writes from ``S``: the root and the expanded nodes."""
        return 1 + (self.num_steps - 1) * self.topk

    @property
    def path_width(self) -> int:
        """Depths a path may reach, plus one: ``num_steps + 1`` (``max_accept``)."""
        return self.num_steps + 1


def tree_capabilities(
    algorithm: str, *, num_steps: int, topk: int, num_draft_tokens: int | None
) -> WorkerCapabilities:
    """Capabilities of a drafter with draft KV: a chain for ``topk == 1``, else a tree.

    ``num_draft_tokens`` defaults to ``num_steps + 1`` for a chain (the only legal value) and to
    ``num_steps * topk + 1`` for a tree. A tree worker samples (``temperature``, ``top_k``,
    ``top_p``; `verify_sampled_tree`) and serves every per-request control but adaptive steps:
    ``speculative=False``, logprobs, penalties, ``min_new_tokens`` (`tree_counts`) and seeds
    (`verify_tree`).

    Raises:
        InvalidConfig: ``num_steps < 1``, ``topk < 1``, a chain with ``num_draft_tokens`` other
            than ``num_steps + 1``, or a tree `TreeShape` refuses.
    """
    if num_steps < 1 or topk < 1:
        raise InvalidConfig(
            f"{algorithm} worker needs num_steps >= 1 and topk >= 1, got {num_steps}, {topk}"
        )
    if topk == 1:
        if num_draft_tokens not in (None, num_steps + 1):
            raise InvalidConfig(
                f"{algorithm} chain (topk 1) of {num_steps} steps verifies num_draft_tokens = "
                f"{num_steps + 1}, got {num_draft_tokens}"
            )
        chain = WorkerCapabilities.chain(algorithm, num_steps=num_steps, keeps_draft_kv=True)
        return attrs.evolve(chain, supports_sampling=True)  # the chain round samples
    nodes = num_steps * topk + 1 if num_draft_tokens is None else num_draft_tokens
    shape = TreeShape(num_steps=num_steps, topk=topk, num_draft_tokens=nodes)
    return with_sampling_controls(
        WorkerCapabilities(
            algorithm=algorithm,
            num_steps=shape.num_steps,
            topk=shape.topk,
            num_draft_tokens=shape.num_draft_tokens,
            keeps_draft_kv=True,
        )
    )


@attrs.frozen(kw_only=True)
class DraftTree:
    """One draft tree per row; node 0 is the root (the bonus ``x0`` at ``S``).

    Attributes:
        tokens: ``[B, D]`` int64 node tokens.
        parents: ``[B, D]`` int64 parent node index (the root's is 0); ``parents < index``.
        depths: ``[B, D]`` int64 depth (root 0); the node's RoPE position is ``S + depth``.
        ranks: ``[B, D]`` int64 rank of the node among its parent's top-k (0: the drafter's
            first choice; the root 0). A path of rank-0 nodes is the chain a topk-1 drafter
            would have drafted.
        scores: ``[B, D]`` float32 cumulative draft log-probability (root 0).
        ancestors: ``[B, D, D]`` bool, ``ancestors[b, n, m]``: ``m`` is ``n`` or an ancestor.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ranks: torch.Tensor
    scores: torch.Tensor
    ancestors: torch.Tensor

    @classmethod
    def from_parents(
        cls,
        tokens: torch.Tensor,
        parents: torch.Tensor,
        *,
        ranks: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> DraftTree:
        """The tree of ``tokens`` ``[B, D]`` whose node ``n`` hangs under ``parents[:, n] < n``.

        Depths and the ancestor mask are derived from the parents.

        Raises:
            InvalidConfig: a parent index that is not smaller than its node's (root aside).
        """
        num_rows, width = tokens.shape
        nodes = torch.arange(width, device=tokens.device)
        if tuple(parents.shape) != (num_rows, width) or bool(
            (parents[:, 1:] >= nodes[None, 1:]).any() | (parents < 0).any()
        ):
            raise InvalidConfig("draft tree: every node's parent must precede it")
        eye = torch.eye(width, dtype=torch.bool, device=tokens.device)
        # Pointer doubling: after pass i a node holds every ancestor up to 2**(i+1) levels up
        # (the root is its own parent), so ceil(log2(width)) passes close the mask.
        ancestors = eye | F.one_hot(parents, width).bool()
        hop = parents
        for _ in range(max(width - 1, 1).bit_length()):
            ancestors = ancestors | ancestors.gather(1, hop[:, :, None].expand(-1, -1, width))
            hop = hop.gather(1, hop)
        zeros = torch.zeros_like(tokens)
        return cls(
            tokens=tokens,
            parents=parents,
            depths=ancestors.sum(-1) - 1,
            ranks=zeros if ranks is None else ranks,
            scores=zeros.float() if scores is None else scores,
            ancestors=ancestors,
        )

    @property
    def num_nodes(self) -> int:
        """D, nodes per row (root included)."""
        return int(self.tokens.shape[1])


def _top_children(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probabilities, tokens)`` ``[N, topk]`` of the ``topk`` best tokens, best first."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, tokens = logp.topk(topk, dim=-1)
    return values, tokens


def _stable_best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices ``[B, count]`` of the ``count`` highest ``scores`` per row; ties: lower index."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :count]


def select_tree(
    roots: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    cand_ranks: torch.Tensor,
    num_draft_tokens: int,
) -> DraftTree:
    """The tree of the root and the ``num_draft_tokens - 1`` best candidates per row.

    Args:
        roots: ``[B]`` bonus tokens (node 0).
        cand_tokens: ``[B, N]`` candidate tokens, level-major (a parent's index is smaller).
        cand_scores: ``[B, N]`` cumulative draft log-probabilities; a child's is ``<=`` its
            parent's, so sorting by score with ties to the lower index keeps every chosen
            node's parent chosen.
        cand_parents: ``[B, N]`` candidate index of the parent, -1 for a child of the root.
        cand_ranks: ``[B, N]`` rank among the parent's top-k.
        num_draft_tokens: D.

    A candidate whose parent was not chosen (only non-finite drafter scores get there) hangs
    under the root instead, so the result is always a valid tree.
    """
    num_rows, num_cands = cand_tokens.shape
    count = num_draft_tokens - 1
    chosen = _stable_best(cand_scores, count).sort(dim=1).values  # depth-major: parents first
    node_of = torch.full(
        (num_rows, num_cands + 1), 0, dtype=torch.int64, device=cand_tokens.device
    )  # column num_cands: "the root"
    nodes = torch.arange(1, count + 1, device=cand_tokens.device).expand(num_rows, count)
    node_of.scatter_(1, chosen, nodes)
    parent_cand = cand_parents.gather(1, chosen)
    parent_cand = torch.where(parent_cand < 0, num_cands, parent_cand)
    parents = node_of.gather(1, parent_cand)
    column = torch.zeros(num_rows, 1, dtype=torch.int64, device=cand_tokens.device)
    return DraftTree.from_parents(
        torch.cat([roots[:, None].long(), cand_tokens.gather(1, chosen)], 1),
        torch.cat([column, parents], 1),
        ranks=torch.cat([column, cand_ranks.gather(1, chosen)], 1),
        scores=torch.cat([column.float(), cand_scores.gather(1, chosen).float()], 1),
    )


def grow_tree(
    forward: DraftForward,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start: torch.Tensor,
    roots: torch.Tensor,
    root_features: torch.Tensor | None,
    shape: TreeShape,
) -> DraftTree:
    """Draft one tree per row (module docstring): ``num_steps`` drafter forwards, then select.

    Args:
        forward: the drafter; ``features`` of a node is the drafter output (``hidden_states``)
            of its parent's forward, ``root_features`` for the root.
        req_pool_indices: ``[B]`` request slots.
        req_to_token: the engine's slot table (read only).
        start: ``[B]`` frontier ``S``.
        roots: ``[B]`` bonus tokens at ``S``.
        root_features: ``[B, hidden]`` or None (a drafter without features).
        shape: the tree's size.

    Writes drafter KV only at ``req_to_token[slot, S .. S + scratch_width)``.
    """
    num_rows, topk = roots.shape[0], shape.topk
    device = roots.device
    slots = req_pool_indices.long().to(req_to_token.device)
    out = forward(
        chain_attention(req_pool_indices, req_to_token, start, roots[:, None]), root_features
    )
    scores, tokens = _top_children(out.logits, topk)  # level 1: [B, k], every node expanded
    ranks = torch.arange(topk, device=device).expand(num_rows, topk)
    cand_tokens, cand_scores, cand_ranks = [tokens], [scores], [ranks]
    cand_parents = [torch.full((num_rows, topk), -1, dtype=torch.int64, device=device)]
    front_cands = ranks  # candidate index of each expanded node
    front_features = out.hidden_states[:, None, :].expand(-1, topk, -1)
    front_visible = torch.zeros(
        num_rows, topk, shape.scratch_width, dtype=torch.bool, device=device
    )
    front_visible[:, :, 0] = True  # the root
    offset = topk
    for level in range(1, shape.num_steps):
        first = 1 + (level - 1) * topk  # scratch column of this level's first expanded node
        columns = first + torch.arange(topk, device=device)
        front_visible[:, torch.arange(topk, device=device), columns] = True  # itself
        width = first + topk
        positions = start.long()[:, None] + columns[None, :]
        out = forward(
            TreeAttentionBatch(
                input_ids=tokens.reshape(-1),
                positions=(start.long() + level)[:, None].expand(-1, topk).reshape(-1),
                out_cache_loc=req_to_token[slots[:, None], positions.to(req_to_token.device)]
                .reshape(-1)
                .to(device),
                req_pool_indices=req_pool_indices,
                req_to_token=req_to_token,
                prefix_lens=start.long() + first,
                extend_lens=torch.full((num_rows,), topk, dtype=torch.int64, device=device),
                tree=TreeMask(
                    start=start.long(),
                    visible=front_visible[:, :, :width].reshape(num_rows * topk, width),
                ),
            ),
            front_features.reshape(num_rows * topk, -1),
        )
        child_scores, child_tokens = _top_children(out.logits, topk)
        child_scores = (scores[:, :, None] + child_scores.view(num_rows, topk, topk)).flatten(1)
        child_tokens = child_tokens.view(num_rows, topk * topk)
        cand_tokens.append(child_tokens)
        cand_scores.append(child_scores)
        cand_parents.append(front_cands[:, :, None].expand(-1, -1, topk).reshape(num_rows, -1))
        cand_ranks.append(torch.arange(topk, device=device).repeat(topk).expand(num_rows, -1))
        if level + 1 < shape.num_steps:  # the next level's expanded nodes
            best = _stable_best(child_scores, topk)
            parent_slot = best // topk
            tokens, scores = child_tokens.gather(1, best), child_scores.gather(1, best)
            front_cands = offset + best
            hidden = out.hidden_states.view(num_rows, topk, -1)
            front_features = hidden.gather(
                1, parent_slot[:, :, None].expand(-1, -1, hidden.shape[2])
            )
            front_visible = front_visible.gather(
                1, parent_slot[:, :, None].expand(-1, -1, shape.scratch_width)
            )
        offset += topk * topk
    return select_tree(
        roots,
        torch.cat(cand_tokens, 1),
        torch.cat(cand_scores, 1),
        torch.cat(cand_parents, 1),
        torch.cat(cand_ranks, 1),
        shape.num_draft_tokens,
    )


def tree_attention(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start: torch.Tensor,
    tree: DraftTree,
) -> TreeAttentionBatch:
    """The verify forward of ``tree``: node ``n`` of row ``b`` at KV position ``S + n``.

    RoPE position ``S + depth(n)``; node ``n`` sees ``[0, S)`` and its ancestors-or-self.
    """
    num_rows, width = tree.tokens.shape
    start = start.long()
    offsets = torch.arange(width, dtype=torch.int64, device=tree.tokens.device)
    slots = req_pool_indices.long().to(req_to_token.device)
    kv_positions = (start[:, None] + offsets[None, :]).to(req_to_token.device)
    out_cache_loc = req_to_token[slots[:, None], kv_positions]
    return TreeAttentionBatch(
        input_ids=tree.tokens.reshape(-1),
        positions=(start[:, None] + tree.depths).reshape(-1),
        out_cache_loc=out_cache_loc.reshape(-1).to(tree.tokens.device),
        req_pool_indices=req_pool_indices,
        req_to_token=req_to_token,
        prefix_lens=start,
        extend_lens=torch.full((num_rows,), width, dtype=torch.int64, device=tree.tokens.device),
        tree=TreeMask(start=start, visible=tree.ancestors.reshape(num_rows * width, width)),
    )
