"""The prefix cache's radix tree: matching, keys, locks, LRU eviction, and a state machine."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specstate import Req, RequestLimits, SamplingParams
from specstate.core.errors import InvalidConfig, LedgerViolation
from specstate.core.status import FinishReason, FinishState, ReqStatus
from specstate.internals import OwnershipChecker, Role
from specstate.memory.prefix_cache import PrefixCache, PrefixMatch, PrefixSharing, prefix_keys
from specstate.memory.prefix_rows import insertable_lens


def _pages(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _token_cache(page_size: int = 1) -> PrefixCache:
    return PrefixCache(page_size=page_size, sharing=PrefixSharing.TOKEN)


def test_a_match_is_the_longest_cached_prefix_and_splits_the_edge() -> None:
    """Matching 3 of 5 cached tokens returns their pages and splits the edge at 3."""
    cache = _token_cache()
    assert cache.insert(cache.keys([1, 2, 3, 4, 5]), _pages(10, 11, 12, 13, 14)) == 0
    match = cache.match(cache.keys([1, 2, 3, 9]))
    assert (match.num_tokens, match.pages.tolist(), match.num_unlocked_pages) == (
        3,
        [10, 11, 12],
        3,
    )
    assert cache.snapshot().num_nodes == 2
    assert cache.match(cache.keys([7, 1, 2])).num_tokens == 0
    assert cache.problems() == []


def test_pages_are_shared_whole_at_page_size_above_one() -> None:
    """At P = 4 a match is cut down to whole pages; a partly matching page is not shared."""
    cache = _token_cache(4)
    cache.insert(cache.keys(range(12)), _pages(5, 6, 7))
    assert cache.match(cache.keys([0, 1, 2, 3, 4, 5, 6, 99, 8])).pages.tolist() == [5]
    assert cache.match(cache.keys(range(11))).num_tokens == 8  # 11 keys: 2 whole pages
    with pytest.raises(LedgerViolation, match="3 keys with 1 pages of 4"):
        cache.insert(cache.keys([1, 2, 3]), _pages(9))


def test_bigram_keys_share_a_position_only_when_the_next_token_matches() -> None:
    """BIGRAM: position p is shared only if token p + 1 matches too; TOKEN ignores it."""
    tokens = [1, 2, 3, 4, 5]
    for sharing, want in ((PrefixSharing.BIGRAM, 2), (PrefixSharing.TOKEN, 3)):
        cache = PrefixCache(page_size=1, sharing=sharing)
        keys = cache.keys(tokens)
        cache.insert(keys[:4], _pages(10, 11, 12, 13))
        other = cache.keys([1, 2, 3, 9, 9])  # differs at token 3
        assert cache.match(other[:3]).num_tokens == want
    assert prefix_keys([1, 2, 3], PrefixSharing.BIGRAM).tolist() == [(1 << 32) | 2, (2 << 32) | 3]


def test_a_locked_path_is_never_evicted_and_unreferenced_leaves_go_lru_first() -> None:
    """Eviction takes the least recently used unreferenced leaf's tail first, never a lock."""
    cache = _token_cache()
    cache.insert(cache.keys([1, 2, 3, 4]), _pages(1, 2, 3, 4))
    cache.insert(cache.keys([1, 2, 7, 8]), _pages(1, 2, 7, 8))
    held = cache.match(cache.keys([1, 2, 3, 4]))
    cache.lock(held)
    assert cache.num_evictable_pages == 2  # pages 7, 8: the other branch
    assert cache.evict(10).tolist() == [7, 8]
    assert cache.evict(10).size == 0 and cache.num_cached_pages == 4
    cache.unlock(held)
    cache.match(cache.keys([1, 2, 3]))  # touch: [1, 2, 3] is now the most recent
    assert cache.evict(1).tolist() == [4]  # the leaf's tail goes first
    assert cache.evict(2).tolist() == [3, 2]  # then the rest of it, then its parent
    assert cache.problems() == []


