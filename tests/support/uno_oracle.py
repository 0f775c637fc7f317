"""Test-only: UNO's LoRA pathway computed plainly on transformers' model, and a derived adapter.

`pathway_logits` is the independent computation of UNO's draft pass: transformers'
``LlamaForCausalLM`` (unpaged, no KV cache) over the whole sequence ``context + [x0] + noise``,
with every adapted projection's output increased by ``scale * B (A x)`` on the noise rows only
(forward hooks on transformers' own modules). `distill_adapter` derives an adapter from a
target so that it partly agrees with it: LoRA pairs on every projection, trained for a few
hundred steps to predict the target's greedy continuation from the noise rows, then saved in
PEFT's format (``adapter_config.json``, ``adapter_model.safetensors``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from dflash_oracle import greedy_corpus
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaForCausalLM

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

Pairs = Mapping[str, tuple[torch.Tensor, torch.Tensor]]
"""``model.layers.N.<block>.<proj>`` (transformers' module name) -> ``(A [r, in], B [out, r])``."""


def projection_names(hf: LlamaForCausalLM) -> list[str]:
    """transformers' names of every projection of ``hf``'s decoder layers."""
    return [
        name
        for name, module in hf.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] in PROJECTIONS
    ]


@contextmanager
def _adapted(
    hf: LlamaForCausalLM, pairs: Pairs, scale: float, rows: torch.Tensor
) -> Iterator[None]:
    """Inside, ``hf``'s projections add ``scale * B (A x)`` where ``rows`` (``[T]`` bool)."""
    modules = dict(hf.named_modules())
    handles = []

    def hook(a: torch.Tensor, b: torch.Tensor) -> object:
        def add(
            module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor:
            del module
            return output + ((inputs[0] @ a.T) @ b.T) * scale * rows[:, None].to(output.dtype)

        return add

    try:
        for name, (a, b) in pairs.items():
            handles.append(modules[name].register_forward_hook(hook(a, b)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def pathway_logits(
    hf: LlamaForCausalLM, pairs: Pairs, scale: float, sequence: Sequence[int], first_noise: int
) -> torch.Tensor:
    """``[len(sequence), V]`` logits of the LoRA pathway: plain rows before ``first_noise``,
    adapted rows from it on (causal attention over the whole sequence)."""
    ids = torch.tensor([list(sequence)])
    rows = torch.arange(len(sequence)) >= first_noise
    with torch.no_grad(), _adapted(hf, pairs, scale, rows):
        logits: torch.Tensor = hf(ids).logits[0]
    return logits


def save_adapter(pairs: Pairs, *, rank: int, alpha: float, directory: Path) -> None:
    """Write ``pairs`` as a PEFT LoRA adapter (the names PEFT gives a ``LlamaForCausalLM``)."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in pairs.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().contiguous()
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def adapter_scale(directory: Path) -> float:
    """``lora_alpha / r`` of a PEFT adapter directory (read with ``json``, not specstate)."""
    config = json.loads((directory / "adapter_config.json").read_text())
    return float(config["lora_alpha"]) / int(config["r"])


def load_pairs(directory: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The pairs of a PEFT adapter directory, by transformers' module name."""
    from safetensors.torch import load_file

    tensors = load_file(str(directory / "adapter_model.safetensors"))
    pairs = {}
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            name = key[len("base_model.model.") : -len(".lora_A.weight")]
            pairs[name] = (tensors[key], tensors[key.replace("lora_A", "lora_B")])
    return pairs


def distill_adapter(
    hf: LlamaForCausalLM,
    directory: Path,
    *,
    width: int,
    noise_token: int,
    rank: int = 8,
    alpha: float = 16.0,
    steps: int = 300,
    seed: int = 9,
) -> None:
    """Train LoRA pairs for ``hf``'s draft pass of ``width`` rows and save them (PEFT)."""
    torch.manual_seed(seed)
    corpus = greedy_corpus(hf, num=64, prompt_len=6, new_tokens=34, seed=seed)
    modules = dict(hf.named_modules())
    pairs = {}
    for name in projection_names(hf):
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        a = (torch.randn(rank, linear.in_features) / linear.in_features**0.5).requires_grad_()
        pairs[name] = (a, torch.zeros(linear.out_features, rank, requires_grad=True))
    optimizer = torch.optim.Adam([t for pair in pairs.values() for t in pair], lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    hf.requires_grad_(False)
    for _ in range(steps):
        anchor = int(torch.randint(2, corpus.shape[1] - width, (1,), generator=gen))
        noise = torch.full((corpus.shape[0], width - 1), noise_token)
        ids = torch.cat([corpus[:, : anchor + 1], noise], 1)
        rows = torch.arange(ids.shape[1]) > anchor
        with _adapted(hf, pairs, alpha / rank, rows):
            logits = hf(ids).logits[:, anchor + 1 :]
        labels = corpus[:, anchor + 2 : anchor + width + 1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    save_adapter(pairs, rank=rank, alpha=alpha, directory=directory)
