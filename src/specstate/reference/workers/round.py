"""One speculative round, as every reference worker runs it, and the worker that drafts nothing.

`ChainRoundWorker` implements `WorkerProtocol` once for every chain algorithm; a subclass says
only how it drafts and what it commits after a verify. Per scheduler-level mode::

    EXTEND / MIXED   target extend ─▶ on_publish(seq_lens) ─▶ draft prefill (drafter KV, history)
    DECODE           propose d1..dK ─▶ target verify [x0, d1..dK] at S..S+K ─▶ accept a
                     (with a verify budget b: only d1..db verified, no KV past S+b)
                     ─▶ on_publish(S + a) ─▶ commit round (draft-extend, history) ─▶ result
    IDLE             on_publish(empty) ─▶ empty result

A MIXED batch is an EXTEND to the worker: a running request rides as a 1-token extend of its
bonus, which is exactly a 1-token chunk (its relay payload row carries what a chunk needs).

Rows with ``temperature > 0`` sample (target and drafter alike) and verify by speculative
sampling (`specstate.reference.workers.verify`); greedy rows take the argmax, also when they
share a batch with sampled rows. All randomness of unseeded rows comes from the worker's one
`TokenSampler` (``seed`` option): a run is reproducible for a fixed seed and batch composition.

Every chain worker (``topk == 1``) serves the sampling controls (its capabilities declare them;
a tree, ``topk > 1``, serves them in its own round, `specstate.reference.workers.tree`): a
DECODE round records the bonus in the target's token history and builds the token state at
``S``; the drafter drafts inside `TokenSampler.drafting` (the same controls on its logits,
seeded rows coupled to the position they draft); the target verifies each position with the
drafts before it (`specstate.reference.workers.target`). A request with ``speculative=False``
still rides the verify, with its drafts ignored: it accepts exactly one token.

A chain worker also serves grammars (``ForwardBatch.grammar``, `specstate.grammar.rows`): the
drafter drafts under the grammar's masks (an n-gram chain is checked and pruned instead), the
verify applies one mask per position, and after the publish the grammar keeps the accepted
run and builds the next round's first masks, while the draft-extend is still to run.

Invariant: ``on_publish`` is called exactly once per forward, after the target decided the
frontier and before any post-verify work; the worker writes only its own caches and history,
never a ledger counter, a request, or a batch field.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Sequence

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import HandoffUnsupported, InvalidConfig
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.handoff.record import ROW, HandoffRecord, StateLayout
from specstate.memory.prefix_cache import PrefixSharing
from specstate.reference.model import KvCache, PagedLlama
from specstate.reference.workers.layout import (
    decode_result,
    decode_roots,
    empty_result,
    extend_result,
)
from specstate.reference.workers.sampler import TokenSampler
from specstate.reference.workers.sources import ModelSource, SourceModel
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import ChainVerdict, DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = [
    "ChainRoundWorker",
    "PlainWorker",
    "VerifiedRound",
    "parameter_digest",
    "tensor_digest",
]


def parameter_digest(module: torch.nn.Module) -> str:
    """SHA-256 of ``module``'s parameters and buffers: names, dtypes, shapes and bytes."""
    return tensor_digest([*module.named_parameters(), *module.named_buffers()])


