"""Shared fixtures: every test runs with the run-time ownership check on."""

from __future__ import annotations

import pytest
from memory_harness import Memory, build_memory

from specstate import OwnershipChecker


@pytest.fixture
def checker() -> OwnershipChecker:
    """A fresh ownership checker in checking mode."""
    return OwnershipChecker(enabled=True)


@pytest.fixture
def memory() -> Memory:
    """A memory layer with page size 1, 64 pages, 8 request slots, a chain window (L 4, R 8)."""
    return build_memory()
