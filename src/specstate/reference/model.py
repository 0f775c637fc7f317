"""The reference paged Llama: a model whose attention touches KV only through the slot tables.

`PagedLlama` guarantees that keys and values are written only at `out_cache_loc` and read only
through the `req_to_token` rows named by `req_pool_indices`, so a bookkeeping error anywhere in
the scheduler (a wrong prefix length, a stale slot, a slot shared by two requests) shows up as
wrong tokens. Every forward mode (prefill, chunked or 1-token extend, decode, target verify of a
chain, draft extend) is the same *extend* computation over one frozen `AttentionBatch`::

    req_to_token[req_pool_indices[b]]     one row per request slot; row 0 is padding
      [0, prefix_len)                       KV valid before this forward (read only)
      [prefix_len, prefix_len+extend_len)   new tokens: K/V written this forward at out_cache_loc

New token ``i`` of request ``b`` attends causally to
``req_to_token[slot_b, 0 : prefix_lens[b] + i + 1]`` after every new token's K/V was written, so
``out_cache_loc`` must equal ``req_to_token[slot_b, prefix_len + i]`` for a token to see itself.
Token slot 0 is the padding slot: padding rows (``req_pool_index 0``, ``out_cache_loc 0``) write
there harmlessly; no real request may list slot 0 in the used part of its row.

A tree forward (draft-tree verify, a tree drafting level) is a `TreeAttentionBatch`: its
`TreeMask` ``(start, visible)`` replaces the causal rule. New token ``t`` of request ``b`` sees
positions ``[0, start[b])`` of its row plus ``start[b] + j`` for every ``j`` with
``visible[t, j]`` (its ancestors in the tree and itself); its RoPE position is ``positions[t]``
(``S + depth``), wherever its KV is stored. A plain `AttentionBatch` plans causally, unchanged.

The numerics follow Hugging Face's ``LlamaForCausalLM`` (RMSNorm in float32, default RoPE, SwiGLU
MLP, grouped-query attention), so logits match transformers within float tolerance. The model is
inference-only: `PagedLlama.forward` runs without autograd. Hugging Face file formats live in
`specstate.reference.checkpoint`; this module knows nothing about them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.moe import MoeBlock, MoeConfig

if TYPE_CHECKING:
    from specstate.engine.worker import ParallelGroup

__all__ = [
    "AttentionBatch",
    "DecoderLayer",
    "ForwardPlan",
    "KvCache",
    "KvObserver",
    "ModelConfig",
    "ModelOutput",
    "PagedLlama",
    "RMSNorm",
    "TreeAttentionBatch",
    "TreeMask",
    "apply_rope",
    "paged_attention",
    "plan_forward",
    "shard_config",
]


@attrs.frozen(kw_only=True)
class ModelConfig:
    """The shape and numerics of a Llama-architecture model (HF ``LlamaConfig``, default RoPE).

    Two variations serve Ernie 4.5 MoE (HF ``Ernie4_5_MoeConfig``): ``moe`` makes some layers'
    MLP a `MoeBlock`, and ``rope_interleaved`` rotates adjacent pairs ``(2i, 2i + 1)`` instead of
    the halves ``(i, i + head_dim / 2)``.

    Invariant: every size is >= 1, ``num_attention_heads % num_key_value_heads == 0``,
    ``head_dim`` is even (RoPE rotates halves), ``rms_norm_eps > 0`` and ``rope_theta > 0``.
    ``head_dim`` may differ from ``hidden_size // num_attention_heads``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    moe: MoeConfig | None = None
    rope_interleaved: bool = False

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            if field.type in ("int", int) and value < 1:  # every plain-int field is a size
                raise InvalidConfig(f"ModelConfig: {field.name} must be >= 1, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfig(
                f"ModelConfig: num_attention_heads ({self.num_attention_heads}) is not divisible"
                f" by num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise InvalidConfig(f"ModelConfig: head_dim must be even for RoPE, got {self.head_dim}")
        finite = math.isfinite(self.rms_norm_eps) and math.isfinite(self.rope_theta)
        if not (finite and self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise InvalidConfig(
                f"ModelConfig: rms_norm_eps ({self.rms_norm_eps}) and rope_theta"
                f" ({self.rope_theta}) must be finite and > 0"
            )


def shard_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank of ``world_size`` holds: attention heads, KV heads and MLP width split.

    Vocabulary, hidden size, layers and ``head_dim`` are unchanged (the embedding, the norms and
    the LM head are replicated; `specstate.reference.tensor_parallel` slices the weights).

    Raises:
        InvalidConfig: a split size is not divisible by ``world_size``.
    """
    if world_size == 1:
        return config
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    if config.moe is not None:
        sizes["moe.intermediate_size"] = config.moe.intermediate_size
    for name, size in sizes.items():
        if world_size < 1 or size % world_size:
            raise InvalidConfig(
                f"ModelConfig: {name} ({size}) is not divisible by the tensor-parallel size "
                f"{world_size}"
            )
    return attrs.evolve(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=config.num_key_value_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
        moe=None
        if config.moe is None
        else attrs.evolve(config.moe, intermediate_size=config.moe.intermediate_size // world_size),
    )


class KvObserver(Protocol):
    """Told of every access to a `KvCache` it observes (a test's watch, `KvCache.observe`)."""

    def kv_written(self, cache: KvCache, slots: torch.Tensor) -> None:
        """``slots`` (any shape) were just written."""
        ...

    def kv_read(self, cache: KvCache, slots: torch.Tensor) -> None:
        """``slots`` (any shape) are being read."""
        ...


@attrs.define
class KvCache:
    """Owner of the per-layer K and V buffers, indexed by token slot.

    Invariant: every buffer is ``[num_token_slots, num_kv_heads, head_dim]``; slot 0 is the
    padding slot, so padding rows may write there and no real token is ever stored there.
    Buffers change only through `write`; `gather` returns copies. Observers (`observe`) are told
    of every write and read, in order, on the thread that makes it.
    """

    _keys: list[torch.Tensor]
    _values: list[torch.Tensor]
    _observers: list[KvObserver] = attrs.field(factory=list)

    def observe(self, observer: KvObserver) -> Callable[[], None]:
        """Tell ``observer`` of every access from now on; returns the call that stops it."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer)

    @classmethod
    def allocate(
        cls, config: ModelConfig, *, num_token_slots: int, device: torch.device | str = "cpu"
    ) -> KvCache:
        """Allocates zeroed buffers for every layer in ``config.dtype`` on ``device``.

        Raises:
            InvalidConfig: ``num_token_slots`` < 2 (the padding slot plus one real slot).
        """
        if num_token_slots < 2:
            raise InvalidConfig(
                f"KvCache: num_token_slots must be >= 2 (slot 0 is padding), got {num_token_slots}"
            )
        shape = (num_token_slots, config.num_key_value_heads, config.head_dim)
        layers = range(config.num_hidden_layers)
        return cls(
            [torch.zeros(shape, dtype=config.dtype, device=device) for _ in layers],
            [torch.zeros(shape, dtype=config.dtype, device=device) for _ in layers],
        )

    @property
    def num_token_slots(self) -> int:
        """Token slots per layer, padding slot 0 included."""
        return int(self._keys[0].shape[0])

    @property
    def device(self) -> torch.device:
        """Where the buffers live."""
        return self._keys[0].device

    @property
    def num_layers(self) -> int:
        """Layers whose K and V this cache holds."""
        return len(self._keys)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer, by name (``k0``, ``v0``, ``k1``, ...): indexed by token slot on dim 0.

        The buffers themselves, not copies: a prefill → decode handoff reads and writes them at
        a request's slots (`specstate.handoff`), as `write` would.
        """
        out: dict[str, torch.Tensor] = {}
        for layer, (keys, values) in enumerate(zip(self._keys, self._values, strict=True)):
            out[f"k{layer}"] = keys
            out[f"v{layer}"] = values
        return out

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``k``/``v`` ``[T, kv_heads, head_dim]`` of ``layer`` at token slots ``loc``.

        Duplicate slots are allowed only for padding slot 0 (which copy lands is unspecified).
        """
        self._keys[layer].index_copy_(0, loc, k)
        self._values[layer].index_copy_(0, loc, v)
        for observer in self._observers:
            observer.kv_written(self, loc)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns copies of the K and V of ``layer`` at ``slots`` (any shape; adds 2 dims)."""
        for observer in self._observers:
            observer.kv_read(self, slots)
        return self._keys[layer][slots], self._values[layer][slots]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copies the K and V of every layer from token slots ``src`` to ``dst`` (both ``[N]``).

        Every source is read before any destination is written, so ``src`` and ``dst`` may
        overlap (a compaction that shifts entries left). Duplicate destinations are allowed only
        for padding slot 0, as in `write`.
        """
        src, dst = src.long(), dst.long()
        for observer in self._observers:
            observer.kv_read(self, src)
        for keys, values in zip(self._keys, self._values, strict=True):
            keys.index_copy_(0, dst, keys.index_select(0, src))
            values.index_copy_(0, dst, values.index_select(0, src))
        for observer in self._observers:
            observer.kv_written(self, dst)


@attrs.frozen(kw_only=True)
class TreeMask:
    """Per-token visibility of a tree forward (see the module docstring).

    Attributes:
        start: ``[B]`` int64; positions ``[0, start[b])`` of row ``b`` are visible to all of the
            row's new tokens (the committed prefix ``S``).
        visible: ``[T, W]`` bool; new token ``t`` of row ``b`` also sees position
            ``start[b] + j`` where ``visible[t, j]`` (its tree ancestors and itself).

    Invariant (checked at forward): ``start[b] + W <= prefix_lens[b] + extend_lens[b]``: a tree
    token sees only positions whose KV is valid before or written by this forward.
    """

    start: torch.Tensor
    visible: torch.Tensor


@attrs.frozen(kw_only=True)
class AttentionBatch:
    """One forward's tokens and the slot tables through which attention finds its KV.

    Shapes: ``T`` new tokens concatenated per request, ``B`` requests, all index tensors
    integer-typed on the model's device. ``input_ids``, ``positions``, ``out_cache_loc`` are
    ``[T]``; ``req_pool_indices``, ``prefix_lens``, ``extend_lens`` are ``[B]``;
    ``req_to_token`` is ``[max_requests + 1, row_width]``. New tokens attend causally; a
    `TreeAttentionBatch` attends by a tree mask instead.

    Invariant: ``sum(extend_lens) == T`` and ``prefix_lens + extend_lens <= row_width``
    (checked at forward, which must read them on the host anyway).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    req_to_token: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor

    def __attrs_post_init__(self) -> None:
        groups = {
            "input_ids, positions, out_cache_loc": (
                self.input_ids,
                self.positions,
                self.out_cache_loc,
            ),
            "req_pool_indices, prefix_lens, extend_lens": (
                self.req_pool_indices,
                self.prefix_lens,
                self.extend_lens,
            ),
        }
        for names, group in groups.items():
            if group[0].ndim != 1 or any(t.shape != group[0].shape for t in group):
                shapes = [tuple(t.shape) for t in group]
                raise InvalidConfig(f"AttentionBatch: {names} must be equal 1-D, got {shapes}")
        if self.req_to_token.ndim != 2:
            shape = tuple(self.req_to_token.shape)
            raise InvalidConfig(f"AttentionBatch: req_to_token must be 2-D, got {shape}")


@attrs.frozen(kw_only=True)
class TreeAttentionBatch(AttentionBatch):
    """An `AttentionBatch` whose new tokens attend by a tree mask instead of causally.

    Attributes:
        tree: who sees what (`TreeMask`); ``positions`` carry each token's RoPE position
            (``S + depth``), ``out_cache_loc`` where its KV is stored.

    Invariant: ``tree.start`` is ``[B]`` and ``tree.visible`` a bool ``[T, W]`` (checked here);
    ``tree.start + W <= prefix_lens + extend_lens`` per row (checked at forward).
    """

    tree: TreeMask

    def __attrs_post_init__(self) -> None:
        AttentionBatch.__attrs_post_init__(self)
        tree = self.tree
        if (
            tree.start.shape != self.prefix_lens.shape
            or tree.visible.ndim != 2
            or tree.visible.dtype != torch.bool
            or tree.visible.shape[0] != self.input_ids.shape[0]
        ):
            start, visible = tuple(tree.start.shape), tuple(tree.visible.shape)
            raise InvalidConfig(
                f"TreeAttentionBatch: tree start {start} and visible {visible} "
                f"({tree.visible.dtype}) must be [B] and bool [T, W]"
            )


@attrs.frozen(kw_only=True)
class ModelOutput:
    """What one forward returns.

    Attributes:
        logits: ``[T, vocab]`` float32, or ``[R, vocab]`` for the ``R`` rows selected by
            ``logit_rows`` at forward.
        hidden_states: ``[T, hidden]`` — the last decoder layer's output *before* the final
            RMSNorm (the residual stream EAGLE-style draft heads consume), always all rows; or,
            when a forward names ``feature_layers``, those layers' outputs side by side.
    """

    logits: torch.Tensor
    hidden_states: torch.Tensor


@attrs.frozen
class ForwardPlan:
    """Per-forward plan shared by all layers (padded ``[B, max_ext]`` query layout)."""

    cos: torch.Tensor  # [T, 1, head_dim] float32 RoPE angles of the new tokens
    sin: torch.Tensor
    out_cache_loc: torch.Tensor  # [T] int64 slots the new tokens' K/V are written at
    token_req: torch.Tensor  # [T] request index b of each new token
    token_offset: torch.Tensor  # [T] i: the token's index within its request's extend
    kv_slots: torch.Tensor  # [B, max_kv] token slots each request reads, 0 past its kv_len
    mask: torch.Tensor  # [B, 1, max_ext, max_kv] True where query i may attend column j
    rope_interleaved: bool = False  # rotate pairs (2i, 2i+1), not halves (ModelConfig)


def _check_lengths(batch: AttentionBatch) -> int:
    """Checks the lengths against the tokens and the table; returns the longest KV read."""
    ext, pre = batch.extend_lens.long(), batch.prefix_lens.long()
    num_tokens, (num_rows, row_width) = batch.input_ids.shape[0], batch.req_to_token.shape
    if int(ext.sum()) != num_tokens or bool((ext < 0).any()) or bool((pre < 0).any()):
        raise InvalidConfig(
            f"AttentionBatch: extend_lens {ext.tolist()} (prefix_lens {pre.tolist()}) must be"
            f" >= 0 and sum to the {num_tokens} new tokens"
        )
    max_kv = int((pre + ext).max()) if ext.numel() else 0
    if max_kv > row_width:
        raise InvalidConfig(
            f"AttentionBatch: prefix_lens + extend_lens reach {max_kv}, past req_to_token row"
            f" width {row_width}"
        )
    tree = batch.tree if isinstance(batch, TreeAttentionBatch) else None
    if tree is not None and ext.numel():
        start, width = tree.start.long(), tree.visible.shape[1]
        if bool((start < 0).any()) or bool((start + width > pre + ext).any()):
            raise InvalidConfig(
                f"TreeAttentionBatch: tree start {start.tolist()} + width {width} must lie inside"
                f" prefix_lens + extend_lens {(pre + ext).tolist()}"
            )
    pools = batch.req_pool_indices
    if pools.numel() and (int(pools.min()) < 0 or int(pools.max()) >= num_rows):
        raise InvalidConfig(f"AttentionBatch: req_pool_indices {pools.tolist()} outside {num_rows}")
    return max_kv


def plan_forward(batch: AttentionBatch, config: ModelConfig, num_token_slots: int) -> ForwardPlan:
    """Checks the batch against the tables and builds the padded gather plan."""
    device, max_kv = batch.input_ids.device, _check_lengths(batch)
    ext, pre = batch.extend_lens.long(), batch.prefix_lens.long()
    cols = torch.arange(max_kv, device=device)
    rows = batch.req_to_token[batch.req_pool_indices.long(), :max_kv].long()
    kv_slots = torch.where(cols[None, :] < (pre + ext)[:, None], rows, 0)
    for name, slots in (("req_to_token", kv_slots), ("out_cache_loc", batch.out_cache_loc)):
        if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_token_slots):
            raise InvalidConfig(f"AttentionBatch: {name} has a slot outside [0, {num_token_slots})")
    token_req = torch.repeat_interleave(torch.arange(ext.shape[0], device=device), ext)
    starts = torch.cumsum(ext, 0) - ext
    token_offset = torch.arange(token_req.shape[0], device=device) - starts[token_req]
    max_ext = int(ext.max()) if ext.numel() else 0
    if not isinstance(batch, TreeAttentionBatch):
        # Padded query rows (i >= extend_len) still see column 0, so no row of the mask is
        # empty (an empty row makes SDPA return NaN); their outputs are dropped.
        last_visible = pre[:, None] + torch.arange(max_ext, device=device)[None, :]
        mask = (cols[None, None, :] <= last_visible[:, :, None])[:, None]
    else:
        mask = _tree_mask(batch.tree, token_req, token_offset, ext, cols, max_ext)[:, None]
    cos, sin = _rope(batch.positions, config)
    out_cache_loc = batch.out_cache_loc.long()
    return ForwardPlan(
        cos, sin, out_cache_loc, token_req, token_offset, kv_slots, mask, config.rope_interleaved
    )


def _tree_mask(
    tree: TreeMask,
    token_req: torch.Tensor,
    token_offset: torch.Tensor,
    ext: torch.Tensor,
    cols: torch.Tensor,
    max_ext: int,
) -> torch.Tensor:
    """``[B, max_ext, max_kv]`` visibility of a tree forward (see `TreeMask`).

    Padded query rows see column 0 only, so no row of the mask is empty.
    """
    num_reqs, width = ext.shape[0], tree.visible.shape[1]
    start = tree.start.long()
    mask = (cols[None, :] < start[:, None])[:, None, :].repeat(1, max_ext, 1)
    if width:
        visible = tree.visible.new_zeros(num_reqs, max_ext, width)
        visible[token_req, token_offset] = tree.visible
        rel = cols[None, :] - start[:, None]  # [B, max_kv] column relative to the tree start
        in_tree = (rel >= 0) & (rel < width)
        index = rel.clamp(0, width - 1)[:, None, :].expand(num_reqs, max_ext, cols.shape[0])
        mask |= visible.gather(2, index) & in_tree[:, None, :]
    padded = torch.arange(max_ext, device=ext.device)[None, :] >= ext[:, None]
    mask |= padded[:, :, None] & (cols == 0)[None, None, :]
    return mask


def _rope(positions: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Default-RoPE cos/sin ``[T, 1, head_dim]`` in float32 (HF's computation).

    Rotate-half layout: angle ``i`` at columns ``i`` and ``i + head_dim / 2``; interleaved
    (``config.rope_interleaved``): at columns ``2i`` and ``2i + 1``.
    """
    exponents = torch.arange(0, config.head_dim, 2, device=positions.device).float()
    inv_freq = 1.0 / (config.rope_theta ** (exponents / config.head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    if config.rope_interleaved:
        emb = freqs.repeat_interleave(2, dim=-1)[:, None, :]
    else:
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def _apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotates ``x`` ``[T, heads, head_dim]`` by the positions' angles (see `_rope`).

    Interleaved, HF Ernie's computation: in float32, cast back to ``x``'s dtype.
    """
    if interleaved:
        pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        return (x.float() * cos + pairs.float() * sin).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def apply_rope(x: torch.Tensor, plan: ForwardPlan) -> torch.Tensor:
    """``x`` ``[T, heads, head_dim]`` (queries or keys of the plan's tokens) rotated to their
    positions, in the plan's RoPE layout: what every attention layer of the model does."""
    return _apply_rope(x, plan.cos, plan.sin, interleaved=plan.rope_interleaved)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 and cast back like HF."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Attention(nn.Module):
    """Grouped-query attention that writes at ``out_cache_loc`` and reads via ``req_to_token``."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        dim, hidden = config.head_dim, config.hidden_size
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.shape = (heads, kv_heads, dim)
        self.layer = layer

    def forward(self, x: torch.Tensor, plan: ForwardPlan, cache: KvCache) -> torch.Tensor:
        heads, kv_heads, dim = self.shape
        num_tokens = x.shape[0]
        q = apply_rope(self.q_proj(x).view(num_tokens, heads, dim), plan)
        k = apply_rope(self.k_proj(x).view(num_tokens, kv_heads, dim), plan)
        v = self.v_proj(x).view(num_tokens, kv_heads, dim)
        projected: torch.Tensor = self.o_proj(paged_attention(q, k, v, self.layer, plan, cache))
        return projected


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    plan: ForwardPlan,
    cache: KvCache,
    *,
    new_columns: torch.Tensor | None = None,
) -> torch.Tensor:
    """Grouped-query attention of the batch's new tokens over their rows' KV, ``[N, H * d]``.

    Writes the new tokens' ``k`` and ``v`` (``[N, KV, d]``) of ``layer`` at ``out_cache_loc``
    first, then gathers every row's KV through the slot table and attends with the queries
    ``q`` (``[N, H, d]``) under ``plan.mask``; query head ``h`` reads KV head ``h // (H/KV)``,
    as Hugging Face's ``repeat_kv``. ``new_columns`` (``[N]``, each new token's KV column,
    i.e. its position): the new tokens read their own ``k`` and ``v`` as computed rather than
    through the table, for a forward whose writes past a row's verify budget went to the
    padding slot (a DFlash block draft).
    """
    num_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    # NOTE: write before gather — a new token must see its own K/V through the table.
    cache.write(layer, plan.out_cache_loc, k, v)
    keys, values = cache.gather(layer, plan.kv_slots)  # [B, max_kv, kv_heads, dim]
    if new_columns is not None:  # the gather made copies: the cache is not touched
        at = (plan.token_req, new_columns.long())
        keys[at], values[at] = k.to(keys.dtype), v.to(values.dtype)
    group = heads // kv_heads
    keys = keys.repeat_interleave(group, dim=2).transpose(1, 2)
    values = values.repeat_interleave(group, dim=2).transpose(1, 2)
    queries = q.new_zeros(plan.kv_slots.shape[0], plan.mask.shape[2], heads, dim)
    queries[plan.token_req, plan.token_offset] = q
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, plan.mask)
    return out.transpose(1, 2)[plan.token_req, plan.token_offset].reshape(num_tokens, heads * dim)


class _Mlp(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention then MLP (a `MoeBlock` where ``config.moe`` says so).

    With ``reduce`` (tensor parallelism: this rank holds some heads and some of the MLP), the
    outputs of ``o_proj`` and ``down_proj`` are partial sums that ``reduce`` sums over the ranks
    before each residual add.
    """

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        *,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = _Attention(config, layer)
        moe = config.moe
        self.mlp: nn.Module
        if moe is not None and moe.is_sparse(layer):
            self.mlp = MoeBlock(moe, config.hidden_size, width=moe.intermediate_size, reduce=reduce)
            self._mlp_reduces = False  # the block reduces its own partial sums
        else:
            self.mlp = _Mlp(config)
            self._mlp_reduces = reduce is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self._reduce = reduce

    def forward(self, x: torch.Tensor, plan: ForwardPlan, cache: KvCache) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), plan, cache)
        if self._reduce is not None:
            attended = self._reduce(attended)
        x = x + attended
        mixed = self.mlp(self.post_attention_layernorm(x))
        if self._reduce is not None and self._mlp_reduces:
            mixed = self._reduce(mixed)
        out: torch.Tensor = x + mixed
        return out


class PagedLlama(nn.Module):
    """A Llama causal LM over a paged KV cache it owns (see the module docstring).

    Parameter names equal Hugging Face's with the ``model.`` prefix removed (``lm_head`` is
    absent when embeddings are tied). The KV cache is not a parameter or buffer: build the model
    on its final device, ``.to()`` does not move the cache.

    With ``parallel`` the model is this rank's shard (`shard_config`): its attention heads, KV
    heads and MLP columns, with the embedding, the norms and the LM head replicated; every
    decoder layer sums its row-parallel outputs over the group (`ParallelGroup.all_reduce`,
    bit for bit equal on every rank, so every rank computes the same hidden states and logits).
    ``config`` stays the whole model's; the KV cache holds this rank's KV heads only.

    Args:
        config: The model shape; parameters are created in ``config.dtype``.
        num_token_slots: KV token slots per layer, padding slot 0 included.
        device: Where parameters and the KV cache live.
        parallel: the tensor-parallel group this model is a shard of (None: the whole model).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_token_slots: int,
        device: torch.device | str = "cpu",
        parallel: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel
        local = config if parallel is None else shard_config(config, parallel.world_size)
        reduce = None if parallel is None else parallel.all_reduce
        with torch.device(device):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(
                DecoderLayer(local, i, reduce=reduce) for i in range(config.num_hidden_layers)
            )
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        self.to(dtype=config.dtype)
        self.requires_grad_(False)
        self._kv_cache = KvCache.allocate(local, num_token_slots=num_token_slots, device=device)

    @property
    def kv_cache(self) -> KvCache:
        """The KV cache this model writes at ``out_cache_loc`` and reads via ``req_to_token``."""
        return self._kv_cache

    def forward(
        self,
        batch: AttentionBatch,
        *,
        logit_rows: torch.Tensor | None = None,
        feature_layers: tuple[int, ...] | None = None,
    ) -> ModelOutput:
        """Runs one extend forward: writes the new tokens' K/V, returns logits and hidden states.

        Args:
            batch: Tokens and slot tables; see `AttentionBatch` for the invariants.
            logit_rows: Optional ``[R]`` indices into the ``T`` new tokens; only those rows get
                logits (e.g. the last token of each prefill chunk).
            feature_layers: return as ``hidden_states`` the outputs (residual stream) of these
                decoder layers, concatenated ``[T, len(feature_layers) * hidden]`` (the
                auxiliary hidden states an EAGLE-3 head reads), instead of the last layer's.

        Raises:
            InvalidConfig: The batch is inconsistent with itself or with the KV cache size, or a
                feature layer is outside ``[0, num_hidden_layers)``.
        """
        wanted = () if feature_layers is None else feature_layers
        if any(not 0 <= i < self.config.num_hidden_layers for i in wanted):
            raise InvalidConfig(
                f"PagedLlama: feature layers {list(wanted)} outside [0, "
                f"{self.config.num_hidden_layers})"
            )
        with torch.no_grad():
            plan = plan_forward(batch, self.config, self._kv_cache.num_token_slots)
            x: torch.Tensor = self.embed_tokens(batch.input_ids)
            outputs: list[torch.Tensor] = []
            for layer in self.layers:
                x = layer(x, plan, self._kv_cache)
                outputs.append(x)
            normed = self.norm(x if logit_rows is None else x[logit_rows])
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(normed, head).float()
        hidden = x if feature_layers is None else torch.cat([outputs[i] for i in wanted], -1)
        return ModelOutput(logits=logits, hidden_states=hidden)
