"""The request metrics of an `AsyncEngine`: latencies and token counts, as its driver delivers.

Owner: `RequestMetrics`, written only by the driver thread (`specstate.serving.driver`), at the
events that concern one request, never per round: when the engine accepts it, each time its
tokens are handed to its stream, and when it ends. What it measures, on `time.monotonic`::

    arrival        AsyncEngine.submit was called (the Submit command was made)
    admission      the scheduler first admitted it (`Req.first_admitted_s`)
    delivery       the driver routed a step's tokens of it to its stream
    end            the driver routed its final event

    queue time            admission - arrival               once per admitted request
    time to first token   first delivery - arrival          once per request with a token
    inter-token latency   gap since the previous delivery / tokens delivered, once per token
                          after the request's first (the tokens that came with the first: 0)
    end-to-end latency    end - arrival                     once per ended request

So the histograms reconcile with the responses exactly: the inter-token count is the delivered
tokens less one per request that got any, and the token counters are the usage's sums
(``prompt_tokens``; ``completion_tokens``; ``cached_tokens`` and the speculative
``accepted_tokens`` as the usage counts them, at the end).

`register_request_metrics` exports them to ``prometheus_client`` (the ``metrics`` extra), next to
the engine's own series (`specstate.engine.metrics`); `RequestMetrics.snapshot` is the frozen
read for tests and logs (`AsyncEngineSnapshot.requests`).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any, Final, Protocol

import attrs

from specstate.core.errors import InvalidConfig
from specstate.core.request import Req
from specstate.core.status import FinishState

__all__ = [
    "E2E_BUCKETS_S",
    "INTER_TOKEN_BUCKETS_S",
    "QUEUE_BUCKETS_S",
    "TTFT_BUCKETS_S",
    "HistogramSnapshot",
    "MeasuredFrontDoor",
    "RequestMetrics",
    "RequestMetricsSnapshot",
    "register_request_metrics",
]

TTFT_BUCKETS_S: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
"""Upper bounds (seconds) of the time-to-first-token buckets (+Inf follows)."""
INTER_TOKEN_BUCKETS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the inter-token latency buckets (+Inf follows)."""
E2E_BUCKETS_S: Final = (
    0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0,
)  # fmt: skip
"""Upper bounds (seconds) of the end-to-end latency buckets (+Inf follows)."""
QUEUE_BUCKETS_S: Final = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
    40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
"""Upper bounds (seconds) of the queue-time buckets (+Inf follows)."""


