"""Verifying draft trees: which path of each row's tree the target accepts, and the run.

Greedy rows take the target's own token after every node (`verify_tree_targets`): a node is
accepted when its token is its parent's target token and its parent is accepted; the deepest
accepted node ends the path, and the run is the target's tokens along it (lossless).

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

Invariant: a verdict's accepted nodes form one path from the root; ``1 <= accept_len <= K + 1``.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from specstate.batch.sampling import SamplingInfo, seeded_uniforms
from specstate.core.errors import InvalidConfig
from specstate.reference.workers.sampler import (
    TokenCounts,
    TokenSampler,
    filtered_probs,
    sample_with_uniforms,
)
from specstate.reference.workers.tree_draft import DraftTree

__all__ = [
    "TreeVerdict",
    "tree_counts",
    "verify_greedy_tree",
    "verify_sampled_tree",
    "verify_tree",
    "verify_tree_targets",
    "verify_tree_with_probs",
]


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
