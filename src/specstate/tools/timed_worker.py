"""`TimedWaitWorker`: a worker whose device work is a timed wait, to measure the host path.

A forward sleeps ``device_seconds`` and returns a well-formed result. A sleep releases the GIL
and uses no CPU, as a GPU forward would, so the normal loop costs host + device per round and
the overlap loop about max(host, device). With ``device_seconds=0`` the worker does no waiting
at all, and a step's wall time is the engine's host work plus building a tiny result.

Two device models:

* blocking (default): the forward sleeps on the forward stream's thread, so the stream's own
  Python (resolve, isolation, publish, stash) runs in series with the wait;
* asynchronous (``asynchronous=True``): like a GPU, the forward is *enqueued*: it returns at
  once, the device is busy until ``max(now, end of the previous forward) + device_seconds``,
  and the result's ``copy_done`` event completes then. Host Python — the stream's included —
  overlaps the device time; a round costs max(host, device).

Its tokens are a constant (the engine's bookkeeping does not depend on their values) and every
decode row accepts the same run length, so a workload's growth is known in advance::

    round k (decode):  S  ->  S + accept      (one publish of the new frontier per forward)

Synthetic acceptance (``accept_rates``, like SGLang's ``SIMULATE_ACC_LEN`` and vLLM's
synthetic mode): draft position ``k`` (1-based) is accepted with probability
``accept_rates[k - 1]`` given the ones before it were, drawn per row and round from a seeded
generator, so the system can be measured at a chosen acceptance apart from any drafter; the
accept length is one plus the accepted leading drafts.

Invariant: every result satisfies the forward contract of `specstate.engine.worker`: EXTEND
returns stride 1, accept 1 and ``new_seq_lens == seq_lens``; DECODE returns stride
``num_steps + 1``, ``accept`` per row and ``new_seq_lens == seq_lens + accept``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.memory.prefix_cache import PrefixSharing
from specstate.relay.future_map import RelayPayload
from specstate.relay.streams import Stream
from specstate.tools.draft_shapes import DraftShape

__all__ = ["DeadlineEvent", "TimedWaitWorker"]

_TOKEN_ID: Final = 7
_HIDDEN: Final = 256
"""The model width of a relayed hidden state (``draft_shape``), as `specstate bench host`'s."""
"""The token every forward samples; any id below the vocabulary size would do."""


