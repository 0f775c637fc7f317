"""The prefix cache: a radix tree from token prefixes to the KV pages that hold them.

`PrefixCache` owns the pages of finished requests' committed KV that it keeps for reuse, and
guarantees that a page some request row maps is never evicted. It maps *keys* (one per KV
position, `prefix_keys`) to KV pages: page-granular at page size P > 1 (an edge holds whole
pages), token-granular at P = 1. Every node holds a reference count (``ref``): the number of
request rows whose cached prefix runs through it; ``ref`` never grows from a node to its
child, so an unreferenced node heads a wholly unreferenced subtree, and everything
unreferenced is evictable (leaves first, least recently used first)::

    root ─ [sys prompt: pages 3 9 4] ─┬─ [user a: 7 2]     ref 1  (a row maps it)
             ref 2                    └─ [user b: 5]       ref 1
                                          └─ [answer: 8]   ref 0  (evictable leaf)

Why a radix tree and not hashed full pages (vLLM's choice): the tree matches a prompt by
comparing whole edges as arrays (a few NumPy operations per edge, not a hash per page), it is
token-granular at P = 1 without hashing every token, it evicts a whole leaf's pages at once,
and it has no hash collisions to guard against; a reference count per node is the lock, as in
SGLang's `RadixCache`. Every operation touches only the nodes on one path (match, insert,
lock, unlock) or the leaves it evicts (an LRU heap with at most one entry per node), never the
whole tree.

Keys: `PrefixSharing.TOKEN` keys position ``p`` by token ``p``; `PrefixSharing.BIGRAM` by the
pair (token ``p``, token ``p + 1``), for drafters whose state at ``p`` depends on the next
token (SGLang's EAGLE draft KV): such a position is shared only when the next token matches
too.

Invariant: the cached pages are distinct; a node's key holds ``P`` keys per page; ``ref`` of
a child is at most its parent's; the evictable count is the number of pages on nodes with
``ref == 0``; the heap holds every unreferenced leaf (possibly with an older stamp).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np

from specstate.core.errors import InvalidConfig, LedgerViolation
from specstate.memory.host_arrays import IntArray

__all__ = [
    "PrefixCache",
    "PrefixCacheSnapshot",
    "PrefixMatch",
    "PrefixSharing",
    "prefix_keys",
]

_EMPTY: Final[IntArray] = np.zeros(0, dtype=np.int64)


class PrefixSharing(enum.Enum):
    """What a worker's state at a KV position depends on, so whether and how it is shared.

    Member order carries no meaning.
    """

    NONE = "none"
    """Not declared: the worker may keep state outside the token slots; nothing is shared."""
    TOKEN = "token"
    """Everything a forward leaves at position ``p`` lives at ``p``'s token slot and depends
    on tokens ``[0, p]`` only (target KV; a drafter's KV, features or token history)."""
    BIGRAM = "bigram"
    """As TOKEN, but the state at ``p`` may also depend on token ``p + 1`` (SGLang-style EAGLE
    draft KV): a cached position is shared only when the token after it matches too."""

    @property
    def lookahead(self) -> int:
        """Tokens past a position that its key includes (1 for BIGRAM, else 0)."""
        return 1 if self is PrefixSharing.BIGRAM else 0


def prefix_keys(tokens: Sequence[int] | IntArray, sharing: PrefixSharing) -> IntArray:
    """One key per KV position of ``tokens``: the token, or (BIGRAM) the token and the next.

    BIGRAM keys pack both ids in one int64 (``t_p << 32 | t_(p+1)``), one fewer than tokens.
    """
    t = as_token_array(tokens)
    if sharing is PrefixSharing.BIGRAM:
        keys: IntArray = (t[:-1] << 32) | t[1:]
        return keys
    return t


def as_token_array(tokens: Sequence[int] | IntArray) -> IntArray:
    """``tokens`` as an int64 array (no copy for one already)."""
    if isinstance(tokens, np.ndarray):
        return tokens.astype(np.int64, copy=False)
    # fromiter: the fastest way in from a list or tuple of Python ints
    return np.fromiter(tokens, dtype=np.int64, count=len(tokens))


class _Node:
    """One edge of the tree: keys, the pages holding them, and its lock count."""

    __slots__ = ("children", "key", "pages", "parent", "queued", "ref", "seq", "stamp")

    def __init__(self, key: IntArray, pages: IntArray, parent: _Node | None, stamp: int, seq: int):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.ref = 0
        self.stamp = stamp  # last use (the cache's clock)
        self.seq = seq  # creation order: a unique tie-break in the heap
        self.queued = False  # has an entry in the eviction heap


@attrs.frozen(kw_only=True)
class PrefixMatch:
    """The longest cached prefix of a key sequence.

    Attributes:
        num_tokens: matched KV positions (a multiple of the page size).
        pages: ``[num_tokens / P]`` the pages holding them, in position order.
        num_unlocked_pages: matched pages no row holds now (evictable until locked).
        tokens: the tokens the match was made for, as an int64 array, when the caller keeps
            them (a row's release builds its keys from them); else None.
    """

    num_tokens: int
    pages: IntArray = attrs.field(eq=False)
    num_unlocked_pages: int
    node: object = attrs.field(eq=False, repr=False)  # the tree node it ends at (opaque)
    tokens: IntArray | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen(kw_only=True)
class PrefixCacheSnapshot:
    """Frozen statistics of a `PrefixCache` (and of the admissions that used it).

    Attributes:
        page_size: P.
        sharing: how keys are made (TOKEN or BIGRAM).
        num_cached_pages: pages the cache holds.
        num_evictable_pages: of those, pages no request row maps (reusable on demand).
        num_nodes: tree edges.
        num_inserted_pages: pages handed to the cache since it was made.
        num_evicted_pages: pages it gave back to the pool since it was made.
        num_admissions: admissions that looked a prefix up.
        num_queried_tokens: their prefill tokens (prompt plus earlier outputs).
        num_hit_tokens: of those, tokens whose KV came from the cache.
    """

    page_size: int
    sharing: PrefixSharing
    num_cached_pages: int
    num_evictable_pages: int
    num_nodes: int
    num_inserted_pages: int
    num_evicted_pages: int
    num_admissions: int = 0
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens over queried tokens (0.0 before any query)."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class PrefixCache:
    """A radix tree of cached KV pages; see the module docstring.

    Args:
        page_size: P, token slots per KV page; keys come in whole pages.
        sharing: how keys are made (TOKEN or BIGRAM).

    Raises:
        InvalidConfig: ``page_size < 1`` or ``sharing`` is NONE.
    """

    def __init__(self, *, page_size: int, sharing: PrefixSharing) -> None:
        if page_size < 1 or sharing is PrefixSharing.NONE:
            raise InvalidConfig(
                f"a prefix cache needs page_size >= 1 and TOKEN or BIGRAM keys, got "
                f"{page_size}, {sharing.value}"
            )
        self._p = page_size
        self.sharing = sharing
        self._root = _Node(_EMPTY, _EMPTY, None, 0, 0)
        self._clock = 0
        self._seq = 0
        self._heap: list[tuple[int, int, _Node]] = []
        self._num_pages = 0
        self._num_evictable = 0
        self._num_nodes = 0
        self._inserted = 0
        self._evicted = 0

    # ------------------------------------------------------------------ reads
    @property
    def page_size(self) -> int:
        """P."""
        return self._p

    @property
    def num_cached_pages(self) -> int:
        """Pages the cache holds."""
        return self._num_pages

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages no request row maps: `evict` can hand all of them back."""
        return self._num_evictable

    def keys(self, tokens: Sequence[int] | IntArray) -> IntArray:
        """`prefix_keys` of ``tokens`` with this cache's sharing."""
        return prefix_keys(tokens, self.sharing)

    def snapshot(self) -> PrefixCacheSnapshot:
        """Frozen statistics of the tree."""
        return PrefixCacheSnapshot(
            page_size=self._p,
            sharing=self.sharing,
            num_cached_pages=self._num_pages,
            num_evictable_pages=self._num_evictable,
            num_nodes=self._num_nodes,
            num_inserted_pages=self._inserted,
            num_evicted_pages=self._evicted,
        )

    # ------------------------------------------------------------------ match
    def match(self, keys: IntArray) -> PrefixMatch:
        """The longest cached prefix of ``keys`` (cut down to whole pages); locks nothing.

        Marks the path as used (LRU). A match ending inside an edge splits it, so that the
        match always ends at a node (`lock` holds whole nodes).
        """
        self._clock += 1
        node, i, parts, unlocked = self._root, 0, [], 0
        n = len(keys) // self._p * self._p
        while i < n:
            child = node.children.get(keys[i : i + self._p].tobytes())
            if child is None:
                break
            same = self._common(child.key, keys, i, n)
            cut = same < len(child.key)
            if cut:
                child = self._split(child, same)
            child.stamp = self._clock
            parts.append(child.pages)
            if child.ref == 0:
                unlocked += len(child.pages)
            node, i = child, i + same
            if cut:
                break
        pages = np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else _EMPTY)
        return PrefixMatch(num_tokens=i, pages=pages, num_unlocked_pages=unlocked, node=node)

    def _common(self, edge: IntArray, keys: IntArray, i: int, n: int) -> int:
        """Keys ``keys[i:]`` and ``edge`` share, cut down to whole pages (at least one page)."""
        m = min(len(edge), n - i)
        differ = edge[:m] != keys[i : i + m]
        if not differ.any():
            return m
        return int(differ.argmax()) // self._p * self._p

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` keys (a multiple of P); the new head node is returned."""
        parent = node.parent
        assert parent is not None  # the root is never split
        head = _Node(node.key[:at], node.pages[: at // self._p], parent, node.stamp, self._next())
        head.ref = node.ref
        parent.children[node.key[: self._p].tobytes()] = head
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // self._p :], head
        head.children[node.key[: self._p].tobytes()] = node
        self._num_nodes += 1
        return head

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------ locks
    def lock(self, match: PrefixMatch) -> None:
        """Hold the matched path for one more request row (its pages cannot be evicted)."""
        node = match.node
        assert isinstance(node, _Node)
        root = self._root
        while node is not root:
            if node.ref == 0:
                self._num_evictable -= len(node.pages)
            node.ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, match: PrefixMatch) -> None:
        """Release one row's hold on the matched path; unreferenced leaves become evictable.

        Raises:
            LedgerViolation: the path is not held (an unlock without a lock).
        """
        node = match.node
        assert isinstance(node, _Node)
        root = self._root
        while node is not root:
            if node.ref <= 0:
                raise LedgerViolation(
                    f"prefix cache: unlock of an unheld node ({len(node.key)} keys)"
                )
            node.ref -= 1
            if node.ref == 0:
                self._num_evictable += len(node.pages)
                if not node.children:
                    self._queue(node)
            assert node.parent is not None
            node = node.parent

    # ----------------------------------------------------------------- insert
    def insert(self, keys: IntArray, pages: IntArray) -> int:
        """Cache ``pages`` as the KV of ``keys`` (``len(keys) == P * len(pages)``).

        The part already cached stays as it is; the rest becomes a new unreferenced leaf.
        Returns how many leading keys were cached already: the caller's own pages for them
        are duplicates, and the caller frees them.
        """
        p = self._p
        if len(keys) != p * len(pages) or len(keys) % p:
            raise LedgerViolation(
                f"prefix cache: insert of {len(keys)} keys with {len(pages)} pages of {p}"
            )
        self._clock += 1
        node, i, k = self._root, 0, len(keys)
        while i < k:
            child = node.children.get(keys[i : i + p].tobytes())
            if child is None:
                break
            same = self._common(child.key, keys, i, k)
            cut = same < len(child.key)
            if cut:
                child = self._split(child, same)
            child.stamp = self._clock
            node, i = child, i + same
            if cut:
                break
        if i < k:
            leaf = _Node(keys[i:].copy(), pages[i // p :].copy(), node, self._clock, self._next())
            node.children[keys[i : i + p].tobytes()] = leaf
            added = len(leaf.pages)
            self._num_pages += added
            self._num_evictable += added
            self._inserted += added
            self._num_nodes += 1
            self._queue(leaf)
        return i

    # ------------------------------------------------------------------ evict
    def evict(self, num_pages: int) -> IntArray:
        """Take up to ``num_pages`` unreferenced pages out, least recently used leaves first.

        A leaf gives its last pages first, so a partly evicted leaf keeps its head. Returns
        the pages taken (the caller frees them into the pool); fewer only when the cache
        holds fewer evictable pages.
        """
        out: list[IntArray] = []
        need = min(num_pages, self._num_evictable)
        heap, root = self._heap, self._root
        while need > 0 and heap:
            stamp, _, node = heapq.heappop(heap)
            node.queued = False
            if node.parent is None or node.ref or node.children:
                continue  # evicted, locked again, or no longer a leaf
            if stamp != node.stamp:
                self._queue(node)  # used since it was queued: requeue at its new place
                continue
            take = min(need, len(node.pages))
            out.append(node.pages[len(node.pages) - take :])
            need -= take
            if take < len(node.pages):
                node.pages = node.pages[: len(node.pages) - take]
                node.key = node.key[: len(node.key) - take * self._p]
                self._queue(node)
                continue
            parent = node.parent
            del parent.children[node.key[: self._p].tobytes()]
            node.parent = None
            self._num_nodes -= 1
            if parent is not root and parent.ref == 0 and not parent.children:
                self._queue(parent)
        taken = np.concatenate(out) if out else _EMPTY
        self._num_pages -= taken.size
        self._num_evictable -= taken.size
        self._evicted += taken.size
        return taken

    def _queue(self, node: _Node) -> None:
        if not node.queued:
            node.queued = True
            heapq.heappush(self._heap, (node.stamp, node.seq, node))

    # ----------------------------------------------------------------- checks
    def pages_and_refs(self) -> tuple[IntArray, IntArray]:
        """Every cached page and its node's reference count (O(tree): checks only)."""
        pages: list[IntArray] = []
        refs: list[IntArray] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            pages.append(node.pages)
            refs.append(np.full(len(node.pages), node.ref, dtype=np.int64))
            stack.extend(node.children.values())
        if not pages:
            return _EMPTY, _EMPTY
        return np.concatenate(pages), np.concatenate(refs)

    def problems(self) -> list[str]:
        """Ways the tree breaks its invariant (O(tree): checks only); empty when it holds."""
        found: list[str] = []
        num_pages = evictable = nodes = 0
        stack = [(key, child, self._root) for key, child in self._root.children.items()]
        while stack:
            key, node, parent = stack.pop()
            nodes += 1
            num_pages += len(node.pages)
            evictable += len(node.pages) if node.ref == 0 else 0
            checks = {
                "an edge's keys are not whole pages": len(node.key) != self._p * len(node.pages)
                or not len(node.pages),
                "a child is filed under another key": key != node.key[: self._p].tobytes(),
                "a child's parent link is wrong": node.parent is not parent,
                "a child holds more references than its parent": parent is not self._root
                and node.ref > parent.ref,
                "a negative reference count": node.ref < 0,
                "an unreferenced leaf is not queued for eviction": node.ref == 0
                and not node.children
                and not node.queued,
            }
            found += [
                f"{problem} (node of {len(node.key)} keys)"
                for problem, bad in checks.items()
                if bad
            ]
            stack.extend((k, c, node) for k, c in node.children.items())
        pages, _ = self.pages_and_refs()
        if np.unique(pages).size != pages.size:
            found.append("a page is cached twice")
        counts = {
            "cached pages": (num_pages, self._num_pages),
            "evictable pages": (evictable, self._num_evictable),
            "nodes": (nodes, self._num_nodes),
        }
        found += [
            f"{name}: counted {have}, recorded {recorded}"
            for name, (have, recorded) in counts.items()
            if have != recorded
        ]
        return found
