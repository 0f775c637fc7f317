"""Prometheus metrics of an engine: acceptance counters and engine gauges, read at scrape time.

``register_metrics(engine)`` adds a collector to a ``prometheus_client`` registry (the optional
``metrics`` extra: ``pip install 'specstate[metrics]'``). Nothing is recorded on the hot path:
every scrape reads the engine's own counters (the output table's accept-length histogram,
`Engine.snapshot`), so the exported numbers are exactly the engine's.

Counters (``specstate_spec_*``) count settled verify rows only: a row whose request ended or was
retracted before its result settled proposed drafts that nobody verified, and is in neither the
numerator nor the denominator. So the per-request sums reconcile exactly: the accepted tokens are
the sum of every request's ``Req.accept_lengths``, the verifies their count.

* ``specstate_spec_verifies_total``: settled verify rows;
* ``specstate_spec_draft_tokens_total``: draft tokens they proposed (``D - 1`` each);
* ``specstate_spec_accepted_tokens_total``: tokens they accepted, the bonus included;
* ``specstate_spec_accepted_drafts_total``: accepted draft tokens (accepted minus one a verify);
* ``specstate_spec_accepted_drafts_by_position_total{position}``: verifies whose draft at
  ``position`` (1-based) was accepted;
* ``specstate_spec_verifies_by_accept_length_total{length}``: the accept-length histogram.

Gauges: ``specstate_requests{state}`` (waiting, prefilling, running), ``specstate_kv_pages``
and ``specstate_kv_free_pages`` (free, or cached and evictable), ``specstate_batches_in_flight``,
``specstate_quarantined_requests``, ``specstate_deferred_releases``.

With a prefix cache (``EngineSnapshot.prefix_cache``): the gauges
``specstate_prefix_cache_pages`` and ``specstate_prefix_cache_evictable_pages``, and the counters
``specstate_prefix_cache_queried_tokens_total`` (tokens admitted requests had to prefill),
``specstate_prefix_cache_hit_tokens_total`` (of those, supplied by the cache: their ratio is the
hit rate), ``specstate_prefix_cache_inserted_pages_total`` and
``specstate_prefix_cache_evicted_pages_total``.

A scrape from another thread reads a moment of the engine without locking it (it never writes);
the numbers of one scrape can straddle one step.

One prefix names one engine's series on a registry: registering a second collector with a
prefix that registry already holds (the same engine twice, or two engines under one prefix)
raises `InvalidConfig` instead of exporting every series twice. Give each engine its own
``prefix``, or ``registry.unregister(collector)`` first.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from specstate.core.errors import InvalidConfig

if TYPE_CHECKING:
    from specstate.engine.engine import Engine

__all__ = ["SpecstateCollector", "register_metrics"]


class SpecstateCollector:
    """A ``prometheus_client`` collector of one engine (see the module docstring)."""

    def __init__(self, engine: Engine, *, prefix: str = "specstate") -> None:
        self._engine = engine
        self._prefix = prefix

    def describe(self) -> Iterator[Any]:
        """The metric families this collector exports (their names: how a registry finds a
        prefix registered twice, whatever its ``auto_describe``)."""
        return self.collect()

    def collect(self) -> Iterator[Any]:
        """The metric families of this scrape."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine, p = self._engine, self._prefix
        snap = engine.snapshot()
        metrics = snap.metrics

        def counter(name: str, doc: str, value: float) -> Any:
            family = CounterMetricFamily(f"{p}_spec_{name}", doc)
            family.add_metric([], value)
            return family

        yield counter("verifies", "Settled verify rows.", metrics.num_verifies)
        yield counter(
            "draft_tokens",
            "Draft tokens verified by settled verifies (each row's budget or the width).",
            metrics.num_proposed_drafts,
        )
        yield counter(
            "rejected_drafts",
            "Draft tokens verified and rejected (verify work that bought no token).",
            metrics.num_rejected_drafts,
        )
        yield counter(
            "accepted_tokens",
            "Tokens accepted by settled verifies, bonus included.",
            metrics.num_accepted_tokens,
        )
        yield counter("accepted_drafts", "Accepted draft tokens.", metrics.num_correct_drafts)
        by_position = CounterMetricFamily(
            f"{p}_spec_accepted_drafts_by_position",
            "Settled verifies whose draft at this position (1-based) was accepted.",
            labels=["position"],
        )
        verified = CounterMetricFamily(
            f"{p}_spec_verified_drafts_by_position",
            "Settled verifies that verified their draft at this position (1-based).",
            labels=["position"],
        )
        for k, checked in enumerate(metrics.verified_by_position, start=1):
            accepted = sum(n for length, n in metrics.histogram if length >= k + 1)
            by_position.add_metric([str(k)], accepted)
            verified.add_metric([str(k)], checked)
        yield by_position
        yield verified
        budgets = snap.verify_budget
        if budgets is not None:
            planned = CounterMetricFamily(
                f"{p}_verify_budget_rows",
                "Decode rows planned at each verify budget, by policy.",
                labels=["policy", "budget"],
            )
            for budget, rows in enumerate(budgets.rows_by_budget):
                planned.add_metric([budgets.policy, str(budget)], rows)
            yield planned
        by_length = CounterMetricFamily(
            f"{p}_spec_verifies_by_accept_length",
            "Settled verifies by accept length (bonus included).",
            labels=["length"],
        )
        for length, n in metrics.histogram:
            by_length.add_metric([str(length)], n)
        yield by_length
        requests = GaugeMetricFamily(f"{p}_requests", "Requests by state.", labels=["state"])
        requests.add_metric(["waiting"], snap.num_waiting)
        requests.add_metric(["prefilling"], snap.num_prefilling)
        requests.add_metric(["running"], snap.num_running)
        yield requests
        for name, doc, value in (
            ("kv_pages", "KV pages in the pool.", snap.num_pages),
            ("kv_free_pages", "Free KV pages.", snap.num_free_pages),
            ("batches_in_flight", "Launched batches not settled yet.", snap.num_in_flight),
            (
                "quarantined_requests",
                "Requests whose KV waits for an abandoned forward.",
                len(snap.quarantined),
            ),
            (
                "deferred_releases",
                "Ended requests whose KV waits for a launched batch to retire.",
                len(snap.deferred_releases),
            ),
        ):
            gauge = GaugeMetricFamily(f"{p}_{name}", doc)
            gauge.add_metric([], value)
            yield gauge
        cache = snap.prefix_cache
        if cache is not None:
            for name, doc, value in (
                ("pages", "KV pages the prefix cache holds.", cache.num_cached_pages),
                (
                    "evictable_pages",
                    "Prefix-cache pages no request maps (evicted on demand).",
                    cache.num_evictable_pages,
                ),
            ):
                gauge = GaugeMetricFamily(f"{p}_prefix_cache_{name}", doc)
                gauge.add_metric([], value)
                yield gauge
            for name, doc, value in (
                (
                    "queried_tokens",
                    "Tokens admitted requests had to prefill.",
                    cache.num_queried_tokens,
                ),
                ("hit_tokens", "Of those, tokens the prefix cache supplied.", cache.num_hit_tokens),
                ("inserted_pages", "Pages handed to the prefix cache.", cache.num_inserted_pages),
                ("evicted_pages", "Pages the prefix cache gave back.", cache.num_evicted_pages),
            ):
                family = CounterMetricFamily(f"{p}_prefix_cache_{name}", doc)
                family.add_metric([], value)
                yield family


def register_metrics(
    engine: Engine, registry: Any = None, *, prefix: str = "specstate"
) -> SpecstateCollector:
    """Register ``engine``'s collector (on the default registry unless one is given).

    Raises:
        ImportError: ``prometheus_client`` is not installed (the ``metrics`` extra).
        InvalidConfig: the registry already holds series under ``prefix`` (this engine
            registered twice, or another engine with the same prefix); nothing is registered.
    """
    from prometheus_client import REGISTRY

    collector = SpecstateCollector(engine, prefix=prefix)
    try:
        (REGISTRY if registry is None else registry).register(collector)
    except ValueError as exc:  # prometheus_client: "Duplicated timeseries in CollectorRegistry"
        raise InvalidConfig(
            f"register_metrics: the registry already has series named {prefix}_* (this engine "
            "registered twice, or two engines with one prefix); give each engine its own "
            f"prefix=, or unregister the first collector ({str(exc)[:120]})"
        ) from None
    return collector
