"""Test-only: tiny random transformers LFM2 checkpoints (short convolutions + attention)."""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from hf_oracle import make_checkpoint
from hybrid_oracle import make_partial_hybrid_drafter
from transformers import Lfm2Config, Lfm2ForCausalLM

from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

DEFAULT_LAYERS = ("conv", "full_attention", "conv", "conv")
"""A short convolution, attention, two short convolutions: three recurrent layers."""


def make_lfm2_checkpoint(
    directory: Path,
    *,
    seed: int = 0,
    vocab_size: int = 97,
    hidden: int = 32,
    layer_types: tuple[str, ...] = DEFAULT_LAYERS,
    conv_kernel: int = 3,
    tie_word_embeddings: bool = True,
) -> Lfm2ForCausalLM:
    """Save a random tiny float32 LFM2 to ``directory`` (safetensors) and return it.

    The feed-forward width goes through transformers' ``block_auto_adjust_ff_dim`` sizing
    (``2/3`` of ``intermediate_size``, rounded up to ``block_multiple_of``), so a loader that
    ignored it would refuse the weights.
    """
    torch.manual_seed(seed)
    config = Lfm2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=conv_kernel,
        block_multiple_of=16,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
    )
    model = Lfm2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("conv.out_proj.weight"):
                param.mul_(3.0)  # the convolutions steer the output, not just nudge it
    model.train(False)
    model.save_pretrained(directory)
    return model


@attrs.frozen
class Lfm2Checkpoints:
    """An LFM2 target (the oracle's model) and its drafters.

    Attributes:
        target: the LFM2 target directory; ``hf`` is the same model in transformers.
        partial: an LFM2 drafter (the target perturbed): partial acceptance.
        llama: an attention-only Llama drafter of the same vocabulary.
    """

    target: Path
    hf: Lfm2ForCausalLM
    partial: Path
    llama: Path
    vocab_size: int

    def worker(self, algorithm: str, *, num_steps: int = 3) -> WorkerProtocol:
        """A reference worker for ``algorithm``: ``none``, ``ngram``, ``draft_model`` (the LFM2
        drafter) or ``draft_model:llama``."""
        registry = default_registry()
        if algorithm == "none":
            return registry.create("none", target=self.target)
        if algorithm == "ngram":
            return registry.create(
                "ngram", target=self.target, num_steps=num_steps, draft_without_match=False
            )
        draft = self.llama if algorithm == "draft_model:llama" else self.partial
        return registry.create("draft_model", target=self.target, draft=draft, num_steps=num_steps)


def make_lfm2_checkpoints(root: Path, *, seed: int = 0, vocab_size: int = 97) -> Lfm2Checkpoints:
    """Build and save an LFM2 target, a partly agreeing LFM2 drafter and a Llama drafter."""
    hf = make_lfm2_checkpoint(root / "target", seed=seed, vocab_size=vocab_size)
    partial = make_partial_hybrid_drafter(hf, root / "partial", scale=0.05)
    make_checkpoint(root / "llama", seed=seed + 1, vocab_size=vocab_size, hidden=16, layers=1)
    return Lfm2Checkpoints(
        target=root / "target", hf=hf, partial=partial, llama=root / "llama", vocab_size=vocab_size
    )
