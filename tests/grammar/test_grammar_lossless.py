"""Grammar requests are exact: HF ``generate()`` under the same grammar, token for token.

Every algorithm (none, draft_model, eagle, ngram chains) × overlap on/off × page size 1 and 16 ×
whole / chunked prefill with mixed chunks serves five concurrent requests — a JSON schema, a
regular expression, an EBNF and a Lark grammar, and one without a grammar — with the invariant
checker after every step. The oracle is transformers' greedy ``generate()`` with a logits
processor applying the same compiled grammar (`grammar_oracle.hf_grammar_greedy`); every
output is also checked by Python's ``re`` / ``json``. The drafters agree with the target only
partly, so drafts are rejected and rolled back (asserted), accept lengths strictly between 1 and
the maximum occur (asserted), and the n-gram drafter proposes tokens the grammar refuses, which
are pruned (asserted). Two more tests: a grammar that ends inside an accepted run (agreeing
drafters), and retraction in the middle of a grammar under a small pool.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import pytest
from controls_oracle import run_bounds
from engine_driver import DriveLog, checked_config, run_checked
from grammar_oracle import (
    EOS,
    GRAMMARS,
    VOCAB,
    ascii_vocabulary,
    hf_grammar_greedy,
    hf_grammar_scored,
    matches,
)
from spec_checkpoints import ALGORITHMS, FAMILIES, MIXED_PROMPTS, SpecCheckpoints

from specstate import Req, RequestLimits, SamplingParams
from specstate.engine.capabilities.grammar import GrammarSnapshot
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine

PROMPTS = [list(p) for p in MIXED_PROMPTS]
KINDS: tuple[str | None, ...] = ("json_schema", "regex", "ebnf", "lark", None)
NEW_TOKENS = 40
STEPS = 3


@attrs.frozen
class Served:
    """What one engine run produced."""

    reqs: list[Req]
    grammar: GrammarSnapshot
    histogram: dict[int, int]
    log: DriveLog


@pytest.fixture(scope="module")
def expected(partial_ckpt: SpecCheckpoints) -> list[list[int]]:
    """The oracle's greedy tokens of every prompt under its grammar (none for the last)."""
    return [
        hf_grammar_greedy(
            partial_ckpt.hf, p, NEW_TOKENS, None if kind is None else GRAMMARS[kind][0]
        )
        for p, kind in zip(PROMPTS, KINDS, strict=True)
    ]


def limits() -> RequestLimits:
    """The tiny checkpoints' limits, with their text vocabulary."""
    return RequestLimits(
        vocab_size=VOCAB,
        max_context_len=64,
        eos_token_ids={EOS},
        grammar_vocabulary=ascii_vocabulary(),
    )


def serve(
    ckpt: SpecCheckpoints, algorithm: str, *, agreeing: bool = False, **options: Any
) -> Served:
    """Serve PROMPTS under KINDS with every check on; the requests and what happened."""
    config = checked_config(**options)
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=agreeing)
    with Engine(worker, limits=limits(), config=config) as engine:
        reqs = [
            engine.submit(
                f"g{i}",
                prompt,
                SamplingParams(
                    max_new_tokens=NEW_TOKENS,
                    grammar=None if kind is None else GRAMMARS[kind][0],
                ),
            )
            for i, (prompt, kind) in enumerate(zip(PROMPTS, KINDS, strict=True))
        ]
        log = run_checked(engine)
        snap = engine.snapshot()
        assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
        grammar = engine.grammar.snapshot()
    return Served(reqs, grammar, dict(snap.metrics.histogram), log)


def check_outputs(served: Served, expected: list[list[int]]) -> None:
    """Outputs equal the oracle; grammar outputs end at their EOS and parse."""
    assert [list(r.emitted_ids) for r in served.reqs] == expected
    for req, kind in zip(served.reqs, KINDS, strict=True):
        assert req.finish is not None
        if kind is None:
            assert req.finish.reason.value == "length"
        else:
            assert req.finish.reason.value == "stop", (kind, req.finish)
            assert matches(kind, req.emitted_ids), (kind, req.emitted_ids)
    assert served.grammar.num_requests == 0  # ended requests left the table
    assert served.grammar.num_dead_ends == served.grammar.num_violations == 0


