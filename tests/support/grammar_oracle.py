"""Test-only: a text vocabulary for the tiny checkpoints, and HF ``generate()`` under a grammar.

The tiny test checkpoints have 97 token ids; `ascii_vocabulary` gives them text: ids 0-94 are
the printable ASCII characters (space to ``~``), 95 is a newline, 96 is the end-of-sequence
token (special). `hf_grammar_greedy` is the exactness oracle: transformers' greedy
``generate()`` with a `LogitsProcessor` that sets -inf on every token the same compiled grammar
refuses — its own llguidance matcher, advanced one generated token at a time, its mask unpacked
with NumPy (not the engine's code). `matches` checks an output with Python itself (``re``,
``json``), apart from llguidance.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from hf_oracle import greedy_scored
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from specstate.grammar.spec import Grammar, GrammarVocabulary
from specstate.grammar.state import GrammarCompiler

EOS = 96
VOCAB = 97


def ascii_vocabulary() -> GrammarVocabulary:
    """Ids 0-94: ``chr(32 + id)``; 95: newline; 96: EOS (special)."""
    return GrammarVocabulary.from_tokens([chr(32 + i) for i in range(95)] + ["\n", None])


def compiler() -> GrammarCompiler:
    """A compiler for the tiny checkpoints' vocabulary."""
    return GrammarCompiler(ascii_vocabulary(), vocab_size=VOCAB, eos_token_ids=frozenset({EOS}))


def text(ids: Sequence[int]) -> str:
    """The text of ``ids`` (the EOS and other special ids contribute nothing)."""
    return ascii_vocabulary().decode(ids).decode("utf-8")


def encode(value: str) -> list[int]:
    """The ids of ASCII ``value``."""
    return [95 if c == "\n" else ord(c) - 32 for c in value]


class GrammarProcessor(LogitsProcessor):
    """Masks the scores of one generate() row to what its grammar allows next."""

    def __init__(self, matcher: Any, prompt_len: int) -> None:
        self._matcher = matcher
        self._prompt_len = prompt_len
        self._consumed = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[0, self._prompt_len :].tolist()
        for token in generated[self._consumed :]:
            assert self._matcher.consume_token(token), self._matcher.get_error()
        self._consumed = len(generated)
        packed = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(packed, bitorder="little")[: scores.shape[1]].astype(bool)
        out = scores.clone()
        out[0, torch.from_numpy(~allowed)] = float("-inf")
        return out  # type: ignore[return-value]


def hf_grammar_greedy(
    model: LlamaForCausalLM, prompt: Sequence[int], max_new_tokens: int, grammar: Grammar | None
) -> list[int]:
    """transformers' greedy tokens under ``grammar`` (EOS ends the output and is included)."""
    return hf_grammar_scored(model, prompt, max_new_tokens, grammar)[0]


def hf_grammar_scored(
    model: LlamaForCausalLM,
    prompt: Sequence[int],
    max_new_tokens: int,
    grammar: Grammar | None,
    *,
    repetition_penalty: float = 1.0,
) -> tuple[list[int], list[float]]:
    """`hf_grammar_greedy` with HF's repetition penalty (applied before the grammar's mask, as
    transformers runs its own processors before the ones it is given), and the log-probability
    of every token under the processed scores."""
    processors = LogitsProcessorList()
    if grammar is not None:
        _, matcher = compiler().compile(grammar)
        processors.append(GrammarProcessor(matcher, len(prompt)))
    return greedy_scored(
        model,
        prompt,
        max_new_tokens,
        eos_token_id=EOS if grammar is not None else None,
        repetition_penalty=repetition_penalty,
        logits_processor=processors,
    )


# The grammars of the exactness tests: each ends within a few dozen tokens whatever the model,
# and each has a check in Python itself.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["ab", "cd", "efg"]},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tag", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-e]{1,4}(-[0-9]{1,2}){1,3};"
EBNF = 'root ::= "(" num ( op num ){0,3} ")"\nnum ::= [0-9]{1,2}\nop ::= "+" | "*"'
LARK = 'start: WORD ("," WORD)~0..2 "."\nWORD: /[a-z]{1,3}/'


def _json_ok(value: str) -> bool:
    obj = json.loads(value)
    return (
        list(obj) == ["id", "tag", "ok"]
        and isinstance(obj["id"], int)
        and 0 <= obj["id"] <= 999
        and obj["tag"] in ("ab", "cd", "efg")
        and isinstance(obj["ok"], bool)
    )


GRAMMARS: dict[str, tuple[Grammar, Callable[[str], bool]]] = {
    "json_schema": (Grammar.json_schema(SCHEMA), _json_ok),
    "regex": (Grammar.regex(REGEX), lambda s: re.fullmatch(REGEX, s) is not None),
    "ebnf": (
        Grammar.ebnf(EBNF),
        lambda s: re.fullmatch(r"\([0-9]{1,2}([+*][0-9]{1,2}){0,3}\)", s) is not None,
    ),
    "lark": (
        Grammar.lark(LARK),
        lambda s: re.fullmatch(r"[a-z]{1,3}(,[a-z]{1,3}){0,2}\.", s) is not None,
    ),
}


def matches(kind: str, ids: Sequence[int]) -> bool:
    """Whether a finished output (ending with EOS) is a string of grammar ``kind``, by Python."""
    if not ids or ids[-1] != EOS or EOS in ids[:-1]:
        return False
    return bool(GRAMMARS[kind][1](text(ids[:-1])))
