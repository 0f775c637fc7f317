"""What a readable trace record is: the JSONL schema of `specstate.engine.trace`, checked.

`check_record` refuses, with `TraceFileError` naming the field, a record that the readers of
`specstate.tools.trace` (summary, ``--check``, ``--request``, Perfetto, ``--plot``) could not
read: a missing field, a string where a number belongs, a bool where a count belongs, columns of
a round of different lengths. So a hand-edited or truncated trace exits 2 with one line instead
of a traceback deep in a reader. A record of a type this reader does not know is kept as is (a
newer writer may add types); the header's ``schema`` and ``version`` are checked by the loader.

Invariant: every record `check_record` accepts has every field its readers index, with the
documented type.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Final

__all__ = ["TraceFileError", "check_record"]


class TraceFileError(ValueError):
    """The file is not a readable specstate trace."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past the float range
        return False


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


_Check = Callable[[object], bool]
_KINDS: Final[Mapping[_Check, tuple[str, str]]] = {  # (one, a list of them)
    _is_int: ("an integer", "integers"),
    _is_number: ("a finite number", "finite numbers"),
    _is_str: ("a string", "strings"),
    _is_bool: ("true or false", "booleans"),
}

_FIELDS: Final[Mapping[str, Mapping[str, _Check]]] = {
    "span": {"track": _is_str, "name": _is_str, "batch": _is_int, "ts_us": _is_number,
             "dur_us": _is_number},
    "publish": {"batch": _is_int, "ts_us": _is_number},
    "round": {"batch": _is_int, "mode": _is_str, "verify": _is_bool, "ts_us": _is_number,
              "running": _is_int, "free_pages": _is_int},
    "event": {"event": _is_str, "id": _is_str, "batch": _is_int, "reason": _is_str},
}  # fmt: skip

_COLUMNS: Final[Mapping[str, _Check]] = {
    "id": _is_str,
    "incarnation": _is_int,
    "settled": _is_bool,
    "frontier_in": _is_int,
    "accept": _is_int,
    "bonus": _is_int,
    "committed": _is_int,
    "allocated": _is_int,
    "protected": _is_int,
    "outputs": _is_int,
}

_TRACKS: Final = ("host", "forward")


def check_record(record: dict[str, Any], where: str) -> None:
    """Raise `TraceFileError` (``where: what is wrong``) unless ``record`` is readable.

    Args:
        record: one decoded JSONL line (a dict with a ``type``).
        where: ``file:line``, for the message.
    """
    kind = record["type"]
    if kind == "header":
        worker = record.get("worker", {})
        if not isinstance(worker, dict):
            raise TraceFileError(f"{where}: header field 'worker' must be an object")
        if "num_draft_tokens" in worker and not _is_int(worker["num_draft_tokens"]):
            raise TraceFileError(f"{where}: header worker.num_draft_tokens must be an integer")
        return
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return  # a record type this reader does not know: not read
    for name, check in fields.items():
        _field(record, name, check, f"{where}: {kind} record")
    if kind == "span" and record["track"] not in _TRACKS:
        raise TraceFileError(
            f"{where}: span track must be one of {_TRACKS}, got {record['track']!r:.40}"
        )
    if kind == "round":
        _check_rows(record.get("rows"), f"{where}: round record")
    if kind == "event":
        for name in ("prompt_len", "max_new_tokens"):
            if name in record and not _is_int(record[name]):
                raise TraceFileError(f"{where}: event record field {name!r} must be an integer")


def _field(record: Mapping[str, Any], name: str, check: _Check, what: str) -> None:
    if name not in record:
        raise TraceFileError(f"{what} has no field {name!r}")
    if not check(record[name]):
        raise TraceFileError(
            f"{what} field {name!r} must be {_KINDS[check][0]}, got {record[name]!r:.40}"
        )


def _check_rows(rows: object, what: str) -> None:
    """The per-row columns of a round: each a list of the documented type, all one length."""
    if not isinstance(rows, dict):
        raise TraceFileError(f"{what} has no 'rows' object")
    length = None
    for name, check in (*_COLUMNS.items(), ("frontier_out", _is_int)):
        column = rows.get(name)
        if name == "frontier_out" and column is None and name in rows:
            continue  # no frontier was published for this round
        if not isinstance(column, list) or not all(check(v) for v in column):
            raise TraceFileError(
                f"{what} column rows.{name} must be a list of {_KINDS[check][1]}, got "
                f"{column!r:.40}"
            )
        if length is None:
            length = len(column)
        elif len(column) != length:
            raise TraceFileError(
                f"{what} column rows.{name} has {len(column)} entries, rows.id has {length}"
            )
