"""`specstate bench host` replays the documented workload and checks every finish it times."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import pytest
import torch

from specstate.tools import host_workload as wl
from specstate.tools.bench_host import HostSettings, host_benchmark
from specstate.tools.draft_shapes import DRAFT_SHAPES


def test_the_steady_workload_keeps_its_documented_draws() -> None:
    """Prompt and accept lengths follow the documented seeds and draw order."""
    assert wl.steady_prompts(8) == [1693, 1002, 339, 115, 285, 1965, 1752, 1292]
    assert [a[0] for a in wl.steady_accepts(1, 5)] == [2, 1, 4, 4, 2]


def test_a_churned_request_ends_on_eos_inside_its_run_or_on_its_cap() -> None:
    """Replaying a request's runs puts EOS at output ``length - 1``, or stops at its cap."""
    draws = wl.Draws(4)
    reqs = [draws.next() for _ in range(40)]
    assert {r.by_eos for r in reqs} == {True, False}
    for req in reqs:
        outputs = [wl.FILLER]
        while len(outputs) < req.length:
            accept, tokens = req.next_run()
            outputs.extend(tokens[:accept])
        assert (outputs[req.length - 1] == wl.EOS) == req.by_eos
        assert wl.EOS not in outputs[: req.length - 1]


@pytest.mark.parametrize("workload", ["churn", "steady"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_a_small_run_reports_and_checks_every_finish(workload: str, page_size: int) -> None:
    """A tiny replay returns the peer-shaped report; its untimed checks passed."""
    settings = HostSettings(
        workload=workload, page_sizes=(page_size,), batch_sizes=(1, 6), iters=30, warmup=2,
        repeats=2, launch_us=0.0,
    )  # fmt: skip
    report = host_benchmark(settings)
    results = report["results"]
    assert isinstance(results, list)
    assert [(r["page_size"], r["bs"]) for r in results] == [(page_size, 1), (page_size, 6)]
    for row in results:
        assert row["samples"] == 60
        assert 0 < row["total_us"]["median"] <= row["total_us"]["p90"]
        assert row["total_us_best_repeat_median"] == min(row["total_us_median_per_repeat"])
        assert (row["finished_requests"] > 0) == (workload == "churn" and row["bs"] == 6)
        assert len(row["workload_digest"]) == 16


def test_device_work_is_modelled_as_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `req_to_token` store, every gathered relay buffer and every scatter of joined rows
    costs exactly one modelled launch, and nothing else spins; the functions are back in
    place after the run."""
    import specstate.relay.write_log as write_log
    from specstate.memory.slots import ReqToTokenPool
    from specstate.tools import bench_host

    launches = {"store": 0, "gather": 0, "patch": 0}
    store, gather, patch_rows = ReqToTokenPool._store, write_log._gather, write_log._patch_rows

    def counted_store(*args: Any) -> None:
        launches["store"] += 1
        store(*args)

    def counted_gather(buffers: Sequence[torch.Tensor | None], indices: torch.Tensor) -> Any:
        launches["gather"] += sum(b is not None for b in buffers)
        return gather(buffers, indices)

    def counted_patch(*args: Any) -> torch.Tensor:
        launches["patch"] += 1 + (args[3] is not None)
        return patch_rows(*args)

    monkeypatch.setattr(ReqToTokenPool, "_store", counted_store)
    monkeypatch.setattr(write_log, "_gather", counted_gather)
    monkeypatch.setattr(write_log, "_patch_rows", counted_patch)
    spins: list[int] = []
    monkeypatch.setattr(bench_host, "_spin", spins.append)
    settings = HostSettings(
        workload="churn", page_sizes=(1,), batch_sizes=(6,), iters=30, warmup=2, repeats=1,
        launch_us=7.0,
    )  # fmt: skip
    host_benchmark(settings)
    assert launches["store"] > 0 and launches["patch"] > 0  # churned rounds patch the relay
    assert set(spins) == {7000}
    assert len(spins) == sum(launches.values())
    assert ReqToTokenPool._store is counted_store
    assert (write_log._gather, write_log._patch_rows) == (counted_gather, counted_patch)


@pytest.mark.parametrize("algorithm", sorted(DRAFT_SHAPES))
def test_every_drafter_family_replays_through_the_same_round(algorithm: str) -> None:
    """`bench host --algorithm`: the stand-in declares the family and relays its extras; the
    same requests finish the same way (the workload digest does not depend on the family)."""
    settings = HostSettings(
        page_sizes=(16,), batch_sizes=(6,), iters=20, warmup=2, repeats=1, launch_us=0.0,
        algorithm=algorithm,
    )  # fmt: skip
    report = host_benchmark(settings)
    config = report["config"]
    assert isinstance(config, dict) and config["algorithm"].startswith(f"{algorithm}, ")
    results = report["results"]
    assert isinstance(results, list)
    eagle = host_benchmark(attrs.evolve(settings, algorithm="eagle"))["results"]
    assert isinstance(eagle, list)
    assert results[0]["workload_digest"] == eagle[0]["workload_digest"]
    assert results[0]["finished_requests"] == eagle[0]["finished_requests"] > 0


def test_the_ops_launch_model_counts_charges_and_never_spins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``launch_model="ops"`` replays each run once more to count its tensor operations and
    charges each one launch, with no spin; ``handoff`` adds the figure with the hand-off to
    request streams; ``device="cpu:0"`` takes the engine's device path (more operations)."""
    from specstate.tools import bench_host

    spins: list[int] = []
    monkeypatch.setattr(bench_host, "_spin", spins.append)
    counted: dict[str, float] = {}
    for device in ("cpu", "cpu:0"):
        settings = HostSettings(
            workload="churn", page_sizes=(1,), batch_sizes=(6,), iters=20, warmup=2, repeats=1,
            launch_us=0.0, launch_model="ops", handoff=True, device=device,
        )  # fmt: skip
        report = host_benchmark(settings)
        results = report["results"]
        assert isinstance(results, list)
        (row,) = results
        assert row["total_us"]["median"] == row["host_us"]["median"]  # launches cost 0 here
        assert row["handoff_total_us"]["median"] > 0
        assert row["finished_requests"] > 0 and len(row["cohort_digest"]) == 16
        counted[device] = row["device_ops"]["median"]
    assert spins == []
    assert 0 < counted["cpu"] < counted["cpu:0"]


def test_the_device_write_into_req_to_token_is_two_modelled_launches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the device path, each write into the device copy of ``req_to_token`` (a host-to-device
    copy and an indexed store) runs as a modelled kernel of two launches, as SGLang's
    ``assign_req_to_token_pool`` kernel is on its side; the original method is restored."""
    from specstate.memory.slots import ReqToTokenPool
    from specstate.tools import bench_host

    real = ReqToTokenPool._store_device
    stores: list[int] = []

    def spy(self: ReqToTokenPool, both: Any, n: int) -> None:
        stores.append(n)
        real(self, both, n)

    launches: list[int] = []
    kernel = bench_host.COUNTER.kernel

    def recording(count: int, fn: Any, *args: Any) -> Any:
        if fn is spy:
            launches.append(count)
        return kernel(count, fn, *args)

    monkeypatch.setattr(ReqToTokenPool, "_store_device", spy)
    monkeypatch.setattr(bench_host.COUNTER, "kernel", recording)
    settings = HostSettings(
        workload="steady", page_sizes=(1,), batch_sizes=(2,), iters=6, warmup=1, repeats=1,
        launch_us=0.0, launch_model="ops", device="cpu:0",
    )  # fmt: skip
    host_benchmark(settings)
    assert stores and launches == [2] * len(stores)  # page 1: every decode round writes
    assert ReqToTokenPool._store_device is spy
