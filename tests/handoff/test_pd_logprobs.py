"""Requests with ``logprobs`` (and ``top_logprobs``) cross a handoff: the first token's
log-probability and top alternatives travel in the record, and the decode engine's
`Req.logprobs` / `Req.top_logprobs` continue them.

Greedy and seeded sampled requests, mixed in one batch with and without ``top_logprobs``, every
chain algorithm and both loops: tokens, logprobs and top alternatives equal one engine's
exactly; greedy tokens equal transformers' ``generate()`` and their logprobs its scores'.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from block_checkpoints import BlockCheckpoints
from engine_driver import checked_config, run_checked
from handoff_harness import linked
from hf_oracle import greedy_scored
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol
from specstate.handoff.link import serve_disaggregated
from specstate.reference.workers import default_registry

NEW_TOKENS = 8
PROMPTS = [list(p) for p in MIXED_PROMPTS]
ALGORITHMS = ("none", "ngram", "draft_model", "eagle", "eagle3", "mtp", "frozen_kv_mtp", "dflash")

Outputs = dict[str, tuple[list[int], Any, Any]]


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    """Even ids greedy, odd ids seeded sampled; top_logprobs 0, 1, 3 in turn."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            max_new_tokens=NEW_TOKENS,
            logprobs=True,
            top_logprobs=(0, 1, 3)[i % 3],
            temperature=0.9 if i % 2 else 0.0,
            seed=40 + i if i % 2 else None,
        )
        out.append((f"r{i}", prompt, params))
    return out


def _worker(partial: SpecCheckpoints, block: BlockCheckpoints, algorithm: str) -> WorkerProtocol:
    if algorithm == "dflash":
        return default_registry().create(
            "dflash", target=block.target, assistant=block.assistant, check_commit_order=True
        )
    return partial.worker(algorithm, agreeing=False)


def _outputs(reqs: Any) -> Outputs:
    return {r.request_id: (list(r.emitted_ids), r.logprobs, r.top_logprobs) for r in reqs}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap"), list(itertools.product(ALGORITHMS, [False, True]))
)
def test_logprobs_continue_on_the_decode_engine(
    partial_ckpt: SpecCheckpoints,
    block_ckpt: BlockCheckpoints,
    algorithm: str,
    overlap: bool,
) -> None:
    """One engine's tokens, logprobs and top alternatives, exactly; HF's for greedy rows."""
    requests = _requests()
    vocab = block_ckpt.vocab_size if algorithm == "dflash" else partial_ckpt.vocab_size
    hf: Any = block_ckpt.hf if algorithm == "dflash" else partial_ckpt.hf
    options: dict[str, Any] = {"overlap": overlap, "page_size": 4, "prefix_cache": True}

    def worker() -> WorkerProtocol:
        return _worker(partial_ckpt, block_ckpt, algorithm)

    records = {}
    with linked(worker(), worker(), vocab_size=vocab, **options) as link:
        export = link.prefill.export_handoff

        def recorded(request_id: str) -> Any:
            records[request_id] = record = export(request_id)
            return record

        link.prefill.export_handoff = recorded  # type: ignore[method-assign]
        got = _outputs(serve_disaggregated(link, requests, after_step=check_engine).values())
    limits = RequestLimits(vocab_size=vocab, max_context_len=64)
    with Engine(worker(), limits=limits, config=checked_config(**options)) as engine:
        reqs = [engine.submit(*r) for r in requests]
        run_checked(engine)
        want = _outputs(reqs)
    assert got == want
    assert len(records) == len(requests)
    for rid, prompt, params in requests:
        record = records[rid]
        assert record.output_logprobs == want[rid][1][:1]  # the first token's crossed
        top = want[rid][2]
        assert record.output_top_logprobs == (None if top is None else top[:1])
        if params.top_logprobs:
            assert all(len(pairs) == params.top_logprobs for pairs in top)
        if params.temperature == 0.0:
            tokens, logprobs = greedy_scored(hf, prompt, NEW_TOKENS)
            assert got[rid][0] == tokens
            assert got[rid][1] == pytest.approx(logprobs, abs=1e-4)
