"""Test-only: tiny random transformers NemotronH checkpoints (Mamba2 + attention) as oracles."""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import torch
from hf_oracle import make_checkpoint
from transformers import NemotronHConfig, NemotronHForCausalLM, PreTrainedModel

from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

DEFAULT_PATTERN = "M*-M"
"""Mamba2, attention, MLP, Mamba2: two recurrent layers around one attention layer."""

_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}


HYBRID_PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89],
    [79, 32],
    [38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93],
    [7],
    [5, 5, 5, 5, 5, 5],
]
"""Prompts the hybrid lossless tests share: lengths 1 to 15, one that repeats a token."""


def make_hybrid_checkpoint(
    directory: Path,
    *,
    seed: int = 0,
    vocab_size: int = 97,
    hidden: int = 32,
    pattern: str = DEFAULT_PATTERN,
    conv_kernel: int = 4,
    tie_word_embeddings: bool = False,
) -> NemotronHForCausalLM:
    """Save a random tiny NemotronH to ``directory`` (safetensors) and return it.

    ``dt_bias`` is drawn in [-1, 1], so ``softplus(dt + dt_bias)`` stays far above
    ``time_step_min``: transformers clamps there in its prompt scan but not in its one-token
    step, and a clamp that binds would make its own two paths disagree.
    """
    torch.manual_seed(seed)
    config = NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        layers_block_type=[_KINDS[c] for c in pattern],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        intermediate_size=2 * hidden,
        ssm_state_size=8,
        mamba_num_heads=4,
        mamba_head_dim=hidden // 4,
        n_groups=2,
        conv_kernel=conv_kernel,
        chunk_size=8,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
    )
    model = NemotronHForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mixer.dt_bias"):
                param.copy_(torch.rand(param.shape) * 2 - 1)
            if name.endswith("mixer.out_proj.weight"):
                param.mul_(4.0)  # the recurrent layers steer the output, not just nudge it
    model.train(False)
    model.save_pretrained(directory)
    return model


def make_partial_hybrid_drafter(
    target: PreTrainedModel, directory: Path, *, scale: float = 0.1, seed: int = 11
) -> Path:
    """The target with Gaussian noise of ``scale`` times each parameter's spread, saved.

    A hybrid drafter that agrees with the target for a few tokens, then diverges: accept
    lengths strictly between 1 and the maximum occur.
    """
    drafter = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * scale * param.std())
    drafter.save_pretrained(directory)
    return directory


@attrs.frozen
class HybridCheckpoints:
    """A hybrid target (the oracle's model) and its drafters.

    Attributes:
        target: the NemotronH target directory; ``hf`` is the same model in transformers.
        partial: a hybrid drafter (the target perturbed): partial acceptance.
        llama: an attention-only Llama drafter of the same vocabulary (random: rare accepts).
    """

    target: Path
    hf: NemotronHForCausalLM
    partial: Path
    llama: Path
    vocab_size: int

    def worker(self, algorithm: str, *, num_steps: int = 3) -> WorkerProtocol:
        """A reference worker for ``algorithm``: ``none``, ``ngram`` (drafts nothing when no
        row matches), ``draft_model`` (the hybrid drafter) or ``draft_model:llama``."""
        registry = default_registry()
        if algorithm == "none":
            return registry.create("none", target=self.target)
        if algorithm == "ngram":
            return registry.create(
                "ngram", target=self.target, num_steps=num_steps, draft_without_match=False
            )
        draft = self.llama if algorithm == "draft_model:llama" else self.partial
        return registry.create("draft_model", target=self.target, draft=draft, num_steps=num_steps)


def make_hybrid_checkpoints(
    root: Path, *, seed: int = 0, vocab_size: int = 97
) -> HybridCheckpoints:
    """Build and save a hybrid target, a partly agreeing hybrid drafter and a Llama drafter."""
    hf = make_hybrid_checkpoint(root / "target", seed=seed, vocab_size=vocab_size)
    partial = make_partial_hybrid_drafter(hf, root / "partial", scale=0.05)
    make_checkpoint(root / "llama", seed=seed + 1, vocab_size=vocab_size, hidden=16, layers=1)
    return HybridCheckpoints(
        target=root / "target", hf=hf, partial=partial, llama=root / "llama", vocab_size=vocab_size
    )
