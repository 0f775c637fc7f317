"""Prefill → decode is lossless for the newer families: Frozen-KV MTP, DFLASH, DSpark and UNO.

Each family's draft state crosses in the record: DFLASH's and DSpark's materialized context KV
(``assistant.k*`` / ``assistant.v*``, by slot), Frozen-KV MTP's seed state (the target's normed
hidden state of position ``C - 1``, in the draft state: it keeps nothing by slot), and for UNO
nothing besides the target's (the drafter is the target through an adapter; a UNO tree's
pass-1 marginals live one round). Both loops, page 1
and 16, prefix cache on: greedy requests emit transformers' ``generate()`` tokens and one
engine's, with one engine's accept lengths; seeded sampled requests one engine's; the decode
engine prefills nothing, target or drafter. DFLASH and DSpark run with their commit-order
check: a decode round reading imported context the ledger does not hold as committed raises.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from block_checkpoints import BlockCheckpoints
from engine_driver import checked_config, run_checked, with_stops
from handoff_harness import linked, run_one, run_pd
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import Engine, HandoffMismatch, RequestLimits, SamplingParams
from specstate.engine.budgets import budget_policy
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol, handoff_worker
from specstate.handoff.link import HandoffLink, serve_disaggregated
from specstate.reference.workers import default_registry

NEW_TOKENS = 12
WAVE1 = [list(p) for p in MIXED_PROMPTS]
WAVE2 = [[*p, (7 * i + 3) % 90 + 1, 11] for i, p in enumerate(WAVE1)]  # wave 1's prefixes
PROMPTS = WAVE1 + WAVE2
FAMILIES = ("frozen_kv_mtp", "dflash", "dspark", "uno", "uno_tree")
"""``uno_tree``: UNO drafting a tree (``topk`` 2, six nodes verified)."""
MIN_ACCEPT = {"frozen_kv_mtp": 1.0, "dflash": 1.0, "dspark": 1.0, "uno": 2.0, "uno_tree": 2.0}
MAX_ACCEPT = {"frozen_kv_mtp": 4, "dflash": 4, "dspark": 4, "uno": 5, "uno_tree": 5}


class Families:
    """A worker of every family here on its own tiny target, and that target's HF model."""

    def __init__(self, partial: SpecCheckpoints, block: BlockCheckpoints, dspark: Path) -> None:
        self.partial, self.block, self.dspark = partial, block, dspark

    def worker(self, family: str) -> WorkerProtocol:
        if family == "frozen_kv_mtp":
            return self.partial.worker(family, agreeing=False)
        if family == "dspark":
            return default_registry().create(
                "dspark", target=self.block.target, assistant=self.dspark, check_commit_order=True
            )
        if family == "dflash":
            return self.block.worker(family, check_commit_order=True)
        if family == "uno_tree":
            return self.block.worker("uno", topk=2, num_draft_tokens=6)
        return self.block.worker(family)

    def hf(self, family: str) -> Any:
        return self.partial.hf if family == "frozen_kv_mtp" else self.block.hf

    def vocab_size(self, family: str) -> int:
        return self.partial.vocab_size if family == "frozen_kv_mtp" else self.block.vocab_size


@pytest.fixture(scope="module")
def families(
    partial_ckpt: SpecCheckpoints, block_ckpt: BlockCheckpoints, dspark_assistant: Path
) -> Families:
    return Families(partial_ckpt, block_ckpt, dspark_assistant)


def _requests(
    stops: list[int | None], *, sampled: bool
) -> list[list[tuple[str, list[int], SamplingParams]]]:
    out = []
    for i, (prompt, stop) in enumerate(zip(PROMPTS, stops, strict=True)):
        if sampled:
            params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=100 + i)
        else:
            params = SamplingParams(
                max_new_tokens=NEW_TOKENS, stop_token_ids=() if stop is None else (stop,)
            )
        out.append((f"r{i}", prompt, params))
    return [out[: len(WAVE1)], out[len(WAVE1) :]]


