"""The KV-caching example (examples/hf_kv_cache_adapter.py) is a correct, speculative worker.

A tiny random GPT-2 checkpoint (a non-Llama architecture: learned positions, LayerNorm, fused
QKV) is saved by the test, loaded through ``AutoModelForCausalLM`` and wrapped by the example's
`GPT2SlotWorker`, whose KV lives in the engine's token slots. It passes the conformance kit with
HF ``generate()`` as the oracle; equals ``generate()`` token for token in both loops, page 1 and
16, whole and chunked (mixed) prefill, with stops inside runs, under retraction and with an
abort; really speculates; keeps exactly the KV the planning formula predicts, one row per engine
slot; and feeds the model only the new tokens of a forward (the rest comes from the cache).

``examples/`` is not a package: the module is loaded from its path.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import ModuleType

import pytest
import torch
from engine_driver import checked_config
from example_harness import (
    NEW_TOKENS,
    PROMPTS,
    STEPS,
    Served,
    assert_quotes_verbatim,
    clear_greedy,
    load_example,
    serve,
    stops_mid_output,
)
from hf_oracle import greedy
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from specstate import (
    Engine,
    EngineConfig,
    InvalidRequest,
    KvLayout,
    RequestLimits,
    SamplingParams,
    kv_bytes_for_tokens,
)
from specstate.testing.conformance import assert_worker_conforms


@pytest.fixture(scope="module")
def example() -> ModuleType:
    """The example file, imported by path."""
    return load_example("hf_kv_cache_adapter")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2 saved as a Hugging Face checkpoint."""
    directory = tmp_path_factory.mktemp("kv_adapter") / "gpt2"
    torch.manual_seed(1)
    config = GPT2Config(
        vocab_size=97,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(checkpoint: Path) -> GPT2LMHeadModel:
    """The checkpoint, loaded as any causal LM would be."""
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert isinstance(loaded, GPT2LMHeadModel)
    loaded.train(False)
    return loaded


@pytest.fixture(scope="module")
def expected(model: GPT2LMHeadModel) -> list[list[int]]:
    """transformers' greedy ``generate()`` of every prompt, clear of near-ties (the adapter's
    attention and HF's round differently)."""
    return clear_greedy(model)


def _serve(
    example: ModuleType,
    model: GPT2LMHeadModel,
    config: EngineConfig,
    stops: list[int | None],
    *,
    abort: str | None = None,
) -> Served:
    """Serve PROMPTS on the example's worker (`example_harness.serve`)."""
    worker = example.GPT2SlotWorker(model, num_steps=STEPS)
    return serve(worker, model.config.vocab_size, config, stops, abort=abort)


def test_the_adapter_conforms(example: ModuleType, model: GPT2LMHeadModel) -> None:
    """The shipped kit, every configuration, HF generate() as the oracle."""
    assert_worker_conforms(
        lambda: example.GPT2SlotWorker(model, num_steps=STEPS),
        vocab_size=model.config.vocab_size,
        oracle=lambda prompt, n: greedy(model, prompt, n),
    )


@pytest.mark.parametrize(
    ("overlap", "page_size", "chunking"),
    list(itertools.product([False, True], [1, 16], [(None, False), (4, True)])),
)
def test_lossless_against_generate(
    example: ModuleType,
    model: GPT2LMHeadModel,
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
    example: ModuleType, model: GPT2LMHeadModel, expected: list[list[int]], overlap: bool
) -> None:
    """A pool too small for every request retracts some (their KV is recomputed into new
    slots); one is aborted; the rest are exact."""
    config = checked_config(overlap=overlap, page_size=4, kv_tokens=96)
    outputs, reasons, _, retracted = _serve(
        example, model, config, [None] * len(PROMPTS), abort="p1"
    )
    assert retracted, "the pool was meant to force retractions"
    assert reasons[1] == "abort"
    assert outputs[:1] + outputs[2:] == expected[:1] + expected[2:]
    assert outputs[1] == expected[1][: len(outputs[1])]


def test_the_adapter_really_speculates(
    example: ModuleType, model: GPT2LMHeadModel, expected: list[list[int]]
) -> None:
    """Drafts hit in part and in full: accept lengths 2..K and D = K + 1 all occur."""
    outputs, _, histogram, _ = _serve(
        example, model, checked_config(overlap=True, kv_tokens=2048), [None] * len(PROMPTS)
    )
    assert outputs == expected
    assert set(histogram) <= set(range(1, STEPS + 2)), histogram
    assert all(histogram.get(a, 0) > 0 for a in range(2, STEPS + 2)), histogram


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_kv_lives_in_the_engine_slots(
    example: ModuleType, model: GPT2LMHeadModel, checkpoint: Path, page_size: int
) -> None:
    """One K and one V row per engine token slot, per layer: the bytes the planning formula
    gives for the checkpoint's config.json."""
    kv_tokens = 1000
    worker = example.GPT2SlotWorker(model, num_steps=STEPS)
    config = EngineConfig(kv_tokens=kv_tokens, page_size=page_size)
    limits = RequestLimits(vocab_size=model.config.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=config):
        buffers = [*worker.cache.keys, *worker.cache.values]
    slots = kv_tokens // page_size * page_size
    assert len(buffers) == 2 * model.config.n_layer
    assert all(b.shape[0] == slots for b in buffers)
    allocated = sum(b.numel() * b.element_size() for b in buffers)
    layout = KvLayout.from_config(checkpoint)
    assert allocated == kv_bytes_for_tokens(kv_tokens, [layout], page_size=page_size)


def test_a_forward_feeds_the_model_only_its_new_tokens(
    example: ModuleType, model: GPT2LMHeadModel, expected: list[list[int]]
) -> None:
    """The prefill embeds the prompt once; every decode round embeds D tokens a row, never the
    sequence so far: everything before comes from the cache (and the tokens stay exact)."""
    fed: list[int] = []
    hook = model.transformer.wte.register_forward_hook(lambda m, i, o: fed.append(i[0].numel()))
    try:
        worker = example.GPT2SlotWorker(model, num_steps=STEPS)
        limits = RequestLimits(vocab_size=model.config.vocab_size, max_context_len=64)
        with Engine(
            worker, limits=limits, config=checked_config(overlap=False, kv_tokens=512)
        ) as e:
            req = e.submit("a", PROMPTS[0], SamplingParams(max_new_tokens=NEW_TOKENS))
            e.run_until_idle()
    finally:
        hook.remove()
    assert list(req.emitted_ids) == expected[0]
    assert fed[0] == len(PROMPTS[0]) and set(fed[1:]) == {STEPS + 1}
    assert len(fed) - 1 == len(req.accept_lengths)


def test_a_sampled_request_is_refused(example: ModuleType, model: GPT2LMHeadModel) -> None:
    """Greedy only: the worker does not declare sampling, and the engine refuses it."""
    worker = example.GPT2SlotWorker(model, num_steps=STEPS)
    assert worker.capabilities.supports_sampling is False
    limits = RequestLimits(vocab_size=model.config.vocab_size, max_context_len=64)
    with (
        Engine(worker, limits=limits, config=checked_config(kv_tokens=256)) as engine,
        pytest.raises(InvalidRequest, match="greedy-only"),
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


def test_the_walk_through_quotes_the_example_verbatim() -> None:
    """Every ``py-excerpt`` block of docs/example-kv-adapter.md is a run of the example's lines."""
    assert_quotes_verbatim("hf_kv_cache_adapter", "example-kv-adapter.md", at_least=6)
