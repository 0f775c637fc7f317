"""``mtp`` on a hybrid target: a NemotronH (Mamba2 + attention) that ships MTP layers.

transformers' ``generate`` refuses assisted generation for NemotronH, so each decode round's
drafts and accept length are compared with a plain, unpaged recomputation that follows
``MtpLayer``'s wiring with transformers' own modules (`hybrid_mtp_oracle`), with one MTP layer
and with two (step ``i`` on layer ``i``; past ``L`` the last layer reused). Greedy outputs equal
transformers' greedy ``generate()`` of the target token for token: both loops, page sizes 1 and
16, whole and chunked prefill with mixed chunks, the prefix cache asked for (a worker with
recurrent state gets none), and retraction forced by a small KV pool; seeded sampled requests
emit the same tokens as without speculation. Every step runs the
invariant checker (the recurrent-state invariants included), ownership checks and the
consume-once relay, and the conformance kit passes. The Mamba2 layers steer the output, so a
recurrent state committed past the accepted run shows up as a wrong token.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from engine_driver import (
    checked_config,
    run_checked,
    serve_to_completion,
    serve_under_pressure,
    with_stops,
)
from hf_oracle import greedy
from hybrid_mtp_oracle import HybridMtpCheckpoints, make_hybrid_mtp_checkpoints
from hybrid_oracle import HYBRID_PROMPTS
from mtp_oracle import RecordingMtp

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.reference.workers import default_registry
from specstate.testing.conformance import check_worker
from specstate.tools.cli import main

VOCAB = 32
"""A vocabulary small enough that the derived MTP layers' drafts are accepted now and then."""

PROMPTS = [[t % VOCAB for t in prompt] for prompt in HYBRID_PROMPTS]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> HybridMtpCheckpoints:
    """NemotronH targets with one MTP layer and with two."""
    return make_hybrid_mtp_checkpoints(tmp_path_factory.mktemp("hybrid_mtp"), vocab_size=VOCAB)


@pytest.fixture(scope="module")
def expected(ckpt: HybridMtpCheckpoints) -> dict[int, list[list[int]]]:
    """transformers' greedy continuations of each target (no MTP), by MTP layer count."""
    return {layers: [greedy(ckpt.hf(layers), p, NEW_TOKENS) for p in PROMPTS] for layers in (1, 2)}


def _serve(
    ckpt: HybridMtpCheckpoints, layers: int, prompts: Sequence[Sequence[int]], **options: Any
) -> tuple[RecordingMtp, list[list[int]], float]:
    """Serve ``prompts`` greedily with a recording ``mtp`` worker, every check on; the worker,
    the outputs and the mean accept length."""
    stops = options.pop("stops", [None] * len(prompts))
    worker = RecordingMtp(target=ckpt.target(layers), num_steps=options.pop("num_steps", None))
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=checked_config(**options)) as engine:
        reqs = serve_to_completion(engine, prompts, max_new_tokens=NEW_TOKENS, stops=stops)
        snapshot = engine.snapshot()
    assert snapshot.prefix_cache is None  # a target with recurrent state shares no prefixes
    return worker, [list(r.emitted_ids) for r in reqs], snapshot.metrics.mean_accept_length


def _accept(drafts: Sequence[int], following: Sequence[int]) -> int:
    """The accept length of ``drafts`` against the tokens that follow the bonus."""
    run = 0
    for draft, token in zip(drafts, following, strict=False):
        if draft != token:
            break
        run += 1
    return run + 1


ROUND_CONFIGS = [
    pytest.param({"overlap": False, "page_size": 1}, id="normal-page1"),
    pytest.param(
        {"overlap": True, "page_size": 16, "chunked_prefill": 4, "mixed_chunk": True},
        id="overlap-page16-mixed",
    ),
]


@pytest.mark.parametrize(("layers", "num_steps"), [(1, 1), (1, 3), (2, 2), (2, 3)])
@pytest.mark.parametrize("options", ROUND_CONFIGS)
def test_drafts_and_accepts_equal_an_unpaged_recomputation(
    ckpt: HybridMtpCheckpoints,
    expected: dict[int, list[list[int]]],
    layers: int,
    num_steps: int,
    options: dict[str, object],
) -> None:
    """Round by round, the drafts equal the unpaged recomputation at the round's frontier and
    the accept length is the recomputed drafts' run against transformers' greedy tokens."""
    worker, outputs, _ = _serve(ckpt, layers, PROMPTS, num_steps=num_steps, **options)
    assert outputs == expected[layers]
    accepts = []
    for i, prompt in enumerate(PROMPTS):
        sequence = list(prompt) + outputs[i]
        for r in worker.rounds[f"p{i}"]:
            if r.start + num_steps >= len(sequence):
                break  # a round the length limit cuts (or, under overlap, one past the end)
            drafts = ckpt.drafts(layers, sequence[: r.start + 1], num_steps)
            assert r.drafts == drafts, (i, r.start)
            assert r.accept == _accept(drafts, sequence[r.start + 1 :]), (i, r.start)
            accepts.append(r.accept)
    assert 1 < sum(accepts) / len(accepts) < num_steps + 1  # real, partial acceptance
    if num_steps == layers:  # every layer's draft accepted in some round
        assert max(accepts) == num_steps + 1