class TimedWaitWorker:
    """A chain drafter of ``num_steps`` whose forward is a ``device_seconds`` wait.

    Args:
        device_seconds: wall time of one forward; 0 means no wait at all.
        num_steps: draft steps per round (the verify width is ``num_steps + 1``).
        accept: tokens every decode row accepts per round, bonus included,
            ``1 <= accept <= num_steps + 1``.
        asynchronous: model an asynchronous device (see the module docstring).
        accept_rates: synthetic acceptance, one probability per draft position (``num_steps``
            of them, each in ``[0, 1]``); ``accept`` is then ignored.
        seed: seeds the synthetic acceptance.
        draft_shape: declare a drafter family's name and draft KV and relay its payload extras
            (`specstate.tools.draft_shapes`; zeros, built once per batch size and never
            written); None: ``timed_wait`` with draft KV, relaying the bonus tokens only.

    Raises:
        InvalidConfig: a negative wait, fewer than one draft step, ``accept`` outside
            ``[1, num_steps + 1]``, or rates that are not ``num_steps`` probabilities.
    """

    def __init__(
        self,
        *,
        device_seconds: float,
        num_steps: int = 3,
        accept: int = 2,
        asynchronous: bool = False,
        accept_rates: Sequence[float] | None = None,
        seed: int = 0,
        draft_shape: DraftShape | None = None,
    ) -> None:
        if not device_seconds >= 0.0:  # also rejects NaN
            raise InvalidConfig(f"device_seconds must be >= 0, got {device_seconds}")
        if num_steps < 1:
            raise InvalidConfig(f"num_steps must be >= 1, got {num_steps}")
        if not 1 <= accept <= num_steps + 1:
            raise InvalidConfig(f"accept must be in [1, {num_steps + 1}], got {accept}")
        if accept_rates is not None and (
            len(accept_rates) != num_steps or not all(0.0 <= r <= 1.0 for r in accept_rates)
        ):
            raise InvalidConfig(
                f"accept_rates must be {num_steps} probabilities in [0, 1], got {accept_rates}"
            )
        self._rates = None if accept_rates is None else np.asarray(accept_rates, dtype=float)
        self._rng = np.random.default_rng(seed)
        self._device_seconds = device_seconds
        self._asynchronous = asynchronous
        self._device_free_at = 0.0  # asynchronous: when the device finishes its queued work
        self._num_steps = num_steps
        self._accept = accept
        self._shape = draft_shape
        self._extras: dict[int, RelayPayload] = {}  # batch size -> the payload's extras
        name = "timed_wait" if draft_shape is None else draft_shape.algorithm
        keeps = True if draft_shape is None else draft_shape.keeps_draft_kv
        chain = WorkerCapabilities.chain(name, num_steps=num_steps, keeps_draft_kv=keeps)
        self._capabilities = attrs.evolve(
            chain,
            asynchronous=asynchronous,
            supports_sampling=True,
            prefix_sharing=PrefixSharing.TOKEN,
            supports_verify_budgets=True,
        )

    @property
    def device_seconds(self) -> float:
        """Wall time of one forward, in seconds."""
        return self._device_seconds

    @property
    def accept(self) -> int:
        """Tokens a decode row accepts per round (bonus included); with synthetic
        acceptance, the most it can accept (``num_steps + 1``)."""
        return self._accept if self._rates is None else self._num_steps + 1

    @property
    def capabilities(self) -> WorkerCapabilities:
        """A chain drafter of ``num_steps`` that keeps its own draft KV; supports overlap.

        It declares ``supports_sampling``: its tokens are a constant whatever a request asks,
        and taking sampled requests lets a benchmark measure the host path of a sampled batch.
        It keeps no state at all, so prefixes may be shared (`PrefixSharing.TOKEN`), and
        honours verify budgets (``supports_verify_budgets``: a row accepts at most its budget
        + 1 and reports it verified its budget). The asynchronous device model declares
        ``asynchronous``: its forward only enqueues.
        """
        return self._capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build: the worker keeps no KV of its own."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Wait ``device_seconds``, publish the new frontier, return a fresh result.

        Postcondition: the returned tensors are new and never written again by the worker.
        """
        copy_done = None
        if self._asynchronous:
            start = max(time.perf_counter(), self._device_free_at)
            self._device_free_at = start + self._device_seconds
            copy_done = DeadlineEvent(self._device_free_at)
        elif self._device_seconds > 0.0:
            time.sleep(self._device_seconds)
        rows = batch.batch_size
        device = batch.seq_lens.device  # the result lives where the batch does
        if batch.forward_mode.is_decode():
            stride = self._num_steps + 1
            if self._rates is None:
                accept_lens = torch.full((rows,), self._accept, dtype=torch.int64, device=device)
            else:
                hits = self._rng.random((rows, self._num_steps)) < self._rates
                runs = 1 + np.cumprod(hits, axis=1).sum(axis=1)
                accept_lens = torch.from_numpy(runs.astype(np.int64)).to(device)
            budgets = batch.verify_budgets
            verified = None
            if budgets is not None:  # a row verifies at most its budget
                accept_lens = torch.minimum(accept_lens, budgets + 1)
                verified = budgets
            new_seq_lens = batch.seq_lens + accept_lens
        else:
            stride = 1
            accept_lens = torch.ones(rows, dtype=torch.int64, device=device)
            new_seq_lens = batch.seq_lens.clone()
            verified = None
        if on_publish is not None:
            on_publish(new_seq_lens)
        return GenerationBatchResult(
            next_token_ids=torch.full(
                (rows * stride,), _TOKEN_ID, dtype=torch.int64, device=device
            ),
            accept_lens=accept_lens,
            stride=stride,
            new_seq_lens=new_seq_lens,
            next_draft_input=self._relay(rows, device),
            copy_done=copy_done,
            verified_lens=verified,
        )

    def _relay(self, rows: int, device: torch.device) -> RelayPayload:
        """The bonus tokens and, with a draft shape, its extras (built once per size)."""
        bonus = torch.full((rows,), _TOKEN_ID, dtype=torch.int64, device=device)
        shape = self._shape
        if shape is None:
            return RelayPayload(bonus_tokens=bonus)
        extras = self._extras.get(rows)
        if extras is None:
            width = _HIDDEN * shape.hidden_multiple
            top = torch.zeros((rows, 1), device=device) if shape.topk else None
            extras = RelayPayload(
                bonus_tokens=bonus,
                topk_p=top,
                topk_index=None if top is None else top.long(),
                hidden_states=torch.zeros((rows, width), dtype=torch.bfloat16, device=device)
                if width
                else None,
            )
            self._extras[rows] = extras
        return attrs.evolve(extras, bonus_tokens=bonus)


class DeadlineEvent:
    """An `Event` that completes at a wall-clock deadline (``time.perf_counter`` seconds)."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def query(self) -> bool:
        """Whether the deadline has passed."""
        return time.perf_counter() >= self._deadline

    def synchronize(self) -> None:
        """Sleep until the deadline (releases the interpreter lock, uses no CPU)."""
        left = self._deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def synchronize_within(self, seconds: float) -> bool:
        """Sleep until the deadline or for ``seconds``, whichever is first; whether it passed."""
        left = self._deadline - time.perf_counter()
        if left > seconds:
            time.sleep(seconds)
            return False
        self.synchronize()
        return True

    def wait(self, stream: Stream) -> None:
        """Make later work on ``stream`` wait for the deadline."""
        stream.submit(self.synchronize)

    def wait_current(self) -> None:
        """Block the calling thread until the deadline."""
        self.synchronize()
