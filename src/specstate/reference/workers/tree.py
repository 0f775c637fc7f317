"""Tree rounds: grow a draft tree, verify it in one target forward, compact the KV.

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

Every write stays inside the engine's reservation ``[S, S + L)`` with
``L >= max(K * k, D)`` (`SpecWindow.alloc_len_per_decode`): the target writes ``[S, S + D)``,
the drafter ``[S, S + max(1 + (K-1)*k, K+1))``; both are ``<= max(K * k, D)`` for ``k >= 2``.

Invariant: after a round the target's and the drafter's KV at ``[S, S + a)`` of each row equal
what a chain forward of the accepted tokens would have written (up to float summation order),
so every later round reads the same prefix a chain worker would.

The tree's shape and growth live in `specstate.reference.workers.tree_draft`, its verification
(greedy, seeded and sampled rows, the per-request controls) in
`specstate.reference.workers.tree_verify`; this module owns the round that composes them
(`TreeRoundWorker`) and re-exports their names.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import OnPublish, WorkerCapabilities
from specstate.reference.model import AttentionBatch, KvCache, ModelOutput
from specstate.reference.workers.layout import chain_attention, decode_result, decode_roots
from specstate.reference.workers.round import ChainRoundWorker
from specstate.reference.workers.sampler import (
    contain_logits,
    token_logprobs,
    top_token_logprobs,
)
from specstate.reference.workers.target import TargetRunner
from specstate.reference.workers.tree_draft import (
    DraftTree,
    TreeShape,
    grow_tree,
    tree_attention,
)
from specstate.reference.workers.tree_verify import (
    TreeVerdict,
    tree_counts,
    verify_tree_with_probs,
)
from specstate.relay.future_map import RelayPayload

__all__ = ["TreeRoundWorker", "VerifiedTree", "compact_kv"]


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
    """``run_tokens`` ``[B, K + 1, ...]`` cut or zero-padded to the stride ``D`` along dim 1
    (runs fit: a <= D)."""
    missing = width - run_tokens.shape[1]
    if missing <= 0:
        return run_tokens[:, :width]
    pad = run_tokens.new_zeros(run_tokens.shape[0], missing, *run_tokens.shape[2:])
    return torch.cat([run_tokens, pad], 1)


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

    Raises:
        InvalidConfig: ``topk`` larger than the target's vocabulary.
    """

    def __init__(
        self, target: TargetRunner, capabilities: WorkerCapabilities, *, seed: int | None = None
    ) -> None:
        vocab = target.config.vocab_size
        if capabilities.topk > vocab:
            raise InvalidConfig(
                f"{capabilities.algorithm} worker: topk {capabilities.topk} exceeds the "
                f"vocabulary of {vocab} tokens (a tree node has at most {vocab} children)"
            )
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
        out = self._target.forward(tree_attention(batch.req_pool_indices, table, start, tree))
        num_rows, width = tree.tokens.shape
        logits = out.logits.view(num_rows, width, -1)
        invalid = _mask_non_finite(logits)
        if counts is not None:  # node n sees the prefix and its path root .. n
            logits, unusable = contain_logits(tree_counts(counts, tree).apply(logits, sampling))
            invalid = invalid | unusable
        verdict, probs = verify_tree_with_probs(
            tree, logits, shape.path_width, sampling, self._sampler, start=start
        )
        # The history below the new frontier: the path's tokens (every round, so a prefix
        # the prefix cache shares later carries them).
        self._record_path(batch.req_pool_indices, start, verdict.path_tokens(tree))
        logprobs = top = None
        if sampling.logprobs:  # run token j is scored by its parent, the path node at depth j
            index = verdict.path[:, :, None].expand(-1, -1, logits.shape[-1])
            path_logits = logits.gather(1, index)
            path_probs = None if probs is None else probs.gather(1, index)
            run_logprobs = token_logprobs(path_logits, path_probs, sampling, verdict.run_tokens)
            logprobs = _fit_width(run_logprobs, width)
            if sampling.top_logprobs:
                ids, values = top_token_logprobs(
                    path_logits, path_probs, sampling, sampling.top_logprobs
                )
                top = _fit_width(ids, width), _fit_width(values, width)
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
            top_logprobs=top,
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
