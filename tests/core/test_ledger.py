"""The KV ledger: ordering checked on every mutation, owners enforced, errors leave it unchanged."""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specstate import LedgerViolation, OwnershipError, ReservationExceeded
from specstate.internals import KvLedger, OwnershipChecker, Role

ROW_WIDTH = 32
MAX_SLOTS = 6


def _t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@pytest.fixture
def ledger(checker: OwnershipChecker) -> KvLedger:
    """A ledger with requests r1 (slot 1) and r2 (slot 2) open, allocated 10 and committed 4."""
    led = KvLedger(MAX_SLOTS, ROW_WIDTH, checker=checker)
    with checker.acting(Role.ALLOCATOR):
        led.open_slot(1, "r1")
        led.open_slot(2, "r2")
        led.grow_allocated(_t([1, 2]), _t([10, 10]))
    with checker.acting(Role.SCHEDULER):
        led.commit_extend(_t([1, 2]), _t([4, 4]))
    return led


def test_snapshot_reads_every_counter(ledger: KvLedger) -> None:
    """The frozen snapshot carries the three counters and the reservation beyond committed."""
    snap = ledger.snapshot(1)
    assert (snap.cache_protected_len, snap.kv_committed_len, snap.kv_allocated_len) == (0, 4, 10)
    assert snap.num_reserved_tokens == 6
    assert ledger.batch_snapshot().for_request("r2").slot == 2


def test_snapshot_is_frozen(ledger: KvLedger) -> None:
    """Assigning a snapshot field raises at run time too."""
    snap = ledger.snapshot(1)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        snap.kv_committed_len = 5  # type: ignore[misc]


def test_reads_are_copies(ledger: KvLedger) -> None:
    """A tensor returned by a read never aliases the ledger's store."""
    got = ledger.committed(_t([1]))
    got += 100
    assert ledger.snapshot(1).kv_committed_len == 4


def test_advance_committed_vectorized(checker: OwnershipChecker, ledger: KvLedger) -> None:
    """The result processor settles a batch in one call."""
    with checker.acting(Role.RESULT_PROCESSOR):
        ledger.advance_committed(_t([1, 2]), _t([3, 6]))
    assert ledger.committed(_t([1, 2])).tolist() == [7, 10]


def test_commit_past_allocated_names_the_numbers(
    checker: OwnershipChecker, ledger: KvLedger
) -> None:
    """A commit past the reservation raises ReservationExceeded and changes no slot."""
    before = ledger.batch_snapshot()
    with (
        checker.acting(Role.RESULT_PROCESSOR),
        pytest.raises(
            ReservationExceeded,
            match=r"request r2: commit of 7 tokens would pass allocated 10 \(committed 4\)",
        ),
    ):
        ledger.advance_committed(_t([1, 2]), _t([1, 7]))
    assert ledger.batch_snapshot() == before


def test_wrong_role_is_refused(checker: OwnershipChecker, ledger: KvLedger) -> None:
    """The worker may not advance committed; the scheduler may not grow allocated."""
    before = ledger.batch_snapshot()
    with (
        checker.acting(Role.WORKER),
        pytest.raises(
            OwnershipError, match="request r1: role 'worker' may not write kv_committed_len"
        ),
    ):
        ledger.advance_committed(_t([1]), _t([1]))
    with (
        checker.acting(Role.SCHEDULER),
        pytest.raises(
            OwnershipError, match="r1, r2: role 'scheduler' may not write kv_allocated_len"
        ),
    ):
        ledger.grow_allocated(_t([1, 2]), _t([12, 12]))
    assert ledger.batch_snapshot() == before


