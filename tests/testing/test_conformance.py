"""The shipped conformance kit: the reference workers pass it; a broken worker fails each rule.

The reference workers run through every configuration against HF ``generate()`` as the oracle.
Each broken worker wraps a real one and breaks one rule on its second decode forward (or, for
wrong tokens, everywhere); the kit must name exactly that rule.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial

import attrs
import pytest
import torch
from hf_oracle import greedy
from mtp_oracle import MtpCheckpoints, make_mtp_checkpoints
from planted_workers import ReadsOnePastTheFrontier, WritesUndeclaredKv, planted
from spec_checkpoints import (
    ALGORITHMS,
    FAMILIES,
    SpecCheckpoints,
    make_spec_checkpoints,
)
from spy_worker import SpyWorker

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import RelayError
from specstate.engine.worker import OnPublish, WorkerMemory, WorkerProtocol
from specstate.reference.workers.mtp import MtpWorker
from specstate.reference.workers.round import VerifiedRound
from specstate.relay.future_map import RelayPayload
from specstate.testing.conformance import assert_worker_conforms, check_worker
from specstate.testing.kit_workload import DEFAULT_PROMPTS

Pub = OnPublish | None
Result = GenerationBatchResult
Break = Callable[["_Broken", ForwardBatch, Pub], Result]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("conformance"))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, *FAMILIES])
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


# ------------------------------------------------------------------ capabilities and rules
class _Rewrites(SpyWorker):
    """A real worker; ``rewrite`` changes every batch it is handed (one broken capability)."""

    def __init__(self, inner: WorkerProtocol, rewrite: Callable[[ForwardBatch], ForwardBatch]):
        super().__init__(inner)
        self._rewrite = rewrite

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The real forward of the rewritten batch."""
        return self._inner.forward_batch_generation(self._rewrite(batch), on_publish=on_publish)


def _ignores_width(batch: ForwardBatch) -> ForwardBatch:
    return attrs.evolve(batch, num_draft_steps=None)


def _ignores_speculative_false(batch: ForwardBatch) -> ForwardBatch:
    info = attrs.evolve(batch.sampling_info, speculative=None, speculative_host=None)
    return attrs.evolve(batch, sampling_info=info)


def _ignores_min_new_tokens(batch: ForwardBatch) -> ForwardBatch:
    info = attrs.evolve(batch.sampling_info, min_new_tokens=None, stop_token_ids=None)
    return attrs.evolve(batch, sampling_info=info)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rewrite", "rule"),
    [
        (_ignores_width, "adaptive"),
        (_ignores_speculative_false, "speculation"),
        (_ignores_min_new_tokens, "controls"),
    ],
    ids=["ignores-num-draft-steps", "ignores-speculative-false", "ignores-min-new-tokens"],
)
def test_a_declared_capability_the_worker_ignores_fails_its_rule(
    ckpt: SpecCheckpoints, rewrite: Callable[[ForwardBatch], ForwardBatch], rule: str
) -> None:
    """Adaptive steps, per-request speculation and min_new_tokens are exercised: a worker that
    declares one and ignores it fails exactly that rule."""
    report = check_worker(
        lambda: _Rewrites(ckpt.worker("eagle"), rewrite),
        vocab_size=ckpt.vocab_size,
        oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n),
    )
    assert report.rules() == {rule}, str(report)


