"""The public API is pinned: `__all__` is sorted and equals the public names."""

from __future__ import annotations

import specstate


def test_all_is_sorted_and_complete() -> None:
    """Every public name is exported, nothing else, in sorted order."""
    public = {n for n in vars(specstate) if not n.startswith("_")} - {"annotations"}
    public -= {
        "core",
        "memory",
        "relay",
        "batch",
        "engine",
        "tools",
        "reference",
        "lint",
        "testing",
    }
    assert list(specstate.__all__) == sorted(specstate.__all__)
    assert set(specstate.__all__) - {"__version__"} == public


def test_every_export_resolves() -> None:
    """Each name in `__all__` is an attribute of the package."""
    missing = [n for n in specstate.__all__ if not hasattr(specstate, n)]
    assert missing == []
