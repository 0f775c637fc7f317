"""Sampling state of a batch, the logit controls, and the per-request random source.

`SamplingInfo` holds one row per request of a batch, as tensors built once from the requests'
`SamplingParams` (temperature, top-k, top-p; the penalties, ``min_new_tokens``, seeds, the
per-request speculation switch and the logprobs flag), so a worker reads per-row parameters
without touching a request. A row whose request uses no control costs nothing: a tensor exists
only when some row of the batch needs it.

Two helpers define the controls for every worker (docs/engine.md, "Sampling controls"):

* `apply_logit_controls` — repetition penalty (Hugging Face), frequency and presence penalties
  (OpenAI), the ``min_new_tokens`` mask — given each scored position's token counts;
* `seeded_uniforms` — a counter-based random source: one uniform per ``(seed, position, draw)``
  from a 32-bit integer hash, vectorized, no generator state, so a seeded request draws the same
  numbers whatever its batch mates, loop or retractions.

The scheduler may also own a `PenaltyAccumulator`, which folds each settled output token into
per-request token counts exactly once (``frequency_penalties`` with scheduler-side counts; the
reference workers count tokens themselves, from their own token history, which is exact under
overlap and speculation). A speculative round builds
several forward batches (draft, verify, draft-extend) from one schedule batch; if each of them
folded pending tokens, penalties would accumulate once per forward. So the worker never sees the
accumulator: `SamplingInfo.copy_for_forward` folds what is pending once, then returns a copy
whose counts are a frozen tensor and whose accumulator is None.

Invariant: each settled token is counted exactly once, however many forward copies are made;
tensors are rebound, never written in place, so a copy taken earlier never changes value.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from specstate.core.params import SamplingParams

__all__ = ["PenaltyAccumulator", "SamplingInfo", "apply_logit_controls", "seeded_uniforms"]


class PenaltyAccumulator:
    """Per-request output-token counts for frequency penalties (scheduler-owned).

    Tokens are queued with `cumulate` as results settle and folded into the counts by `fold`.
    """

    def __init__(self, counts: torch.Tensor) -> None:
        self._counts = counts
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_folded_tokens = 0

    @classmethod
    def zeros(cls, batch_size: int, vocab_size: int, *, device: torch.device) -> PenaltyAccumulator:
        """An accumulator with no token counted."""
        return cls(torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device))

    def cumulate(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Queue settled tokens: ``token_ids[i]`` was emitted by batch row ``rows[i]``."""
        self._pending.append((rows, token_ids))

    def fold(self) -> torch.Tensor:
        """Count every queued token once and return the counts (a new tensor each fold)."""
        if self._pending:
            rows = torch.cat([r for r, _ in self._pending])
            ids = torch.cat([t for _, t in self._pending])
            self._counts = self._counts.index_put(
                (rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True
            )
            self.num_folded_tokens += int(ids.numel())
            self._pending = []
        return self._counts

    def select(self, rows: torch.Tensor) -> PenaltyAccumulator:
        """A new accumulator for the kept rows (pending tokens folded first)."""
        return PenaltyAccumulator(self.fold().index_select(0, rows))

    def concat(self, other: PenaltyAccumulator) -> PenaltyAccumulator:
        """A new accumulator for ``self``'s rows followed by ``other``'s."""
        return PenaltyAccumulator(torch.cat([self.fold(), other.fold()]))


def _rows(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, rows)


def _cat(
    a: torch.Tensor | None, b: torch.Tensor | None, size_a: int, size_b: int, neutral: float
) -> torch.Tensor | None:
    """``a`` then ``b``; a missing side is filled with its rows' ``neutral`` value."""
    if a is None and b is None:
        return None
    like = a if a is not None else b
    assert like is not None
    if a is None:
        a = torch.full((size_a, *like.shape[1:]), neutral, dtype=like.dtype, device=like.device)
    if b is None:
        b = torch.full((size_b, *like.shape[1:]), neutral, dtype=like.dtype, device=like.device)
    if a.dim() == 2 and a.shape[1] != b.shape[1]:  # stop ids of different widths: pad with -1
        width = max(a.shape[1], b.shape[1])
        a = torch.nn.functional.pad(a, (0, width - a.shape[1]), value=-1)
        b = torch.nn.functional.pad(b, (0, width - b.shape[1]), value=-1)
    return torch.cat([a, b])


def _tensor_if(
    values: Sequence[float] | Sequence[int],
    neutral: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """A ``[B]`` tensor of ``values``, or None when every value is ``neutral``."""
    if all(v == neutral for v in values):
        return None
    return torch.tensor(list(values), dtype=dtype, device=device)


def _stop_matrix(
    params: Sequence[SamplingParams], eos_token_ids: frozenset[int], device: torch.device
) -> torch.Tensor:
    """``[B, n]`` each row's stop tokens (its stop ids, EOS unless ``ignore_eos``), -1 padded."""
    rows = [
        sorted(p.stop_token_ids if p.ignore_eos else p.stop_token_ids | eos_token_ids)
        for p in params
    ]
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], device=device)