class _LatePublisher(SpyWorker):
    """Publishes each decode frontier late: from a helper thread, during the next forward."""

    def __init__(self, inner: WorkerProtocol) -> None:
        super().__init__(inner)
        self._pending: tuple[OnPublish, torch.Tensor] | None = None
        self.refused = 0

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Call the previous forward's on_publish from another thread, then run this one
        without publishing (the engine publishes new_seq_lens when it returns)."""
        if self._pending is not None:
            late, lens = self._pending
            self._pending = None
            thread = threading.Thread(target=self._publish, args=(late, lens))
            thread.start()
            thread.join()
        result = self._inner.forward_batch_generation(batch, on_publish=None)
        if on_publish is not None and batch.forward_mode.is_decode():
            assert result.new_seq_lens is not None
            self._pending = (on_publish, result.new_seq_lens)
        return result

    def _publish(self, late: OnPublish, lens: torch.Tensor) -> None:
        try:
            late(lens)
        except RelayError:  # the engine refuses it: nothing is relayed
            self.refused += 1


@pytest.mark.slow
def test_a_late_publish_from_another_thread_fails_relay(ckpt: SpecCheckpoints) -> None:
    """on_publish after the forward returned, from a helper thread: ``relay`` (the engine
    refused every such call, so the tokens stay right)."""
    workers: list[_LatePublisher] = []

    def factory() -> WorkerProtocol:
        workers.append(_LatePublisher(ckpt.worker("eagle")))
        return workers[-1]

    report = check_worker(
        factory, vocab_size=ckpt.vocab_size, oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n)
    )
    assert report.rules() == {"relay"}, str(report)
    assert "on_publish called after the forward returned" in str(report)
    assert sum(w.refused for w in workers) > 0
    assert any("on_publish called after its forward returned" in line for line in report.log)


class _WritesTable(SpyWorker):
    """Writes the last column of its first row's req_to_token (never allocated, so harmless
    to the tokens, but not the worker's to write)."""

    def attach(self, memory: WorkerMemory) -> None:
        """Keep the table."""
        self.table = memory.req_to_token
        super().attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Scribble, then run the real forward."""
        slot = int(batch.req_pool_indices[0])
        self.table[slot, -1] = self.table[slot, -1] + 1
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


@pytest.mark.slow
def test_a_worker_writing_req_to_token_fails_ownership(ckpt: SpecCheckpoints) -> None:
    """A write to ``req_to_token`` is found by comparing the table around each forward."""
    report = check_worker(
        lambda: _WritesTable(ckpt.worker("ngram")),
        vocab_size=ckpt.vocab_size,
        oracle=lambda prompt, n: greedy(ckpt.hf, prompt, n),
    )
    assert report.rules() == {"ownership"}, str(report)
    assert "wrote req_to_token[" in str(report)


class _WritesCounterAtAttach(SpyWorker):
    """Writes a ledger counter while attaching: the error escapes the engine's constructor."""

    def attach(self, memory: WorkerMemory) -> None:
        """Attach, then write a counter it does not own."""
        super().attach(memory)
        slots = torch.tensor([1])
        memory.ledger.advance_committed(slots, torch.ones_like(slots))  # type: ignore[attr-defined]


def test_an_escaped_ownership_error_is_reported_under_its_rule(ckpt: SpecCheckpoints) -> None:
    """An error that escapes the engine (not a batch's finish) is named by its type."""
    report = check_worker(
        lambda: _WritesCounterAtAttach(ckpt.worker("none")), vocab_size=ckpt.vocab_size
    )
    assert report.rules() == {"ownership"}, str(report)
    assert "building the engine: OwnershipError" in str(report)


class _WrongUnderOverlap(SpyWorker):
    """Right tokens in the normal loop; off by one (token and relayed bonus) under overlap."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Shift the run only when the engine hands an on_publish (the overlap loop)."""
        result = self._inner.forward_batch_generation(batch, on_publish=on_publish)
        if on_publish is None:
            return result
        payload = result.next_draft_input
        assert payload is not None
        return attrs.evolve(
            result,
            next_token_ids=(result.next_token_ids + 1) % 97,
            next_draft_input=attrs.evolve(payload, bonus_tokens=(payload.bonus_tokens + 1) % 97),
        )


@pytest.mark.slow
def test_a_worker_wrong_in_one_loop_is_caught_without_an_oracle(ckpt: SpecCheckpoints) -> None:
    """No oracle: the overlap configurations disagree with the normal ones (``tokens``)."""
    report = check_worker(lambda: _WrongUnderOverlap(ckpt.worker("none")), vocab_size=97)
    assert report.rules() == {"tokens"}, str(report)
    assert all("overlap loop" in f.config for f in report.findings)
    assert {f.request for f in report.findings} >= {"g1", "g2", "g3"}  # not only the aborted


@pytest.mark.slow
def test_the_pressure_configuration_retracts_and_aborts_its_request(ckpt: SpecCheckpoints) -> None:
    """The KV-pressure run retracts and really aborts g0 mid-flight (after it emitted)."""
    report = check_worker(partial(ckpt.worker, "eagle", agreeing=False), vocab_size=97)
    assert report.ok, str(report)
    pressure = [r for r in report.runs if "KV pressure" in r.name]
    assert len(pressure) == 1 and pressure[0].aborted == ("g0",) and pressure[0].retracted > 0
    assert all(not r.aborted for r in report.runs if r is not pressure[0])


