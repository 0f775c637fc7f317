"""A subword model's grammar vocabulary, read from its ``tokenizer.json``.

The oracle is the ``tokenizers`` library itself: the bytes our vocabulary gives a text's token
ids are the text it encoded (byte-level BPE), or that text after the space SentencePiece puts
in front (``▁``), for texts with characters the tokenizer only spells byte by byte. Then the
vocabulary serves grammars end to end: the engine and `specstate generate` on a tiny
Llama checkpoint with that tokenizer emit text that matches its grammar
(tests/serving/test_subword_server.py serves it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from subword_tokenizers import (
    SPECIALS,
    TEXTS,
    byte_level_tokenizer,
    sentencepiece_tokenizer,
    subword_checkpoint,
    token_id,
)
from tokenizers import Tokenizer, decoders, models

from specstate import (
    Engine,
    EngineConfig,
    Grammar,
    GrammarVocabulary,
    InvalidConfig,
    SamplingParams,
)
from specstate.reference.workers import default_registry
from specstate.tools.cli import main
from specstate.tools.generate.workers import checkpoint_limits


def test_byte_level_tokens_spell_exactly_the_encoded_text(tmp_path: Path) -> None:
    tok = byte_level_tokenizer(tmp_path / "tokenizer.json")
    size = tok.get_vocab_size()
    vocab = GrammarVocabulary.from_tokenizer_json(tmp_path / "tokenizer.json", vocab_size=size + 5)
    assert vocab.size == size + 5
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert vocab.decode(ids) == text.encode("utf-8"), text
    specials = {token_id(tok, t) for t in SPECIALS}
    assert set(vocab.special_ids()) == specials | set(range(size, size + 5))
    # Single tokens: GPT-2's stand-ins ("Ġ" a space, "Ċ" a newline) are their bytes.
    assert vocab.token_bytes[token_id(tok, "\u0120")] == b" "
    assert vocab.token_bytes[token_id(tok, "\u010a")] == b"\n"


def test_sentencepiece_tokens_spell_the_text_and_fall_back_to_bytes(tmp_path: Path) -> None:
    tok = sentencepiece_tokenizer(tmp_path / "tokenizer.json")
    size = tok.get_vocab_size()
    eos = token_id(tok, "</s>")
    vocab = GrammarVocabulary.from_tokenizer_json(
        tmp_path / "tokenizer.json", vocab_size=size, special_ids=[eos]
    )
    fell_back = 0
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text  # the tokenizer round-trips it (the Strip drops "▁")
        assert vocab.decode(ids) == b" " + text.encode("utf-8"), text
        fell_back += sum(str(tok.id_to_token(i)).startswith("<0x") for i in ids)
    assert fell_back > 0  # the emoji and CJK characters were spelled byte by byte
    assert vocab.token_bytes[token_id(tok, "<0xF0>")] == b"\xf0"
    assert set(vocab.special_ids()) == {token_id(tok, t) for t in SPECIALS}


def test_a_tokenizer_it_cannot_spell_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.save(str(path))
    with pytest.raises(InvalidConfig, match=r"tokenizer\.json: decoder \['WordPiece'\]"):
        GrammarVocabulary.from_tokenizer_json(path, vocab_size=3)
    byte_level_tokenizer(path)
    with pytest.raises(InvalidConfig, match=r"has 360 ids, more than the model's vocab_size 300"):
        GrammarVocabulary.from_tokenizer_json(path, vocab_size=300)
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(InvalidConfig, match="cannot read the tokenizer"):
        GrammarVocabulary.from_tokenizer_json(path, vocab_size=300)


def test_a_subword_checkpoint_serves_grammars_through_engine_and_generate(tmp_path: Path) -> None:
    """The checkpoint's limits carry its tokenizer's vocabulary; a speculative engine's regex
    and JSON-schema outputs match their grammar as text and end on EOS, and `specstate
    generate` emits the same tokens for the same request line."""
    model = tmp_path / "model"
    model.mkdir()
    tok, eos, draft = subword_checkpoint(model)
    limits = checkpoint_limits(model)
    assert limits.grammar_vocabulary is not None
    assert limits.grammar_vocabulary.token_bytes[eos] is None
    regex = r"(def|class) [a-z]{2,6}\(\):"
    schema = {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["count"],
        "additionalProperties": False,
    }
    prompt = tok.encode("def add(a, b):\n").ids
    runs = {}
    for algorithm in ("draft_model", "none"):
        more = {"num_steps": 3, "draft": str(draft)} if algorithm != "none" else {}
        worker = default_registry().create(algorithm, target=str(model), **more)
        config = EngineConfig(kv_tokens=2048, check_invariants=True)
        with Engine(worker, limits=limits, config=config) as engine:
            by_regex = engine.submit(
                "r", prompt, SamplingParams(max_new_tokens=40, grammar=Grammar.regex(regex))
            )
            by_schema = engine.submit(
                "j", prompt, SamplingParams(max_new_tokens=40, grammar=Grammar.json_schema(schema))
            )
            engine.run_until_idle()
        runs[algorithm] = (by_regex, by_schema)
    by_regex, by_schema = runs["draft_model"]
    accepted = {a for r in (by_regex, by_schema) for a in r.accept_lengths}
    assert accepted & {2, 3}, accepted  # runs of drafts accepted, some cut short
    # Speculation emits exactly what masked decoding without a drafter emits.
    assert [r.emitted_ids for r in runs["none"]] == [by_regex.emitted_ids, by_schema.emitted_ids]
    for req in (by_regex, by_schema):
        assert req.finish is not None and req.finish.reason.value == "stop", req.finish
        assert req.emitted_ids[-1] == eos
    assert re.fullmatch(regex, tok.decode(list(by_regex.emitted_ids[:-1])))
    assert set(json.loads(tok.decode(list(by_schema.emitted_ids[:-1])))) == {"count"}
    line = {"id": "r", "input_ids": prompt, "max_new_tokens": 40, "grammar": {"regex": regex}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    argv = ["generate", "--model", str(model), "--draft", str(draft), "--algorithm",
            "draft_model", "--num-steps", "3",
            "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
            "--check-invariants"]  # fmt: skip
    assert main(argv) == 0
    (row,) = map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    assert row["output_ids"] == list(by_regex.emitted_ids)
