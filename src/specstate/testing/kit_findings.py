"""The conformance kit's findings: what broke, for which request, and how an error names its rule.

`FindingLog` keeps the findings of one run once per rule and request (the first configuration,
and how many more broke it); `rule_of_detail` and `rule_of_error` map a failed request's finish
detail, or an error that escaped the engine, to the rule it names (the table in
`specstate.testing.conformance`). `ConformanceReport` is what the kit returns.

Invariant: a `FindingLog` holds at most one finding per ``(rule, request)``.
"""

from __future__ import annotations

import attrs

from specstate.batch.isolation import IsolationError
from specstate.core.errors import InvariantViolation, OwnershipError, RelayError, WorkerResultError

__all__ = [
    "ConfigRun",
    "ConformanceReport",
    "Finding",
    "FindingLog",
    "described",
    "rule_of_detail",
    "rule_of_error",
]

_TYPES = (
    (WorkerResultError, "result"),
    (RelayError, "relay"),
    (OwnershipError, "ownership"),
    (IsolationError, "isolation"),
)
_INVARIANTS = {"relay": "relay", "isolation": "isolation", "draft-width": "adaptive"}


@attrs.frozen
class Finding:
    """One broken rule, for one request (or the configuration), first seen in ``config``.

    Attributes:
        rule: the rule's name (module docstring).
        config: the first configuration where it broke.
        detail: what broke there, with the numbers.
        request: the request it concerns ("" for the configuration as a whole).
        repeats: how many other configurations broke the same rule for the same request.
    """

    rule: str
    config: str
    detail: str
    request: str = ""
    repeats: int = 0

    def __str__(self) -> str:
        more = f" (and {self.repeats} more configurations)" if self.repeats else ""
        return f"[{self.rule}] {self.config}{more}: {self.detail}"


@attrs.frozen(kw_only=True)
class ConfigRun:
    """What happened in one configuration.

    Attributes:
        name: the configuration.
        steps: engine steps taken.
        retracted: retractions the engine reported.
        aborted: requests that ended with `FinishReason.ABORT`.
    """

    name: str
    steps: int
    retracted: int
    aborted: tuple[str, ...]


@attrs.frozen
class ConformanceReport:
    """What `check_worker` found; ``ok`` when nothing.

    Attributes:
        findings: the broken rules, once per rule and request.
        configs: the configurations run, by name.
        runs: what happened in each configuration (steps, retractions, aborts).
        log: the ``specstate`` log records of the runs (failed batches, with tracebacks).
    """

    findings: tuple[Finding, ...]
    configs: tuple[str, ...]
    runs: tuple[ConfigRun, ...] = ()
    log: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when every configuration ran clean."""
        return not self.findings

    def rules(self) -> set[str]:
        """The names of the broken rules."""
        return {f.rule for f in self.findings}

    def __str__(self) -> str:
        if self.ok:
            return f"worker conforms ({len(self.configs)} configurations)"
        return "\n".join(str(f) for f in self.findings)


class FindingLog:
    """The findings of one kit run, once per rule and request (the first configuration, then how
    many more broke it)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], Finding] = {}

    def add(self, rule: str, config: str, detail: str, request: str = "") -> None:
        """Record ``rule`` broken for ``request`` in ``config`` (a repeat is counted)."""
        key = (rule, request)
        first = self._by_key.get(key)
        if first is None:
            self._by_key[key] = Finding(rule, config, detail, request)
        elif first.config != config:
            self._by_key[key] = attrs.evolve(first, repeats=first.repeats + 1)

    def all(self) -> tuple[Finding, ...]:
        """Every finding, in the order first seen."""
        return tuple(self._by_key.values())


def described(exc: BaseException) -> str:
    """``Type: message``, as a request's finish detail gives a failure."""
    return f"{type(exc).__name__}: {exc}"


def rule_of_error(exc: BaseException) -> str:
    """The rule an exception that escaped the engine names."""
    if isinstance(exc, InvariantViolation):
        return _INVARIANTS.get(exc.invariant, "invariant")
    return rule_of_detail(described(exc))


def rule_of_detail(detail: str) -> str:
    """The rule a finish detail (``Type: message``) names."""
    if "[isolation]" in detail:
        return "isolation"
    if "draft steps (at most" in detail or "[draft-width]" in detail:
        return "adaptive"
    if "speculative=False accepts exactly 1" in detail:
        return "speculation"
    if "[relay]" in detail:  # also a result without the relay payload (WorkerResultError)
        return "relay"
    if "before the post-publish commit" in detail:  # `CommitOrderLedger.check_reads`
        return "commit-order"
    if detail.startswith("InvariantViolation:"):
        name = detail.partition("[")[2].partition("]")[0]
        return _INVARIANTS.get(name, "invariant")
    for error, rule in _TYPES:
        if detail.startswith(f"{error.__name__}:"):
            return rule
    return "error"
