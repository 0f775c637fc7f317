"""Host index arrays: the 1-D int64 NumPy arrays the KV pools compute on, and their helpers.

Every pool keeps what the host decides alone in NumPy arrays (about 1 µs an operation where a
torch operation on a CPU costs several); `host_index` turns any index a caller passes (a tensor
on any device, a list, an array) into one.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

__all__ = ["Indices", "IntArray", "has_duplicates", "host_index"]

_I64 = torch.int64
IntArray = npt.NDArray[np.int64]
Indices = Tensor | IntArray


def host_index(values: Indices) -> IntArray:
    """``values`` as a 1-D int64 host array (no copy for a CPU int64 tensor or array)."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # the hot path: already one (a contiguous copy is not needed to index)
    if isinstance(values, Tensor):
        values = values.detach().to("cpu", _I64).numpy()
    return np.ascontiguousarray(values, dtype=np.int64).reshape(-1)


def has_duplicates(values: IntArray) -> bool:
    """Whether any value repeats (a sort: NumPy's hash-based ``unique`` is far slower here)."""
    if values.size < 2:
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())
