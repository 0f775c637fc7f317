"""``top_logprobs`` through the engine equal transformers' distributions, position by position.

Greedy rows, speculation on (chains, a draft tree, a block drafter; runs cut mid-way), both
loops, and a retraction-forced run: each emitted position's top ``k`` ids and values are the top
``k`` of ``log_softmax`` of transformers' target logits at that position (``generate(...,
output_logits=True)``), and the emitted token is the top one. A sampled request (temperature,
top-p) gets its top ``k`` under the processed distribution, recomputed here from transformers'
logits of the emitted sequence. The invariant checker runs after every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from block_checkpoints import BlockCheckpoints
from engine_driver import DriveLog, run_checked
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints
from transformers import LlamaForCausalLM

from specstate import RequestLimits, SamplingParams
from specstate.core.request import Req, TopLogprobs
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

NEW_TOKENS = 12
STEPS = 3  # D = 4
TOP = (5, 1, 3, 20, 2)  # each row its own k (the batch's K is the largest)
TOL = 2e-4


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


def hf_distributions(
    hf: LlamaForCausalLM, prompt: Sequence[int], n: int
) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens of ``prompt`` and ``log_softmax`` of its logits at each."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = [int(t) for t in out.sequences[0, len(prompt) :]]
    return tokens, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]


def assert_top_of(got: TopLogprobs, dist: torch.Tensor, k: int) -> None:
    """``got`` is a top ``k`` of ``dist``: each value is its id's log-probability there, and the
    values are ``dist``'s ``k`` largest (ties may order ids either way)."""
    ids = [t for t, _ in got]
    values = [v for _, v in got]
    assert len(got) == k and len(set(ids)) == k
    assert values == pytest.approx(dist[ids].tolist(), abs=TOL)
    assert values == pytest.approx(dist.sort(descending=True).values[:k].tolist(), abs=TOL)


def serve(
    worker: WorkerProtocol,
    ckpt: SpecCheckpoints,
    requests: Sequence[tuple[Sequence[int], SamplingParams]],
    **config: object,
) -> tuple[list[Req], DriveLog]:
    """Serve ``requests`` in one engine with every check on."""
    engine_config = EngineConfig(
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **{"kv_tokens": 2048, **config},  # type: ignore[arg-type]
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=engine_config) as engine:
        reqs = [engine.submit(f"r{i}", list(p), params) for i, (p, params) in enumerate(requests)]
        log = run_checked(engine)
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    return reqs, log


def greedy_requests() -> list[tuple[Sequence[int], SamplingParams]]:
    """Every mixed prompt, each row with its own ``top_logprobs``; the last row without."""
    out: list[tuple[Sequence[int], SamplingParams]] = [
        (p, SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=True, top_logprobs=k))
        for p, k in zip(MIXED_PROMPTS, TOP, strict=True)
    ]
    out.append((MIXED_PROMPTS[0], SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=True)))
    return out


def assert_greedy_tops(reqs: list[Req], ckpt: SpecCheckpoints) -> None:
    """Tokens, logprobs and top logprobs of every row equal transformers' at each position."""
    for req, k in zip(reqs, TOP, strict=False):
        tokens, dists = hf_distributions(ckpt.hf, req.prompt_ids, NEW_TOKENS)
        assert list(req.emitted_ids) == tokens
        tops, logprobs = req.top_logprobs, req.logprobs
        assert tops is not None and logprobs is not None and len(tops) == len(tokens)
        for top, token, logprob, dist in zip(tops, tokens, logprobs, dists, strict=True):
            assert_top_of(top, dist, k)
            assert top[0][0] == token  # the emitted token is the top-1 (greedy)
            assert top[0][1] == pytest.approx(logprob, abs=1e-6)
    assert reqs[-1].top_logprobs is None and reqs[-1].logprobs is not None


def assert_speculated(reqs: list[Req]) -> None:
    """Runs were cut mid-way: mean accept length strictly between 1 and the maximum."""
    accepts = [a for r in reqs for a in r.accept_lengths]
    mean = sum(accepts) / len(accepts)
    assert 1 < mean < STEPS + 1, accepts
    assert any(1 < a < STEPS + 1 for a in accepts), accepts


