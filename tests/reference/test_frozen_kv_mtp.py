"""``frozen_kv_mtp``: drafts equal an unpaged recomputation from the committed KV; lossless.

The reference model cannot serve a Gemma 4 target, so the oracle of the drafts is a plain
recomputation (`frozen_oracle.dense_frozen_drafts`): transformers' Llama over the committed
tokens gives the KV and the normed hidden state, and the assistant's steps are written out.
Every round's drafts equal it, whatever the loop, page size, chunking or prefix cache; the
worker reserves only the target's window and owns no KV; it is lossless everywhere.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import (
    checked_config,
    run_checked,
    serve_to_completion,
    serve_under_pressure,
    with_stops,
)
from frozen_oracle import dense_frozen_drafts
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, family_options

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.engine import Engine
from specstate.reference.workers import default_registry
from specstate.reference.workers.frozen_kv_mtp import FrozenKvMtpWorker
from specstate.reference.workers.verify import DraftChain

NEW_TOKENS = 14
STEPS = 3


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """The shared one-layer target."""
    return partial_ckpt


@pytest.fixture(scope="module")
def assistant(ckpt: SpecCheckpoints) -> Path:
    """The assistant derived from the target."""
    path = family_options(ckpt.target, "frozen_kv_mtp")["assistant"]
    assert isinstance(path, Path)
    return path


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """HF's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]


class RecordingFrozen(FrozenKvMtpWorker):
    """The worker, recording every round's frontier and drafts by request."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.rounds: list[tuple[str, int, list[int]]] = []

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        chain = super()._propose(batch, start, roots)
        for rid, s, row in zip(
            batch.request_ids, start.tolist(), chain.tokens.tolist(), strict=True
        ):
            self.rounds.append((rid, s, row))
        return chain


def serve(
    ckpt: SpecCheckpoints, assistant: Path, prompts: Sequence[Sequence[int]], **options: Any
) -> tuple[RecordingFrozen, dict[str, list[int]], float]:
    """Serve ``prompts`` with a recording worker, every check on."""
    worker = RecordingFrozen(target=ckpt.target, assistant=assistant, num_steps=STEPS)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=checked_config(**options)) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        run_checked(engine)
        accept = engine.snapshot().metrics.mean_accept_length
    pairs = enumerate(zip(prompts, reqs, strict=True))
    sequences = {f"p{i}": [*p, *r.emitted_ids] for i, (p, r) in pairs}
    return worker, sequences, accept


CONFIGS = [
    pytest.param({"overlap": False, "page_size": 1}, id="normal-page1"),
    pytest.param(
        {"overlap": True, "page_size": 16, "chunked_prefill": 4, "mixed_chunk": True},
        id="overlap-page16-chunked-mixed",
    ),
    pytest.param({"overlap": True, "page_size": 4, "prefix_cache": True}, id="overlap-prefix"),
]


@pytest.mark.parametrize("options", CONFIGS)
def test_drafts_equal_an_unpaged_recomputation_from_the_committed_kv(
    ckpt: SpecCheckpoints, assistant: Path, options: dict[str, object]
) -> None:
    """Every round's drafts equal the assistant recomputed from transformers' KV and state."""
    prompts = [*MIXED_PROMPTS, (*MIXED_PROMPTS[2][:10], 4, 4)]
    worker, sequences, accept = serve(ckpt, assistant, prompts, **options)
    checked = 0
    for rid, start, drafts in worker.rounds:
        if start >= len(sequences[rid]):
            continue  # the round in flight past the end (overlap)
        want = dense_frozen_drafts(assistant, ckpt.hf, sequences[rid][: start + 1], STEPS)
        assert drafts == want, (rid, start)
        checked += 1
    assert checked >= 20
    assert 1.0 < accept < STEPS + 1


def test_it_owns_no_kv_and_reserves_the_targets_window_only(
    ckpt: SpecCheckpoints, assistant: Path
) -> None:
    """No draft KV declared or held; the reservation is the verify's, at every page size."""
    worker = default_registry().create("frozen_kv_mtp", target=ckpt.target, assistant=assistant)
    caps = worker.capabilities
    assert not caps.keeps_draft_kv and caps.num_draft_tokens == STEPS + 1
    for page in (1, 4, 16):
        assert caps.spec_window(page).alloc_len_per_decode == STEPS + 1
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=checked_config()):
        assert isinstance(worker, FrozenKvMtpWorker)
        assert list(worker.kv_caches()) == ["target"]


MATRIX = list(itertools.product([False, True], [1, 16], [(None, False), (4, True)]))


@pytest.mark.slow
@pytest.mark.parametrize(("overlap", "page_size", "chunking"), MATRIX)
def test_frozen_kv_mtp_is_lossless(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate, stops inside accepted runs included."""
    stops, wants = with_stops(expected)
    config = checked_config(
        overlap=overlap, page_size=page_size, chunked_prefill=chunking[0], mixed_chunk=chunking[1]
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(ckpt.worker("frozen_kv_mtp"), limits=limits, config=config) as engine:
        reqs = serve_to_completion(engine, MIXED_PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
    assert [list(r.emitted_ids) for r in reqs] == wants


@pytest.mark.parametrize("overlap", [False, True])
def test_frozen_kv_mtp_is_lossless_under_retraction(
    ckpt: SpecCheckpoints, expected: list[list[int]], overlap: bool
) -> None:
    """A KV pool too small for every request forces retractions; outputs stay HF's."""
    outs, log, _ = serve_under_pressure(
        ckpt.worker("frozen_kv_mtp"),
        MIXED_PROMPTS,
        vocab_size=ckpt.vocab_size,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=4,
        kv_tokens=64,
    )
    assert outs == expected
    assert log.retracted


def test_an_assistant_that_does_not_fit_is_refused(
    ckpt: SpecCheckpoints, assistant: Path, tmp_path: Path
) -> None:
    """Another KV geometry or a KV layer the target lacks: refused when the worker is made."""
    for field, value, match in (
        ("head_dim", 16, r"head_dim 16 differs from the target's 8"),
        ("kv_layer", 3, r"reads the KV of target layer 3; the target has 1 layers"),
    ):
        bad = tmp_path / field
        shutil.copytree(assistant, bad)
        raw = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**raw, field: value}))
        with pytest.raises(InvalidConfig, match=match):
            default_registry().create("frozen_kv_mtp", target=ckpt.target, assistant=bad)
