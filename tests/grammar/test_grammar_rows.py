"""The grammar view of one forward, without an engine: masks, pushes, rollbacks, ends.

Each test builds `GrammarRows` over one or two `GrammarState` values and plays one forward the
way a worker does (module docstring of `specstate.grammar.rows`); masks are compared with a
fresh llguidance matcher that consumed the same tokens, unpacked with NumPy.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import llguidance
import numpy as np
import pytest
import torch
from grammar_oracle import EOS, VOCAB, compiler, encode

from specstate.core.errors import GrammarError
from specstate.grammar.rows import GrammarRows, apply_token_bitmask
from specstate.grammar.spec import Grammar
from specstate.grammar.state import GrammarState

EXECUTOR = llguidance.LLExecutor(1)
WORDS = (VOCAB + 31) // 32


@attrs.frozen
class Owner:
    """A request as the view sees it: an incarnation."""

    incarnation: int


def state(grammar: Grammar, rid: str = "r") -> GrammarState:
    """A fresh state of ``grammar`` for the tiny vocabulary."""
    comp = compiler()
    text, matcher = comp.compile(grammar)
    return GrammarState(request_id=rid, grammar=grammar, text=text, matcher=matcher, compiler=comp)


def rows(
    states: Sequence[GrammarState],
    *,
    resume: Sequence[int | None] | None = None,
    current: bool = True,
) -> GrammarRows:
    """A view whose grammar row ``i`` is batch row ``i``."""
    return GrammarRows(
        batch_rows=range(len(states)),
        states=states,
        resume=resume or [None] * len(states),
        owners=[Owner(0)] * len(states),
        incarnations=[0 if current else 1] * len(states),
        executor=EXECUTOR,
        mask_words=WORDS,
    )


def allowed(mask: np.ndarray | torch.Tensor) -> set[int]:
    """The token ids a packed mask allows."""
    data = mask.numpy() if isinstance(mask, torch.Tensor) else mask
    bits = np.unpackbits(np.ascontiguousarray(data).view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:VOCAB]).tolist())


def fresh_allowed(grammar: Grammar, tokens: Sequence[int]) -> set[int]:
    """What a fresh matcher allows after ``tokens``."""
    _, matcher = compiler().compile(grammar)
    assert matcher.consume_tokens(list(tokens))
    packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return set(np.flatnonzero(np.unpackbits(packed, bitorder="little")[:VOCAB]).tolist())


def ids(value: str) -> torch.Tensor:
    """``[1, len]`` ids of ``value``."""
    return torch.tensor([encode(value)])


REGEX = Grammar.regex("[a-c]{2,4}x")


def test_verify_masks_are_the_grammar_after_each_draft() -> None:
    """Position j of the verify masks is what the grammar allows after drafts d1 .. dj."""
    view = rows([state(REGEX)])
    masks = view.verify_masks(ids("abc"))
    assert masks is not None and tuple(masks.bitmask.shape) == (1, 4, WORDS)
    for j in range(4):
        assert allowed(masks.bitmask[0, j]) == fresh_allowed(REGEX, encode("abc")[:j])


def test_rejected_drafts_are_rolled_back_and_the_bonus_kept() -> None:
    """A verify that keeps d1 and a bonus rolls the rejected drafts back with the matcher's
    rollback: the state holds exactly the accepted run, and the next mask follows it."""
    grammar_state = state(REGEX)
    view = rows([grammar_state])
    view.verify_masks(ids("abc"))
    view.accept(ids("acxx"), torch.tensor([2]))  # d1 = a kept, bonus c
    assert grammar_state.tokens == encode("ac")
    assert view.stats().rollbacks == 1 and view.stats().rolled_back_tokens == 2
    assert view.outcome()[0].tokens == tuple(encode("ac"))
    nxt = rows([grammar_state]).verify_masks(torch.zeros(1, 0, dtype=torch.int64))
    assert nxt is not None and allowed(nxt.bitmask[0, 0]) == fresh_allowed(REGEX, encode("ac"))


def test_drafts_the_grammar_refuses_are_pruned() -> None:
    """An n-gram style chain is checked draft by draft: the first refused draft prunes the
    rest (no mask after it), and the verify cannot accept it."""
    grammar_state = state(REGEX)
    view = rows([grammar_state])
    masks = view.verify_masks(ids("azb"))  # z is refused after a
    assert masks is not None
    assert view.stats().pruned_drafts == 1
    assert allowed(masks.bitmask[0, 1]) == fresh_allowed(REGEX, encode("a"))
    assert allowed(masks.bitmask[0, 2]) == set(range(VOCAB))  # never emitted: unconstrained
    view.accept(ids("ab__"), torch.tensor([2]))
    assert grammar_state.tokens == encode("ab")


def test_an_end_token_among_the_drafts_ends_the_grammar() -> None:
    """A drafted end token that the verify accepts ends the grammar there: the run's later
    tokens are not the grammar's, and the ended matcher is never asked for a mask."""
    grammar = Grammar.regex("ab")
    grammar_state = state(grammar)
    view = rows([grammar_state])
    view.verify_masks(torch.tensor([[*encode("ab"), EOS]]))
    view.accept(torch.tensor([[*encode("ab"), EOS, 7]]), torch.tensor([4]))
    assert grammar_state.ended and grammar_state.tokens == [*encode("ab"), EOS]
    assert view.outcome()[0].tokens == (*encode("ab"), EOS)
    with pytest.raises(
        GrammarError, match="a mask was asked after output 3, but its grammar ended"
    ):
        grammar_state.matcher_for_mask()
    later = rows([grammar_state])
    assert later.verify_masks(torch.zeros(1, 0, dtype=torch.int64)) is None
    assert later.outcome() == ()


