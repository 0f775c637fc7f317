"""`specstate.tools.host_ops`: the tensor-operation counter every side of the comparison uses."""

from __future__ import annotations

import threading

import pytest
import torch

from specstate.tools import host_workload as wl
from specstate.tools.host_ops import OpCounter, count_ops_of


def test_work_counts_and_views_do_not() -> None:
    """An index gather and an add count one each; slices, views and wrapping data do not."""
    base = torch.arange(10)
    index = torch.tensor([1, 2])

    def work() -> None:
        base[2:5].view(3)  # views
        torch.tensor([1, 2, 3])  # wrapping Python data on the host: no kernel
        base[index]  # a gather
        base.add(1)

    assert count_ops_of(work) == (2, 0)


def test_a_move_that_is_a_no_op_here_counts_once() -> None:
    """``.to(device)``, ``.cpu()`` and a factory with a device are host-device copies on a GPU;
    a ``.to(dtype)`` is a kernel the dispatcher counts, not a move counted twice."""
    t = torch.arange(4)

    def work() -> None:
        t.to("cpu")
        t.cpu()
        torch.tensor([1, 2], device="cpu")
        t.to(torch.int32)  # a copy kernel: counted by the dispatcher only

    assert count_ops_of(work) == (4, 3)


def test_a_modelled_kernel_counts_its_launches_and_nothing_inside() -> None:
    """`OpCounter.kernel` counts the launches it is given; the stand-in's own calls are not."""
    counter = OpCounter()
    with counter:
        counter.enabled = True
        counter.kernel(4, lambda: [torch.ones(3).add(1) for _ in range(5)])
        counter.add(1)
        counter.enabled = False
        torch.ones(3).add(1)  # not enabled: not counted
    assert counter.take() == (5, 0)
    assert counter.take() == (0, 0)


def test_work_on_another_thread_counts_through_bound() -> None:
    """Torch's modes are per thread: a function run through `OpCounter.bound` on another
    thread is counted there too; entering twice in one thread is refused."""
    counter = OpCounter()
    with counter:
        counter.enabled = True
        worker = threading.Thread(target=counter.bound(lambda: torch.ones(2).add(1)))
        worker.start()
        worker.join()
        with pytest.raises(RuntimeError, match="already entered"):
            counter.__enter__()
    assert counter.take() == (2, 0)


def test_the_first_cohort_digest_ignores_later_generations() -> None:
    """`cohort_digest` keeps only requests below ``bs``: a loop that starts its joiners a round
    later has another `digest` but the same cohort digest."""
    ours = [(3, 0, 9), (5, 1, 12), (7, 2, 4)]
    shifted = [(3, 0, 9), (5, 1, 12), (8, 2, 4)]  # request 2 joined a round later
    assert wl.digest(ours) != wl.digest(shifted)
    assert wl.cohort_digest(ours, 2) == wl.cohort_digest(shifted, 2)
    assert wl.cohort_digest(ours, 3) != wl.cohort_digest(shifted, 3)