@attrs.frozen(kw_only=True)
class SamplingInfo:
    """Per-row sampling parameters of a batch, as tensors.

    Every optional per-row tensor is None when no row of the batch needs it (then every row
    has its neutral value, in parentheses).

    Attributes:
        temperatures: ``[B]`` float; 0 for a greedy row.
        top_ks: ``[B]`` int; the vocabulary size for rows without top-k.
        top_ps: ``[B]`` float; 1.0 for rows without nucleus sampling.
        frequency_penalties: ``[B]`` float (0), OpenAI frequency penalty over output tokens.
        penalty_counts: ``[B, vocab]`` scheduler-folded counts of each row's output tokens
            (`PenaltyAccumulator`), or None; workers that count tokens themselves ignore it.
        accumulator: folds settled tokens into ``penalty_counts`` (scheduler only); None on a
            forward copy: a worker cannot fold tokens.
        greedy_host: what the host knows without reading the device: True when every row is
            greedy, False when some row samples, None when unknown (then `is_all_greedy`
            reads ``temperatures``, a device synchronization).
        repetition_penalties: ``[B]`` float (1), Hugging Face repetition penalty over prompt
            and output tokens.
        presence_penalties: ``[B]`` float (0), OpenAI presence penalty over output tokens.
        min_new_tokens: ``[B]`` int64 (0): the row's stop tokens are masked while fewer
            outputs exist.
        stop_token_ids: ``[B, n]`` int64, each row's stop tokens (its ``stop_token_ids``, and
            the EOS ids unless it ignores EOS), -1 padded; set with ``min_new_tokens``.
        prompt_lens: ``[B]`` int64 (0): where each row's outputs begin (position
            ``prompt_len + k`` holds output ``k``); set with any logit control.
        seeds: ``[B]`` int64 (-1: no seed) per-request seeds of `seeded_uniforms`.
        speculative: ``[B]`` bool (True); a False row accepts exactly one token per verify.
        speculative_host: the same flags as a host array (the engine checks accept lengths
            against it without reading the device), or None when every row speculates.
        logprobs: True when some row asks for the log-probabilities of its tokens (host).
        top_logprobs: the most alternatives a row asks for per token (``top_logprobs``,
            host; 0: none): the worker reports that many for every row.
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    frequency_penalties: torch.Tensor | None = None
    penalty_counts: torch.Tensor | None = None
    accumulator: PenaltyAccumulator | None = None
    greedy_host: bool | None = None
    repetition_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    min_new_tokens: torch.Tensor | None = None
    stop_token_ids: torch.Tensor | None = None
    prompt_lens: torch.Tensor | None = None
    seeds: torch.Tensor | None = None
    speculative: torch.Tensor | None = None
    speculative_host: npt.NDArray[np.bool_] | None = attrs.field(default=None, eq=False)
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device,
        frequency_penalties: Sequence[float] | None = None,
        prompt_lens: Sequence[int] | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> SamplingInfo:
        """Build the batch's sampling state from each request's parameters.

        Args:
            params: one per row.
            vocab_size: the model's vocabulary (top-k of rows without one).
            device: where the tensors live.
            frequency_penalties: scheduler-side penalties with a `PenaltyAccumulator` (they
                replace the requests' ``frequency_penalty``); None: the requests' own.
            prompt_lens: each row's prompt length (where its outputs begin); needed by the
                penalties over output tokens and by ``min_new_tokens``.
            eos_token_ids: the model's EOS ids (masked under ``min_new_tokens`` unless a row
                ignores EOS).
        """
        acc = None
        if frequency_penalties is not None:
            penalties = _tensor_if(frequency_penalties, 0.0, torch.float32, device)
            if penalties is not None:
                acc = PenaltyAccumulator.zeros(len(params), vocab_size, device=device)
        else:
            penalties = _tensor_if(
                [p.frequency_penalty for p in params], 0.0, torch.float32, device
            )
        repetition = _tensor_if([p.repetition_penalty for p in params], 1.0, torch.float32, device)
        presence = _tensor_if([p.presence_penalty for p in params], 0.0, torch.float32, device)
        min_new = _tensor_if([p.min_new_tokens for p in params], 0, torch.int64, device)
        controls = any(t is not None for t in (penalties, repetition, presence, min_new))
        prompts = None
        if controls and prompt_lens is not None:
            prompts = torch.tensor(list(prompt_lens), dtype=torch.int64, device=device)
        seeds = _tensor_if(
            [-1 if p.seed is None else p.seed for p in params], -1, torch.int64, device
        )
        flags = [p.speculative for p in params]
        spec_host = None if all(flags) else np.array(flags, dtype=np.bool_)
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], device=device),
            top_ks=torch.tensor(  # a top-k past the vocabulary keeps every token
                [min(p.top_k or vocab_size, vocab_size) for p in params], device=device
            ),
            top_ps=torch.tensor([p.top_p for p in params], device=device),
            frequency_penalties=penalties,
            accumulator=acc,
            greedy_host=all(p.temperature == 0 for p in params),
            repetition_penalties=repetition,
            presence_penalties=presence,
            min_new_tokens=min_new,
            stop_token_ids=None if min_new is None else _stop_matrix(params, eos_token_ids, device),
            prompt_lens=prompts,
            seeds=seeds,
            speculative=None if spec_host is None else torch.tensor(flags, device=device),
            speculative_host=spec_host,
            logprobs=any(p.logprobs for p in params),
            top_logprobs=max((p.top_logprobs for p in params), default=0),
        )

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return int(self.temperatures.shape[0])

    @property
    def is_all_greedy(self) -> bool:
        """True when every row samples greedily (from the host flag when it is known)."""
        if self.greedy_host is not None:
            return self.greedy_host
        return bool((self.temperatures == 0).all())

    @property
    def has_logit_controls(self) -> bool:
        """True when some row has a penalty or ``min_new_tokens`` (known on the host)."""
        return (
            self.repetition_penalties is not None
            or self.frequency_penalties is not None
            or self.presence_penalties is not None
            or self.min_new_tokens is not None
        )

    def copy_for_forward(self) -> SamplingInfo:
        """The worker's copy: pending tokens folded once, counts frozen, no accumulator.

        Without an accumulator that is this very (frozen) value.
        """
        if self.accumulator is None:
            return self
        counts = self.accumulator.fold()
        return attrs.evolve(self, penalty_counts=counts, accumulator=None)

    def apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``logits`` (one row per entry of ``rows``) minus each row's frequency penalty times
        the scheduler-folded ``penalty_counts`` (a no-op without them)."""
        if self.frequency_penalties is None or self.penalty_counts is None:
            return logits
        penalty = self.frequency_penalties.index_select(0, rows).unsqueeze(1)
        return logits - penalty * self.penalty_counts.index_select(0, rows)

    def select(
        self, rows: torch.Tensor, *, host_rows: npt.NDArray[Any] | None = None
    ) -> SamplingInfo:
        """The sampling state of the kept rows (new tensors).

        ``host_rows`` (the same index, or a keep-mask, as a host array) spares a device read
        when some row does not speculate.
        """
        spec_host = self.speculative_host
        if spec_host is not None:
            index = host_rows if host_rows is not None else rows.cpu().numpy()
            spec_host = spec_host[index]
            if spec_host.all():
                spec_host = None
        return SamplingInfo(
            temperatures=self.temperatures.index_select(0, rows),
            top_ks=self.top_ks.index_select(0, rows),
            top_ps=self.top_ps.index_select(0, rows),
            frequency_penalties=_rows(self.frequency_penalties, rows),
            penalty_counts=_rows(self.penalty_counts, rows),
            accumulator=None if self.accumulator is None else self.accumulator.select(rows),
            greedy_host=True if self.greedy_host else None,  # a subset of greedy rows is greedy
            repetition_penalties=_rows(self.repetition_penalties, rows),
            presence_penalties=_rows(self.presence_penalties, rows),
            min_new_tokens=_rows(self.min_new_tokens, rows),
            stop_token_ids=_rows(self.stop_token_ids, rows),
            prompt_lens=_rows(self.prompt_lens, rows),
            seeds=_rows(self.seeds, rows),
            speculative=None if spec_host is None else _rows(self.speculative, rows),
            speculative_host=spec_host,
            logprobs=self.logprobs,  # a superset is harmless: the worker computes more
            top_logprobs=self.top_logprobs,
        )

    def with_rows(
        self,
        size: int,
        rows: torch.Tensor,
        values: SamplingInfo,
        *,
        host_rows: npt.NDArray[np.int64],
    ) -> SamplingInfo:
        """The first ``size`` rows of ``self`` with ``rows`` set to ``values``' rows (new tensors).

        Row ``rows[i]`` (``< size``) takes ``values``' row ``i``; rows at or past
        ``batch_size`` must all be in ``rows``. Only the changed rows are written, into copies
        (a persistent batch changes a few rows a round; nothing is written in place).
        ``host_rows`` is ``rows`` as a host array. Neither side may hold a penalty accumulator.
        """
        if self.accumulator is not None or values.accumulator is not None:
            raise ValueError("with_rows: a sampling state with a penalty accumulator")
        put = functools.partial(_put_rows, size=size, rows=rows, num_new=len(host_rows))
        spec_host = _merge_flags(self.speculative_host, values.speculative_host, size, host_rows)
        temperatures = put(self.temperatures, values.temperatures, 0.0)
        top_ks = put(self.top_ks, values.top_ks, 0)
        top_ps = put(self.top_ps, values.top_ps, 1.0)
        assert temperatures is not None and top_ks is not None and top_ps is not None
        return SamplingInfo(
            temperatures=temperatures,
            top_ks=top_ks,
            top_ps=top_ps,
            frequency_penalties=put(self.frequency_penalties, values.frequency_penalties, 0.0),
            greedy_host=True if self.greedy_host and values.greedy_host else None,
            repetition_penalties=put(self.repetition_penalties, values.repetition_penalties, 1.0),
            presence_penalties=put(self.presence_penalties, values.presence_penalties, 0.0),
            min_new_tokens=put(self.min_new_tokens, values.min_new_tokens, 0),
            stop_token_ids=put(self.stop_token_ids, values.stop_token_ids, -1),
            prompt_lens=put(self.prompt_lens, values.prompt_lens, 0),
            seeds=put(self.seeds, values.seeds, -1),
            speculative=None
            if spec_host is None
            else put(self.speculative, values.speculative, True),
            speculative_host=spec_host,
            logprobs=self.logprobs or values.logprobs,  # a superset is harmless
            top_logprobs=max(self.top_logprobs, values.top_logprobs),
        )

    def concat(self, other: SamplingInfo) -> SamplingInfo:
        """The sampling state of ``self``'s rows followed by ``other``'s (new tensors)."""
        acc = None
        if self.accumulator is not None and other.accumulator is not None:
            acc = self.accumulator.concat(other.accumulator)
        a, b = self.batch_size, other.batch_size
        spec_host = None
        if self.speculative_host is not None or other.speculative_host is not None:
            spec_host = np.concatenate(
                [
                    np.ones(a, np.bool_)
                    if self.speculative_host is None
                    else self.speculative_host,
                    np.ones(b, np.bool_)
                    if other.speculative_host is None
                    else other.speculative_host,
                ]
            )
        speculative = _cat(self.speculative, other.speculative, a, b, True)
        return SamplingInfo(
            temperatures=torch.cat([self.temperatures, other.temperatures]),
            top_ks=torch.cat([self.top_ks, other.top_ks]),
            top_ps=torch.cat([self.top_ps, other.top_ps]),
            frequency_penalties=_cat(self.frequency_penalties, other.frequency_penalties, a, b, 0),
            penalty_counts=None,
            accumulator=acc,
            greedy_host=(
                None
                if self.greedy_host is None or other.greedy_host is None
                else self.greedy_host and other.greedy_host
            ),
            repetition_penalties=_cat(
                self.repetition_penalties, other.repetition_penalties, a, b, 1.0
            ),
            presence_penalties=_cat(self.presence_penalties, other.presence_penalties, a, b, 0),
            min_new_tokens=_cat(self.min_new_tokens, other.min_new_tokens, a, b, 0),
            stop_token_ids=_cat(self.stop_token_ids, other.stop_token_ids, a, b, -1),
            prompt_lens=_cat(self.prompt_lens, other.prompt_lens, a, b, 0),
            seeds=_cat(self.seeds, other.seeds, a, b, -1),
            speculative=speculative,
            speculative_host=spec_host,
            logprobs=self.logprobs or other.logprobs,
            top_logprobs=max(self.top_logprobs, other.top_logprobs),
        )


