"""The trust boundary for worker results: one vectorized check before a result touches state.

A worker is the engine's adapter to someone else's model runner, so its result is untrusted.
Two halves, so that the launch never reads a device value:

* `check_form` (dtypes and shapes: metadata only) runs on the forward stream right after the
  worker returns, on every device;
* `check_values` reads host arrays (`HostResult`). On the host CPU it runs right after
  `check_form`, before the launcher publishes or stashes anything; on a device it runs when the
  host settles the batch, after the result's one copy (see `specstate.engine.launch.result_copy`).
  There the frontier the worker published has already reached the next forward, so the
  launcher relays it *clamped* into ``[seq_lens + 1, seq_lens + max_accept]`` (decode) or to
  ``seq_lens`` (extend): a wrong frontier can only move a row inside its own reservation.

A result that breaks a rule raises `WorkerResultError` naming the rule, the row's request and
the numbers; the batch's requests end with `FinishReason.ERROR` (on the host CPU the launcher
also republishes the batch's own inputs, undoing anything the worker published). The engine
keeps serving, and no counter, output or KV row of any other request is touched.

Always on (a fixed number of array operations per round, whatever the batch size):

* the result is a `GenerationBatchResult` (`check_result_type`; None is a forgotten return);
* shapes and dtypes: ``next_token_ids`` ``[B * stride]`` and ``accept_lens`` ``[B]``, both
  integer (not bool, not floating point);
* accept lengths in ``[1, min(stride, max_accept)]`` for a decode round, exactly 1 otherwise;
* ``next_draft_input`` present, its ``bonus_tokens`` an integer ``[B]`` tensor (the next
  round's input tokens are relayed from it);
* ``invalid_rows``, if given, a ``[B]`` bool tensor (an invalid row ends its request with an
  error at settlement);
* every *accepted* token id of a valid row inside the vocabulary ``[0, vocab_size)``;
* the published frontier — the value handed to ``on_publish``, else ``new_seq_lens`` — equal to
  the host's expectation: ``seq_lens + accept_lens`` for a decode round, ``seq_lens`` (the
  extend end) otherwise. A frontier that disagrees with the accept lengths would make the next
  round read and write KV at the wrong positions, possibly in pages another request owns;
* ``logprobs``, if given, a floating point ``[B * stride]`` tensor whose entries at the accepted
  positions of valid rows are finite and not above 0;
* ``top_logprob_ids`` and ``top_logprob_values``, if given, both (or neither), integer and
  floating point ``[B * stride, K]`` tensors (``K >= 1``); at the accepted positions of valid
  rows, ids inside the vocabulary and values not above 0, not NaN, in descending order;
* ``verified_lens``, if given, an integer ``[B]`` tensor with every row in ``[0, stride - 1]``
  and accepting at most ``verified + 1`` tokens (the frontier rule: accept <= verified + 1);
* ``draft_confidences``, if given, a floating point ``[B, stride - 1]`` tensor of values in
  ``[0, 1]``.

At settlement, against the batch's own sampling state (`check_sampling_rows`, a few array
operations, none when no row uses the controls):

* a row whose request is not speculative (``SamplingParams(speculative=False)``) accepted
  exactly one token in a decode round;
* the result carries ``logprobs`` when a row of the batch asked for them, and top logprobs
  of at least the batch's ``top_logprobs`` columns when a row asked for those;
* a row of a round planned with verify budgets verified at most its budget and accepted at most
  its budget + 1 (`specstate.batch.budgets`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from specstate.batch.result import GenerationBatchResult
from specstate.batch.sampling import SamplingInfo
from specstate.core.errors import WorkerResultError
from specstate.engine.launch.result_copy import HostResult

__all__ = ["check_form", "check_result_type", "check_sampling_rows", "check_values"]

_INTEGER_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def check_result_type(result: object) -> None:
    """Raise `WorkerResultError` unless the worker returned a `GenerationBatchResult`.

    Runs first, right after the worker returns (a forgotten ``return`` gives None).
    """
    if not isinstance(result, GenerationBatchResult):
        raise WorkerResultError(
            f"worker returned {type(result).__name__} {result!r:.60}, not a GenerationBatchResult"
        )


def check_form(result: GenerationBatchResult, b: int, published: torch.Tensor | None) -> None:
    """Raise `WorkerResultError` unless the result's tensors have the batch's dtypes and shapes.

    Reads metadata only (no device value), so it runs in the launch on any device.
    """
    for name, t in (("next_token_ids", result.next_token_ids), ("accept_lens", result.accept_lens)):
        if t.dtype not in _INTEGER_DTYPES or t.dim() != 1:
            raise WorkerResultError(
                f"worker returned {name} of dtype {t.dtype} and shape {tuple(t.shape)}; "
                "it must be a 1-D integer tensor"
            )
    if result.batch_size != b:
        raise WorkerResultError(f"worker returned {result.batch_size} rows for a batch of {b}")
    frontier = published if published is not None else result.new_seq_lens
    if frontier is None:
        raise WorkerResultError("worker published no frontier (no on_publish, no new_seq_lens)")
    if frontier.shape != (b,) or frontier.dtype not in _INTEGER_DTYPES:
        raise WorkerResultError(
            f"worker published a frontier of dtype {frontier.dtype} and shape "
            f"{tuple(frontier.shape)}; expected integer ({b},)"
        )
    payload = result.next_draft_input
    if payload is None:
        raise WorkerResultError(
            "[relay] worker returned no next_draft_input; the next round's input tokens (its "
            "bonus tokens) are relayed from it"
        )
    bonus = payload.bonus_tokens
    if bonus.shape != (b,) or bonus.dtype not in _INTEGER_DTYPES:
        raise WorkerResultError(
            f"worker returned next_draft_input.bonus_tokens of dtype {bonus.dtype} and shape "
            f"{tuple(bonus.shape)}; expected integer ({b},)"
        )
    invalid = result.invalid_rows
    if invalid is not None and (invalid.dtype != torch.bool or invalid.shape != (b,)):
        raise WorkerResultError(
            f"worker returned invalid_rows of dtype {invalid.dtype} and shape "
            f"{tuple(invalid.shape)}; it must be a bool tensor of shape ({b},)"
        )
    if result.verified_lens is not None or result.draft_confidences is not None:
        _check_budget_form(result, b)
    logprobs = result.logprobs
    if logprobs is not None and (
        not logprobs.dtype.is_floating_point or tuple(logprobs.shape) != (b * result.stride,)
    ):
        raise WorkerResultError(
            f"worker returned logprobs of dtype {logprobs.dtype} and shape "
            f"{tuple(logprobs.shape)}; it must be a floating point tensor of shape "
            f"({b * result.stride},), aligned with next_token_ids"
        )
    if result.top_logprob_ids is not None or result.top_logprob_values is not None:
        _check_top_form(result, b)


def _check_top_form(result: GenerationBatchResult, b: int) -> None:
    """Top-logprob ids integer and values floating point, both ``[B * stride, K]``."""
    ids, values = result.top_logprob_ids, result.top_logprob_values
    rows = b * result.stride
    if (
        ids is None
        or values is None
        or ids.dtype not in _INTEGER_DTYPES
        or not values.dtype.is_floating_point
        or ids.dim() != 2
        or tuple(ids.shape) != tuple(values.shape)
        or ids.shape[0] != rows
        or ids.shape[1] < 1
    ):
        got = [None if t is None else (str(t.dtype), tuple(t.shape)) for t in (ids, values)]
        raise WorkerResultError(
            f"worker returned top_logprob_ids and top_logprob_values as {got[0]} and {got[1]}; "
            f"they must be an integer and a floating point tensor, both of shape ({rows}, K) "
            "with K >= 1, aligned with next_token_ids"
        )


def _check_budget_form(result: GenerationBatchResult, b: int) -> None:
    """``verified_lens`` integer ``[B]``; ``draft_confidences`` floating ``[B, stride - 1]``."""
    verified = result.verified_lens
    if verified is not None and (
        verified.dtype not in _INTEGER_DTYPES or tuple(verified.shape) != (b,)
    ):
        raise WorkerResultError(
            f"worker returned verified_lens of dtype {verified.dtype} and shape "
            f"{tuple(verified.shape)}; it must be an integer tensor of shape ({b},)"
        )
    confidences = result.draft_confidences
    want = (b, result.stride - 1)
    if confidences is not None and (
        not confidences.dtype.is_floating_point or tuple(confidences.shape) != want
    ):
        raise WorkerResultError(
            f"worker returned draft_confidences of dtype {confidences.dtype} and shape "
            f"{tuple(confidences.shape)}; it must be a floating point tensor of shape {want}"
        )


def check_values(
    host: HostResult,
    *,
    request_ids: tuple[str, ...],
    decode: bool,
    max_accept: int,
    vocab_size: int,
) -> None:
    """Raise `WorkerResultError` unless the result's values fit its batch (module docstring).

    Args:
        host: the result as host arrays (after `check_form`).
        request_ids: the batch's request ids, one per row.
        decode: the batch was a decode round (multi-token runs allowed).
        max_accept: the worker's declared longest run.
        vocab_size: the model's vocabulary size.
    """
    b = len(request_ids)
    if b == 0:
        return
    limit = min(host.stride, max_accept) if decode else 1
    accept = host.accept
    if accept.dtype != np.int64:
        accept = accept.astype(np.int64)
    outside = (accept < 1) | (accept > limit)
    if np.count_nonzero(outside):
        row = int(np.flatnonzero(outside)[0])
        raise WorkerResultError(
            f"request {request_ids[row]}: accept length {int(accept[row])} outside [1, {limit}] "
            f"(stride {host.stride}, max_accept {max_accept})"
        )
    valid = None if host.invalid is None else ~host.invalid
    _check_tokens(host.tokens, accept, valid, request_ids, vocab_size)
    _check_frontier(host, request_ids, accept, decode)
    if host.logprobs is not None:
        _check_logprobs(host.logprobs, accept, valid, request_ids)
    if host.top_ids is not None and host.top_values is not None:
        _check_top(host.top_ids, host.top_values, accept, valid, request_ids, vocab_size)
    if host.verified is not None or host.confidences is not None:
        _check_verified(host, accept, request_ids)


def check_sampling_rows(
    host: HostResult,
    sampling: SamplingInfo,
    *,
    request_ids: tuple[str, ...],
    decode: bool,
    num_draft_steps: int | None = None,
    budgets: npt.NDArray[np.int64] | None = None,
) -> None:
    """Raise `WorkerResultError` unless the result honours the batch's per-row sampling state.

    Args:
        host: the result as host arrays (after `check_values`).
        sampling: the batch's own (scheduler-side) sampling state.
        request_ids: the batch's request ids, one per row.
        decode: the batch was a decode round.
        num_draft_steps: the drafts the round was launched with (adaptive draft length), or
            None: its accept lengths are then bounded by the worker's window alone.
        budgets: ``[B]`` the rows' verify budgets of a decode round (host), or None.
    """
    if decode and num_draft_steps is not None and host.batch_size:
        over = host.accept > num_draft_steps + 1
        if np.count_nonzero(over):
            row = int(np.flatnonzero(over)[0])
            raise WorkerResultError(
                f"request {request_ids[row]}: accept length {int(host.accept[row])} in a round "
                f"launched with {num_draft_steps} draft steps (at most {num_draft_steps + 1})"
            )
    if decode and budgets is not None and host.batch_size:
        _check_budgets(host, budgets, request_ids)
    if sampling.logprobs and host.logprobs is None and host.batch_size:
        raise WorkerResultError(
            f"request {request_ids[0]}: the batch asks for logprobs but the worker returned "
            "none (GenerationBatchResult.logprobs)"
        )
    if sampling.top_logprobs and host.batch_size:
        got = 0 if host.top_ids is None else host.top_ids.shape[2]
        if got < sampling.top_logprobs:
            raise WorkerResultError(
                f"request {request_ids[0]}: the batch asks for top_logprobs="
                f"{sampling.top_logprobs} but the worker returned {got} per position "
                "(GenerationBatchResult.top_logprob_ids / top_logprob_values)"
            )
    flags = sampling.speculative_host
    if decode and flags is not None:
        wrong = ~flags & (host.accept != 1)
        if np.count_nonzero(wrong):
            row = int(np.flatnonzero(wrong)[0])
            raise WorkerResultError(
                f"request {request_ids[row]}: accept length {int(host.accept[row])} for a "
                "request that does not speculate (speculative=False accepts exactly 1)"
            )


def _check_budgets(
    host: HostResult, budgets: npt.NDArray[np.int64], request_ids: tuple[str, ...]
) -> None:
    """Each row verified at most its budget and accepted at most budget + 1 tokens."""
    verified = host.verified
    over = host.accept > budgets + 1
    if verified is not None:
        over |= verified > budgets
    if np.count_nonzero(over):
        row = int(np.flatnonzero(over)[0])
        got = "" if verified is None else f"verified {int(verified[row])} drafts, "
        raise WorkerResultError(
            f"request {request_ids[row]}: {got}accepted {int(host.accept[row])} tokens in a row "
            f"planned with a verify budget of {int(budgets[row])} (at most {int(budgets[row])} "
            f"drafts, {int(budgets[row]) + 1} tokens)"
        )


def _check_verified(
    host: HostResult, accept: npt.NDArray[np.int64], request_ids: tuple[str, ...]
) -> None:
    """Verified lengths in ``[0, stride - 1]`` with ``accept <= verified + 1``; confidences in
    ``[0, 1]``."""
    verified = host.verified
    if verified is not None:
        bad = (verified < 0) | (verified > host.stride - 1) | (accept > verified + 1)
        if np.count_nonzero(bad):
            row = int(np.flatnonzero(bad)[0])
            raise WorkerResultError(
                f"request {request_ids[row]}: verified {int(verified[row])} drafts and accepted "
                f"{int(accept[row])} tokens (verified must be in [0, {host.stride - 1}] and the "
                "accepted run at most verified + 1)"
            )
    confidences = host.confidences
    if confidences is not None:
        bad_conf = ~((confidences >= 0) & (confidences <= 1))  # NaN fails both
        if np.count_nonzero(bad_conf):
            row, col = (int(x) for x in np.argwhere(bad_conf)[0])
            raise WorkerResultError(
                f"request {request_ids[row]}: draft confidence {float(confidences[row, col])} "
                f"at draft position {col} is not a probability in [0, 1]"
            )


def _check_logprobs(
    logprobs: npt.NDArray[np.floating[Any]],
    accept: npt.NDArray[np.int64],
    valid: npt.NDArray[np.bool_] | None,
    request_ids: tuple[str, ...],
) -> None:
    """Every accepted token's log-probability is finite and not above 0 (rounding allowed)."""
    accepted = np.arange(logprobs.shape[1]) < accept[:, None]
    if valid is not None:
        accepted &= valid[:, None]
    bad = ~(np.isfinite(logprobs) & (logprobs <= 1e-3)) & accepted
    if np.count_nonzero(bad):
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise WorkerResultError(
            f"request {request_ids[row]}: log-probability {float(logprobs[row, col])} of the "
            f"accepted token at run position {col} is not a finite number <= 0"
        )


