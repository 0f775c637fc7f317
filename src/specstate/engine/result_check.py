"""The trust boundary for worker results: one vectorized check before a result touches state.

A worker is the engine's adapter to someone else's model runner, so its result is untrusted.
`check_result` runs on the forward stream right after the worker returns, before the launcher
publishes or stashes anything and long before the result processor settles it. A result that
breaks a rule raises `WorkerResultError` naming the rule, the row's request and the numbers;
the launcher then republishes the batch's own inputs (undoing anything the worker published
through ``on_publish``) and the batch's requests end with `FinishReason.ERROR`. The engine keeps
serving, and no counter, output or KV row of any other request is touched.

Always on (a fixed number of tensor operations per round, whatever the batch size):

* shapes and dtypes: ``next_token_ids`` ``[B * stride]`` and ``accept_lens`` ``[B]``, both
  integer (not bool, not floating point);
* accept lengths in ``[1, min(stride, max_accept)]`` for a decode round, exactly 1 otherwise;
* ``invalid_rows``, if given, a ``[B]`` bool tensor (an invalid row ends its request with an
  error at settlement);
* every *accepted* token id of a valid row inside the vocabulary ``[0, vocab_size)``;
* the published frontier — the value handed to ``on_publish``, else ``new_seq_lens`` — equal to
  the host's expectation: ``seq_lens + accept_lens`` for a decode round, ``seq_lens`` (the
  extend end) otherwise. A frontier that disagrees with the accept lengths would make the next
  round read and write KV at the wrong positions, possibly in pages another request owns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import WorkerResultError

__all__ = ["check_result"]

_INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def check_result(
    result: GenerationBatchResult,
    *,
    request_ids: tuple[str, ...],
    seq_lens: torch.Tensor,
    published: torch.Tensor | None,
    decode: bool,
    max_accept: int,
    vocab_size: int,
) -> None:
    """Raise `WorkerResultError` unless ``result`` fits its batch (see the module docstring).

    The checks run on host arrays (NumPy views of CPU tensors; a device tensor is copied to
    the host first, as settlement needs it there anyway).

    Args:
        result: what the worker returned.
        request_ids: the batch's request ids, one per row.
        seq_lens: the frontier the forward ran from (resolved, one per row).
        published: the frontier the worker handed to ``on_publish``, if it did.
        decode: the batch was a decode round (multi-token runs allowed).
        max_accept: the worker's declared longest run.
        vocab_size: the model's vocabulary size.
    """
    b = len(request_ids)
    for name, t in (("next_token_ids", result.next_token_ids), ("accept_lens", result.accept_lens)):
        if t.dtype not in _INTEGER_DTYPES or t.dim() != 1:
            raise WorkerResultError(
                f"worker returned {name} of dtype {t.dtype} and shape {tuple(t.shape)}; "
                "it must be a 1-D integer tensor"
            )
    if result.batch_size != b:
        raise WorkerResultError(f"worker returned {result.batch_size} rows for a batch of {b}")
    if b == 0:
        return
    limit = min(result.stride, max_accept) if decode else 1
    accept = _host(result.accept_lens).astype(np.int64, copy=False)
    outside = (accept < 1) | (accept > limit)
    if np.count_nonzero(outside):
        row = int(np.flatnonzero(outside)[0])
        raise WorkerResultError(
            f"request {request_ids[row]}: accept length {int(accept[row])} outside [1, {limit}] "
            f"(stride {result.stride}, max_accept {max_accept})"
        )
    valid = _valid_rows(result, b)
    tokens = _host(result.next_token_ids).reshape(b, result.stride)
    _check_tokens(tokens, accept, valid, request_ids, vocab_size)
    _check_frontier(result, request_ids, _host(seq_lens), published, accept, decode)


def _host(t: torch.Tensor) -> npt.NDArray[np.integer[Any]]:
    """A host array of ``t`` (a view for a CPU tensor)."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


def _valid_rows(result: GenerationBatchResult, b: int) -> npt.NDArray[np.bool_] | None:
    """The rows not marked invalid (None: all), after checking ``invalid_rows``'s form."""
    invalid = result.invalid_rows
    if invalid is None:
        return None
    if invalid.dtype != torch.bool or tuple(invalid.shape) != (b,):
        raise WorkerResultError(
            f"worker returned invalid_rows of dtype {invalid.dtype} and shape "
            f"{tuple(invalid.shape)}; it must be a bool tensor of shape ({b},)"
        )
    return ~(invalid if invalid.device.type == "cpu" else invalid.cpu()).numpy()


def _check_tokens(
    tokens: npt.NDArray[np.integer[Any]],
    accept: npt.NDArray[np.int64],
    valid: npt.NDArray[np.bool_] | None,
    request_ids: tuple[str, ...],
    vocab_size: int,
) -> None:
    """Every accepted token id of a valid row lies in the vocabulary (rejected drafts and
    invalid rows may hold anything)."""
    accepted = np.arange(tokens.shape[1]) < accept[:, None]
    if valid is not None:
        accepted &= valid[:, None]
    bad = ((tokens < 0) | (tokens >= vocab_size)) & accepted
    if np.count_nonzero(bad):
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise WorkerResultError(
            f"request {request_ids[row]}: accepted token {int(tokens[row, col])} at run "
            f"position {col} is outside the vocabulary [0, {vocab_size})"
        )


def _check_frontier(
    result: GenerationBatchResult,
    request_ids: tuple[str, ...],
    seq_lens: npt.NDArray[np.integer[Any]],
    published: torch.Tensor | None,
    accept: npt.NDArray[np.int64],
    decode: bool,
) -> None:
    """The published frontier is where the accepted runs end."""
    frontier_t = published if published is not None else result.new_seq_lens
    if frontier_t is None:
        raise WorkerResultError("worker published no frontier (no on_publish, no new_seq_lens)")
    expected = seq_lens + accept if decode else seq_lens
    if tuple(frontier_t.shape) != expected.shape or frontier_t.dtype not in _INTEGER_DTYPES:
        raise WorkerResultError(
            f"worker published a frontier of dtype {frontier_t.dtype} and shape "
            f"{tuple(frontier_t.shape)}; expected integer {expected.shape}"
        )
    frontier = _host(frontier_t)
    wrong = frontier != expected
    if np.count_nonzero(wrong):
        row = int(np.flatnonzero(wrong)[0])
        rule = "seq_lens + accept_lens" if decode else "the extend end"
        raise WorkerResultError(
            f"request {request_ids[row]}: published frontier {int(frontier[row])} but {rule} "
            f"is {int(expected[row])} (seq_lens {int(seq_lens[row])}, accept "
            f"{int(accept[row])})"
        )
