"""The exception tree is one tree rooted at SpecStateError, and its docstring draws all of it."""

from __future__ import annotations

import inspect

import specstate
from specstate.core import errors


def _error_classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


def test_every_error_derives_from_the_root() -> None:
    """Each error class in the module is a SpecStateError."""
    classes = _error_classes()
    assert len(classes) >= 10
    assert all(issubclass(c, specstate.SpecStateError) for c in classes)


def test_docstring_draws_every_error() -> None:
    """The module docstring's tree names every error class."""
    doc = errors.__doc__ or ""
    missing = [c.__name__ for c in _error_classes() if c.__name__ not in doc]
    assert missing == []


def test_reservation_exceeded_is_a_ledger_violation() -> None:
    """Catching LedgerViolation also catches a commit past the reservation."""
    assert issubclass(specstate.ReservationExceeded, specstate.LedgerViolation)
    assert issubclass(specstate.InvalidRequest, ValueError)