def test_a_held_leaf_stays_even_when_used_longer_ago_than_an_unheld_one() -> None:
    """LRU order never reaches a held leaf: a newer unheld leaf is evicted instead."""
    cache = _token_cache()
    cache.insert(cache.keys([1, 2]), _pages(1, 2))
    cache.insert(cache.keys([3, 4]), _pages(3, 4))
    cache.lock(cache.match(cache.keys([1, 2])))
    cache.match(cache.keys([3, 4]))  # used after the held one, but not held
    assert cache.evict(1).tolist() == [4]
    assert cache.evict(5).tolist() == [3]
    assert cache.match(cache.keys([1, 2])).pages.tolist() == [1, 2]


def test_an_unlock_without_a_lock_is_refused() -> None:
    """Unlocking a path nobody holds raises `LedgerViolation`."""
    cache = _token_cache()
    cache.insert(cache.keys([1, 2]), _pages(1, 2))
    match = cache.match(cache.keys([1, 2]))
    with pytest.raises(LedgerViolation, match="unlock of an unheld node"):
        cache.unlock(match)


def test_insert_reports_what_was_cached_already() -> None:
    """A second insert of a longer sequence keeps the cached part and adds only the rest."""
    cache = _token_cache()
    cache.insert(cache.keys([1, 2, 3]), _pages(1, 2, 3))
    assert cache.insert(cache.keys([1, 2, 3, 4, 5]), _pages(9, 9, 9, 4, 5)) == 3
    assert cache.match(cache.keys([1, 2, 3, 4, 5])).pages.tolist() == [1, 2, 3, 4, 5]
    assert (cache.num_cached_pages, cache.snapshot().num_inserted_pages) == (5, 5)


def test_a_cache_needs_a_key_kind_and_a_page_size() -> None:
    """NONE sharing or a page size below 1 is refused at construction."""
    with pytest.raises(InvalidConfig, match="TOKEN or BIGRAM"):
        PrefixCache(page_size=1, sharing=PrefixSharing.NONE)
    with pytest.raises(InvalidConfig, match="page_size >= 1"):
        PrefixCache(page_size=0, sharing=PrefixSharing.TOKEN)


class CacheMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, unlocks and evictions against a model of cached pages.

    The model maps every cached page prefix (a tuple of keys) to its page and counts the holds
    on each; after every rule the tree's structure holds, every modelled prefix matches with
    its pages, and the evictable count is the number of unheld pages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.p = 2
        self.cache = PrefixCache(page_size=self.p, sharing=PrefixSharing.TOKEN)
        self.pages: dict[tuple[int, ...], int] = {}
        self.holds: dict[int, int] = {}
        self.locked: list[tuple[PrefixMatch, tuple[int, ...]]] = []
        self.next_page = 1

    @rule(tokens=st.lists(st.integers(0, 2), min_size=2, max_size=10))
    def insert(self, tokens: list[int]) -> None:
        """Insert whole pages of ``tokens`` with fresh pages."""
        k = len(tokens) // self.p * self.p
        keys = self.cache.keys(tokens[:k])
        fresh = np.arange(self.next_page, self.next_page + k // self.p, dtype=np.int64)
        self.next_page += k // self.p
        existing = self.cache.insert(keys, fresh)
        for j in range(k // self.p):
            prefix = tuple(tokens[: (j + 1) * self.p])
            if (j + 1) * self.p > existing:
                assert prefix not in self.pages
                self.pages[prefix] = int(fresh[j])
            else:
                assert prefix in self.pages

    @rule(tokens=st.lists(st.integers(0, 2), min_size=0, max_size=10))
    def match_and_lock(self, tokens: list[int]) -> None:
        """Match ``tokens`` and hold what matched."""
        match = self.cache.match(self.cache.keys(tokens))
        n = match.num_tokens
        want = [self.pages[tuple(tokens[: (j + 1) * self.p])] for j in range(n // self.p)]
        assert match.pages.tolist() == want
        nxt = tuple(tokens[: n + self.p])
        assert len(nxt) < n + self.p or nxt not in self.pages  # it is the longest
        if n:
            self.cache.lock(match)
            self.locked.append((match, tuple(tokens[:n])))
            for page in want:
                self.holds[page] = self.holds.get(page, 0) + 1

    @rule(tokens=st.lists(st.integers(0, 2), min_size=0, max_size=10))
    def touch(self, tokens: list[int]) -> None:
        """Match without holding (an admission that did not fit): only the LRU order moves."""
        self.cache.match(self.cache.keys(tokens))

    @precondition(lambda self: self.locked)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        """Drop one hold."""
        match, _ = self.locked.pop(data.draw(st.integers(0, len(self.locked) - 1)))
        self.cache.unlock(match)
        for page in match.pages.tolist():
            self.holds[page] -= 1

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        """Evict ``n`` pages: only unheld ones, as many as asked for or evictable."""
        evictable = self.cache.num_evictable_pages
        taken = self.cache.evict(n).tolist()
        assert len(taken) == min(n, evictable)
        gone = {prefix for prefix, page in self.pages.items() if page in taken}
        for prefix in gone:
            assert self.holds.get(self.pages[prefix], 0) == 0
            del self.pages[prefix]
        for prefix in self.pages:  # evicting keeps what is cached prefix-closed
            assert all(prefix[: j * self.p] in self.pages for j in range(1, len(prefix) // self.p))

    @invariant()
    def consistent(self) -> None:
        """Structure, counts and every cached prefix agree with the model."""
        assert self.cache.problems() == []
        assert self.cache.num_cached_pages == len(self.pages)
        unheld = sum(1 for page in self.pages.values() if self.holds.get(page, 0) == 0)
        assert self.cache.num_evictable_pages == unheld


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def _ended(checker: OwnershipChecker, name: str, outputs: int, finish: FinishState | None) -> Req:
    """A request with a 6-token prompt and ``outputs`` settled outputs, ended by ``finish``
    (FINISHED, or ABORTED for an ABORT) or, with None, still running."""
    limits = RequestLimits(vocab_size=100, max_context_len=64)
    req = Req.new(name, range(6), SamplingParams(max_new_tokens=20), limits, checker=checker)
    req.transition(ReqStatus.PREFILL)
    req.transition(ReqStatus.RUNNING)
    with checker.acting(Role.RESULT_PROCESSOR):
        req.append_outputs([7] * outputs)
    if finish is not None:
        Req.end_many([req], [finish])
    return req


@pytest.mark.parametrize(("lookahead", "page_size"), [(0, 1), (1, 1), (0, 4), (1, 4)])
def test_a_release_caches_only_committed_kv_of_what_the_user_saw(
    lookahead: int, page_size: int
) -> None:
    """``floor_P(min(committed, prompt + finished_len - lookahead))`` for a stop or a length
    finish, per row of one release; nothing for an abort, an error or a live request."""
    checker = OwnershipChecker(enabled=False)

    def finish(reason: FinishReason, n: int) -> FinishState:
        return FinishState(reason=reason, finished_len=n)

    rows = [  # (request, its kv_committed_len, what it may cache)
        (_ended(checker, "stop", 9, finish(FinishReason.STOP, 5)), 15, 11 - lookahead),
        (_ended(checker, "short", 9, finish(FinishReason.STOP, 9)), 9, 9),
        (_ended(checker, "length", 12, finish(FinishReason.LENGTH, 12)), 17, 17),
        (_ended(checker, "abort", 9, finish(FinishReason.ABORT, 9)), 15, 0),
        (_ended(checker, "error", 9, finish(FinishReason.ERROR, 9)), 15, 0),
        (_ended(checker, "live", 9, None), 15, 0),
    ]
    reqs = [req for req, _, _ in rows]
    committed = np.array([c for _, c, _ in rows], dtype=np.int64)
    got = insertable_lens(reqs, committed, lookahead=lookahead, page_size=page_size)
    assert got.tolist() == [want // page_size * page_size for _, _, want in rows]
