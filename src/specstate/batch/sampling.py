"""Sampling state of a batch, and the forward-only copy that keeps penalties from doubling.

The scheduler owns a batch's `SamplingInfo`, including its `PenaltyAccumulator`, which folds each
settled output token into per-request token counts exactly once. A speculative round builds
several forward batches (draft, verify, draft-extend) from one schedule batch; if each of them
folded pending tokens, penalties would accumulate once per forward. So the worker never sees the
accumulator: `SamplingInfo.copy_for_forward` folds what is pending once, then returns a copy
whose counts are a frozen tensor and whose accumulator is None.

Invariant: each settled token is counted exactly once, however many forward copies are made;
tensors are rebound, never written in place, so a copy taken earlier never changes value.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from specstate.core.errors import InvalidConfig
from specstate.core.request import SamplingParams

__all__ = ["PenaltyAccumulator", "SamplingInfo"]


class PenaltyAccumulator:
    """Per-request output-token counts for frequency penalties (scheduler-owned).

    Tokens are queued with `cumulate` as results settle and folded into the counts by `fold`.
    """

    def __init__(self, counts: torch.Tensor) -> None:
        self._counts = counts
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_folded_tokens = 0

    @classmethod
    def zeros(cls, batch_size: int, vocab_size: int, *, device: torch.device) -> PenaltyAccumulator:
        """An accumulator with no token counted."""
        return cls(torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device))

    def cumulate(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Queue settled tokens: ``token_ids[i]`` was emitted by batch row ``rows[i]``."""
        self._pending.append((rows, token_ids))

    def fold(self) -> torch.Tensor:
        """Count every queued token once and return the counts (a new tensor each fold)."""
        if self._pending:
            rows = torch.cat([r for r, _ in self._pending])
            ids = torch.cat([t for _, t in self._pending])
            self._counts = self._counts.index_put(
                (rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True
            )
            self.num_folded_tokens += int(ids.numel())
            self._pending = []
        return self._counts

    def select(self, rows: torch.Tensor) -> PenaltyAccumulator:
        """A new accumulator for the kept rows (pending tokens folded first)."""
        return PenaltyAccumulator(self.fold().index_select(0, rows))

    def concat(self, other: PenaltyAccumulator) -> PenaltyAccumulator:
        """A new accumulator for ``self``'s rows followed by ``other``'s."""
        return PenaltyAccumulator(torch.cat([self.fold(), other.fold()]))


def _rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, rows)


def _cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None or b is None:
        if a is not b:
            raise InvalidConfig("cannot merge sampling state with and without penalties")
        return None
    return torch.cat([a, b])


@attrs.frozen(kw_only=True)
class SamplingInfo:
    """Per-row sampling parameters of a batch, as tensors.

    Attributes:
        temperatures: ``[B]`` float; 0 for a greedy row.
        top_ks: ``[B]`` int; the vocabulary size for rows without top-k.
        top_ps: ``[B]`` float; 1.0 for rows without nucleus sampling.
        frequency_penalties: ``[B]`` float, or None when no row is penalized.
        penalty_counts: ``[B, vocab]`` counts of each row's output tokens, or None.
        accumulator: folds settled tokens into ``penalty_counts`` (scheduler only); None on a
            forward copy: a worker cannot fold tokens.
        greedy_host: what the host knows without reading the device: True when every row is
            greedy, False when some row samples, None when unknown (then `is_all_greedy`
            reads ``temperatures``, a device synchronization).
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    frequency_penalties: torch.Tensor | None = None
    penalty_counts: torch.Tensor | None = None
    accumulator: PenaltyAccumulator | None = None
    greedy_host: bool | None = None

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device,
        frequency_penalties: Sequence[float] | None = None,
    ) -> SamplingInfo:
        """Build the batch's sampling state from each request's parameters."""
        penalties = None
        acc = None
        if frequency_penalties is not None and any(p != 0.0 for p in frequency_penalties):
            penalties = torch.tensor(frequency_penalties, dtype=torch.float32, device=device)
            acc = PenaltyAccumulator.zeros(len(params), vocab_size, device=device)
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], device=device),
            top_ks=torch.tensor([p.top_k or vocab_size for p in params], device=device),
            top_ps=torch.tensor([p.top_p for p in params], device=device),
            frequency_penalties=penalties,
            accumulator=acc,
            greedy_host=all(p.temperature == 0 for p in params),
        )

    @property
    def is_all_greedy(self) -> bool:
        """True when every row samples greedily (from the host flag when it is known)."""
        if self.greedy_host is not None:
            return self.greedy_host
        return bool((self.temperatures == 0).all())

    def copy_for_forward(self) -> SamplingInfo:
        """The worker's copy: pending tokens folded once, counts frozen, no accumulator."""
        counts = self.accumulator.fold() if self.accumulator is not None else self.penalty_counts
        return attrs.evolve(self, penalty_counts=counts, accumulator=None)

    def apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row per entry of ``rows``) minus each row's frequency penalty."""
        if self.frequency_penalties is None or self.penalty_counts is None:
            return logits
        penalty = self.frequency_penalties.index_select(0, rows).unsqueeze(1)
        return logits - penalty * self.penalty_counts.index_select(0, rows)

    def select(self, rows: torch.Tensor) -> SamplingInfo:
        """The sampling state of the kept rows (new tensors)."""
        return SamplingInfo(
            temperatures=self.temperatures.index_select(0, rows),
            top_ks=self.top_ks.index_select(0, rows),
            top_ps=self.top_ps.index_select(0, rows),
            frequency_penalties=_rows(self.frequency_penalties, rows),
            penalty_counts=_rows(self.penalty_counts, rows),
            accumulator=None if self.accumulator is None else self.accumulator.select(rows),
            greedy_host=True if self.greedy_host else None,  # a subset of greedy rows is greedy
        )

    def concat(self, other: SamplingInfo) -> SamplingInfo:
        """The sampling state of ``self``'s rows followed by ``other``'s (new tensors)."""
        acc = None
        if self.accumulator is not None and other.accumulator is not None:
            acc = self.accumulator.concat(other.accumulator)
        return SamplingInfo(
            temperatures=torch.cat([self.temperatures, other.temperatures]),
            top_ks=torch.cat([self.top_ks, other.top_ks]),
            top_ps=torch.cat([self.top_ps, other.top_ps]),
            frequency_penalties=_cat(self.frequency_penalties, other.frequency_penalties),
            penalty_counts=None,
            accumulator=acc,
            greedy_host=(
                None
                if self.greedy_host is None or other.greedy_host is None
                else self.greedy_host and other.greedy_host
            ),
        )
