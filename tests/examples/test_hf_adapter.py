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

import itertools
from pathlib import Path
from types import ModuleType

import pytest
from engine_driver import checked_config
from example_harness import (
    PROMPTS,
    STEPS,
    Served,
    assert_quotes_verbatim,
    clear_greedy,
    load_example,
    serve,
    stops_mid_output,
)
from hf_oracle import greedy, make_checkpoint
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from specstate import (
    Engine,
    EngineConfig,
    InvalidRequest,
    RequestLimits,
    SamplingParams,
)
from specstate.testing.conformance import assert_worker_conforms


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example file, imported by path."""
    return load_example("hf_transformers_adapter")


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
    """transformers' greedy ``generate()`` of every prompt, clear of near-ties (a recomputing
    worker and ``generate()``, which caches KV, round differently)."""
    return clear_greedy(model)


def _serve(
    example: ModuleType,
    model: LlamaForCausalLM,
    config: EngineConfig,
    stops: list[int | None],
    *,
    abort: str | None = None,
) -> Served:
    """Serve PROMPTS on the example's worker (`example_harness.serve`)."""
    worker = example.HFNgramWorker(model, num_steps=STEPS)
    return serve(worker, model.config.vocab_size, config, stops, abort=abort)


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
    stops, wants = stops_mid_output(expected)
    config = checked_config(
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
    config = checked_config(overlap=overlap, page_size=4, kv_tokens=96)
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
    config = checked_config(overlap=True, kv_tokens=2048)
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
        Engine(worker, limits=limits, config=checked_config(kv_tokens=256)) as engine,
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
    assert_quotes_verbatim("hf_transformers_adapter", "example-adapter.md", at_least=10)
