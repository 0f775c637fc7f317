"""Argument types shared by the command line's subcommands: a bad value is a usage error.

argparse turns the `argparse.ArgumentTypeError` these raise into ``usage: ...`` and exit status
2, naming the option and the value, before anything runs.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

__all__ = ["comma_list", "count", "milliseconds", "positive", "positive_ints"]

_T = TypeVar("_T", int, float)


def comma_list(text: str, convert: Callable[[str], _T], minimum: _T) -> tuple[_T, ...]:
    """``text`` as distinct comma-separated numbers, each at least ``minimum`` and finite."""
    try:
        values = tuple(convert(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None
    if not all(minimum <= v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every item must be at least {minimum}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} names an item twice")
    return values


def positive_ints(text: str) -> tuple[int, ...]:
    """Distinct comma-separated integers >= 1 (batch sizes, page sizes)."""
    return comma_list(text, int, 1)


def milliseconds(text: str) -> tuple[float, ...]:
    """Distinct comma-separated durations >= 0."""
    return comma_list(text, float, 0.0)


def count(minimum: int) -> Callable[[str], int]:
    """The type of an integer option that must be at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {minimum}")
        return value

    return parse


positive = count(1)
"""An integer >= 1."""
