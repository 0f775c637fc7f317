"""Algorithm ``mtp``: the target's own multi-token-prediction layers draft the chain.

A target that ships ``L`` MTP layers (`specstate.reference.mtp`) drafts step ``j`` with layer
``j - 1`` (multi-layer MTP, SGLang's multi-layer EAGLE), each layer with its own KV at the
request's token slots; past ``L`` steps the last layer is reused autoregressively (single-layer
MTP, DeepSeek NextN style, is ``L = 1``: one layer for every step). Layer ``k`` at position
``p`` reads token ``t_p`` and ``g_(k-1)[p-1]``, the previous layer's output one position back
(``g_(-1)`` is the target's normed last hidden state). The drafts equal transformers'
``generate(use_mtp=True)``'s for ``K = L``: in a round at frontier ``S`` with bonus ``x0``::

    step 1   layer 0     [x0]@S                 hidden [c_0]                      -> d1
    step 2   layer 1     [x0, d1]@S..S+1        hidden [c_1, g_0[S]]              -> d2
    step j   layer j-1   [x0, d1..d(j-1)]@S..   hidden [c_(j-1), g_(j-2)[S..]]    -> dj
    step j>L layer L-1   [d(j-1)]@S+j-1          hidden g_(L-1)[S+j-2]             -> dj
    verify   target      [x0, d1..dK]@S..S+K -> accept a; publish S + a
    extend   layer k     [x0, d1..dK]@S..S+K    hidden [c_k, g_(k-1)[S..S+K-1]]   (KV only)
             feature store <- g_(-1) .. g_(L-2) at S..S+K (below S + a they are true)
    relay    c = [g_(-1), g_0, .., g_(L-2)] at S + a - 1        [B, L * H]

``c_k = g_(k-1)[S-1]`` is the relayed chain of the previous round; each layer's KV below the
frontier is its true KV (the extend rewrites ``S..S+K``, of which ``S..S+a-1`` are settled) and
drafting writes only ``[S, S + K)``. An EXTEND chunk ``[P0, P1)`` runs every layer over the
chunk with the stored chain at ``P0 - 1`` (zeros at ``P0 = 0``, a position no layer attends to)
and relays the chain at ``P1 - 1``.

A NemotronH target (Mamba2 + attention, `specstate.reference.hybrid`) drafts the same way: its
MTP blocks are attention or MLP blocks (no recurrent state of their own), and its Mamba2 layers'
state is the one `ChainRoundWorker`'s verify leaves at the row of every verified position: the
engine carries forward only the row at ``S + a``, the accepted run's, so drafted positions past
it never reach the next round. Its recurrent state is not kept at prefix-cache boundaries, so
the engine shares no prefixes with it.

Invariant: after every forward, MTP layer ``k``'s KV at every position below a row's frontier
is computed from the row's settled tokens and true chain values; the feature store holds, at
the slot of every such position ``p``, ``g_(-1)[p] .. g_(L-2)[p]``; the relayed chain is the one
at ``frontier - 1``. Each is a function of the tokens up to its position, so prefixes are shared
by token (`PrefixSharing.TOKEN`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerCapabilities, WorkerMemory
from specstate.reference.hybrid.config import HybridConfig
from specstate.reference.hybrid.model import PagedHybrid
from specstate.reference.model import AttentionBatch, KvCache, ModelConfig, ModelOutput, PagedLlama
from specstate.reference.mtp import MtpLayers, MtpSpec, load_mtp_layers, read_mtp_spec
from specstate.reference.workers.layout import budget_end, chain_attention
from specstate.reference.workers.round import ChainRoundWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource, source_label
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["MtpWorker"]


class MtpWorker(ChainRoundWorker):
    """Chain drafting with the target's MTP layers (module docstring).

    Args:
        target: the target checkpoint directory (its ``mtp.*`` tensors are the drafter), or an
            in-memory `PagedLlama` together with ``mtp``.
        mtp: the checkpoint directory to read the MTP layers from (default: ``target``).
        num_steps: K, draft steps per round (default: the checkpoint's ``L``; more than ``L``
            reuses the last layer).
        device: where the target and the layers live (default: the engine memory's device).
        dtype: parameter and KV dtype of both (default: the checkpoint's).
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1``; a target that declares no MTP layers (checked here,
            before any engine is built around the worker); an LFM2 target; MTP layers whose
            sizes differ from the target's; at attach, a missing, misshapen, unexpected or
            duplicated MTP layer (`load_mtp_layers`).
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        mtp: str | os.PathLike[str] | None = None,
        num_steps: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        runner = TargetRunner(target, device=device, dtype=dtype)
        if not isinstance(runner.config, ModelConfig | HybridConfig):
            raise InvalidConfig(
                f"mtp worker needs a Llama-architecture or NemotronH target; "
                f"{source_label(target)} is an LFM2 model"
            )
        if mtp is None and not isinstance(target, str | os.PathLike):
            raise InvalidConfig("mtp worker: an in-memory target needs mtp=<checkpoint directory>")
        self._mtp_dir = Path(mtp if mtp is not None else target)  # type: ignore[arg-type]
        self._spec: MtpSpec = read_mtp_spec(self._mtp_dir)
        for name in ("hidden_size", "vocab_size"):
            ours, theirs = getattr(self._spec.config, name), getattr(runner.config, name)
            if ours != theirs:
                raise InvalidConfig(
                    f"MTP layers of {self._mtp_dir} have {name} {ours} but target "
                    f"{source_label(target)} has {name} {theirs}"
                )
        steps = self._spec.num_layers if num_steps is None else num_steps
        if steps < 1:
            raise InvalidConfig(f"mtp worker needs num_steps >= 1, got {steps}")
        capabilities = WorkerCapabilities.chain("mtp", num_steps=steps, keeps_draft_kv=True)
        super().__init__(runner, capabilities, seed=seed)
        self._layers: MtpLayers | None = None
        self._features: torch.Tensor | None = None  # [L, num_token_slots, H], by KV slot

    @property
    def num_mtp_layers(self) -> int:
        """``L``, the MTP layers the checkpoint ships."""
        return self._spec.num_layers

    @property
    def layers(self) -> MtpLayers:
        """The MTP layers (after attach)."""
        if self._layers is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._layers

    @property
    def features(self) -> torch.Tensor:
        """The feature store ``[L, slots, H]``: row ``k`` holds ``g_(k-1)`` of each position."""
        if self._features is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._features

    def _draft_kv_caches(self) -> dict[str, KvCache]:
        return {"mtp": self.layers.kv_cache}

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        # The feature store is [L, slots, H]: by slot on dim 0 through a view, written in place.
        return {"features": self.features.transpose(0, 1)}

    def _handoff_drafter(self) -> torch.nn.Module | None:
        layers = self.layers
        return layers if isinstance(layers, torch.nn.Module) else None

    def _attach_draft(self, memory: WorkerMemory) -> None:
        network = self._target.network
        if not isinstance(network, PagedLlama | PagedHybrid):  # refused at construction
            raise InvalidConfig(f"mtp worker: a {type(network).__name__} target has no MTP layers")
        self._layers = load_mtp_layers(
            self._mtp_dir, network, num_token_slots=memory.num_token_slots
        )
        config = self._target.config
        self._features = torch.zeros(
            self._spec.num_layers,
            memory.num_token_slots,
            config.hidden_size,
            dtype=config.dtype,
            device=self._target.device_for(memory),
        )

    def _store(self, locs: torch.Tensor, chain: list[torch.Tensor]) -> None:
        """Keep ``chain[k][i]`` (``g_(k-1)``) at KV slot ``locs[i]`` (this forward's slots)."""
        store = self.features  # worker-owned: written in place, only at this forward's slots
        slots = locs.reshape(-1).long().to(store.device)
        for k, values in enumerate(chain):
            store[k].index_copy_(0, slots, values.reshape(slots.shape[0], -1).to(store.dtype))

    def _relayed_chain(self, batch: ForwardBatch) -> list[torch.Tensor]:
        """``[c_0 .. c_(L-1)]``, each ``[B, H]``: the relayed chain at ``S - 1``.

        Raises:
            InvalidConfig: ``spec_info`` carries no (or misshapen) hidden states.
        """
        width, count = self._target.config.hidden_size, self._spec.num_layers
        relayed = None if batch.spec_info is None else batch.spec_info.hidden_states
        if relayed is None or tuple(relayed.shape) != (batch.batch_size, count * width):
            shape = None if relayed is None else tuple(relayed.shape)
            raise InvalidConfig(
                f"mtp worker: requests {list(batch.request_ids[:4])} need spec_info.hidden_states "
                f"[{batch.batch_size}, {count} * {width}] (the relayed MTP chain), got {shape}"
            )
        return list(relayed.view(batch.batch_size, count, width).unbind(1))

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        attention, layers = out.attention, self.layers
        first_rows = torch.cumsum(attention.extend_lens, 0) - attention.extend_lens
        boundary = self._boundary_chain(attention)
        current = layers.target_hidden(out.hidden_states)
        chain = [current]
        for k in range(self._spec.num_layers):
            # g_(k-1)[p-1] of every token: the previous token's inside the chunk, the stored one
            # (zeros at position 0) for each row's first token.
            shifted = torch.cat([current.new_zeros(1, current.shape[1]), current[:-1]])
            shifted = shifted.index_copy(0, first_rows, boundary[k].to(current.dtype))
            current = layers(k, attention, shifted, logit_rows=first_rows[:0]).hidden_states
            chain.append(current)
        chain = chain[:-1]  # g_(L-1) feeds no later layer
        self._store(attention.out_cache_loc, chain)
        hidden = torch.cat([c[out.last_rows] for c in chain], dim=1)
        return RelayPayload(bonus_tokens=out.next_tokens, hidden_states=hidden)

    def _boundary_chain(self, attention: AttentionBatch) -> list[torch.Tensor]:
        """``[B, H]`` stored ``g_(k-1)[P0 - 1]`` of each extend row, per layer (zeros at 0)."""
        prefix = attention.prefix_lens.long()
        table = attention.req_to_token
        locs = table[
            attention.req_pool_indices.long().to(table.device),
            (prefix - 1).clamp_min(0).to(table.device),
        ].to(self.features.device)
        keep = (prefix > 0)[:, None].to(self.features.device)
        return [torch.where(keep, store[locs], 0.0) for store in self.features.unbind(0)]

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        steps = batch.draft_steps(self.capabilities.num_steps)
        if steps == 0:
            return DraftChain(tokens=roots[:, None][:, :0])
        relayed, layers, table = self._relayed_chain(batch), self.layers, self._target.req_to_token
        last = self._spec.num_layers - 1
        tokens, previous, choices = roots[:, None], relayed[0][:, None], []
        end = budget_end(batch, start)
        for j in range(1, steps + 1):
            if j - 1 <= last:  # layer j-1 over the span [S, S + j - 1]
                layer, width = j - 1, j
                hidden = torch.cat([relayed[layer][:, None], previous[:, : j - 1]], dim=1)
                attention = chain_attention(batch.req_pool_indices, table, start, tokens, end=end)
            else:  # the last layer again, one position: S + j - 1
                layer, width = last, 1
                hidden = previous[:, -1:]
                attention = chain_attention(
                    batch.req_pool_indices, table, start + j - 1, tokens[:, -1:], end=end
                )
            rows = torch.arange(tokens.shape[0], device=tokens.device) * width + width - 1
            out = layers(layer, attention, hidden.reshape(-1, hidden.shape[2]), logit_rows=rows)
            outputs = out.hidden_states.view(tokens.shape[0], width, -1)
            previous = outputs if j - 1 <= last else torch.cat([previous, outputs], dim=1)
            choice = self._sampler.choose(out.logits, batch.sampling_info)
            tokens = torch.cat([tokens, choice.tokens[:, None]], dim=1)
            choices.append(choice)
        return DraftChain.from_steps(choices)

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        batch, layers = verified.batch, self.layers
        relayed = self._relayed_chain(batch)
        rows, width = verified.chain.shape
        attention = chain_attention(
            batch.req_pool_indices,
            self._target.req_to_token,
            verified.start,
            verified.chain,
            end=budget_end(batch, verified.start),
        )
        current = layers.target_hidden(verified.target_hidden.reshape(rows * width, -1))
        current = current.view(rows, width, -1)
        chain = [current]
        for k in range(self._spec.num_layers - 1):
            # NOTE: the last layer's extend below writes only KV; its outputs feed no layer.
            current = self._extend_layer(k, attention, relayed[k], current)
            chain.append(current)
        self._extend_layer(self._spec.num_layers - 1, attention, relayed[-1], current)
        self._store(attention.out_cache_loc, chain)
        index = (verified.verdict.accept_lens.long() - 1).to(current.device)
        picked = torch.arange(rows, device=current.device)
        hidden = torch.cat([c[picked, index] for c in chain], dim=1)
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens, hidden_states=hidden)

    def _extend_layer(
        self,
        layer: int,
        attention: AttentionBatch,
        first: torch.Tensor,
        previous: torch.Tensor,
    ) -> torch.Tensor:
        """Layer ``layer`` over ``[S, S + K]`` with inputs ``[first, previous[:, :-1]]``;
        returns its outputs ``[B, D, H]``."""
        rows, width, size = previous.shape
        hidden = torch.cat([first[:, None].to(previous.dtype), previous[:, :-1]], dim=1)
        out: ModelOutput = self.layers(
            layer, attention, hidden.reshape(-1, size), logit_rows=attention.prefix_lens[:0]
        )
        return out.hidden_states.view(rows, width, size)
