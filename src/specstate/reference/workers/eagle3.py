"""Algorithm ``eagle3``: an EAGLE-3 head drafts from several target layers' hidden states.

The target's features here are its *auxiliary* hidden states: the outputs of three decoder
layers side by side, ``a_p`` ``[3 * H]`` (`specstate.reference.eagle3_head`). They are what the
feature store keeps at every committed position's KV slot and what the relay carries: the
auxiliary states of exactly the last accepted position. The head projects them through its
``fc`` (``3H -> H``) where a target feature enters (the first draft step, the post-verify
extend, the prefill), drafts in its reduced vocabulary and maps each draft id to a target
token (``d2t``). The round, chains and trees (``topk > 1``: the tree path serves it unchanged,
since the head returns target-vocabulary logits) are `specstate.reference.workers.feature_head`'s.

Invariant (besides the feature head's): every feature stored or relayed is the target's
``[a_l0; a_l1; a_l2]`` of its position, never a projection of it, so a change of head shape
cannot mix two meanings in one buffer.
"""

from __future__ import annotations

import os

import torch

from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.reference.checkpoint import CONFIG_FILE
from specstate.reference.eagle3_config import read_eagle3_config
from specstate.reference.eagle3_head import Eagle3Head, load_eagle3_head
from specstate.reference.model import ModelConfig
from specstate.reference.workers.feature_head import FeatureHeadWorker
from specstate.reference.workers.sources import ModelSource, read_source_config, source_label
from specstate.reference.workers.target import TargetRunner

__all__ = ["Eagle3Worker"]


class Eagle3Worker(FeatureHeadWorker[Eagle3Head]):
    """Chain (or, with ``topk > 1``, tree) drafting with an EAGLE-3 head (module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        eagle3: the head directory (SGLang / SpecForge format,
            `specstate.reference.eagle3_config`).
        num_steps: K, draft steps per round (a chain verifies D = K + 1 tokens).
        topk: branches per tree node; 1 (the default) drafts a chain.
        num_draft_tokens: D, tree nodes verified per round, root included.
        device: where the target and head live (default: the engine memory's device).
        dtype: the target's parameter and KV dtype; the head computes in it too.
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1`` or a tree shape `TreeShape` refuses; a hybrid target; a
            head whose vocabulary or widths differ from the target's, or whose auxiliary layers
            the target lacks (naming both files); a bad head config (the loader's error).
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        eagle3: str | os.PathLike[str],
        num_steps: int = 3,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        config = read_source_config(target, dtype=dtype)
        if not isinstance(config, ModelConfig):
            raise InvalidConfig(
                f"eagle3 worker needs a Llama target; {source_label(target)} is a hybrid model"
            )
        head_config = read_eagle3_config(eagle3)
        where = f"EAGLE-3 head {os.fspath(eagle3)}/{CONFIG_FILE}"
        pairs = (
            ("vocab_size", head_config.vocab_size, config.vocab_size),
            ("target_hidden_size", head_config.target_hidden_size, config.hidden_size),
            ("hidden_size", head_config.hidden_size, config.hidden_size),
        )
        for name, ours, theirs in pairs:
            if ours != theirs:
                raise InvalidConfig(
                    f"{where} has {name} {ours} but target {source_label(target)} has {theirs}"
                )
        try:
            layers = head_config.feature_layers(config.num_hidden_layers)
        except InvalidConfig as error:
            raise InvalidConfig(f"{where}: {error}") from None
        runner = TargetRunner(target, device=device, dtype=dtype, feature_layers=layers)
        super().__init__(
            "eagle3",
            runner,
            feature_width=3 * config.hidden_size,
            num_steps=num_steps,
            topk=topk,
            num_draft_tokens=num_draft_tokens,
            seed=seed,
        )
        self._eagle3_dir = eagle3
        self._aux_layers = layers

    @property
    def aux_layers(self) -> tuple[int, int, int]:
        """The target layers whose outputs are the features."""
        return self._aux_layers

    def _load_head(self, memory: WorkerMemory) -> Eagle3Head:
        return load_eagle3_head(
            self._eagle3_dir, self._target.model, num_token_slots=memory.num_token_slots
        )

    def _project(self, features: torch.Tensor) -> torch.Tensor:
        return self.head.project(features)
