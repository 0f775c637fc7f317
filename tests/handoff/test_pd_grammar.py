"""Grammar requests cross a handoff: the decode engine compiles the grammar from the record's
spec and replays the first token through it; the output equals transformers' greedy
``generate()`` under the same grammar, and one engine's, token for token, with one engine's
accept lengths. Every chain family: the draft-model, EAGLE, EAGLE-3 and MTP drafters, n-gram,
Frozen-KV MTP, and the block drafters (DFLASH, DSpark, UNO) on their own target."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from block_checkpoints import BlockCheckpoints
from grammar_oracle import EOS, GRAMMARS, VOCAB, ascii_vocabulary, hf_grammar_greedy
from handoff_harness import run_one, run_pd
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

KINDS = ("json_schema", "regex", "ebnf", "lark")
NEW_TOKENS = 30
LIMITS = RequestLimits(
    vocab_size=VOCAB, max_context_len=64, eos_token_ids={EOS}, grammar_vocabulary=ascii_vocabulary()
)
BLOCK = ("dflash", "dspark", "uno")


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm",
    ["ngram", "draft_model", "eagle", "eagle3", "mtp", "frozen_kv_mtp", *BLOCK],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_requests_through_prefill_and_decode(
    partial_ckpt: SpecCheckpoints,
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    algorithm: str,
    overlap: bool,
) -> None:
    """Every grammar kind: HF's constrained greedy tokens, one engine's tokens and accepts."""
    requests = [
        (f"g{i}", list(p), SamplingParams(max_new_tokens=NEW_TOKENS, grammar=GRAMMARS[kind][0]))
        for i, (p, kind) in enumerate(zip(MIXED_PROMPTS, KINDS, strict=False))
    ]
    options: dict[str, Any] = {"overlap": overlap, "page_size": 4}
    hf: Any = block_ckpt.hf if algorithm in BLOCK else partial_ckpt.hf

    def worker() -> WorkerProtocol:
        if algorithm == "dspark":
            return default_registry().create(
                "dspark", target=block_ckpt.target, assistant=dspark_assistant
            )
        if algorithm in BLOCK:
            return block_ckpt.worker(algorithm)
        return partial_ckpt.worker(algorithm, agreeing=False)

    run = run_pd(worker(), worker(), [requests], vocab_size=VOCAB, limits=LIMITS, **options)
    one, accepts = run_one(worker(), [requests], vocab_size=VOCAB, limits=LIMITS, **options)
    want = {rid: hf_grammar_greedy(hf, p, NEW_TOKENS, s.grammar) for rid, p, s in requests}
    assert run.outputs == want == one
    assert run.accepts == accepts
    assert run.prefill_tokens_on_decode == 0
    assert run.drafter_prefill_tokens_on_decode == 0
    if algorithm != "ngram":  # the drafter drafts under the grammar and is accepted in part
        assert run.mean_accept > 1.0
