"""The embedded default models: the owner of the checkpoints shipped inside the package.

Three byte-level checkpoints trained by ``scripts/train_embedded.py`` on the standard library's
own Python sources, so ``specstate demo`` runs with no download:

    target/   Llama (config.json + model.safetensors)       load_paged_llama / transformers
    draft/    1-layer Llama, same vocabulary                 load_paged_llama / transformers
    eagle/    EAGLE head on the target's pre-norm features   model_type "specstate_eagle"

The vocabulary is the 256 byte values, then `BOS_ID` and `EOS_ID`, padded to `VOCAB_SIZE`;
`grammar_vocabulary` describes it for grammars (`RequestLimits.grammar_vocabulary`).
`encode` never emits BOS or EOS; callers prepend `BOS_ID` themselves (every training document
starts with it). REPORT.md beside this file holds the training numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from importlib.resources import files
from pathlib import Path
from typing import Final

from specstate.core.errors import InvalidConfig
from specstate.grammar.spec import GrammarVocabulary

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "VOCAB_SIZE",
    "decode",
    "draft_dir",
    "eagle_dir",
    "encode",
    "grammar_vocabulary",
    "target_dir",
]

BOS_ID: Final = 256
EOS_ID: Final = 257
VOCAB_SIZE: Final = 260  # 256 bytes, BOS, EOS and two unused ids
_NUM_BYTES: Final = 256


def _checkpoint_dir(name: str) -> Path:
    """The on-disk directory of one shipped checkpoint.

    Raises:
        InvalidConfig: The package is not installed as plain files (e.g. zipped), or the
            checkpoint is missing; the loaders need real ``config.json`` and safetensors files.
    """
    resource = files(__name__) / name
    if not isinstance(resource, Path) or not (resource / "config.json").is_file():
        raise InvalidConfig(
            f"embedded checkpoint '{name}' not found as files at {resource}"
            " (run scripts/train_embedded.py, or install specstate unzipped)"
        )
    return resource


def target_dir() -> Path:
    """The target Llama checkpoint (``load_paged_llama`` and transformers both read it)."""
    return _checkpoint_dir("target")


def draft_dir() -> Path:
    """The 1-layer draft Llama checkpoint; same vocabulary as the target."""
    return _checkpoint_dir("draft")


def eagle_dir() -> Path:
    """The EAGLE head checkpoint; it reuses the target's embedding and lm_head."""
    return _checkpoint_dir("eagle")


def grammar_vocabulary() -> GrammarVocabulary:
    """The bytes of every id (the 256 byte values; BOS, EOS and the padding are special)."""
    return GrammarVocabulary.byte_level(VOCAB_SIZE, num_bytes=_NUM_BYTES)


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids (no BOS/EOS added)."""
    return list(text.encode("utf-8"))


def decode(ids: Iterable[int]) -> str:
    """Token ids back to text: byte ids decode as UTF-8 (invalid: U+FFFD); special ids drop."""
    return bytes(i for i in ids if 0 <= i < _NUM_BYTES).decode("utf-8", errors="replace")
