"""Shared fixtures: every test runs with the run-time ownership check on."""

from __future__ import annotations

import pytest

from specstate import OwnershipChecker


@pytest.fixture
def checker() -> OwnershipChecker:
    """A fresh ownership checker in checking mode."""
    return OwnershipChecker(enabled=True)
