"""Grammar requests through the block drafters are exact: HF ``generate()`` under the grammar.

dflash and uno (linear) serve five concurrent requests — a JSON schema, a regular expression,
an EBNF and a Lark grammar, and one without a grammar — with every check on. A block's drafts
are masked position by position (each draft sees the grammar after the drafts before it) and
the verify applies one mask per position, so outputs equal transformers' greedy generate()
masked by the same grammar. A uno tree serves no grammar (`test_uno`: refused at submit).
"""

from __future__ import annotations

import pytest
from block_checkpoints import BlockCheckpoints
from engine_driver import checked_config, run_checked
from grammar_oracle import EOS, GRAMMARS, VOCAB, ascii_vocabulary, hf_grammar_greedy, matches
from spec_checkpoints import MIXED_PROMPTS

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine

PROMPTS = [list(p) for p in MIXED_PROMPTS]
KINDS: tuple[str | None, ...] = ("json_schema", "regex", "ebnf", "lark", None)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def expected(block_ckpt: BlockCheckpoints) -> list[list[int]]:
    """The oracle's greedy tokens of every prompt under its grammar (none for the last)."""
    return [
        hf_grammar_greedy(block_ckpt.hf, p, NEW_TOKENS, None if k is None else GRAMMARS[k][0])
        for p, k in zip(PROMPTS, KINDS, strict=True)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dflash", "uno"])
@pytest.mark.parametrize(("overlap", "page_size", "chunked"), [(False, 1, None), (True, 16, 4)])
def test_block_drafters_serve_grammars_exactly(
    block_ckpt: BlockCheckpoints,
    expected: list[list[int]],
    family: str,
    overlap: bool,
    page_size: int,
    chunked: int | None,
) -> None:
    """Outputs equal the oracle; grammar outputs end at EOS and parse; drafts rolled back."""
    limits = RequestLimits(
        vocab_size=VOCAB,
        max_context_len=96,
        eos_token_ids={EOS},
        grammar_vocabulary=ascii_vocabulary(),
    )
    config = checked_config(
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunked,
        mixed_chunk=chunked is not None,
    )
    with Engine(block_ckpt.worker(family), limits=limits, config=config) as engine:
        reqs = [
            engine.submit(
                f"g{i}",
                prompt,
                SamplingParams(
                    max_new_tokens=NEW_TOKENS, grammar=None if kind is None else GRAMMARS[kind][0]
                ),
            )
            for i, (prompt, kind) in enumerate(zip(PROMPTS, KINDS, strict=True))
        ]
        run_checked(engine)
        grammar = engine.grammar.snapshot()
    assert [list(r.emitted_ids) for r in reqs] == expected
    for req, kind in zip(reqs, KINDS, strict=True):
        if kind is not None:
            assert matches(kind, req.emitted_ids), (kind, req.emitted_ids)
    assert grammar.num_masks > 0 and grammar.num_rollbacks > 0
    assert grammar.num_dead_ends == grammar.num_violations == 0