MATRIX = list(itertools.product([1, 2], [False, True], [1, 16], [(None, False), (4, True)]))


@pytest.mark.parametrize(("layers", "overlap", "page_size", "chunking"), MATRIX)
def test_hybrid_mtp_lossless_matrix(
    ckpt: HybridMtpCheckpoints,
    expected: dict[int, list[list[int]]],
    layers: int,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate token for token (stops inside accepted runs included),
    with the prefix cache asked for; acceptance is real."""
    stops, wants = with_stops(expected[layers])
    _, outputs, accept = _serve(
        ckpt,
        layers,
        PROMPTS,
        stops=stops,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
        prefix_cache=True,
    )
    assert outputs == wants
    assert 1.0 < accept < layers + 1


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_hybrid_mtp_lossless_under_retraction(
    ckpt: HybridMtpCheckpoints, expected: dict[int, list[list[int]]], layers: int, overlap: bool
) -> None:
    """A KV pool too small for every request forces retractions (a retracted request's state
    rows are rebuilt by its re-prefill); outputs stay HF's."""
    outs, log, _ = serve_under_pressure(
        ckpt.worker(layers=layers),
        PROMPTS,
        vocab_size=ckpt.vocab_size,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=4,
        kv_tokens=64,
    )
    assert outs == expected[layers]
    assert log.retracted


def test_generate_cli_serves_a_hybrid_mtp_checkpoint(
    ckpt: HybridMtpCheckpoints,
    expected: dict[int, list[list[int]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``specstate generate --algorithm mtp`` on the saved NemotronH + MTP checkpoint emits HF's
    greedy tokens, with drafts accepted; its memory plan sizes the MTP layers' KV and the
    target's state rows (``--kv-memory``)."""
    lines = [
        {"id": f"p{i}", "input_ids": p, "max_new_tokens": NEW_TOKENS} for i, p in enumerate(PROMPTS)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["generate", "--model", str(ckpt.multi), "--algorithm", "mtp", "--check-invariants",
            "--kv-memory", "2MiB",
            "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl")]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in rows] == expected[2]
    assert any(a > 1 for r in rows for a in r["accept_lengths"])
    err = capsys.readouterr().err
    assert "mtp 2x2x2x8x4 B" in err and "of recurrent state" in err  # 2 MTP caches, 2 KV heads


@pytest.mark.parametrize("overlap", [False, True])
def test_seeded_sampling_is_independent_of_the_drafts(
    ckpt: HybridMtpCheckpoints, overlap: bool
) -> None:
    """Seeded sampled requests emit the same tokens with MTP drafts as without speculation: the
    state committed after a sampled verify is the one of its accepted run."""
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.9, seed=7 + i)
        for i in range(len(PROMPTS))
    ]
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    outputs, accepts = {}, {}
    workers = {"none": default_registry().create("none", target=ckpt.multi), "mtp": ckpt.worker()}
    for algorithm, worker in workers.items():
        with Engine(worker, limits=limits, config=checked_config(overlap=overlap)) as engine:
            reqs = [engine.submit(f"s{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
            run_checked(engine)
        outputs[algorithm] = [list(r.emitted_ids) for r in reqs]
        accepts[algorithm] = [a for r in reqs for a in r.accept_lengths]
    assert outputs["mtp"] == outputs["none"]
    assert 1 < sum(accepts["mtp"]) / len(accepts["mtp"]) < 3


def test_the_conformance_kit_passes(ckpt: HybridMtpCheckpoints) -> None:
    """Every configuration the worker's capabilities allow and every recurrent-state scenario
    (zero-draft rounds, staggered rows, retraction) of `check_worker`, tokens equal to HF's."""
    report = check_worker(
        lambda: ckpt.worker(layers=2),
        vocab_size=ckpt.vocab_size,
        prompts=PROMPTS,
        oracle=lambda prompt, n: greedy(ckpt.hf(2), prompt, n),
    )
    assert report.ok, str(report)
    assert any("staggered rows" in c for c in report.configs)