def _check_top(
    ids: npt.NDArray[np.integer[Any]],
    values: npt.NDArray[np.floating[Any]],
    accept: npt.NDArray[np.int64],
    valid: npt.NDArray[np.bool_] | None,
    request_ids: tuple[str, ...],
    vocab_size: int,
) -> None:
    """At every accepted position: top ids in the vocabulary, values <= 0 (``-inf`` allowed:
    a filtered-out token), not NaN, in descending order."""
    accepted = np.arange(ids.shape[1]) < accept[:, None]
    if valid is not None:
        accepted &= valid[:, None]
    bad = ((ids < 0) | (ids >= vocab_size)).any(-1)
    bad |= ~(values <= 1e-3).all(-1)  # NaN fails too
    bad |= (values[..., 1:] > values[..., :-1]).any(-1)
    bad &= accepted
    if np.count_nonzero(bad):
        row, col = (int(x) for x in np.argwhere(bad)[0])
        raise WorkerResultError(
            f"request {request_ids[row]}: top logprobs at run position {col} (ids "
            f"{ids[row, col].tolist()!r:.80}, values {values[row, col].tolist()!r:.80}) must be "
            f"ids in [0, {vocab_size}) with log-probabilities <= 0 in descending order"
        )


def _check_tokens(
    tokens: npt.NDArray[np.integer[Any]],
    accept: npt.NDArray[np.int64],
    valid: npt.NDArray[np.bool_] | None,
    request_ids: tuple[str, ...],
    vocab_size: int,
) -> None:
    """Every accepted token id of a valid row lies in the vocabulary (rejected drafts and
    invalid rows may hold anything)."""
    if tokens.dtype == np.int64 and not np.count_nonzero(tokens.view(np.uint64) >= vocab_size):
        return  # every token is inside (a negative id wraps around past the vocabulary)
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
    host: HostResult,
    request_ids: tuple[str, ...],
    accept: npt.NDArray[np.int64],
    decode: bool,
) -> None:
    """The published frontier is where the accepted runs end."""
    if host.frontier is None:
        raise WorkerResultError("worker published no frontier (no on_publish, no new_seq_lens)")
    seq_lens = host.seq_lens
    expected = seq_lens + accept if decode else seq_lens
    wrong = host.frontier != expected
    if np.count_nonzero(wrong):
        row = int(np.flatnonzero(wrong)[0])
        rule = "seq_lens + accept_lens" if decode else "the extend end"
        raise WorkerResultError(
            f"request {request_ids[row]}: published frontier {int(host.frontier[row])} but "
            f"{rule} is {int(expected[row])} (seq_lens {int(seq_lens[row])}, accept "
            f"{int(accept[row])})"
        )
