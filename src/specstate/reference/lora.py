"""LoRA adapters in PEFT's format, applied to chosen token rows of a `PagedLlama` forward.

`LoraAdapter` owns one adapter's ``lora_A`` / ``lora_B`` pairs, read from a PEFT directory
without PEFT itself (two files, plain safetensors and JSON)::

    adapter_config.json         {"peft_type": "LORA", "r", "lora_alpha", "target_modules",
                                 "use_rslora", "bias": "none", ...}
    adapter_model.safetensors   base_model.model.model.layers.N.<self_attn|mlp>.<proj>.
                                lora_A.weight [r, in], .lora_B.weight [out, r]

For every adapted projection ``W`` of the model and every token row ``t`` the adapter is routed
to, the projection's output becomes (``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with
``use_rslora``)::

    y_t = W x_t + s * B (A x_t)

and rows not routed to it compute ``W x_t`` exactly. `LoraAdapter.applied` routes a forward:
hooks exist on the model's projections only inside it, so a forward outside it (a verify) cannot
see the adapter. Refused (an `InvalidConfig` naming the file and the field): DoRA, a trained
bias, ``fan_in_fan_out``, ``modules_to_save``, per-module rank or alpha patterns, and a tensor
for a module the model lacks or of the wrong shape.

Invariant: the adapter never writes the model's parameters; outside `applied` the model is
exactly the base model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import attrs
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.model import PagedLlama

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "LoraAdapter",
    "LoraConfig",
    "read_lora_config",
]

ADAPTER_CONFIG_FILE: Final = "adapter_config.json"
ADAPTER_WEIGHTS_FILE: Final = "adapter_model.safetensors"
_PREFIXES: Final = ("base_model.model.model.", "base_model.model.")
_REFUSED: Final = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
}

StrPath = str | os.PathLike[str]


@attrs.frozen(kw_only=True)
class LoraConfig:
    """What `adapter_config.json` says that the computation needs.

    Attributes:
        rank: r, the inner width of every pair.
        alpha: ``lora_alpha``.
        use_rslora: scale by ``alpha / sqrt(r)`` instead of ``alpha / r``.
    """

    rank: int
    alpha: float
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        """The factor of ``B (A x)``."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _check_refused(raw: Mapping[str, object], path: Path) -> None:
    for key, allowed in _REFUSED.items():
        if raw.get(key, allowed) not in (allowed, None):
            raise InvalidConfig(
                f"{path}: field '{key}' is {raw[key]!r}; only {allowed} is supported"
            )
    if raw.get("bias", "none") != "none":
        raise InvalidConfig(f"{path}: field 'bias' is {raw['bias']!r}; only 'none' is supported")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if raw.get(key):
            raise InvalidConfig(
                f"{path}: field '{key}' is {raw[key]!r}; the reference LoRA has none"
            )


