"""A target's multi-token-prediction (MTP) layers, paged: the drafter the ``mtp`` worker runs.

`MtpLayers` owns the ``L`` MTP layers a checkpoint ships next to its target (``num_mtp_layers``
in ``config.json``, tensors ``mtp.layers.{k}.*``) and their own paged KV cache, one layer per MTP
layer, indexed by the SAME token slots as the target. It shares the target's embedding and LM
head (never written). Layer ``k`` follows transformers' ``MtpLayer`` (``modeling_layers.py``)::

    g_k[p] = post_norm(block_k(eh_proj(cat([enorm(embed(t_p)), hnorm(g_(k-1)[p-1])]))))
    logits = lm_head(g_k[p])                       the token after p + k (no final norm)

where ``g_(-1)`` is the target's last hidden state after its final norm (what transformers'
``hidden_states[-1]`` holds), ``block_k`` is a decoder layer of the target's architecture built
with layer index ``k`` (so an Ernie MoE target's MTP layer ``k`` is sparse where its layer ``k``
would be), and ``mtp_hidden_states_first`` in the config swaps the two halves of the
projection input. Transformers feeds layer ``k`` positions ``k + 1`` onwards only: its
attention never sees positions ``0 .. k``. The paged layers compute those positions too (their
input is a stored zero or a garbage chain value) but mask them out of every attention read, so
each layer's outputs equal transformers' wherever transformers defines them.

On disk (transformers' format, which ``MtpModel.from_pretrained`` reads)::

    config.json         num_mtp_layers (or num_nextn_predict_layers), mtp_hidden_states_first;
                        a NemotronH target also mtp_layer_types and rms_norm_eps
    model.safetensors   mtp.layers.{k}.{enorm,hnorm,post_norm}.weight [H]
                        mtp.layers.{k}.eh_proj.weight [H, 2H]
                        mtp.layers.{k}.mtp_block.<the target's decoder layer k tensors>

A NemotronH (Mamba2 + attention) target ships MTP layers the same way: ``block_k`` is a
NemotronH block (``x + mixer(norm(x))``, `specstate.reference.hybrid.model.HybridBlock`) of the
kind ``mtp_layer_types[k]`` names in ``config.json`` (transformers' ``get_mtp_config`` builds
``NemotronHBlock(mtp_config, k)`` from that list), and ``enorm`` / ``hnorm`` / ``post_norm`` are
NemotronH RMSNorms of ``rms_norm_eps`` (the block's own norm uses ``layer_norm_epsilon``). An
attention or MLP block keeps no recurrent state; a Mamba2 MTP block (``linear_attention``) is
refused, and so is an LFM2 target.

Loading refuses a checkpoint that declares no MTP layers, misses a tensor of a declared layer,
ships a layer past the declared count, or ships two layers with identical weights (a converter
that copied one layer into every slot: every draft step would run the same layer). Each is an
`InvalidConfig` naming the file, the layers and the numbers.

Invariant: the layers read the target's embedding and LM head and write only their own KV
cache, at ``out_cache_loc``; layer ``k`` attends only to positions ``>= k + 1`` of a row (and
a query at a position below that only to itself, so no row of the mask is empty).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    WEIGHTS_FILE,
    StrPath,
    from_hf_config,
    layer_shapes,
    read_config_json,
    read_float_field,
    write_safetensors,
)
from specstate.reference.ernie import read_num_mtp_layers
from specstate.reference.hybrid.config import HybridConfig, LayerKind, is_hybrid_config
from specstate.reference.hybrid.config import from_hf_config as hybrid_from_hf_config
from specstate.reference.hybrid.lfm2_config import is_lfm2_config
from specstate.reference.hybrid.model import (
    HybridBlock,
    HybridNorm,
    PagedHybrid,
    attention_geometry,
)
from specstate.reference.model import (
    AttentionBatch,
    DecoderLayer,
    ForwardPlan,
    KvCache,
    ModelConfig,
    ModelOutput,
    PagedLlama,
    RMSNorm,
    plan_forward,
    shard_config,
)
from specstate.reference.tensor_parallel import shard_state

if TYPE_CHECKING:
    from specstate.engine.worker import ParallelGroup

__all__ = [
    "MtpLayer",
    "MtpLayers",
    "MtpSpec",
    "MtpTarget",
    "load_mtp_layers",
    "read_mtp_spec",
    "save_mtp_layers",
]

_PREFIX: Final = "mtp.layers."

MtpTarget = PagedLlama | PagedHybrid
"""A target whose MTP layers `MtpLayers` runs: a Llama-architecture model or a NemotronH."""

_BLOCK_KINDS: Final = (LayerKind.ATTENTION, LayerKind.MLP)
"""The NemotronH block kinds an MTP layer may be (a Mamba2 block would need state rows)."""


@attrs.frozen(kw_only=True)
class MtpSpec:
    """What a checkpoint's MTP layers are.

    Attributes:
        config: the target's config; every MTP block is one of its decoder layers (a NemotronH
            target's: a block of the kind ``block_kinds`` names).
        num_layers: ``L``, the MTP layers shipped (``>= 1``).
        hidden_states_first: the projection input is ``[hnorm(g), enorm(e)]`` instead of
            ``[enorm(e), hnorm(g)]`` (``mtp_hidden_states_first``).
        block_kinds: a NemotronH target's kind of each MTP block (``mtp_layer_types``:
            attention or MLP); empty for a Llama-architecture target.
        norm_eps: epsilon of ``enorm`` / ``hnorm`` / ``post_norm`` (``rms_norm_eps``; None: the
            config's norm epsilon).

    Raises:
        InvalidConfig: ``block_kinds`` is not one attention or MLP kind per layer for a
            NemotronH config, or is set for a Llama one.
    """

    config: ModelConfig | HybridConfig
    num_layers: int
    hidden_states_first: bool = False
    block_kinds: tuple[LayerKind, ...] = ()
    norm_eps: float | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.config, HybridConfig):
            if self.block_kinds:
                raise InvalidConfig("MtpSpec: block_kinds is for a NemotronH target only")
            return
        if len(self.block_kinds) != self.num_layers:
            raise InvalidConfig(
                f"MtpSpec: {self.num_layers} MTP layers need {self.num_layers} block kinds, "
                f"got {len(self.block_kinds)}"
            )
        for k, kind in enumerate(self.block_kinds):
            if kind not in _BLOCK_KINDS:
                raise InvalidConfig(
                    f"MtpSpec: MTP layer {k} is a {kind.value!r} block; an MTP layer's block must "
                    f"be one of {[b.value for b in _BLOCK_KINDS]} (a Mamba2 block would need its "
                    "own recurrent state)"
                )

    @property
    def eps(self) -> float:
        """Epsilon of ``enorm`` / ``hnorm`` / ``post_norm``."""
        if self.norm_eps is not None:
            return self.norm_eps
        if isinstance(self.config, HybridConfig):
            return self.config.layer_norm_epsilon
        return self.config.rms_norm_eps

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of every MTP tensor on disk."""
        hidden = self.config.hidden_size
        shapes: dict[str, tuple[int, ...]] = {}
        for k in range(self.num_layers):
            layer = f"{_PREFIX}{k}."
            shapes |= {
                layer + "enorm.weight": (hidden,),
                layer + "hnorm.weight": (hidden,),
                layer + "eh_proj.weight": (hidden, 2 * hidden),
                layer + "post_norm.weight": (hidden,),
            }
            if isinstance(self.config, HybridConfig):
                with torch.device("meta"):
                    block = HybridBlock(self.config, self.block_kinds[k], k)
                shapes |= {
                    f"{layer}mtp_block.{n}": tuple(t.shape) for n, t in block.state_dict().items()
                }
            else:
                shapes |= layer_shapes(layer + "mtp_block.", self.config, k)
        return shapes


def read_mtp_spec(directory: StrPath) -> MtpSpec:
    """The MTP layers ``directory/config.json`` declares.

    Raises:
        InvalidConfig: not a readable target config, or it declares no MTP layers; the message
            names the file.
    """
    raw, path = read_config_json(directory, kind="a checkpoint")
    if is_lfm2_config(raw):
        raise InvalidConfig(
            f"{path}: an LFM2 target; MTP layers are served on Llama-architecture and NemotronH "
            "targets"
        )
    config: ModelConfig | HybridConfig
    config = (
        hybrid_from_hf_config(raw, path) if is_hybrid_config(raw) else from_hf_config(raw, path)
    )
    count = read_num_mtp_layers(raw, path)
    if count == 0:
        raise InvalidConfig(
            f"{path}: declares no MTP layers (num_mtp_layers / num_nextn_predict_layers is "
            "absent or 0); the mtp worker drafts with a target's own MTP layers"
        )
    first = raw.get("mtp_hidden_states_first", False)
    if not isinstance(first, bool):
        raise InvalidConfig(
            f"{path}: field 'mtp_hidden_states_first' must be a bool, got {first!r}"
        )
    if not isinstance(config, HybridConfig):
        return MtpSpec(config=config, num_layers=count, hidden_states_first=first)
    try:
        return MtpSpec(
            config=config,
            num_layers=count,
            hidden_states_first=first,
            block_kinds=_read_block_kinds(raw, path, count),
            norm_eps=read_float_field(raw, "rms_norm_eps", path, default=config.layer_norm_epsilon),
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def _read_block_kinds(raw: dict[str, object], path: Path, count: int) -> tuple[LayerKind, ...]:
    """A NemotronH config's ``mtp_layer_types``: one block kind per MTP layer."""
    value = raw.get("mtp_layer_types")
    kinds = {k.value: k for k in LayerKind}
    if not isinstance(value, list) or len(value) != count or any(v not in kinds for v in value):
        raise InvalidConfig(
            f"{path}: field 'mtp_layer_types' must list the block of each of the {count} MTP "
            f"layers (one of {[b.value for b in _BLOCK_KINDS]}), got {value!r}"
        )
    return tuple(kinds[str(v)] for v in value)


class MtpLayer(nn.Module):
    """One MTP layer's parameters (names as on disk under ``mtp.layers.{k}.``).

    Args:
        spec: the layers' shape; layer ``layer``'s block is the config's decoder layer
            ``layer``, or for a NemotronH target a block of ``spec.block_kinds[layer]``.
        config: ``spec.config`` as this layer computes it (dtype, a tensor-parallel shard).
        layer: ``k``.
        reduce: the tensor-parallel all-reduce of a Llama block's projections.
    """

    def __init__(
        self,
        spec: MtpSpec,
        config: ModelConfig | HybridConfig,
        layer: int,
        *,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, spec.eps
        norm = HybridNorm if isinstance(config, HybridConfig) else RMSNorm
        self.enorm = norm(hidden, eps)
        self.hnorm = norm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.mtp_block: DecoderLayer | HybridBlock
        if isinstance(config, HybridConfig):
            self.mtp_block = HybridBlock(config, spec.block_kinds[layer], layer)
        else:
            self.mtp_block = DecoderLayer(config, layer, reduce=reduce)
        self.post_norm = norm(hidden, eps)


def _visible_from(plan: ForwardPlan, batch: AttentionBatch, first: int) -> ForwardPlan:
    """``plan`` whose queries see only positions ``>= first`` (and each query its own one)."""
    max_kv = plan.mask.shape[-1]
    cols = torch.arange(max_kv, device=plan.mask.device)
    own = batch.prefix_lens.long()[:, None] + torch.arange(
        plan.mask.shape[2], device=plan.mask.device
    )
    allowed = (cols >= first)[None, None, :] | (cols[None, None, :] == own[:, :, None])
    return attrs.evolve(plan, mask=plan.mask & allowed[:, None])


class MtpLayers(nn.Module):
    """The paged MTP layers of one target (see the module docstring); inference only.

    Args:
        spec: the layers' shape.
        target: the target whose embedding and LM head they share (a Llama-architecture model
            or a NemotronH); they compute in its dtype, on its device, sharded like it over its
            tensor-parallel group.
        num_token_slots: KV slots of the layers' cache (default: the target cache's).

    Raises:
        InvalidConfig: the target's hidden or vocab size differs from ``spec.config``'s.
    """

    def __init__(
        self, spec: MtpSpec, target: MtpTarget, *, num_token_slots: int | None = None
    ) -> None:
        super().__init__()
        for name in ("hidden_size", "vocab_size"):
            ours, theirs = getattr(spec.config, name), getattr(target.config, name)
            if ours != theirs:
                raise InvalidConfig(f"MtpLayers: {name} {ours} differs from the target's {theirs}")
        if isinstance(spec.config, HybridConfig) != isinstance(target, PagedHybrid):
            raise InvalidConfig(
                f"MtpLayers: {type(spec.config).__name__} layers do not fit a "
                f"{type(target).__name__} target"
            )
        self.spec = spec
        self._parallel = None if isinstance(target, PagedHybrid) else target.parallel
        parallel = self._parallel
        config = attrs.evolve(spec.config, dtype=target.config.dtype)
        local: ModelConfig | HybridConfig
        if isinstance(config, HybridConfig):
            local, self._geometry = config, attention_geometry(config)
        else:
            local = config if parallel is None else shard_config(config, parallel.world_size)
            self._geometry = local
        reduce = None if parallel is None else parallel.all_reduce
        norm: nn.Module
        lm_head: nn.Module
        if isinstance(target, PagedHybrid):
            embedding, lm_head, norm = target.embeddings, target.lm_head, target.norm_f
        else:
            embedding, norm = target.embed_tokens, target.norm
            lm_head = target.embed_tokens if target.lm_head is None else target.lm_head
        device = embedding.weight.device
        with torch.device(device):
            self.layers = nn.ModuleList(
                MtpLayer(spec, local, k, reduce=reduce) for k in range(spec.num_layers)
            )
        self.to(dtype=target.config.dtype)
        self.requires_grad_(False)
        # Detached views, not parameters: they share the target's storage and are not saved.
        self._embedding = embedding.weight.detach()
        self._lm_head: torch.Tensor = lm_head.weight.detach()
        # A bound method, not a submodule: the target's norm is not one of the layers' tensors.
        self._target_norm = norm.forward
        cache_config = attrs.evolve(self._geometry, num_hidden_layers=spec.num_layers)
        slots = target.kv_cache.num_token_slots if num_token_slots is None else num_token_slots
        self._kv_cache = KvCache.allocate(cache_config, num_token_slots=slots, device=device)

    @property
    def num_layers(self) -> int:
        """``L``, the MTP layers."""
        return self.spec.num_layers

    @property
    def kv_cache(self) -> KvCache:
        """The layers' own KV cache: cache layer ``k`` is MTP layer ``k``'s."""
        return self._kv_cache

    def target_hidden(self, pre_norm: torch.Tensor) -> torch.Tensor:
        """``g_(-1)``: the target's final norm of its pre-norm hidden states ``[T, H]``."""
        with torch.no_grad():
            out: torch.Tensor = self._target_norm(pre_norm)
        return out

    def forward(
        self,
        layer: int,
        batch: AttentionBatch,
        hidden: torch.Tensor,
        *,
        logit_rows: torch.Tensor | None = None,
    ) -> ModelOutput:
        """One extend of MTP layer ``layer``: writes its KV at ``out_cache_loc``.

        Args:
            layer: ``k``, which MTP layer runs.
            batch: the tokens ``t_p`` and slot tables (causal, not a tree).
            hidden: ``[T, H]`` ``g_(k-1)[p-1]`` of each token (anything at ``p <= k``).
            logit_rows: optional rows that get logits (empty: a KV-only forward).

        Returns:
            logits of the token after each selected row, and ``g_k`` ``[T, H]`` of every row.

        Raises:
            InvalidConfig: ``layer`` outside ``[0, L)``, ``hidden`` not ``[T, H]``, or the batch
                is inconsistent.
        """
        num_tokens, width = batch.input_ids.shape[0], self.spec.config.hidden_size
        if not 0 <= layer < self.num_layers:
            raise InvalidConfig(f"MtpLayers: layer {layer} outside [0, {self.num_layers})")
        if tuple(hidden.shape) != (num_tokens, width):
            raise InvalidConfig(
                f"MtpLayers: hidden {tuple(hidden.shape)} must be [{num_tokens}, {width}]"
            )
        mtp = self.layers[layer]
        if not isinstance(mtp, MtpLayer):  # narrows the ModuleList entry for the type checker
            raise InvalidConfig(f"MtpLayers: entry {layer} is a {type(mtp).__name__}")
        with torch.no_grad():
            plan = plan_forward(batch, self._geometry, self._kv_cache.num_token_slots)
            plan = _visible_from(plan, batch, layer + 1)
            embedded = mtp.enorm(F.embedding(batch.input_ids, self._embedding))
            previous = mtp.hnorm(hidden.to(embedded.dtype))
            halves = [previous, embedded] if self.spec.hidden_states_first else [embedded, previous]
            x = mtp.mtp_block(mtp.eh_proj(torch.cat(halves, dim=-1)), plan, self._kv_cache)
            x = mtp.post_norm(x)
            logits = F.linear(x if logit_rows is None else x[logit_rows], self._lm_head).float()
        return ModelOutput(logits=logits, hidden_states=x)


def _read_mtp_tensors(root: Path, spec: MtpSpec) -> dict[str, torch.Tensor]:
    """Every MTP tensor of ``root`` (disk names), checked against ``spec`` first."""
    path = root / WEIGHTS_FILE
    if not path.is_file():
        raise InvalidConfig(f"{path}: missing {WEIGHTS_FILE} holding the MTP layers")
    expected = spec.expected_shapes()
    with safe_open(str(path), framework="pt") as handle:
        present = {name for name in handle.keys() if name.startswith("mtp.")}  # noqa: SIM118
        extras = sorted(present - set(expected))
        if extras:
            raise InvalidConfig(
                f"{path}: unexpected MTP tensor '{extras[0]}' ({len(extras)} extra; the config "
                f"declares {spec.num_layers} MTP layers)"
            )
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            if name not in present:
                layer = name.removeprefix(_PREFIX).split(".", 1)[0]
                raise InvalidConfig(
                    f"{path}: MTP layer {layer} of the {spec.num_layers} the config declares is "
                    f"missing tensor '{name}'"
                )
            got = tuple(handle.get_slice(name).get_shape())
            if got != shape:
                raise InvalidConfig(f"{path}: tensor '{name}' has shape {got}, expected {shape}")
            tensors[name] = handle.get_tensor(name)
    return tensors


def _check_distinct(path: Path, spec: MtpSpec, tensors: dict[str, torch.Tensor]) -> None:
    """Raise `InvalidConfig` when two MTP layers hold identical weights."""
    layers = [
        {
            name.removeprefix(f"{_PREFIX}{k}."): t
            for name, t in tensors.items()
            if name.startswith(f"{_PREFIX}{k}.")
        }
        for k in range(spec.num_layers)
    ]
    for k, ours in enumerate(layers):
        for j in range(k):
            theirs = layers[j]
            if ours.keys() == theirs.keys() and all(
                torch.equal(t, theirs[n]) for n, t in ours.items()
            ):
                raise InvalidConfig(
                    f"{path}: MTP layers {j} and {k} of {spec.num_layers} hold identical weights "
                    "(a duplicated layer: every draft step would run the same one)"
                )


def load_mtp_layers(
    directory: StrPath, target: MtpTarget, *, num_token_slots: int | None = None
) -> MtpLayers:
    """The MTP layers of the checkpoint in ``directory`` for ``target`` (a built model of the
    same checkpoint, or a shard of it).

    Raises:
        InvalidConfig: no MTP layers declared, a missing, misshapen, unexpected or duplicated
            layer, or layers that do not fit the target; the message names the file.
    """
    root = Path(directory)
    spec = read_mtp_spec(root)
    try:
        tensors = _read_mtp_tensors(root, spec)
    except SafetensorError as error:
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    _check_distinct(root / WEIGHTS_FILE, spec, tensors)
    layers = MtpLayers(spec, target, num_token_slots=num_token_slots)
    state = {name.removeprefix("mtp."): t for name, t in tensors.items()}
    parallel = layers._parallel
    if parallel is not None:
        state = _shard_blocks(state, spec, parallel)
    layers.load_state_dict(state, strict=True)
    return layers


def _shard_blocks(
    state: dict[str, torch.Tensor], spec: MtpSpec, parallel: ParallelGroup
) -> dict[str, torch.Tensor]:
    """This rank's slice of every MTP block (`shard_state`), the rest replicated."""
    if not isinstance(spec.config, ModelConfig):
        raise InvalidConfig("MtpLayers: a NemotronH target's MTP layers are not sharded")
    blocks = {
        name.replace(".mtp_block.", ".", 1): t for name, t in state.items() if ".mtp_block." in name
    }
    sharded = shard_state(blocks, spec.config, rank=parallel.rank, world_size=parallel.world_size)
    out = {name: t for name, t in state.items() if ".mtp_block." not in name}
    for name, tensor in sharded.items():
        layer, rest = name.removeprefix("layers.").split(".", 1)
        out[f"layers.{layer}.mtp_block.{rest}"] = tensor
    return out


def save_mtp_layers(layers: MtpLayers, directory: StrPath) -> None:
    """Add ``layers``' tensors to the target checkpoint in ``directory`` and declare them in its
    ``config.json`` (``num_mtp_layers``); existing MTP tensors are replaced.

    Raises:
        InvalidConfig: the directory holds no single-file target checkpoint, or ``layers`` is
            one rank's shard.
    """
    if layers._parallel is not None and layers._parallel.world_size > 1:
        raise InvalidConfig("save_mtp_layers: the layers are a tensor-parallel shard")
    root = Path(directory)
    raw, config_path = read_config_json(root, kind="a checkpoint")
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        raise InvalidConfig(f"{root}: save_mtp_layers needs a single {WEIGHTS_FILE}")
    with safe_open(str(weights), framework="pt") as handle:
        names = [n for n in handle.keys() if not n.startswith("mtp.")]  # noqa: SIM118
        tensors = {n: handle.get_tensor(n) for n in names}
    for name, tensor in layers.state_dict().items():
        tensors["mtp." + name] = tensor.detach().to("cpu").contiguous()
    write_safetensors(tensors, weights)
    raw = {**raw, "num_mtp_layers": layers.num_layers}
    if isinstance(layers.spec.config, HybridConfig):  # what transformers' get_mtp_config reads
        raw["mtp_layer_types"] = [kind.value for kind in layers.spec.block_kinds]
        raw["rms_norm_eps"] = layers.spec.eps
    if layers.spec.hidden_states_first:
        raw["mtp_hidden_states_first"] = True
    config_path.write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
