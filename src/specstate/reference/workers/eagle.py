"""Algorithm ``eagle``: an EAGLE head drafts from the target's last hidden state.

The head (`specstate.reference.eagle_head`) predicts the token after position ``p`` from
``t_p`` and the target feature ``f_(p-1)``: the target's last decoder layer output (before the
final norm) at ``p - 1``, used as is. The round, the feature store and the relay are
`specstate.reference.workers.feature_head`'s: chains, and trees with ``topk > 1``.
"""

from __future__ import annotations

import os

import torch

from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.reference.checkpoint import CONFIG_FILE
from specstate.reference.eagle_head import EagleHead, load_eagle_head, read_eagle_config
from specstate.reference.model import ModelConfig
from specstate.reference.workers.feature_head import FeatureHeadWorker
from specstate.reference.workers.sources import ModelSource, source_label
from specstate.reference.workers.target import TargetRunner

__all__ = ["EagleWorker"]


class EagleWorker(FeatureHeadWorker[EagleHead]):
    """Chain (or, with ``topk > 1``, tree) drafting with an EAGLE head (module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        eagle: the head directory (`specstate.reference.eagle_head` format).
        num_steps: K, draft steps per round (a chain verifies D = K + 1 tokens).
        topk: branches per tree node; 1 (the default) drafts a chain.
        num_draft_tokens: D, tree nodes verified per round, root included (default: ``K + 1``
            for a chain, ``K * topk + 1`` for a tree).
        device: where the target and head live (default: the engine memory's device).
        dtype: the target's parameter and KV dtype; the head computes in it too.
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1``, ``topk < 1``, ``topk`` above the vocabulary, or a tree
            size `TreeShape` refuses; a head whose hidden or vocab size differs from the
            target's (naming both files); a bad checkpoint or head config (the loader's error).
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        eagle: str | os.PathLike[str],
        num_steps: int = 3,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        if num_steps < 1:
            raise InvalidConfig(f"eagle worker needs num_steps >= 1, got {num_steps}")
        runner = TargetRunner(target, device=device, dtype=dtype)
        if not isinstance(runner.config, ModelConfig):
            raise InvalidConfig(
                f"eagle worker needs a Llama target; {source_label(target)} is a hybrid model"
            )
        head_config = read_eagle_config(eagle)
        for name in ("hidden_size", "vocab_size"):
            ours, theirs = getattr(head_config, name), getattr(runner.config, name)
            if ours != theirs:
                raise InvalidConfig(
                    f"EAGLE head {os.fspath(eagle)}/{CONFIG_FILE} has {name} {ours} but target "
                    f"{source_label(target)} has {name} {theirs}"
                )
        super().__init__(
            "eagle",
            runner,
            feature_width=runner.config.hidden_size,
            num_steps=num_steps,
            topk=topk,
            num_draft_tokens=num_draft_tokens,
            seed=seed,
        )
        self._eagle_dir = eagle

    def _load_head(self, memory: WorkerMemory) -> EagleHead:
        return load_eagle_head(
            self._eagle_dir, self._target.model, num_token_slots=memory.num_token_slots
        )
