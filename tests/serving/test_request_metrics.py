"""The front door's request metrics, scraped from a real server after real requests.

The server runs the embedded model with its draft model (speculation, overlap, the prefix
cache); requests go through the `openai` client, streamed and whole, with a stop string and a
prompt sent twice. Every counter and every histogram count of ``/metrics`` is checked against
what the responses said (their usage, finish reasons and tokens); the latency sums only by
relations that hold for every request (queue time <= time to first token <= end-to-end), never
by a duration. docs/observability.md's table names the same series with the same buckets.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serving_harness import Served, serving, speculative_usage

from specstate import Engine, EngineConfig, RequestLimits
from specstate.reference import embedded
from specstate.reference.workers import default_registry
from specstate.serving.openai_server import ServedModel
from specstate.serving.request_metrics import (
    E2E_BUCKETS_S,
    INTER_TOKEN_BUCKETS_S,
    QUEUE_BUCKETS_S,
    TTFT_BUCKETS_S,
    RequestMetrics,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "embedded-metrics"
HISTOGRAMS = {
    "specstate_time_to_first_token_seconds": TTFT_BUCKETS_S,
    "specstate_inter_token_latency_seconds": INTER_TOKEN_BUCKETS_S,
    "specstate_e2e_request_latency_seconds": E2E_BUCKETS_S,
    "specstate_request_queue_time_seconds": QUEUE_BUCKETS_S,
}
COUNTERS = (
    "specstate_prompt_tokens_total",
    "specstate_generation_tokens_total",
    "specstate_request_cached_tokens_total",
    "specstate_request_accepted_tokens_total",
)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The server on the embedded model with its draft model, overlap on, checked."""
    worker = default_registry().create(
        "draft_model",
        target=embedded.target_dir(),
        draft=embedded.draft_dir(),
        num_steps=4,
        dtype=torch.float32,
    )
    limits = RequestLimits(
        vocab_size=embedded.VOCAB_SIZE, max_context_len=1024, eos_token_ids={embedded.EOS_ID}
    )
    config = EngineConfig(kv_tokens=8192, page_size=16, check_invariants=True)
    model = ServedModel.from_checkpoint(embedded.target_dir(), limits, name=MODEL)
    with serving(Engine(worker, limits=limits, config=config), model) as running:
        yield running


def _scrape(served: Served) -> dict[str, float]:
    """Every sample of ``/metrics`` by name and labels (``name{k=v,...}``), once idle."""
    import urllib.request

    served.snapshot()  # the engine is idle: nothing changes during the scrape
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=60) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_the_scraped_series_reconcile_with_the_responses(served: Served) -> None:
    """After six completions (whole and streamed, a stop, a cached prompt) every counter moved
    by the responses' sums, every histogram by one observation per request (the inter-token
    one by one per token after the first), finishes by reason; and the scrape equals the
    front door's own snapshot."""
    before = _scrape(served)
    client = served.client()
    repeated = "# request metrics: this prompt is sent twice\n" * 3
    usages, reasons, tokens = [], [], []
    for prompt, stop in (
        ("import os\nimport sys\n\n\ndef main():\n    ", None),
        ("def add(a, b):\n    return ", None),
        (repeated, None),
        (repeated, None),
        ("class Config:\n    def __init__(self", ")"),
    ):
        completion = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop
        )
        usages.append(completion.usage)
        reasons.append(completion.choices[0].finish_reason)
        tokens.append(speculative_usage(completion)["accepted_tokens"])
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="def add(a, b):\n    ",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usages.append(chunks[-1].usage)
    reasons.append([c.choices[0].finish_reason for c in chunks if c.choices][-1])
    tokens.append(speculative_usage(chunks[-1])["accepted_tokens"])
    after = _scrape(served)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert all(u is not None for u in usages)
    assert "stop" in reasons and "length" in reasons
    completion_tokens = [u.completion_tokens for u in usages if u is not None]
    cached = [
        (u.prompt_tokens_details.cached_tokens or 0)
        for u in usages
        if u is not None and u.prompt_tokens_details is not None
    ]
    assert len(cached) == len(usages) and cached[3] > 0  # the repeat came from the cache
    assert moved("specstate_prompt_tokens_total") == sum(u.prompt_tokens for u in usages if u)
    assert moved("specstate_generation_tokens_total") == sum(completion_tokens)
    assert moved("specstate_request_cached_tokens_total") == sum(cached)
    assert moved("specstate_request_accepted_tokens_total") == sum(tokens)
    n = len(usages)
    for name in HISTOGRAMS:
        expected = sum(t - 1 for t in completion_tokens) if "inter_token" in name else n
        assert moved(f"{name}_count") == expected, name
        assert moved(f"{name}_bucket{{le=+Inf}}") == expected, name
    ttft = moved("specstate_time_to_first_token_seconds_sum")
    queue = moved("specstate_request_queue_time_seconds_sum")
    e2e = moved("specstate_e2e_request_latency_seconds_sum")
    inter = moved("specstate_inter_token_latency_seconds_sum")
    assert 0 < queue <= ttft <= e2e and 0 < inter <= e2e
    for reason in ("stop", "length"):
        assert moved(f"specstate_request_finished_total{{reason={reason}}}") == reasons.count(
            reason
        )
    snap = served.snapshot().requests
    assert snap.num_generation_tokens == after["specstate_generation_tokens_total"]
    assert snap.e2e_latency.count == after["specstate_e2e_request_latency_seconds_count"]
    assert snap.e2e_latency.total_s == pytest.approx(
        after["specstate_e2e_request_latency_seconds_sum"]
    )


