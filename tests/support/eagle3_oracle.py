"""Test-only: EAGLE-3 heads derived from a tiny Llama target, and a plain unpaged recomputation.

A random head almost never agrees with its target, so the heads here are *derived* from it: the
head's attention reads the normed embedding with the target's last layer's projections (plus
a random part over the feature half), its MLP, norms and LM head rows are the target's, and its
``fc`` passes the last auxiliary layer through (plus noise): the drafts match the target's
greedy tokens sometimes (accept lengths strictly between 1 and the maximum) and every part of
the feature path changes them. The draft vocabulary is a random subset of the target's.

`dense_eagle3_drafts` recomputes a round's drafts from the spec with plain torch ops over the
whole sequence, no KV cache and none of specstate's modules: the target's auxiliary hidden
states from transformers (forward hooks on its decoder layers), the head's math written out.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from hf_oracle import make_checkpoint, one_thread
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specstate.engine.worker import WorkerProtocol
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.eagle3_config import Eagle3Config
from specstate.reference.eagle3_head import Eagle3Head, save_eagle3_head
from specstate.reference.model import DecoderLayer, PagedLlama
from specstate.reference.workers import default_registry


def derived_eagle3_head(
    target: PagedLlama,
    aux_layer_ids: tuple[int, int, int],
    *,
    draft_vocab_size: int,
    seed: int,
    feature_weight: float = 0.3,
) -> Eagle3Head:
    """An EAGLE-3 head that partly agrees with ``target`` (see the module docstring)."""
    config = Eagle3Config.for_target(
        target.config, aux_layer_ids=aux_layer_ids, draft_vocab_size=draft_vocab_size
    )
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(config, target)
    hidden = target.config.hidden_size
    last, first = target.layers[-1], target.layers[0]
    assert isinstance(last, DecoderLayer) and isinstance(first, DecoderLayer)
    lm_head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    ids = torch.randperm(target.config.vocab_size, generator=gen)[:draft_vocab_size].sort().values
    layer = head.midlayer
    with torch.no_grad():
        passthrough = torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1)
        head.fc.weight.copy_(passthrough + 0.05 * torch.randn(hidden, 3 * hidden, generator=gen))
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(last.self_attn, name).weight
            noise = torch.randn(weight.shape, generator=gen) * weight.std() * feature_weight
            getattr(layer.self_attn, name).weight.copy_(torch.cat([weight, noise], dim=1))
        layer.self_attn.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        layer.mlp.load_state_dict(last.mlp.state_dict())
        layer.input_layernorm.weight.copy_(first.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.norm.weight.copy_(target.norm.weight)
        head.lm_head.weight.copy_(lm_head[ids])
        head.map_vocabulary(ids)
    return head


TRAINING_PROMPTS = (
    (3, 14, 15, 92, 65, 35, 89),
    (79, 32),
    (38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93),
    (7,),
    (5, 5, 5, 5, 5, 5),
    (11, 22, 33, 44),
    (60, 1, 60, 1, 60),
    (90, 80, 70),
)
"""The prompts the head is trained on: the tests' workloads (their outputs included)."""


@attrs.frozen
class Eagle3Checkpoints:
    """A three-layer Llama target and a derived EAGLE-3 head reading layers 0, 1 and 2."""

    target: Path
    eagle3: Path
    hf: LlamaForCausalLM
    vocab_size: int
    aux_layer_ids: tuple[int, int, int]

    def worker(self, *, num_steps: int = 3, topk: int = 1, **options: Any) -> WorkerProtocol:
        """An ``eagle3`` worker on the target and the head."""
        return default_registry().create(
            "eagle3",
            target=self.target,
            eagle3=self.eagle3,
            num_steps=num_steps,
            topk=topk,
            **options,
        )


def make_eagle3_checkpoints(
    root: Path, *, seed: int = 0, vocab_size: int = 97, draft_vocab_size: int = 80
) -> Eagle3Checkpoints:
    """Build and save a three-layer target and its derived head under ``root``."""
    with one_thread():
        hf = make_checkpoint(root / "target", seed=seed, vocab_size=vocab_size, layers=3)
        paged = load_paged_llama(root / "target", num_token_slots=2)
        aux = (0, 1, 2)
        head = derived_eagle3_head(paged, aux, draft_vocab_size=draft_vocab_size, seed=seed + 7)
        save_eagle3_head(distill(head, hf, TRAINING_PROMPTS), root / "eagle3")
    return Eagle3Checkpoints(
        target=root / "target",
        eagle3=root / "eagle3",
        hf=hf,
        vocab_size=vocab_size,
        aux_layer_ids=aux,
    )


