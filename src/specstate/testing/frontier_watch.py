"""Which KV slots a worker's forward reads and writes, checked against each row's frontier.

A worker that exposes its KV caches (``kv_caches()``, as every reference worker does: the
target's, the drafter's) can be watched through them (`specstate.reference.model.KvCache`
tells its observers of every read and write). `FrontierWatch` checks two rules per forward and
per cache, with the frontier ``F`` of each row: its KV-ready prefix (``seq_lens`` of a DECODE
batch, ``prefix_lens`` of an EXTEND or MIXED one)::

    row slot  req_to_token[slot, 0 : F)      committed: may be read
              req_to_token[slot, F : F + W)  this forward's window: may be written, and read
                                             once this forward wrote it
              req_to_token[slot, F + W : )   neither

* ``frontier``: a slot at a position ``>= F`` read before this forward wrote it. Those slots
  hold a rejected draft of an earlier round, or, under overlap, belong to the round in flight:
  a drafter that reads the target's KV there (a Frozen-KV drafter reading one position too far)
  reads garbage that verification cannot see.
* ``window``: a write at a position outside ``[F, F + W)``: ``W`` is the extend length of an
  EXTEND row, and for a DECODE row the ``L`` the worker's capabilities reserve at this page size
  (`WorkerCapabilities.spec_window`). A drafter that writes KV its capabilities do not declare
  (``keeps_draft_kv`` False, a paged tree's scratch pages) writes past what the engine reserved.

The watch maps only positions ``[0, F + W)`` of each row (under overlap the host plans the
next round past them while this forward runs): a write to any other slot breaks ``window``; a
read of one is not judged. The padding slot 0 is not checked.
Findings are kept as ``(rule, detail)`` pairs, each rule once.

Invariant: the watch changes no argument, result or cache; its observers are installed for the
duration of one forward and removed after it, also when the forward raises.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.reference.model import KvCache

__all__ = ["FrontierWatch", "WatchableWorker"]


@runtime_checkable
class WatchableWorker(WorkerProtocol, Protocol):
    """A worker that exposes the KV caches its forwards touch."""

    def kv_caches(self) -> Mapping[str, KvCache]:
        """The caches by owner name (after attach)."""
        ...


@attrs.frozen(kw_only=True)
class _Geometry:
    """Where each slot of the batch's rows sits: position, and the row's window."""

    slot_position: dict[int, tuple[int, int]]  # slot -> (row, position)
    frontier: list[int]
    window: list[int]


class _ForwardObserver:
    """Observes the caches during one forward (`KvObserver`)."""

    def __init__(
        self, watch: FrontierWatch, geometry: _Geometry, names: dict[int, str], forward: int
    ) -> None:
        self._watch = watch
        self._geometry = geometry
        self._names = names
        self._forward = forward
        self._written: dict[int, set[int]] = {key: set() for key in names}

    def kv_written(self, cache: KvCache, slots: torch.Tensor) -> None:
        written = self._written[id(cache)]
        for slot in slots.reshape(-1).tolist():
            if slot == 0:
                continue
            written.add(slot)
            where = self._geometry.slot_position.get(slot)
            if where is None:  # past every row's window, or no row's slot at all
                self._watch.note(
                    "window",
                    f"forward {self._forward}: the {self._names[id(cache)]} KV cache was "
                    f"written at slot {slot}, which lies in no batch row's window",
                )
                continue
            row, position = where
            lo = self._geometry.frontier[row]
            if not lo <= position < lo + self._geometry.window[row]:
                self._note("window", cache, row, position, "written")

    def kv_read(self, cache: KvCache, slots: torch.Tensor) -> None:
        written = self._written[id(cache)]
        for slot in slots.reshape(-1).tolist():
            where = self._geometry.slot_position.get(slot)
            if slot == 0 or where is None or slot in written:
                continue
            row, position = where
            if position >= self._geometry.frontier[row]:
                self._note("frontier", cache, row, position, "read")

    def _note(self, rule: str, cache: KvCache, row: int, position: int, did: str) -> None:
        lo, width = self._geometry.frontier[row], self._geometry.window[row]
        self._watch.note(
            rule,
            f"forward {self._forward}: the {self._names[id(cache)]} KV cache was {did} at "
            f"position {position} of batch row {row} (frontier {lo}, window [{lo}, "
            f"{lo + width}))" + (", before this forward wrote it" if rule == "frontier" else ""),
        )


class FrontierWatch:
    """A `WorkerProtocol` proxy checking every forward's KV reads and writes (module docstring).

    Args:
        inner: the worker under test; it must expose ``kv_caches()`` (`WatchableWorker`).
        page_size: the engine's page size (a DECODE window is the reservation's ``L`` there).
    """

    def __init__(self, inner: WatchableWorker, *, page_size: int) -> None:
        self._inner = inner
        self._page_size = page_size
        self._memory: WorkerMemory | None = None
        self._forwards = 0
        self._lock = threading.Lock()
        self._found: dict[str, str] = {}

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The wrapped worker's."""
        return self._inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the wrapped worker; keep the slot table to map slots to positions."""
        self._memory = memory
        self._inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The wrapped forward, its cache accesses watched."""
        self._forwards += 1
        geometry = self._geometry(batch)
        if geometry is None:
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        caches = dict(self._inner.kv_caches())
        names = {id(cache): name for name, cache in caches.items()}
        observer = _ForwardObserver(self, geometry, names, self._forwards)
        stops: list[Callable[[], None]] = [cache.observe(observer) for cache in caches.values()]
        try:
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        finally:
            for stop in stops:
                stop()

    def note(self, rule: str, detail: str) -> None:
        """Record a broken rule (the first detail of each rule is kept)."""
        with self._lock:
            self._found.setdefault(rule, detail)

    def take(self) -> list[tuple[str, str]]:
        """The broken rules recorded so far, as ``(rule, detail)``; the record is emptied."""
        with self._lock:
            found, self._found = list(self._found.items()), {}
        return found

    def _geometry(self, batch: ForwardBatch) -> _Geometry | None:
        memory = self._memory
        if memory is None or batch.forward_mode is ForwardMode.IDLE or not batch.batch_size:
            return None
        slots = batch.req_pool_indices.long().cpu()
        if batch.forward_mode is ForwardMode.DECODE:
            frontier = batch.seq_lens.long().cpu().tolist()
            width = self.capabilities.spec_window(self._page_size).alloc_len_per_decode
            window = [width] * len(frontier)
        else:
            prefix = batch.prefix_lens
            frontier = [
                int(p)
                for p in (prefix.tolist() if isinstance(prefix, torch.Tensor) else prefix or ())
            ]
            window = list(batch.extend_lens or ())
        # NOTE: only positions [0, F + W) of a row: the engine reserved them before the launch
        # and nobody changes them during the forward. Under overlap the host already plans the
        # next round (its table writes, its ledger) beyond them, so they are not read here.
        table = memory.req_to_token
        slot_position: dict[int, tuple[int, int]] = {}
        for row, slot in enumerate(slots.tolist()):
            end = frontier[row] + window[row]
            for position, token_slot in enumerate(table[slot, :end].tolist()):
                slot_position[token_slot] = (row, position)
        return _Geometry(slot_position=slot_position, frontier=frontier, window=window)
