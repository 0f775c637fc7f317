"""Prefix rows: which cached prefix each request row holds, from admission to release.

`PrefixRows` owns the link between request rows and the `PrefixCache`: the matched path each
row holds (its lock) and the admission statistics. The allocator calls it; nothing else does::

    admission   match(tokens)      longest cached prefix of prompt + earlier outputs, at most
                                   n - 1 of n tokens (the last token is always recomputed, so
                                   the prefill has logits), cut down to whole pages
                map(slot, match)   hold the path; req_to_token[slot, 0:m] = its pages
    release     release(...)       insert [0, k) of the row; free the row's pages that turned
                                   out to duplicate cached ones; drop the hold

What a release inserts (``insertable_lens``): for a request that FINISHED by a stop or its
length cap, ``k = floor_P(min(kv_committed_len, prompt + finished_len - lookahead))``: only
committed KV (never the reserved frontier, never a rejected draft's slot), and only of tokens
the user saw (the KV of tokens settled past a stop is cut), and for BIGRAM keys only positions
whose next token was seen too. A request that was aborted, retracted or failed inserts nothing:
its KV may belong to a chunk whose forward never finished, or to a failed forward, and a
retracted request re-matches the prefix it held (which stays cached) when it is re-admitted.

Invariant: a row holds a path iff it was admitted with a non-empty match and not yet released;
the path's pages are exactly what the row maps at ``[0, cache_protected_len)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

import attrs
import numpy as np

from specstate.core.errors import LedgerViolation
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.memory.host_arrays import IntArray
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.prefix_cache import (
    PrefixCache,
    PrefixCacheSnapshot,
    PrefixMatch,
    as_token_array,
)
from specstate.memory.slots import ReqToTokenPool

__all__ = ["NoPrefixRows", "PrefixRows", "insertable_lens"]

_INSERTING = frozenset({FinishReason.STOP, FinishReason.LENGTH})


def insertable_lens(
    reqs: Sequence[Req], committed: IntArray, *, lookahead: int, page_size: int
) -> IntArray:
    """Positions of each of ``reqs``' rows a release may cache (see the module docstring),
    given their ``kv_committed_len``: array operations, no Python call per request."""
    visible = np.array(Req.visible_lens(reqs, _INSERTING), dtype=np.int64)  # -1: none
    return np.maximum(np.minimum(committed, visible - lookahead), 0) // page_size * page_size


class PrefixRows:
    """The rows' holds on the prefix cache (see the module docstring).

    Args:
        cache: the tree.
        req_pool: the request rows (read to insert, written through `map_prefix`).
        token_pool: where evicted and duplicate pages go back.
        validate: run the per-row checks (tests and ``check_invariants``).
    """

    def __init__(
        self,
        cache: PrefixCache,
        req_pool: ReqToTokenPool,
        token_pool: TokenSlotAllocator,
        *,
        validate: bool = True,
    ) -> None:
        self.cache = cache
        self._req_pool = req_pool
        self._token_pool = token_pool
        self._validate = validate
        self._held: dict[int, PrefixMatch] = {}
        self._fill: dict[int, IntArray] = {}  # each row's tokens at admission, as an array
        self._admissions = 0
        self._queried = 0
        self._hits = 0

    # ------------------------------------------------------------- admission
    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``tokens`` that leaves at least one token to prefill.

        The match keeps ``tokens`` as an array (`PrefixMatch.tokens`): a row that maps it
        builds its release's keys from it, converting only the outputs it settled since.
        """
        p = self.cache.page_size
        fill = as_token_array(tokens)
        limit = max((len(fill) - 1) // p * p, 0)
        keys = self.cache.keys(fill[: limit + self.cache.sharing.lookahead])
        return attrs.evolve(self.cache.match(keys[:limit]), tokens=fill)

    def map(self, slot: int, match: PrefixMatch, num_query_tokens: int) -> int:
        """Hold ``match`` for ``slot``'s fresh row and map its pages; the positions mapped."""
        self._admissions += 1
        self._queried += num_query_tokens
        self._hits += match.num_tokens
        if match.tokens is not None:
            self._fill[slot] = match.tokens
        if match.num_tokens == 0:
            return 0
        self.cache.lock(match)
        self._held[slot] = match
        return self._req_pool.map_prefix(self._token_pool, slot, match.pages)

    # ---------------------------------------------------------------- memory
    def evictable_pages(self) -> int:
        """Pages `evict` can hand back (cached, held by no row)."""
        return self.cache.num_evictable_pages

    def cached_pages(self) -> IntArray:
        """Every page the cache holds (the pool's balance counts them as owned)."""
        return self.cache.pages_and_refs()[0]

    def evict(self, num_pages: int) -> int:
        """Give ``num_pages`` (or all evictable, if fewer) back to the pool; how many."""
        pages = self.cache.evict(num_pages)
        self._token_pool.free_pages(pages, validate=self._validate)
        return int(pages.size)

    # --------------------------------------------------------------- release
    def release(
        self,
        reqs: Sequence[Req],
        slots: IntArray,
        protected: IntArray,
        committed: IntArray,
    ) -> tuple[IntArray, IntArray]:
        """Insert what each row may cache, free its duplicates, drop its hold.

        Returns, per row, the first position whose pages the caller still frees (the end of
        what was inserted, else ``cache_protected_len``) and the number of the row's own pages
        the cache kept. Array operations for all the rows; Python per row only for a row that
        inserts something (a walk of the tree) or held a match (its unlock).
        """
        p, lookahead = self.cache.page_size, self.cache.sharing.lookahead
        start = protected.copy()
        kept = np.zeros_like(protected)
        duplicate_end = protected.copy()
        table = self._req_pool.table_host
        lens = insertable_lens(reqs, committed, lookahead=lookahead, page_size=p)
        if self._validate and (lens > committed).any():
            i = int(np.flatnonzero(lens > committed)[0])
            raise LedgerViolation(
                f"[cache-committed] request {reqs[i].request_id}: insert of {int(lens[i])} "
                f"positions passes its committed length {int(committed[i])}"
            )
        rows = slots.tolist()
        fills = list(map(self._fill.pop, rows, repeat(None)))
        for i in (lens > protected).nonzero()[0].tolist():  # rows with something to insert
            req, slot, lo, k = reqs[i], rows[i], int(protected[i]), int(lens[i])
            tokens = self._tokens(req, fills[i], k + lookahead)
            existing = self.cache.insert(self.cache.keys(tokens)[:k], table[slot, :k:p] // p)
            if self._validate and existing < lo:
                raise LedgerViolation(
                    f"request {req.request_id}: its cached prefix of {lo} positions is "
                    f"no longer cached ({existing} found at release)"
                )
            start[i], duplicate_end[i], kept[i] = k, existing, (k - existing) // p
        for match in map(self._held.pop, rows, repeat(None)):  # the holds, after the inserts
            if match is not None:
                self.cache.unlock(match)
        if bool((duplicate_end > protected).any()):
            self._req_pool.free_rows(
                self._token_pool,
                slots,
                protected,
                duplicate_end,
                validate=self._validate,
            )
        return start, kept

    @staticmethod
    def _tokens(req: Req, fill: IntArray | None, n: int) -> IntArray:
        """The first ``n`` tokens of ``req`` (prompt, then outputs) as an array."""
        if fill is not None and len(fill) >= n:
            return fill[:n]
        if fill is None:
            return as_token_array((*req.prompt_ids, *req.output_ids)[:n])
        # NOTE: outputs only grow while a request holds its row: the fill is their prefix.
        since = req.output_ids[len(fill) - len(req.prompt_ids) : n - len(req.prompt_ids)]
        return np.concatenate([fill, as_token_array(since)])

    # ----------------------------------------------------------------- reads
    def snapshot(self) -> PrefixCacheSnapshot:
        """The cache's statistics with the admissions'."""
        snap = self.cache.snapshot()
        return PrefixCacheSnapshot(
            page_size=snap.page_size,
            sharing=snap.sharing,
            num_cached_pages=snap.num_cached_pages,
            num_evictable_pages=snap.num_evictable_pages,
            num_nodes=snap.num_nodes,
            num_inserted_pages=snap.num_inserted_pages,
            num_evicted_pages=snap.num_evicted_pages,
            num_admissions=self._admissions,
            num_queried_tokens=self._queried,
            num_hit_tokens=self._hits,
        )

    def held_pages(self, slot: int) -> IntArray:
        """The cached pages ``slot``'s row holds (empty if none)."""
        held = self._held.get(slot)
        return held.pages if held is not None else np.zeros(0, dtype=np.int64)

    def held_slots(self) -> tuple[int, ...]:
        """Rows that hold a cached prefix."""
        return tuple(self._held)


class NoPrefixRows:
    """The allocator's prefix owner when the engine shares no KV between requests.

    It caches nothing, so it has nothing to match, map, evict or hold, and a release frees
    every page from the row's first position: the allocator calls it as it calls `PrefixRows`
    and has no branch of its own for a cache that is off.
    """

    def match(self, tokens: Sequence[int]) -> None:
        """No cached prefix."""
        return None

    def map(self, slot: int, match: PrefixMatch, num_query_tokens: int) -> int:
        """Nothing to map (`match` finds nothing)."""
        return 0

    def evictable_pages(self) -> int:
        """No cached page to hand back."""
        return 0

    def evict(self, num_pages: int) -> int:
        """Nothing to evict."""
        return 0

    def cached_pages(self) -> IntArray:
        """No cached page."""
        return np.zeros(0, dtype=np.int64)

    def release(
        self,
        reqs: Sequence[Req],
        slots: IntArray,
        protected: IntArray,
        committed: IntArray,
    ) -> tuple[IntArray, None]:
        """Nothing is cached: the caller frees every page from ``protected`` on."""
        return protected, None
