"""The paged EAGLE-3 head: one decoder layer over several target layers' hidden states.

`Eagle3Head` owns the head's parameters, its draft vocabulary map and its own paged KV cache,
indexed by the SAME token slots as the target. The target's *auxiliary* hidden states are the
outputs of three of its decoder layers (``aux_layer_ids``), side by side: ``a_p`` ``[3 * Ht]``.
At position ``p`` with token ``t_p`` and feature ``f`` (``fc(a_(p-1))`` from the target, zeros at
``p = 0``; the head's own previous ``x2`` on later draft steps), following SGLang's
``LlamaForCausalLMEagle3``::

    attn_in = cat([input_layernorm(embed(t_p)), hidden_norm(f)])     [2H]; q, k, v: [*, 2H]
    x1      = f + o_proj(attention(attn_in))                         RoPE at p, causal, own KV
    x2      = x1 + mlp(post_attention_layernorm(x1))                 x2: the next step's feature
    logits  = lm_head(norm(x2))                                      [draft_vocab]
    token   = i + d2t[i] for draft id i                              (the draft vocabulary map)

`Eagle3Head.forward` returns the logits over the *target* vocabulary (a token outside the
draft vocabulary gets the float32 minimum / 4: it is never drafted unless a mask leaves nothing
else), so samplers, penalties and grammars see target ids.

The checkpoint format is `specstate.reference.eagle3_config`'s. Every loading failure is an
`InvalidConfig` naming the file and the field or tensor.

Invariant: the head reads the target's embedding (shared, never written) and writes only its
own KV cache, at ``out_cache_loc``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    StrPath,
    read_checked_tensors,
    write_safetensors,
)
from specstate.reference.eagle3_config import Eagle3Config, read_eagle3_config
from specstate.reference.model import (
    AttentionBatch,
    ForwardPlan,
    KvCache,
    ModelConfig,
    ModelOutput,
    PagedLlama,
    RMSNorm,
    apply_rope,
    paged_attention,
    plan_forward,
)

__all__ = ["Eagle3Head", "load_eagle3_head", "save_eagle3_head"]

_OUTSIDE: Final = torch.finfo(torch.float32).min / 4
"""The logit of a target token outside the draft vocabulary (finite: a mask never empties a row)."""


class _Eagle3Attention(nn.Module):
    """The head's attention projections: queries, keys and values read ``[embedding; f]``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv_heads, dim = config.num_key_value_heads, config.head_dim
        self.q_proj = nn.Linear(2 * hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.shape = (heads, kv_heads, dim)

    def forward(self, x: torch.Tensor, plan: ForwardPlan, cache: KvCache) -> torch.Tensor:
        heads, kv_heads, dim = self.shape
        n = x.shape[0]
        q = apply_rope(self.q_proj(x).view(n, heads, dim), plan)
        k = apply_rope(self.k_proj(x).view(n, kv_heads, dim), plan)
        v = self.v_proj(x).view(n, kv_heads, dim)
        out: torch.Tensor = self.o_proj(paged_attention(q, k, v, 0, plan, cache))
        return out


class _Eagle3Mlp(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Eagle3Layer(nn.Module):
    """The head's decoder layer (names as on disk under ``midlayer.``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = _Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = _Eagle3Mlp(config)

    def forward(
        self, embedded: torch.Tensor, f: torch.Tensor, plan: ForwardPlan, cache: KvCache
    ) -> torch.Tensor:
        """``x2`` of tokens with embeddings ``embedded`` and features ``f`` (both ``[T, H]``)."""
        x = torch.cat([self.input_layernorm(embedded), self.hidden_norm(f)], dim=-1)
        x1 = f + self.self_attn(x, plan, cache)
        out: torch.Tensor = x1 + self.mlp(self.post_attention_layernorm(x1))
        return out


class Eagle3Head(nn.Module):
    """The paged EAGLE-3 head (see the module docstring); inference only.

    Attributes:
        d2t: ``[draft_vocab]`` int64 buffer: draft id ``i`` is target token ``i + d2t[i]``.
        t2d: ``[vocab]`` bool buffer: the target tokens in the draft vocabulary.

    Args:
        config: the head's shape.
        target: the target whose embedding the head shares; the head computes in the target's
            dtype on the target's device.
        num_token_slots: KV slots of the head's cache (default: the target cache's).

    Raises:
        InvalidConfig: the head's vocabulary or target hidden size differs from the target's.
    """

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(
        self, config: Eagle3Config, target: PagedLlama, *, num_token_slots: int | None = None
    ) -> None:
        super().__init__()
        _check_fits_target(config, target.config, "Eagle3Head")
        self.config = config
        self._layer_config = config.layer_config(dtype=target.config.dtype)
        device = target.embed_tokens.weight.device
        hidden = config.hidden_size
        with torch.device(device):
            self.fc = nn.Linear(3 * config.target_hidden_size, hidden, bias=False)
            self.midlayer = _Eagle3Layer(self._layer_config)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.to(dtype=target.config.dtype)
        self.requires_grad_(False)
        self._embedding = target.embed_tokens.weight.detach()  # shared, not saved
        slots = target.kv_cache.num_token_slots if num_token_slots is None else num_token_slots
        self._kv_cache = KvCache.allocate(self._layer_config, num_token_slots=slots, device=device)

    @property
    def kv_cache(self) -> KvCache:
        """The head's own KV cache (same slot indexing as the target's)."""
        return self._kv_cache

    def map_vocabulary(self, target_ids: torch.Tensor) -> None:
        """Set the draft vocabulary: draft id ``i`` is target token ``target_ids[i]``.

        Raises:
            InvalidConfig: not ``draft_vocab_size`` distinct ids inside the target vocabulary.
        """
        ids = target_ids.long().to(self.d2t.device)
        size, vocab = self.config.draft_vocab_size, self.config.vocab_size
        if (
            ids.shape != (size,)
            or len(set(ids.tolist())) != size
            or not bool(((ids >= 0) & (ids < vocab)).all())
        ):
            raise InvalidConfig(f"Eagle3Head: need {size} distinct target ids in [0, {vocab})")
        arange = torch.arange(size, device=ids.device)
        self.d2t.copy_(ids - arange)
        self.t2d.zero_()
        self.t2d[ids] = True

    def target_ids(self) -> torch.Tensor:
        """``[draft_vocab]`` the target token of every draft id: ``i + d2t[i]``."""
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc(aux)``: the feature ``[N, H]`` of auxiliary hidden states ``[N, 3 * Ht]``."""
        with torch.no_grad():
            out: torch.Tensor = self.fc(aux.to(self.fc.weight.dtype))
        return out

    def forward(
        self,
        batch: AttentionBatch,
        features: torch.Tensor,
        *,
        logit_rows: torch.Tensor | None = None,
    ) -> ModelOutput:
        """One extend of the head: writes its KV at ``out_cache_loc``.

        Args:
            batch: the tokens ``t_p`` and slot tables.
            features: ``[T, H]`` ``f`` of each token (projected: `project`).
            logit_rows: optional rows that get logits (empty: a KV-only forward).

        Returns:
            logits over the target vocabulary, and ``x2`` ``[T, H]`` (the next step's feature).

        Raises:
            InvalidConfig: ``features`` is not ``[T, H]``, or the batch is inconsistent.
        """
        num_tokens, hidden = batch.input_ids.shape[0], self.config.hidden_size
        if tuple(features.shape) != (num_tokens, hidden):
            raise InvalidConfig(
                f"Eagle3Head: features {tuple(features.shape)} must be [{num_tokens}, {hidden}]"
            )
        with torch.no_grad():
            plan = plan_forward(batch, self._layer_config, self._kv_cache.num_token_slots)
            embedded = F.embedding(batch.input_ids, self._embedding)
            x2 = self.midlayer(embedded, features.to(embedded.dtype), plan, self._kv_cache)
            out = self.norm(x2 if logit_rows is None else x2[logit_rows])
            draft = F.linear(out, self.lm_head.weight).float()
            logits = draft.new_full((draft.shape[0], self.config.vocab_size), _OUTSIDE)
            logits[:, self.target_ids()] = draft
        return ModelOutput(logits=logits, hidden_states=x2)


