"""Resolving a schedule batch's relay values from the FutureMap, at forward entry.

Under overlap, batch N+1 is scheduled before result N is settled, so its frontier and its bonus
tokens are `Unresolved` until the forward starts. These functions gather them from the
`FutureMap` (behind the publish fence) and *rebind* the batch fields; the scheduler calls them
on its own batch, just before `forward_isolation`.

Invariant: resolved values are new tensors; fields that are already resolved are left alone, so
a non-overlap batch passes through unchanged.
"""

from __future__ import annotations

from specstate.batch.schedule_batch import ScheduleBatch
from specstate.relay.future_map import FutureMap, Unresolved

__all__ = ["resolve_batch_forward_inputs", "resolve_batch_seq_lens"]


def resolve_batch_seq_lens(
    future_map: FutureMap, batch: ScheduleBatch, *, host_mirror: bool = False
) -> None:
    """Rebind ``batch.seq_lens`` (and its host mirror when asked) to the published frontier."""
    if not isinstance(batch.seq_lens, Unresolved):
        return
    value = batch.seq_lens
    resolved = future_map.resolve_seq_lens(
        value.future_indices, host_mirror=host_mirror, patch=value.patch
    )
    batch.seq_lens = resolved.seq_lens
    mirror = resolved.seq_lens_cpu
    batch.seq_lens_cpu = None if mirror is None else tuple(mirror)


def resolve_batch_forward_inputs(future_map: FutureMap, batch: ScheduleBatch) -> None:
    """Rebind ``batch.input_ids`` to the stashed bonus tokens and ``spec_info`` to the extras."""
    if not isinstance(batch.input_ids, Unresolved):
        return
    value = batch.input_ids
    inputs = future_map.resolve_forward_inputs(value.future_indices, patch=value.patch)
    batch.input_ids = inputs.bonus_tokens
    batch.spec_info = inputs  # a frozen payload of its own (made by this resolve)
