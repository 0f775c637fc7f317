"""Test-only: reference workers with one planted KV-access bug each (the frontier watch's
and the conformance kit's negative controls)."""

from __future__ import annotations

import torch
from spec_checkpoints import SpecCheckpoints, family_options

from specstate.batch.forward_batch import ForwardBatch
from specstate.reference.workers.frozen_kv_mtp import FrozenKvMtpWorker
from specstate.reference.workers.verify import DraftChain


class ReadsOnePastTheFrontier(FrozenKvMtpWorker):
    """A planted bug: the assistant attends to the target's KV at its frontier ``S`` too."""

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        table = self._target.req_to_token
        committed = self.assistant.read_committed(batch.req_pool_indices, table, start + 1)
        tokens, state, choices = roots, self._relayed_state(batch), []
        for _ in range(self.capabilities.num_steps):
            out = self.assistant.step(tokens, state, start, committed)
            choice = self._sampler.choose(out.logits, batch.sampling_info)
            tokens, state = choice.tokens, out.state
            choices.append(choice)
        return DraftChain.from_steps(choices)


class WritesUndeclaredKv(FrozenKvMtpWorker):
    """A planted bug: a drafter that declares no KV writes some past the target's window."""

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        width = self.capabilities.num_draft_tokens
        table = self._target.req_to_token
        slots = table[batch.req_pool_indices.long(), start + width]
        config = self._target.model.config
        zeros = torch.zeros(slots.shape[0], config.num_key_value_heads, config.head_dim)
        self._target.model.kv_cache.write(0, slots, zeros, zeros)
        return super()._propose(batch, start, roots)


def planted(ckpt: SpecCheckpoints, kind: type[FrozenKvMtpWorker]) -> FrozenKvMtpWorker:
    """A worker of ``kind`` with the shared checkpoints' assistant."""
    options = family_options(ckpt.target, "frozen_kv_mtp")
    return kind(target=ckpt.target, assistant=options["assistant"], num_steps=3)  # type: ignore[arg-type]
