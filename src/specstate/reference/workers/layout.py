"""Forward geometry of the reference workers: where each forward's tokens sit and write KV.

Every model call of a round is an extend over the engine's ``req_to_token`` table (see
`specstate.reference.model`). This module turns a scheduler-level `ForwardBatch` into those
`AttentionBatch` values and the worker's answers into a `GenerationBatchResult`; it owns no
state. The geometry of one speculative round of row ``b`` (``S = seq_lens[b]``, ``K`` steps,
``D = K + 1``)::

    position        S        S+1      ...   S+K-1     S+K
    draft step k    x0 (k=0) d1 (k=1) ...   d(K-1)             1 token each, prefix S+k
    verify          x0       d1       ...   d(K-1)    dK       D tokens, prefix S
    draft-extend    x0       d1       ...   d(K-1)    dK       D tokens, prefix S
    KV slot         req_to_token[slot_b, S + j]  (reserved by the engine: S + D <= allocated)

Invariant: every `AttentionBatch` built here writes only at ``req_to_token[slot, p]`` for the
positions ``p`` it names (EXTEND: at the engine's ``out_cache_loc``), and reads only through the
rows of the batch's slots.
"""

from __future__ import annotations

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvalidConfig
from specstate.reference.model import AttentionBatch
from specstate.relay.future_map import RelayPayload

__all__ = [
    "budget_end",
    "chain_attention",
    "decode_result",
    "decode_roots",
    "empty_result",
    "extend_attention",
    "extend_result",
    "last_token_rows",
]


def extend_attention(batch: ForwardBatch, req_to_token: torch.Tensor) -> AttentionBatch:
    """The `AttentionBatch` of an EXTEND / MIXED forward, writing at its ``out_cache_loc``.

    Raises:
        InvalidConfig: the batch lacks one of the extend fields.
    """
    input_ids, positions, out_cache_loc = batch.input_ids, batch.positions, batch.out_cache_loc
    prefix_lens, extend_lens = batch.prefix_lens, batch.extend_lens
    if (
        input_ids is None
        or positions is None
        or out_cache_loc is None
        or prefix_lens is None
        or extend_lens is None
    ):
        raise InvalidConfig(
            f"{batch.forward_mode.value} batch of {batch.batch_size} requests lacks input_ids, "
            "positions, out_cache_loc, prefix_lens or extend_lens"
        )
    device = input_ids.device
    return AttentionBatch(
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        req_pool_indices=batch.req_pool_indices,
        req_to_token=req_to_token,
        prefix_lens=torch.as_tensor(prefix_lens, dtype=torch.int64, device=device),
        extend_lens=torch.tensor(extend_lens, dtype=torch.int64, device=device),
    )


def last_token_rows(extend_lens: torch.Tensor) -> torch.Tensor:
    """Index of each row's last new token in the packed ``[T]`` layout (rows with tokens)."""
    return torch.cumsum(extend_lens, 0) - 1


def chain_attention(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start: torch.Tensor,
    tokens: torch.Tensor,
    *,
    end: torch.Tensor | None = None,
) -> AttentionBatch:
    """``tokens`` ``[B, w]`` of row ``b`` at positions ``start[b] .. start[b] + w - 1``.

    Writes their KV at ``req_to_token[slot_b, start[b] + j]``; attends to the prefix
    ``[0, start[b])`` plus the chain itself (causally). With ``end`` (a row's verify budget:
    its frontier + budget + 1), positions at or past ``end[b]`` write to the padding slot
    instead: the row's reservation covers only its budget, and what lies beyond it (a draft it
    does not verify) is never read as a result.
    """
    num_rows, width = tokens.shape
    offsets = torch.arange(width, dtype=torch.int64, device=tokens.device)
    positions = start.long()[:, None] + offsets[None, :]
    slots = req_pool_indices.long().to(req_to_token.device)
    out_cache_loc = req_to_token[slots[:, None], positions.to(req_to_token.device)]
    if end is not None:  # NOTE: slot 0 (page 0) is padding: written harmlessly, never read
        past = positions.to(req_to_token.device) >= end.long().to(req_to_token.device)[:, None]
        out_cache_loc = out_cache_loc.masked_fill(past, 0)
    return AttentionBatch(
        input_ids=tokens.reshape(-1),
        positions=positions.reshape(-1),
        out_cache_loc=out_cache_loc.reshape(-1).to(tokens.device),
        req_pool_indices=req_pool_indices,
        req_to_token=req_to_token,
        prefix_lens=start.long(),
        extend_lens=torch.full((num_rows,), width, dtype=torch.int64, device=tokens.device),
    )