def _check_fits_target(config: Eagle3Config, target: ModelConfig, where: str) -> None:
    """Raise `InvalidConfig` unless the vocabulary and target width equal the target's."""
    pairs = (("vocab_size", config.vocab_size), ("target_hidden_size", config.target_hidden_size))
    for name, ours in pairs:
        theirs = target.vocab_size if name == "vocab_size" else target.hidden_size
        if ours != theirs:
            raise InvalidConfig(
                f"{where}: EAGLE-3 head {name} {ours} differs from the target's {theirs}"
            )
    if config.hidden_size != target.hidden_size:
        raise InvalidConfig(
            f"{where}: EAGLE-3 head hidden_size {config.hidden_size} differs from the target's "
            f"{target.hidden_size} (the head shares the target's embedding)"
        )


def _read_head_tensors(path: Path, config: Eagle3Config) -> dict[str, torch.Tensor]:
    """Every expected tensor of ``path`` (names and shapes checked first; the vocabulary map
    checked after)."""
    tensors = read_checked_tensors(
        path,
        config.expected_shapes(),
        kind="the EAGLE-3 head",
        keep=lambda name: name != "embed_tokens.weight",
    )
    ids = torch.arange(config.draft_vocab_size) + tensors["d2t"].long()
    bad = (ids < 0) | (ids >= config.vocab_size)
    if bool(bad.any()) or len(set(ids.tolist())) != ids.numel():
        raise InvalidConfig(
            f"{path}: tensor 'd2t' maps draft ids onto target ids outside [0, "
            f"{config.vocab_size}) or onto one target id twice"
        )
    return tensors | {"d2t": tensors["d2t"].long(), "t2d": tensors["t2d"].bool()}


def load_eagle3_head(
    directory: StrPath, target: PagedLlama, *, num_token_slots: int | None = None
) -> Eagle3Head:
    """Loads the EAGLE-3 head in ``directory`` for ``target`` (see `Eagle3Head` for the args).

    Raises:
        InvalidConfig: a bad config, a head that does not fit the target, a missing file, a
            missing, misshapen or unexpected tensor, or a bad vocabulary map; the message names
            the file.
    """
    root = Path(directory)
    config = read_eagle3_config(root)
    _check_fits_target(config, target.config, str(root / CONFIG_FILE))
    try:
        tensors = _read_head_tensors(root / WEIGHTS_FILE, config)
    except SafetensorError as error:
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    head = Eagle3Head(config, target, num_token_slots=num_token_slots)
    head.load_state_dict(tensors, strict=True)
    return head


def save_eagle3_head(head: Eagle3Head, directory: StrPath) -> None:
    """Writes ``config.json`` and ``model.safetensors`` of ``head`` (created if needed)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    raw = attrs.evolve(head.config, dtype=head.fc.weight.dtype).to_json()
    (root / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in head.state_dict().items()}
    write_safetensors(tensors, root / WEIGHTS_FILE)
