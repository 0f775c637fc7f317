"""The recurrent-state pool: its layout, its sizing, and who may open, commit and close records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstate.core.errors import DoubleRelease, InvalidConfig, LedgerViolation, OwnershipError
from specstate.core.ownership import OwnershipChecker, Role
from specstate.memory.recurrent import RecurrentStatePool, recurrent_pool_for
from specstate.memory.recurrent_layout import (
    RecurrentGroupSpec,
    RecurrentLayout,
    RecurrentStateSpec,
    StateTensorSpec,
    rows_per_request,
)

SPEC = RecurrentStateSpec(
    groups=(
        RecurrentGroupSpec(
            name="target.mamba2",
            num_layers=2,
            tensors=(
                StateTensorSpec(name="conv", shape=(64, 3), dtype=torch.float32),
                StateTensorSpec(name="ssm", shape=(4, 8, 8), dtype=torch.float32),
            ),
        ),
    )
)


def _slots(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _pool(checker: OwnershipChecker, *, validate: bool = True) -> RecurrentStatePool:
    pool = recurrent_pool_for(
        SPEC,
        num_draft_tokens=4,
        topk=1,
        num_request_slots=5,
        checker=checker,
        validate=validate,
    )
    assert pool is not None
    return pool


def test_spec_sizes_and_refusals() -> None:
    """Bytes per row add up over layers and tensors; empty or repeated groups are refused."""
    assert SPEC.bytes_per_row == 2 * (64 * 3 + 4 * 8 * 8) * 4
    assert SPEC.merged(None) is SPEC
    with pytest.raises(InvalidConfig, match="distinct groups"):
        SPEC.merged(SPEC)
    with pytest.raises(InvalidConfig, match="shape \\(0, 3\\) must be >= 1"):
        StateTensorSpec(name="conv", shape=(0, 3), dtype=torch.float32)


def test_rows_follow_the_position_modulo_c() -> None:
    """The state after p tokens of slot s is row s*C + p % C; a slot never leaves its rows."""
    layout = RecurrentLayout(rows_per_request=5, num_request_slots=3)
    assert layout.num_rows == 15
    rows = layout.rows(torch.tensor([[1], [2]]), torch.arange(12)[None, :])
    assert rows[0].tolist() == [5 + p % 5 for p in range(12)]
    assert bool(((rows[1] >= 10) & (rows[1] < 15)).all())


def test_c_is_one_more_than_the_verify_width() -> None:
    """A verify of D tokens needs D checkpoints besides the state it starts from."""
    assert rows_per_request(1) == 2
    assert rows_per_request(4) == 5
    with pytest.raises(InvalidConfig, match="num_draft_tokens must be >= 1"):
        rows_per_request(0)


def test_no_spec_no_pool_and_trees_are_refused(checker: OwnershipChecker) -> None:
    """A worker without state gets no pool; a recurrent worker that drafts trees is refused."""
    kwargs = {"num_draft_tokens": 4, "num_request_slots": 5, "checker": checker, "validate": True}
    assert recurrent_pool_for(None, topk=1, **kwargs) is None  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig, match="chains only \\(topk 1\\), got topk 2"):
        recurrent_pool_for(SPEC, topk=2, **kwargs)  # type: ignore[arg-type]


def test_lifecycle_of_a_record(checker: OwnershipChecker) -> None:
    """Open at 0, the prefill committed once, runs added, closed; each by its own role."""
    pool = _pool(checker)
    with checker.acting(Role.ALLOCATOR):
        pool.open_state(2, "r", incarnation=1)
    assert pool.holder(2) == ("r", 1) and pool.open_slots() == [2]
    with checker.acting(Role.RESULT_PROCESSOR):
        pool.settle_states(_slots(2), _slots(1), _slots(), [0], _slots(7))
        pool.settle_states(_slots(2), _slots(3), None, [], _slots())
    assert pool.committed_lengths(_slots(2)).tolist() == [10]
    assert pool.committed_rows(_slots(2)).tolist() == [2 * 5 + 10 % 5]
    assert pool.snapshot().num_open == 1
    assert pool.snapshot().bytes_per_request == 5 * SPEC.bytes_per_row
    with checker.acting(Role.ALLOCATOR):
        pool.close_states(_slots(2))
    assert pool.holder(2) is None and pool.snapshot().num_open == 0


@pytest.mark.parametrize(
    ("role", "call"),
    [
        (Role.SCHEDULER, "commit"),
        (Role.WORKER, "commit"),
        (Role.RESULT_PROCESSOR, "open"),
        (Role.SCHEDULER, "close"),
    ],
)
def test_only_the_owner_writes(checker: OwnershipChecker, role: Role, call: str) -> None:
    """A commit by anyone but the result processor, an open or close by anyone but the
    allocator, raises OwnershipError naming the request and the counter."""
    pool = _pool(checker)
    with checker.acting(Role.ALLOCATOR):
        pool.open_state(1, "r1", incarnation=0)
    calls = {
        "commit": lambda: pool.commit_states(_slots(1), _slots(2)),
        "open": lambda: pool.open_state(3, "new", incarnation=0),
        "close": lambda: pool.close_states(_slots(1)),
    }
    with checker.acting(role), pytest.raises(OwnershipError, match="request r1|request new"):
        calls[call]()
    assert pool.committed_lengths(_slots(1)).tolist() == [0]


def test_bad_commits_change_nothing(checker: OwnershipChecker) -> None:
    """Closed, repeated or negative commits and a second prefill commit are refused."""
    pool = _pool(checker)
    with checker.acting(Role.ALLOCATOR):
        pool.open_state(1, "r1", incarnation=0)
        with pytest.raises(LedgerViolation, match="cannot open"):
            pool.open_state(1, "again", incarnation=0)
    with checker.acting(Role.RESULT_PROCESSOR):
        pool.commit_prefilled(_slots(1), _slots(5))
        for slots, runs, match in [
            (_slots(2), _slots(1), "not open"),
            (_slots(1, 1), _slots(1, 1), "repeats"),
            (_slots(1), _slots(-1), "negative"),
        ]:
            with pytest.raises(LedgerViolation, match=match):
                pool.commit_states(slots, runs)
        with pytest.raises(LedgerViolation, match="request r1: prefill committed twice"):
            pool.commit_prefilled(_slots(1), _slots(5))
    assert pool.committed_lengths(_slots(1)).tolist() == [5]
    with checker.acting(Role.ALLOCATOR):
        pool.close_states(_slots(1))
        with pytest.raises(DoubleRelease, match="slots \\[1\\] are not open"):
            pool.close_states(_slots(1))
