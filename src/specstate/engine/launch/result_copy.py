"""The round's one device-to-host transfer: a worker result, as host arrays the host settles.

Settlement, the value checks of `specstate.engine.launch.result_check` and the finish rules all read
host arrays (`HostResult`). Where they come from depends on where the worker's tensors live:

* on the host CPU (``torch.device("cpu")``) they *are* the result's tensors (NumPy views, no
  copy): `HostResult.view`;
* on a device, the launch packs the accept lengths, the tokens, the published frontier, the
  invalid-row flags, the logprobs (float32 bits) and the top logprobs into one int64 tensor
  right after the forward and starts one non-blocking copy into a host buffer (pinned on
  CUDA, on a copy stream that waits for the forward stream), then records an event:
  `ResultCopy.start`. The host waits for that event when it settles the batch
  (`ResultCopy.wait`), never before, and never reads a device tensor.

Invariant: the launch path does not read any device value; the host reads a result only after
its copy event.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from specstate.batch.result import GenerationBatchResult
from specstate.relay.streams import CudaEvent

__all__ = ["HostResult", "ResultCopy"]

IntArray = npt.NDArray[np.int64]


@attrs.frozen(kw_only=True)
class HostResult:
    """A worker result as host arrays.

    Attributes:
        tokens: ``[B, stride]`` accepted runs (row ``i``'s first ``accept[i]`` count).
        accept: ``[B]`` accept lengths.
        stride: tokens per row of the producing forward.
        frontier: ``[B]`` the frontier the worker published (``on_publish``, else
            ``new_seq_lens``), or None if it published none.
        invalid: ``[B]`` rows the worker marked invalid, or None.
        seq_lens: ``[B]`` the frontier the forward ran from (what the published one is checked
            against).
        logprobs: ``[B, stride]`` float log-probabilities of the tokens, or None.
        top_ids: ``[B, stride, K]`` the top tokens of each position (``top_logprobs``), or
            None.
        top_values: ``[B, stride, K]`` float their log-probabilities, or None.
        verified: ``[B]`` drafts each row verified, or None (each verified its budget).
        confidences: ``[B, stride - 1]`` float predicted acceptance of each draft position,
            or None.
    """

    tokens: npt.NDArray[Any]
    accept: npt.NDArray[Any]
    stride: int
    frontier: npt.NDArray[np.integer[Any]] | None
    invalid: npt.NDArray[np.bool_] | None
    seq_lens: npt.NDArray[np.integer[Any]]
    logprobs: npt.NDArray[np.floating[Any]] | None = None
    top_ids: npt.NDArray[np.integer[Any]] | None = None
    top_values: npt.NDArray[np.floating[Any]] | None = None
    verified: npt.NDArray[np.integer[Any]] | None = None
    confidences: npt.NDArray[np.floating[Any]] | None = None

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return int(self.accept.shape[0])

    @classmethod
    def view(
        cls,
        result: GenerationBatchResult,
        seq_lens: torch.Tensor,
        published: torch.Tensor | None = None,
    ) -> HostResult:
        """NumPy views of a result whose tensors are on the host CPU (no copy)."""
        b = result.batch_size
        frontier = published if published is not None else result.new_seq_lens
        return cls(
            tokens=result.next_token_ids.numpy().reshape(b, result.stride),
            accept=result.accept_lens.numpy(),
            stride=result.stride,
            frontier=None if frontier is None else frontier.numpy(),
            invalid=None if result.invalid_rows is None else result.invalid_rows.numpy(),
            seq_lens=seq_lens.numpy(),
            logprobs=None if result.logprobs is None else _host_floats(result.logprobs, b),
            top_ids=(
                None
                if result.top_logprob_ids is None
                else _host_top(result.top_logprob_ids, b, result.stride)
            ),
            top_values=(
                None
                if result.top_logprob_values is None
                else _host_top(result.top_logprob_values, b, result.stride)
            ),
            verified=None if result.verified_lens is None else result.verified_lens.numpy(),
            confidences=(
                None
                if result.draft_confidences is None
                else _host_floats(result.draft_confidences, b)
            ),
        )


def _int64(values: torch.Tensor) -> torch.Tensor:
    """``values`` as int64: itself when it already is (the common case, with no call)."""
    return values if values.dtype is torch.int64 else values.long()


def _host_floats(values: torch.Tensor, b: int) -> npt.NDArray[np.floating[Any]]:
    """A host CPU float tensor as a ``[b, stride]`` array (float32 unless it is float64)."""
    if values.dtype not in (torch.float32, torch.float64):
        values = values.float()  # bfloat16 has no NumPy dtype
    out: npt.NDArray[np.floating[Any]] = values.numpy().reshape(b, -1)
    return out


def _host_top(values: torch.Tensor, b: int, stride: int) -> npt.NDArray[Any]:
    """A host ``[b * stride, K]`` top-logprobs tensor as a ``[b, stride, K]`` array."""
    if values.dtype in (torch.float16, torch.bfloat16):
        values = values.float()
    out: npt.NDArray[Any] = values.numpy().reshape(b, stride, -1)
    return out


def _top_width(result: GenerationBatchResult) -> int:
    """``K`` of the result's top logprobs (0: none)."""
    ids = result.top_logprob_ids
    return 0 if ids is None or ids.dim() != 2 else int(ids.shape[1])  # check_form refuses 0


class ResultCopy:
    """One packed, non-blocking device-to-host copy of a result, and the event that ends it."""

    def __init__(
        self,
        host: torch.Tensor,
        event: CudaEvent | None,
        layout: tuple[int, int, bool, bool, bool, bool, bool, int],
        keep: tuple[torch.Tensor, ...],
    ) -> None:
        self._host = host
        self._event = event
        # (batch size, stride, and whether the copy holds the frontier, the invalid rows, the
        # logprobs, the verified lengths, the confidences; K of the top logprobs, 0: none)
        self._layout = layout
        self._keep = keep  # device tensors the copy reads, alive until it is done

    @classmethod
    def start(
        cls,
        result: GenerationBatchResult,
        seq_lens: torch.Tensor,
        published: torch.Tensor | None,
    ) -> ResultCopy:
        """Pack the result on its device and start the copy; reads no device value.

        Call right after the forward, on the forward stream (the launch closure).
        """
        b, stride = result.batch_size, result.stride
        frontier = published if published is not None else result.new_seq_lens
        parts = [_int64(result.accept_lens), _int64(result.next_token_ids), _int64(seq_lens)]
        if frontier is not None:
            parts.append(_int64(frontier))
        if result.invalid_rows is not None:
            parts.append(result.invalid_rows.long())
        if result.logprobs is not None:  # float32 bits, read back as float32 on the host
            parts.append(result.logprobs.float().view(torch.int32).long())
        if result.verified_lens is not None:
            parts.append(result.verified_lens.long())
        if result.draft_confidences is not None:  # float32 bits too
            parts.append(result.draft_confidences.float().reshape(-1).view(torch.int32).long())
        top = 0 if result.top_logprob_ids is None else _top_width(result)
        if top:  # ids, then float32 bits
            assert result.top_logprob_ids is not None and result.top_logprob_values is not None
            parts.append(_int64(result.top_logprob_ids).reshape(-1))
            values = result.top_logprob_values.float().reshape(-1)
            parts.append(values.view(torch.int32).long())
        packed = torch.cat(parts)
        layout = (
            b,
            stride,
            frontier is not None,
            result.invalid_rows is not None,
            result.logprobs is not None,
            result.verified_lens is not None,
            result.draft_confidences is not None,
            top,
        )
        if not packed.is_cuda:
            host = torch.empty(packed.numel(), dtype=torch.int64)  # packed is 1-D
            host.copy_(packed, non_blocking=True)
            return cls(host, None, layout, ())
        forward = torch.cuda.current_stream(packed.device)
        copy = _copy_stream(packed.device)
        copy.wait_stream(forward)
        host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(copy):
            host.copy_(packed, non_blocking=True)
            packed.record_stream(copy)  # the caching allocator must not reuse it early
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(copy)
        return cls(host, CudaEvent(event, None, packed.device), layout, (packed,))

    def wait(self, timeout: float | None = None) -> HostResult | None:
        """Block until the copy is done (up to ``timeout`` seconds); None if it is not."""
        if self._event is not None:
            if timeout is None:
                self._event.synchronize()
            elif not self._event.synchronize_within(timeout):
                return None
        self._keep = ()
        b, stride, has_frontier, has_invalid, has_logprobs, has_verified, has_conf, top = (
            self._layout
        )
        flat = self._host.numpy()
        accept = flat[:b]
        tokens = flat[b : b + b * stride].reshape(b, stride)
        at = b + b * stride
        seq_lens, at = flat[at : at + b], at + b
        frontier = None
        if has_frontier:
            frontier, at = flat[at : at + b], at + b
        invalid = None
        if has_invalid:
            invalid, at = flat[at : at + b].astype(np.bool_), at + b
        logprobs = None
        if has_logprobs:
            bits = flat[at : at + b * stride].astype(np.int32)
            logprobs, at = bits.view(np.float32).reshape(b, stride), at + b * stride
        verified = None
        if has_verified:
            verified, at = flat[at : at + b], at + b
        confidences = None
        if has_conf:
            n = b * (stride - 1)
            confidences, at = (
                flat[at : at + n].astype(np.int32).view(np.float32).reshape(b, -1),
                at + n,
            )
        top_ids = top_values = None
        if top:
            n = b * stride * top
            top_ids, at = flat[at : at + n].reshape(b, stride, top), at + n
            bits = flat[at : at + n].astype(np.int32)
            top_values = bits.view(np.float32).reshape(b, stride, top)
        return HostResult(
            tokens=tokens,
            accept=accept,
            stride=stride,
            frontier=frontier,
            invalid=invalid,
            seq_lens=seq_lens,
            logprobs=logprobs,
            top_ids=top_ids,
            top_values=top_values,
            verified=verified,
            confidences=confidences,
        )


_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """One copy stream per CUDA device, created on first use."""
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        _COPY_STREAMS[device] = stream
    return stream