MATRIX = list(itertools.product(FAMILIES, [False, True], [1, 16]))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "overlap", "page_size"), MATRIX)
def test_greedy_through_prefill_and_decode_equals_hf_and_one_engine(
    families: Families, family: str, overlap: bool, page_size: int
) -> None:
    """Greedy requests, stops inside runs: HF's tokens, one engine's tokens and accept
    lengths, no prefill of either model on the decode side, partial acceptance there."""
    expected = [greedy(families.hf(family), p, NEW_TOKENS) for p in PROMPTS]
    stops, wants = with_stops(expected)
    waves = _requests(stops, sampled=False)
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size, "prefix_cache": True}
    vocab = families.vocab_size(family)
    run = run_pd(
        families.worker(family), families.worker(family), waves, vocab_size=vocab, **options
    )
    one, one_accepts = run_one(families.worker(family), waves, vocab_size=vocab, **options)
    assert [run.outputs[f"r{i}"] for i in range(len(PROMPTS))] == wants
    assert run.outputs == one
    assert run.accepts == one_accepts  # the draft state crossed whole: the same drafts
    assert run.handoffs == sum(len(w) > 1 for w in wants) > 0
    assert run.prefill_tokens_on_decode == 0
    assert run.drafter_prefill_tokens_on_decode == 0
    assert MIN_ACCEPT[family] < run.mean_accept < MAX_ACCEPT[family]
    if page_size == 1:
        assert run.decode_cached_tokens > 0  # wave 2 arrived onto cached prefixes


@pytest.mark.slow
@pytest.mark.parametrize(("family", "overlap", "page_size"), MATRIX)
def test_seeded_sampling_through_prefill_and_decode_equals_one_engine(
    families: Families, family: str, overlap: bool, page_size: int
) -> None:
    """Seeded sampled requests: one engine's tokens and accept lengths."""
    waves = _requests([None] * len(PROMPTS), sampled=True)
    options: dict[str, Any] = {"overlap": overlap, "page_size": page_size, "prefix_cache": True}
    vocab = families.vocab_size(family)
    run = run_pd(
        families.worker(family), families.worker(family), waves, vocab_size=vocab, **options
    )
    one, one_accepts = run_one(families.worker(family), waves, vocab_size=vocab, **options)
    assert run.outputs == one
    assert run.accepts == one_accepts
    assert run.prefill_tokens_on_decode == 0 and run.drafter_prefill_tokens_on_decode == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_decode_engine_holds_exactly_the_state_that_crossed(
    families: Families, family: str
) -> None:
    """After its import batch, every slot-kept buffer of the decode worker holds the record's
    values bit for bit at the request's new slots; read apart from the export too: the
    target's KV, and DFLASH's / DSpark's context KV, equal the prefill worker's at its slots.
    (The relayed draft state, Frozen-KV's seed state, is checked by the accept lengths of the
    tests above.)"""
    prefill_worker, decode_worker = families.worker(family), families.worker(family)
    vocab = families.vocab_size(family)
    with linked(prefill_worker, decode_worker, vocab_size=vocab, page_size=4) as link:
        link.prefill.submit_prefill("r", WAVE1[2], SamplingParams(max_new_tokens=5))
        run_checked(link.prefill)
        record = link.prefill.export_handoff("r")
        if family == "frozen_kv_mtp":  # its seed state: [hidden], the target's width
            assert record.draft_state.hidden_states is not None
        else:
            assert record.draft_state.tensors() == {}  # the bonus only
        if family in ("dflash", "dspark"):
            assert any(name.startswith("assistant.") for name in record.slot_state)
        parked = link.prefill.request("r")
        prefill_locs = link.prefill.allocator.req_to_token[
            link.prefill.allocator.slot_of(parked), : record.committed_len
        ]
        req = link.decode.admit_handoff(record)
        while req.num_outputs == 0:
            link.decode.step()
        slot = link.decode.allocator.slot_of(req)
        locs = link.decode.allocator.req_to_token[slot, : record.committed_len]
        held = handoff_worker(decode_worker).export_handoff(locs)
        assert list(held) == list(record.slot_state)
        for name, tensor in record.slot_state.items():
            assert torch.equal(held[name], tensor), name
        caches = {"target": (decode_worker.target_network, prefill_worker.target_network)}  # type: ignore[attr-defined]
        if family in ("dflash", "dspark"):
            caches["assistant"] = (decode_worker.assistant, prefill_worker.assistant)  # type: ignore[attr-defined]
        for owner, (ours_model, theirs_model) in caches.items():
            ours_cache, theirs_cache = ours_model.kv_cache, theirs_model.kv_cache
            for layer in range(ours_cache.num_layers):
                for ours, theirs in zip(
                    ours_cache.gather(layer, locs),
                    theirs_cache.gather(layer, prefill_locs),
                    strict=True,
                ):
                    assert torch.equal(ours, theirs), (owner, layer)
        link.prefill.release_handoff("r")
        run_checked(link.decode)
        assert tuple(req.output_ids[: len(record.output_ids)]) == record.output_ids