def test_an_end_token_rejected_by_the_verify_is_rolled_back() -> None:
    """A drafted end token the verify rejects is undone: the grammar goes on."""
    grammar = Grammar.regex("ab|abc")
    grammar_state = state(grammar)
    view = rows([grammar_state])
    view.verify_masks(torch.tensor([[*encode("ab"), EOS]]))
    view.accept(torch.tensor([[*encode("abc"), 0]]), torch.tensor([3]))
    assert not grammar_state.ended and grammar_state.tokens == encode("abc")


def test_a_dead_end_at_the_first_position_fails_the_row() -> None:
    """A grammar the vocabulary cannot spell (no ASCII for é) is a dead end: the row reports it
    and its mask leaves the logits finite."""
    grammar_state = state(Grammar.regex("é"))
    view = rows([grammar_state])
    masks = view.sample_masks()
    assert masks is not None and allowed(masks.bitmask[0]) == set(range(VOCAB))
    view.accept_sampled(torch.tensor([5]))
    (outcome,) = view.outcome()
    assert outcome.dead_end and outcome.failure is not None
    assert "dead end" in outcome.failure and "after output 0" in outcome.failure


def test_a_dead_end_on_a_rejected_draft_rebuilds_the_matcher() -> None:
    """A draft that leads to a dead end puts llguidance's matcher in its permanent error state;
    when the verify rejects that draft the matcher is rebuilt at the kept tokens."""
    grammar = Grammar.regex("xaé|xb")
    grammar_state = state(grammar)
    view = rows([grammar_state])
    view.verify_masks(ids("xa"))  # after "xa" nothing ASCII can follow
    view.accept(ids("xb_"), torch.tensor([2]))  # the verify kept x, then b
    assert grammar_state.tokens == encode("xb") and grammar_state.dead is None
    assert view.stats().rebuilds == 1 and view.outcome()[0].failure is None
    assert grammar_state.prefetched is not None
    assert allowed(grammar_state.prefetched[1]) == {EOS}


def test_a_run_into_a_dead_end_fails_the_row() -> None:
    """The same dead-end draft, accepted: the run's next token has no allowed value."""
    grammar_state = state(Grammar.regex("xaé|xb"))
    view = rows([grammar_state])
    view.verify_masks(ids("xa"))
    view.accept(ids("xa_"), torch.tensor([3]))
    (outcome,) = view.outcome()
    assert outcome.dead_end and outcome.tokens == tuple(encode("xa"))


def test_verify_masks_refuse_drafts_other_than_the_masked_ones() -> None:
    """Masks built while drafting belong to those drafts: verifying other drafts is refused."""
    view = rows([state(REGEX)])
    view.draft_masks()
    view.push_drafts(ids("a")[:, 0])
    with pytest.raises(GrammarError, match=r"verify drafts \[1\] differ from the drafts \[65\]"):
        view.verify_masks(ids("!"))


def test_a_view_is_used_once_and_in_order() -> None:
    """Out-of-order use raises instead of building masks from the wrong state."""
    view = rows([state(REGEX)])
    with pytest.raises(GrammarError, match="out of order: new -> done"):
        view.accept(ids("a"), torch.tensor([1]))
    view.draft_masks()
    with pytest.raises(GrammarError, match="draft_masks\\(\\) twice"):
        view.draft_masks()


def test_a_row_retracted_since_scheduling_takes_no_part() -> None:
    """A row whose request is no longer the incarnation scheduled gets no mask and no push."""
    grammar_state = state(REGEX)
    view = rows([grammar_state], current=False)
    assert view.verify_masks(ids("ab")) is None
    assert grammar_state.tokens == [] and view.outcome() == ()


def test_a_prefill_resumes_at_the_committed_position() -> None:
    """A re-prefilled request's grammar rolls back what a retracted round had kept."""
    grammar_state = state(REGEX)
    grammar_state.push(encode("a")[0])
    grammar_state.push(encode("b")[0])
    grammar_state.num_committed = 1
    view = rows([grammar_state], resume=[1])  # the request was retracted at output 1
    masks = view.sample_masks()
    assert masks is not None and allowed(masks.bitmask[0]) == fresh_allowed(REGEX, encode("a"))
    assert grammar_state.tokens == encode("a") and view.stats().rolled_back_tokens == 1


def test_apply_token_bitmask_masks_exactly_the_cleared_bits() -> None:
    """-inf exactly where the packed mask clears a bit, for every token id."""
    generator = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (2, 3, WORDS), generator=generator).int()
    logits = torch.randn(2, 3, VOCAB, generator=generator)
    masked = apply_token_bitmask(logits, bitmask)
    for i in range(2):
        for j in range(3):
            keep = allowed(bitmask[i, j])
            assert set(torch.isfinite(masked[i, j]).nonzero().flatten().tolist()) == keep
            assert torch.equal(masked[i, j, sorted(keep)], logits[i, j, sorted(keep)])