def read_lora_config(directory: StrPath) -> LoraConfig:
    """Reads ``directory/adapter_config.json``.

    Raises:
        InvalidConfig: a missing or unreadable file, a non-LoRA ``peft_type``, a missing or
            mistyped ``r`` / ``lora_alpha``, or a refused feature (module docstring).
    """
    path = Path(directory) / ADAPTER_CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidConfig(
            f"{path}: missing {ADAPTER_CONFIG_FILE} (not a PEFT adapter?)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidConfig(f"{path}: unreadable {ADAPTER_CONFIG_FILE}: {error}") from None
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}: {ADAPTER_CONFIG_FILE} must hold a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise InvalidConfig(f"{path}: field 'peft_type' is {raw['peft_type']!r}; expected 'LORA'")
    _check_refused(raw, path)
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidConfig(f"{path}: field 'r' must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise InvalidConfig(f"{path}: field 'lora_alpha' must be a number, got {alpha!r}")
    return LoraConfig(rank=rank, alpha=float(alpha), use_rslora=bool(raw.get("use_rslora")))


def _module_name(key: str) -> tuple[str, str] | None:
    """``(module, "A" | "B")`` of a PEFT tensor name, or None for another tensor."""
    for suffix, which in ((".lora_A.weight", "A"), (".lora_B.weight", "B")):
        if key.endswith(suffix):
            name = key[: -len(suffix)]
            for prefix in _PREFIXES:
                if name.startswith(prefix):
                    return name[len(prefix) :], which
            return name, which
    return None


def _read_pairs(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    if not path.is_file():
        raise InvalidConfig(f"{path}: missing {ADAPTER_WEIGHTS_FILE} of the LoRA adapter")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                named = _module_name(key)
                if named is None:
                    raise InvalidConfig(f"{path}: unexpected tensor '{key}' (not a LoRA pair)")
                pairs.setdefault(named[0], {})[named[1]] = handle.get_tensor(key)
    except SafetensorError as error:
        raise InvalidConfig(f"{path}: unreadable safetensors weights ({error})") from None
    return pairs


class LoraAdapter:
    """One LoRA adapter bound to a model's projections (see the module docstring).

    Use `load`; the constructor takes checked pairs.

    Args:
        config: rank, alpha, scaling.
        pairs: module name (``layers.N.self_attn.q_proj``) -> ``(A [r, in], B [out, r])``.
        modules: module name -> the model's `nn.Linear` of that name.
    """

    def __init__(
        self,
        config: LoraConfig,
        pairs: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        modules: Mapping[str, nn.Linear],
    ) -> None:
        self.config = config
        self._pairs = dict(pairs)
        self._modules = dict(modules)

    @classmethod
    def load(cls, directory: StrPath, model: PagedLlama) -> LoraAdapter:
        """The adapter in ``directory``, bound to ``model`` (its dtype and device).

        Raises:
            InvalidConfig: a bad config (`read_lora_config`), a missing or unreadable weights
                file, a module the model lacks or that is not a projection, a half pair, or a
                tensor of the wrong shape; the message names the file and the tensor.
        """
        root = Path(directory)
        config = read_lora_config(root)
        path = root / ADAPTER_WEIGHTS_FILE
        linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, pair in sorted(_read_pairs(path).items()):
            module = linears.get(name)
            if module is None:
                raise InvalidConfig(f"{path}: LoRA pair for '{name}', a module the model lacks")
            if set(pair) != {"A", "B"}:
                raise InvalidConfig(f"{path}: '{name}' has lora_{''.join(pair)} only")
            a, b = pair["A"], pair["B"]
            want = ((config.rank, module.in_features), (module.out_features, config.rank))
            if (tuple(a.shape), tuple(b.shape)) != want:
                raise InvalidConfig(
                    f"{path}: '{name}' has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                    f"expected {want[0]} and {want[1]} (r {config.rank})"
                )
            weight = module.weight
            pairs[name] = (a.to(weight), b.to(weight))
        if not pairs:
            raise InvalidConfig(f"{path}: the adapter holds no LoRA pair")
        return cls(config, pairs, {name: linears[name] for name in pairs})

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every LoRA matrix by name (``<module>.lora_A``, ``<module>.lora_B``), and the
        scale as a tensor (``scale``): what identifies the adapter."""
        out = [("scale", torch.tensor(float(self.config.scale), dtype=torch.float64))]
        for name, (a, b) in sorted(self._pairs.items()):
            out += [(f"{name}.lora_A", a), (f"{name}.lora_B", b)]
        return out

    @property
    def module_names(self) -> tuple[str, ...]:
        """The adapted projections, sorted."""
        return tuple(sorted(self._pairs))

    @contextmanager
    def applied(self, rows: torch.Tensor) -> Iterator[None]:
        """Inside, the model's forwards add the adapter to the token rows where ``rows`` (a
        ``[T]`` bool mask of the next forward's tokens) is True; single use, hooks removed on
        exit (also on an exception)."""
        scale = self.config.scale
        handles = []
        try:
            for name, (a, b) in self._pairs.items():

                def add(
                    module: nn.Module,
                    inputs: tuple[torch.Tensor, ...],
                    output: torch.Tensor,
                    a: torch.Tensor = a,
                    b: torch.Tensor = b,
                ) -> torch.Tensor:
                    del module
                    delta = (inputs[0] @ a.T) @ b.T * scale
                    return output + delta * rows.to(output.dtype)[:, None]

                handles.append(self._modules[name].register_forward_hook(add))
            yield
        finally:
            for handle in handles:
                handle.remove()
