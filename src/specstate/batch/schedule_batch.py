"""The scheduler's batch: which requests run next, and the tensors their forward will read.

The scheduler owns every field of a `ScheduleBatch`. Under overlap, the forward of batch N may
still read its tensors while the host prepares batch N+1 from the same object, so nothing here
writes a tensor or list in place: `filter`, `merge` and every prepare step *rebind* fields to new
values. A reference taken earlier (by a forward, a snapshot, the keep-alive ring) never changes
value.

A field that the device decides (the frontier ``seq_lens`` and the bonus ``input_ids`` under
overlap) holds `Unresolved` until the FutureMap resolves it at forward entry.

Invariant: ``len(reqs) == len(incarnations) == req_pool_indices.numel()``; when set,
``future_indices`` is parallel to ``req_pool_indices`` and ``seq_lens_cpu`` has one entry per
request.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Final

import attrs
import torch

from specstate.batch.budgets import VerifyBudgets
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.sampling import SamplingInfo
from specstate.core.errors import InvalidConfig
from specstate.core.request import Req
from specstate.grammar.rows import GrammarRows
from specstate.relay.future_map import RelayPayload, Unresolved

__all__ = ["ScheduleBatch"]

SeqLens = torch.Tensor | Unresolved
"""A device frontier: a tensor once resolved, `Unresolved` while it lives in the FutureMap."""


def _select_lens(value: SeqLens, rows: torch.Tensor) -> SeqLens:
    if isinstance(value, Unresolved):
        return Unresolved(value.future_indices.index_select(0, rows))
    return value.index_select(0, rows)


def _cat_lens(a: SeqLens, b: SeqLens) -> SeqLens:
    if isinstance(a, Unresolved) and isinstance(b, Unresolved):
        return Unresolved(torch.cat([a.future_indices, b.future_indices]))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.cat([a, b])
    raise InvalidConfig("cannot merge a resolved frontier with an unresolved one")


def _opt_rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, rows.to(t.device))


def _opt_cat(a: torch.Tensor | None, b: torch.Tensor | None, name: str) -> torch.Tensor | None:
    if a is None and b is None:
        return None
    if a is None or b is None:
        raise InvalidConfig(f"cannot merge relay payloads with and without {name}")
    return torch.cat([a, b])


def _select_payload(p: RelayPayload | None, rows: torch.Tensor) -> RelayPayload | None:
    if p is None:
        return None
    return RelayPayload(
        bonus_tokens=p.bonus_tokens.index_select(0, rows.to(p.bonus_tokens.device)),
        topk_p=_opt_rows(p.topk_p, rows),
        topk_index=_opt_rows(p.topk_index, rows),
        hidden_states=_opt_rows(p.hidden_states, rows),
    )


def _cat_payload(a: RelayPayload | None, b: RelayPayload | None) -> RelayPayload | None:
    if a is None or b is None:
        if a is not b:
            raise InvalidConfig("cannot merge a batch with a relay payload and one without")
        return None
    return RelayPayload(
        bonus_tokens=torch.cat([a.bonus_tokens, b.bonus_tokens]),
        topk_p=_opt_cat(a.topk_p, b.topk_p, "topk_p"),
        topk_index=_opt_cat(a.topk_index, b.topk_index, "topk_index"),
        hidden_states=_opt_cat(a.hidden_states, b.hidden_states, "hidden_states"),
    )


@attrs.define(eq=False, slots=False)
class ScheduleBatch:
    """Requests scheduled together, and the inputs of their next forward (scheduler-owned).

    Attributes:
        reqs: the requests, one per row.
        incarnations: each request's incarnation when it was scheduled; a result is settled
            only for requests whose incarnation still matches.
        forward_mode: a scheduler-level mode (EXTEND / DECODE / MIXED / IDLE).
        req_pool_indices: ``[B]`` request slots, int64.
        seq_lens: ``[B]`` device frontier — the KV-ready prefix the forward may use.
        sampling_info: per-row sampling state; the worker sees a forward copy only.
        seq_lens_cpu: host mirror of ``seq_lens`` when one is kept, else None.
        input_ids: flat input tokens, `Unresolved` bonus tokens under overlap, or None.
        out_cache_loc: token slots the forward writes (extend paths), or None.
        prefix_lens: per-row KV prefix before an extend: host ints when the host knows every
            row's prefix (EXTEND), a device tensor for MIXED (a running tail's prefix is its
            device frontier, unknown to the host under overlap), or None.
        positions: ``[sum(extend_lens)]`` device positions of an extend's tokens, built at
            scheduling (so the launch needs no host-to-device copy), or None.
        extend_lens: per-row tokens of an extend, or None.
        spec_info: the relay payload the worker gets for the next round, or None.
        future_indices: ``[B]`` FutureMap rows this batch's relay values live in, or None.
        num_draft_steps: draft steps of this DECODE round chosen by the engine's draft policy
            (adaptive draft length), or None: the worker's own ``num_steps``.
        verify_budgets: ``[B]`` per-row verify budgets of this DECODE round, planned by the
            engine's verify-budget policy from settled history (row ``i`` verifies at most
            ``budgets[i]`` drafts), or None: every row verifies the round's width. Per round:
            cleared by ``filter`` and ``merge``.
        grammar: the forward's grammar view (`GrammarRows`), set at launch by the grammar
            table when a row samples under a grammar; None otherwise. Per forward: cleared
            by ``filter`` and ``merge``.
    """

    reqs: tuple[Req, ...]
    incarnations: tuple[int, ...]
    forward_mode: ForwardMode
    req_pool_indices: torch.Tensor
    seq_lens: SeqLens
    sampling_info: SamplingInfo
    seq_lens_cpu: tuple[int, ...] | None = None
    input_ids: torch.Tensor | Unresolved | None = None
    out_cache_loc: torch.Tensor | None = None
    prefix_lens: tuple[int, ...] | torch.Tensor | None = None
    extend_lens: tuple[int, ...] | None = None
    positions: torch.Tensor | None = None
    spec_info: RelayPayload | None = None
    future_indices: torch.Tensor | None = None
    num_draft_steps: int | None = None
    verify_budgets: VerifyBudgets | None = None
    grammar: GrammarRows | None = None
    # The request ids, when the caller already has them (a persistent batch); else derived.
    _ids: tuple[str, ...] | None = attrs.field(default=None, alias="ids")

    def __attrs_post_init__(self) -> None:
        n = len(self.reqs)
        if len(self.incarnations) != n or self.req_pool_indices.numel() != n:
            raise InvalidConfig(
                f"batch of {n} requests has {len(self.incarnations)} incarnations and "
                f"{self.req_pool_indices.numel()} slots"
            )
        if not self.forward_mode.is_scheduler_mode():
            raise InvalidConfig(f"{self.forward_mode.value} is worker-internal")

    @property
    def batch_size(self) -> int:
        """Number of requests (rows)."""
        return len(self.reqs)

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The request id of every row."""
        if self._ids is None:  # derived each time: reading never changes the batch
            return tuple(r.request_id for r in self.reqs)
        return self._ids

    def field_bindings(self) -> dict[str, object]:
        """Every declared field's current binding (for a shallow snapshot)."""
        return dict(zip(_FIELD_NAMES, _read_fields(self), strict=True))

    def restore_fields(self, bindings: dict[str, object]) -> None:
        """Rebind every field of ``bindings`` (from `field_bindings`) that was rebound since.

        A field still bound to the very same object is left alone (the common case: only
        what a forward rebound is put back).
        """
        if len(bindings) != len(_FIELD_NAMES):  # a subset: rebind each
            for name, value in bindings.items():
                setattr(self, name, value)
            return
        for (name, old), now in zip(bindings.items(), _read_fields(self), strict=True):
            if now is not old:
                setattr(self, name, old)

    def filter(self, keep: Sequence[int]) -> None:
        """Keep only rows ``keep`` (in that order), rebinding every field; frees no KV.

        Per-forward inputs (``input_ids``, ``out_cache_loc``, prefix and extend lengths) are
        cleared: the next prepare step rebuilds them.
        """
        if not keep:
            raise InvalidConfig("filter would empty the batch; drop it instead")
        # Every per-row tensor lives on the batch's device: so does the index.
        rows = torch.tensor(list(keep), dtype=torch.int64, device=self._device)
        self.reqs = tuple(self.reqs[i] for i in keep)
        self.incarnations = tuple(self.incarnations[i] for i in keep)
        self.req_pool_indices = self.req_pool_indices.index_select(0, rows)
        self.seq_lens = _select_lens(self.seq_lens, rows)
        self.sampling_info = self.sampling_info.select(rows)
        if self.seq_lens_cpu is not None:
            self.seq_lens_cpu = tuple(self.seq_lens_cpu[i] for i in keep)
        if self.future_indices is not None:
            self.future_indices = self.future_indices.index_select(0, rows)
        self.spec_info = _select_payload(self.spec_info, rows)
        self._clear_forward_inputs()

    def merge(self, other: ScheduleBatch) -> None:
        """Append ``other``'s rows after this batch's, rebinding every field; frees no KV."""
        self.reqs = self.reqs + other.reqs
        self.incarnations = self.incarnations + other.incarnations
        self.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])
        self.seq_lens = _cat_lens(self.seq_lens, other.seq_lens)
        self.sampling_info = self.sampling_info.concat(other.sampling_info)
        if self.seq_lens_cpu is None or other.seq_lens_cpu is None:
            self.seq_lens_cpu = None
        else:
            self.seq_lens_cpu = self.seq_lens_cpu + other.seq_lens_cpu
        if self.future_indices is None or other.future_indices is None:
            self.future_indices = None
        else:
            self.future_indices = torch.cat([self.future_indices, other.future_indices])
        self.spec_info = _cat_payload(self.spec_info, other.spec_info)
        self._clear_forward_inputs()

    @property
    def _device(self) -> torch.device:
        if isinstance(self.seq_lens, Unresolved):
            return self.seq_lens.future_indices.device
        return self.seq_lens.device

    def _clear_forward_inputs(self) -> None:
        self._ids = None  # the rows changed
        self.input_ids = None
        self.out_cache_loc = None
        self.prefix_lens = None
        self.extend_lens = None
        self.positions = None
        self.verify_budgets = None
        self.grammar = None


_FIELD_NAMES: Final = tuple(f.name for f in attrs.fields(ScheduleBatch))
"""The declared fields, in order (read once: `field_bindings` runs every round)."""
_read_fields: Final = operator.attrgetter(*_FIELD_NAMES)
