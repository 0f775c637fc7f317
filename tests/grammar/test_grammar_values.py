"""Grammar values: `Grammar`, `GrammarVocabulary`, and the limits and parameters that carry them."""

from __future__ import annotations

import pytest

from specstate import InvalidConfig, InvalidRequest, RequestLimits, SamplingParams
from specstate.grammar.spec import GRAMMAR_KINDS, Grammar, GrammarVocabulary
from specstate.grammar.state import GrammarCompiler
from specstate.reference import embedded


def test_every_kind_round_trips_through_the_request_file_form() -> None:
    """`Grammar.to_json` and `Grammar.from_json` are inverse; the schema keeps its key order."""
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    grammars = [
        Grammar.json_schema(schema),
        Grammar.regex("[0-9]+"),
        Grammar.ebnf('root ::= "a"'),
        Grammar.lark('start: "a"'),
    ]
    assert [g.kind for g in grammars] == list(GRAMMAR_KINDS)
    for grammar in grammars:
        assert Grammar.from_json(grammar.to_json()) == grammar and grammar.problems() == []
    assert list(grammars[0].to_json()["json_schema"]["properties"]) == ["z", "a"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({}, "exactly one key"),
        ({"regex": "a", "lark": "b"}, "exactly one key"),
        ({"yaml": "a: 1"}, "unknown grammar kind 'yaml'"),
        ({"json_schema": 3}, "grammar 'json_schema' must be an object or a string"),
        ({"ebnf": ["root"]}, "grammar 'ebnf' must be a string"),
    ],
)
def test_a_malformed_request_file_form_is_named(value: object, message: str) -> None:
    """Each malformed form says what is wrong."""
    with pytest.raises(ValueError, match=message):
        Grammar.from_json(value)


def test_a_grammar_describes_itself_briefly() -> None:
    """Messages name a grammar by kind and the start of its text."""
    assert Grammar.regex("[a-z]+").describe() == "regex '[a-z]+'"
    assert Grammar.lark("start: " + "x" * 80).describe().endswith("...")


def test_a_byte_level_vocabulary_spells_bytes_and_skips_specials() -> None:
    """The embedded model's vocabulary: ids 0-255 are bytes, BOS, EOS and padding special."""
    vocabulary = embedded.grammar_vocabulary()
    assert vocabulary.size == embedded.VOCAB_SIZE
    assert vocabulary.special_ids() == (256, 257, 258, 259)
    ids = vocabulary.encode("déf".encode())
    assert ids == embedded.encode("déf")
    assert vocabulary.decode([embedded.BOS_ID, *ids, embedded.EOS_ID]) == "déf".encode()


def test_multi_byte_tokens_encode_greedily() -> None:
    """`GrammarVocabulary.from_tokens` takes strings, bytes and None; encoding is longest-first."""
    vocabulary = GrammarVocabulary.from_tokens(["a", "ab", b"b", None])
    assert vocabulary.encode(b"abab") == [1, 1] and vocabulary.encode(b"ba?") == [2, 0]
    assert vocabulary.decode([1, 3, 2]) == b"abb"


def test_a_vocabulary_refuses_empty_or_foreign_entries() -> None:
    """An empty byte string or a non-bytes entry is refused, naming the ids."""
    with pytest.raises(InvalidConfig, match=r"ids \[1\] are not"):
        GrammarVocabulary(token_bytes=[b"a", b"", None])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"eos_token_ids": set()}, "needs eos_token_ids"),
        ({"eos_token_ids": {97}}, r"eos_token_ids \[97\] stand for text"),
        ({"vocab_size": 100}, "describes 260 tokens, more than vocab_size 100"),
    ],
)
def test_limits_check_the_vocabulary_against_the_model(
    options: dict[str, object], message: str
) -> None:
    """The EOS ids must be special tokens of the vocabulary, which must fit the model."""
    values: dict[str, object] = {
        "vocab_size": embedded.VOCAB_SIZE,
        "max_context_len": 64,
        "eos_token_ids": {embedded.EOS_ID},
        "grammar_vocabulary": embedded.grammar_vocabulary(),
        **options,
    }
    with pytest.raises(InvalidConfig, match=message):
        RequestLimits(**values)  # type: ignore[arg-type]


def test_sampling_params_read_the_request_file_form() -> None:
    """``grammar={"regex": ...}`` becomes a `Grammar`; a malformed form is an `InvalidRequest`."""
    assert SamplingParams(grammar={"regex": "a+"}).grammar == Grammar.regex("a+")
    with pytest.raises(InvalidRequest, match="grammar: unknown grammar kind 'x'"):
        SamplingParams(grammar={"x": "a"})
    assert SamplingParams(grammar="a+").problems(10) == [
        "grammar must be a Grammar or None, got str"
    ]


def test_the_compiler_keeps_a_bounded_cache_of_compiled_grammars() -> None:
    """A grammar compiled again comes from the cache (a fresh copy); the oldest leave first."""
    compiler = GrammarCompiler(
        embedded.grammar_vocabulary(),
        vocab_size=embedded.VOCAB_SIZE,
        eos_token_ids=frozenset({embedded.EOS_ID}),
        max_cached=2,
    )
    grammars = [Grammar.regex(f"a{{{n}}}") for n in (1, 2, 3)]
    first = compiler.compile(grammars[0])[1]
    again = compiler.compile(grammars[0])[1]
    assert first is not again and again.consume_token(ord("a")) and not first.is_error()
    for grammar in grammars[1:]:
        compiler.compile(grammar)
    assert list(compiler._compiled) == grammars[1:]
