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

On disk (the SGLang / SpecForge / vLLM format) a head is a directory::

    config.json        {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                        "num_hidden_layers": 1, "vocab_size" (the target's), "draft_vocab_size",
                        "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                        "target_hidden_size" (optional, default hidden_size),
                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [l0, l1, l2]}}
    model.safetensors  fc.weight [H, 3 * Ht]; midlayer.{input_layernorm, hidden_norm,
                       post_attention_layernorm}.weight; midlayer.self_attn.{q,k,v}_proj.weight
                       [*, 2H], o_proj; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
                       lm_head.weight [draft_vocab, H]; d2t [draft_vocab] int64; t2d [vocab]
                       bool; embed_tokens.weight optional and unused (the target's embedding is
                       shared, as in SGLang)

``eagle_aux_hidden_state_layer_ids`` name the layers whose *outputs* are captured (SGLang's
convention); without them the target's layers ``1, N // 2 - 1, N - 4`` are (SGLang's default,
the inputs of layers ``2, N // 2, N - 3``). Every loading failure is an `InvalidConfig` naming
the file and the field or tensor.

Invariant: the head reads the target's embedding (shared, never written) and writes only its
own KV cache, at ``out_cache_loc``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    DTYPES,
    WEIGHTS_FILE,
    StrPath,
    read_config_json,
    read_float_field,
    read_int_field,
    write_safetensors,
)
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

__all__ = [
    "EAGLE3_ARCHITECTURE",
    "Eagle3Config",
    "Eagle3Head",
    "load_eagle3_head",
    "read_eagle3_config",
    "save_eagle3_head",
]

EAGLE3_ARCHITECTURE: Final = "LlamaForCausalLMEagle3"
_OUTSIDE: Final = torch.finfo(torch.float32).min / 4
"""The logit of a target token outside the draft vocabulary (finite: a mask never empties a row)."""