def chain_worker(ckpt: SpecCheckpoints, algorithm: str, *, topk: int = 1) -> WorkerProtocol:
    """A reference worker of STEPS steps drafting ``topk`` per node (a tree when above 1)."""
    options: dict[str, object] = {"target": ckpt.target, "seed": 0}
    if algorithm != "none":
        options.update(num_steps=STEPS, topk=topk)
    if algorithm == "draft_model":
        options["draft"] = ckpt.draft
    if algorithm == "eagle":
        options["eagle"] = ckpt.eagle
    return default_registry().create(algorithm, **options)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize(
    ("algorithm", "topk"),
    [("draft_model", 1), ("eagle", 1), ("draft_model", 2)],
    ids=["chain", "eagle-chain", "tree"],
)
def test_greedy_top_logprobs_equal_hf_with_speculation(
    ckpt: SpecCheckpoints, algorithm: str, topk: int, overlap: bool
) -> None:
    """Each position's top k equals transformers'; the emitted token is the top one."""
    worker = chain_worker(ckpt, algorithm, topk=topk)
    assert worker.capabilities.supports_top_logprobs
    reqs, _ = serve(worker, ckpt, greedy_requests(), overlap=overlap)
    assert_greedy_tops(reqs, ckpt)
    assert_speculated(reqs[:-1])


def test_greedy_top_logprobs_survive_retraction(ckpt: SpecCheckpoints) -> None:
    """A pool that forces retraction and re-prefill keeps the top logprobs aligned."""
    worker = chain_worker(ckpt, "draft_model")
    reqs, log = serve(
        worker,
        ckpt,
        greedy_requests(),
        overlap=True,
        page_size=16,
        kv_tokens=96,
        chunked_prefill=4,
        mixed_chunk=True,
    )
    assert log.retracted, "the pool was meant to force a retraction"
    assert_greedy_tops(reqs, ckpt)


def processed_log_distributions(
    hf: LlamaForCausalLM,
    prompt: Sequence[int],
    emitted: Sequence[int],
    temperature: float,
    top_p: float,
) -> list[torch.Tensor]:
    """The log of each emitted position's sampling distribution, recomputed from
    transformers' logits of the whole sequence: softmax at ``temperature``, the smallest
    most-probable prefix whose mass reaches ``top_p`` kept, renormalized (-inf elsewhere)."""
    ids = torch.tensor([[*prompt, *emitted]])
    with torch.no_grad():
        logits = hf(ids).logits[0].float()
    out = []
    for position in range(len(prompt) - 1, len(prompt) - 1 + len(emitted)):
        probs = torch.softmax(logits[position] / temperature, dim=-1)
        ordered, order = probs.sort(descending=True)
        keep = (ordered.cumsum(0) - ordered) < top_p
        kept = torch.zeros_like(probs)
        kept[order[keep]] = ordered[keep]
        out.append((kept / kept.sum()).log())
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", ["draft_model", "tree", "dflash"])
def test_sampled_top_logprobs_follow_the_processed_distribution(
    ckpt: SpecCheckpoints, block_ckpt: BlockCheckpoints, algorithm: str, overlap: bool
) -> None:
    """A sampled request's top k (temperature, top-p) are its processed distribution's."""
    temperature, top_p, k = 0.7, 0.8, 6
    if algorithm == "dflash":
        worker, hf, vocab = block_ckpt.worker("dflash"), block_ckpt.hf, block_ckpt.vocab_size
    else:
        topk = 2 if algorithm == "tree" else 1
        worker, hf, vocab = chain_worker(ckpt, "draft_model", topk=topk), ckpt.hf, ckpt.vocab_size
    params = SamplingParams(
        max_new_tokens=NEW_TOKENS,
        temperature=temperature,
        top_p=top_p,
        seed=11,
        logprobs=True,
        top_logprobs=k,
    )
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=True, top_logprobs=2)
    prompts = [[t % vocab for t in p] for p in MIXED_PROMPTS[:3]]
    requests = [(prompts[0], params), (prompts[1], greedy), (prompts[2], params)]
    engine_config = EngineConfig(
        kv_tokens=2048, check_invariants=True, check_ownership=True, overlap=overlap
    )
    limits = RequestLimits(vocab_size=vocab, max_context_len=64)
    with Engine(worker, limits=limits, config=engine_config) as engine:
        reqs = [engine.submit(f"s{i}", p, q) for i, (p, q) in enumerate(requests)]
        run_checked(engine)
    for req in (reqs[0], reqs[2]):
        dists = processed_log_distributions(hf, req.prompt_ids, req.emitted_ids, temperature, top_p)
        tops, logprobs = req.top_logprobs, req.logprobs
        assert tops is not None and logprobs is not None and len(tops) == NEW_TOKENS
        for top, token, logprob, dist in zip(tops, req.emitted_ids, logprobs, dists, strict=True):
            assert logprob == pytest.approx(float(dist[token]), abs=TOL)
            values = [v for _, v in top]
            assert values == pytest.approx(dist[[t for t, _ in top]].tolist(), abs=TOL)
            assert values == pytest.approx(dist.sort(descending=True).values[:k].tolist(), abs=TOL)
            assert any(v == float("-inf") for v in values) or len(set(values)) == k
    accepts = [a for r in reqs for a in r.accept_lengths]
    assert max(accepts) > 1, accepts  # speculation really happened
