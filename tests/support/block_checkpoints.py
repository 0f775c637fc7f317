"""Test-only: a tiny target for the block drafters and the drafters derived from it.

The target is a two-layer Llama (hidden 32, vocabulary 97) with a smaller weight spread than
`hf_oracle.make_checkpoint`'s, so that its greedy continuations have structure (repeated
phrases) a tiny drafter can learn. Its drafters are distilled from it for a few seconds on its
own greedy continuations, so they agree with it partly (acceptance strictly between one token
and the block):

* a DFlash assistant (`dflash_oracle.distill_assistant`): block 4, context from both target
  layers (the last one after the final norm);
* a UNO LoRA adapter in PEFT format (`uno_oracle.distill_adapter`) on every projection.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch
from dflash_oracle import assistant_config, distill_assistant
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel
from uno_oracle import distill_adapter

from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

BLOCK_FAMILIES = ("dflash", "uno")
BLOCK_SIZE = 4
"""The assistant's block: the bonus and three masks (three drafts per round)."""
UNO_STEPS = 4
"""UNO's width: the root and three drafts per round (its adapter is trained for it)."""
NOISE_TOKEN = 96
"""The token of UNO's noise rows (the last one; the adapter is trained with it)."""


def make_block_target(directory: Path, *, seed: int = 3) -> LlamaForCausalLM:
    """Save the block drafters' target (see the module docstring) and return it."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    model.save_pretrained(directory)
    return model


@attrs.frozen
class BlockCheckpoints:
    """The target (and its transformers model, the oracle) with its derived drafters."""

    target: Path
    assistant: Path
    adapter: Path
    hf: LlamaForCausalLM
    vocab_size: int

    def hf_assistant(self) -> MuseGlimmerAssistantModel:
        """The assistant as transformers loads it."""
        model: MuseGlimmerAssistantModel = MuseGlimmerAssistantModel.from_pretrained(self.assistant)
        model.train(False)
        return model

    def worker(self, algorithm: str, **options: object) -> WorkerProtocol:
        """A ``dflash`` or ``uno`` worker on the target (``options``: the worker's others)."""
        base: dict[str, object] = {"target": self.target}
        if algorithm == "dflash":
            base["assistant"] = self.assistant
        if algorithm == "uno":
            base |= {"adapter": self.adapter, "num_steps": UNO_STEPS, "noise_token_id": NOISE_TOKEN}
        return default_registry().create(algorithm, **{**base, **options})


def make_block_checkpoints(root: Path) -> BlockCheckpoints:
    """Build the target and distill its drafters under ``root`` (a few seconds).

    On one intra-op thread: tiny models on shared cores spin-wait with more (a session fixture
    is set up before the per-test thread fixture runs).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        hf = make_block_target(root / "target")
        config = assistant_config(97, 32, block_size=BLOCK_SIZE, layer_ids=(0, 1))
        distill_assistant(hf, config, root / "assistant")
        distill_adapter(hf, root / "adapter", width=UNO_STEPS, noise_token=NOISE_TOKEN)
    finally:
        torch.set_num_threads(threads)
    return BlockCheckpoints(
        target=root / "target",
        assistant=root / "assistant",
        adapter=root / "adapter",
        hf=hf,
        vocab_size=97,
    )
