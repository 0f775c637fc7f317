"""The bytes of every token of a Hugging Face ``tokenizer.json``: a subword model's vocabulary.

A grammar masks token ids by the bytes each one stands for (`GrammarVocabulary`). A byte-level
checkpoint needs no file; a subword checkpoint ships its tokens in ``tokenizer.json``, and
`token_bytes_from_tokenizer_json` reads them from it (plain JSON: no tokenizer library is
needed). Two families cover the common checkpoints:

* **byte-level BPE** (GPT-2, Llama 3, Qwen, Mistral Nemo): the ``ByteLevel`` decoder; each
  character of a token's string stands for one byte, through GPT-2's table of printable
  stand-ins (``Ġ`` is a space, ``Ċ`` a newline);
* **SentencePiece-style** (Llama 2, Mistral 7B, Gemma): a ``Metaspace`` decoder, or a
  ``Replace("▁", " ")`` step; ``▁`` is a space, and with ``ByteFallback`` each ``<0xNN>`` token
  is the single byte ``NN``.

The decoder's ``Strip`` of the one space that starts a whole text is not applied: a token's
bytes are the same wherever it stands (as the grammar libraries take them), so a grammar sees
the leading space of the first word the model emits.

Special tokens: the added tokens marked ``special``, the ids the caller names (the model's EOS
and BOS ids: a grammar ends on EOS, which must be special), and ids past the tokenizer's last
token up to the model's ``vocab_size`` (a padded vocabulary). Any other decoder, a token whose
string the byte-level table cannot spell, or a tokenizer with more ids than the model, raise
`InvalidConfig` naming the file and what is wrong; build the vocabulary with
`GrammarVocabulary.from_tokens` instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, Final

from specstate.core.errors import InvalidConfig

__all__ = ["token_bytes_from_tokenizer_json"]

_METASPACE: Final = "\u2581"  # ▁
_BYTE_TOKEN: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes_from_tokenizer_json(
    path: str | Path, *, vocab_size: int, special_ids: Iterable[int] = ()
) -> list[bytes | None]:
    """The bytes of each of ``vocab_size`` ids of the tokenizer at ``path`` (module docstring),
    None for a special id; ``special_ids`` (EOS, BOS) are special whatever the file says.
    `GrammarVocabulary.from_tokenizer_json` builds the vocabulary from them.

    Raises:
        InvalidConfig: the file cannot be read, its decoder is not one of the two families,
            a token cannot be spelled as bytes, or it has more ids than ``vocab_size``.
    """
    path = Path(path)
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfig(f"{path}: cannot read the tokenizer ({exc})") from None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("model"), Mapping):
        raise InvalidConfig(f"{path}: not a tokenizer.json (no 'model' object)")
    tokens = _model_tokens(path, spec["model"])
    added = {int(t["id"]): t for t in spec.get("added_tokens") or () if isinstance(t, Mapping)}
    size = max([*tokens, *added], default=-1) + 1
    if size > vocab_size:
        raise InvalidConfig(
            f"{path}: the tokenizer has {size} ids, more than the model's vocab_size {vocab_size}"
        )
    spell = _speller(path, spec.get("decoder"), spec["model"])
    out: list[bytes | None] = [None] * vocab_size
    for i, text in tokens.items():
        out[i] = spell(i, text)
    for i, token in added.items():  # written as they are, not through the decoder's table
        content = str(token.get("content", ""))
        out[i] = None if token.get("special", False) or not content else content.encode()
    for i in special_ids:
        if 0 <= i < vocab_size:
            out[i] = None
    return [t or None for t in out]


def _model_tokens(path: Path, model: Mapping[str, Any]) -> dict[int, str]:
    """Id -> token string of the model's own vocabulary (BPE, WordLevel, WordPiece, Unigram)."""
    vocab = model.get("vocab")
    if isinstance(vocab, Mapping):  # BPE, WordLevel, WordPiece: token -> id
        return {int(i): str(t) for t, i in vocab.items()}
    if isinstance(vocab, list):  # Unigram: [token, score] per id
        return {i: str(entry[0]) for i, entry in enumerate(vocab)}
    raise InvalidConfig(f"{path}: model {model.get('type')!r} has no vocabulary")


def _speller(path: Path, decoder: object, model: Mapping[str, Any]) -> Any:
    """How a token string becomes bytes, from the decoder (and the model's byte fallback)."""
    steps = _decoder_steps(decoder)
    kinds = {str(s.get("type")) for s in steps}
    if "ByteLevel" in kinds:
        table = _byte_level_table()

        def byte_level(i: int, text: str) -> bytes:
            try:
                return bytes(table[c] for c in text)
            except KeyError:
                raise InvalidConfig(
                    f"{path}: token {i} ({text!r}) has a character outside the byte-level table"
                ) from None

        return byte_level
    metaspace = "Metaspace" in kinds or any(
        s.get("type") == "Replace" and (s.get("pattern") or {}).get("String") == _METASPACE
        for s in steps
    )
    if metaspace:
        fallback = "ByteFallback" in kinds or bool(model.get("byte_fallback"))

        def sentencepiece(i: int, text: str) -> bytes:
            if fallback:
                byte = _BYTE_TOKEN.fullmatch(text)
                if byte is not None:
                    return bytes([int(byte.group(1), 16)])
            return text.replace(_METASPACE, " ").encode()

        return sentencepiece
    raise InvalidConfig(
        f"{path}: decoder {sorted(kinds) or None} is neither byte-level nor SentencePiece-style; "
        "build the vocabulary with GrammarVocabulary.from_tokens"
    )


def _decoder_steps(decoder: object) -> list[Mapping[str, Any]]:
    if not isinstance(decoder, Mapping):
        return []
    if decoder.get("type") == "Sequence":
        return [s for d in decoder.get("decoders") or () for s in _decoder_steps(d)]
    return [decoder]


@cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level stand-ins: printable bytes stand for themselves, the other 68 bytes
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + k): b for k, b in enumerate(others)})
    return table