def budget_end(batch: ForwardBatch, start: torch.Tensor) -> torch.Tensor | None:
    """The first position each row of a DECODE round may not write (its frontier + verify
    budget + 1; `chain_attention`'s ``end``), or None without budgets."""
    budgets = batch.verify_budgets
    return None if budgets is None else start.long() + budgets.to(start.device).long() + 1


def decode_roots(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S, x0)`` of a DECODE batch: the frontier and the pending bonus token of each row.

    The bonus is ``input_ids`` when the engine resolved it, else ``spec_info.bonus_tokens``.

    Raises:
        InvalidConfig: neither carries the bonus tokens.
    """
    roots = batch.input_ids
    if roots is None and batch.spec_info is not None:
        roots = batch.spec_info.bonus_tokens
    if roots is None or roots.numel() != batch.batch_size:
        raise InvalidConfig(
            f"decode batch of {batch.batch_size} requests has no bonus token per row "
            "(input_ids and spec_info.bonus_tokens are both missing or misshapen)"
        )
    return batch.seq_lens.long(), roots.long()


def extend_result(
    next_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    payload: RelayPayload,
    invalid_rows: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> GenerationBatchResult:
    """EXTEND result: stride 1, accept 1, ``new_seq_lens = seq_lens`` (no ``+1``);
    ``top_logprobs`` ``([B, K], [B, K])`` ids and values."""
    return GenerationBatchResult(
        next_token_ids=next_tokens,
        accept_lens=torch.ones_like(next_tokens, dtype=torch.int64),
        stride=1,
        new_seq_lens=seq_lens.long().clone(),
        next_draft_input=payload,
        invalid_rows=invalid_rows,
        logprobs=logprobs,
        top_logprob_ids=None if top_logprobs is None else top_logprobs[0],
        top_logprob_values=None if top_logprobs is None else top_logprobs[1],
    )


def decode_result(
    run_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    new_seq_lens: torch.Tensor,
    payload: RelayPayload,
    invalid_rows: torch.Tensor | None = None,
    logprobs: torch.Tensor | None = None,
    draft_confidences: torch.Tensor | None = None,
    *,
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> GenerationBatchResult:
    """DECODE result from ``run_tokens`` ``[B, D]``: row ``b``'s first ``accept_lens[b]`` count.

    Tokens past each run are written as 0 (the padding the result processor never reads), and
    so are their ``logprobs`` (``[B, D]``, aligned with ``run_tokens``) and ``top_logprobs``
    (``([B, D, K], [B, D, K])`` ids and values), when given; ``draft_confidences``
    ``[B, D - 1]`` go to the result as they are.
    """
    width = run_tokens.shape[1]
    keep = torch.arange(width, device=run_tokens.device)[None, :] < accept_lens[:, None]
    top_ids = top_values = None
    if top_logprobs is not None:
        ids, values = top_logprobs
        top_ids = torch.where(keep[..., None], ids, 0).reshape(-1, ids.shape[-1])
        top_values = torch.where(keep[..., None], values, 0.0).reshape(-1, values.shape[-1])
    return GenerationBatchResult(
        next_token_ids=torch.where(keep, run_tokens, 0).reshape(-1),
        accept_lens=accept_lens,
        stride=width,
        new_seq_lens=new_seq_lens,
        next_draft_input=payload,
        invalid_rows=invalid_rows,
        logprobs=None if logprobs is None else torch.where(keep, logprobs, 0.0).reshape(-1),
        top_logprob_ids=top_ids,
        top_logprob_values=top_values,
        draft_confidences=draft_confidences,
    )


def empty_result(device: torch.device, stride: int) -> GenerationBatchResult:
    """The result of an IDLE forward: no rows."""
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return GenerationBatchResult(
        next_token_ids=empty,
        accept_lens=empty.clone(),
        stride=stride,
        new_seq_lens=empty.clone(),
        next_draft_input=RelayPayload(bonus_tokens=empty.clone()),
    )
