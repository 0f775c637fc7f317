"""KV sizing for one decode round: how many token slots a request reserves, and what that costs.

This module owns no state: it holds the speculative-window configuration (`SpecWindow`) and the
pure, vectorized arithmetic that the allocation layer and the retraction check share, so that the
memory estimate and the reservation agree page for page.

One request row of ``req_to_token`` (positions, left to right; P = page size)::

    0           protected      committed           allocated                 row width
    |-- prefix --|--- own KV ----|--- reserved --------|------- free ------------|
    | tree cache | confirmed by  | rejected drafts and | never written; at least  |
    |  (shared)  | the target    | the next 2L (or 3L) | row_headroom past the    |
    |            |               | slots; page aligned | context length           |

Invariant:
    ``0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <= row width``, and a
    decode reservation never shrinks ``kv_allocated_len``: the next allocated length is
    ``max(allocated, ceil_P(committed + R))`` with ``R = reserve_windows * L``.
    With overlap the device frontier leads ``committed`` by at most one verify (``<= L``
    tokens), so draft and verify writes (``<= L`` more) stay below ``committed + 2L``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import attrs
import torch

from specstate.core.errors import InvalidConfig, LedgerViolation

__all__ = [
    "DecodeAllocLens",
    "SpecWindow",
    "ceil_to_page",
    "decode_tokens_needed",
    "page_aligned_decode_alloc_lens",
    "spec_decode_tokens_needed",
]

LengthsLike = torch.Tensor | Sequence[int]


def _check_spec_window(window: SpecWindow) -> None:
    """Raise `InvalidConfig` naming the numbers when `window` is inconsistent."""
    w = window
    if w.page_size < 1:
        raise InvalidConfig(f"page_size must be >= 1, got {w.page_size}")
    if w.reserve_windows < 2:
        raise InvalidConfig(
            f"reserve_windows must be >= 2 (one verify of host lag + one round), "
            f"got {w.reserve_windows}"
        )
    if not w.speculative:
        if (w.num_steps, w.topk, w.num_draft_tokens, w.keeps_draft_kv) != (0, 1, 0, False):
            raise InvalidConfig(
                "without speculation num_steps, topk, num_draft_tokens, keeps_draft_kv must be "
                f"0, 1, 0, False; got {w.num_steps}, {w.topk}, {w.num_draft_tokens}, "
                f"{w.keeps_draft_kv}"
            )
        return
    if w.num_steps < 1 or w.topk < 1 or w.num_draft_tokens < 1:
        raise InvalidConfig(
            "speculation needs num_steps >= 1, topk >= 1, num_draft_tokens >= 1; got "
            f"num_steps={w.num_steps}, topk={w.topk}, num_draft_tokens={w.num_draft_tokens}"
        )


@attrs.frozen(kw_only=True)
class SpecWindow:
    """The speculative window of one worker, as the memory layer sizes it.

    Attributes:
        speculative: Whether the worker speculates at all.
        num_steps: Draft steps per round (``0`` without speculation).
        topk: Draft branches per step (``1`` for a chain).
        num_draft_tokens: D, tokens verified per round (``0`` without speculation).
        keeps_draft_kv: Whether the draft writes KV into the request's row (EAGLE yes, n-gram no).
        page_size: P, token slots per KV page.
        reserve_windows: Windows of L reserved past ``committed``: 2 (double buffer for the
            one-verify host lag), 3 for algorithms that prefetch the next draft.

    Invariant:
        ``reserve >= 2 * alloc_len_per_decode``; every field combination is validated at
        construction (`InvalidConfig`), so the derived numbers are always meaningful.
    """

    speculative: bool
    num_steps: int
    topk: int
    num_draft_tokens: int
    keeps_draft_kv: bool
    page_size: int
    reserve_windows: int = 2

    def __attrs_post_init__(self) -> None:
        """Validate the combination of fields."""
        _check_spec_window(self)

    @classmethod
    def none(cls, page_size: int, *, reserve_windows: int = 2) -> SpecWindow:
        """Return the window of a worker that does not speculate (L = 1)."""
        return cls(
            speculative=False,
            num_steps=0,
            topk=1,
            num_draft_tokens=0,
            keeps_draft_kv=False,
            page_size=page_size,
            reserve_windows=reserve_windows,
        )

    @property
    def alloc_len_per_decode(self) -> int:
        """L: token slots one round may write past the frontier it starts from."""
        if not self.speculative:
            return 1
        steps, topk, p = self.num_steps, self.topk, self.page_size
        if p == 1 or topk == 1 or not self.keeps_draft_kv:
            return max(steps * topk, self.num_draft_tokens)
        # Paged tree: each branch gets whole pages starting from the partial prefix-tail page.
        pages_per_branch = -(-(p - 1 + steps) // p)
        return max(pages_per_branch * p * topk, self.num_draft_tokens)

    @property
    def reserve(self) -> int:
        """R = reserve_windows · L: tokens reserved past ``kv_committed_len`` each round."""
        return self.reserve_windows * self.alloc_len_per_decode

    @property
    def row_headroom(self) -> int:
        """Extra ``req_to_token`` row width beyond the context length.

        It covers the reservation of a request at the context's end: ``ceil_P(committed +
        R)`` stays below ``context + R + P - 1``, for a chain and a tree alike (a tree's R
        is far wider than its D, also at page size 1).
        """
        base = 4 + self.num_draft_tokens
        if self.speculative:
            return max(base, self.reserve + self.page_size - 1)
        return base


@attrs.frozen(kw_only=True)
class DecodeAllocLens:
    """The per-request reservation of one decode round.

    Attributes:
        cur: int64 [B], the allocated lengths before the round.
        nxt: int64 [B], the allocated lengths after it.
        needed: ``Σ(nxt - cur)`` token positions to map.

    Invariant:
        ``nxt >= cur`` elementwise; ``nxt`` is page aligned wherever it grew.
    """

    cur: torch.Tensor
    nxt: torch.Tensor
    needed: int


def _check_page_size(page_size: int) -> None:
    """Raise `InvalidConfig` unless ``page_size >= 1``."""
    if page_size < 1:
        raise InvalidConfig(f"page_size must be >= 1, got {page_size}")


@overload
def ceil_to_page(x: int, page_size: int) -> int: ...
@overload
def ceil_to_page(x: torch.Tensor, page_size: int) -> torch.Tensor: ...
def ceil_to_page(x: int | torch.Tensor, page_size: int) -> int | torch.Tensor:
    """Round ``x`` up to a multiple of ``page_size`` (an int or an integer tensor)."""
    _check_page_size(page_size)
    if isinstance(x, torch.Tensor):
        return torch.div(x + (page_size - 1), page_size, rounding_mode="floor") * page_size
    return -(-x // page_size) * page_size


def _as_lengths(values: LengthsLike, name: str) -> torch.Tensor:
    """Return ``values`` as a 1-D int64 tensor; negative lengths raise `LedgerViolation`."""
    if isinstance(values, torch.Tensor):
        t = values.to(torch.int64)
    else:
        t = torch.tensor(list(values), dtype=torch.int64)
    if t.dim() != 1:
        raise LedgerViolation(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.numel() and int(t.min()) < 0:
        raise LedgerViolation(f"{name} has a negative length: {int(t.min())}")
    return t


def _cur_nxt(
    allocated: LengthsLike, committed: LengthsLike, reserve: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(cur, nxt)`` with ``nxt = max(cur, ceil_P(committed + reserve))``."""
    _check_page_size(page_size)
    if reserve < 0:
        raise InvalidConfig(f"reserve must be >= 0, got {reserve}")
    cur = _as_lengths(allocated, "allocated")
    com = _as_lengths(committed, "committed").to(cur.device)
    if cur.shape != com.shape:
        raise LedgerViolation(
            f"allocated and committed differ in shape: {tuple(cur.shape)} vs {tuple(com.shape)}"
        )
    return cur, torch.maximum(cur, ceil_to_page(com + reserve, page_size))


