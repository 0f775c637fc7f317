"""The engine on a GPU: exact tokens on CUDA, and an overlap loop that really overlaps.

Skipped without CUDA (the CPU proofs of the same properties are `test_device_audit.py` and
`test_stream_order.py`). With a GPU:

* every algorithm, both loops, page 1 and 16, chunked prefill with mixed chunks, on ``cuda``:
  the tokens equal HF ``generate()``'s (float32) and the CPU engine's;
* overlap, read from CUDA events: with a forward that keeps the GPU busy (a sleep kernel),
  ``step()`` returns while the forward it launched is still running in most steady rounds —
  the host schedules and settles under the forward instead of waiting for it.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import ALGORITHMS, MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish
from specstate.tools.timed_worker import TimedWaitWorker

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("cuda"))


def _run(ckpt: SpecCheckpoints, algorithm: str, device: str, **options: object) -> list[list[int]]:
    config = EngineConfig(
        device=device,
        kv_tokens=1024,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **options,  # type: ignore[arg-type]
    )
    engine = Engine(
        ckpt.worker(algorithm),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=config,
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    run_checked(engine, max_steps=300)
    engine.close()
    return [list(r.emitted_ids) for r in reqs]


@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size", "chunking"),
    [
        (a, o, p, c)
        for a, o, (p, c) in itertools.product(
            ALGORITHMS, [False, True], [(1, (None, False)), (16, (4, True))]
        )
    ],
)
def test_the_engine_on_cuda_matches_hf_and_the_cpu(
    ckpt: SpecCheckpoints,
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Token for token: CUDA engine == HF generate == CPU engine."""
    options: dict[str, object] = {
        "overlap": overlap,
        "page_size": page_size,
        "chunked_prefill": chunking[0],
        "mixed_chunk": chunking[1],
    }
    on_cuda = _run(ckpt, algorithm, "cuda", **options)
    on_cpu = _run(ckpt, algorithm, "cpu", **options)
    want = [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]
    assert on_cuda == want
    assert on_cpu == want


class _SleepKernelWorker(TimedWaitWorker):
    """Each forward first keeps the GPU busy with a sleep kernel (about ``milliseconds``)."""

    def __init__(self, milliseconds: float) -> None:
        super().__init__(device_seconds=0.0)
        # torch.cuda._sleep spins for a number of cycles; about 1e6 cycles a millisecond.
        self._cycles = int(milliseconds * 1e6)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Enqueue the sleep on the current (forward) stream, then the tiny result."""
        torch.cuda._sleep(self._cycles)  # type: ignore[no-untyped-call]
        return super().forward_batch_generation(batch, on_publish=on_publish)


def test_overlap_really_overlaps_on_cuda() -> None:
    """In steady rounds, step() returns while the forward it launched still runs."""
    engine = Engine(
        _SleepKernelWorker(milliseconds=20.0),
        limits=RequestLimits(vocab_size=32, max_context_len=512),
        config=EngineConfig(device="cuda", overlap=True, kv_tokens=4096),
    )
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    for i in range(8):
        engine.submit(f"r{i}", [1, 2, 3], params)
    for _ in range(5):  # prefill, then a few decode rounds
        engine.step()
    busy = 0
    rounds = 20
    for _ in range(rounds):
        engine.step()
        flight = engine.in_flight
        assert flight is not None and flight.done is not None
        busy += not flight.done.query()  # the launched forward is still on the GPU
    engine.close()
    assert busy >= 0.8 * rounds, f"host waited for the forward in {rounds - busy} of {rounds}"