MATRIX = list(itertools.product(ALGORITHMS, [False, True], [1, 16], [(None, False), (4, True)]))
FAMILY_MATRIX: list[tuple[str, bool, int, tuple[int | None, bool]]] = list(
    itertools.product(FAMILIES, [False, True], [16], [(4, True)])
)
"""The hidden-state drafters: both loops at page 16 with chunked, mixed prefill."""


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "overlap", "page_size", "chunking"), MATRIX + FAMILY_MATRIX)
def test_grammar_lossless_matrix(
    partial_ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Grammar outputs equal HF generate under the same grammar; drafts were rolled back."""
    served = serve(
        partial_ckpt,
        algorithm,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    check_outputs(served, expected)
    grammar = served.grammar
    assert grammar.num_masks > 0
    if algorithm != "none":
        assert grammar.num_rollbacks > 0 and grammar.num_rolled_back_tokens > 0
    if algorithm == "ngram":
        assert grammar.num_pruned_drafts > 0  # the history proposed what the grammar refuses
    if algorithm in ("draft_model", "eagle", *FAMILIES):
        assert any(1 < a < STEPS + 1 for a in served.histogram), served.histogram


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["draft_model", "eagle"])
def test_grammar_ends_inside_an_accepted_run(
    partial_ckpt: SpecCheckpoints, expected: list[list[int]], algorithm: str, overlap: bool
) -> None:
    """With drafters that agree with the target, a grammar's end token lands inside an accepted
    run: the request stops there (reason stop, EOS included) and the run's later tokens are
    settled but never emitted."""
    served = serve(partial_ckpt, algorithm, agreeing=True, overlap=overlap)
    check_outputs(served, expected)
    inside = 0
    for req, kind in zip(served.reqs, KINDS, strict=True):
        if kind is None:
            continue
        end = len(req.emitted_ids)  # the EOS is output end - 1
        bounds = run_bounds(req.accept_lengths)
        if end not in bounds:  # the run that holds the EOS goes on past it
            inside += 1
            assert len(req.output_ids) > end and req.emitted_ids[-1] == EOS
    assert inside >= 2, "agreeing drafters were meant to end grammars inside runs"


@pytest.mark.parametrize("algorithm", ["draft_model", "ngram"])
def test_retraction_in_the_middle_of_a_grammar(
    partial_ckpt: SpecCheckpoints, expected: list[list[int]], algorithm: str
) -> None:
    """A pool too small for every request retracts some in the middle of their grammar
    (asserted); re-admitted, each resumes its grammar at its settled outputs: still exact."""
    served = serve(partial_ckpt, algorithm, overlap=True, kv_tokens=96, page_size=4)
    assert served.log.retracted, "the pool was meant to force retractions"
    retracted = set(served.log.retracted)
    with_grammar = {f"g{i}" for i, kind in enumerate(KINDS) if kind is not None}
    assert retracted & with_grammar, (retracted, "a grammar request was meant to be retracted")
    check_outputs(served, expected)


@pytest.mark.parametrize("algorithm", ["draft_model", "ngram"])
def test_grammar_with_a_penalty_and_logprobs_equals_hf(
    partial_ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """The mask comes after the repetition penalty (HF's order), and logprobs are under the
    masked distribution: tokens and logprobs equal HF's processed scores."""
    config = EngineConfig(kv_tokens=2048, overlap=True, check_invariants=True)
    kinds = [k for k in KINDS if k is not None]
    with Engine(
        partial_ckpt.worker(algorithm, num_steps=STEPS), limits=limits(), config=config
    ) as engine:
        reqs = [
            engine.submit(
                f"p{i}",
                PROMPTS[i],
                SamplingParams(
                    max_new_tokens=NEW_TOKENS,
                    grammar=GRAMMARS[kind][0],
                    repetition_penalty=1.3,
                    logprobs=True,
                ),
            )
            for i, kind in enumerate(kinds)
        ]
        run_checked(engine)
    for i, (req, kind) in enumerate(zip(reqs, kinds, strict=True)):
        tokens, logprobs = hf_grammar_scored(
            partial_ckpt.hf, PROMPTS[i], NEW_TOKENS, GRAMMARS[kind][0], repetition_penalty=1.3
        )
        assert list(req.emitted_ids) == tokens and matches(kind, req.emitted_ids)
        assert req.logprobs is not None
        assert list(req.logprobs) == pytest.approx(logprobs, abs=1e-4)
