"""KV pages: `TokenSlotAllocator` owns the free pages of the token-slot pool.

Token slot id = ``page * P + offset``. The free pages are a host stack (all-or-nothing takes,
O(pages touched)); a flag per page says whether it is free, so a page freed twice is always
refused. The row methods of `ReqToTokenPool` (`specstate.memory.slots`) take and return pages
for the request rows; the prefix cache holds pages that no row owns any more.

Invariant:
    Page 0 (token slots ``0..P-1``) is padding: never handed out. Every other page is either
    free (on the stack, ``is_free``) or owned by exactly one row (or by the prefix cache).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation
from specstate.memory.host_arrays import Indices, IntArray, has_duplicates, host_index

__all__ = ["TokenSlotAllocator", "TokenSlotAllocatorSnapshot"]


@attrs.frozen(kw_only=True)
class TokenSlotAllocatorSnapshot:
    """Frozen statistics of a `TokenSlotAllocator` (page 0 counted nowhere)."""

    num_pages: int
    page_size: int
    num_free_pages: int
    num_used_pages: int

    @property
    def num_free_tokens(self) -> int:
        """Free token slots (whole free pages)."""
        return self.num_free_pages * self.page_size


@attrs.define(init=False, eq=False)
class TokenSlotAllocator:
    """Free KV pages: an int64 stack with a top pointer plus an ``is_free`` flag per page.

    Host state (NumPy): which page is free is decided by the host alone; only the token-slot
    ids written into ``req_to_token`` reach the device.

    Invariant:
        ``stack[:top]`` holds exactly the pages with ``is_free`` set, each once; page 0 is
        never free. `alloc_pages` and `free_pages` are all-or-nothing and touch only the pages
        they move (O(pages), never O(pool)).
    """

    _page_size: int
    _free_stack: IntArray = attrs.field(repr=False)  # [num_pages - 1]
    _top: int
    _is_free: npt.NDArray[np.bool_] = attrs.field(repr=False)  # [num_pages]

    def __init__(self, num_pages: int, page_size: int):
        """Create ``num_pages`` pages of ``page_size`` slots; pages ``1..num_pages-1`` free."""
        if num_pages < 2 or page_size < 1:
            raise InvalidConfig(
                f"need num_pages >= 2 (page 0 is padding) and page_size >= 1, "
                f"got {num_pages}, {page_size}"
            )
        self._page_size = page_size
        # Highest page at the bottom, so a fresh pool hands out pages 1, 2, 3, ... in order.
        self._free_stack = np.arange(num_pages - 1, 0, -1, dtype=np.int64)
        self._top = num_pages - 1
        self._is_free = np.ones(num_pages, dtype=np.bool_)
        self._is_free[0] = False

    @property
    def num_pages(self) -> int:
        """Pages including the padding page 0."""
        return int(self._is_free.shape[0])

    @property
    def page_size(self) -> int:
        """Token slots per page (P)."""
        return self._page_size

    def available_pages(self) -> int:
        """Free pages."""
        return self._top

    def available_tokens(self) -> int:
        """Free token slots (free pages × P)."""
        return self._top * self._page_size

    def alloc_pages(self, n: int) -> Tensor:
        """Take ``n`` pages (int64 [n]); `KvPoolExhausted` with nothing taken if too few."""
        return torch.from_numpy(self.take_pages(n))

    def take_pages(self, n: int) -> IntArray:
        """`alloc_pages` as a host array (the allocation layer's hot path)."""
        if n < 0:
            raise LedgerViolation(f"cannot allocate a negative number of pages: {n}")
        if n > self._top:
            raise KvPoolExhausted(
                f"requested {n} pages ({n * self._page_size} tokens), available {self._top} "
                f"pages ({self.available_tokens()} tokens)"
            )
        pages = self._free_stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free[pages] = False
        return pages

    def are_free(self, pages: IntArray) -> npt.NDArray[np.bool_]:
        """Whether each of ``pages`` is free (on the stack)."""
        free: npt.NDArray[np.bool_] = self._is_free[pages]
        return free

    def free_pages(self, pages: Indices, *, validate: bool = True) -> None:
        """Return ``pages``; `DoubleRelease` with nothing changed on any bad page.

        A page that is already free is always refused; ``validate`` adds the range and
        duplicate checks (per-page work that only a caller's bug can fail).
        """
        pages = host_index(pages)
        n = pages.size
        if n == 0:
            return
        if validate:
            lo, hi = int(pages.min()), int(pages.max())
            if lo < 1 or hi >= self.num_pages:
                raise DoubleRelease(
                    f"free of pages outside [1, {self.num_pages - 1}] (page 0 is padding): "
                    f"{lo}..{hi}"
                )
            if has_duplicates(pages):
                raise DoubleRelease(f"the same page appears twice in one free: {pages.tolist()}")
        if np.count_nonzero(self._is_free[pages]):
            already = pages[self._is_free[pages]]
            raise DoubleRelease(f"free of {already.size} already free pages: {already.tolist()}")
        self._free_stack[self._top : self._top + n] = pages
        self._top += n
        self._is_free[pages] = True

    def check_balance(self, owned: Tensor | None = None) -> None:
        """Prove the free list is consistent, and free ∪ ``owned`` = pages 1.. with no overlap.

        O(pool); debug and tests only. Raises `LedgerViolation` listing every problem found.
        """
        problems = self._stack_problems()
        if owned is not None and not problems:
            problems = self._owned_problems(host_index(owned))
        if problems:
            raise LedgerViolation("KV page balance broken: " + "; ".join(problems))

    def snapshot(self) -> TokenSlotAllocatorSnapshot:
        """Frozen page statistics."""
        return TokenSlotAllocatorSnapshot(
            num_pages=self.num_pages,
            page_size=self._page_size,
            num_free_pages=self._top,
            num_used_pages=self.num_pages - 1 - self._top,
        )

    def _stack_problems(self) -> list[str]:
        """Disagreements between the stack and ``is_free``."""
        free, n_marked = self._free_stack[: self._top], int(self._is_free.sum())
        if free.size and (int(free.min()) < 1 or int(free.max()) >= self.num_pages):
            return [f"the free stack holds out-of-range pages: {free.tolist()}"]
        checks = {
            "page 0 is marked free": bool(self._is_free[0]),
            "a page is on the free stack twice": has_duplicates(free),
            "a page on the free stack is not marked free": not bool(self._is_free[free].all()),
            f"{n_marked} pages marked free, stack has {self._top}": n_marked != self._top,
        }
        return [problem for problem, failed in checks.items() if failed]

    def _owned_problems(self, owned: IntArray) -> list[str]:
        """Ways in which ``owned`` and the free pages fail to partition pages 1.."""
        if owned.size and (int(owned.min()) < 1 or int(owned.max()) >= self.num_pages):
            return [f"owned pages out of range [1, {self.num_pages - 1}]: {owned.tolist()}"]
        uniq, counts = np.unique(owned, return_counts=True)
        leaked = self.num_pages - 1 - self._top - uniq.size
        checks = {
            f"pages owned twice: {uniq[counts > 1].tolist()}": bool((counts > 1).any()),
            f"owned pages that are free: {owned[self._is_free[owned]].tolist()}": bool(
                self._is_free[owned].any()
            ),
            f"{leaked} pages neither free nor owned (leaked)": leaked != 0,
        }
        return [problem for problem, failed in checks.items() if failed]
