"""The conformance kit's view of one worker: a proxy that watches every forward it runs.

`WatchedWorker` wraps the worker under test and implements `WorkerProtocol` itself (it
subclasses nothing, like any worker); the engine sees exactly what the worker returns. Around
each forward it records the rules a worker can break without the engine noticing at once:

* ``relay``: ``on_publish`` called from a thread other than the one running the forward, or
  after the forward returned (the worker gets the kit's callable, which notes the call and
  hands it on to the engine's, which refuses it too);
* ``ownership``: a write to ``req_to_token``, found by comparing the table before and after the
  forward — only where nothing else writes it meanwhile (the normal loop: ``watch_table``);
* ``capabilities``: capabilities that change during the worker's life;

and it keeps every decode round's accept lengths of greedy rows (`RoundRecorder`) for the
kit's ``draft_state`` rule (`specstate.testing.draft_state`).

Findings are kept as ``(rule, detail)`` pairs, each rule once, until the kit reads them.

Invariant: the proxy changes no argument and no result; the engine's behaviour with it is the
engine's behaviour with the bare worker.
"""

from __future__ import annotations

import threading

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.testing.draft_state import RoundRecorder

__all__ = ["WatchedWorker"]


class _PublishWatch:
    """The kit's ``on_publish``: notes a call from another thread or after return, passes on."""

    def __init__(self, watched: WatchedWorker, engine_publish: OnPublish, batch: int) -> None:
        self._watched = watched
        self._publish = engine_publish
        self._batch = batch
        self._thread = threading.get_ident()
        self.returned = False

    def __call__(self, new_seq_lens: torch.Tensor) -> None:
        if self.returned or threading.get_ident() != self._thread:
            where = "after the forward returned" if self.returned else "from another thread"
            self._watched.note(
                "relay",
                f"forward {self._batch}: on_publish called {where} (thread "
                f"{threading.current_thread().name!r}); it must be called from the thread "
                "running forward_batch_generation, before it returns",
            )
        self._publish(new_seq_lens)


class WatchedWorker:
    """A `WorkerProtocol` proxy recording what the kit checks around each forward.

    Args:
        inner: the worker under test.
        watch_table: compare ``req_to_token`` before and after every forward (only when no
            other thread writes the table during a forward: the normal loop).
    """

    def __init__(self, inner: WorkerProtocol, *, watch_table: bool) -> None:
        self._inner = inner
        self._watch_table = watch_table
        self._capabilities = inner.capabilities
        self._memory: WorkerMemory | None = None
        self._forwards = 0
        self._lock = threading.Lock()
        self._found: dict[str, str] = {}  # rule -> first detail
        self.rounds = RoundRecorder(inner.capabilities.num_steps)

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The wrapped worker's (read each time, as the engine would)."""
        return self._inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the wrapped worker; keep the table to watch."""
        self._memory = memory
        self._inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The wrapped forward, watched (module docstring)."""
        self._forwards += 1
        table = None if self._memory is None else self._memory.req_to_token
        before = table.clone() if self._watch_table and table is not None else None
        watch = None if on_publish is None else _PublishWatch(self, on_publish, self._forwards)
        try:
            result = self._inner.forward_batch_generation(batch, on_publish=watch)
            self.rounds.record(batch, result)
            return result
        finally:
            if watch is not None:
                watch.returned = True
            if before is not None and table is not None:
                self._compare_table(before, table)
            if self._inner.capabilities != self._capabilities:
                self.note(
                    "capabilities",
                    f"capabilities changed from {self._capabilities} to "
                    f"{self._inner.capabilities}; they must be constant",
                )

    def note(self, rule: str, detail: str) -> None:
        """Record a broken rule (the first detail of each rule is kept)."""
        with self._lock:
            self._found.setdefault(rule, detail)

    def take(self) -> list[tuple[str, str]]:
        """The broken rules recorded so far, as ``(rule, detail)``; the record is emptied."""
        with self._lock:
            found, self._found = list(self._found.items()), {}
        return found

    def _compare_table(self, before: torch.Tensor, table: torch.Tensor) -> None:
        changed = (before != table).nonzero()
        if changed.numel():
            slot, position = (int(x) for x in changed[0])
            self.note(
                "ownership",
                f"forward {self._forwards}: the worker wrote req_to_token[{slot}, {position}] "
                f"({int(before[slot, position])} -> {int(table[slot, position])}); only the "
                "engine's memory layer writes it",
            )
