"""The finish resolver: abort, stop inside a run, the cap, a stop past the cap, ignore_eos."""

from __future__ import annotations

import pytest

from specstate import FinishReason, SamplingParams
from specstate.testing.finish_oracle import resolve_finish

EOS = frozenset({2})


@pytest.mark.parametrize(
    ("run", "before", "params", "expected"),
    [
        # EOS mid-run beats the length cap; tokens after it are not emitted.
        ([5, 2, 7, 8], 0, SamplingParams(max_new_tokens=10), (FinishReason.STOP, 2)),
        # A stop token from the request's own list.
        (
            [5, 9, 7],
            3,
            SamplingParams(max_new_tokens=10, stop_token_ids={9}),
            (FinishReason.STOP, 5),
        ),
        # The run crosses the cap without a stop: length finish exactly at the cap.
        ([5, 6, 7, 8], 8, SamplingParams(max_new_tokens=10), (FinishReason.LENGTH, 10)),
        # EOS exactly at the cap is a stop.
        ([5, 2], 8, SamplingParams(max_new_tokens=10), (FinishReason.STOP, 10)),
        # EOS beyond the cap is a length finish at the cap.
        ([5, 6, 2], 8, SamplingParams(max_new_tokens=10), (FinishReason.LENGTH, 10)),
        # ignore_eos: EOS is an ordinary token.
        ([2, 2], 0, SamplingParams(max_new_tokens=10, ignore_eos=True), None),
        # The first stop in the run wins over a later one.
        ([9, 2], 0, SamplingParams(max_new_tokens=10, stop_token_ids={9}), (FinishReason.STOP, 1)),
        ([5, 6], 0, SamplingParams(max_new_tokens=10), None),
    ],
)
def test_finish_precedence(
    run: list[int],
    before: int,
    params: SamplingParams,
    expected: tuple[FinishReason, int] | None,
) -> None:
    """Each case ends where the precedence rules say, never past the cap."""
    got = resolve_finish(run, num_outputs_before=before, params=params, eos_token_ids=EOS)
    if expected is None:
        assert got is None
    else:
        assert got is not None and (got.reason, got.finished_len) == expected
        assert got.finished_len <= params.max_new_tokens


def test_abort_wins_over_a_stop() -> None:
    """A pending abort ends the request even if the run holds a stop token."""
    got = resolve_finish(
        [2, 5],
        num_outputs_before=1,
        params=SamplingParams(max_new_tokens=2),
        eos_token_ids=EOS,
        abort_reason="user",
    )
    assert got is not None and (got.reason, got.finished_len, got.detail) == (
        FinishReason.ABORT,
        2,
        "user",
    )


def test_the_module_docstring_says_who_calls_resolve_finish() -> None:
    """``engine/finish.py`` says the engine finds finishes in its output columns and never
    calls `resolve_finish`: no engine module but its own names it (if one starts calling it,
    that docstring must change with it)."""
    from pathlib import Path

    import specstate.engine

    folder = Path(specstate.engine.__file__).parent
    callers = [
        path.name
        for path in sorted(folder.glob("*.py"))
        if path.name != "finish.py" and "resolve_finish" in path.read_text(encoding="utf-8")
    ]
    assert callers == []
