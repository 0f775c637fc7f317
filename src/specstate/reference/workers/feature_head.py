"""The round of a draft head that reads the target's features: EAGLE and EAGLE-3 share it.

`FeatureHeadWorker` owns a draft head (its own paged KV at the request's token slots) and the
*feature store*: the target feature of every committed position, kept at that position's KV
slot like the KV itself, so a prefix the prefix cache shares brings its features along and a
chunk boundary needs no recompute. The head predicts the token after position ``p`` from
``t_p`` and a feature ``f``: the projected target feature of ``p - 1`` (`_project`: the identity
for EAGLE, the head's ``fc`` over several layers' hidden states for EAGLE-3), or, on later draft
steps, the head's own output. The raw target features cross the round in the relay
(``next_draft_input.hidden_states``, read back as ``batch.spec_info.hidden_states``)::

    EXTEND chunk [P0, P1)   target extend -> H[P0..P1-1], stored at the chunk's slots; publish;
                            head extend over the chunk with features [stored H(P0-1) or 0 at
                            P0 = 0, H[P0], .., H[P1-2]] (projected)
                            relay: bonus = target token at P1, hidden = H[P1-1]
    DECODE at S             head K chain steps from x0@S with H(S-1) (relayed, projected), then
                            its own h -> d1..dK (argmax, or drawn from the head's filtered q_i
                            when the row samples); target verify -> H[S..S+K], accept a = m + 1;
                            publish S + a
                            head draft-extend [x0, d1..dK] @ S..S+K with the TRUE features
                            [H(S-1), H[S], .., H[S+K-1]] (projected); H[S..S+K] stored at their
                            slots
                            relay: bonus = y_m, hidden = H[S+m] (the feature of the new bonus)

With ``topk > 1`` a DECODE round drafts a tree instead (`specstate.reference.workers.tree`):
the head expands the top-k children of the k best nodes per level (a node's feature is the
head's ``h`` of its parent, the root's the projected relayed ``H(S-1)``), the target verifies the
``num_draft_tokens`` best nodes under a tree mask, the accepted path's target KV is moved to
``S .. S+a-1``, and the head re-extends the path ``[x0, p_1 .. p_K]`` at ``S .. S+K`` with the
TRUE features ``[H(S-1), H(p_0) .. H(p_(K-1))]`` (stored at the path's slots); relay: bonus =
y at the path's end ``m``, hidden = ``H(m)``. Sampled rows verify the tree by recursive
rejection sampling.

Invariant: after every forward, the head's KV below each row's frontier was computed from the
row's settled tokens and the target's true features; the feature store holds, at the slot of
every position below the frontier, the target feature of that position; the relayed hidden
state is the target feature at ``frontier - 1``. Each is a function of the tokens up to its
position, so the worker shares prefixes by token (`PrefixSharing.TOKEN`).
"""

from __future__ import annotations

import abc
from typing import Generic, Protocol, TypeVar

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.reference.model import AttentionBatch, KvCache, ModelOutput
from specstate.reference.workers.layout import budget_end, chain_attention
from specstate.reference.workers.round import VerifiedRound
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.tree import TreeRoundWorker, VerifiedTree
from specstate.reference.workers.tree_draft import tree_capabilities
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["FeatureHead", "FeatureHeadWorker"]


class FeatureHead(Protocol):
    """What the round needs of a head: one extend over features, and its KV cache."""

    @property
    def kv_cache(self) -> KvCache:
        """The head's own KV cache (the target's slot indexing)."""
        ...

    def __call__(
        self,
        batch: AttentionBatch,
        features: torch.Tensor,
        *,
        logit_rows: torch.Tensor | None = None,
    ) -> ModelOutput:
        """Extend ``batch`` with ``features`` ``[T, H]``; logits of ``logit_rows`` (all: None)."""
        ...


HeadT = TypeVar("HeadT", bound=FeatureHead)