@attrs.frozen(kw_only=True)
class Eagle3Config:
    """The shape of an EAGLE-3 head; ``dtype`` is the dtype its weights are stored in.

    Invariant: the sizes satisfy `ModelConfig`'s checks for a one-layer model, ``1 <=
    draft_vocab_size <= vocab_size``, and ``aux_layer_ids`` (when given) are three ids >= 0.
    """

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    dtype: torch.dtype = torch.float32

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        *,
        aux_layer_ids: tuple[int, int, int],
        draft_vocab_size: int | None = None,
    ) -> Eagle3Config:
        """A head shaped like one decoder layer of ``target``."""
        return cls(
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=aux_layer_ids,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            dtype=target.dtype,
        )

    def layer_config(self, dtype: torch.dtype | None = None) -> ModelConfig:
        """The one-layer `ModelConfig` of the head's attention geometry and KV cache."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            dtype=self.dtype if dtype is None else dtype,
        )

    def feature_layers(self, num_target_layers: int) -> tuple[int, int, int]:
        """The target layers whose outputs the head reads (see the module docstring).

        Raises:
            InvalidConfig: a layer outside ``[0, num_target_layers)``.
        """
        n = num_target_layers
        ids = self.aux_layer_ids or (1, n // 2 - 1, n - 4)
        if any(not 0 <= i < n for i in ids):
            raise InvalidConfig(
                f"EAGLE-3 head reads the outputs of target layers {list(ids)} but the target has "
                f"{n} layers (set eagle_config.eagle_aux_hidden_state_layer_ids)"
            )
        return ids

    def to_json(self) -> dict[str, object]:
        """The ``config.json`` object of this head."""
        raw: dict[str, object] = {
            "architectures": [EAGLE3_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            **attrs.asdict(self, filter=lambda a, _: a.name not in ("dtype", "aux_layer_ids")),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        if self.aux_layer_ids is not None:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return raw

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of ``model.safetensors`` (``embed_tokens.weight`` aside)."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_rows = self.num_attention_heads * self.head_dim
        kv_rows = self.num_key_value_heads * self.head_dim
        layer = "midlayer."
        return {
            "fc.weight": (hidden, 3 * self.target_hidden_size),
            layer + "input_layernorm.weight": (hidden,),
            layer + "hidden_norm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_rows, 2 * hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, 2 * hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, 2 * hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
            "norm.weight": (hidden,),
            "lm_head.weight": (self.draft_vocab_size, hidden),
            "d2t": (self.draft_vocab_size,),
            "t2d": (self.vocab_size,),
        }


def _aux_ids(raw: Mapping[str, object], path: StrPath) -> tuple[int, int, int] | None:
    eagle = raw.get("eagle_config")
    if eagle is None:
        return None
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, Mapping) else eagle
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
    ):
        raise InvalidConfig(
            f"{path}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be three layer "
            f"ids >= 0, got {ids!r}"
        )
    return (ids[0], ids[1], ids[2])


def parse_eagle3_config(raw: Mapping[str, object], path: StrPath) -> Eagle3Config:
    """Parses an EAGLE-3 head's ``config.json`` object.

    Raises:
        InvalidConfig: not an EAGLE-3 head, a missing or mistyped field, or inconsistent sizes;
            the message names the file and the field.
    """
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or EAGLE3_ARCHITECTURE not in architectures:
        raise InvalidConfig(
            f"{path}: field 'architectures' is {architectures!r}; expected "
            f"[{EAGLE3_ARCHITECTURE!r}]"
        )
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    heads = read_int_field(raw, "num_attention_heads", path)
    hidden = read_int_field(raw, "hidden_size", path)
    vocab = read_int_field(raw, "vocab_size", path)
    config = Eagle3Config(
        vocab_size=vocab,
        draft_vocab_size=read_int_field(raw, "draft_vocab_size", path, default=vocab),
        hidden_size=hidden,
        intermediate_size=read_int_field(raw, "intermediate_size", path),
        num_attention_heads=heads,
        num_key_value_heads=read_int_field(raw, "num_key_value_heads", path, default=heads),
        head_dim=read_int_field(raw, "head_dim", path, default=hidden // max(heads, 1)),
        target_hidden_size=read_int_field(raw, "target_hidden_size", path, default=hidden),
        aux_layer_ids=_aux_ids(raw, path),
        rms_norm_eps=read_float_field(raw, "rms_norm_eps", path, default=1e-6),
        rope_theta=read_float_field(raw, "rope_theta", path, default=10000.0),
        max_position_embeddings=read_int_field(raw, "max_position_embeddings", path, default=2048),
        dtype=DTYPES[dtype_name],
    )
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise InvalidConfig(
            f"{path}: field 'draft_vocab_size' is {config.draft_vocab_size}; expected 1 .. "
            f"vocab_size {config.vocab_size}"
        )
    try:
        config.layer_config()
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None
    return config


def read_eagle3_config(directory: StrPath) -> Eagle3Config:
    """Reads ``directory/config.json`` of an EAGLE-3 head (see `parse_eagle3_config`)."""
    raw, path = read_config_json(directory, kind="an EAGLE-3 head")
    return parse_eagle3_config(raw, path)


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
    if not path.is_file():
        raise InvalidConfig(f"{path}: missing {WEIGHTS_FILE} of the EAGLE-3 head")
    expected = config.expected_shapes()
    with safe_open(str(path), framework="pt") as handle:
        present = set(handle.keys()) - {"embed_tokens.weight"}
        extras = sorted(present - set(expected))
        if extras:
            raise InvalidConfig(f"{path}: unexpected tensor '{extras[0]}' ({len(extras)} extra)")
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            if name not in present:
                raise InvalidConfig(f"{path}: missing tensor '{name}'")
            got = tuple(handle.get_slice(name).get_shape())
            if got != shape:
                raise InvalidConfig(f"{path}: tensor '{name}' has shape {got}, expected {shape}")
            tensors[name] = handle.get_tensor(name)
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
