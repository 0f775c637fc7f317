"""KV memory planning: what a KV token slot costs in bytes, and how many slots a budget buys.

The engine's pool holds ``kv_tokens`` token slots (`EngineConfig.kv_tokens`, rounded down to
whole pages), and a worker's ``attach`` allocates every KV cache it keeps with that many slots
(`WorkerMemory.num_token_slots`). So the bytes of the KV caches are::

    bytes_per_token = Σ over caches  2 (K and V) × layers × KV heads × head dim × dtype bytes
    kv_bytes        = floor(kv_tokens / P) × P × bytes_per_token

summed over the target's cache and every drafter cache the worker keeps in the same slots (a
draft model's, an EAGLE head's one layer). Counted: those K and V buffers, nothing else; not
counted: weights, activations, the slot table ``req_to_token`` and other per-request tables, and
what the allocator of the device keeps back. `kv_tokens_for_budget` is the inverse: the most
whole pages whose caches fit a byte budget.

The speculative reservation lives inside ``kv_tokens``: each request reserves ``R`` slots past
its committed KV (`SpecWindow.reserve`, 2 × the slots one round may write), so a request whose
prompt and output total ``n`` tokens holds at most ``ceil_P(n + R)`` slots; `requests_that_fit`
counts how many such requests fit the pool at once (page 0 is padding and holds none).

This module imports torch only to read a dtype's size, so a command line can parse
``--kv-memory 2GiB`` with `parse_bytes` without loading it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import attrs

from specstate.core.errors import InvalidConfig

if TYPE_CHECKING:
    import torch

    from specstate.engine.worker import WorkerCapabilities
    from specstate.memory.recurrent_layout import RecurrentStateSpec

__all__ = [
    "KvLayout",
    "format_bytes",
    "kv_bytes_for_tokens",
    "kv_layouts",
    "kv_tokens_for_budget",
    "parse_bytes",
    "recurrent_state_bytes",
    "requests_that_fit",
]

EAGLE_MODEL_TYPE: Final = "specstate_eagle"
"""An EAGLE head directory (`specstate.reference.eagle_head`): one decoder layer."""


@attrs.frozen(kw_only=True)
class KvLayout:
    """The KV cache of one model, per token slot: K and V of every layer and KV head.

    Attributes:
        num_layers: decoder layers that keep KV.
        num_kv_heads: key/value heads per layer (fewer than the query heads under GQA).
        head_dim: channels per head.
        dtype_bytes: bytes per element of the cache (4 for float32, 2 for bfloat16/float16).
        name: what the cache belongs to, for messages (``target``, ``draft``, ``eagle``).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    name: str = "model"

    def __attrs_post_init__(self) -> None:
        """Every size is a positive integer."""
        for field in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfig(f"KvLayout {self.name}: {field} must be >= 1, got {value!r}")

    @property
    def bytes_per_token(self) -> int:
        """``2 × num_layers × num_kv_heads × head_dim × dtype_bytes``: K and V of one slot."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(
        cls,
        config: str | Path | Mapping[str, Any],
        *,
        dtype: torch.dtype | None = None,
        name: str = "model",
    ) -> KvLayout:
        """The layout of a Hugging Face ``config.json`` (a checkpoint directory, or the dict).

        Reads ``num_hidden_layers`` (or GPT-2's ``n_layer``; 1 for an EAGLE head; for a hybrid
        such as NemotronH, the attention layers of its ``layers_block_type`` or
        ``hybrid_override_pattern``, for LFM2 the ``full_attention`` entries of its
        ``layer_types``: recurrent layers hold state rows, not KV),
        ``num_key_value_heads`` (default: the attention heads, ``num_attention_heads`` or
        ``n_head``), ``head_dim`` (default: ``hidden_size`` or ``n_embd`` over the heads) and
        the dtype: ``dtype`` if given, else the config's ``torch_dtype`` / ``dtype``, else
        float32 (what the reference model loads then).

        Raises:
            InvalidConfig: no readable ``config.json``, or a size missing or not a positive
                integer.
        """
        raw = _read_config(config)
        where = f"{config}" if not isinstance(config, Mapping) else "config"
        heads = _size(raw, ("num_attention_heads", "n_head"), where)
        attention = _attention_layers(raw)
        if raw.get("model_type") == EAGLE_MODEL_TYPE:
            layers = 1
        elif attention is not None:
            layers = max(attention, 1)  # the reference hybrid keeps one cache at least
        else:
            layers = _size(raw, ("num_hidden_layers", "n_layer"), where)
        kv_heads = raw.get("num_key_value_heads") or heads
        head_dim = raw.get("head_dim") or _size(raw, ("hidden_size", "n_embd"), where) // heads
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=_dtype_bytes(dtype, raw, where),
            name=name,
        )


def kv_layouts(
    target: str | Path,
    *,
    draft: str | Path | None = None,
    eagle: str | Path | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[KvLayout, ...]:
    """The KV caches a reference worker keeps: the target's, and its drafter's if it has one.

    ``draft`` is a draft model checkpoint (``draft_model``), ``eagle`` an EAGLE head directory;
    ``dtype`` is the worker's ``dtype`` option (None: each checkpoint's own). A draft model runs
    in ``dtype`` or its own checkpoint's dtype; an EAGLE head always runs in the target's.
    ``ngram`` and ``none`` keep the target's cache only.
    """
    layouts = [KvLayout.from_config(target, dtype=dtype, name="target")]
    if draft is not None:
        layouts.append(KvLayout.from_config(draft, dtype=dtype, name="draft"))
    if eagle is not None:
        head = KvLayout.from_config(eagle, name="eagle")
        layouts.append(attrs.evolve(head, dtype_bytes=layouts[0].dtype_bytes))
    return tuple(layouts)


def kv_bytes_for_tokens(kv_tokens: int, layouts: Sequence[KvLayout], *, page_size: int = 1) -> int:
    """Bytes the caches of ``layouts`` allocate for an engine with ``kv_tokens`` slots.

    ``floor(kv_tokens / page_size) × page_size × Σ bytes_per_token``: the pool keeps whole pages,
    and every cache holds one entry per slot, the padding page included.
    """
    _check_page_size(page_size)
    slots = (kv_tokens // page_size) * page_size
    return slots * _bytes_per_token(layouts)


def kv_tokens_for_budget(
    budget_bytes: int | float, layouts: Sequence[KvLayout], *, page_size: int = 1
) -> int:
    """The most ``kv_tokens`` (whole pages) whose caches fit in ``budget_bytes``.

    Pass it to `EngineConfig(kv_tokens=...)`; `kv_bytes_for_tokens` of the result is at most the
    budget, and one more page would pass it.

    Raises:
        InvalidConfig: the budget holds fewer than the two pages an engine needs.
    """
    _check_page_size(page_size)
    per_token = _bytes_per_token(layouts)
    if not math.isfinite(budget_bytes) or budget_bytes < 0:
        raise InvalidConfig(
            f"a KV budget must be a finite number of bytes >= 0, got {budget_bytes}"
        )
    kv_tokens = int(budget_bytes // (per_token * page_size)) * page_size
    if kv_tokens < 2 * page_size:
        raise InvalidConfig(
            f"a KV budget of {format_bytes(budget_bytes)} holds {kv_tokens} token slots at "
            f"{per_token} bytes a slot; the engine needs at least 2 pages ({2 * page_size})"
        )
    return kv_tokens


def recurrent_state_bytes(
    spec: RecurrentStateSpec | None, *, max_running: int, num_draft_tokens: int
) -> int:
    """Bytes of a hybrid worker's state rows in an engine that runs ``max_running`` requests.

    ``(2 × max_running + 1) × C × bytes_per_row``: the engine keeps twice ``max_running``
    request slots (room for requests whose release waits for a launched batch) and the padding
    slot 0, each with ``C = D + 1`` state rows (`rows_per_request`, ``D`` the verify width,
    1 without speculation), and a row holds one state of every layer group the worker declares
    (its target's and a hybrid drafter's: `RecurrentStateSpec.bytes_per_row`). 0 without a
    spec. It does not depend on ``kv_tokens``: subtract it from a budget before
    `kv_tokens_for_budget`.

    Raises:
        InvalidConfig: ``max_running`` or ``num_draft_tokens`` below 1.
    """
    if max_running < 1 or num_draft_tokens < 1:
        raise InvalidConfig(
            f"state rows need max_running >= 1 and num_draft_tokens >= 1, got {max_running}, "
            f"{num_draft_tokens}"
        )
    if spec is None:
        return 0
    return (2 * max_running + 1) * (num_draft_tokens + 1) * spec.bytes_per_row


def requests_that_fit(
    kv_tokens: int, request_tokens: int, capabilities: WorkerCapabilities, *, page_size: int = 1
) -> int:
    """How many requests of ``request_tokens`` (prompt + new tokens) fit the pool at once.

    Each holds at most ``ceil_P(request_tokens + R)`` slots, ``R`` the speculative reservation
    of ``capabilities`` at ``page_size`` (`SpecWindow.reserve`); the pool has
    ``floor(kv_tokens / P) - 1`` usable pages (page 0 is padding). 0 when `Engine.submit`
    refuses such a request outright, which it does when one page more than that does not fit.
    A memory bound only: `EngineConfig.max_running` caps the running requests too.
    """
    _check_page_size(page_size)
    reserve = capabilities.spec_window(page_size).reserve
    pages_per_request = -(-(request_tokens + reserve) // page_size)
    usable_pages = kv_tokens // page_size - 1
    if pages_per_request + 1 > usable_pages:
        return 0
    return usable_pages // pages_per_request


_UNITS: Final = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE: Final = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """A byte count written for people: ``2GiB``, ``512MiB``, ``1.5GB``, ``1073741824``.

    Units: ``B``, decimal ``kB MB GB TB`` (powers of 1000) and binary ``KiB MiB GiB TiB``
    (powers of 1024), any case.

    Raises:
        ValueError: not a number with one of those units.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a byte size (e.g. 2GiB, 512MiB, 1.5GB, 1073741824; units B, kB, "
            "MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: int | float) -> str:
    """``num_bytes`` in binary units, three significant digits (``1.50 GiB``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def _bytes_per_token(layouts: Sequence[KvLayout]) -> int:
    if not layouts:
        raise InvalidConfig("no KV layouts: give at least the target's")
    return sum(layout.bytes_per_token for layout in layouts)


def _check_page_size(page_size: int) -> None:
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise InvalidConfig(f"page_size must be an integer >= 1, got {page_size!r}")


def _read_config(config: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    path = Path(config)
    path = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot read the model config ({exc})") from None
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}: the model config is not a JSON object")
    return raw


def _size(raw: Mapping[str, Any], names: tuple[str, ...], where: str) -> int:
    for name in names:
        value = raw.get(name)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidConfig(f"{where}: {name} must be an integer >= 1, got {value!r}")
            return value
    raise InvalidConfig(f"{where}: no {' or '.join(names)} in the model config")


def _dtype_bytes(dtype: torch.dtype | None, raw: Mapping[str, Any], where: str) -> int:
    import torch

    if dtype is not None:
        return dtype.itemsize
    name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    found = getattr(torch, str(name), None)
    if not isinstance(found, torch.dtype):
        raise InvalidConfig(f"{where}: dtype {name!r} is not a torch dtype")
    return found.itemsize


def _attention_layers(raw: Mapping[str, Any]) -> int | None:
    """The attention layers of a hybrid config (NemotronH's layer list or pattern, LFM2's
    ``layer_types`` or ``full_attn_idxs``), else None."""
    if raw.get("model_type") == "lfm2":  # other models' layer_types are all attention
        types, indices = raw.get("layer_types"), raw.get("full_attn_idxs")
        if isinstance(types, list):
            return sum(1 for kind in types if kind == "full_attention")
        if isinstance(indices, list):
            return len(indices)
    kinds = raw.get("layers_block_type")
    if isinstance(kinds, list):
        return sum(kind in ("attention", "full_attention") for kind in kinds)
    pattern = raw.get("hybrid_override_pattern")
    if isinstance(pattern, str):
        return pattern.count("*")
    return None
