"""The shipped conformance kit: the reference workers pass it; a broken worker fails each rule.

The reference workers run through every configuration against HF ``generate()`` as the oracle.
Each broken worker wraps a real one and breaks one rule on its second decode forward (or, for
wrong tokens, everywhere); the kit must name exactly that rule.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs
import pytest
import torch
from hf_oracle import greedy
from spec_checkpoints import ALGORITHMS, SpecCheckpoints, make_spec_checkpoints
from spy_worker import SpyWorker

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerMemory, WorkerProtocol
from specstate.testing.conformance import assert_worker_conforms, check_worker

Pub = OnPublish | None
Result = GenerationBatchResult
Break = Callable[["_Broken", ForwardBatch, Pub], Result]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("conformance"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_reference_workers_conform(ckpt: SpecCheckpoints, algorithm: str) -> None:
    """Every configuration, every rule, tokens equal to HF generate."""
    assert_worker_conforms(
        partial(ckpt.worker, algorithm, agreeing=False),
        vocab_size=ckpt.vocab_size,
        oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n),
    )


@pytest.mark.slow
def test_a_wide_tree_window_conforms_under_pressure(ckpt: SpecCheckpoints) -> None:
    """An EAGLE tree of 6 steps, topk 4 reserves 96 tokens a request at page 4: the pressure run
    sizes its pool from the worker's window, so the worker is judged, not the pool."""
    from specstate.reference.workers import default_registry

    def factory() -> WorkerProtocol:
        return default_registry().create(
            "eagle", target=ckpt.target, eagle=ckpt.eagle, num_steps=6, topk=4,
            num_draft_tokens=8,
        )  # fmt: skip

    assert_worker_conforms(
        factory, vocab_size=ckpt.vocab_size, oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n)
    )


class _Broken(SpyWorker):
    """A real worker whose second decode forward goes through ``broken``."""

    def __init__(self, inner: WorkerProtocol, broken: Break) -> None:
        super().__init__(inner)
        self._broken = broken
        self._decodes = 0
        self.memory: WorkerMemory | None = None

    def attach(self, memory: WorkerMemory) -> None:
        """Keep the memory (a bug may write its ledger)."""
        self.memory = memory
        super().attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The real forward, except the second decode, which is broken."""
        if batch.forward_mode.is_decode():
            self._decodes += 1
            if self._decodes == 2:
                return self._broken(self, batch, on_publish)
        return self.real(batch, on_publish)

    def real(self, batch: ForwardBatch, on_publish: OnPublish | None) -> GenerationBatchResult:
        """The wrapped worker's forward."""
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


def _shifted_frontier(
    w: _Broken, batch: ForwardBatch, pub: OnPublish | None
) -> GenerationBatchResult:
    result = w.real(batch, None)
    assert result.new_seq_lens is not None
    shifted = result.new_seq_lens + 1
    if pub is not None:
        pub(shifted)
    return attrs.evolve(result, new_seq_lens=shifted)


def _long_accept(w: _Broken, batch: ForwardBatch, pub: Pub) -> Result:
    result = w.real(batch, pub)
    return attrs.evolve(result, accept_lens=result.accept_lens + 10)


def _no_stash(w: _Broken, batch: ForwardBatch, pub: Pub) -> Result:
    return attrs.evolve(w.real(batch, pub), next_draft_input=None)


def _writes_counter(
    w: _Broken, batch: ForwardBatch, pub: OnPublish | None
) -> GenerationBatchResult:
    assert w.memory is not None
    ledger = w.memory.ledger
    ledger.advance_committed(batch.req_pool_indices, torch.ones_like(batch.req_pool_indices))  # type: ignore[attr-defined]
    return w.real(batch, pub)


def _in_place(w: _Broken, batch: ForwardBatch, pub: Pub) -> Result:
    batch.seq_lens.add_(0)
    return w.real(batch, pub)


def _raises(w: _Broken, batch: ForwardBatch, pub: Pub) -> Result:
    raise RuntimeError("device lost")


@pytest.mark.parametrize(
    ("broken", "rule"),
    [
        (_shifted_frontier, "result"),
        (_long_accept, "result"),
        (_no_stash, "relay"),
        (_writes_counter, "ownership"),
        (_in_place, "isolation"),
        (_raises, "error"),
    ],
    ids=["shifted-frontier", "accept-too-long", "no-stash", "writes-counter", "in-place", "raises"],
)
def test_a_broken_worker_fails_its_rule(ckpt: SpecCheckpoints, broken: Break, rule: str) -> None:
    """The kit names the broken rule (and only it)."""
    report = check_worker(lambda: _Broken(ckpt.worker("eagle"), broken), vocab_size=ckpt.vocab_size)
    assert report.rules() == {rule}, str(report)


class _WrongTokens(SpyWorker):
    """Every emitted token (and so every relayed bonus) off by one: well formed, but wrong."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Shift the accepted tokens and the relayed bonus."""
        result = self._inner.forward_batch_generation(batch, on_publish=on_publish)
        vocab = 97
        payload = result.next_draft_input
        assert payload is not None
        return attrs.evolve(
            result,
            next_token_ids=(result.next_token_ids + 1) % vocab,
            next_draft_input=attrs.evolve(payload, bonus_tokens=(payload.bonus_tokens + 1) % vocab),
        )


def test_wrong_tokens_are_caught_by_the_oracle(ckpt: SpecCheckpoints) -> None:
    """A well-formed worker with the wrong tokens fails ``tokens`` (and nothing else)."""
    report = check_worker(
        lambda: _WrongTokens(ckpt.worker("none")),
        vocab_size=ckpt.vocab_size,
        oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n),
    )
    assert report.rules() == {"tokens"}, str(report)