def target_aux(hf: LlamaForCausalLM, tokens: Sequence[int], layers: Sequence[int]) -> torch.Tensor:
    """``[len(tokens), 3H]``: the outputs of decoder ``layers`` (before the final norm)."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        hf.model.layers[i].register_forward_hook(
            lambda _m, _a, out, i=i: captured.__setitem__(
                i, out[0] if isinstance(out, tuple) else out
            )
        )
        for i in set(layers)
    ]
    try:
        with torch.no_grad():
            hf(torch.tensor([list(tokens)]))
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat([captured[i][0] for i in layers], dim=-1)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[B, T, heads, dim]`` at positions 0..T-1."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(x.shape[1]).float()[:, None] * inv[None, :]
    emb = torch.cat([angles, angles], -1)[None, :, None, :]
    rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * emb.cos() + rotated * emb.sin()


def dense_head(
    w: dict[str, torch.Tensor],
    config: Eagle3Config,
    embed: torch.Tensor,
    tokens: torch.Tensor,
    feats: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head over whole sequences ``tokens`` ``[B, n]`` with features ``[B, n, H]``:
    ``(draft-vocab logits [B, n, Vd], x2 [B, n, H])`` (causal: right padding changes nothing
    before it)."""
    eps, heads, kv, dim = (
        config.rms_norm_eps,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    rows, n = tokens.shape
    m = {k.removeprefix("midlayer."): v for k, v in w.items()}
    x = torch.cat(
        [
            _rms(embed[tokens], m["input_layernorm.weight"], eps),
            _rms(feats, m["hidden_norm.weight"], eps),
        ],
        -1,
    )
    q = (x @ m["self_attn.q_proj.weight"].T).view(rows, n, heads, dim)
    k = (x @ m["self_attn.k_proj.weight"].T).view(rows, n, kv, dim)
    v = (x @ m["self_attn.v_proj.weight"].T).view(rows, n, kv, dim)
    q, k = _rope(q, config.rope_theta), _rope(k, config.rope_theta)
    k, v = k.repeat_interleave(heads // kv, 2), v.repeat_interleave(heads // kv, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / dim**0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(rows, n, heads * dim)
    x1 = feats + attn @ m["self_attn.o_proj.weight"].T
    h = _rms(x1, m["post_attention_layernorm.weight"], eps)
    mlp = (F.silu(h @ m["mlp.gate_proj.weight"].T) * (h @ m["mlp.up_proj.weight"].T)) @ m[
        "mlp.down_proj.weight"
    ].T
    x2 = x1 + mlp
    logits = _rms(x2, w["norm.weight"], eps) @ w["lm_head.weight"].T
    return logits, x2


def dense_eagle3_drafts(
    head_dir: Path,
    config: Eagle3Config,
    hf: LlamaForCausalLM,
    tokens: Sequence[int],
    num_steps: int,
) -> list[int]:
    """The greedy drafts of the round whose pending bonus is ``tokens[-1]`` at
    ``S = len(tokens) - 1``, recomputed from scratch: features ``[0, fc(a_0) .. fc(a_(S-1))]``
    for positions ``0 .. S``, then the head's own ``x2`` for each later draft position."""
    w = load_file(head_dir / "model.safetensors")
    embed = hf.model.embed_tokens.weight.detach()
    hot = torch.arange(config.draft_vocab_size) + w["d2t"]
    start = len(tokens) - 1
    assert config.aux_layer_ids is not None
    with torch.no_grad():
        aux = target_aux(hf, tokens[:start], config.aux_layer_ids)
        feats = torch.cat([torch.zeros(1, config.hidden_size), aux @ w["fc.weight"].T])
        seq, drafts = list(tokens), []
        for _ in range(num_steps):
            logits, x2 = dense_head(w, config, embed, torch.tensor([seq]), feats[None])
            drafts.append(int(hot[int(logits[0, -1].argmax())]))
            seq.append(drafts[-1])
            feats = torch.cat([feats, x2[0, -1:]])
    return drafts


def _continued(hf: LlamaForCausalLM, prompt: Sequence[int], new_tokens: int) -> list[int]:
    """``prompt`` and the target's greedy continuation (training data: plain forwards, cheaper
    than ``generate()`` at this size)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def distill(
    head: Eagle3Head,
    hf: LlamaForCausalLM,
    prompts: Sequence[Sequence[int]],
    *,
    steps: int = 80,
    new_tokens: int = 24,
) -> Eagle3Head:
    """``head`` trained briefly (Adam, teacher-forced target features) to predict the target's
    greedy tokens on the target's own greedy continuations of ``prompts`` (the workload the
    tests serve), as EAGLE-3 heads are trained on their target's outputs; returns it with the
    trained weights loaded."""
    config = head.config
    assert config.aux_layer_ids is not None
    embed = hf.model.embed_tokens.weight.detach()
    sequences = [_continued(hf, p, new_tokens) for p in prompts]
    width = max(len(seq) for seq in sequences)
    tokens = torch.zeros(len(sequences), width, dtype=torch.int64)  # right padding
    labels = torch.full((len(sequences), width - 1), -100, dtype=torch.int64)
    aux = torch.zeros(len(sequences), width, 3 * config.target_hidden_size)
    draft_of = torch.full((config.vocab_size,), -100, dtype=torch.int64)
    draft_of[head.target_ids()] = torch.arange(config.draft_vocab_size)
    for i, (prompt, seq) in enumerate(zip(prompts, sequences, strict=True)):
        tokens[i, : len(seq)] = torch.tensor(seq)
        aux[i, : len(seq)] = target_aux(hf, seq, config.aux_layer_ids)
        # a prompt token is nobody's prediction: labels from the first generated one on
        labels[i, len(prompt) - 1 : len(seq) - 1] = draft_of[torch.tensor(seq[len(prompt) :])]
    weights = {
        name: t.detach().clone().float().requires_grad_(t.is_floating_point())
        for name, t in head.state_dict().items()
    }
    trainable = [t for t in weights.values() if t.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        feats = torch.cat(
            [
                torch.zeros(len(sequences), 1, config.hidden_size),
                aux[:, :-2] @ weights["fc.weight"].T,
            ],
            dim=1,
        )
        logits, _ = dense_head(weights, config, embed, tokens[:, :-1], feats)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    head.load_state_dict({k: v.detach() for k, v in weights.items()})
    return head