def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B, ...]`` viewed to broadcast against ``like`` ``[B, ..., V]``."""
    values = values.to(like.device)
    return values.view(*values.shape, *([1] * (like.ndim - values.ndim)))


def apply_logit_controls(
    logits: torch.Tensor,
    sampling: SamplingInfo,
    *,
    seen: torch.Tensor,
    output_counts: torch.Tensor,
    num_outputs: torch.Tensor,
) -> torch.Tensor:
    """``logits`` ``[B, ..., V]`` after the penalties and the ``min_new_tokens`` mask (new tensor).

    Every scored position brings the state of the tokens before it (with speculation: the
    drafts before it too, exactly what one-token-at-a-time decoding would see):

    Args:
        logits: raw logits; row ``b`` uses ``sampling``'s row ``b``.
        sampling: the per-row controls (`SamplingInfo`).
        seen: ``[B, ..., V]`` bool (or counts): the token occurs in prompt + output so far.
        output_counts: ``[B, ..., V]`` float occurrences of each token in the output so far.
        num_outputs: ``[B, ...]`` int: outputs before the scored token.

    Order (docs/engine.md): repetition penalty (a present token's logit divided by the
    penalty when positive, multiplied when negative), then ``- frequency * count - presence *
    (count > 0)``, then -inf at the row's stop tokens while ``num_outputs < min_new_tokens``.
    """
    out = logits
    if sampling.repetition_penalties is not None:
        penalty = _per_row(sampling.repetition_penalties.to(logits.dtype), logits)
        penalized = torch.where(out < 0, out * penalty, out / penalty)
        out = torch.where(seen.bool(), penalized, out)
    counts = output_counts.to(logits.dtype)
    if sampling.frequency_penalties is not None:
        out = out - _per_row(sampling.frequency_penalties.to(logits.dtype), logits) * counts
    if sampling.presence_penalties is not None:
        present = (counts > 0).to(logits.dtype)
        out = out - _per_row(sampling.presence_penalties.to(logits.dtype), logits) * present
    if sampling.min_new_tokens is not None and sampling.stop_token_ids is not None:
        vocab = logits.shape[-1]
        stops = sampling.stop_token_ids.to(logits.device).long()
        stops = torch.where(stops >= 0, stops, vocab)  # padding lands in a dropped column
        is_stop = torch.zeros(stops.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
        is_stop = is_stop.scatter(1, stops, True)[:, :vocab]
        short = num_outputs.to(logits.device) < _per_row(sampling.min_new_tokens, num_outputs)
        mask = is_stop.view(is_stop.shape[0], *([1] * (logits.ndim - 2)), vocab)
        out = out.masked_fill(mask & short[..., None], float("-inf"))
    return out


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``x * constant mod 2**32`` for ``x`` in ``[0, 2**32)``, without int64 overflow."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (``lowbias32``, a bijection with full avalanche) of ``x``."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor, draw: int = 0) -> torch.Tensor:
    """One uniform in ``[0, 1)`` (float64, 53 random bits) per ``(seed, position, draw)``.

    A counter-based source: the value is a pure function of its key (two rounds of a 32-bit
    hash over the seed's halves, the position and the draw index), so a row draws the same
    number whatever its batch mates, the loop, a retraction or the order of evaluation.

    Args:
        seeds: ``[B]`` int64 in ``[0, 2**63)`` (negative entries give defined but meaningless
            values: callers mask unseeded rows).
        positions: ``[B, ...]`` int64 token positions (< 2**32), one uniform per entry.
        draw: which independent stream of the position (0 for the token itself).
    """
    seeds = seeds.long().to(positions.device).clamp_min(0)
    seeds = seeds.view(*seeds.shape, *([1] * (positions.ndim - seeds.ndim)))
    key = _hash32((seeds & _MASK32) ^ _hash32((seeds >> 32) ^ 0x9E3779B9))
    mixed = _hash32(key ^ (positions.long() & _MASK32))
    first = _hash32(mixed ^ _mul32(torch.full_like(mixed, 2 * draw + 1), 0x85EBCA6B))
    second = _hash32(first ^ 0x68E31DA4)
    bits = (first >> 5) * (1 << 26) + (second >> 6)  # 27 + 26 = 53 bits
    return bits.double() / float(1 << 53)


def _put_rows(
    old: torch.Tensor | None,
    new: torch.Tensor | None,
    neutral: float,
    *,
    size: int,
    rows: torch.Tensor,
    num_new: int,
) -> torch.Tensor | None:
    """`SamplingInfo.with_rows` for one column: the first ``size`` rows of ``old`` (a missing
    column is ``neutral``) with ``rows`` set to ``new``'s rows, in a copy."""
    if old is None and new is None:
        return None
    like = old if old is not None else new
    assert like is not None
    if old is None:
        old = torch.full((size, *like.shape[1:]), neutral, dtype=like.dtype, device=like.device)
    if new is None:
        new = torch.full((num_new, *like.shape[1:]), neutral, dtype=like.dtype, device=like.device)
    if old.dim() == 2 and old.shape[1] != new.shape[1]:  # stop ids: pad with -1
        width = max(old.shape[1], new.shape[1])
        old = torch.nn.functional.pad(old, (0, width - old.shape[1]), value=-1)
        new = torch.nn.functional.pad(new, (0, width - new.shape[1]), value=-1)
    a = old.shape[0]
    if size <= a:
        out = old[:size].clone()
    else:
        out = old.new_empty((size, *old.shape[1:]))
        out[:a] = old
    return out.index_copy_(0, rows.to(out.device), new.to(out.dtype))


def _merge_flags(
    old: npt.NDArray[np.bool_] | None,
    new: npt.NDArray[np.bool_] | None,
    size: int,
    host_rows: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_] | None:
    """The per-row speculative flags of `SamplingInfo.with_rows` (None: every row speculates)."""
    if old is None and new is None:
        return None
    flags = np.ones(size, np.bool_)
    if old is not None:
        keep = min(old.size, size)
        flags[:keep] = old[:keep]
    flags[host_rows] = True if new is None else new
    return None if flags.all() else flags
