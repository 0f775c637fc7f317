"""Algorithm ``frozen_kv_mtp``: an assistant that owns no KV drafts from the target's committed KV.

The assistant (`specstate.reference.frozen_kv_head`, Gemma 4's assistant on a Llama target)
drafts every step of a round at the constant position ``S`` with a recurrent state, attending
to the KV one target layer holds at positions ``[0, S)`` of the row: the committed frontier.
Nothing it computes lands in a KV slot, so the round reserves only the target's window
(``keeps_draft_kv`` is False) and its post-verify work is the seed selection alone::

    EXTEND chunk [P0, P1)   target extend -> H[P0..P1-1]; publish
                            relay: bonus = target token at P1, state = norm(H[P1-1])
    DECODE at S             read K, V of layer kv_layer at [0, S) once; K steps at position S:
                            (x0, s0) -> d1, s1;  (d1, s1) -> d2, s2; ..   s0 = the relayed state
                            target verify [x0, d1..dK] @ S..S+K -> accept a; publish S + a
                            relay: bonus = y_m, state = norm(H[S + a - 1])  (selection only)

The relay's state is the target's last hidden state after its final norm at ``frontier - 1``:
every extend and every verify computes it for its own rows, so no store is needed (a prefix the
prefix cache shares is re-entered by an extend, which recomputes it).

Invariant: a forward reads the target's KV only at positions below each row's frontier before
its verify writes ``[S, S + D)``, and writes no KV of its own; the relayed state is
``norm(H[frontier - 1])``, a function of the tokens up to it (`PrefixSharing.TOKEN`).
"""

from __future__ import annotations

import os

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerCapabilities, WorkerMemory
from specstate.reference.checkpoint import CONFIG_FILE
from specstate.reference.frozen_kv_config import read_frozen_kv_config
from specstate.reference.frozen_kv_head import FrozenKvAssistant, load_frozen_kv_assistant
from specstate.reference.model import ModelConfig
from specstate.reference.workers.round import ChainRoundWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource, source_label
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["FrozenKvMtpWorker"]


class FrozenKvMtpWorker(ChainRoundWorker):
    """Chain drafting with a Frozen-KV MTP assistant (module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        assistant: the assistant's directory (`specstate.reference.frozen_kv_head` format).
        num_steps: K, draft steps per round (a chain verifies D = K + 1 tokens).
        device: where the target and the assistant live (default: the engine memory's device).
        dtype: the target's parameter and KV dtype; the assistant computes in it too.
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1``; a hybrid target; an assistant that does not fit the
            target (its KV geometry, width or vocabulary; naming both files); a bad assistant
            config (the loader's error); at attach, a tensor-parallel group of two or more.
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        assistant: str | os.PathLike[str],
        num_steps: int = 3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        if num_steps < 1:
            raise InvalidConfig(f"frozen_kv_mtp worker needs num_steps >= 1, got {num_steps}")
        runner = TargetRunner(target, device=device, dtype=dtype)
        if not isinstance(runner.config, ModelConfig):
            raise InvalidConfig(
                f"frozen_kv_mtp worker needs a Llama target; {source_label(target)} is a hybrid "
                "model"
            )
        config = read_frozen_kv_config(assistant)
        try:
            config.source_layer(runner.config)
        except InvalidConfig as error:
            raise InvalidConfig(
                f"{os.fspath(assistant)}/{CONFIG_FILE} and target {source_label(target)}: {error}"
            ) from None
        capabilities = WorkerCapabilities.chain(
            "frozen_kv_mtp", num_steps=num_steps, keeps_draft_kv=False
        )
        super().__init__(runner, capabilities, seed=seed)
        self._assistant_dir = assistant
        self._assistant: FrozenKvAssistant | None = None

    @property
    def assistant(self) -> FrozenKvAssistant:
        """The assistant (after attach)."""
        if self._assistant is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._assistant

    def _attach_draft(self, memory: WorkerMemory) -> None:
        # The assistant owns no KV (nothing is sized by the engine's slots); its queries span
        # every head of the target's KV, which a tensor-parallel rank holds only a share of.
        if memory.parallel is not None and memory.parallel.world_size > 1:
            raise InvalidConfig(
                "frozen_kv_mtp does not shard: its assistant reads every KV head of the target, "
                f"a rank of {memory.parallel.world_size} holds "
                f"1/{memory.parallel.world_size} of them"
            )
        self._assistant = load_frozen_kv_assistant(self._assistant_dir, self._target.model)

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        # The assistant keeps nothing by slot: it reads the target's KV (which crosses), and
        # its seed state norm(H[C - 1]) crosses in the record's draft state (hidden_states).
        return {}

    def _handoff_drafter(self) -> torch.nn.Module | None:
        return self._assistant

    def _state(self, pre_norm: torch.Tensor) -> torch.Tensor:
        """The seed state: the target's final norm of its hidden states ``[N, H]``."""
        with torch.no_grad():
            out: torch.Tensor = self._target.model.norm(pre_norm)
        return out

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        state = self._state(out.hidden_states[out.last_rows])
        return RelayPayload(bonus_tokens=out.next_tokens, hidden_states=state)

    def _relayed_state(self, batch: ForwardBatch) -> torch.Tensor:
        """``[B, H]`` the relayed seed state of every row.

        Raises:
            InvalidConfig: ``spec_info`` carries no (or misshapen) hidden states.
        """
        width = self._target.config.hidden_size
        relayed = None if batch.spec_info is None else batch.spec_info.hidden_states
        if relayed is None or tuple(relayed.shape) != (batch.batch_size, width):
            shape = None if relayed is None else tuple(relayed.shape)
            raise InvalidConfig(
                f"frozen_kv_mtp worker: requests {list(batch.request_ids[:4])} need "
                f"spec_info.hidden_states [{batch.batch_size}, {width}] (the relayed state), "
                f"got {shape}"
            )
        return relayed

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        steps = batch.draft_steps(self.capabilities.num_steps)
        if steps == 0:
            return DraftChain(tokens=roots[:, None][:, :0])
        assistant = self.assistant
        committed = assistant.read_committed(
            batch.req_pool_indices, self._target.req_to_token, start
        )
        tokens, state, choices = roots, self._relayed_state(batch), []
        for _ in range(steps):
            out = assistant.step(tokens, state, start, committed)
            choice = self._sampler.choose(out.logits, batch.sampling_info)
            tokens, state = choice.tokens, out.state
            choices.append(choice)
        return DraftChain.from_steps(choices)

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        hidden = verified.target_hidden
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        state = self._state(hidden[rows, verified.verdict.last_accepted])
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens, hidden_states=state)
