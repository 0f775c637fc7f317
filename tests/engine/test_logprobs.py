"""Logprobs through the engine: one float per emitted token, aligned, checked like tokens.

A stand-in worker (the timed-wait worker, constant tokens) returns ``-position / 1000`` as the
log-probability of the token at each position, and as top logprobs the ids
``(position + j) % 32`` with values ``-position / 1000 - j``, so alignment is checkable exactly:
after a stop that cuts a run, across retraction and re-prefill, in both loops, and through the
packed device-to-host copy (``device="cpu:0"``). A result whose logprobs or top logprobs are
missing, misshapen or out of range at an accepted position fails its batch with
`WorkerResultError`.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from engine_driver import DriveLog, run_checked

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.core.request import TopLogprobs
from specstate.core.status import FinishReason
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.tools.timed_worker import TimedWaitWorker

PROMPT = [1, 2, 3]


class PositionLogprobs:
    """Timed-wait results with logprob ``-position / 1000`` per token, or a broken variant."""

    def __init__(self, *, broken: str = "", accept: int = 2) -> None:
        self._inner = TimedWaitWorker(device_seconds=0.0, accept=accept)
        self._broken = broken

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's, with logprobs and top logprobs."""
        return attrs.evolve(
            self._inner.capabilities, supports_logprobs=True, supports_top_logprobs=True
        )

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build."""
        self._inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The inner result, with logprobs of each token's position."""
        result = self._inner.forward_batch_generation(batch, on_publish=on_publish)
        steps = torch.arange(result.stride, device=batch.seq_lens.device)[None, :]
        decode = batch.forward_mode is ForwardMode.DECODE
        positions = batch.seq_lens.long()[:, None] + (steps + 1 if decode else steps)
        logprobs = -(positions.float() / 1000)
        if self._broken == "nan":
            logprobs = logprobs.clone()
            logprobs[0, 0] = float("nan")
        if self._broken == "none" or not batch.sampling_info.logprobs:
            return result
        if self._broken == "shape":
            logprobs = logprobs[:, :1]
        k = batch.sampling_info.top_logprobs
        if not k or self._broken == "top-none":
            return attrs.evolve(result, logprobs=logprobs.reshape(-1))
        ranks = torch.arange(k, device=positions.device)
        ids = (positions[..., None] + ranks) % 32
        values = -(positions[..., None].float() / 1000) - ranks
        if self._broken == "top-order":
            values = values.flip(-1)
        if self._broken == "top-narrow":
            ids, values = ids[..., :-1], values[..., :-1]
        return attrs.evolve(
            result,
            logprobs=logprobs.reshape(-1),
            top_logprob_ids=ids.reshape(-1, ids.shape[-1]),
            top_logprob_values=values.reshape(-1, values.shape[-1]),
        )


Row = tuple[
    tuple[int, ...], tuple[float, ...] | None, FinishReason, str, tuple[TopLogprobs, ...] | None
]


def serve(
    worker: PositionLogprobs, params: list[SamplingParams], **config: object
) -> tuple[list[Row], DriveLog]:
    """Each request's emitted tokens, logprobs, finish reason, detail and top logprobs; the
    drive log."""
    engine_config = EngineConfig(
        check_invariants=True,
        check_ownership=True,
        **{"kv_tokens": 512, **config},  # type: ignore[arg-type]
    )
    limits = RequestLimits(vocab_size=32, max_context_len=64)
    with Engine(worker, limits=limits, config=engine_config) as engine:
        reqs = [engine.submit(f"r{i}", PROMPT, p) for i, p in enumerate(params)]
        log = run_checked(engine)
    out = []
    for req in reqs:
        assert req.finish is not None
        reason, detail = req.finish.reason, req.finish.detail
        out.append((req.emitted_ids, req.logprobs, reason, detail, req.top_logprobs))
    return out, log


def expected_tops(n: int, k: int) -> list[TopLogprobs]:
    """The stand-in's top ``k`` of outputs ``0 .. n-1``."""
    positions = [len(PROMPT) + i for i in range(n)]
    return [tuple(((p + j) % 32, -p / 1000 - j) for j in range(k)) for p in positions]


