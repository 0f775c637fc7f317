"""Test-only: tiny subword tokenizers (the ``tokenizers`` library) and a tiny Llama checkpoint
that uses one, with a drafter that agrees with it for a few tokens."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from hf_oracle import make_checkpoint
from spec_checkpoints import perturb
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    '{"name": "fox", "count": 12, "tags": ["quick", "brown"]}',
    "café naïve déjà vu, 東京 and Ölfeld",
    "for i in range(10):\n\tprint(i * i)\n",
]
TEXTS = [
    "def mul(a, b):\n    return a * b",
    "The lazy dog jumps over the quick fox.",
    "emoji 🦊 and 🐶, tabs\tand   spaces",
    "Ölfeld — ünïcödé, 東京",
    '{"a": [1, 2, {"b": null}]}',
]
SPECIALS = ["<unk>", "<s>", "</s>"]


def token_id(tok: Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    assert found is not None, token
    return found


def byte_level_tokenizer(path: Path) -> Tokenizer:
    """A GPT-2-style byte-level BPE (ByteLevel pre-tokenizer and decoder), saved at ``path``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=360,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return tok


def sentencepiece_tokenizer(path: Path) -> Tokenizer:
    """A Llama-2-style BPE: Metaspace, byte fallback to ``<0xNN>`` tokens of the model's own
    vocabulary, and the decoder chain Replace, ByteFallback, Fuse, Strip; saved at ``path``."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=[*SPECIALS, *byte_tokens], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    # The byte tokens belong to the model's vocabulary, as in Llama 2: not special tokens.
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIALS]
    path.write_text(json.dumps(spec), encoding="utf-8")
    return Tokenizer.from_file(str(path))


def subword_checkpoint(directory: Path) -> tuple[Tokenizer, int, Path]:
    """A tiny random Llama whose vocabulary is a byte-level BPE's, EOS ``</s>``, and a drafter
    (the target perturbed: it agrees for a few tokens, then diverges) in ``directory/draft``."""
    tok = byte_level_tokenizer(directory / "tokenizer.json")
    hf = make_checkpoint(directory, vocab_size=tok.get_vocab_size(), hidden=32)
    draft = copy.deepcopy(hf)
    perturb(draft, 0.1, seed=11)
    draft.save_pretrained(directory / "draft")
    eos = token_id(tok, "</s>")
    for path in (directory / "config.json", directory / "draft" / "config.json"):
        config = json.loads(path.read_text())
        config.update(eos_token_id=eos, bos_token_id=token_id(tok, "<s>"))
        path.write_text(json.dumps(config))
    return tok, eos, directory / "draft"