class FeatureHeadWorker(TreeRoundWorker, Generic[HeadT]):
    """Chain (or tree) drafting with a head over the target's features (module docstring).

    A subclass says which head it loads (`_load_head`) and how a target feature becomes the
    head's input (`_project`).

    Args:
        algorithm: the registry name the capabilities declare.
        target: the target runner (its ``hidden_states`` are the features).
        feature_width: the width of one target feature (the store and the relay rows).
        num_steps: K, draft steps per round.
        topk: branches per tree node; 1 drafts a chain.
        num_draft_tokens: D, tree nodes verified per round (default: `tree_capabilities`).
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1`` or a tree shape `tree_capabilities` refuses.
    """

    def __init__(
        self,
        algorithm: str,
        target: TargetRunner,
        *,
        feature_width: int,
        num_steps: int,
        topk: int,
        num_draft_tokens: int | None,
        seed: int | None,
    ) -> None:
        if num_steps < 1:
            raise InvalidConfig(f"{algorithm} worker needs num_steps >= 1, got {num_steps}")
        capabilities = tree_capabilities(
            algorithm, num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens
        )
        super().__init__(target, capabilities, seed=seed)
        self._feature_width = feature_width
        self._head: HeadT | None = None
        self._features: torch.Tensor | None = None  # [num_token_slots, width], by KV slot

    @abc.abstractmethod
    def _load_head(self, memory: WorkerMemory) -> HeadT:
        """The head, with ``memory.num_token_slots`` KV slots, on the target's device."""

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        """The head's input ``[N, H]`` of raw target features ``[N, width]`` (EAGLE: as is)."""
        return features

    @property
    def head(self) -> HeadT:
        """The draft head (after attach)."""
        if self._head is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._head

    def _draft_kv_caches(self) -> dict[str, KvCache]:
        return {"head": self.head.kv_cache}

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        return {"features": self.features}  # the target feature of every committed position

    def _handoff_drafter(self) -> torch.nn.Module | None:
        head = self.head
        return head if isinstance(head, torch.nn.Module) else None

    def _attach_draft(self, memory: WorkerMemory) -> None:
        self._head = self._load_head(memory)
        self._features = torch.zeros(
            memory.num_token_slots,
            self._feature_width,
            dtype=self._target.config.dtype,
            device=self._target.device_for(memory),
        )

    def _run_head(
        self,
        attention: AttentionBatch,
        features: torch.Tensor,
        *,
        logit_rows: torch.Tensor | None = None,
    ) -> ModelOutput:
        out: ModelOutput = self.head(attention, features, logit_rows=logit_rows)
        return out

    @property
    def features(self) -> torch.Tensor:
        """The feature store: the target feature of each committed position, by KV slot."""
        if self._features is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._features

    def _store_features(self, locs: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep ``hidden[i]`` at KV slot ``locs[i]`` (where this forward wrote KV)."""
        store = self.features  # worker-owned: written in place, only at this forward's slots
        store.index_copy_(0, locs.reshape(-1).long().to(store.device), hidden.to(store.dtype))

    def _boundary_features(self, attention: AttentionBatch) -> torch.Tensor:
        """``[B, hidden]`` stored ``f_(P0-1)`` of each extend row (zeros where ``P0 == 0``)."""
        prefix = attention.prefix_lens.long()
        table = attention.req_to_token
        locs = table[
            attention.req_pool_indices.long().to(table.device),
            (prefix - 1).clamp_min(0).to(table.device),
        ]
        stored = self.features[locs.to(self.features.device)]
        return torch.where((prefix > 0)[:, None].to(stored.device), stored, 0.0)

    def _relayed_features(self, batch: ForwardBatch, needed: torch.Tensor) -> torch.Tensor:
        """``[B, hidden]`` relayed ``f_(S-1)`` where ``needed``, zeros elsewhere.

        Raises:
            InvalidConfig: a row needs its feature but ``spec_info`` carries no hidden states.
        """
        hidden = self._feature_width
        relayed = None if batch.spec_info is None else batch.spec_info.hidden_states
        if relayed is None:
            prefix = batch.prefix_lens  # host ints when known: no device read needed
            fresh = isinstance(prefix, tuple) and not any(prefix)
            if not fresh and bool(needed.any()):
                rows = [rid for rid, n in zip(batch.request_ids, needed.tolist(), strict=True) if n]
                raise InvalidConfig(
                    f"{self.capabilities.algorithm} worker: requests {rows[:4]} continue after "
                    "a KV prefix but spec_info carries no hidden_states (relay the previous "
                    "next_draft_input)"
                )
            return torch.zeros(
                batch.batch_size, hidden, dtype=self._target.config.dtype, device=needed.device
            )
        if tuple(relayed.shape) != (batch.batch_size, hidden):
            raise InvalidConfig(
                f"{self.capabilities.algorithm} worker: spec_info.hidden_states "
                f"{tuple(relayed.shape)} must be [{batch.batch_size}, {hidden}]"
            )
        return torch.where(needed[:, None], relayed, torch.zeros_like(relayed))

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        attention, hidden = out.attention, out.hidden_states
        first_rows = torch.cumsum(attention.extend_lens, 0) - attention.extend_lens
        incoming = self._boundary_features(attention)
        self._store_features(attention.out_cache_loc, hidden)
        # f_(p-1) of every token: the previous token's target feature inside the chunk, the
        # stored one (or zeros at position 0) for the chunk's first token.
        features = torch.cat([hidden.new_zeros(1, hidden.shape[1]), hidden[:-1]])
        features = features.index_copy(0, first_rows, incoming.to(hidden.dtype))
        self._run_head(attention, self._project(features), logit_rows=first_rows[:0])
        return RelayPayload(bonus_tokens=out.next_tokens, hidden_states=hidden[out.last_rows])

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        table = self._target.req_to_token
        steps_wanted = batch.draft_steps(self.capabilities.num_steps)
        if steps_wanted == 0:
            return DraftChain(tokens=roots[:, None][:, :0])
        relayed = self._relayed_features(batch, torch.ones_like(start, dtype=torch.bool))
        features = self._project(relayed)
        tokens, steps, end = roots, [], budget_end(batch, start)
        for step in range(steps_wanted):
            chain = chain_attention(
                batch.req_pool_indices, table, start + step, tokens[:, None], end=end
            )
            out = self._run_head(chain, features)
            choice = self._sampler.choose(out.logits, batch.sampling_info)
            tokens, features = choice.tokens, out.hidden_states
            steps.append(choice)
        return DraftChain.from_steps(steps) if steps else DraftChain(tokens=roots[:, None][:, :0])

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        batch, hidden = verified.batch, verified.target_hidden
        first = self._relayed_features(batch, torch.ones_like(verified.start, dtype=torch.bool))
        true_features = torch.cat([first[:, None].to(hidden.dtype), hidden[:, :-1]], dim=1)
        chain = chain_attention(
            batch.req_pool_indices,
            self._target.req_to_token,
            verified.start,
            verified.chain,
            end=budget_end(batch, verified.start),
        )
        self._run_head(
            chain,
            self._project(true_features.reshape(-1, hidden.shape[2])),
            logit_rows=verified.start[:0],
        )
        self._store_features(chain.out_cache_loc, hidden.reshape(-1, hidden.shape[2]))
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        next_hidden = hidden[rows, verified.verdict.last_accepted]
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens, hidden_states=next_hidden)

    def _tree_forward(
        self, attention: AttentionBatch, features: torch.Tensor | None
    ) -> ModelOutput:
        if features is None:
            raise InvalidConfig(f"{self.capabilities.algorithm} tree drafting needs node features")
        return self._run_head(attention, features)

    def _tree_root_features(self, batch: ForwardBatch, start: torch.Tensor) -> torch.Tensor:
        return self._project(
            self._relayed_features(batch, torch.ones_like(start, dtype=torch.bool))
        )

    def _commit_tree(self, verified: VerifiedTree) -> RelayPayload:
        first = self._relayed_features(
            verified.batch, torch.ones_like(verified.start, dtype=torch.bool)
        )
        features = verified.path_features(first)
        attention = verified.path_attention(self._target.req_to_token)
        self._run_head(
            attention,
            self._project(features.reshape(-1, features.shape[2])),
            logit_rows=verified.start[:0],
        )
        # The path's features at S .. S+a-1 (past the accepted length they are never read):
        # node p_j's is the input of position S+j+1, the last accepted node's is the relayed one.
        locs = attention.out_cache_loc.view(features.shape[0], -1)
        self._store_features(locs[:, :-1], features[:, 1:].reshape(-1, features.shape[2]))
        rows = torch.arange(locs.shape[0], device=locs.device)
        last = locs[rows, (verified.verdict.accept_lens.long() - 1).to(locs.device)]
        self._store_features(last, verified.last_hidden)
        return RelayPayload(
            bonus_tokens=verified.verdict.bonus_tokens, hidden_states=verified.last_hidden
        )
