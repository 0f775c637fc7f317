"""What a release returns: `ReleasedKv` and `ReleasedBatch`, the values `KvAllocator.release` /
`release_many` give back (the ledger entries as they were, the pages freed).
"""

from __future__ import annotations

from collections.abc import Iterator
from operator import attrgetter
from typing import Final

import attrs
import numpy as np

from specstate.core.request import Req
from specstate.memory.host_arrays import IntArray

__all__ = ["NOTHING_RELEASED", "ReleasedBatch", "ReleasedKv"]

_REQUEST_ID = attrgetter("request_id")


@attrs.frozen(kw_only=True)
class ReleasedKv:
    """What one release returned: the request, its ledger entry, and the pages freed."""

    request_id: str
    slot: int
    cache_protected_len: int
    kv_committed_len: int
    kv_allocated_len: int
    num_freed_pages: int


@attrs.frozen(kw_only=True)
class ReleasedBatch:
    """What one batch release returned, as columns; iterate it for `ReleasedKv` values."""

    reqs: tuple[Req, ...]
    slots: IntArray = attrs.field(eq=False)
    cache_protected_len: IntArray = attrs.field(eq=False)
    kv_committed_len: IntArray = attrs.field(eq=False)
    kv_allocated_len: IntArray = attrs.field(eq=False)
    page_size: int = 1
    num_cached_pages: IntArray | None = attrs.field(default=None, eq=False)
    """Per row, its own pages the prefix cache kept (None: none)."""

    @property
    def num_freed_pages(self) -> IntArray:
        """Per row, the pages it gave back to the pool (computed when read)."""
        p = self.page_size
        start, stop = self.cache_protected_len, self.kv_allocated_len
        pages: IntArray = np.maximum(-(-stop // p) - -(-start // p), 0)
        return pages if self.num_cached_pages is None else pages - self.num_cached_pages

    @property
    def request_ids(self) -> tuple[str, ...]:
        """The released requests' ids, in release order."""
        return tuple(map(_REQUEST_ID, self.reqs))

    def __len__(self) -> int:
        return len(self.reqs)

    def __getitem__(self, i: int) -> ReleasedKv:
        return ReleasedKv(
            request_id=self.reqs[i].request_id,
            slot=int(self.slots[i]),
            cache_protected_len=int(self.cache_protected_len[i]),
            kv_committed_len=int(self.kv_committed_len[i]),
            kv_allocated_len=int(self.kv_allocated_len[i]),
            num_freed_pages=int(self.num_freed_pages[i]),
        )

    def __iter__(self) -> Iterator[ReleasedKv]:
        return (self[i] for i in range(len(self)))


NOTHING_RELEASED: Final = ReleasedBatch(
    reqs=(),
    slots=np.zeros(0, dtype=np.int64),
    cache_protected_len=np.zeros(0, dtype=np.int64),
    kv_committed_len=np.zeros(0, dtype=np.int64),
    kv_allocated_len=np.zeros(0, dtype=np.int64),
)