@attrs.frozen(kw_only=True)
class HistogramSnapshot:
    """One latency histogram at an instant.

    Attributes:
        bounds: the buckets' upper bounds, seconds, increasing (a last +Inf bucket follows).
        counts: observations per bucket (not cumulative), ``len(bounds) + 1`` of them; an
            observation goes to the first bucket whose bound is at least it.
        total_s: the sum of the observations, seconds.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    total_s: float

    @property
    def count(self) -> int:
        """How many observations."""
        return sum(self.counts)


@attrs.define
class _Histogram:
    """Fixed buckets, a count per bucket and the sum; many equal observations cost one add."""

    _bounds: tuple[float, ...]
    _counts: list[int] = attrs.field(init=False)
    _total_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        self._counts = [0] * (len(self._bounds) + 1)

    def observe(self, seconds: float, times: int = 1) -> None:
        self._counts[bisect.bisect_left(self._bounds, seconds)] += times
        self._total_s += seconds * times

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(
            bounds=self._bounds, counts=tuple(self._counts), total_s=self._total_s
        )


@attrs.frozen(kw_only=True)
class RequestMetricsSnapshot:
    """The request metrics of a front door at an instant (`RequestMetrics.snapshot`).

    Attributes:
        time_to_first_token: first delivery minus arrival, per request with a token.
        inter_token_latency: per token after a request's first (module docstring).
        e2e_latency: end minus arrival, per ended request.
        queue_time: first admission minus arrival, per admitted request.
        num_prompt_tokens: prompt tokens of the requests the engine accepted.
        num_generation_tokens: tokens delivered to the streams.
        num_cached_tokens: prompt tokens the prefix cache supplied, per ended request (the
            usage's ``cached_tokens``).
        num_accepted_tokens: delivered tokens that verifies accepted, bonus included, per ended
            request (the usage's speculative ``accepted_tokens``).
        finished: ended requests by finish reason (``stop``, ``length``, ``abort``, ``error``).
    """

    time_to_first_token: HistogramSnapshot
    inter_token_latency: HistogramSnapshot
    e2e_latency: HistogramSnapshot
    queue_time: HistogramSnapshot
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    num_accepted_tokens: int
    finished: tuple[tuple[str, int], ...]


@attrs.define
class _Timing:
    """When one live request arrived, was last handed tokens, and whether its queue time is in."""

    arrived_s: float
    last_delivery_s: float | None = None
    queued: bool = False


@attrs.define
class RequestMetrics:
    """The request metrics of one front door (module docstring); only its driver writes them.

    Invariant: a request is timed from `record_accepted` to `record_end`, and each of its
    events is counted once.
    """

    _live: dict[str, _Timing] = attrs.field(factory=dict)
    _ttft: _Histogram = attrs.field(factory=lambda: _Histogram(TTFT_BUCKETS_S))
    _itl: _Histogram = attrs.field(factory=lambda: _Histogram(INTER_TOKEN_BUCKETS_S))
    _e2e: _Histogram = attrs.field(factory=lambda: _Histogram(E2E_BUCKETS_S))
    _queue: _Histogram = attrs.field(factory=lambda: _Histogram(QUEUE_BUCKETS_S))
    _prompt_tokens: int = 0
    _generation_tokens: int = 0
    _cached_tokens: int = 0
    _accepted_tokens: int = 0
    _finished: dict[str, int] = attrs.field(factory=dict)

    def record_accepted(self, req: Req, *, arrived_s: float) -> None:
        """The engine accepted ``req``, which arrived at ``arrived_s``."""
        self._live[req.request_id] = _Timing(arrived_s)
        self._prompt_tokens += len(req.prompt_ids)

    def record_delivery(self, req: Req, num_tokens: int, *, at_s: float) -> None:
        """``num_tokens`` of ``req`` were handed to its stream at ``at_s`` (0: none)."""
        timing = self._live[req.request_id]
        if not timing.queued:  # until the first admission is seen (one call a request)
            self._queue_time(req, timing)
        if num_tokens == 0:
            return
        self._generation_tokens += num_tokens
        last = timing.last_delivery_s
        if last is None:
            self._ttft.observe(at_s - timing.arrived_s)
            if num_tokens > 1:  # they came with the first: no gap
                self._itl.observe(0.0, num_tokens - 1)
        else:
            self._itl.observe((at_s - last) / num_tokens, num_tokens)
        timing.last_delivery_s = at_s

    def record_end(
        self, req: Req, finish: FinishState, accept_lengths: Sequence[int], *, at_s: float
    ) -> None:
        """``req`` ended with ``finish``, its final event handed over at ``at_s``;
        ``accept_lengths`` are its verifies' as far as delivered (`Req.emitted_accept_lengths`)."""
        timing = self._live.pop(req.request_id)
        self._queue_time(req, timing)
        self._e2e.observe(at_s - timing.arrived_s)
        reason = finish.reason.value
        self._finished[reason] = self._finished.get(reason, 0) + 1
        self._cached_tokens += min(req.cached_tokens, len(req.prompt_ids))
        self._accepted_tokens += sum(accept_lengths)

    def _queue_time(self, req: Req, timing: _Timing) -> None:
        admitted = req.first_admitted_s
        if not timing.queued and admitted is not None:
            timing.queued = True
            self._queue.observe(max(admitted - timing.arrived_s, 0.0))

    def snapshot(self) -> RequestMetricsSnapshot:
        """The metrics now (call it on the driver thread for a consistent read)."""
        return RequestMetricsSnapshot(
            time_to_first_token=self._ttft.snapshot(),
            inter_token_latency=self._itl.snapshot(),
            e2e_latency=self._e2e.snapshot(),
            queue_time=self._queue.snapshot(),
            num_prompt_tokens=self._prompt_tokens,
            num_generation_tokens=self._generation_tokens,
            num_cached_tokens=self._cached_tokens,
            num_accepted_tokens=self._accepted_tokens,
            finished=tuple(sorted(self._finished.items())),
        )


class RequestMetricsCollector:
    """A ``prometheus_client`` collector of one front door's `RequestMetrics`."""

    def __init__(self, metrics: RequestMetrics, *, prefix: str = "specstate") -> None:
        self._metrics = metrics
        self._prefix = prefix

    def describe(self) -> Iterator[Any]:
        """The metric families this collector exports (a registry finds duplicates by them)."""
        return self.collect()

    def collect(self) -> Iterator[Any]:
        """The metric families of this scrape."""
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        snap, p = self._metrics.snapshot(), self._prefix
        for name, doc, histogram in (
            ("time_to_first_token_seconds", "Arrival to first token.", snap.time_to_first_token),
            (
                "inter_token_latency_seconds",
                "Per token after a request's first: the gap since the previous delivery over "
                "the tokens delivered.",
                snap.inter_token_latency,
            ),
            ("e2e_request_latency_seconds", "Arrival to the end.", snap.e2e_latency),
            ("request_queue_time_seconds", "Arrival to first admission.", snap.queue_time),
        ):
            yield HistogramMetricFamily(
                f"{p}_{name}", doc, buckets=buckets_of(histogram), sum_value=histogram.total_s
            )
        for name, doc, value in (
            ("prompt_tokens", "Prompt tokens of accepted requests.", snap.num_prompt_tokens),
            ("generation_tokens", "Tokens delivered to streams.", snap.num_generation_tokens),
            (
                "request_cached_tokens",
                "Prompt tokens the prefix cache supplied, of ended requests.",
                snap.num_cached_tokens,
            ),
            (
                "request_accepted_tokens",
                "Delivered tokens that verifies accepted (bonus included), of ended requests.",
                snap.num_accepted_tokens,
            ),
        ):
            counter = CounterMetricFamily(f"{p}_{name}", doc)
            counter.add_metric([], value)
            yield counter
        finished = CounterMetricFamily(
            f"{p}_request_finished", "Ended requests by finish reason.", labels=["reason"]
        )
        for reason, n in snap.finished:
            finished.add_metric([reason], n)
        yield finished


def buckets_of(histogram: HistogramSnapshot) -> list[tuple[str, int]]:
    """``histogram``'s cumulative buckets as ``prometheus_client`` takes them (``le``, count)."""
    cumulative, buckets = 0, []
    for bound, n in zip((*histogram.bounds, float("inf")), histogram.counts, strict=True):
        cumulative += n
        buckets.append((_le(bound), cumulative))
    return buckets


def _le(bound: float) -> str:
    """A bucket's ``le`` label as Prometheus writes it (``+Inf`` for the last)."""
    return "+Inf" if bound == float("inf") else repr(bound)


class MeasuredFrontDoor(Protocol):
    """What `register_request_metrics` reads: a front door's request metrics (`AsyncEngine`)."""

    @property
    def request_metrics(self) -> RequestMetrics:
        """The front door's request metrics."""
        ...


def register_request_metrics(
    front: MeasuredFrontDoor, registry: Any = None, *, prefix: str = "specstate"
) -> RequestMetricsCollector:
    """Register ``front``'s request metrics (on the default registry unless one is given).

    A scrape from a thread other than the driver's reads them without a lock; its numbers can
    straddle one delivery (``specstate serve`` scrapes on the driver thread, `AsyncEngine.read`).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
        InvalidConfig: the registry already holds these series under ``prefix``; nothing is
            registered.
    """
    from prometheus_client import REGISTRY

    collector = RequestMetricsCollector(front.request_metrics, prefix=prefix)
    try:
        (REGISTRY if registry is None else registry).register(collector)
    except ValueError as exc:  # prometheus_client: "Duplicated timeseries in CollectorRegistry"
        raise InvalidConfig(
            f"register_request_metrics: the registry already has series named {prefix}_* "
            f"(this front door registered twice, or two with one prefix); give each its own "
            f"prefix= ({str(exc)[:120]})"
        ) from None
    return collector