@pytest.mark.parametrize(
    ("role", "call", "error", "message"),
    [
        (
            Role.ALLOCATOR,
            lambda led: led.grow_allocated(_t([1]), _t([9])),
            LedgerViolation,
            "r1: kv_allocated_len would move from 10 down to 9",
        ),
        (
            Role.ALLOCATOR,
            lambda led: led.grow_allocated(_t([1]), _t([33])),
            LedgerViolation,
            "allocated 33 <= row width 32 would not hold",
        ),
        (
            Role.SCHEDULER,
            lambda led: led.commit_extend(_t([1]), _t([3])),
            LedgerViolation,
            "r1: kv_committed_len would move from 4 down to 3",
        ),
        (
            Role.SCHEDULER,
            lambda led: led.commit_extend(_t([1]), _t([11])),
            ReservationExceeded,
            "r1: committed 11 would pass allocated 10",
        ),
        (
            Role.SCHEDULER,
            lambda led: led.set_protected(1, 5),
            LedgerViolation,
            "r1: cache_protected_len 5 outside 0..committed 4",
        ),
        (
            Role.RESULT_PROCESSOR,
            lambda led: led.advance_committed(_t([1]), _t([-1])),
            LedgerViolation,
            "r1: committed run length would move from 0 down to -1",
        ),
        (
            Role.RESULT_PROCESSOR,
            lambda led: led.advance_committed(_t([3]), _t([1])),
            LedgerViolation,
            "slot 3 holds no request",
        ),
        (
            Role.RESULT_PROCESSOR,
            lambda led: led.advance_committed(_t([1, 1]), _t([1, 1])),
            LedgerViolation,
            r"duplicate slots in one batch update: \[1, 1\]",
        ),
        (
            Role.RESULT_PROCESSOR,
            lambda led: led.advance_committed(_t([0]), _t([1])),
            LedgerViolation,
            r"slot 0 outside 1..6",
        ),
        (
            Role.RESULT_PROCESSOR,
            lambda led: led.advance_committed(_t([1]), _t([1, 2])),
            LedgerViolation,
            "must be equal 1-D",
        ),
        (
            Role.ALLOCATOR,
            lambda led: led.open_slot(2, "r9"),
            LedgerViolation,
            "request r9: slot 2 is held by r2",
        ),
        (
            Role.ALLOCATOR,
            lambda led: led.open_slot(7, "r9"),
            LedgerViolation,
            "request r9: slot 7 outside 1..6",
        ),
        (Role.ALLOCATOR, lambda led: led.close_slot(4), LedgerViolation, "slot 4 holds no request"),
    ],
)
def test_illegal_changes_raise_and_change_nothing(
    checker: OwnershipChecker,
    ledger: KvLedger,
    role: Role,
    call: object,
    error: type[Exception],
    message: str,
) -> None:
    """Each illegal mutation raises its documented error with the numbers; nothing changes."""
    before = ledger.batch_snapshot()
    assert callable(call)
    with checker.acting(role), pytest.raises(error, match=message):
        call(ledger)
    assert ledger.batch_snapshot() == before


def test_close_returns_the_entry_and_zeroes(checker: OwnershipChecker, ledger: KvLedger) -> None:
    """Closing hands back the last entry; the slot reads zero and can be reopened."""
    with checker.acting(Role.ALLOCATOR):
        last = ledger.close_slot(1)
        assert (last.request_id, last.kv_allocated_len) == ("r1", 10)
        assert ledger.allocated(_t([1])).tolist() == [0]
        ledger.open_slot(1, "r3")
    assert ledger.snapshot(1).kv_committed_len == 0


def test_views_are_the_same_ledger(ledger: KvLedger) -> None:
    """Every role's view reads the same counters."""
    views = ledger.views()
    assert views.worker.snapshot(1) == views.result_processor.snapshot(1) == ledger.snapshot(1)


# ---------------------------------------------------------------- property test


@attrs.define
class _Entry:
    rid: str
    protected: int = 0
    committed: int = 0
    allocated: int = 0


