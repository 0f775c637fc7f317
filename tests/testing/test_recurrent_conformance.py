"""The conformance kit checks a hybrid worker's state commit: the reference hybrid workers pass,
a worker that keeps the state of its whole chain whatever it accepted fails."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from hf_oracle import greedy
from hybrid_oracle import HybridCheckpoints, make_hybrid_checkpoints
from spy_worker import SpyWorker

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerMemory, WorkerProtocol
from specstate.reference.hybrid import PagedHybrid
from specstate.reference.workers import ChainRoundWorker
from specstate.testing.conformance import check_worker
from specstate.testing.recurrent_conformance import check_recurrent_state


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> HybridCheckpoints:
    """A hybrid target and drafters shared by the module."""
    return make_hybrid_checkpoints(tmp_path_factory.mktemp("recurrent_conformance"))


def _oracle(ckpt: HybridCheckpoints) -> partial[list[int]]:
    return partial(greedy, ckpt.hf)


@pytest.mark.parametrize("algorithm", ["ngram", "draft_model"])
def test_the_reference_hybrid_workers_conform(ckpt: HybridCheckpoints, algorithm: str) -> None:
    """Every configuration and every recurrent scenario, tokens equal to HF generate."""
    report = check_worker(
        partial(ckpt.worker, algorithm), vocab_size=ckpt.vocab_size, oracle=_oracle(ckpt)
    )
    assert report.ok, str(report)
    scenarios = [c for c in report.configs if "rows" in c or "draft" in c or "retraction" in c]
    assert any("zero-draft rounds" in c for c in scenarios)  # both declare adaptive steps
    assert any("staggered rows" in c for c in scenarios)


def test_a_worker_without_state_runs_no_scenario(ckpt: HybridCheckpoints) -> None:
    """No recurrent state, no recurrent scenario."""
    from specstate.reference.workers import default_registry

    factory = partial(default_registry().create, "none", target=ckpt.llama)
    assert check_recurrent_state(factory, vocab_size=97, prompts=[[1]], max_new_tokens=2) == (
        [],
        [],
    )


class _KeepsTheLastCheckpoint(SpyWorker):
    """A hybrid worker that, after each verify, overwrites the state of the accepted length
    with the state after the whole chain (vLLM-style "commit the last slot" bug)."""

    def __init__(self, inner: ChainRoundWorker) -> None:
        super().__init__(inner)
        self._worker = inner
        self._memory: WorkerMemory | None = None

    def attach(self, memory: WorkerMemory) -> None:
        """Keep the layout of the state rows."""
        self._memory = memory
        super().attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The real round, then the bug."""
        result = super().forward_batch_generation(batch, on_publish=on_publish)
        network = self._worker.target_network
        if batch.forward_mode is ForwardMode.DECODE and isinstance(network, PagedHybrid):
            layout, states = network.layout, network.states
            assert layout is not None and states is not None
            slots, start = batch.req_pool_indices, batch.seq_lens
            last = layout.rows(slots, start + result.stride)
            accepted = layout.rows(slots, start + result.accept_lens)
            for layer in range(states.num_layers):
                states.write(layer, accepted, *states.read(layer, last))
        return result


def test_a_worker_that_commits_the_last_checkpoint_fails(ckpt: HybridCheckpoints) -> None:
    """Its tokens drift from HF generate: the recurrent scenarios report ``tokens`` findings."""

    def factory() -> WorkerProtocol:
        worker = ckpt.worker("draft_model")
        assert isinstance(worker, ChainRoundWorker)
        return _KeepsTheLastCheckpoint(worker)

    prompts = [[3, 14, 15, 92, 65, 35, 89], [79, 32], [5, 5, 5, 5]]
    with torch.no_grad():
        findings, scenarios = check_recurrent_state(
            factory, vocab_size=ckpt.vocab_size, prompts=prompts, max_new_tokens=10,
            oracle=_oracle(ckpt),
        )  # fmt: skip
    assert {rule for rule, _, _ in findings} == {"tokens"}
    assert {scenario for _, scenario, _ in findings} == set(scenarios)  # every scenario sees it
