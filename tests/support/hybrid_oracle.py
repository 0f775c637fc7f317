"""Test-only: tiny random transformers NemotronH checkpoints (Mamba2 + attention) as oracles."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

DEFAULT_PATTERN = "M*-M"
"""Mamba2, attention, MLP, Mamba2: two recurrent layers around one attention layer."""

_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}


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
