"""Bad user input is refused at `submit` with `InvalidRequest`, and the engine is unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch

from specstate import (
    Engine,
    EngineConfig,
    InvalidConfig,
    InvalidRequest,
    RequestLimits,
    SamplingParams,
)
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerCapabilities
from specstate.tools.timed_worker import TimedWaitWorker

LIMITS = RequestLimits(vocab_size=32, max_context_len=64, eos_token_ids={31})


def _engine() -> Engine:
    config = EngineConfig(overlap=False, kv_tokens=512, check_invariants=True)
    return Engine(TimedWaitWorker(device_seconds=0.0), limits=LIMITS, config=config)


BAD_PARAMS: dict[str, tuple[dict[str, Any], str]] = {
    "fractional max_new_tokens": ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
    "string max_new_tokens": ({"max_new_tokens": "5"}, "max_new_tokens must be an integer"),
    "bool max_new_tokens": ({"max_new_tokens": True}, "max_new_tokens must be an integer"),
    "fractional top_k": ({"top_k": 2.5}, "top_k must be an integer"),
    "infinite temperature": ({"temperature": float("inf")}, "temperature must be a finite"),
    "NaN top_p": ({"top_p": float("nan")}, "top_p must be a number in"),
    "string stop ids": ({"stop_token_ids": ["3"]}, "stop_token_ids must be integers"),
    "bool stop ids": ({"stop_token_ids": [True]}, "stop_token_ids must be integers"),
    "integer ignore_eos": ({"ignore_eos": 1}, "ignore_eos must be a bool"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs=2 needs logprobs=True"),
    "top_logprobs past the maximum": ({"top_logprobs": 21}, r"top_logprobs must be .* \[0, 20\]"),
    "negative top_logprobs": ({"top_logprobs": -1}, "top_logprobs must be an integer in"),
    "fractional top_logprobs": ({"top_logprobs": 1.5}, "top_logprobs must be an integer in"),
}


@pytest.mark.parametrize("case", list(BAD_PARAMS))
def test_bad_sampling_values_are_refused(case: str) -> None:
    """Wrong types and non-finite numbers in SamplingParams are refused, naming the field."""
    fields, message = BAD_PARAMS[case]
    with _engine() as engine:
        before = engine.snapshot()
        with pytest.raises(InvalidRequest, match=f"request 'r': .*{message}") as info:
            engine.submit("r", [1, 2, 3], SamplingParams(**fields))
        assert info.value.fields == tuple(fields)
        assert engine.snapshot() == before and engine.is_idle
        check_engine(engine)


def test_a_refusal_names_the_request_fields_at_fault() -> None:
    """`InvalidRequest.fields` names the fields of `Engine.submit` that a refusal is about, in
    the order of the message: the prompt, each bad sampling value, what the worker does not
    support, what does not fit the context or the pool, and an id that is bad or taken."""

    class _Plain(TimedWaitWorker):  # no penalties, no logprobs, greedy only
        @property
        def capabilities(self) -> WorkerCapabilities:
            return attrs.evolve(super().capabilities, supports_sampling=False)

    engine = Engine(
        _Plain(device_seconds=0.0),
        limits=RequestLimits(vocab_size=32, max_context_len=1024),
        config=EngineConfig(overlap=False, kv_tokens=256),
    )
    cases: list[tuple[list[int], SamplingParams, tuple[str, ...]]] = [
        ([], SamplingParams(), ("prompt_ids",)),
        (
            [1, 99],
            SamplingParams(top_p=0.0, min_new_tokens=-1),
            ("prompt_ids", "top_p", "min_new_tokens"),
        ),
        ([1], SamplingParams(max_new_tokens=4, min_new_tokens=5), ("min_new_tokens",)),
        ([1], SamplingParams(temperature=0.5), ("temperature",)),
        (
            [1],
            SamplingParams(presence_penalty=0.5, logprobs=True),
            ("presence_penalty", "logprobs"),
        ),
        (
            [1],
            SamplingParams(logprobs=True, top_logprobs=3),  # neither is declared
            ("logprobs", "top_logprobs"),
        ),
        ([1] * 1000, SamplingParams(max_new_tokens=25), ("max_new_tokens",)),  # the context
        ([1], SamplingParams(max_new_tokens=600), ("max_new_tokens",)),  # the pool
    ]
    with engine:
        for prompt, sampling, fields in cases:
            with pytest.raises(InvalidRequest) as info:
                engine.submit("r", prompt, sampling)
            assert info.value.fields == fields, info.value
        assert engine.is_idle
        engine.submit("live", [1], SamplingParams(max_new_tokens=2))
        for request_id in ("", 7, "live"):  # not a string, empty, or the id of a live request
            with pytest.raises(InvalidRequest) as info:
                engine.submit(request_id, [1], SamplingParams())  # type: ignore[arg-type]
            assert info.value.fields == ("request_id",), info.value


def test_top_logprobs_past_the_vocabulary_are_refused() -> None:
    """``top_logprobs`` is at most the vocabulary size too (a vocabulary under 20 tokens)."""
    tiny = RequestLimits(vocab_size=8, max_context_len=64)
    assert SamplingParams(logprobs=True, top_logprobs=8).problems(tiny.vocab_size) == []
    problems = SamplingParams(logprobs=True, top_logprobs=9).problems(tiny.vocab_size)
    assert problems == [
        "top_logprobs must be an integer in [0, 8] (at most 20 and the vocabulary size 8), got 9"
    ]


def test_a_string_of_stop_ids_is_not_a_collection() -> None:
    """stop_token_ids="32" is refused instead of being read as the ids 3 and 2."""
    with pytest.raises(InvalidRequest, match="stop_token_ids must be a collection"):
        SamplingParams(stop_token_ids="32")  # type: ignore[arg-type]


BAD_PROMPTS: dict[str, tuple[Any, str]] = {
    "a string of digits": ("104105", "prompt must be a sequence of token ids, got str"),
    "strings": (["5", "6"], "2 prompt entries are not integer token ids, first at 0: str"),
    "bools": ([True, False], "not integer token ids, first at 0: bool"),
    "floats": ([1.0, 2.5], "not integer token ids, first at 0: float"),
    "a float tensor": (torch.tensor([1.0, 2.0]), "1-D integer tensor or array, got torch.float32"),
    "a 2-D array": (np.ones((2, 2), dtype=np.int64), "1-D integer tensor or array"),
    "a number": (7, "prompt must be a sequence of token ids, got int"),
}


@pytest.mark.parametrize("case", list(BAD_PROMPTS))
def test_bad_prompts_are_refused(case: str) -> None:
    """A prompt must be integer token ids; strings, bools and floats are refused."""
    prompt, message = BAD_PROMPTS[case]
    with _engine() as engine:
        with pytest.raises(InvalidRequest, match=message):
            engine.submit("r", prompt, SamplingParams())
        assert engine.is_idle
        check_engine(engine)


def test_integer_tensors_and_arrays_are_prompts() -> None:
    """1-D integer tensors, arrays and ranges are read as the same prompt."""
    with _engine() as engine:
        prompts: list[Any] = [torch.tensor([1, 2, 3]), np.array([1, 2, 3]), range(1, 4)]
        for i, prompt in enumerate(prompts):
            req = engine.submit(f"r{i}", prompt, SamplingParams(max_new_tokens=2))
            assert req.prompt_ids == (1, 2, 3)


@pytest.mark.parametrize("request_id", [None, 7, "", ["a"]])
def test_a_request_id_must_be_a_non_empty_string(request_id: Any) -> None:
    """Non-string or empty ids (even unhashable ones) are refused with InvalidRequest."""
    with (
        _engine() as engine,
        pytest.raises(InvalidRequest, match="request id must be a non-empty string"),
    ):
        engine.submit(request_id, [1, 2], SamplingParams())


BAD_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "negative chunk": ({"chunked_prefill": -1}, "chunked_prefill must be None or an integer"),
    "zero prefill budget": ({"max_prefill_tokens": 0}, "max_prefill_tokens must be an integer"),
    "fractional page": ({"page_size": 2.5}, "page_size must be an integer >= 1, got 2.5"),
    "unknown device": ({"device": "nonsense"}, "device 'nonsense' is not a torch device"),
    "integer flag": ({"overlap": 1}, "overlap must be a bool, got 1"),
    "pool under two pages": ({"page_size": 16, "kv_tokens": 20}, r"kv_tokens must be .* \(32\)"),
    "zero timeout": ({"forward_timeout_s": 0}, "forward_timeout_s must be None or a finite"),
    "NaN timeout": ({"forward_timeout_s": float("nan")}, "forward_timeout_s must be None or a"),
    "bool timeout": ({"forward_timeout_s": True}, "forward_timeout_s must be None or a finite"),
    "text timeout": ({"forward_timeout_s": "5"}, "forward_timeout_s must be None or a finite"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_bad_engine_configs_are_refused(case: str) -> None:
    """EngineConfig refuses wrong types and sizes with InvalidConfig naming the field."""
    fields, message = BAD_CONFIGS[case]
    with pytest.raises(InvalidConfig, match=f"EngineConfig: .*{message}"):
        EngineConfig(**fields)


def test_generate_reports_a_bad_config_instead_of_looping(tmp_path: Path) -> None:
    """`specstate generate --chunked-prefill -1` exits 2 with one line, at once."""
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"id": "a", "input_ids": [1, 2], "max_new_tokens": 2}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "specstate.tools.cli", "generate", "--model", str(tmp_path),
         "--input", str(prompts), "--output", str(tmp_path / "out.jsonl"),
         "--chunked-prefill", "-1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "chunked_prefill must be None or an integer >= 1, got -1" in proc.stderr


def test_a_worker_that_does_not_declare_sampling_is_greedy_only() -> None:
    """supports_sampling is False unless declared (a forgotten flag cannot silently decode
    sampled requests greedily); the refusal names the flag."""
    assert WorkerCapabilities(algorithm="mine").supports_sampling is False

    class _Undeclared(TimedWaitWorker):
        @property
        def capabilities(self) -> WorkerCapabilities:
            return WorkerCapabilities.chain("mine", num_steps=3, keeps_draft_kv=True)

    engine = Engine(
        _Undeclared(device_seconds=0.0),
        limits=RequestLimits(vocab_size=32, max_context_len=64),
        config=EngineConfig(overlap=False, kv_tokens=256),
    )
    with pytest.raises(InvalidRequest, match="'mine' is greedy-only .*declare supports_sampling"):
        engine.submit("s", [1, 2], SamplingParams(temperature=0.7))
    engine.close()


def test_a_greedy_only_worker_refuses_sampled_requests_at_submit() -> None:
    """supports_sampling=False: temperature > 0 is refused at submit, not at the forward."""

    class _GreedyOnly(TimedWaitWorker):
        @property
        def capabilities(self) -> WorkerCapabilities:
            return attrs.evolve(super().capabilities, supports_sampling=False)

    engine = Engine(
        _GreedyOnly(device_seconds=0.0),
        limits=RequestLimits(vocab_size=32, max_context_len=64),
        config=EngineConfig(overlap=False, kv_tokens=256, check_invariants=True),
    )
    with pytest.raises(InvalidRequest, match="is greedy-only"):
        engine.submit("s", [1, 2], SamplingParams(temperature=0.7))
    assert engine.is_idle
    engine.submit("g", [1, 2], SamplingParams(max_new_tokens=3))
    engine.run_until_idle()
    engine.close()
