"""The text codec of a byte-level checkpoint (ids 0-255 are UTF-8 bytes), or why there is none.

`specstate serve` and `specstate generate` both read text through it. A checkpoint that is not
byte-level may still have a tokenizer: both then use `specstate.serving.text.load_codec`'s codec
(`specstate.serving.text.Codec` names either kind).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

import attrs

from specstate.core.errors import InvalidRequest
from specstate.serving.vocabulary import read_vocabulary

__all__ = ["MAX_SPECIAL_IDS", "NUM_BYTES", "ByteCodec", "byte_codec"]

NUM_BYTES: Final = 256
MAX_SPECIAL_IDS: Final = 16
"""A byte-level vocabulary: the 256 byte values, then at most this many special ids."""


@attrs.frozen(kw_only=True)
class ByteCodec:
    """Text <-> ids of a byte-level model: ids 0-255 are UTF-8 bytes; others are special."""

    bos_token_id: int | None

    def encode(self, text: str) -> tuple[int, ...]:
        """BOS (if the model has one), then the UTF-8 bytes of ``text``."""
        head = () if self.bos_token_id is None else (self.bos_token_id,)
        return (*head, *text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Byte ids as UTF-8 (an invalid sequence becomes U+FFFD); special ids are dropped."""
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


def byte_codec(model: Path | None) -> ByteCodec:
    """The text codec of a byte-level checkpoint; `InvalidRequest` saying why not otherwise.

    A checkpoint is byte-level when its ``config.json`` has a ``vocab_size`` of 256 to 256 +
    `MAX_SPECIAL_IDS` and every BOS / EOS id it names is >= 256: ids 0-255 are then the byte
    values (the embedded model: 260 ids, BOS 256, EOS 257). Any architecture's config is read:
    a tokenizer's vocabulary (GPT-2's 50257 ids, say) is refused with the reason.
    """
    if model is None:
        raise InvalidRequest(
            '"text" needs --model DIR, a byte-level checkpoint or one with a tokenizer, to '
            "encode it"
        )
    config = read_vocabulary(model)  # any architecture: a --worker may run a non-Llama model
    specials = [*config.eos_token_ids]
    if config.bos_token_id is not None:
        specials.append(config.bos_token_id)
    in_range = NUM_BYTES <= config.vocab_size <= NUM_BYTES + MAX_SPECIAL_IDS
    if not in_range or any(t < NUM_BYTES for t in specials):
        raise InvalidRequest(
            f'"text" needs a byte-level model (ids 0-255 are UTF-8 bytes: vocab_size 256 to '
            f"{NUM_BYTES + MAX_SPECIAL_IDS}, special ids >= 256), but --model {model} has "
            f"vocab_size {config.vocab_size} and special ids {sorted(specials)}; "
            'send "input_ids" instead'
        )
    return ByteCodec(bos_token_id=config.bos_token_id)
