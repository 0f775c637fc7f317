"""The few fields of any Hugging Face ``config.json`` that ``generate`` needs without a model.

The vocabulary size, the context length and the BOS / EOS ids, read from Llama, Qwen2, GPT-2 and
other configurations alike (no architecture check: the reference worker checks its own), so a
``--worker`` running a model of another architecture still gets `checkpoint_limits` and text
prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from specstate.core.errors import InvalidConfig

__all__ = ["Vocabulary", "read_vocabulary"]


@attrs.frozen(kw_only=True)
class Vocabulary:
    """What a checkpoint's ``config.json`` says about its tokens and context.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_context_len: ``max_position_embeddings`` (GPT-2: ``n_positions``), 2048 if absent.
        bos_token_id: the BOS id, or None.
        eos_token_ids: the EOS ids (``eos_token_id`` may be one id or a list).
    """

    vocab_size: int
    max_context_len: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def read_vocabulary(model: Path) -> Vocabulary:
    """The `Vocabulary` of the checkpoint directory ``model``.

    Raises:
        InvalidConfig: no readable ``config.json``, or a field of the wrong type; one line
            naming the file and the field.
    """
    path = model / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot read the model config ({exc})") from None
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}: the model config is not a JSON object")
    context = raw.get("max_position_embeddings", raw.get("n_positions", 2048))
    bos = _ids(raw, "bos_token_id", path)
    if len(bos) > 1:
        raise InvalidConfig(f"{path}: field 'bos_token_id' must be null or one id, got {bos}")
    return Vocabulary(
        vocab_size=_count(raw.get("vocab_size"), "vocab_size", path),
        max_context_len=_count(context, "max_position_embeddings", path),
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=_ids(raw, "eos_token_id", path),
    )


def _count(value: Any, name: str, path: Path) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidConfig(f"{path}: field '{name}' must be an integer >= 1, got {value!r}")
    return value


def _ids(raw: dict[str, Any], name: str, path: Path) -> tuple[int, ...]:
    value = raw.get(name)
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidConfig(f"{path}: field '{name}' must be null, an id or a list of ids")
    return tuple(ids)
