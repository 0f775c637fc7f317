"""The per-row columns of a set of requests: slots, sampling state, output-row epochs, ids.

`RowColumns` builds them for the scheduler's batches: the extend and mixed plans read `slots`
and `sampling`, and the persistent decode rows (`specstate.engine.schedule.decode_rows`) build the
columns of the requests that join with `build` (`plain` when every row samples with
temperature, top-k and top-p only: two host arrays, no Python call per request; `general`
otherwise, and as the checking mode's reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specstate.batch.sampling import SamplingInfo
from specstate.core.params import SamplingParams
from specstate.core.request import Req
from specstate.engine.schedule.decode_columns import DecodeColumns, PlainRows, plain_columns
from specstate.engine.settle.outputs import OutputTable
from specstate.memory.allocation import KvAllocator

__all__ = ["RowColumns"]


class RowColumns:
    """Builds the columns of requests that hold KV slots (read-only on every owner it asks).

    Args:
        allocator: whose slots the requests hold.
        outputs: the output rows (their epochs, the EOS ids).
        vocab_size: the model's vocabulary (a larger top-k keeps every token).
        device: where the columns' device tensors live.
    """

    def __init__(
        self,
        *,
        allocator: KvAllocator,
        outputs: OutputTable,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self._allocator = allocator
        self._outputs = outputs
        self._vocab_size = vocab_size
        self._device = device

    def slots(self, reqs: Sequence[Req]) -> torch.Tensor:
        """The request slots ``reqs`` hold, as a host int64 tensor."""
        return torch.tensor(self._allocator.slots_of(reqs), dtype=torch.int64)

    def build(self, reqs: tuple[Req, ...]) -> DecodeColumns:
        """The columns of ``reqs``: from two host arrays when every row is plain, else
        `general`."""
        plain = self.plain(reqs)
        if plain is None:
            return self.general(reqs)
        incarnations = tuple(Req.incarnations_of(reqs))
        request_ids = tuple(r.request_id for r in reqs)
        return plain_columns(reqs, incarnations, request_ids, plain, self._device)

    def general(self, reqs: tuple[Req, ...]) -> DecodeColumns:
        """The columns of ``reqs`` built from their parameters (any sampling control)."""
        incarnations = tuple(Req.incarnations_of(reqs))
        request_ids = tuple(r.request_id for r in reqs)
        slots = self.slots(reqs)
        return DecodeColumns(
            reqs=reqs,
            slots=slots,
            slots_host=slots.numpy(),
            device_slots=slots.to(self._device),
            incarnations=incarnations,
            sampling=self.sampling(reqs),
            epochs=self._outputs.epochs(slots.numpy()),
            request_ids=request_ids,
        )

    def plain(self, reqs: tuple[Req, ...]) -> PlainRows | None:
        """The host values of ``reqs``' rows, or None when one of them is not plain (it uses a
        sampling control beyond temperature, top-k and top-p); no Python call per request."""
        params = [req.sampling for req in reqs]
        if not _all_plain(params):
            return None
        vocab = self._vocab_size
        rows = PlainRows.empty(len(reqs))
        ints = rows.ints
        ints[0] = self._allocator.slots_of(reqs)
        ints[1] = self._outputs.epochs(ints[0])
        # No top-k, or one past the vocabulary, keeps every token.
        ints[2] = [vocab if p.top_k is None or p.top_k > vocab else p.top_k for p in params]
        rows.floats[:] = [[p.temperature for p in params], [p.top_p for p in params]]
        return rows

    def sampling(self, reqs: Sequence[Req]) -> SamplingInfo:
        """The sampling state of ``reqs``, one row each (any sampling control)."""
        return SamplingInfo.from_params(
            [r.sampling for r in reqs],
            vocab_size=self._vocab_size,
            device=self._device,
            prompt_lens=[len(r.prompt_ids) for r in reqs],
            eos_token_ids=self._outputs.eos_token_ids,
        )


def _all_plain(params: Sequence[SamplingParams]) -> bool:
    """True when every request's sampling is temperature, top-k and top-p only: its row of a
    `SamplingInfo` has no optional tensor (`SamplingInfo.from_params` would build none)."""
    flags = [  # a list, not a generator: that would resume once per request
        p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.min_new_tokens == 0
        and p.seed is None
        and p.speculative
        and not p.logprobs
        for p in params
    ]
    return all(flags)
