"""`specstate lint` knows the recurrent-state counter and the pool's mutators."""

from __future__ import annotations

import pytest

from specstate.tools.lint import scan_source


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        ("self.state.recurrent_committed_len += n", "augassign recurrent_committed_len"),
        ("pool._recurrent_committed[slots] = lens", "assign _recurrent_committed"),
        ("pool.commit_states(slots, accept)", "call commit_states"),
        ("pool.commit_prefilled(slots, lens)", "call commit_prefilled"),
        ("pool.settle_states(slots, accept, None, [], lens)", "call settle_states"),
        ("pool.open_state(3, 'r', 0)", "call open_state"),
        ("pool.close_states(slots)", "call close_states"),
    ],
)
def test_an_adapter_writing_the_state_record_is_a_site(line: str, kind: str) -> None:
    """A worker that commits or opens a recurrent-state record is reported, with its scope."""
    source = (
        f"class MyWorker:\n    def forward(self, pool, slots, accept, lens, n):\n        {line}\n"
    )
    sites = scan_source(source, "adapter.py")
    assert [(s.scope, s.kind) for s in sites] == [("MyWorker.forward", kind)]


def test_a_reset_and_a_read_are_not_sites() -> None:
    """Assigning 0 resets; reading the committed length writes nothing."""
    source = (
        "def f(pool, slots):\n"
        "    pool.recurrent_committed_len = 0\n"
        "    return pool.committed_lengths(slots)\n"
    )
    assert scan_source(source, "adapter.py") == []
