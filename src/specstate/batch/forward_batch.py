"""The worker's frozen view of one forward, built from a schedule batch without changing it.

A worker may build several `ForwardBatch` values in one speculative round (draft, verify,
draft-extend) with `attrs.evolve`; none of them can write back into the `ScheduleBatch`, which
the scheduler owns. Building one requires the relay values to be resolved: a batch whose
frontier is still `Unresolved` raises `RelayError` instead of handing the worker a placeholder.

Positions: for EXTEND / MIXED rows, token ``i`` of a row sits at ``prefix_len + i``; for
DECODE, ``seq_lens`` is the KV-ready prefix before this forward, so the first new token of a row
sits at position ``seq_lens[row]`` (the bonus token, root of the next verify).
"""

from __future__ import annotations

import attrs
import torch

from specstate.batch.forward_mode import ForwardMode
from specstate.batch.sampling import SamplingInfo
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import RelayError
from specstate.grammar.rows import GrammarRows
from specstate.relay.future_map import RelayPayload, Unresolved

__all__ = ["ForwardBatch"]


def _extend_positions(
    prefix_lens: tuple[int, ...], extend_lens: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    starts = torch.tensor(prefix_lens, dtype=torch.int64)
    lens = torch.tensor(extend_lens, dtype=torch.int64)
    row_start = torch.repeat_interleave(starts - (torch.cumsum(lens, 0) - lens), lens)
    return (torch.arange(int(lens.sum()), dtype=torch.int64) + row_start).to(device)


@attrs.frozen(kw_only=True)
class ForwardBatch:
    """Everything one forward reads; frozen, so a worker cannot write scheduler state.

    Attributes:
        forward_mode: EXTEND (prefill or chunk), DECODE (one round), MIXED (an extend to the
            worker: running requests ride as 1-token extends of their bonus) or IDLE.
        request_ids: one id per row.
        req_pool_indices: ``[B]`` int64 request slots: row ``i``'s KV positions live at
            ``req_to_token[req_pool_indices[i], position]``.
        seq_lens: ``[B]`` device frontier. DECODE: the KV-ready prefix ``S`` before this
            forward (the bonus token sits at ``S``). EXTEND: prefix plus this chunk.
        seq_lens_cpu: host mirror of ``seq_lens`` when the host knows it, else None (under
            overlap the frontier is decided on the device).
        input_ids: flat input tokens (EXTEND: ``[sum(extend_lens)]``; DECODE: ``[B]`` bonus
            tokens), or None for IDLE.
        positions: the position of every input token, on the device, or None for IDLE.
        out_cache_loc: token slots an extend writes its KV to (one per input token), or None
            for DECODE (the worker writes inside the reserved window of each row).
        prefix_lens: per-row KV prefix before an extend: host ints, or a device tensor for a
            MIXED batch (a running tail's prefix is its device frontier); None for DECODE.
        extend_lens: per-row input tokens of an extend, or None for DECODE.
        sampling_info: per-row sampling parameters as tensors.
        spec_info: the relay payload the previous round (or chunk) of these rows stashed, or
            None when no row has one.
        num_draft_steps: for a DECODE round under an adaptive draft policy, how many tokens
            to draft this round, in ``[0, num_steps]`` (0: none, a plain decode step); None:
            the worker's own ``num_steps`` (`draft_steps` reads it). A worker that declares
            ``WorkerCapabilities.supports_adaptive_steps`` honours it.
        verify_budgets: for a DECODE round under a verify-budget policy, ``[B]`` int64 on the
            device: row ``i`` verifies at most ``verify_budgets[i]`` drafts (its accepted run
            is at most ``verify_budgets[i] + 1`` tokens) and writes no KV past its frontier
            ``+ verify_budgets[i] + 1``; 0 is a plain decode step that still extends the
            drafter. None: every row verifies the round's width. A worker that declares
            ``WorkerCapabilities.supports_verify_budgets`` honours it.
        grammar: the grammar view of this forward (`GrammarRows`: packed bitmasks per sampled
            or verified position of the rows whose request has a grammar), or None when no
            row has one. A worker that declares ``WorkerCapabilities.supports_grammar`` uses
            it as docs/workers.md describes ("Grammars").
    """

    forward_mode: ForwardMode
    request_ids: tuple[str, ...]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: tuple[int, ...] | None
    input_ids: torch.Tensor | None
    positions: torch.Tensor | None
    out_cache_loc: torch.Tensor | None
    prefix_lens: tuple[int, ...] | torch.Tensor | None
    extend_lens: tuple[int, ...] | None
    sampling_info: SamplingInfo
    spec_info: RelayPayload | None
    num_draft_steps: int | None = None
    grammar: GrammarRows | None = None
    verify_budgets: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        """Number of requests (rows)."""
        return len(self.request_ids)

    def draft_steps(self, default: int) -> int:
        """Tokens to draft in this round: ``num_draft_steps``, else ``default`` (the worker's)."""
        return default if self.num_draft_steps is None else self.num_draft_steps

    @classmethod
    def from_schedule(
        cls, batch: ScheduleBatch, *, positions: torch.Tensor | None = None
    ) -> ForwardBatch:
        """The frozen view of ``batch``'s next forward; ``batch`` is not modified.

        ``positions``: a decode round's positions when the caller already made them (a fresh
        tensor equal to ``seq_lens``, as the launch's one operation on a device gives); else
        they are derived from the batch.

        Raises:
            RelayError: ``seq_lens`` or ``input_ids`` is still `Unresolved`.
        """
        if isinstance(batch.seq_lens, Unresolved) or isinstance(batch.input_ids, Unresolved):
            raise RelayError(
                f"batch of {batch.batch_size} requests ({', '.join(batch.request_ids[:4])}) "
                "has unresolved relay values; resolve them before building a forward"
            )
        return cls(
            forward_mode=batch.forward_mode,
            request_ids=batch.request_ids,
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            input_ids=batch.input_ids,
            positions=cls._positions(batch, batch.seq_lens) if positions is None else positions,
            out_cache_loc=batch.out_cache_loc,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            sampling_info=batch.sampling_info,
            spec_info=batch.spec_info,
            num_draft_steps=batch.num_draft_steps,
            grammar=batch.grammar,
            verify_budgets=None if batch.verify_budgets is None else batch.verify_budgets.device,
        )

    @staticmethod
    def _positions(batch: ScheduleBatch, seq_lens: torch.Tensor) -> torch.Tensor | None:
        mode = batch.forward_mode
        if mode is ForwardMode.DECODE:  # the round's first position is the frontier
            return seq_lens.clone()
        if mode.is_extend() and batch.positions is not None:
            return batch.positions  # built at scheduling, already on the device
        prefix, lens = batch.prefix_lens, batch.extend_lens
        if mode.is_extend() and isinstance(prefix, tuple) and lens is not None:
            return _extend_positions(prefix, lens, seq_lens.device)
        return None