class LedgerMachine(RuleBasedStateMachine):
    """Random legal and illegal ledger operations against a plain-Python reference model."""

    def __init__(self) -> None:
        super().__init__()
        self.checker = OwnershipChecker(enabled=True)
        self.ledger = KvLedger(MAX_SLOTS, ROW_WIDTH, checker=self.checker)
        self.model: dict[int, _Entry] = {}
        self.counter = 0

    def _apply(
        self, role: Role, legal: bool, call: object, expect: type[Exception] = LedgerViolation
    ) -> None:
        before = self.ledger.batch_snapshot()
        assert callable(call)
        with self.checker.acting(role):
            if legal:
                call()
            else:
                with pytest.raises(expect):
                    call()
                assert self.ledger.batch_snapshot() == before

    @rule(slot=st.integers(0, MAX_SLOTS + 1))
    def open_slot(self, slot: int) -> None:
        self.counter += 1
        rid = f"r{self.counter}"
        legal = 1 <= slot <= MAX_SLOTS and slot not in self.model
        self._apply(Role.ALLOCATOR, legal, lambda: self.ledger.open_slot(slot, rid))
        if legal:
            self.model[slot] = _Entry(rid)

    @rule(slot=st.integers(1, MAX_SLOTS))
    def close_slot(self, slot: int) -> None:
        legal = slot in self.model
        self._apply(Role.ALLOCATOR, legal, lambda: self.ledger.close_slot(slot))
        if legal:
            del self.model[slot]

    @rule(data=st.data(), which=st.sampled_from(["grow", "extend", "advance"]))
    def batch_update(self, data: st.DataObject, which: str) -> None:
        slots = data.draw(st.lists(st.integers(1, MAX_SLOTS), min_size=1, max_size=4))
        values = data.draw(
            st.lists(st.integers(-2, ROW_WIDTH + 2), min_size=len(slots), max_size=len(slots))
        )
        legal = len(set(slots)) == len(slots) and all(s in self.model for s in slots)
        new: list[tuple[int, int]] = []  # (committed, allocated) per slot if legal
        for s, v in zip(slots, values, strict=True):
            if not legal:
                break
            e = self.model[s]
            c, a = e.committed, e.allocated
            if which == "grow":
                legal = e.allocated <= v <= ROW_WIDTH and e.committed <= v
                a = v
            elif which == "extend":
                legal = e.committed <= v <= e.allocated
                c = v
            else:
                legal = v >= 0 and e.committed + v <= e.allocated
                c = e.committed + v
            new.append((c, a))
        role, call = {
            "grow": (Role.ALLOCATOR, lambda: self.ledger.grow_allocated(_t(slots), _t(values))),
            "extend": (Role.SCHEDULER, lambda: self.ledger.commit_extend(_t(slots), _t(values))),
            "advance": (
                Role.RESULT_PROCESSOR,
                lambda: self.ledger.advance_committed(_t(slots), _t(values)),
            ),
        }[which]
        self._apply(role, legal, call)
        if legal:
            for s, (c, a) in zip(slots, new, strict=True):
                self.model[s].committed, self.model[s].allocated = c, a

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def set_protected(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.model)))
        n = data.draw(st.integers(-1, ROW_WIDTH))
        legal = 0 <= n <= self.model[slot].committed
        self._apply(Role.SCHEDULER, legal, lambda: self.ledger.set_protected(slot, n))
        if legal:
            self.model[slot].protected = n

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), role=st.sampled_from([Role.WORKER, Role.FUTURE_MAP, Role.SCHEDULER]))
    def wrong_role_advance(self, data: st.DataObject, role: Role) -> None:
        slot = data.draw(st.sampled_from(sorted(self.model)))
        call = lambda: self.ledger.advance_committed(_t([slot]), _t([0]))  # noqa: E731
        self._apply(role, False, call, expect=OwnershipError)

    @invariant()
    def matches_model_and_keeps_order(self) -> None:
        snap = self.ledger.batch_snapshot()
        got = {
            e.slot: (e.request_id, e.cache_protected_len, e.kv_committed_len, e.kv_allocated_len)
            for e in snap.entries
        }
        want = {s: (e.rid, e.protected, e.committed, e.allocated) for s, e in self.model.items()}
        assert got == want
        for _, p, c, a in got.values():
            assert 0 <= p <= c <= a <= ROW_WIDTH


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@given(st.lists(st.integers(0, 8), min_size=1, max_size=MAX_SLOTS))
@settings(max_examples=40, deadline=None)
def test_batch_commit_equals_sum(runs: list[int]) -> None:
    """Settling runs one batch at a time adds exactly each run to each slot."""
    checker = OwnershipChecker(enabled=True)
    led = KvLedger(MAX_SLOTS, ROW_WIDTH, checker=checker)
    slots = _t(list(range(1, len(runs) + 1)))
    with checker.acting(Role.ALLOCATOR):
        for s in slots.tolist():
            led.open_slot(s, f"r{s}")
        led.grow_allocated(slots, torch.full_like(slots, 16))
    with checker.acting(Role.RESULT_PROCESSOR):
        led.advance_committed(slots, _t(runs))
        led.advance_committed(slots, _t(runs))
    assert led.committed(slots).tolist() == [2 * r for r in runs]