def test_the_running_and_waiting_gauges_follow_a_live_request(served: Served) -> None:
    """While a long stream runs, ``specstate_requests{state="running"}`` counts it; once it is
    closed (aborted) and the engine idle, running and waiting are 0."""
    stream = served.client().completions.create(
        model=MODEL, prompt="def main():\n    ", max_tokens=600, temperature=0, stream=True
    )
    first = next(iter(stream))
    assert first.choices
    import urllib.request

    with urllib.request.urlopen(f"{served.url}/metrics", timeout=60) as response:
        live = response.read().decode()
    stream.close()
    assert 'specstate_requests{state="running"} 1.0' in live
    assert 'specstate_requests{state="waiting"} 0.0' in live
    idle = _scrape(served)
    assert idle["specstate_requests{state=running}"] == 0
    assert idle["specstate_requests{state=waiting}"] == 0
    assert idle["specstate_request_finished_total{reason=abort}"] >= 1


def test_docs_observability_names_every_series_with_its_buckets(served: Served) -> None:
    """The serving-metrics table of docs/observability.md lists each histogram with the buckets
    the server exports, and each counter; the scrape has exactly those ``le`` labels."""
    page = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    section = page.split("## Serving metrics")[1].split("\n## ")[0]
    scraped = _scrape(served)
    for name, bounds in HISTOGRAMS.items():
        row = re.search(rf"^\| `{name}` \| histogram \| ([^|]*) \|", section, re.M)
        assert row is not None, name
        documented = [float(b) for b in re.findall(r"[\d.]+", row.group(1))]
        assert documented == list(bounds), name
        exported = sorted(
            float(key.split("le=")[1].rstrip("}"))
            for key in scraped
            if key.startswith(f"{name}_bucket{{") and "+Inf" not in key
        )
        assert exported == list(bounds), name
    for name in (*COUNTERS, "specstate_request_finished_total"):
        assert f"`{name.removesuffix('_total')}_total" in section, name


def test_an_observation_on_a_bound_falls_in_that_bucket() -> None:
    """Buckets are upper bounds, inclusive (Prometheus' ``le``); a first delivery of several
    tokens counts its extra tokens as inter-token gaps of 0."""
    from specstate import Req, SamplingParams
    from specstate.core.ownership import OwnershipChecker

    limits = RequestLimits(vocab_size=8, max_context_len=64)
    req = Req.new("r", [1, 2], SamplingParams(max_new_tokens=4), limits, checker=OwnershipChecker())
    metrics = RequestMetrics()
    metrics.record_accepted(req, arrived_s=10.0)
    metrics.record_delivery(req, 3, at_s=10.0 + TTFT_BUCKETS_S[2])
    snap = metrics.snapshot()
    assert snap.time_to_first_token.counts[2] == 1 and snap.time_to_first_token.count == 1
    assert snap.inter_token_latency.counts[0] == 2 and snap.inter_token_latency.total_s == 0
    assert snap.num_generation_tokens == 3 and snap.queue_time.count == 0  # never admitted