def test_a_different_drafter_is_refused(families: Families, block_ckpt: BlockCheckpoints) -> None:
    """DSpark's heads are part of its drafter: a DFLASH record (the same backbone, no heads)
    is refused by algorithm, and a UNO worker without its adapter by drafter digest."""
    with linked(
        families.worker("dflash"), families.worker("dspark"), vocab_size=97, page_size=4
    ) as link:
        link.prefill.submit_prefill("r", WAVE1[0], SamplingParams(max_new_tokens=4))
        run_checked(link.prefill)
        with pytest.raises(HandoffMismatch) as caught:
            link.decode.admit_handoff(link.prefill.export_handoff("r"))
        assert caught.value.field == "algorithm"
        # The same backbone (DSpark's is DFLASH's, copied): the heads alone tell them apart.
        dflash, dspark = (
            e.handoff_descriptor().drafter_digest for e in (link.prefill, link.decode)
        )
        assert dflash and dspark and dflash != dspark
        link.prefill.release_handoff("r", error="refused")
    plain = block_ckpt.worker("uno", adapter=None)
    with linked(families.worker("uno"), plain, vocab_size=97, page_size=4) as link:
        link.prefill.submit_prefill("r", WAVE1[0], SamplingParams(max_new_tokens=4))
        run_checked(link.prefill)
        with pytest.raises(HandoffMismatch) as caught:
            link.decode.admit_handoff(link.prefill.export_handoff("r"))
        assert caught.value.field == "drafter_digest"
        link.prefill.release_handoff("r", error="refused")


@pytest.mark.parametrize("overlap", [False, True])
def test_dspark_under_the_confidence_budget_through_prefill_and_decode(
    families: Families, overlap: bool
) -> None:
    """DSpark with `ConfidenceBudget` on both engines: a budget is planned from the settled
    rounds' confidences, which the decode engine sees from its first round on, as one engine
    does after a prefill. HF's tokens, one engine's tokens, accept and verified lengths."""
    requests = _requests([None] * len(PROMPTS), sampled=False)[0]
    limits = RequestLimits(vocab_size=97, max_context_len=64)
    config = checked_config(overlap=overlap, page_size=16, prefix_cache=True)

    def engine() -> Engine:
        return Engine(
            families.worker("dspark"),
            limits=limits,
            config=config,
            verify_budget=budget_policy("confidence"),
        )

    with engine() as prefill, engine() as decode:
        crossed = serve_disaggregated(
            HandoffLink(prefill, decode), requests, after_step=check_engine
        )
        got = {
            rid: (list(r.emitted_ids), r.accept_lengths, r.verified_lengths)
            for rid, r in crossed.items()
        }
    with engine() as one:
        reqs = [one.submit(*r) for r in requests]
        run_checked(one)
        want = {
            r.request_id: (list(r.emitted_ids), r.accept_lengths, r.verified_lengths) for r in reqs
        }
    assert got == want
    assert [got[rid][0] for rid, _, _ in requests] == [
        greedy(families.block.hf, p, NEW_TOKENS) for _, p, _ in requests
    ]
    width = 3  # a budget below the block's three drafts cut some round
    assert any(v < width for _, _, verified in got.values() for v in verified)
