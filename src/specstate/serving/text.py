"""Text for the server: the codec of a checkpoint, and text handed out as tokens stream in.

Owner of the text side of a served model. `load_codec` finds how a checkpoint turns text into
token ids and back:

* a byte-level checkpoint (ids 0-255 are UTF-8 bytes, as in the embedded model): the bytes,
  after the BOS id when the config names one (`specstate.serving.byte_codec.byte_codec`);
* a ``tokenizer.json`` (the ``tokenizers`` package) or a ``tokenizer_config.json``
  (``transformers.AutoTokenizer``), special tokens added as the tokenizer's own template says;
* otherwise none: the server then takes prompts as token ids only.

A stop string becomes the token-id sequence of its text (`TextCodec.encode_plain`); the engine
matches it on token ids, which is exact for a byte-level model (a string is one byte sequence)
and, for a subword tokenizer, catches the stop only where the model emits it tokenized that way.

`TextStream` hands out the text of a growing token sequence piece by piece, holding back a
trailing partial character (U+FFFD) until the tokens that complete it arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import attrs

from specstate.core.errors import InvalidConfig, InvalidRequest
from specstate.serving.byte_codec import ByteCodec, byte_codec

__all__ = ["Codec", "TextCodec", "TextStream", "load_codec"]

_REPLACEMENT = "\ufffd"


class TextCodec(Protocol):
    """Text <-> token ids of one model."""

    @property
    def kind(self) -> str:
        """What the codec is: ``bytes`` or ``tokenizer``."""
        ...

    def encode(self, text: str) -> list[int]:
        """A prompt's ids: the model's special prefix (BOS) and the text's tokens."""
        ...

    def encode_plain(self, text: str) -> list[int]:
        """The text's tokens alone (no special tokens): a stop string's sequence."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Ids back to text; special ids are dropped."""
        ...


Codec: TypeAlias = "ByteCodec | TextCodec"
"""What turns a request's ``text`` into ids and the output back into text (either kind)."""


@attrs.frozen
class _Bytes:
    """A byte-level model: ids 0-255 are UTF-8 bytes."""

    bos_token_id: int | None

    @property
    def kind(self) -> str:
        return "bytes"

    def encode(self, text: str) -> list[int]:
        head = [] if self.bos_token_id is None else [self.bos_token_id]
        return [*head, *text.encode("utf-8")]

    def encode_plain(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


@attrs.frozen
class _Tokenizer:
    """A Hugging Face tokenizer (``tokenizers.Tokenizer`` or a transformers tokenizer)."""

    inner: Any
    fast: bool  # a tokenizers.Tokenizer (encode returns an Encoding) or a transformers one

    @property
    def kind(self) -> str:
        return "tokenizer"

    def encode(self, text: str) -> list[int]:
        if self.fast:
            return list(self.inner.encode(text).ids)
        return list(self.inner.encode(text))

    def encode_plain(self, text: str) -> list[int]:
        if self.fast:
            return list(self.inner.encode(text, add_special_tokens=False).ids)
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.inner.decode(list(ids), skip_special_tokens=True))


def load_codec(model: Path) -> TextCodec | None:
    """The codec of the checkpoint at ``model`` (module docstring), or None.

    Raises:
        InvalidConfig: the checkpoint has a tokenizer that cannot be loaded.
    """
    try:
        codec = byte_codec(model)
    except InvalidRequest:
        pass  # not byte-level: look for a tokenizer
    else:
        return _Bytes(codec.bos_token_id)
    if (model / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            pass  # transformers may still read it below
        else:
            try:
                return _Tokenizer(Tokenizer.from_file(str(model / "tokenizer.json")), fast=True)
            except Exception as exc:
                raise InvalidConfig(f"{model}/tokenizer.json: cannot load it ({exc})") from None
    if (model / "tokenizer_config.json").is_file() or (model / "tokenizer.json").is_file():
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise InvalidConfig(
                f"{model} has a tokenizer, but neither tokenizers nor transformers is installed"
            ) from exc
        try:
            return _Tokenizer(AutoTokenizer.from_pretrained(model), fast=False)
        except Exception as exc:
            raise InvalidConfig(f"{model}: cannot load its tokenizer ({exc})") from None
    return None


class TextStream:
    """The text of a token sequence that grows, handed out piece by piece.

    Each `push` returns the text its tokens add, except a trailing partial character (shown
    as U+FFFD by the decoder) held back until it completes or `flush` ends the sequence.
    Decoding the whole sequence each time keeps a subword tokenizer's spacing right.
    """

    def __init__(self, codec: TextCodec) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._sent = 0  # characters handed out

    def push(self, ids: Sequence[int]) -> str:
        """The new text once ``ids`` are appended (complete characters only)."""
        self._ids.extend(ids)
        text = self._codec.decode(self._ids)
        stable = len(text.rstrip(_REPLACEMENT))
        piece = text[self._sent : stable] if stable > self._sent else ""
        self._sent += len(piece)
        return piece

    def flush(self) -> str:
        """The rest of the text, partial characters included (the sequence ended)."""
        text = self._codec.decode(self._ids)
        piece = text[self._sent :]
        self._sent = len(text)
        return piece
