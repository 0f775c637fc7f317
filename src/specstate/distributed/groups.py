"""One rank's membership of a tensor-parallel group: its rank and the groups it talks on.

`RankGroup` owns the process groups of one rank (``torch.distributed``)::

    worker group    the model's collectives: the all-reduce after each row-parallel layer, the
                    broadcast of rank 0's seed and n-gram drafts. Called by the forward (the
                    forward stream's thread under overlap). NCCL on CUDA, gloo on a CPU.
    control group   the engine's host decisions inside a step: the adaptive draft width and the
                    agreement on every round. Called by the thread that drives the engine.
                    Always gloo, on host tensors.
    command group   rank 0's commands of each step (submits, aborts, step, close), from the
                    same thread. Gloo, with the idle timeout: a follower waits there while the
                    leader has nothing to do.

Separate groups, because under overlap two threads issue collectives at the same time (the ranks
of one group must issue its collectives in one order), and because waiting for work and waiting
for a peer inside a round deserve different timeouts.

Failure: a collective that raises (a peer closed its connection, or nothing came within the
group's timeout) leaves its group unusable (gloo closes the connections on a timeout). The group
keeps the first failure and raises `RankFailure`, at once and on every later call, so a dead or
wedged peer costs at most one timeout, never a hang. The control group's timeout is twice the
worker group's, so a rank whose forward waits out a worker-group timeout still reaches the
round's agreement in time.

Invariant: every rank calls the collectives of each group in the same order; after a failure
a group performs no collective.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Sequence
from typing import Final

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from specstate.core.errors import InvalidConfig, RankFailure

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "ControlGroup",
    "RankGroup",
    "WorkerGroup",
]

DEFAULT_TIMEOUT_S: Final = 60.0
"""Seconds a model collective may take before the group fails (the round's agreement: twice)."""
DEFAULT_IDLE_TIMEOUT_S: Final = 3600.0
"""Seconds a follower waits for rank 0's next command before the group fails."""


class _Collectives:
    """Calls the collectives of one process group; the first failure is kept and re-raised."""

    def __init__(self, name: str, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self._name = name
        self._group = group
        self._rank = rank
        self._size = size
        self.failure: RankFailure | None = None

    @property
    def rank(self) -> int:
        """This rank, ``0 .. world_size - 1``."""
        return self._rank

    @property
    def world_size(self) -> int:
        """How many ranks the group has."""
        return self._size

    def _call(self, what: str, op: Callable[[], object]) -> None:
        """Run one collective; `RankFailure` (now and at every later call) if it fails."""
        if self.failure is not None:
            raise RankFailure(
                f"rank {self._rank}: the {self._name} group failed earlier ({self.failure})"
            )
        try:
            op()
        except RuntimeError as exc:  # gloo / NCCL: a timeout, a closed connection
            self.failure = RankFailure(
                f"rank {self._rank}: {self._name} {what} failed (a rank died or wedged, or "
                f"nothing came within the timeout): {str(exc).splitlines()[0]}"
            )
            raise self.failure from exc

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self._size)]
        self._call("all_gather", lambda: dist.all_gather(parts, tensor, group=self._group))
        return parts

    def _broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        buf = tensor.contiguous().clone()
        self._call("broadcast", lambda: dist.broadcast(buf, group=self._group, group_src=src))
        return buf


class WorkerGroup(_Collectives):
    """The worker's collectives (`specstate.engine.worker.ParallelGroup`); see the module doc."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks, bit for bit equal on every rank.

        An all-gather then a sum in rank order, the same on every rank: nothing promises that a
        backend's all-reduce sums in one order on every rank (a ring may start each rank's sum
        at itself), and ranks whose hidden states differ in the last bit could choose different
        tokens.
        """
        if self._size == 1:
            return tensor
        parts = self._gather(tensor.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tensor`` on every rank (a new tensor)."""
        return tensor if self._size == 1 else self._broadcast(tensor)


class ControlGroup(_Collectives):
    """The engine's host-side collectives, on host tensors (gloo); see the module docstring."""

    def broadcast_ints(self, values: Sequence[int]) -> tuple[int, ...]:
        """Rank 0's ``values`` on every rank (every rank passes the same count)."""
        if self._size == 1:
            return tuple(values)
        got = self._broadcast(torch.tensor(list(values), dtype=torch.int64))
        return tuple(int(v) for v in got.tolist())

    def broadcast_bytes_from(self, src: int, payload: bytes, size: int) -> bytes:
        """Rank ``src``'s ``payload`` of ``size`` bytes (every rank learned ``size`` before)."""
        if self._size == 1 or size == 0:
            return payload
        buf = torch.zeros(size, dtype=torch.uint8)
        if self._rank == src:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return self._broadcast(buf, src).numpy().tobytes()

    def barrier(self) -> None:
        """Wait until every rank got here."""
        if self._size > 1:
            self._call("barrier", lambda: dist.barrier(group=self._group))

    def all_gather_ints(self, values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``[world_size, k]``: row ``r`` is rank ``r``'s ``values`` (``[k]`` on every rank)."""
        if self._size == 1:
            return values[None, :].copy()
        parts = self._gather(torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64)))
        return torch.stack(parts).numpy()