def page_aligned_decode_alloc_lens(
    allocated: LengthsLike, committed: LengthsLike, *, reserve: int, page_size: int
) -> DecodeAllocLens:
    """Compute the speculative decode reservation of a batch (docs/memory.md, "Sizing").

    Args:
        allocated: ``kv_allocated_len`` per request.
        committed: ``kv_committed_len`` per request.
        reserve: R, tokens to reserve past ``committed``.
        page_size: P.

    Returns:
        ``cur = allocated``, ``nxt = max(cur, ceil_P(committed + reserve))`` and
        ``needed = Σ(nxt - cur)``.

    Invariant:
        The reservation never shrinks (``nxt >= cur``); it never reads or changes ``committed``
        beyond using it as the base.
    """
    cur, nxt = _cur_nxt(allocated, committed, reserve, page_size)
    return DecodeAllocLens(cur=cur, nxt=nxt, needed=int((nxt - cur).sum()))


def spec_decode_tokens_needed(
    allocated: LengthsLike, committed: LengthsLike, *, reserve: int, page_size: int
) -> int:
    """Return the free tokens the next speculative reservation takes from the pool.

    This is ``Σ(ceil_P(nxt) - ceil_P(cur))`` in tokens (whole pages times P): positions in the
    page that ``cur`` already started reuse that page, so only new pages count.

    Invariant:
        Equals ``P ×`` the pages `grow_rows` allocates for ``page_aligned_decode_alloc_lens``.
    """
    cur, nxt = _cur_nxt(allocated, committed, reserve, page_size)
    return int((ceil_to_page(nxt, page_size) - ceil_to_page(cur, page_size)).sum())


def decode_tokens_needed(allocated: LengthsLike, page_size: int) -> int:
    """Return the free tokens one non-speculative decode step (+1 token each) takes.

    A request needs a new page exactly when its allocated length is a multiple of P
    (its last page is full, or it has none).

    Invariant:
        Equals ``P ×`` the pages `grow_rows` allocates for ``nxt = allocated + 1``.
    """
    _check_page_size(page_size)
    cur = _as_lengths(allocated, "allocated")
    return page_size * int((cur % page_size == 0).sum())
