"""The example adapter (examples/hf_transformers_adapter.py) is a correct, speculative worker.

A Hugging Face Llama checkpoint (tiny, random) is loaded through ``AutoModelForCausalLM`` and
wrapped by the example's `HFNgramWorker`. The adapter passes the shipped conformance kit with
HF ``generate()`` as the oracle; serves prompts through the engine with the invariant checker
after every step, in both loops, whole and chunked (mixed) prefill, page 1 and 16, with stop
tokens inside runs, under KV pressure (retraction) and with an abort, equal to ``generate()``
token for token; and really speculates: accept lengths strictly between 1 and D occur, and so
does D. The example's own ``main()`` runs too.

``examples/`` is not a package: the module is loaded from its path.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy, make_checkpoint
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from specstate import (
    Engine,
    EngineConfig,
    InvalidRequest,
    RequestLimits,
    SamplingParams,
    check_engine,
)
from specstate.testing.conformance import assert_worker_conforms

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_transformers_adapter.py"
NEW_TOKENS = 20
STEPS = 3  # K; D = 4
PROMPTS = [
    [62, 93, 3, 60, 5, 62, 93, 3, 60, 5],
    [70, 32, 4, 70, 32, 4],
    [75, 48, 75],
    [11, 12, 13, 14, 15, 16, 17, 18],
    [42],
]
"""Repetition makes n-gram drafts hit, fully or in part; one 1-token prompt. Each continuation
is clear of argmax near-ties (see `expected`), so the comparison tests the adapter, not rounding."""


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example file, imported by path."""
    spec = importlib.util.spec_from_file_location("hf_transformers_adapter", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved as a Hugging Face checkpoint."""
    directory = tmp_path_factory.mktemp("hf_adapter") / "tiny"
    make_checkpoint(directory, seed=0, layers=2)
    return directory


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> LlamaForCausalLM:
    """The checkpoint, loaded as any causal LM would be."""
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert isinstance(loaded, LlamaForCausalLM)
    loaded.train(False)
    return loaded


@pytest.fixture(scope="module")
def expected(model: LlamaForCausalLM) -> list[list[int]]:
    """transformers' greedy ``generate()`` of every prompt, checked to be free of near-ties.

    A recomputing worker and ``generate()`` (which caches KV) round differently; where the two
    best logits are within rounding of each other, argmax may differ without any bug.
    """
    outputs = [greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out]), use_cache=False).logits
        top2 = logits[0, len(prompt) - 1 :].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        assert margin > 1e-3, f"prompt {prompt} has an argmax near-tie ({margin}); pick another"
    return outputs


def _serve(
    example: ModuleType,
    model: LlamaForCausalLM,
    config: EngineConfig,
    stops: list[int | None],
    *,
    abort: str | None = None,
) -> tuple[list[list[int]], list[str], dict[int, int], tuple[str, ...]]:
    """Serve PROMPTS with the invariant checker after every step.

    Returns each request's tokens and finish reason, the accept-length histogram, and the
    requests retracted on the way. ``abort`` is aborted after the third step.
    """
    limits = RequestLimits(vocab_size=model.config.vocab_size, max_context_len=64)
    worker = example.HFNgramWorker(model, num_steps=STEPS)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(
                f"p{i}",
                prompt,
                SamplingParams(
                    max_new_tokens=NEW_TOKENS, stop_token_ids=() if stop is None else (stop,)
                ),
            )
            for i, (prompt, stop) in enumerate(zip(PROMPTS, stops, strict=True))
        ]
        retracted: list[str] = []
        if abort is not None:
            for _ in range(3):
                retracted.extend(engine.step().retracted)
                check_engine(engine)
            engine.abort(abort)
        log = run_checked(engine)
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    reasons = [r.finish.reason.value if r.finish is not None else "none" for r in reqs]
    outputs = [list(r.emitted_ids) for r in reqs]
    return outputs, reasons, dict(snap.metrics.histogram), (*retracted, *log.retracted)


def _checked(**options: object) -> EngineConfig:
    """An engine config with every check on: invariants, ownership, consume-once relay."""
    return EngineConfig(
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **options,  # type: ignore[arg-type]
    )


def test_the_adapter_conforms(example: ModuleType, model: LlamaForCausalLM) -> None:
    """The shipped kit, every configuration, HF generate() as the oracle."""
    assert_worker_conforms(
        lambda: example.HFNgramWorker(model, num_steps=STEPS),
        vocab_size=model.config.vocab_size,
        oracle=lambda prompt, n: greedy(model, prompt, n),
    )


@pytest.mark.parametrize(
    ("overlap", "page_size", "chunking"),
    list(itertools.product([False, True], [1, 16], [(None, False), (4, True)])),
)
def test_lossless_against_generate(
    example: ModuleType,
    model: LlamaForCausalLM,
    expected: list[list[int]],
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Equal to generate() token for token; every other request stops at a token mid-output."""
    stops = [out[9] if i % 2 == 0 else None for i, out in enumerate(expected)]
    wants = [
        out if s is None else out[: out.index(s) + 1]
        for out, s in zip(expected, stops, strict=True)
    ]
    config = _checked(
        overlap=overlap,
        page_size=page_size,
        kv_tokens=2048,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    outputs, reasons, _, _ = _serve(example, model, config, stops)
    assert outputs == wants
    assert reasons == ["length" if s is None else "stop" for s in stops]


@pytest.mark.parametrize("overlap", [False, True])
def test_lossless_under_retraction_and_abort(
    example: ModuleType, model: LlamaForCausalLM, expected: list[list[int]], overlap: bool
) -> None:
    """A pool too small for every request retracts some; one is aborted; the rest are exact."""
    config = _checked(overlap=overlap, page_size=4, kv_tokens=96)
    outputs, reasons, _, retracted = _serve(
        example, model, config, [None] * len(PROMPTS), abort="p1"
    )
    assert retracted, "the pool was meant to force retractions"
    assert reasons[1] == "abort"
    assert outputs[:1] + outputs[2:] == expected[:1] + expected[2:]
    assert outputs[1] == expected[1][: len(outputs[1])]


def test_the_adapter_really_speculates(
    example: ModuleType, model: LlamaForCausalLM, expected: list[list[int]]
) -> None:
    """Drafts hit in part and in full: accept lengths 2..K and D = K + 1 all occur."""
    config = _checked(overlap=True, kv_tokens=2048)
    outputs, _, histogram, _ = _serve(example, model, config, [None] * len(PROMPTS))
    assert outputs == expected
    assert set(histogram) <= set(range(1, STEPS + 2)), histogram
    assert all(histogram.get(a, 0) > 0 for a in range(2, STEPS + 2)), histogram


def test_a_sampled_request_is_refused(example: ModuleType, model: LlamaForCausalLM) -> None:
    """Greedy only: the capabilities say so, and the engine refuses temperature > 0."""
    worker = example.HFNgramWorker(model, num_steps=STEPS)
    assert worker.capabilities.supports_sampling is False
    limits = RequestLimits(vocab_size=model.config.vocab_size, max_context_len=64)
    with (
        Engine(worker, limits=limits, config=_checked(kv_tokens=256)) as engine,
        pytest.raises(InvalidRequest),
    ):
        engine.submit("s", [1, 2], SamplingParams(max_new_tokens=4, temperature=0.7))


def test_main_checks_itself_against_generate(
    example: ModuleType, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``main()`` on its own tiny model, and with ``--model DIR``: exit 0, lossless."""
    assert example.main(["--max-new-tokens", "12"]) == 0
    assert example.main(["--model", str(checkpoint), "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out.count("lossless: 4 prompts equal model.generate() in both loops") == 2


def test_bad_options_are_refused(example: ModuleType, model: LlamaForCausalLM) -> None:
    """num_steps and max_ngram below 1 are refused at construction."""
    with pytest.raises(ValueError, match="num_steps >= 1"):
        example.HFNgramWorker(model, num_steps=0)
    with pytest.raises(ValueError, match="max_ngram >= 1"):
        example.HFNgramWorker(model, max_ngram=0)


def test_the_walk_through_quotes_the_example_verbatim() -> None:
    """Every ``py-excerpt`` block of docs/example-adapter.md is a run of the example's lines."""
    doc = EXAMPLE.parents[1] / "docs" / "example-adapter.md"
    blocks = re.findall(r"```py-excerpt\n(.*?)```", doc.read_text(encoding="utf-8"), re.S)
    source = "\n".join(line.strip() for line in EXAMPLE.read_text(encoding="utf-8").splitlines())
    assert len(blocks) >= 10
    for block in blocks:
        quoted = "\n".join(line.strip() for line in block.strip("\n").splitlines())
        assert f"\n{quoted}\n" in f"\n{source}\n", f"not in the example:\n{block}"
