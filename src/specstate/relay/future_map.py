"""The FutureMap owns the device relay between iterations: next inputs, keyed by request slot.

One row per request-pool slot (the *future index* is ``req_pool_idx``). The worker writes the
next frontier (`FutureMap.publish`) and the next round's inputs (`FutureMap.stash`) while the
host already schedules the next iteration; the next iteration reads them back
(`FutureMap.resolve_seq_lens`, `FutureMap.resolve_forward_inputs`,
`FutureMap.resolve_mixed_tails`) behind the publish fence::

    host      | schedule N |  resolve N  | schedule N+1 (overlaps forward N) |  resolve N+1  |
                                  |                                              ^ waits publish
    forward                       | forward N: verify -> accept -> PUBLISH -> draft-extend ...
                                                                      |  stash (bonus, extras)
                                                         publish event recorded here

Until resolved, a batch field that depends on the relay holds `Unresolved` (its own type, never
a ``-1`` placeholder), so the type checker makes every reader handle it.

Invariant: every returned tensor is new (a gather or an arithmetic result), never a view into a
buffer, and no caller tensor is written; every batch-wide operation is a fixed number of tensor
ops with no Python loop over requests and, outside debug mode, no host synchronization beyond
the documented fences (the publish/stash events and an explicitly requested host mirror).

Persistent batches relay by reference: a write without a stream is kept *pending* in a
`specstate.relay.write_log.WriteLog` — the written tensors and the index tensor, not yet
scattered into the buffers. A resolve with the very same index tensor (the running batch,
unchanged since the previous round) returns the pending tensors themselves: no scatter and no
gather, whatever the batch size. Writes and reads that bring the host copy of their indices
(``host=``, as the engine's do) go further: a read takes each row from the write that holds
its slot's latest value, so a persistent batch whose rows stay in place when members leave and
join reads its unchanged rows from the previous round's tensor (one gather) and only the joined
rows from elsewhere. Every read sees exactly what eager writes would have left in the buffers,
except at the slots of requests that left a persistent batch: no one reads those before their
next holder writes them (`specstate.relay.write_log`).
Written tensors are owned by the map once written (the worker's result contract), and the map
never writes them, so sharing them is safe.

Debug mode (consume once): buffers start poisoned (``int64`` min, NaN) and two host-side bool
bitmaps mark slots written since their last read: `publish` marks ``new_seq_lens`` rows and
`stash` marks token rows. A resolve of any unmarked row raises `RelayError` naming the slots, then
clears the marks and re-poisons the rows it read. Writing a marked row again (publish twice, no
resolve in between) is allowed: it overwrites.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

import attrs
import torch
from typing_extensions import TypeIs

from specstate.core.errors import InvalidConfig, RelayError
from specstate.relay.streams import Event, Stream
from specstate.relay.write_log import IntArray, RowPatch, WriteLog

__all__ = [
    "DraftDims",
    "ForwardInputs",
    "FutureMap",
    "FutureMapSnapshot",
    "MixedTails",
    "RelayPayload",
    "ResolvedSeqLens",
    "Unresolved",
    "is_unresolved",
]

POISON_INT: Final = torch.iinfo(torch.int64).min
POISON_FLOAT: Final = float("nan")
_Write = Callable[[], None]


def _cast_like(value: torch.Tensor | None, buf: torch.Tensor | None) -> torch.Tensor | None:
    """``value`` in the dtype a buffer read would have returned (a no-op when it matches)."""
    if value is None or buf is None or value.dtype is buf.dtype:
        return value
    return value.to(buf.dtype)


@attrs.frozen
class Unresolved:
    """A batch value that lives in the FutureMap rows ``future_indices`` until resolved.

    ``patch``, when given, says how ``future_indices`` derives from the previous round's index
    (a persistent batch, `RowPatch`): the resolve then moves only the rows that changed.
    """

    future_indices: torch.Tensor
    patch: RowPatch | None = attrs.field(default=None, eq=False)


def is_unresolved(x: object) -> TypeIs[Unresolved]:
    """Return whether ``x`` is an `Unresolved` relay value (narrows both branches)."""
    return isinstance(x, Unresolved)


@attrs.frozen(kw_only=True)
class DraftDims:
    """Shapes of the draft extras, for buffers allocated up front instead of at first stash."""

    topk: int
    hidden_size: int
    hidden_dtype: torch.dtype = torch.float32


@attrs.frozen(kw_only=True)
class RelayPayload:
    """The next round's inputs for a set of slots: ``[n]`` bonus tokens plus optional extras.

    Attributes:
        bonus_tokens: ``[n]`` integer tokens, each row's last accepted (or sampled) token: the
            next round's input at the row's frontier.
        topk_p: ``[n, k]`` draft probabilities a tree or EAGLE drafter carries over, or None.
        topk_index: ``[n, k]`` token ids matching ``topk_p``, or None.
        hidden_states: ``[n, hidden]`` features an EAGLE head continues from, or None.
    """

    bonus_tokens: torch.Tensor
    topk_p: torch.Tensor | None = None
    topk_index: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


@attrs.frozen(kw_only=True)
class ResolvedSeqLens:
    """The resolved frontier of a batch; ``seq_lens_cpu`` only when a host mirror was asked."""

    seq_lens: torch.Tensor
    seq_lens_cpu: list[int] | None


@attrs.frozen(kw_only=True)
class ForwardInputs(RelayPayload):
    """Gathered next-round inputs, the batch's relay payload as they are; an extra is None when
    its buffer was never created."""


@attrs.frozen(kw_only=True)
class MixedTails:
    """Late-bound geometry of the running tails of a mixed batch (1-token extend of the bonus)."""

    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    prefix_lens: torch.Tensor


@attrs.frozen(kw_only=True)
class FutureMapSnapshot:
    """Counters and shapes of a `FutureMap` at one moment."""

    max_slots: int
    debug: bool
    topk: int | None
    hidden_size: int | None
    num_publishes: int
    num_stashes: int
    num_fence_waits: int
    num_host_mirrors: int
    num_kept_writes: int = 0
    """Writes kept by reference now (both logs): what a read may still build rows from."""


class FutureMap:
    """Slot-indexed relay buffers with a publish fence; see the module docstring."""

    def __init__(
        self,
        max_slots: int,
        *,
        device: torch.device,
        debug: bool = False,
        draft_dims: DraftDims | None = None,
    ) -> None:
        if max_slots <= 0:
            raise InvalidConfig(f"FutureMap needs max_slots >= 1, got {max_slots}")
        self._max_slots = max_slots
        self._device = device
        self._debug = debug
        self._new_seq_lens = self._buffer((), torch.int64)
        self._bonus_tokens = self._buffer((), torch.int64)
        d = draft_dims  # None: each extra is created by the first stash that carries it
        self._topk_p = None if d is None else self._buffer((d.topk,), torch.float32)
        self._topk_index = None if d is None else self._buffer((d.topk,), torch.int64)
        self._hidden = None if d is None else self._buffer((d.hidden_size,), d.hidden_dtype)
        self._published = torch.zeros(max_slots, dtype=torch.bool)  # debug: written since read
        self._stashed = torch.zeros(max_slots, dtype=torch.bool)  # debug: written since read
        self._publish_event: Event | None = None
        self._stash_event: Event | None = None
        # Writes kept by reference until a read needs the buffers (see the module docstring).
        self._lens_log = WriteLog(max_slots)
        self._payload_log = WriteLog(max_slots)
        self._num_publishes = self._num_stashes = self._num_fence_waits = self._num_host_mirrors = 0

    def publish(
        self,
        indices: torch.Tensor,
        new_seq_lens: torch.Tensor,
        *,
        stream: Stream | None = None,
        host: IntArray | None = None,
    ) -> None:
        """Scatter the next device frontier of ``indices`` and record the publish event.

        With ``stream``, the scatter is ordered after the work already on it (inline from that
        stream's own work) and the event is recorded right after; without, it runs now, after
        the previous publish (kept by reference until a read needs it). ``host`` is the host
        copy of ``indices`` (see the module docstring). Do not write the arguments afterwards.

        Raises:
            RelayError: shapes disagree, or (debug) indices are out of range or repeated.
        """
        self._check_indices(indices, new_seq_lens.shape, "publish")
        if indices.numel() == 0:
            return
        self._num_publishes += 1
        if stream is None:
            if self._publish_event is not None:
                self._publish_event = self._wait(self._publish_event)
            self._lens_log.keep(
                indices, (new_seq_lens,), None if self._debug else host, self._lens_bufs()
            )
            if self._debug:
                self._published[indices.cpu()] = True
            return
        self._lens_log.flush(self._lens_bufs())
        self._publish_event = self._ordered_write(
            self._publish_event, stream, lambda: self._write_seq_lens(indices, new_seq_lens)
        )

    def arm_fences(self, stream: Stream) -> None:
        """Record the publish and stash fences on ``stream`` now, at its current end.

        For work that publishes or stashes from *inside* a stream item (a worker's
        ``on_publish`` on a `CpuStream` thread, which may run after the host's next resolve):
        armed right after submitting that work, the fences make the next resolves wait for it.
        """
        for previous in (self._publish_event, self._stash_event):
            if previous is not None:  # keep "the latest event implies every earlier write"
                stream.wait_event(previous)
        self._publish_event = self._stash_event = stream.record_event()

    def stash(
        self,
        indices: torch.Tensor,
        payload: RelayPayload,
        *,
        stream: Stream | None = None,
        host: IntArray | None = None,
    ) -> None:
        """Write the next round's inputs of ``indices``, ordered like `publish`.

        An extras buffer is created by the first stash that carries it, shaped from it.

        Raises:
            RelayError: shapes disagree with ``indices``; ``topk_p`` without ``topk_index``.
            InvalidConfig: an extra's width differs from the existing buffer.
        """
        self._check_indices(indices, payload.bonus_tokens.shape, "stash")
        if (payload.topk_p is None) != (payload.topk_index is None):
            raise RelayError("stash: topk_p and topk_index must be given together")
        if indices.numel() == 0:
            return
        if self._ensure_extras(payload, indices.shape[0]):  # on the host: errors raise here
            # A new buffer: kept writes would lack it, so they go to the buffers first.
            self._payload_log.flush(self._payload_bufs())
        self._num_stashes += 1
        if stream is None:
            if self._stash_event is not None:
                self._stash_event = self._wait(self._stash_event)
            values = (payload.bonus_tokens, payload.topk_p, payload.topk_index,
                      payload.hidden_states)  # fmt: skip
            if self._covers(payload):
                self._payload_log.keep(
                    indices, values, None if self._debug else host, self._payload_bufs()
                )
            else:  # the extras it lacks keep their earlier values: write through the buffers
                self._payload_log.write_now(indices, values, host, self._payload_bufs())
            if self._debug:
                self._stashed[indices.cpu()] = True
            return
        self._payload_log.flush(self._payload_bufs())
        self._stash_event = self._ordered_write(
            self._stash_event, stream, lambda: self._write_payload(indices, payload)
        )

    def resolve_seq_lens(
        self,
        indices: torch.Tensor,
        *,
        host_mirror: bool = False,
        patch: RowPatch | None = None,
    ) -> ResolvedSeqLens:
        """Wait for the publish fence, then gather the frontier of ``indices``.

        ``host_mirror`` adds ``seq_lens_cpu``, a host list (a device-to-host copy); ``patch``
        derives ``indices`` from an earlier index. The tensor returned is new, or a write kept
        by reference (module docstring); it is never written afterwards.

        Raises:
            RelayError: (debug) a slot not published since its last resolve.
        """
        self._check_indices(indices, indices.shape, "resolve_seq_lens")
        seq_lens = self._gather_seq_lens(indices, patch)
        self._num_host_mirrors += int(host_mirror)
        return ResolvedSeqLens(
            seq_lens=seq_lens, seq_lens_cpu=seq_lens.tolist() if host_mirror else None
        )

    def resolve_forward_inputs(
        self, indices: torch.Tensor, *, patch: RowPatch | None = None
    ) -> ForwardInputs:
        """Wait for the latest stash, then gather bonus tokens and extras of ``indices``.

        ``patch`` derives ``indices`` from an earlier index (module docstring).

        Raises:
            RelayError: (debug) a slot not stashed since its last resolve.
        """
        self._check_indices(indices, indices.shape, "resolve_forward_inputs")
        if indices.numel() > 0:
            event, self._stash_event = self._stash_event, None
            if event is not None:
                self._stash_event = self._wait(event)
            if self._debug:
                self._consume(self._stashed, indices, "stash")
        bonus, topk_p, topk_index, hidden = self._read(
            self._payload_log, indices, patch, self._payload_bufs()
        )
        assert bonus is not None  # the bonus buffer always exists
        return ForwardInputs(
            bonus_tokens=bonus if bonus.dtype is torch.int64 else bonus.to(torch.int64),
            topk_p=_cast_like(topk_p, self._topk_p),
            topk_index=_cast_like(topk_index, self._topk_index),
            hidden_states=_cast_like(hidden, self._hidden),
        )

    def resolve_mixed_tails(
        self,
        slots: torch.Tensor,
        req_to_token: torch.Tensor,
        fresh_committed: torch.Tensor | None = None,
    ) -> MixedTails:
        """Rebuild the last ``n`` rows of a mixed batch: a 1-token extend at ``fresh``.

        ``seq_lens = fresh + 1``, ``out_cache_loc = req_to_token[slots, fresh]`` and
        ``prefix_lens = fresh``; ``fresh`` defaults to the published frontier of ``slots``
        (behind the publish fence, consumed like `resolve_seq_lens`). The ``+1`` is local to
        this view. All three are new tensors; no input is written.

        Raises:
            RelayError: ``fresh_committed`` does not match ``slots``; (debug) unpublished slots.
        """
        fresh_shape = slots.shape if fresh_committed is None else fresh_committed.shape
        self._check_indices(slots, fresh_shape, "resolve_mixed_tails")
        if fresh_committed is None:
            fresh = self._gather_seq_lens(slots, None)  # never written afterwards
        else:
            fresh = fresh_committed.to(torch.int64, copy=True)
        return MixedTails(
            seq_lens=fresh + 1, out_cache_loc=req_to_token[slots, fresh], prefix_lens=fresh
        )

    def snapshot(self) -> FutureMapSnapshot:
        """Return the counters and extras shapes as a frozen value."""
        return FutureMapSnapshot(
            max_slots=self._max_slots,
            debug=self._debug,
            topk=None if self._topk_p is None else self._topk_p.shape[1],
            hidden_size=None if self._hidden is None else self._hidden.shape[1],
            num_publishes=self._num_publishes,
            num_stashes=self._num_stashes,
            num_fence_waits=self._num_fence_waits,
            num_host_mirrors=self._num_host_mirrors,
            num_kept_writes=self._lens_log.num_entries + self._payload_log.num_entries,
        )

    def _buffer(self, row: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        fill = (POISON_FLOAT if dtype.is_floating_point else POISON_INT) if self._debug else 0
        buf = torch.full((self._max_slots, *row), fill, dtype=dtype, device=self._device)
        if buf.is_cuda:  # NOTE: once per buffer: its writers run on other streams than this fill
            torch.cuda.current_stream(buf.device).synchronize()
        return buf

    def _check_indices(self, indices: torch.Tensor, values: torch.Size, op: str) -> None:
        if indices.dim() != 1 or values != indices.shape:
            shapes = f"indices {tuple(indices.shape)} for values {tuple(values)}"
            raise RelayError(f"{op}: indices must be 1-D and match the values, got {shapes}")
        if not self._debug or indices.numel() == 0:
            return
        host = indices.cpu()  # debug only: a host sync
        bad = host[(host < 0) | (host >= self._max_slots)]
        if bad.numel() > 0:
            raise RelayError(f"{op}: slots {bad.tolist()} outside [0, {self._max_slots})")
        ordered = host.sort().values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise RelayError(f"{op}: repeated slots in {host.tolist()}")

    def _ordered_write(
        self, previous: Event | None, stream: Stream | None, write: _Write
    ) -> Event | None:
        # NOTE: write-after-write: a new write must land after the previous one of the same
        # buffers, so that the latest event implies every earlier write.
        if stream is None:
            previous = self._wait(previous)
            write()
            return previous
        if previous is not None:
            stream.wait_event(previous)
        stream.submit(write)
        return stream.record_event()

    def _wait(self, event: Event | None) -> Event | None:
        # Order the caller after ``event``; return it while it may still be pending.
        # NOTE: callers detach the event first, so an error of the fenced work is raised once
        # and the map stays usable after the owner's recovery (that write is lost).
        if event is None:
            return None
        self._num_fence_waits += 1
        event.wait_current()
        return None if event.query() else event

    def _covers(self, payload: RelayPayload) -> bool:
        """True when ``payload`` carries every extra the buffers hold (a read needs no buffer)."""
        return (
            (self._topk_p is None or payload.topk_p is not None)
            and (self._topk_index is None or payload.topk_index is not None)
            and (self._hidden is None or payload.hidden_states is not None)
        )

    def _lens_bufs(self) -> tuple[torch.Tensor]:
        return (self._new_seq_lens,)

    def _payload_bufs(self) -> tuple[torch.Tensor | None, ...]:
        return (self._bonus_tokens, self._topk_p, self._topk_index, self._hidden)

    def _read(
        self,
        log: WriteLog,
        indices: torch.Tensor,
        patch: RowPatch | None,
        bufs: tuple[torch.Tensor | None, ...],
    ) -> tuple[torch.Tensor | None, ...]:
        """The latest values of ``indices`` from ``log`` (debug: consumed, rows re-poisoned)."""
        if not self._debug:
            if patch is not None:
                return log.read_patched(indices, patch, bufs)
            return log.read(indices, None, bufs)
        newest = log.newest()
        if newest is not None and newest.indices is indices:
            log.discard_newest()  # consumed: the rows read are poisoned below
            values = newest.values
        else:
            values = log.read(indices, None, bufs)
        self._repoison(indices, tuple(b for b in bufs if b is not None))
        return values

    def _gather_seq_lens(self, indices: torch.Tensor, patch: RowPatch | None) -> torch.Tensor:
        if indices.numel() > 0:  # an empty set has nothing to wait for
            event, self._publish_event = self._publish_event, None
            if event is not None:
                self._publish_event = self._wait(event)
            if self._debug:
                self._consume(self._published, indices, "publish")
        (seq_lens,) = self._read(self._lens_log, indices, patch, self._lens_bufs())
        assert seq_lens is not None
        return seq_lens if seq_lens.dtype is torch.int64 else seq_lens.to(torch.int64)

    def _consume(self, marks: torch.Tensor, indices: torch.Tensor, writer: str) -> None:
        if not self._debug:
            return
        host = indices.cpu()
        stale = host[~marks[host]]
        if stale.numel() > 0:
            slots = stale.tolist()
            msg = f"[relay] consume once: slots {slots} have no {writer} since their last read"
            raise RelayError(msg)
        marks[host] = False

    def _repoison(self, indices: torch.Tensor, bufs: tuple[torch.Tensor, ...]) -> None:
        if not self._debug or indices.numel() == 0:
            return
        for buf in bufs:  # a fixed number of buffers, not a loop over requests
            buf[indices] = POISON_FLOAT if buf.dtype.is_floating_point else POISON_INT

    def _write_seq_lens(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        # NOTE: cast inside the write, so a temporary is allocated on the writing stream.
        self._new_seq_lens[indices] = values.to(torch.int64)
        if self._debug:
            self._published[indices.cpu()] = True

    def _write_payload(self, indices: torch.Tensor, payload: RelayPayload) -> None:
        self._bonus_tokens[indices] = payload.bonus_tokens.to(torch.int64)
        extras = (payload.topk_p, payload.topk_index, payload.hidden_states)
        for buf, value in zip((self._topk_p, self._topk_index, self._hidden), extras, strict=True):
            if buf is not None and value is not None:
                buf[indices] = value.to(buf.dtype)
        if self._debug:
            self._stashed[indices.cpu()] = True

    def _ensure_extras(self, payload: RelayPayload, n: int) -> bool:
        """Validate the payload's extras against the buffers; True if a buffer was created.

        Every extra is validated before any buffer is created: a refused stash changes nothing.
        """
        topk_p, topk_index, hidden = self._topk_p, self._topk_index, self._hidden
        if payload.topk_p is not None and payload.topk_index is not None:
            topk_p = self._extra(topk_p, payload.topk_p, n, torch.float32, "topk_p")
            topk_index = self._extra(topk_index, payload.topk_index, n, torch.int64, "topk_index")
        if (h := payload.hidden_states) is not None:
            hidden = self._extra(hidden, h, n, h.dtype, "hidden_states")
        created = (
            topk_p is not self._topk_p
            or topk_index is not self._topk_index
            or hidden is not self._hidden
        )
        self._topk_p, self._topk_index, self._hidden = topk_p, topk_index, hidden
        return created

    def _extra(
        self, buf: torch.Tensor | None, value: torch.Tensor, n: int, dtype: torch.dtype, name: str
    ) -> torch.Tensor:
        if value.dim() != 2 or value.shape[0] != n:
            raise RelayError(f"stash: {name} must be [{n}, width], got {tuple(value.shape)}")
        if buf is None:
            return self._buffer((value.shape[1],), dtype)
        if buf.shape[1] != value.shape[1]:
            raise InvalidConfig(
                f"stash: {name} width {value.shape[1]} != buffer width {buf.shape[1]}"
            )
        return buf
