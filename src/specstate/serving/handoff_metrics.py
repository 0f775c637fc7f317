"""The handoffs of a front door that serves a prefill process (``specstate serve --prefill``).

`HandoffMetrics` counts what the decode side (the server process) received: records admitted
(handoffs), their bytes, their transfer time (from a record's frame to its last tensor landing,
a histogram) and the failures (a record refused, a request the prefill side could not hand
over because it is gone or silent). `register_handoff_metrics` exports them as
``specstate_handoffs``, ``specstate_handoff_bytes``, ``specstate_handoff_transfer_seconds`` and
``specstate_handoff_failures`` (docs/observability.md). Only the driver thread writes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import attrs

from specstate.core.errors import InvalidConfig
from specstate.serving.request_metrics import HistogramSnapshot, _Histogram, buckets_of

__all__ = [
    "TRANSFER_BUCKETS_S",
    "HandoffMetrics",
    "HandoffMetricsCollector",
    "HandoffMetricsSnapshot",
    "register_handoff_metrics",
]

TRANSFER_BUCKETS_S: Final = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the transfer-time buckets (+Inf follows)."""


@attrs.frozen(kw_only=True)
class HandoffMetricsSnapshot:
    """The handoff metrics at an instant.

    Attributes:
        num_handoffs: records the decode engine admitted.
        num_bytes: tensor bytes of the records received.
        transfer: the transfer time of every record received.
        num_failures: records refused, and requests lost on the prefill side (gone, silent).
    """

    num_handoffs: int
    num_bytes: int
    transfer: HistogramSnapshot
    num_failures: int


@attrs.define
class HandoffMetrics:
    """Counters of the handoffs a front door received (module docstring)."""

    num_handoffs: int = 0
    num_bytes: int = 0
    num_failures: int = 0
    _transfer: _Histogram = attrs.field(factory=lambda: _Histogram(TRANSFER_BUCKETS_S))

    def record_arrival(self, num_bytes: int, seconds: float, *, admitted: bool) -> None:
        """A record of ``num_bytes`` landed in ``seconds``; ``admitted`` or refused."""
        self.num_bytes += num_bytes
        self._transfer.observe(seconds)
        if admitted:
            self.num_handoffs += 1
        else:
            self.num_failures += 1

    def record_failures(self, count: int) -> None:
        """``count`` requests could not be handed over (the prefill side is gone or silent)."""
        self.num_failures += count

    def snapshot(self) -> HandoffMetricsSnapshot:
        """The counters now."""
        return HandoffMetricsSnapshot(
            num_handoffs=self.num_handoffs,
            num_bytes=self.num_bytes,
            transfer=self._transfer.snapshot(),
            num_failures=self.num_failures,
        )


class HandoffMetricsCollector:
    """A ``prometheus_client`` collector of one front door's `HandoffMetrics`."""

    def __init__(self, metrics: HandoffMetrics, *, prefix: str = "specstate") -> None:
        self._metrics = metrics
        self._prefix = prefix

    def describe(self) -> Iterator[Any]:
        """The metric families this collector exports."""
        return self.collect()

    def collect(self) -> Iterator[Any]:
        """The metric families of this scrape."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snap, p = self._metrics.snapshot(), self._prefix
        for name, doc, value in (
            ("handoffs", "Handoff records the decode engine admitted.", snap.num_handoffs),
            ("handoff_bytes", "Tensor bytes of the handoff records received.", snap.num_bytes),
            (
                "handoff_failures",
                "Handoff records refused, and requests the prefill side could not hand over.",
                snap.num_failures,
            ),
        ):
            counter = CounterMetricFamily(f"{p}_{name}", doc)
            counter.add_metric([], value)
            yield counter
        yield HistogramMetricFamily(
            f"{p}_handoff_transfer_seconds",
            "A handoff record's frame to its last tensor landing, on the decode side.",
            buckets=buckets_of(snap.transfer),
            sum_value=snap.transfer.total_s,
        )


def register_handoff_metrics(
    metrics: HandoffMetrics, registry: Any = None, *, prefix: str = "specstate"
) -> HandoffMetricsCollector:
    """Register ``metrics`` (on the default registry unless one is given).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
        InvalidConfig: the registry already holds these series under ``prefix``.
    """
    from prometheus_client import REGISTRY

    collector = HandoffMetricsCollector(metrics, prefix=prefix)
    try:
        (REGISTRY if registry is None else registry).register(collector)
    except ValueError as exc:
        raise InvalidConfig(
            f"register_handoff_metrics: the registry already has series named {prefix}_* "
            f"({str(exc)[:120]})"
        ) from None
    return collector