def tensor_digest(tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors (in name order): names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        data = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{data.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@attrs.frozen(kw_only=True)
class VerifiedRound:
    """A DECODE round after the target verified it: what post-verify commits read.

    Attributes:
        batch: the forward's frozen batch.
        start: ``[B]`` frontier ``S`` before the round.
        chain: ``[B, D]`` verified tokens ``[x0, d1..dK]`` at ``S .. S+K``.
        verdict: accepted runs and lengths.
        target_hidden: ``[B, D, hidden]`` target features of the chain.
        confidences: ``[B, D - 1]`` the drafter's confidences (`DraftChain.confidences`).
    """

    batch: ForwardBatch
    start: torch.Tensor
    chain: torch.Tensor
    verdict: ChainVerdict
    target_hidden: torch.Tensor
    confidences: torch.Tensor | None = None


def with_sampling_controls(capabilities: WorkerCapabilities) -> WorkerCapabilities:
    """``capabilities`` declaring sampling and every control a reference round implements."""
    return attrs.evolve(
        capabilities,
        supports_sampling=True,
        supports_per_request_speculation=True,
        supports_penalties=True,
        supports_min_new_tokens=True,
        supports_seeds=True,
        supports_logprobs=True,
        supports_top_logprobs=True,
    )


def _with_recurrent_state(
    capabilities: WorkerCapabilities, target: TargetRunner
) -> WorkerCapabilities:
    """``capabilities`` declaring the target's recurrent state before a drafter's (if any).

    Both models' states use the engine's state rows, as both models' KV uses its token slots:
    each forward reads the row of its frontier and writes the rows of the positions it absorbs.

    Raises:
        InvalidConfig: a model with recurrent state in a tree worker (``topk > 1``).
    """
    spec = target.recurrent
    merged = capabilities.recurrent if spec is None else spec.merged(capabilities.recurrent)
    if merged is None:
        return capabilities
    if capabilities.topk > 1:
        raise InvalidConfig(
            f"{capabilities.algorithm}: a model with recurrent state verifies chains only; "
            f"topk {capabilities.topk} drafts a tree"
        )
    return attrs.evolve(capabilities, recurrent=merged)


def _imported_logprobs(
    records: Sequence[HandoffRecord], batch: ForwardBatch, device: torch.device
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """An import batch's logprobs: each record's last emitted token's (the "sampled" one),
    as the prefill engine computed it; 0 for a row that did not ask. Its top alternatives
    ``([B, K], [B, K])`` the same way: a row's first ``top_logprobs`` columns, then id 0 at
    ``-inf`` (K is the batch's; settlement keeps each row's own)."""
    sampling = batch.sampling_info
    if not sampling.logprobs:
        return None, None
    last = [0.0 if r.output_logprobs is None else r.output_logprobs[-1] for r in records]
    logprobs = torch.tensor(last, dtype=torch.float32, device=device)
    k = sampling.top_logprobs
    if not k:
        return logprobs, None
    ids = torch.zeros(len(records), k, dtype=torch.int64)
    values = torch.full((len(records), k), -torch.inf, dtype=torch.float32)  # past a row's
    for row, record in enumerate(records):
        if record.output_top_logprobs is not None:
            pairs = record.output_top_logprobs[-1]
            ids[row, : len(pairs)] = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
            values[row, : len(pairs)] = torch.tensor([v for _, v in pairs], dtype=torch.float32)
    return logprobs, (ids.to(device), values.to(device))


def _publish(on_publish: OnPublish | None, new_seq_lens: torch.Tensor) -> None:
    if on_publish is not None:
        on_publish(new_seq_lens)


class ChainRoundWorker(abc.ABC):
    """A `WorkerProtocol` implementation for chain drafting (see the module docstring).

    Args:
        target: the target model runner.
        capabilities: the algorithm, steps and draft-KV flag this worker declares.
        seed: seeds the worker's generator (None: a fresh seed per attach, not reproducible).
    """

    def __init__(
        self, target: TargetRunner, capabilities: WorkerCapabilities, *, seed: int | None = None
    ) -> None:
        self._target = target
        capabilities = _with_recurrent_state(capabilities, target)
        if capabilities.prefix_sharing is PrefixSharing.NONE and capabilities.recurrent is None:
            # Every state a reference forward leaves at a position (KV, draft KV, features,
            # token history) sits at its token slot and depends on tokens [0, p] only. A
            # recurrent state is not kept at cache boundaries: hybrid targets share nothing.
            capabilities = attrs.evolve(capabilities, prefix_sharing=PrefixSharing.TOKEN)
        self._capabilities = capabilities
        if capabilities.topk == 1:  # the chain round implements every sampling control
            self._capabilities = attrs.evolve(
                with_sampling_controls(capabilities),
                supports_adaptive_steps=True,
                supports_grammar=True,
                supports_verify_budgets=capabilities.speculative,
            )
        self._sampler = TokenSampler(seed)
        self._identity: tuple[str, str] | None = None

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The algorithm and window this worker runs; constant for its lifetime."""
        return self._capabilities

    @property
    def target_network(self) -> SourceModel:
        """The target model (after attach), a Llama or a hybrid (`PagedHybrid`)."""
        return self._target.network

    @property
    def target_model(self) -> PagedLlama:
        """The target model (after attach)."""
        return self._target.model

    def kv_caches(self) -> dict[str, KvCache]:
        """The KV caches this worker's forwards touch, by owner (``target`` first), after
        attach: what a test's watch observes (`specstate.testing.frontier_watch`)."""
        return {"target": self.target_network.kv_cache, **self._draft_kv_caches()}

    def _draft_kv_caches(self) -> dict[str, KvCache]:
        """The drafter's own KV caches (none by default)."""
        return {}

    # ------------------------------------------------------------ handoff (HandoffWorker)
    def handoff_identity(self) -> tuple[str, str]:
        """Digests of the target's and the drafter's parameters (computed once)."""
        if self._identity is None:
            self._identity = (parameter_digest(self.target_network), self._drafter_digest())
        return self._identity

    def _drafter_digest(self) -> str:
        """The digest of the drafter's weights ("" without any): `_handoff_drafter`'s
        parameters by default; a family whose drafter is not one module says its own."""
        drafter = self._handoff_drafter()
        return "" if drafter is None else parameter_digest(drafter)

    def handoff_layout(self) -> StateLayout:
        """Every buffer this worker keeps by KV token slot: name, dtype, one position's shape."""
        buffers = {**self._handoff_buffers(), **self._handoff_state_rows()}
        return tuple((name, str(buf.dtype), tuple(buf.shape[1:])) for name, buf in buffers.items())

    def export_handoff(
        self, locs: torch.Tensor, *, state_row: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Copies of every slot-kept buffer at token slots ``locs``, and of every recurrent
        state buffer at ``state_row`` (`HandoffWorker`)."""
        out = {
            name: buf.index_select(0, locs.to(buf.device).long())
            for name, buf in self._handoff_buffers().items()
        }
        rows = self._handoff_state_rows()
        if rows and state_row is None:
            raise InvalidConfig("export_handoff: a hybrid worker's export needs its state row")
        for name, buf in rows.items():
            assert state_row is not None
            out[name] = buf.index_select(0, state_row.to(buf.device).long())[0]
        return out

    def import_handoff(
        self,
        batch: ForwardBatch,
        records: Sequence[HandoffRecord],
        *,
        on_publish: OnPublish | None = None,
    ) -> GenerationBatchResult:
        """Write each record's slot state at the batch's new slots; its bonus is the "sampled"
        token and its draft state the next payload (`HandoffWorker.import_handoff`)."""
        buffers = self._handoff_buffers()
        locs, prefix_lens, extend_lens = batch.out_cache_loc, batch.prefix_lens, batch.extend_lens
        if locs is None or not isinstance(prefix_lens, tuple) or extend_lens is None:
            raise InvalidConfig("import_handoff needs an EXTEND batch with host prefix lengths")
        if len(records) != len(extend_lens):
            raise InvalidConfig(
                f"import_handoff: {len(records)} records for a batch of {len(extend_lens)} rows"
            )
        offset = 0
        for record, start, count in zip(records, prefix_lens, extend_lens, strict=True):
            at = locs[offset : offset + count].long()
            offset += count
            for name, buf in buffers.items():
                part = record.slot_state[name][start : start + count]
                buf.index_copy_(0, at.to(buf.device), part.to(device=buf.device, dtype=buf.dtype))
        self._imported(locs.long())
        state_rows = self._handoff_state_rows()
        if state_rows:  # each row's state after seq_lens tokens, at its own slot's rows
            layout = self._target.memory.recurrent
            if layout is None:
                raise InvalidConfig("import_handoff: recurrent state without a state layout")
            at_rows = layout.rows(batch.req_pool_indices, batch.seq_lens)
            for name, buf in state_rows.items():
                values = torch.stack([r.recurrent_state[name] for r in records])
                buf.index_copy_(
                    0, at_rows.to(buf.device), values.to(device=buf.device, dtype=buf.dtype)
                )
        device = batch.seq_lens.device
        tokens = torch.tensor(
            [r.draft_state.bonus_token for r in records], dtype=torch.int64, device=device
        )
        grammar = batch.grammar
        if grammar is not None:  # the same token the prefill engine sampled under it
            grammar.sample_masks()
            grammar.accept_sampled(tokens)
        _publish(on_publish, batch.seq_lens.long())
        extras = [r.draft_state for r in records]

        def stacked(name: str) -> torch.Tensor | None:
            found = [getattr(d, name) for d in extras]
            if any(t is None for t in found):
                return None
            return torch.stack([t for t in found if t is not None]).to(device)

        payload = RelayPayload(
            bonus_tokens=tokens,
            hidden_states=stacked("hidden_states"),
            topk_p=stacked("topk_p"),
            topk_index=stacked("topk_index"),
        )
        invalid = torch.zeros(len(records), dtype=torch.bool, device=device)
        logprobs, top = _imported_logprobs(records, batch, device)
        return extend_result(tokens, batch.seq_lens, payload, invalid, logprobs, top)

    def _handoff_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer kept by KV token slot (dim 0), by name, in a fixed order.

        A tree worker (``topk > 1``) keeps the same: after each round its target's and
        drafter's state at ``[S, S + a)`` is compacted to what a chain of the accepted tokens
        writes (`specstate.reference.workers.tree`); nothing of a tree outlives its round.

        Raises:
            HandoffUnsupported: a family that does not say what its drafter keeps
                (`_draft_handoff_buffers`).
        """
        out: dict[str, torch.Tensor] = {}
        for owner, cache in self.kv_caches().items():
            out.update({f"{owner}.{name}": buf for name, buf in cache.buffers().items()})
        out["target.history"] = self._target.history.slot_tokens
        out.update(self._draft_handoff_buffers())
        return out

    def _handoff_state_rows(self) -> dict[str, torch.Tensor]:
        """Every recurrent state buffer (a hybrid target's, a hybrid drafter's), by name with
        the `ROW` prefix, indexed by state row on dim 0; empty without recurrent state."""
        out: dict[str, torch.Tensor] = {}
        for owner, model in (("target", self.target_network), ("draft", self._handoff_drafter())):
            states = getattr(model, "states", None)
            if states is not None:
                out.update({f"{ROW}{owner}.{n}": b for n, b in states.buffers().items()})
        return out

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        """The drafter's slot-kept buffers besides its KV caches (`kv_caches`).

        Default: refuse (a family that keeps draft state the engine does not know of would
        otherwise hand off a drafter with holes).
        """
        raise HandoffUnsupported(
            f"{self._capabilities.algorithm}: this worker family does not export its draft state"
        )

    def _handoff_drafter(self) -> torch.nn.Module | None:
        """The drafter whose weights the descriptor digests (None: no drafter weights)."""
        return None

    def _imported(self, slots: torch.Tensor) -> None:
        """An import wrote every slot-kept buffer at ``slots`` (the batch's new slots): the
        state a prefill would have left there. A family that tracks its writes records it."""
        del slots

    def attach(self, memory: WorkerMemory) -> None:
        """Build the target and the drafter with ``memory.num_token_slots`` KV slots each."""
        self._target.attach(memory)
        self._sampler.bind(self._target.device_for(memory), memory.parallel)
        self._attach_draft(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Runs one forward of ``batch``; see `specstate.engine.worker` for the contract.

        Raises:
            InvalidConfig: a worker-internal mode or an inconsistent batch.
        """
        mode = batch.forward_mode
        if mode is ForwardMode.IDLE:
            _publish(on_publish, batch.seq_lens.long())
            return empty_result(batch.seq_lens.device, self._capabilities.num_draft_tokens)
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return self._run_extend(batch, on_publish)
        if mode is ForwardMode.DECODE:
            return self._run_decode(batch, on_publish)
        raise InvalidConfig(f"{mode.value} is worker-internal; the scheduler cannot send it")

    def _run_extend(
        self, batch: ForwardBatch, on_publish: OnPublish | None
    ) -> GenerationBatchResult:
        out = self._target.extend(batch, self._sampler)
        # NOTE: the frontier of an extend is seq_lens itself: the sampled token is the next
        # pending root, whose KV the next verify writes. Publish before the draft prefill.
        _publish(on_publish, batch.seq_lens.long())
        payload = self._draft_prefill(batch, out)
        return extend_result(
            out.next_tokens,
            batch.seq_lens,
            payload,
            out.invalid_rows,
            out.logprobs,
            out.top_logprobs,
        )

    def _run_decode(
        self, batch: ForwardBatch, on_publish: OnPublish | None
    ) -> GenerationBatchResult:
        start, roots = decode_roots(batch)
        sampling = batch.sampling_info
        counts = self._target.begin_round(batch.req_pool_indices, start, roots, sampling)
        grammar = batch.grammar
        with self._sampler.drafting(start, sampling, counts, grammar):
            drafts = self._propose(batch, start, roots)
        checked = self._target.verify_chain(
            batch.req_pool_indices,
            start,
            roots,
            drafts,
            sampling=sampling,
            sampler=self._sampler,
            counts=counts,
            grammar_masks=None if grammar is None else grammar.verify_masks(drafts.tokens),
            budgets=batch.verify_budgets,
        )
        verdict, hidden = checked.verdict, checked.hidden_states
        new_seq_lens = start + verdict.accept_lens
        _publish(on_publish, new_seq_lens)
        if grammar is not None:  # keep the run, roll back the rest; next round's first masks
            grammar.accept(verdict.run_tokens, verdict.accept_lens)
        chain = torch.cat([roots[:, None], drafts.tokens], dim=1)
        verified = VerifiedRound(
            batch=batch,
            start=start,
            chain=chain,
            verdict=verdict,
            target_hidden=hidden,
            confidences=drafts.confidences,
        )
        payload = self._commit_round(verified)
        return decode_result(
            verdict.run_tokens,
            verdict.accept_lens,
            new_seq_lens,
            payload,
            checked.invalid_rows,
            checked.logprobs,
            drafts.confidences,
            top_logprobs=checked.top_logprobs,
        )

    @abc.abstractmethod
    def _attach_draft(self, memory: WorkerMemory) -> None:
        """Build the drafter's state for ``memory`` (caches, history)."""

    @abc.abstractmethod
    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        """Bring the drafter up to the extend's tokens; return the next round's payload."""

    @abc.abstractmethod
    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        """Draft ``[B, K]`` tokens after the bonus ``roots`` at positions ``start``.

        Greedy rows draft the drafter's argmax; sampled rows draw from the drafter's filtered
        distribution (``batch.sampling_info``) with ``self._sampler`` and return it in
        `DraftChain.probs` (a deterministic drafter returns None: ``q`` is one-hot). It runs
        inside `TokenSampler.drafting`: call ``self._sampler.choose`` once per draft step, in
        order, and it applies the logit controls and the seeded draws of the drafted position.
        """

    @abc.abstractmethod
    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        """Post-verify commits (after publish); return the next round's payload."""


class PlainWorker(ChainRoundWorker):
    """Algorithm ``none``: each DECODE is a 1-token extend of the bonus at ``S``; publishes ``S+1``.

    Args:
        target: checkpoint directory or in-memory `PagedLlama`.
        device: where the model lives (default: the engine memory's device).
        dtype: parameter and KV dtype (default: the checkpoint's).
        seed: seeds the generator of sampled rows (None: not reproducible).
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        runner = TargetRunner(target, device=device, dtype=dtype)
        super().__init__(runner, WorkerCapabilities(algorithm="none"), seed=seed)

    def _attach_draft(self, memory: WorkerMemory) -> None:
        del memory  # nothing drafts

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        return {}  # nothing drafts

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        return DraftChain(tokens=roots.new_zeros(roots.shape[0], 0))

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)
