"""The relay under churn: a persistent batch reads each row from where its latest write lives."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specstate.batch.sampling import SamplingInfo
from specstate.core.ownership import OwnershipChecker
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.engine.schedule.decode_columns import DecodeColumns
from specstate.engine.schedule.decode_rows import DecodeRows
from specstate.relay.future_map import FutureMap, RelayPayload

MAX_SLOTS = 40
HIDDEN = 3


def _req(i: int) -> Req:
    limits = RequestLimits(vocab_size=32, max_context_len=64)
    return Req.new(
        f"r{i}", [1, 2], SamplingParams(), limits, checker=OwnershipChecker(enabled=False)
    )


class _Churn:
    """Requests join (a prefill write of their slot) and leave (their slot freed for reuse);
    the decode rounds write every row; ``want`` is what eager writes would leave per slot."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.fm = FutureMap(MAX_SLOTS, device=torch.device("cpu"))
        self.free = list(range(1, MAX_SLOTS))
        self.rng.shuffle(self.free)
        self.slot_of: dict[Req, int] = {}
        self.running: list[Req] = []
        self.want: dict[int, tuple[int, int, float]] = {}  # slot -> (frontier, bonus, hidden)
        self.rows = DecodeRows(self._build)
        self.count = 0

    def _build(self, reqs: tuple[Req, ...]) -> DecodeColumns:
        slots = torch.tensor([self.slot_of[r] for r in reqs], dtype=torch.int64)
        return DecodeColumns(
            reqs=reqs,
            slots=slots,
            slots_host=slots.numpy(),
            device_slots=slots,
            incarnations=tuple(r.incarnation for r in reqs),
            sampling=SamplingInfo.from_params(
                [r.sampling for r in reqs], vocab_size=32, device=torch.device("cpu")
            ),
            epochs=np.zeros(len(reqs), dtype=np.int64),
            request_ids=tuple(r.request_id for r in reqs),
        )

    def _write(self, slots: list[int]) -> None:
        """One forward's publish and stash for ``slots`` (fresh values)."""
        index = torch.tensor(slots, dtype=torch.int64)
        self._write_index(index)

    def _write_index(self, index: torch.Tensor) -> torch.Tensor:
        values = [
            (self.rng.randrange(1 << 30), self.rng.randrange(1 << 30)) for _ in range(len(index))
        ]
        hidden = [float(self.rng.randrange(1000)) for _ in range(len(index))]
        lens = torch.tensor([v[0] for v in values])
        bonus = torch.tensor([v[1] for v in values])
        states = torch.tensor(hidden).repeat_interleave(HIDDEN).view(-1, HIDDEN)
        host = index.numpy()
        self.fm.publish(index, lens, host=host)
        self.fm.stash(index, RelayPayload(bonus_tokens=bonus, hidden_states=states), host=host)
        for slot, (frontier, token), h in zip(host.tolist(), values, hidden, strict=True):
            self.want[slot] = (frontier, token, h)
        return bonus

    def join(self, n: int) -> None:
        joiners = []
        for _ in range(min(n, len(self.free))):
            self.count += 1
            req = _req(self.count)
            self.slot_of[req] = self.free.pop(0)
            joiners.append(req)
        if joiners:  # their prefill writes their slots
            self._write([self.slot_of[r] for r in joiners])
        for req in joiners:
            self.running.append(req)
            self.rows.join(req)

    def leave(self, n: int) -> None:
        for req in self.rng.sample(self.running, min(n, len(self.running))):
            self.running.remove(req)
            self.rows.leave(req)
            self.free.append(self.slot_of.pop(req))  # reused by a later joiner

    def decode_round(self) -> None:
        """Resolve the batch through its patch, check every row, then write every row."""
        cols = self.rows.columns(lambda: tuple(self.running))
        patch = self.rows.relay_patch(cols)
        lens = self.fm.resolve_seq_lens(cols.device_slots, patch=patch).seq_lens
        got = self.fm.resolve_forward_inputs(cols.device_slots, patch=patch)
        assert got.hidden_states is not None
        expect = [self.want[s] for s in cols.slots_host.tolist()]
        assert lens.tolist() == [e[0] for e in expect]
        assert got.bonus_tokens.tolist() == [e[1] for e in expect]
        assert got.hidden_states[:, 0].tolist() == [e[2] for e in expect]
        self._write_index(cols.device_slots)


@pytest.mark.parametrize("seed", range(6))
def test_a_churned_batch_relays_every_row_from_its_latest_write(seed: int) -> None:
    """Rows stay, move (condense), join in reused slots: each reads its slot's latest value,
    and the writes of requests that left are dropped, not kept (the log stays short)."""
    churn = _Churn(seed)
    churn.join(12)
    churn.decode_round()  # the first round reads through the buffers
    for _ in range(60):
        left = churn.rng.randint(0, 4)
        churn.leave(left)
        churn.join(churn.rng.randint(0, 4) if churn.rng.random() < 0.8 else 0)
        if not churn.running:
            churn.join(1)
        churn.decode_round()
        # The round's write supersedes every kept row, and the rows that left are dead.
        assert churn.fm.snapshot().num_kept_writes == 2


@pytest.mark.parametrize("seed", range(4))
def test_a_later_write_of_kept_rows_is_read_not_the_previous_round(seed: int) -> None:
    """Between two decode rounds some running rows are written again (a mixed batch's tails
    extend them): the next round reads those rows' new values, with or without churn."""
    churn = _Churn(seed)
    churn.join(10)
    churn.decode_round()
    for _ in range(30):
        if churn.rng.random() < 0.5:
            churn.leave(churn.rng.randint(0, 2))
            churn.join(churn.rng.randint(0, 2))
        if not churn.running:
            churn.join(1)
        tails = churn.rng.sample(churn.running, churn.rng.randint(1, len(churn.running)))
        churn._write([churn.slot_of[r] for r in tails])  # a write of kept rows since the round
        churn.decode_round()


def test_an_unchanged_batch_reads_its_last_write_by_reference() -> None:
    """No one left or joined: the resolve returns the written tensor itself (no copy)."""
    churn = _Churn(0)
    churn.join(5)
    churn.decode_round()
    cols = churn.rows.columns(lambda: tuple(churn.running))
    patch = churn.rows.relay_patch(cols)
    assert patch is not None and patch.gather is None
    written = churn._write_index(cols.device_slots)
    assert churn.fm.resolve_forward_inputs(cols.device_slots, patch=patch).bonus_tokens is written


def test_rows_that_leave_at_the_end_leave_the_others_reading_the_last_write() -> None:
    """Only the last rows left: the next round reads the first rows of the last write (a view
    of its tensors: no gather, no flush into the buffers), with the right values."""
    churn = _Churn(1)
    churn.join(6)
    churn.decode_round()
    cols = churn.rows.columns(lambda: tuple(churn.running))
    churn.rows.relay_patch(cols)
    written = churn._write_index(cols.device_slots)
    for req in churn.running[-2:]:  # the last two rows leave; nobody joins
        churn.running.remove(req)
        churn.rows.leave(req)
    cols = churn.rows.columns(lambda: tuple(churn.running))
    patch = churn.rows.relay_patch(cols)
    assert patch is not None and patch.gather is None and patch.departed_host.size == 2
    got = churn.fm.resolve_forward_inputs(cols.device_slots, patch=patch).bonus_tokens
    assert got.untyped_storage().data_ptr() == written.untyped_storage().data_ptr()
    assert got.tolist() == [churn.want[s][1] for s in cols.slots_host.tolist()]
