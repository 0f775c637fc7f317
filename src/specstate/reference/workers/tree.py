"""Tree drafting: grow a draft tree, verify it in one target forward, compact the KV.

A chain drafter proposes one token per step; a tree drafter (EAGLE-2 / SGLang style) expands
the ``topk`` best children of several nodes per step and lets the target verify all of them at
once. The scheduler never sees the tree: it gets the accepted run, its length and the next
draft state, exactly as from a chain. One DECODE round of row ``b`` (``S`` = frontier, ``x0`` =
bonus, ``K`` = num_steps, ``k`` = topk, ``D`` = num_draft_tokens)::

    grow      x0@S -> top-k children (level 1, all expanded); for level l = 1 .. K-1 forward
              the k expanded nodes of level l (tree attention: prefix [0, S) + ancestors), each
              proposes its top-k children; the k best of those k*k by cumulative draft
              log-probability are the next level's expanded nodes. Drafter KV of the
              expanded nodes sits in scratch positions S + 1 + (l-1)*k + i.
    select    the D - 1 best candidates by cumulative score (ties: shallower first), plus the
              root; nodes ordered depth-major, so a parent precedes its children.
    verify    target forward of the D nodes at KV positions S .. S+D-1 (node n at S + n), RoPE
              position S + depth(n), tree mask = ancestors-or-self; y_n = argmax at node n.
              Node n is accepted when its token is y_(parent n) and its parent is accepted;
              the deepest accepted node m ends the path root = p_0, p_1, .., p_(a-1) = m.
              run = y_(p_0) .. y_(p_(a-1))  (= the path's drafts, then the bonus y_m)
              accept_len a = depth(m) + 1, in [1, K + 1]
    publish   S + a
    compact   target KV of p_j moves from position S + p_j to S + j (j < a): the committed
              prefix [S, S + a) is contiguous, as if a chain of the accepted tokens ran.
    commit    the drafter re-extends the path [x0, p_1 .. p_K] at S .. S+K (the subclass:
              EAGLE with the true target features of the path, relaying H of m).

The result has stride ``D`` (as a chain's: ``D = K + 1`` there), each row's run padded with 0:
a path of depth ``d`` needs ``d + 1`` nodes, so ``a <= min(D, K + 1)``, which is the engine's
bound ``min(stride, max_accept)``. Siblings are the top-k of one distribution, so their tokens
differ: at most one child of an accepted node is accepted, the accepted nodes form one path, and
the run is the target's own greedy continuation (lossless) whatever the drafter proposed.

Sampled rows (``temperature > 0``) verify the same tree by recursive rejection sampling
(`verify_sampled_tree`). The children are the drafter's deterministic top-k, so each candidate's
proposal is one-hot; ``p_n`` is the target's filtered distribution (`filtered_probs`) at node
``n``::

    cur = root; r = p_root
    for each child c of cur, in node order:      accept c with probability r(c) / sum(r)
        accepted:  cur = c; r = p_c; continue with c's children
        rejected:  r(c) = 0                      (r renormalized implicitly)
    bonus ~ r / sum(r)                           (no child left, or every child rejected)

This is drawing ``t ~ p_cur`` and accepting the child whose token is ``t`` (checking the
children without replacement), so every emitted token, drafted or bonus, is distributed exactly
as the target's filtered distribution given the tokens before it, whatever the drafter chose.
Greedy rows of the same batch keep `verify_greedy_tree`, bit for bit.

Per-request controls (docs/engine.md, "Sampling controls"), all per row:

* penalties and ``min_new_tokens``: node ``n``'s logits are processed with the counts of the
  prefix plus its own path root .. ``n`` and ``depth(n)`` more outputs (`tree_counts`): what
  one-at-a-time decoding sees had that path been emitted. The path's tokens are then written
  to the target's token history at ``S .. S + K``;
* seeds: a seeded sampled row's target token after node ``n`` is ``F_n^-1(u(seed, S +
  depth(n) + 1))`` and a child is accepted iff it equals its parent's (`verify_tree_targets`),
  so the row emits the same tokens as a chain or no speculation;
* ``speculative=False``: the row accepts no child, exactly one token (the root's argmax,
  seeded draw, or a draw from ``p_root``);
* logprobs: run token ``j`` under the final distribution of its parent, the path node at depth
  ``j`` (`token_logprobs`).

The drafter grows its tree from raw logits (no controls): only acceptance depends on that.

Every write stays inside the engine's reservation ``[S, S + L)`` with
``L >= max(K * k, D)`` (`SpecWindow.alloc_len_per_decode`): the target writes ``[S, S + D)``,
the drafter ``[S, S + max(1 + (K-1)*k, K+1))``; both are ``<= max(K * k, D)`` for ``k >= 2``.

Invariant: after a round the target's and the drafter's KV at ``[S, S + a)`` of each row equal
what a chain forward of the accepted tokens would have written (up to float summation order),
so every later round reads the same prefix a chain worker would.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.batch.sampling import SamplingInfo, seeded_uniforms
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import OnPublish, WorkerCapabilities
from specstate.reference.model import (
    AttentionBatch,
    KvCache,
    ModelOutput,
    TreeAttentionBatch,
    TreeMask,
)
from specstate.reference.workers.layout import chain_attention, decode_result, decode_roots
from specstate.reference.workers.round import ChainRoundWorker, with_sampling_controls
from specstate.reference.workers.sampler import (
    TokenCounts,
    TokenSampler,
    filtered_probs,
    sample_with_uniforms,
    token_logprobs,
)
from specstate.reference.workers.target import TargetRunner
from specstate.relay.future_map import RelayPayload

__all__ = [
    "DraftForward",
    "DraftTree",
    "TreeRoundWorker",
    "TreeShape",
    "TreeVerdict",
    "VerifiedTree",
    "compact_kv",
    "grow_tree",
    "select_tree",
    "tree_attention",
    "tree_capabilities",
    "tree_counts",
    "verify_greedy_tree",
    "verify_sampled_tree",
    "verify_tree",
    "verify_tree_targets",
    "verify_tree_with_probs",
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


@attrs.frozen(kw_only=True)
class TreeVerdict:
    """The outcome of verifying one tree per row.

    Attributes:
        run_tokens: ``[B, K + 1]``; row ``b``'s run is ``run_tokens[b, :accept_lens[b]]``
            (past it: the root's target token for a greedy row, 0 for a sampled one).
        accept_lens: ``[B]`` int64, bonus included, in ``[1, K + 1]``.
        bonus_tokens: ``[B]`` int64, the last token of each run.
        path: ``[B, K + 1]`` node index of the accepted node at depth ``j`` (0 past the path).
        last_node: ``[B]`` the deepest accepted node (the path's end).
    """

    run_tokens: torch.Tensor
    accept_lens: torch.Tensor
    bonus_tokens: torch.Tensor
    path: torch.Tensor
    last_node: torch.Tensor

    def path_tokens(self, tree: DraftTree) -> torch.Tensor:
        """``[B, K + 1]`` tokens of the path nodes (the root's token past the path)."""
        return tree.tokens.gather(1, self.path)

    def non_first_branch(self, tree: DraftTree) -> torch.Tensor:
        """``[B]`` bool: the accepted path holds a node that is not its parent's first choice."""
        depth = torch.arange(self.path.shape[1], device=self.path.device)[None, :]
        on_path = (depth > 0) & (depth < self.accept_lens[:, None])
        return (tree.ranks.gather(1, self.path).gt(0) & on_path).any(1)


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


def _check_tree(tree: DraftTree, scores: torch.Tensor, name: str) -> None:
    num_rows, width = tree.tokens.shape
    if scores.ndim != 3 or tuple(scores.shape[:2]) != (num_rows, width):
        raise InvalidConfig(
            f"tree verify {name} {tuple(scores.shape)} do not fit {num_rows} trees of {width}"
        )


def _path_to(tree: DraftTree, last: torch.Tensor, path_width: int) -> torch.Tensor:
    """``[B, path_width]`` the node at each depth of the path root .. ``last`` (0 past it)."""
    num_rows, width = tree.tokens.shape
    rows = torch.arange(num_rows, device=last.device)
    on_path = tree.ancestors[rows, last]
    depth_slot = torch.where(on_path, tree.depths, path_width)
    nodes = torch.arange(width, device=last.device).expand(num_rows, width)
    path = torch.zeros(num_rows, path_width + 1, dtype=torch.int64, device=last.device)
    return path.scatter(1, depth_slot, nodes)[:, :path_width]


def verify_greedy_tree(tree: DraftTree, logits: torch.Tensor, path_width: int) -> TreeVerdict:
    """Greedy verification of ``tree`` against the target's ``logits`` ``[B, D, V]``.

    Args:
        tree: the verified tree.
        logits: row ``n`` scores the token after node ``n``.
        path_width: ``K + 1`` (deeper than any node).

    Raises:
        InvalidConfig: the shapes disagree.
    """
    _check_tree(tree, logits, "logits")
    return verify_tree_targets(tree, logits.argmax(-1), path_width)


def verify_tree_targets(
    tree: DraftTree,
    targets: torch.Tensor,
    path_width: int,
    speculative: torch.Tensor | None = None,
) -> TreeVerdict:
    """Verification against the target's own token ``targets[:, n]`` after every node ``n``.

    The target's token after a node is fixed before the children are compared (the argmax, or
    a seeded row's draw ``F^-1(u(seed, S + depth + 1))``): node ``n`` is accepted when its token
    is ``targets[parent n]`` and its parent is accepted; the run is ``targets`` along the path
    to the deepest accepted node. A row with ``speculative`` False (``[B]`` bool, None: all
    speculate) accepts no child: exactly one token, the root's target.
    """
    num_rows = tree.tokens.shape[0]
    matched = tree.tokens == targets.gather(1, tree.parents)
    if speculative is not None:
        matched = matched & speculative.to(matched.device)[:, None]
    matched[:, 0] = True
    # accepted: every node on the way from the root matched (the ancestor mask has the way).
    accepted = ~(tree.ancestors & ~matched[:, None, :]).any(-1)
    last = torch.where(accepted, tree.depths, -1).argmax(1)
    rows = torch.arange(num_rows, device=targets.device)
    path = _path_to(tree, last, path_width)
    return TreeVerdict(
        run_tokens=targets.gather(1, path),
        accept_lens=tree.depths[rows, last] + 1,
        bonus_tokens=targets[rows, last],
        path=path,
        last_node=last,
    )


def _accept_child(
    uniforms: torch.Tensor, mass: torch.Tensor, child_mass: torch.Tensor
) -> torch.Tensor:
    """``u < r(c) / sum(r)`` without a division; ``r(c) == 0`` (rejected before) rejects."""
    return uniforms * mass < child_mass


def verify_sampled_tree(
    tree: DraftTree, target_probs: torch.Tensor, path_width: int, sampler: TokenSampler
) -> TreeVerdict:
    """Recursive rejection sampling of every row's ``tree`` (see the module docstring).

    Args:
        tree: the verified tree; its children are deterministic (one-hot proposals).
        target_probs: ``[B, D, V]`` the target's filtered distribution after each node.
        path_width: ``K + 1`` (deeper than any node).
        sampler: draws ``B * D`` uniforms, then one token per row.

    Children are tried in node order, which is their parent's order too: a node's children all
    come after it, so one pass over the nodes walks every row's path. Row ``b``'s run is the
    accepted path's drafts, then the bonus; 0 past it.

    Raises:
        InvalidConfig: the shapes disagree.
    """
    _check_tree(tree, target_probs, "probabilities")
    num_rows, width = tree.tokens.shape
    device = target_probs.device
    rows = torch.arange(num_rows, device=device)
    uniforms = sampler.uniform((num_rows, width), device)  # column 0 (the root) unused
    current = torch.zeros(num_rows, dtype=torch.int64, device=device)
    residual = target_probs[:, 0].clone()  # unnormalized: rejected children are zeroed
    for node in range(1, width):
        token = tree.tokens[:, node, None]
        candidate = tree.parents[:, node] == current
        child_mass = residual.gather(1, token).squeeze(1)
        accept = candidate & _accept_child(uniforms[:, node], residual.sum(-1), child_mass)
        reject = candidate & ~accept
        residual = torch.where(reject[:, None], residual.scatter(1, token, 0.0), residual)
        residual = torch.where(accept[:, None], target_probs[:, node], residual)
        current = torch.where(accept, node, current)
    mass = residual.sum(-1, keepdim=True)
    # NOTE: an all-zero residual needs every remaining token rejected at probability 1; only
    # rounding gets here, and p of the node itself is then the right distribution.
    fallback = target_probs[rows, current]
    bonus = sampler.sample(torch.where(mass > 0, residual / mass.clamp_min(1e-30), fallback))
    path = _path_to(tree, current, path_width)
    accept_lens = tree.depths[rows, current] + 1
    steps = torch.arange(path_width, device=device)[None, :]
    drafted = tree.tokens.gather(1, torch.cat([path[:, 1:], path[:, :1]], 1))
    run = torch.where(steps < (accept_lens - 1)[:, None], drafted, 0)
    run = run.scatter(1, (accept_lens - 1)[:, None], bonus[:, None])
    return TreeVerdict(
        run_tokens=run,
        accept_lens=accept_lens,
        bonus_tokens=bonus,
        path=path,
        last_node=current,
    )


def tree_counts(counts: TokenCounts, tree: DraftTree) -> TokenCounts:
    """``[B, D, V]`` token state of every node: the state at ``S`` plus the node's path.

    ``counts`` is the state scoring ``S + 1`` (it holds the root ``x0``); node ``n`` scores the
    token after it, so it also sees the tokens of its ancestors-or-self below the root, exactly
    what one-at-a-time decoding sees once the path root .. ``n`` is emitted (``depth(n)`` more
    outputs: the ``min_new_tokens`` mask). A chain is the special case `TokenCounts.chain`.
    """
    one = F.one_hot(tree.tokens.long(), counts.seen.shape[-1]).to(counts.seen.dtype)
    below_root = tree.ancestors.clone()
    below_root[:, :, 0] = False  # the root x0 is in counts already
    path = torch.bmm(below_root.to(one.dtype), one)  # small integers: exact in float32
    return TokenCounts(
        seen=counts.seen[:, None] + path,
        output=counts.output[:, None] + path,
        num_outputs=counts.num_outputs[:, None] + tree.depths.to(counts.num_outputs.device),
    )


def _pick(rows: torch.Tensor, chosen: TreeVerdict, other: TreeVerdict) -> TreeVerdict:
    """``chosen``'s verdict where ``rows`` (``[B]`` bool), ``other``'s elsewhere."""
    return TreeVerdict(
        run_tokens=torch.where(rows[:, None], chosen.run_tokens, other.run_tokens),
        accept_lens=torch.where(rows, chosen.accept_lens, other.accept_lens),
        bonus_tokens=torch.where(rows, chosen.bonus_tokens, other.bonus_tokens),
        path=torch.where(rows[:, None], chosen.path, other.path),
        last_node=torch.where(rows, chosen.last_node, other.last_node),
    )


def _single_token(first: torch.Tensor, path_width: int) -> TreeVerdict:
    """The verdict that emits ``first`` ``[B]`` alone at the root (no child accepted)."""
    zeros = first.new_zeros(first.shape[0], path_width)
    return TreeVerdict(
        run_tokens=zeros.scatter(1, zeros[:, :1], first[:, None]),
        accept_lens=torch.ones_like(first),
        bonus_tokens=first,
        path=zeros,
        last_node=torch.zeros_like(first),
    )


def verify_tree_with_probs(
    tree: DraftTree,
    logits: torch.Tensor,
    path_width: int,
    sampling: SamplingInfo,
    sampler: TokenSampler,
    *,
    start: torch.Tensor | None = None,
) -> tuple[TreeVerdict, torch.Tensor | None]:
    """`verify_tree`, and the filtered distributions ``[B, D, V]`` of ``logits`` (None when the
    batch is all greedy)."""
    _check_tree(tree, logits, "logits")
    speculative = sampling.speculative
    targets = logits.argmax(-1)
    if sampling.is_all_greedy:
        return verify_tree_targets(tree, targets, path_width, speculative), None
    probs = filtered_probs(logits, sampling)
    fixed_rows = (sampling.temperatures == 0).to(logits.device)
    if sampling.seeds is not None:
        if start is None:
            raise InvalidConfig("tree verify of seeded rows needs the frontier start")
        # node n scores the token at S + depth(n) + 1: the position a seeded row draws for.
        positions = start.long().to(logits.device)[:, None] + 1 + tree.depths
        uniforms = seeded_uniforms(sampling.seeds, positions)
        seeded = (sampling.seeds.to(logits.device) >= 0) & ~fixed_rows
        targets = torch.where(seeded[:, None], sample_with_uniforms(probs, uniforms), targets)
        fixed_rows = fixed_rows | seeded
    fixed = verify_tree_targets(tree, targets, path_width, speculative)
    sampled = verify_sampled_tree(tree, probs, path_width, sampler)
    if speculative is not None:  # a single token drawn from p_root itself, not the residual
        single = ~speculative.to(logits.device)
        first = sampler.sample(probs[:, 0])
        sampled = _pick(single, _single_token(first, path_width), sampled)
    return _pick(fixed_rows, fixed, sampled), probs


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,
    path_width: int,
    sampling: SamplingInfo,
    sampler: TokenSampler,
    *,
    start: torch.Tensor | None = None,
) -> TreeVerdict:
    """Each row verified per its sampling, on its (processed) ``logits`` ``[B, D, V]``.

    Greedy rows by argmax (`verify_tree_targets`; an all-greedy batch draws nothing); seeded
    sampled rows against their seeded draws at ``start + depth + 1`` (a seeded row emits the
    tokens a chain or no speculation would); other sampled rows by `verify_sampled_tree` on
    `filtered_probs`. A row with ``speculative`` False accepts exactly one token: the root's
    argmax, seeded draw, or a draw from ``p_root``.

    Raises:
        InvalidConfig: the shapes disagree, or seeded rows without ``start``.
    """
    verdict, _ = verify_tree_with_probs(tree, logits, path_width, sampling, sampler, start=start)
    return verdict


def compact_kv(
    cache: KvCache,
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start: torch.Tensor,
    verdict: TreeVerdict,
) -> None:
    """Move the accepted path's KV into place: node ``p_j`` at ``S + p_j`` to ``S + j``, ``j < a``.

    Positions past the path are not touched (their copy is slot 0 onto slot 0, the padding).
    """
    width = verdict.path.shape[1]
    depth = torch.arange(width, device=verdict.path.device)[None, :]
    keep = (depth < verdict.accept_lens[:, None]).to(req_to_token.device)
    slots = req_pool_indices.long().to(req_to_token.device)[:, None]
    base = start.long().to(req_to_token.device)[:, None]
    src = req_to_token[slots, base + verdict.path.to(req_to_token.device)]
    dst = req_to_token[slots, base + depth.to(req_to_token.device)]
    device = cache.device
    cache.copy_slots(
        torch.where(keep, src, 0).reshape(-1).to(device),
        torch.where(keep, dst, 0).reshape(-1).to(device),
    )


def _mask_non_finite(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` rows of ``logits`` with a non-finite value; those rows are zeroed (no host read)."""
    finite = torch.isfinite(logits).flatten(1).all(dim=1)
    logits.masked_fill_(~finite.view(-1, *([1] * (logits.dim() - 1))), 0.0)
    return ~finite


@attrs.frozen(kw_only=True)
class VerifiedTree:
    """A DECODE round after the target verified its tree: what post-verify commits read.

    Attributes:
        batch: the forward's frozen batch.
        start: ``[B]`` frontier ``S`` before the round.
        tree: the verified trees.
        verdict: the accepted paths.
        target_hidden: ``[B, D, hidden]`` target features of the tree's nodes.
    """

    batch: ForwardBatch
    start: torch.Tensor
    tree: DraftTree
    verdict: TreeVerdict
    target_hidden: torch.Tensor

    def path_features(self, first: torch.Tensor) -> torch.Tensor:
        """``[B, K + 1, hidden]`` ``f_(p-1)`` of the path's tokens: ``first`` (``f_(S-1)``), then
        the target features of the path nodes ``p_0 .. p_(K-1)``."""
        hidden = self.target_hidden
        path = self.verdict.path[:, :-1, None].expand(-1, -1, hidden.shape[2])
        return torch.cat([first[:, None].to(hidden.dtype), hidden.gather(1, path)], 1)

    def path_attention(self, req_to_token: torch.Tensor) -> AttentionBatch:
        """The chain extend of the path tokens at ``S .. S+K`` (drafter catch-up)."""
        tokens = self.verdict.path_tokens(self.tree)
        return chain_attention(self.batch.req_pool_indices, req_to_token, self.start, tokens)

    @property
    def last_hidden(self) -> torch.Tensor:
        """``[B, hidden]`` target feature of the path's last node (the new bonus's ``f``)."""
        rows = torch.arange(self.target_hidden.shape[0], device=self.target_hidden.device)
        return self.target_hidden[rows, self.verdict.last_node]


def _fit_width(run_tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``run_tokens`` ``[B, K + 1]`` cut or zero-padded to the stride ``D`` (runs fit: a <= D)."""
    missing = width - run_tokens.shape[1]
    if missing <= 0:
        return run_tokens[:, :width]
    return torch.cat([run_tokens, run_tokens.new_zeros(run_tokens.shape[0], missing)], 1)


def _publish(on_publish: OnPublish | None, new_seq_lens: torch.Tensor) -> None:
    if on_publish is not None:
        on_publish(new_seq_lens)


class TreeRoundWorker(ChainRoundWorker):
    """`ChainRoundWorker` whose DECODE grows and verifies a draft tree when ``topk > 1``.

    With ``topk == 1`` every round is the chain round, unchanged. A tree round verifies each
    row per its sampling (`verify_tree`): greedy rows by argmax, sampled rows by recursive
    rejection sampling with the worker's `TokenSampler`. A subclass implements the
    chain hooks and three tree hooks: `_tree_forward` (one drafter forward),
    `_tree_root_features` and `_commit_tree` (post-verify, after publish and compaction).

    Attributes:
        observer: if set, called with every `VerifiedTree` after its round (tests, metrics).
    """

    def __init__(
        self, target: TargetRunner, capabilities: WorkerCapabilities, *, seed: int | None = None
    ) -> None:
        super().__init__(target, capabilities, seed=seed)
        self._tree: TreeShape | None = None
        if capabilities.topk > 1:
            self._tree = TreeShape(
                num_steps=capabilities.num_steps,
                topk=capabilities.topk,
                num_draft_tokens=capabilities.num_draft_tokens,
            )
        self.observer: Callable[[VerifiedTree], None] | None = None

    @property
    def tree_shape(self) -> TreeShape | None:
        """The tree's size, None for a chain worker."""
        return self._tree

    def _run_decode(
        self, batch: ForwardBatch, on_publish: OnPublish | None
    ) -> GenerationBatchResult:
        shape = self._tree
        if shape is None:
            return super()._run_decode(batch, on_publish)
        start, roots = decode_roots(batch)
        sampling = batch.sampling_info
        counts = self._target.begin_round(batch.req_pool_indices, start, roots, sampling)
        table = self._target.req_to_token
        tree = grow_tree(
            self._tree_forward,
            batch.req_pool_indices,
            table,
            start,
            roots,
            self._tree_root_features(batch, start),
            shape,
        )
        target = self._target.model
        out = target(tree_attention(batch.req_pool_indices, table, start, tree))
        num_rows, width = tree.tokens.shape
        logits = out.logits.view(num_rows, width, -1)
        invalid = _mask_non_finite(logits)
        if counts is not None:  # node n sees the prefix and its path root .. n
            logits = tree_counts(counts, tree).apply(logits, sampling)
        verdict, probs = verify_tree_with_probs(
            tree, logits, shape.path_width, sampling, self._sampler, start=start
        )
        # The history below the new frontier: the path's tokens (every round, so a prefix
        # the prefix cache shares later carries them).
        self._record_path(batch.req_pool_indices, start, verdict.path_tokens(tree))
        logprobs = None
        if sampling.logprobs:  # run token j is scored by its parent, the path node at depth j
            index = verdict.path[:, :, None].expand(-1, -1, logits.shape[-1])
            path_probs = None if probs is None else probs.gather(1, index)
            run_logprobs = token_logprobs(
                logits.gather(1, index), path_probs, sampling, verdict.run_tokens
            )
            logprobs = _fit_width(run_logprobs, width)
        new_seq_lens = start + verdict.accept_lens
        _publish(on_publish, new_seq_lens)
        compact_kv(target.kv_cache, batch.req_pool_indices, table, start, verdict)
        verified = VerifiedTree(
            batch=batch,
            start=start,
            tree=tree,
            verdict=verdict,
            target_hidden=out.hidden_states.view(num_rows, width, -1),
        )
        payload = self._commit_tree(verified)
        if self.observer is not None:
            self.observer(verified)
        return decode_result(
            _fit_width(verdict.run_tokens, width),
            verdict.accept_lens,
            new_seq_lens,
            payload,
            invalid,
            logprobs,
        )

    def _record_path(
        self, slots: torch.Tensor, start: torch.Tensor, path_tokens: torch.Tensor
    ) -> None:
        """Write the path's tokens at ``S .. S+K`` of the token history (past the accepted
        length they are never read: the next round rewrites its root and reads up to it)."""
        width = path_tokens.shape[1]
        steps = torch.arange(width, device=path_tokens.device)[None, :]
        positions = start.long().to(path_tokens.device)[:, None] + steps
        self._target.write_tokens(
            slots.long().repeat_interleave(width), positions.reshape(-1), path_tokens.reshape(-1)
        )

    @abc.abstractmethod
    def _tree_forward(
        self, attention: AttentionBatch, features: torch.Tensor | None
    ) -> ModelOutput:
        """One drafter forward over ``attention`` (tree or chain) with node ``features``."""

    @abc.abstractmethod
    def _tree_root_features(self, batch: ForwardBatch, start: torch.Tensor) -> torch.Tensor | None:
        """``[B, hidden]`` features of the roots (EAGLE: the relayed ``f_(S-1)``), or None."""

    @abc.abstractmethod
    def _commit_tree(self, verified: VerifiedTree) -> RelayPayload:
        """Post-verify drafter commits (after publish and compaction); the next payload."""