@pytest.mark.slow
def test_findings_come_once_per_rule_and_request(
    ckpt: SpecCheckpoints, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker failing every batch: one finding per request (with the other configurations
    counted), and the engine's failure log kept out of the output unless asked for."""
    with caplog.at_level(logging.ERROR, logger="specstate"):
        report = check_worker(lambda: _Broken(ckpt.worker("eagle"), _raises), vocab_size=97)
        quiet = list(caplog.records)
        loud = check_worker(lambda: _Broken(ckpt.worker("eagle"), _raises), vocab_size=97, log=True)
    keys = [(f.rule, f.request) for f in report.findings]
    assert len(keys) == len(set(keys)) and report.rules() == {"error"}, str(report)
    assert all(f.repeats > 0 for f in report.findings)
    assert "more configurations" in str(report) and len(str(report).splitlines()) == len(keys)
    assert quiet == [] and "device lost" not in capsys.readouterr().err
    assert any("failed; its requests end with ERROR" in line for line in report.log)
    assert len(caplog.records) == len(loud.log) > 0
    assert "Traceback" not in str(report)


@pytest.mark.slow
def test_a_checkpoint_with_an_eos_needs_its_eos_ids(ckpt: SpecCheckpoints) -> None:
    """An oracle that stops at EOS (as HF ``generate`` does for a real checkpoint): with the
    EOS ids the kit agrees with it; without them it says to pass them."""
    eos = greedy(ckpt.hf, DEFAULT_PROMPTS[0], 12)[3]  # stops the first prompt early

    def stops_at_eos(prompt: Sequence[int], n: int) -> list[int]:
        out = greedy(ckpt.hf, prompt, n)
        return out[: out.index(eos) + 1] if eos in out else out

    factory = partial(ckpt.worker, "ngram")
    goes_on = partial(greedy, ckpt.hf)  # an oracle that does not stop at EOS: the kit cuts it
    assert_worker_conforms(factory, vocab_size=97, eos_token_ids={eos}, oracle=goes_on)
    report = check_worker(factory, vocab_size=97, oracle=stops_at_eos)
    assert report.rules() == {"tokens"} and "pass the model's eos_token_ids" in str(report)


class _RelaysTheFirstPosition(MtpWorker):
    """A planted draft-state bug: the relayed hidden chain is the round's first position's,
    not the last accepted one's (right only when a round accepts one token)."""

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        payload = super()._commit_round(verified)
        first = verified.target_hidden[:, 0]
        hidden = payload.hidden_states
        assert hidden is not None
        stale = torch.cat([self.layers.target_hidden(first), hidden[:, first.shape[1] :]], dim=1)
        return attrs.evolve(payload, hidden_states=stale)


@pytest.fixture(scope="module")
def mtp(tmp_path_factory: pytest.TempPathFactory) -> MtpCheckpoints:
    """Ernie MoE targets with MTP layers that agree partly and lean on the relayed state."""
    return make_mtp_checkpoints(tmp_path_factory.mktemp("conformance_mtp"))


@pytest.mark.parametrize("broken", [False, True])
def test_a_hidden_state_from_the_wrong_position_fails_draft_state(
    mtp: MtpCheckpoints, broken: bool
) -> None:
    """Tokens stay right (lossless), but the accept lengths at one frontier disagree between
    configurations (mixed chunks and the adaptive widths reach it after other rounds): the kit
    names draft_state, and only for the broken worker."""
    kind = _RelaysTheFirstPosition if broken else MtpWorker
    report = check_worker(
        lambda: kind(target=mtp.multi),
        vocab_size=mtp.vocab_size,
        oracle=lambda prompt, n: greedy(mtp.hf_multi, prompt, n),
    )
    assert {f.rule for f in report.findings} == ({"draft_state"} if broken else set()), report


def test_kv_reads_past_the_frontier_and_undeclared_writes_fail_their_rules(
    ckpt: SpecCheckpoints,
) -> None:
    """The frontier watch's planted workers (`test_frontier_watch`), through the kit."""
    read = check_worker(lambda: planted(ckpt, ReadsOnePastTheFrontier), vocab_size=97)
    assert "frontier" in {f.rule for f in read.findings}, read
    write = check_worker(lambda: planted(ckpt, WritesUndeclaredKv), vocab_size=97)
    assert "window" in {f.rule for f in write.findings}, write
