"""Test-only: tiny checkpoints for every algorithm, and workers built from them.

Random weights make drafts that are almost never accepted, which leaves multi-token runs
untested. So besides random drafters, this builds drafters that agree with the target:

* ``draft_model`` with the target itself as the drafter (every draft accepted);
* an EAGLE head equal to a one-layer target (fc passes the embedding; the layer and the norm are
  the target's), so its drafts are the target's own greedy tokens;
* for the hidden-state drafter families (``FAMILIES``), built on first use next to the target:
  two MTP layers derived from the target (`mtp_oracle.derived_mtp_layers`), an EAGLE-3 head
  reading the target's one layer three times, derived and trained briefly on the standard
  prompts (`eagle3_oracle`), and a Frozen-KV assistant derived from the target
  (`frozen_oracle`); each agrees with the target partly.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import attrs
import torch
from hf_oracle import make_checkpoint, one_thread
from transformers import LlamaForCausalLM

from specstate.engine.worker import WorkerProtocol
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.eagle3_head import save_eagle3_head
from specstate.reference.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
from specstate.reference.frozen_kv_head import save_frozen_kv_assistant
from specstate.reference.model import PagedLlama
from specstate.reference.mtp import save_mtp_layers
from specstate.reference.workers import default_registry

ALGORITHMS = ("none", "draft_model", "eagle", "ngram")
FAMILIES = ("mtp", "eagle3", "frozen_kv_mtp")
"""The hidden-state drafter families (`SpecCheckpoints.worker` builds their drafters lazily)."""

MIXED_PROMPTS = (
    (3, 14, 15, 92, 65, 35, 89),
    (79, 32),
    (38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93),
    (7,),
    (5, 5, 5, 5, 5, 5),
)
"""Concurrent prompts of mixed lengths (1 to 15 tokens) for the engine's lossless tests."""


def identity_head(target: PagedLlama) -> EagleHead:
    """An EAGLE head that computes exactly what a one-layer ``target`` computes."""
    head = EagleHead(EagleHeadConfig.for_target(target.config), target)
    hidden = target.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1))
        head.layers[0].load_state_dict(target.layers[0].state_dict())
        head.norm.load_state_dict(target.norm.state_dict())
    return head


@attrs.frozen
class SpecCheckpoints:
    """A one-layer target (the oracle's model), a random drafter, and an identity EAGLE head."""

    target: Path
    draft: Path
    eagle: Path
    hf: LlamaForCausalLM
    vocab_size: int

    def worker(
        self, algorithm: str, *, num_steps: int = 3, agreeing: bool = True
    ) -> WorkerProtocol:
        """A reference worker; ``agreeing`` drafters accept (draft_model drafts with the target)."""
        options = self.options(algorithm, num_steps=num_steps, agreeing=agreeing)
        return default_registry().create(algorithm, **options)

    def options(
        self, algorithm: str, *, num_steps: int = 3, agreeing: bool = True
    ) -> dict[str, object]:
        """The registry options of `worker` (picklable: paths and ints, for another process)."""
        options: dict[str, object] = {"target": self.target}
        if algorithm != "none":
            options["num_steps"] = num_steps
        if algorithm == "draft_model":
            options["draft"] = self.target if agreeing else self.draft
        if algorithm == "eagle":
            options["eagle"] = self.eagle
        if algorithm in FAMILIES:
            options.update(family_options(self.target, algorithm))
        return options


def family_options(target: Path, algorithm: str) -> dict[str, object]:
    """The options of a hidden-state family's worker on ``target``, its drafter built on first
    use next to it (a directory that already exists is reused)."""
    with one_thread():
        return _family_options(target, algorithm)


def _family_options(target: Path, algorithm: str) -> dict[str, object]:
    from eagle3_oracle import derived_eagle3_head, distill
    from frozen_oracle import derived_assistant
    from mtp_oracle import derived_mtp_layers

    root = target.parent
    paged = load_paged_llama(target, num_token_slots=2)
    if algorithm == "mtp":
        directory = root / "with_mtp"
        if not directory.exists():
            shutil.copytree(target, directory)
            save_mtp_layers(derived_mtp_layers(paged, 2, noise=0.1, seed=31), directory)
        return {"target": directory}
    if algorithm == "eagle3":
        directory = root / "eagle3"
        if not directory.exists():
            hf = LlamaForCausalLM.from_pretrained(target)
            head = derived_eagle3_head(
                paged, (0, 0, 0), draft_vocab_size=paged.config.vocab_size - 9, seed=41
            )
            vocab = paged.config.vocab_size
            prompts = [[t % vocab for t in p] for p in MIXED_PROMPTS]
            save_eagle3_head(distill(head, hf, prompts), directory)
        return {"eagle3": directory}
    directory = root / "assistant"
    if not directory.exists():
        save_frozen_kv_assistant(derived_assistant(paged, state_weight=0.3), directory)
    return {"assistant": directory}


def make_spec_checkpoints(
    root: Path, *, seed: int = 0, vocab_size: int = 97, hidden: int = 32
) -> SpecCheckpoints:
    """Build and save the checkpoints under ``root``."""
    hf = make_checkpoint(root / "target", seed=seed, vocab_size=vocab_size, hidden=hidden, layers=1)
    make_checkpoint(root / "draft", seed=seed + 1, vocab_size=vocab_size, hidden=16, layers=1)
    head = identity_head(load_paged_llama(root / "target", num_token_slots=2))
    save_eagle_head(head, root / "eagle")
    return SpecCheckpoints(
        target=root / "target",
        draft=root / "draft",
        eagle=root / "eagle",
        hf=hf,
        vocab_size=vocab_size,
    )


def perturb(module: torch.nn.Module, scale: float, seed: int) -> None:
    """Add Gaussian noise of ``scale`` times each parameter's spread, in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())


def make_partial_drafters(
    ckpt: SpecCheckpoints, root: Path, *, scale: float = 0.1
) -> SpecCheckpoints:
    """The same target with drafters that agree for a few tokens, then diverge.

    The draft model is the target with its weights perturbed, the EAGLE head the identity head
    perturbed: their drafts match the target's greedy tokens often but not always, so accept
    lengths strictly between 1 and D occur.
    """
    draft = copy.deepcopy(ckpt.hf)
    perturb(draft, scale, seed=11)
    draft.save_pretrained(root / "partial_draft", safe_serialization=True)
    head = identity_head(load_paged_llama(ckpt.target, num_token_slots=2))
    perturb(head, scale, seed=12)
    save_eagle_head(head, root / "partial_eagle")
    return attrs.evolve(ckpt, draft=root / "partial_draft", eagle=root / "partial_eagle")
