"""The one interface an engine implements: `WorkerProtocol`, and the algorithm registry.

A worker runs forwards; specstate owns every scheduling counter. The worker gets read-only
access to the request → token-slot table and the ledger (`WorkerMemory`), a frozen
`ForwardBatch` per forward, and a callback to publish the next frontier. It never writes a
ledger counter, a request, or a scheduler-owned batch field that outlives its forward.

The forward contract, per scheduler-level mode (positions are token positions in a request's
row; ``S`` is ``batch.seq_lens[row]``, the KV-ready prefix before this forward)::

    EXTEND (prefill or chunk)
      in:   input_ids [sum(extend_lens)], positions, out_cache_loc (where to write), prefix_lens,
            extend_lens; seq_lens = prefix + extend.
      does: writes target (and draft) KV at out_cache_loc; samples one token after the last
            input token of every row (the engine ignores it for a non-final chunk).
      out:  next_token_ids [B] (stride 1), accept_lens = 1, new_seq_lens = seq_lens,
            next_draft_input = the next round's inputs (bonus = the sampled token, extras).
    DECODE (one speculative round, or one plain decode step)
      in:   input_ids [B] = the pending bonus token of each row, at position S; spec_info =
            the relay payload of the previous round (bonus tokens, draft extras).
      does: draft → verify [S, S + D) → accept a run of a tokens (bonus included, 1 <= a <= D)
            → on_publish(S + a) → post-verify commits (draft-extend), all inside
            req_to_token[slot, 0 : kv_allocated_len), which the engine has reserved.
      out:  next_token_ids [B * stride] (row i's run at i*stride : i*stride + a_i), accept_lens,
            new_seq_lens = S + accept_lens, next_draft_input (bonus = last token of each run).

A worker with recurrent state (`WorkerCapabilities.recurrent`) also reads each row's start state
from the state row of its prefix (``S`` in DECODE, ``prefix_lens`` in EXTEND; the zero state at
0) and writes the state after each token at position ``p`` to the row of ``p + 1``
(`WorkerMemory.recurrent`, `specstate.memory.recurrent`).

Invariant (what the engine relies on): the worker reads KV only below ``S`` plus what it wrote in
this forward, writes KV only inside ``[S, kv_allocated_len)`` of each row (EXTEND: only at
``out_cache_loc``), calls ``on_publish`` at most once per forward with the next frontier, and
returns tensors it will not write again (the scheduler owns them once returned).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import HandoffUnsupported, InvalidConfig
from specstate.core.ledger import WorkerLedgerView
from specstate.handoff.record import HandoffRecord, StateLayout
from specstate.memory.prefix_cache import PrefixSharing
from specstate.memory.recurrent_layout import RecurrentLayout, RecurrentStateSpec
from specstate.memory.sizing import SpecWindow

__all__ = [
    "AlgorithmRegistry",
    "HandoffWorker",
    "OnPublish",
    "ParallelGroup",
    "WorkerCapabilities",
    "WorkerFactory",
    "WorkerMemory",
    "WorkerProtocol",
    "handoff_worker",
]

OnPublish = Callable[[torch.Tensor], None]
"""``on_publish(new_seq_lens)``: the next frontier of every row of the batch is decided."""


@attrs.frozen(kw_only=True)
class WorkerCapabilities:
    """What a worker's algorithm needs from the scheduler; the memory sizing derives from it.

    ``supports_sampling`` and the ``supports_*`` flags of the sampling controls (docs/engine.md,
    "Sampling controls") are False unless declared, and `Engine.submit` refuses a request that
    needs one the worker lacks (stop sequences need nothing from a worker: the engine matches
    them).

    Attributes:
        algorithm: registry name (``none``, ``draft_model``, ``eagle``, ``ngram``, ...).
        num_steps: draft steps per round (0 without speculation).
        topk: draft branches per step (1 for a chain).
        num_draft_tokens: verify width D, bonus root included (1 without speculation).
        keeps_draft_kv: whether drafting writes KV into the request's reserved slots.
        supports_overlap: whether the worker may run under the overlap loop.
        supports_mixed_chunk: whether running requests may ride in a prefill batch.
        supports_sampling: whether the worker samples (temperature > 0). False unless
            declared, like every ``supports_*`` flag of a sampling capability: the engine then
            refuses a sampled request at `Engine.submit` (a worker that forgot it would
            otherwise decode sampled requests greedily without a word).
        supports_per_request_speculation: a row with ``SamplingParams(speculative=False)``
            accepts exactly one token per verify (its drafts ignored). Needed only by a
            speculative worker; the engine fails a batch whose such row accepted more.
        supports_penalties: ``repetition_penalty``, ``frequency_penalty`` and
            ``presence_penalty``, each verify position seeing the drafts before it.
        supports_min_new_tokens: stop tokens masked before ``min_new_tokens`` outputs.
        supports_seeds: per-request ``seed`` (`specstate.batch.sampling.seeded_uniforms`).
        supports_logprobs: ``GenerationBatchResult.logprobs`` when a row asks for them.
        supports_top_logprobs: ``GenerationBatchResult.top_logprob_ids`` and
            ``top_logprob_values`` when a row asks for ``top_logprobs``.
        supports_adaptive_steps: the worker drafts ``ForwardBatch.num_draft_steps`` tokens in
            a decode round when the engine sets it (0 to ``num_steps``; 0 is a plain decode
            step), for an adaptive draft policy; the engine fails a batch whose row accepted
            more than ``num_draft_steps + 1``.
        recurrent: the recurrent state of a hybrid model (Mamba2, linear attention, short
            convolution layers), or None. The engine then lays out ``C = num_draft_tokens + 1``
            state rows per request (`WorkerMemory.recurrent`), commits the state of the
            accepted length at settlement, and a prefix cache does not share prefixes (the
            state is not checkpointed at cache boundaries). Chains only (``topk == 1``).
        supports_grammar: the worker masks every sampled, drafted and verified position of a
            row with ``ForwardBatch.grammar`` (`GrammarRows`), so a request may set
            ``SamplingParams.grammar``; the reference chain workers do, draft trees do not.
        prefix_sharing: what the state a forward leaves at a KV position depends on, which
            decides whether the prefix cache may map one request's committed KV into another
            request's row (docs/memory.md, "Prefix cache"). NONE (the default) shares
            nothing; TOKEN: every per-position state (target KV, draft KV, features, token
            histories) lives at the position's token slot and depends on tokens ``[0, p]``;
            BIGRAM: as TOKEN, but the state at ``p`` may read token ``p + 1`` too.
        supports_verify_budgets: the worker honours ``ForwardBatch.verify_budgets`` (a chain,
            ``topk == 1``): row ``i`` verifies at most ``budgets[i]`` drafts, accepts at most
            ``budgets[i] + 1`` tokens and writes no KV (target or draft) past its frontier
            ``+ budgets[i] + 1``; a row at 0 is a plain decode step whose drafter is still
            extended. It may report what each row verified (``verified_lens``). The engine
            then takes a verify-budget policy and reserves each row by its budget.
        reports_draft_confidences: the worker reports ``draft_confidences`` in every decode
            result, for every row (budget 0 included: the drafts it proposed, verified or
            not), which `ConfidenceBudget` plans from.
        asynchronous: ``forward_batch_generation`` only enqueues its device work and returns
            before that work is done; the result's ``copy_done`` event completes once it is
            (a GPU worker's kernels). The engine then launches every forward on the driving
            thread, as on a CUDA stream, even on the CPU: no forward-stream thread, no
            hand-off. A worker that computes inside the call (a CPU model) leaves it False, so
            that under overlap its forward runs on the forward stream's own thread.
    """

    algorithm: str
    num_steps: int = 0
    topk: int = 1
    num_draft_tokens: int = 1
    keeps_draft_kv: bool = False
    supports_overlap: bool = True
    supports_mixed_chunk: bool = True
    supports_sampling: bool = False
    supports_per_request_speculation: bool = False
    supports_penalties: bool = False
    supports_min_new_tokens: bool = False
    supports_seeds: bool = False
    supports_logprobs: bool = False
    supports_top_logprobs: bool = False
    supports_adaptive_steps: bool = False
    recurrent: RecurrentStateSpec | None = None
    supports_grammar: bool = False
    prefix_sharing: PrefixSharing = PrefixSharing.NONE
    asynchronous: bool = False
    supports_verify_budgets: bool = False
    reports_draft_confidences: bool = False

    @classmethod
    def chain(cls, algorithm: str, *, num_steps: int, keeps_draft_kv: bool) -> WorkerCapabilities:
        """A chain drafter of ``num_steps``: topk 1, verify width ``num_steps + 1``."""
        return cls(
            algorithm=algorithm,
            num_steps=num_steps,
            topk=1,
            num_draft_tokens=num_steps + 1,
            keeps_draft_kv=keeps_draft_kv,
        )

    @property
    def speculative(self) -> bool:
        """True when the worker drafts (``num_steps >= 1``)."""
        return self.num_steps > 0

    @property
    def max_accept(self) -> int:
        """The longest run one round may accept: ``num_steps + 1`` for a chain."""
        return self.num_steps + 1 if self.speculative else 1

    def spec_window(self, page_size: int) -> SpecWindow:
        """The reservation window (L, R, headroom) this worker needs at ``page_size``."""
        if not self.speculative:
            return SpecWindow.none(page_size)
        return SpecWindow(
            speculative=True,
            num_steps=self.num_steps,
            topk=self.topk,
            num_draft_tokens=self.num_draft_tokens,
            keeps_draft_kv=self.keeps_draft_kv,
            page_size=page_size,
        )


@runtime_checkable
class ParallelGroup(Protocol):
    """The tensor-parallel group one rank's worker computes in (`WorkerMemory.parallel`).

    Every rank of the group calls each collective in the same order (one thread per rank
    calls them: the forward's). A collective that fails or times out raises `RankFailure`, and
    every later one raises it at once: the group cannot recover (docs/scale-out.md).
    """

    @property
    def rank(self) -> int:
        """This rank, ``0 .. world_size - 1``; rank 0 is where host decisions are made."""
        ...

    @property
    def world_size(self) -> int:
        """How many ranks share the model."""
        ...

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` over the ranks: a new tensor, bit for bit equal on every rank."""
        ...

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (same shape and dtype everywhere; a new tensor)."""
        ...


@attrs.frozen(kw_only=True)
class WorkerMemory:
    """What the engine hands a worker once: read access to the slot table and the ledger.

    Attributes:
        req_to_token: ``[max_requests + 1, row_width]`` request → token-slot table. Read it;
            only the memory layer writes it.
        ledger: the worker's (read-only) view of the KV ledger.
        num_token_slots: KV token slots per layer the worker's caches must hold (slot 0 is
            the padding slot).
        device: where the engine's tensors live.
        recurrent: where request states sit in the worker's state buffers (a worker that
            declares `WorkerCapabilities.recurrent` allocates ``recurrent.num_rows`` rows per
            state tensor); None for a worker without recurrent state.
        parallel: the tensor-parallel group of this rank (`specstate.distributed`), or None
            when one worker runs the whole model. A worker shards its model over it and makes
            every host decision from rank 0's (docs/scale-out.md).
    """

    req_to_token: torch.Tensor
    ledger: WorkerLedgerView
    num_token_slots: int
    device: torch.device
    recurrent: RecurrentLayout | None = None
    parallel: ParallelGroup | None = None


@runtime_checkable
class WorkerProtocol(Protocol):
    """A model runner driven by specstate. Implementations need not subclass anything."""

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The algorithm and window this worker runs; constant for its lifetime."""
        ...

    def attach(self, memory: WorkerMemory) -> None:
        """Bind the engine's memory; called once, before the first forward.

        Postcondition: the worker's KV caches hold ``memory.num_token_slots`` slots.
        """
        ...

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Run one forward of ``batch`` (see the module docstring for the per-mode contract).

        Args:
            batch: the frozen view of the scheduler's batch, relay values resolved.
            on_publish: called once with ``new_seq_lens`` as soon as the next frontier is known
                (after accept, before post-verify work). None in the normal loop.

        Returns:
            The result; its tensors belong to the scheduler from now on.
        """
        ...


@runtime_checkable
class HandoffWorker(Protocol):
    """A worker whose requests' state can move from a prefill engine to a decode engine.

    Optional: `handoff_worker` refuses, with `HandoffUnsupported`, a worker that does not
    implement it. Each family says what it keeps by KV token slot (`handoff_layout`): the
    target's KV, its drafter's KV, feature stores, token histories; a decode engine writes them
    back at its own slots (`import_handoff`) instead of running the prefill again.
    """

    def handoff_identity(self) -> tuple[str, str]:
        """Digests of the target's and the drafter's parameters ("" for no drafter weights)."""
        ...

    def handoff_layout(self) -> StateLayout:
        """(name, dtype, per-position shape) of every buffer kept by KV token slot.

        Raises:
            HandoffUnsupported: the worker's state does not cross (a family that does not
                say what its drafter keeps), naming why.
        """
        ...

    def export_handoff(
        self, locs: torch.Tensor, *, state_row: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        """Copies of every slot-kept buffer at token slots ``locs`` ``[C]`` (positions 0..C-1),
        then, for a worker with recurrent state, of every state buffer at ``state_row`` ``[1]``
        (the state after C tokens; named with the `ROW` prefix), in `handoff_layout` order."""
        ...

    def import_handoff(
        self,
        batch: ForwardBatch,
        records: Sequence[HandoffRecord],
        *,
        on_publish: OnPublish | None = None,
    ) -> GenerationBatchResult:
        """An EXTEND forward that computes nothing: row ``i`` takes ``records[i]``'s slot state
        for positions ``[prefix_lens[i], seq_lens[i])`` at its ``out_cache_loc`` (a prefix the
        decode engine's cache supplied is not written) and, with recurrent state, its state row
        at the row of ``seq_lens[i]``; it returns the record's bonus token as the sampled token
        with its draft state as the next round's payload, and (for a batch that asks for them)
        the bonus token's logprob and top alternatives the record carries."""
        ...


def handoff_worker(worker: WorkerProtocol) -> HandoffWorker:
    """``worker`` as a `HandoffWorker`.

    Raises:
        HandoffUnsupported: the worker does not implement the handoff methods.
    """
    if not isinstance(worker, HandoffWorker):
        raise HandoffUnsupported(
            f"worker {type(worker).__name__} ({worker.capabilities.algorithm!r}) does not "
            "implement HandoffWorker: its requests cannot be handed off"
        )
    return worker


WorkerFactory = Callable[..., WorkerProtocol]
"""Builds a worker from keyword options (model paths, steps, device, ...)."""


class AlgorithmRegistry:
    """Names → worker factories, so users can plug in their own algorithm."""

    def __init__(self) -> None:
        self._factories: dict[str, WorkerFactory] = {}

    def register(self, name: str, factory: WorkerFactory) -> None:
        """Register ``factory`` under ``name``; registering a taken name raises."""
        if name in self._factories:
            raise InvalidConfig(f"algorithm {name!r} is already registered")
        self._factories[name] = factory

    def create(self, name: str, **options: object) -> WorkerProtocol:
        """Build the worker registered as ``name`` with ``options``."""
        factory = self._factories.get(name)
        if factory is None:
            known = ", ".join(sorted(self._factories)) or "none"
            raise InvalidConfig(f"unknown algorithm {name!r} (registered: {known})")
        return factory(**options)

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._factories))

    def as_mapping(self) -> Mapping[str, WorkerFactory]:
        """A read-only copy of the registry."""
        return dict(self._factories)
