"""The sampling controls' contract: validation, capabilities, per-row state and result checks.

* every new `SamplingParams` field is validated with a message naming the value, and
  `Engine.submit` raises `InvalidRequest` naming the request, changing nothing;
* a worker that does not declare a control gets no request that needs it (refused at submit);
* `SamplingInfo` builds a per-row tensor only when some row needs it, and keeps rows aligned
  through ``select`` and ``concat`` (neutral values fill rows that had none);
* `apply_logit_controls` agrees with a per-row loop written from the definitions, and
  `seeded_uniforms` is a pure, uniform function of its key;
* the result checks refuse bad logprobs and a non-speculative row that accepted more than one
  token; the packed device-to-host copy carries logprobs exactly.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specstate import (
    Engine,
    EngineConfig,
    InvalidRequest,
    RequestLimits,
    SamplingParams,
    WorkerResultError,
)
from specstate.batch.result import GenerationBatchResult
from specstate.batch.sampling import SamplingInfo, apply_logit_controls, seeded_uniforms
from specstate.engine.launch.result_check import check_form, check_sampling_rows, check_values
from specstate.engine.launch.result_copy import HostResult, ResultCopy
from specstate.reference import embedded
from specstate.reference.workers import default_registry
from specstate.relay.future_map import RelayPayload
from specstate.tools.timed_worker import TimedWaitWorker

VOCAB = 32
CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"speculative": 1}, "speculative must be a bool, got 1"),
        ({"logprobs": "yes"}, "logprobs must be a bool, got 'yes'"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0, got 0.0"),
        ({"repetition_penalty": math.nan}, "repetition_penalty must be a finite number > 0"),
        ({"frequency_penalty": math.inf}, "frequency_penalty must be a finite number, got inf"),
        ({"presence_penalty": True}, "presence_penalty must be a finite number, got True"),
        ({"min_new_tokens": -1}, "min_new_tokens must be an integer >= 0, got -1"),
        ({"min_new_tokens": 2.5}, "min_new_tokens must be an integer >= 0, got 2.5"),
        ({"min_new_tokens": 9, "max_new_tokens": 8}, "min_new_tokens 9 exceeds max_new_tokens 8"),
        ({"stop_sequences": [[]]}, "stop_sequences[0] is empty"),
        ({"stop_sequences": [5]}, "stop_sequences[0] must be a sequence of token ids, got int 5"),
        ({"stop_sequences": [[1], [1, 99]]}, "stop_sequences[1] (1, 99) has ids outside"),
        ({"stop_sequences": [["a"]]}, "stop_sequences[0] must hold integer token ids"),
        ({"seed": -1}, "seed must be None or an integer in [0, 2**63), got -1"),
        ({"seed": 2**63}, "seed must be None or an integer in [0, 2**63)"),
        ({"seed": 1.0}, "seed must be None or an integer in [0, 2**63), got 1.0"),
    ],
)
def test_every_field_is_validated_at_submit(params: dict[str, object], message: str) -> None:
    """`problems` names the field and value; submit raises naming the request; nothing changes."""
    sampling = SamplingParams(**params)  # type: ignore[arg-type]
    assert any(message in p for p in sampling.problems(VOCAB)), sampling.problems(VOCAB)
    worker = TimedWaitWorker(device_seconds=0.0)
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=64)
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=256)) as engine:
        with pytest.raises(InvalidRequest, match="request 'bad': ") as caught:
            engine.submit("bad", [1, 2], sampling)
        assert message in str(caught.value)
        assert engine.is_idle and engine.snapshot().num_waiting == 0


def test_a_string_is_not_a_collection_of_stop_sequences() -> None:
    """A string is refused when the parameters are built, like stop_token_ids."""
    with pytest.raises(InvalidRequest, match="stop_sequences must be a collection"):
        SamplingParams(stop_sequences="ab")  # type: ignore[arg-type]
    assert SamplingParams(stop_sequences=[[1, 2], (3,)]).stop_sequences == ((1, 2), (3,))


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"speculative": False}, "speculative=False (per-request speculation)"),
        ({"repetition_penalty": 1.1}, "penalties (repetition_penalty=1.1"),
        ({"presence_penalty": -0.5}, "presence_penalty=-0.5)"),
        ({"min_new_tokens": 3}, "min_new_tokens=3"),
        ({"seed": 5, "temperature": 0.7}, "seed=5"),
        ({"logprobs": True}, "logprobs=True"),
    ],
)
def test_a_worker_without_the_capability_is_never_sent_the_request(
    params: dict[str, object], named: str
) -> None:
    """The timed-wait worker declares no control: each request is refused, naming it."""
    worker = TimedWaitWorker(device_seconds=0.0)
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=64)
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=256)) as engine:
        with pytest.raises(InvalidRequest, match="worker 'timed_wait' does not support") as e:
            engine.submit("x", [1, 2], SamplingParams(**params))  # type: ignore[arg-type]
        assert named in str(e.value)
        # What needs nothing from a worker is served: stop sequences, a seed on a greedy row.
        engine.submit(
            "ok", [1, 2], SamplingParams(max_new_tokens=8, stop_sequences=[[7, 7]], seed=3)
        )


def test_the_reference_chain_workers_declare_every_control() -> None:
    """Every chain algorithm of the registry declares the five controls."""
    flags = (
        "supports_per_request_speculation",
        "supports_penalties",
        "supports_min_new_tokens",
        "supports_seeds",
        "supports_logprobs",
    )
    for name in ("none", "ngram", "draft_model"):
        options: dict[str, object] = {"target": embedded.target_dir()}
        if name != "none":
            options["num_steps"] = 2
        if name == "draft_model":
            options["draft"] = embedded.draft_dir()
        caps = default_registry().create(name, **options).capabilities
        assert all(getattr(caps, flag) for flag in flags), (name, caps)


def test_sampling_info_builds_only_what_rows_need_and_keeps_rows_aligned() -> None:
    """Neutral batches carry no extra tensor; select and concat keep every column aligned."""
    plain = SamplingInfo.from_params(
        [SamplingParams(), SamplingParams(temperature=0.5)], vocab_size=VOCAB, device=CPU
    )
    assert not plain.has_logit_controls and plain.seeds is None and plain.speculative is None
    assert plain.speculative_host is None and not plain.logprobs
    rich = SamplingInfo.from_params(
        [
            SamplingParams(repetition_penalty=1.5, seed=4, speculative=False),
            SamplingParams(min_new_tokens=2, stop_token_ids=[9], logprobs=True),
            SamplingParams(presence_penalty=0.5, ignore_eos=True, min_new_tokens=1),
        ],
        vocab_size=VOCAB,
        device=CPU,
        prompt_lens=[3, 4, 5],
        eos_token_ids=frozenset({31}),
    )
    assert rich.has_logit_controls and rich.logprobs
    assert rich.frequency_penalties is None  # no row has one
    assert rich.stop_token_ids is not None
    assert rich.stop_token_ids.tolist() == [[31, -1], [9, 31], [-1, -1]]
    assert rich.speculative_host is not None and rich.speculative_host.tolist() == [
        False,
        True,
        True,
    ]
    merged = plain.concat(rich)
    assert merged.repetition_penalties is not None
    assert merged.repetition_penalties.tolist() == [1.0, 1.0, 1.5, 1.0, 1.0]
    assert merged.seeds is not None and merged.seeds.tolist() == [-1, -1, 4, -1, -1]
    assert merged.speculative is not None
    assert merged.speculative.tolist() == [True, True, False, True, True]
    assert merged.speculative_host is not None
    assert merged.speculative_host.tolist() == merged.speculative.tolist()
    assert merged.prompt_lens is not None and merged.prompt_lens.tolist() == [0, 0, 3, 4, 5]
    kept = merged.select(torch.tensor([4, 2]), host_rows=np.array([4, 2]))
    assert kept.speculative_host is not None and kept.speculative_host.tolist() == [True, False]
    assert kept.min_new_tokens is not None and kept.min_new_tokens.tolist() == [1, 0]
    speculating = merged.select(torch.tensor([0, 3]))  # no host index: read from the device
    assert speculating.speculative_host is None and speculating.speculative is None


def test_logit_controls_match_the_definitions_row_by_row() -> None:
    """Repetition, frequency, presence and the min_new_tokens mask, against a per-row loop."""
    gen = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(repetition_penalty=1.7, min_new_tokens=3, stop_token_ids=[2]),
        SamplingParams(frequency_penalty=0.6, presence_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=0.2, min_new_tokens=1),
    ]
    info = SamplingInfo.from_params(
        params, vocab_size=8, device=CPU, prompt_lens=[2, 2, 2], eos_token_ids=frozenset({7})
    )
    logits = torch.randn(3, 8, generator=gen) * 3
    seen = (torch.rand(3, 8, generator=gen) < 0.4).float()
    output = torch.randint(0, 3, (3, 8), generator=gen).float()
    num_outputs = torch.tensor([2, 5, 1])
    got = apply_logit_controls(
        logits, info, seen=seen, output_counts=output, num_outputs=num_outputs
    )
    for row, p in enumerate(params):
        stops = set(p.stop_token_ids) | {7}
        for token in range(8):
            want = float(logits[row, token])
            if seen[row, token]:
                want = want * p.repetition_penalty if want < 0 else want / p.repetition_penalty
            count = float(output[row, token])
            want -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            if int(num_outputs[row]) < p.min_new_tokens and token in stops:
                want = -math.inf
            assert float(got[row, token]) == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_seeded_uniforms_are_a_pure_uniform_function_of_the_key() -> None:
    """Same key, same value (in any batch); each key part matters; uniform over [0, 1)."""
    seeds = torch.tensor([0, 1, 2**62 + 5])
    positions = torch.tensor([[10, 11], [10, 11], [10, 11]])
    values = seeded_uniforms(seeds, positions)
    alone = seeded_uniforms(seeds[2:], positions[2:])
    assert torch.equal(values[2:], alone)
    assert len({float(v) for v in values.flatten()}) == 6
    assert not torch.equal(seeded_uniforms(seeds, positions, draw=1), values)
    many = seeded_uniforms(torch.arange(400), torch.arange(50)[None, :].expand(400, 50))
    assert bool(((many >= 0) & (many < 1)).all())
    counts = torch.histc(many.float(), bins=20, min=0.0, max=1.0)
    expected = many.numel() / 20
    statistic = float(((counts - expected) ** 2 / expected).sum())
    assert statistic < 45.0  # chi-square, 19 degrees of freedom: p ~ 1e-3


def _result(logprobs: torch.Tensor | None, accept: list[int], stride: int) -> GenerationBatchResult:
    b = len(accept)
    return GenerationBatchResult(
        next_token_ids=torch.ones(b * stride, dtype=torch.int64),
        accept_lens=torch.tensor(accept),
        stride=stride,
        new_seq_lens=torch.tensor([10 + a for a in accept]),
        next_draft_input=RelayPayload(bonus_tokens=torch.ones(b, dtype=torch.int64)),
        logprobs=logprobs,
    )


def test_result_checks_refuse_bad_logprobs_and_non_speculative_runs() -> None:
    """Form, finiteness at accepted positions only, presence when asked, accept 1 when asked."""
    ids = ("a", "b")
    seq_lens = torch.tensor([10, 10])
    with pytest.raises(WorkerResultError, match="logprobs of dtype torch.int64"):
        check_form(_result(torch.zeros(6, dtype=torch.int64), [1, 2], 3), 2, None)
    with pytest.raises(WorkerResultError, match=r"shape \(4,\); it must be a floating point"):
        check_form(_result(torch.zeros(4), [1, 2], 3), 2, None)
    past_the_run = torch.tensor([-0.5, math.nan, math.nan, -0.1, -0.2, math.nan])
    ok = HostResult.view(_result(past_the_run, [1, 2], 3), seq_lens)
    check_values(ok, request_ids=ids, decode=True, max_accept=3, vocab_size=VOCAB)
    inside = HostResult.view(_result(past_the_run, [2, 2], 3), seq_lens)
    with pytest.raises(WorkerResultError, match="request a: log-probability nan"):
        check_values(inside, request_ids=ids, decode=True, max_accept=3, vocab_size=VOCAB)
    positive = HostResult.view(_result(torch.full((6,), 0.5), [1, 1], 3), seq_lens)
    with pytest.raises(WorkerResultError, match="not a finite number <= 0"):
        check_values(positive, request_ids=ids, decode=True, max_accept=3, vocab_size=VOCAB)
    info = SamplingInfo.from_params(
        [SamplingParams(), SamplingParams(speculative=False, logprobs=True)],
        vocab_size=VOCAB,
        device=CPU,
    )
    with pytest.raises(WorkerResultError, match="request b: accept length 2 for a request that"):
        check_sampling_rows(ok, info, request_ids=ids, decode=True)
    check_sampling_rows(ok, info, request_ids=ids, decode=False)  # extends accept 1 anyway
    single = HostResult.view(_result(past_the_run, [3, 1], 3), seq_lens)
    check_sampling_rows(single, info, request_ids=ids, decode=True)
    missing = HostResult.view(_result(None, [3, 1], 3), seq_lens)
    with pytest.raises(WorkerResultError, match="asks for logprobs but the worker returned none"):
        check_sampling_rows(missing, info, request_ids=ids, decode=True)


def test_the_packed_copy_carries_logprobs_bit_for_bit() -> None:
    """Logprobs travel as float32 bits inside the one int64 copy, next to the invalid rows."""
    logprobs = torch.tensor([-0.125, -3.5e-8, -1e30, 0.0, -2.0, -7.25])
    result = GenerationBatchResult(
        next_token_ids=torch.arange(6),
        accept_lens=torch.tensor([3, 1]),
        stride=3,
        new_seq_lens=torch.tensor([13, 11]),
        next_draft_input=RelayPayload(bonus_tokens=torch.tensor([2, 3])),
        invalid_rows=torch.tensor([False, True]),
        logprobs=logprobs,
    )
    host = ResultCopy.start(result, torch.tensor([10, 10]), None).wait()
    assert host is not None and host.logprobs is not None and host.invalid is not None
    assert host.logprobs.dtype == np.float32
    assert host.logprobs.reshape(-1).tolist() == logprobs.tolist()
    assert host.invalid.tolist() == [False, True] and host.tokens.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert host.frontier is not None and host.frontier.tolist() == [13, 11]
