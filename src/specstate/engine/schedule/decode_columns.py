"""The per-row columns of a decode round: one row per request, in the batch's order.

`DecodeColumns` is what a decode batch is built from (slots on the host and the device,
incarnations, the sampling state, output-row epochs, ids); `PlainRows` packs the host values of
rows that sample with temperature, top-k and top-p only, and `plain_columns` builds the columns
as views of them. `specstate.engine.schedule.column_builder` builds columns for requests;
`specstate.engine.schedule.decode_rows` keeps them from one round to the next.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import numpy.typing as npt
import torch

from specstate.batch.sampling import SamplingInfo
from specstate.core.request import Req
from specstate.engine.settle.outputs import IntArray

__all__ = ["DecodeColumns", "FloatArray", "PlainRows", "plain_columns"]

_HOST: Final = torch.device("cpu")
FloatArray = npt.NDArray[np.float32]


@attrs.frozen(kw_only=True, eq=False)
class PlainRows:
    """Host values of rows whose sampling is temperature, top-k and top-p only (*plain*).

    One packed host array, one column per row: a change writes only the changed columns into
    a copy, and on a device the array travels in one host-to-device copy.

    Attributes:
        values: ``[4, n]`` int64: request slot, output-row epoch, top-k, and a row that holds
            the ``[2, n]`` float32 temperature and top-p (`floats`, a view of its bytes).
    """

    values: IntArray
    ints: IntArray = attrs.field(init=False)
    """``[3, n]`` int64 (a view of ``values``): request slot, output-row epoch, top-k."""
    floats: FloatArray = attrs.field(init=False)
    """``[2, n]`` float32 (a view of ``values``' last row): temperature, top-p."""

    def __attrs_post_init__(self) -> None:
        values = self.values
        object.__setattr__(self, "ints", values[:3])
        object.__setattr__(self, "floats", values[3].view(np.float32).reshape(2, -1))

    @classmethod
    def empty(cls, n: int) -> PlainRows:
        """``n`` rows, their values unset (written through `ints` and `floats`)."""
        return cls(values=np.empty((4, n), dtype=np.int64))

    @property
    def size(self) -> int:
        """Number of rows."""
        return int(self.values.shape[1])


@attrs.frozen(kw_only=True)
class DecodeColumns:
    """The per-row columns of one set of decoding requests (one row per request, in order).

    ``plain``, when set, holds the host values behind ``slots``, ``epochs`` and ``sampling``
    (every row plain, `plain_columns`): a change then patches two host arrays.
    """

    reqs: tuple[Req, ...]
    slots: torch.Tensor
    slots_host: IntArray  # the same memory as ``slots``
    device_slots: torch.Tensor
    incarnations: tuple[int, ...]
    sampling: SamplingInfo
    epochs: IntArray
    request_ids: tuple[str, ...]
    plain: PlainRows | None = attrs.field(default=None, eq=False)


def plain_columns(
    reqs: tuple[Req, ...],
    incarnations: tuple[int, ...],
    request_ids: tuple[str, ...],
    plain: PlainRows,
    device: torch.device,
) -> DecodeColumns:
    """The columns of plain rows, built from their host values (views, two copies on a device).

    The sampling state has temperatures, top-k and top-p and nothing else (every optional
    tensor None), exactly what `SamplingInfo.from_params` builds for plain rows.
    """
    ints, floats = plain.ints, plain.floats
    slots = torch.from_numpy(ints[0])  # views of the host rows: no tensor indexing on a CPU
    if device == _HOST:  # (the device audit's ``cpu:0`` is a device: it takes the copy)
        device_slots, top_ks = slots, torch.from_numpy(ints[2])
        temperatures, top_ps = torch.from_numpy(floats[0]), torch.from_numpy(floats[1])
    else:  # one copy of the packed array, then views of its rows (flat: any n, even 0)
        n = plain.size
        flat = torch.from_numpy(plain.values.reshape(-1)).to(device)
        device_slots, _, top_ks, packed = flat.view(4, n).unbind()
        temperatures, top_ps = packed.view(torch.float32).view(2, n).unbind()
    return DecodeColumns(
        reqs=reqs,
        slots=slots,
        slots_host=ints[0],
        device_slots=device_slots,
        incarnations=incarnations,
        sampling=SamplingInfo(
            temperatures=temperatures,
            top_ks=top_ks,
            top_ps=top_ps,
            greedy_host=not np.count_nonzero(floats[0]),
        ),
        epochs=ints[1],
        request_ids=request_ids,
        plain=plain,
    )