def expected_logprobs(n: int) -> list[float]:
    """The stand-in's logprobs of outputs ``0 .. n-1``."""
    return [-(len(PROMPT) + k) / 1000 for k in range(n)]


@pytest.mark.parametrize(
    "config",
    [
        {"overlap": False},
        {"overlap": True},
        {"overlap": True, "device": "cpu:0"},  # the packed copy
        {"overlap": True, "kv_tokens": 64, "page_size": 4},  # retraction and re-prefill
    ],
    ids=["normal", "overlap", "packed-copy", "retraction"],
)
def test_logprobs_align_with_emitted_tokens(config: dict[str, object]) -> None:
    """One logprob per emitted token, cut where the tokens are cut; None when not asked."""
    params = [
        SamplingParams(max_new_tokens=11, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=30, stop_sequences=[(7, 7, 7, 7)], logprobs=True),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=9),
    ]
    got, log = serve(PositionLogprobs(), params, **config)
    assert bool(log.retracted) == ("kv_tokens" in config)
    for tokens, logprobs, _, _, _ in got[:3]:
        assert logprobs is not None and len(logprobs) == len(tokens)
        assert list(logprobs) == pytest.approx(expected_logprobs(len(tokens)), abs=1e-6)
    assert len(got[1][0]) == 4 and got[1][2] is FinishReason.STOP  # cut inside a run
    assert got[3][1] is None and got[3][0] == (7,) * 9
    assert [row[4] for row in got] == [None] * 4


@pytest.mark.parametrize(
    "config",
    [
        {"overlap": False},
        {"overlap": True},
        {"overlap": True, "device": "cpu:0"},  # the packed copy
        {"overlap": True, "kv_tokens": 64, "page_size": 4},  # retraction and re-prefill
    ],
    ids=["normal", "overlap", "packed-copy", "retraction"],
)
def test_top_logprobs_align_with_emitted_tokens(config: dict[str, object]) -> None:
    """Each request's own k alternatives per emitted token, cut where the tokens are cut."""
    params = [
        SamplingParams(max_new_tokens=11, ignore_eos=True, logprobs=True, top_logprobs=3),
        SamplingParams(
            max_new_tokens=30, stop_sequences=[(7, 7, 7, 7)], logprobs=True, top_logprobs=5
        ),
        SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=True),
        SamplingParams(max_new_tokens=9, logprobs=True, top_logprobs=1),
    ]
    got, log = serve(PositionLogprobs(), params, **config)
    assert bool(log.retracted) == ("kv_tokens" in config)
    assert len(got[1][0]) == 4 and got[1][2] is FinishReason.STOP  # cut inside a run
    for (tokens, _, _, _, top), k in zip(got, (3, 5, 0, 1), strict=True):
        if not k:
            assert top is None
            continue
        assert top is not None and len(top) == len(tokens)
        for pairs, want in zip(top, expected_tops(len(tokens), k), strict=True):
            assert [t for t, _ in pairs] == [t for t, _ in want]
            assert [v for _, v in pairs] == pytest.approx([v for _, v in want], abs=1e-5)


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("nan", "log-probability nan of the accepted token at run position 0"),
        ("none", "the batch asks for logprobs but the worker returned none"),
        ("shape", "worker returned logprobs of dtype torch.float32 and shape"),
        ("top-none", "the batch asks for top_logprobs=2 but the worker returned 0"),
        ("top-narrow", "the batch asks for top_logprobs=2 but the worker returned 1"),
        ("top-order", "in descending order"),
    ],
)
@pytest.mark.parametrize("overlap", [False, True])
def test_bad_logprobs_fail_the_batch(broken: str, message: str, overlap: bool) -> None:
    """Missing, misshapen or non-finite logprobs end the batch's requests with ERROR."""
    top = 2 if broken.startswith("top") else 0
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=top)]
    got, _ = serve(PositionLogprobs(broken=broken), params, overlap=overlap)
    tokens, _, reason, detail, _ = got[0]
    assert reason is FinishReason.ERROR and "WorkerResultError" in detail
    assert message in detail
    assert len(tokens) <= 1  # the first decode result at the latest failed
