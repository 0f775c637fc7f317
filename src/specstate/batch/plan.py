"""Plans: what the scheduler hands the launch for one batch, and what settlement reads back.

A `LaunchPlan` is a value: the `ScheduleBatch` to launch plus the host-side facts settlement needs
about its rows (slots, output-row epochs, which prefill chunks complete). It is built once by the
scheduler and read by the launcher, the result processor and every capability hook; nobody
changes it after it is built.
"""

from __future__ import annotations

import attrs
import torch

from specstate.batch.forward_mode import ForwardMode
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.handoff.record import HandoffRecord
from specstate.memory.host_arrays import IntArray

__all__ = ["LaunchPlan", "PrefillPart"]


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """One batch to launch, with what settlement needs to know about its rows.

    Attributes:
        batch: the batch; its prefill rows (if any) come first, then the decode-like rows.
        slots: ``[B]`` host request slots of the rows.
        epochs: ``[B]`` output-row epochs at scheduling (a changed epoch marks a stale row).
        last_chunk: one flag per prefill row: its chunk completes the prefill.
        prefill: the host-known prefill part of a MIXED batch, else None.
        relay_rows: ``[n]`` device index of the rows whose inputs come from the FutureMap
            (continuing chunks, running tails), built at scheduling; None when none does.
        handoff: an EXTEND batch of handed-off requests (one record per row): the launcher
            writes their state (`HandoffWorker.import_handoff`) instead of running a forward;
            None for every other batch.
    """

    batch: ScheduleBatch
    slots: torch.Tensor
    epochs: IntArray
    last_chunk: tuple[bool, ...] = ()
    prefill: PrefillPart | None = None
    relay_rows: torch.Tensor | None = None
    handoff: tuple[HandoffRecord, ...] | None = None
    slots_host: IntArray = attrs.field(
        default=attrs.Factory(lambda plan: plan.slots.numpy(), takes_self=True)
    )
    """``slots`` as a host array (the same memory)."""
    detached: int = -1
    """`OutputTable.num_detached` when ``epochs`` were current (-1: not known): while it is
    unchanged, no row of the batch went stale, and settlement need not compare epochs."""

    @property
    def is_decode(self) -> bool:
        """True for a decode round."""
        return self.batch.forward_mode is ForwardMode.DECODE


@attrs.frozen(kw_only=True)
class PrefillPart:
    """The host-known prefill rows of a MIXED batch; its running tails bind at forward entry."""

    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    tail_slots: torch.Tensor
    prefix_lens_device: torch.Tensor  # ``prefix_lens`` on the device
    positions: torch.Tensor  # the prefill tokens' positions, on the device
