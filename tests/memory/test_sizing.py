"""Tests for specstate.memory.sizing: L, R, headroom, page-aligned reservation, estimates."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstate.core.errors import InvalidConfig, LedgerViolation
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.sizing import (
    SpecWindow,
    ceil_to_page,
    decode_tokens_needed,
    page_aligned_decode_alloc_lens,
    spec_decode_tokens_needed,
)
from specstate.memory.slots import ReqToTokenPool

# (allocated, committed, reserve, page_size, cur, nxt, needed): SGLang spec v2's vectors.
SECTION_4_1_VECTORS = [
    ([8], [10], 4, 4, [8], [16], 8),
    ([4], [8], 4, 4, [4], [12], 8),
    ([32], [10], 4, 4, [32], [32], 0),
    ([7], [9], 3, 1, [7], [12], 5),
    ([0, 8, 20], [5, 5, 30], 4, 4, [0, 8, 20], [12, 12, 36], 32),
    ([8], [8], 17, 8, [8], [32], 24),
    ([], [], 4, 4, [], [], 0),
]


@pytest.mark.parametrize(
    ("allocated", "committed", "reserve", "page_size", "cur", "nxt", "needed"),
    SECTION_4_1_VECTORS,
)
def test_page_aligned_decode_alloc_lens_matches_notes_vectors(
    allocated: list[int],
    committed: list[int],
    reserve: int,
    page_size: int,
    cur: list[int],
    nxt: list[int],
    needed: int,
) -> None:
    """Every SGLang spec v2 sizing vector is reproduced exactly, from lists and tensors."""
    for a, c in ((allocated, committed), (torch.tensor(allocated), torch.tensor(committed))):
        lens = page_aligned_decode_alloc_lens(a, c, reserve=reserve, page_size=page_size)
        assert lens.cur.dtype == lens.nxt.dtype == torch.int64
        assert lens.cur.tolist() == cur
        assert lens.nxt.tolist() == nxt
        assert lens.needed == needed


# (page_size, topk, keeps_draft_kv, reserve_windows) -> (L, R, row_headroom), worked by hand with
# num_steps = 3 and D = 4 (topk 1) or D = 8 (topk 4):
#   topk 1: L = max(3·1, 4) = 4 whatever P.  topk 4, no draft KV or P 1: L = max(12, 8) = 12.
#   topk 4, draft KV, P 4: ceil(6/4)=2 pages/branch, L = 2·4·4 = 32; P 16: ceil(18/16)=2, L = 128.
#   headroom = max(4 + D, R + P - 1): a request at the context's end reserves R past it.
FORMULA_TABLE = [
    (1, 1, True, 2, 4, 8, 8),
    (1, 1, False, 3, 4, 12, 12),
    (4, 1, True, 2, 4, 8, 11),
    (4, 1, False, 3, 4, 12, 15),
    (16, 1, True, 2, 4, 8, 23),
    (16, 1, False, 3, 4, 12, 27),
    (1, 4, True, 2, 12, 24, 24),
    (1, 4, False, 3, 12, 36, 36),
    (4, 4, False, 2, 12, 24, 27),
    (4, 4, False, 3, 12, 36, 39),
    (4, 4, True, 2, 32, 64, 67),
    (4, 4, True, 3, 32, 96, 99),
    (16, 4, False, 2, 12, 24, 39),
    (16, 4, False, 3, 12, 36, 51),
    (16, 4, True, 2, 128, 256, 271),
    (16, 4, True, 3, 128, 384, 399),
]


@pytest.mark.parametrize(
    ("page_size", "topk", "keeps_draft_kv", "windows", "alloc_len", "reserve", "headroom"),
    FORMULA_TABLE,
)
def test_window_formulas_match_hand_table(
    page_size: int,
    topk: int,
    keeps_draft_kv: bool,
    windows: int,
    alloc_len: int,
    reserve: int,
    headroom: int,
) -> None:
    """L, R and the row headroom match the hand-computed table."""
    window = SpecWindow(
        speculative=True,
        num_steps=3,
        topk=topk,
        num_draft_tokens=4 if topk == 1 else 8,
        keeps_draft_kv=keeps_draft_kv,
        page_size=page_size,
        reserve_windows=windows,
    )
    assert (window.alloc_len_per_decode, window.reserve, window.row_headroom) == (
        alloc_len,
        reserve,
        headroom,
    )


def test_paged_tree_takes_draft_tokens_when_larger() -> None:
    """A paged tree whose branches fit one page takes L = D when D is larger (1·4·2 = 8 < 16)."""
    window = SpecWindow(
        speculative=True,
        num_steps=1,
        topk=2,
        num_draft_tokens=16,
        keeps_draft_kv=True,
        page_size=4,
    )
    assert (window.alloc_len_per_decode, window.reserve, window.row_headroom) == (16, 32, 35)


@pytest.mark.parametrize(("page_size", "windows"), [(1, 2), (4, 2), (16, 3)])
def test_no_speculation_window(page_size: int, windows: int) -> None:
    """Without speculation L = 1, R = windows and the headroom is 4."""
    window = SpecWindow.none(page_size, reserve_windows=windows)
    assert not window.speculative
    assert (window.alloc_len_per_decode, window.reserve, window.row_headroom) == (1, windows, 4)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"page_size": 0}, r"page_size must be >= 1, got 0"),
        ({"reserve_windows": 1}, r"reserve_windows must be >= 2 .* got 1"),
        ({"num_steps": 0}, r"num_steps=0, topk=1, num_draft_tokens=4"),
        ({"topk": 0}, r"num_steps=3, topk=0, num_draft_tokens=4"),
        ({"num_draft_tokens": 0}, r"num_steps=3, topk=1, num_draft_tokens=0"),
        ({"speculative": False}, r"must be 0, 1, 0, False; got 3, 1, 4, True"),
    ],
)
def test_inconsistent_window_raises_invalid_config(fields: dict[str, int], match: str) -> None:
    """Inconsistent windows raise InvalidConfig naming the numbers."""
    base: dict[str, int | bool] = {
        "speculative": True,
        "num_steps": 3,
        "topk": 1,
        "num_draft_tokens": 4,
        "keeps_draft_kv": True,
        "page_size": 4,
    }
    base.update(fields)
    with pytest.raises(InvalidConfig, match=match):
        SpecWindow(**base)  # type: ignore[arg-type]


def test_ceil_to_page_on_ints_and_tensors() -> None:
    """ceil_to_page rounds ints and tensors up to a multiple of P and rejects P < 1."""
    assert [ceil_to_page(x, 4) for x in (0, 1, 4, 5, 8)] == [0, 4, 4, 8, 8]
    assert ceil_to_page(torch.tensor([0, 1, 16, 17]), 16).tolist() == [0, 16, 16, 32]
    assert ceil_to_page(7, 1) == 7
    with pytest.raises(InvalidConfig, match=r"page_size must be >= 1, got 0"):
        ceil_to_page(3, 0)


def test_bad_lengths_raise() -> None:
    """Mismatched shapes, negative lengths or a negative reserve raise and name the numbers."""
    with pytest.raises(LedgerViolation, match=r"differ in shape: \(2,\) vs \(1,\)"):
        page_aligned_decode_alloc_lens([1, 2], [1], reserve=4, page_size=4)
    with pytest.raises(LedgerViolation, match=r"committed has a negative length: -3"):
        page_aligned_decode_alloc_lens([1], [-3], reserve=4, page_size=4)
    with pytest.raises(InvalidConfig, match=r"reserve must be >= 0, got -1"):
        spec_decode_tokens_needed([1], [1], reserve=-1, page_size=4)
    with pytest.raises(LedgerViolation, match=r"must be 1-D, got shape \(1, 1\)"):
        decode_tokens_needed(torch.tensor([[4]]), 4)


def test_spec_estimate_counts_whole_new_pages() -> None:
    """The spec estimate counts new pages, not positions: (7, 9, R3, P4) needs 4 tokens, not 5."""
    assert spec_decode_tokens_needed([7], [9], reserve=3, page_size=4) == 12 - 8
    assert spec_decode_tokens_needed([7], [9], reserve=3, page_size=1) == 5
    assert spec_decode_tokens_needed([0, 8, 20], [5, 5, 30], reserve=4, page_size=4) == 32
    assert spec_decode_tokens_needed([32], [10], reserve=4, page_size=4) == 0


def test_decode_estimate_counts_requests_on_a_page_boundary() -> None:
    """Non-spec decode needs P tokens per request whose allocated length is a multiple of P."""
    assert decode_tokens_needed([0, 3, 4, 5, 8], 4) == 3 * 4
    assert decode_tokens_needed([0, 3, 4, 5, 8], 1) == 5
    assert decode_tokens_needed([], 16) == 0


def _ceil(x: int, p: int) -> int:
    """Plain-Python ceil to a multiple of p."""
    return (x + p - 1) // p * p


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 4, 16]),
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 48)), max_size=6),
    reserve=st.integers(0, 40),
)
def test_estimates_equal_pages_the_pool_hands_out(
    page_size: int, reqs: list[tuple[int, int]], reserve: int
) -> None:
    """Both estimates equal P × the pages grow_rows takes for the reservation they predict."""
    alloc = [a for a, _ in reqs]
    commit = [c for _, c in reqs]
    lens = page_aligned_decode_alloc_lens(alloc, commit, reserve=reserve, page_size=page_size)
    assert lens.nxt.tolist() == [max(a, _ceil(c + reserve, page_size)) for a, c in reqs]

    def fresh_rows() -> tuple[ReqToTokenPool, TokenSlotAllocator, torch.Tensor]:
        req_pool = ReqToTokenPool(8, 128)
        tokens = TokenSlotAllocator(1 + 8 * 128 // page_size, page_size)
        slots = torch.tensor([req_pool.alloc(f"r{i}").slot for i in range(len(reqs))])
        req_pool.grow_rows(tokens, slots, torch.zeros_like(lens.cur), lens.cur)
        return req_pool, tokens, slots

    req_pool, tokens, slots = fresh_rows()
    spec = spec_decode_tokens_needed(alloc, commit, reserve=reserve, page_size=page_size)
    assert req_pool.grow_rows(tokens, slots, lens.cur, lens.nxt) * page_size == spec

    req_pool, tokens, slots = fresh_rows()
    plain = decode_tokens_needed(alloc, page_size)
    assert req_pool.grow_rows(tokens, slots, lens.cur, lens.cur + 1) * page_size == plain