class RankGroup:
    """One rank of a tensor-parallel group: both process groups, built and torn down together.

    Build it with `RankGroup.init` (explicit rank and address) or `RankGroup.from_env` (the
    variables ``torchrun`` sets), use it as a context manager, and hand it to
    `specstate.distributed.DistributedEngine`.

    Args:
        rank: this rank.
        world_size: ranks in the group.
        device: where the worker's tensors live (``cuda:<local rank>`` for NCCL).
        timeout_s: the worker group's collective timeout; the control group's is twice it.
        idle_timeout_s: the command group's: how long a follower waits for rank 0's next step.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout_s = timeout_s
        groups: list[dist.ProcessGroup | None] = [None, None, None]
        if world_size > 1:
            groups = [
                dist.group.WORLD,
                dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2 * timeout_s)),
                dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=idle_timeout_s)),
            ]
        self.worker = WorkerGroup("worker", groups[0], rank, world_size)
        self.control = ControlGroup("control", groups[1], rank, world_size)
        self.commands = ControlGroup("command", groups[2], rank, world_size)
        self._closed = False

    @classmethod
    def init(
        cls,
        *,
        rank: int,
        world_size: int,
        init_method: str = "env://",
        device: str | torch.device = "cpu",
        timeout_s: float = DEFAULT_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> RankGroup:
        """Join the group (``torch.distributed.init_process_group``); every rank calls it.

        Raises:
            InvalidConfig: a bad rank, world size or timeout, or a process group exists already.
        """
        if not 0 <= rank < world_size or not timeout_s > 0 or not idle_timeout_s > 0:
            raise InvalidConfig(
                f"RankGroup: rank {rank} of world size {world_size}, timeout {timeout_s} s, "
                f"idle timeout {idle_timeout_s} s"
            )
        if dist.is_initialized():
            raise InvalidConfig("RankGroup: this process already joined a process group")
        where = torch.device(device)
        if world_size > 1:
            backend = "nccl" if where.type == "cuda" else "gloo"
            if where.type == "cuda":
                torch.cuda.set_device(where)
            dist.init_process_group(
                backend=backend,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
        return cls(
            rank=rank,
            world_size=world_size,
            device=where,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
        )

    @classmethod
    def from_env(
        cls,
        *,
        device: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> RankGroup:
        """Join from ``torchrun``'s variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...).

        ``device`` None: ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``.

        Raises:
            InvalidConfig: ``RANK`` or ``WORLD_SIZE`` is missing or not an integer.
        """
        try:
            rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
        except (KeyError, ValueError) as exc:
            raise InvalidConfig(f"RankGroup.from_env: no torchrun environment ({exc})") from None
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        return cls.init(
            rank=rank,
            world_size=world_size,
            device=device,
            timeout_s=timeout_s,
            idle_timeout_s=idle_timeout_s,
        )

    @property
    def is_leader(self) -> bool:
        """True on rank 0, the rank that takes requests and makes the host decisions."""
        return self.rank == 0

    @property
    def failure(self) -> RankFailure | None:
        """The first collective failure of any of the groups, or None."""
        return self.worker.failure or self.control.failure or self.commands.failure

    def close(self) -> None:
        """Leave the group (every rank calls it); idempotent.

        The ranks meet at a barrier first: a rank that tears its groups down while another
        still finishes its last collective can abort at exit. After a failure (or when the
        barrier fails) the groups are only dropped; leave such a process with ``os._exit``.
        """
        if self._closed:
            return
        self._closed = True
        if not dist.is_initialized() or self.failure is not None:
            return
        try:
            self.control.barrier()
        except RankFailure:
            return
        dist.destroy_process_group()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
