"""Trains and ships the embedded default models: byte-level target, 1-layer drafter, EAGLE head.

This script owns the reproducible recipe behind ``src/specstate/reference/embedded/``: it reads the
standard library's own ``*.py`` sources (available offline on any Python install), trains three
models with fixed step counts and seeds, writes the checkpoints, checks that both transformers and
`load_paged_llama` load the target with the same logits, measures held-out loss and offline greedy
acceptance, and writes ``REPORT.md``::

    stdlib *.py (sorted, ~5% held out by path hash) -> byte stream [BOS bytes EOS]...
      1. target  Llama, tied embeddings        CE on next byte
      2. draft   1-layer Llama                 CE + KL to the frozen target
      3. eagle   fc + 1 decoder layer + norm   CE (through the target's lm_head) + feature loss

Usage (from the repository root; ~30 minutes on 2 idle CPU cores, longer when they are shared)::

    nice -n 10 python scripts/train_embedded.py > train.log 2>&1

Step counts, not wall-clock limits, end every phase, so a rerun on the same Python version
(same stdlib sources), torch version and thread count reproduces the weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specstate.reference.checkpoint import load_paged_llama, save_paged_llama, write_safetensors
from specstate.reference.embedded import BOS_ID, EOS_ID, VOCAB_SIZE
from specstate.reference.model import AttentionBatch, ModelConfig, PagedLlama

EXCLUDED_DIRS: Final = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
HELDOUT_BUCKETS: Final = 20  # one bucket of 20 (~5%) of files is held out
REPO_ROOT: Final = Path(__file__).resolve().parents[1]
DEFAULT_OUT: Final = REPO_ROOT / "src" / "specstate" / "reference" / "embedded"
SHIP_DTYPE: Final = torch.float16


def log(message: str) -> None:
    """Prints one progress line with a wall-clock stamp."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------- corpus


@attrs.frozen(kw_only=True)
class Corpus:
    """Token streams (documents joined as ``BOS bytes EOS``) and where they came from."""

    train: torch.Tensor  # [N] int64
    heldout: torch.Tensor  # [M] int64
    heldout_docs: tuple[torch.Tensor, ...]  # the held-out files, each [BOS bytes EOS]
    num_train_files: int
    num_heldout_files: int


def is_heldout(relative: str) -> bool:
    """Deterministic split: a file is held out when its path hashes into bucket 0."""
    digest = hashlib.sha256(relative.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_BUCKETS == 0


def read_corpus(max_train_bytes: int, max_heldout_bytes: int) -> Corpus:
    """Reads the stdlib sources in sorted path order, splits and caps them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(root.rglob("*.py")) if not EXCLUDED_DIRS & set(f.parts)]
    train: list[torch.Tensor] = []
    heldout: list[torch.Tensor] = []
    sizes = {"train": 0, "heldout": 0}
    for path in files:
        relative = path.relative_to(root).as_posix()
        split, cap = (
            ("heldout", max_heldout_bytes) if is_heldout(relative) else ("train", max_train_bytes)
        )
        data = path.read_bytes()
        if not data or sizes[split] + len(data) > cap:
            continue
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)
        doc = torch.cat([torch.tensor([BOS_ID]), body, torch.tensor([EOS_ID])])
        (heldout if split == "heldout" else train).append(doc)
        sizes[split] += len(data)
    return Corpus(
        train=torch.cat(train),
        heldout=torch.cat(heldout),
        heldout_docs=tuple(heldout),
        num_train_files=len(train),
        num_heldout_files=len(heldout),
    )


def batches(
    stream: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> Iterator[torch.Tensor]:
    """Endless random windows ``[batch_size, seq_len + 1]`` drawn with a private generator."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
        yield stream[starts[:, None] + offsets[None, :]]


# --------------------------------------------------------------------------- models


class RMSNorm(nn.Module):
    """Llama RMSNorm (float32 statistics)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rope(positions: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Default-RoPE cos/sin ``[T, head_dim]`` (HF's rotate-half layout)."""
    exponents = torch.arange(0, config.head_dim, 2).float() / config.head_dim
    freqs = positions.float()[:, None] / (config.rope_theta**exponents)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ``[B, heads, T, head_dim]``."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with HF Llama parameter names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads, kv_heads, dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(config.hidden_size, heads * dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, config.hidden_size, bias=False)
        self.shape = (heads, kv_heads, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        (batch, length, _), (heads, kv_heads, dim) = x.shape, self.shape
        q = self.q_proj(x).view(batch, length, heads, dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, kv_heads, dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, kv_heads, dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))
        return projected


class Mlp(nn.Module):
    """SwiGLU feed-forward with HF Llama parameter names."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """One pre-norm Llama decoder layer (attention then MLP, both residual)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Mlp(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


def init_weights(module: nn.Module, num_layers: int) -> None:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by depth."""
    for name, param in module.named_parameters():
        if name.endswith("norm.weight"):
            continue
        std = (
            0.02 / math.sqrt(2 * num_layers)
            if name.endswith(("o_proj.weight", "down_proj.weight"))
            else 0.02
        )
        nn.init.normal_(param, std=std)


class TrainLlama(nn.Module):
    """A trainable tied-embedding Llama whose state dict is `PagedLlama`'s (HF minus ``model.``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        init_weights(self, config.num_hidden_layers)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits ``[B, T, vocab]`` and the last layer's output before the final norm."""
        cos, sin = rope(torch.arange(ids.shape[1]), self.config)
        x: torch.Tensor = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return F.linear(self.norm(x), self.embed_tokens.weight), x


class EagleHead(nn.Module):
    """EAGLE head: ``h = layer(fc(cat(embed(t_p), f_{p-1})))``; logits ``= lm_head(norm(h))``.

    The embedding and lm_head are the (frozen, tied) target's and are not parameters here.
    """

    def __init__(self, config: ModelConfig, target_norm: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        init_weights(self, 1)
        with torch.no_grad():
            self.norm.weight.copy_(target_norm)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Embeddings and features f_{p-1}, both ``[B, T, hidden]`` -> h ``[B, T, hidden]``."""
        cos, sin = rope(torch.arange(embeds.shape[1]), self.config)
        x: torch.Tensor = self.fc(torch.cat([embeds, features], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def round_to_ship_dtype(module: nn.Module) -> None:
    """Rounds parameters through the shipped dtype, so evaluation sees the shipped weights."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(param.to(SHIP_DTYPE).float())


def count_params(module: nn.Module) -> int:
    """Number of parameters (tied weights once)."""
    return sum(p.numel() for p in module.parameters())


# --------------------------------------------------------------------------- training


@attrs.frozen(kw_only=True)
class Schedule:
    """Fixed-length AdamW schedule: linear warmup then cosine decay to 10%."""

    steps: int
    lr: float
    warmup: int = 50
    weight_decay: float = 0.1

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def run_training(
    name: str,
    module: nn.Module,
    schedule: Schedule,
    data: Iterator[torch.Tensor],
    loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
    log_every: int,
) -> float:
    """Runs ``schedule.steps`` optimizer steps of ``loss_fn`` on ``data``; returns seconds taken."""
    decay = [p for n, p in module.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in module.named_parameters() if p.ndim < 2 or "embed" in n]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": schedule.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=schedule.lr,
        betas=(0.9, 0.95),
    )
    module.train()
    start = time.perf_counter()
    for step in range(schedule.steps):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        loss, parts = loss_fn(next(data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == schedule.steps - 1:
            shown = " ".join(f"{k} {v:.4f}" for k, v in parts.items())
            elapsed = time.perf_counter() - start
            log(f"{name} step {step + 1}/{schedule.steps} {shown} ({elapsed:.0f} s)")
    module.eval()
    return time.perf_counter() - start


def lm_loss(model: TrainLlama) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]:
    """Next-byte cross-entropy."""

    def loss_fn(window: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        logits, _ = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        return loss, {"ce": float(loss.detach())}

    return loss_fn


def distill_loss(
    draft: TrainLlama, target: TrainLlama, kl_weight: float
) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]:
    """Cross-entropy plus ``kl_weight`` * KL(target || draft) on the same window."""

    def loss_fn(window: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.no_grad():
            teacher, _ = target(window[:, :-1])
        logits, _ = draft(window[:, :-1])
        ce = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        kl = F.kl_div(
            F.log_softmax(logits, -1).flatten(0, 1),
            F.log_softmax(teacher, -1).flatten(0, 1),
            log_target=True,
            reduction="batchmean",
        )
        return (1 - kl_weight) * ce + kl_weight * kl, {
            "ce": float(ce.detach()),
            "kl": float(kl.detach()),
        }

    return loss_fn


def shifted(features: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` features f_p -> inputs f_{p-1} (zeros at p = 0)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def eagle_logits(head: EagleHead, target: TrainLlama, h: torch.Tensor) -> torch.Tensor:
    """The head's logits through the target's (tied) lm_head."""
    return F.linear(head.norm(h), target.embed_tokens.weight)


def eagle_loss(
    head: EagleHead, target: TrainLlama, feature_weight: float
) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]:
    """EAGLE loss: CE of t_{p+1} (teacher-forced true features) + smooth-L1 of h_p to f_p.

    A second, self-fed pass (the head's own h_{p-1} as the feature, as at draft step 2+) adds
    the same loss, so the chain does not drift after its first step.
    """

    def loss_fn(window: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        ids, labels = window[:, :-1], window[:, 1:]
        with torch.no_grad():
            _, features = target(ids)
            embeds = target.embed_tokens(ids)
        scale = features.std()
        parts: dict[str, float] = {}
        total = torch.zeros(())
        inputs = shifted(features)
        for unroll in range(2):
            h = head(embeds, inputs)
            logits = eagle_logits(head, target, h)
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            reg = F.smooth_l1_loss(h / scale, features / scale)
            total = total + ce + feature_weight * reg
            parts |= {f"ce{unroll}": float(ce.detach()), f"reg{unroll}": float(reg.detach())}
            inputs = shifted(h)
        return total / 2, parts

    return loss_fn


# --------------------------------------------------------------------------- evaluation


def heldout_loss(model: TrainLlama, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-byte cross-entropy (nats/byte) over non-overlapping held-out windows."""
    num = min(max_windows, (stream.numel() - 1) // seq_len)
    windows = torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(num)])
    total = 0.0
    with torch.no_grad():
        for chunk in torch.split(windows, 16):
            logits, _ = model(chunk[:, :-1])
            ce = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
            total += float(ce)
    return total / (num * seq_len)


def eval_prompts(corpus: Corpus, num: int, length: int) -> torch.Tensor:
    """``[num, length]`` held-out code prompts, one per file, taken from the middle of the file."""
    docs = [d for d in corpus.heldout_docs if d.numel() >= 2 * length]
    step = max(1, len(docs) // num)
    picked = docs[::step][:num]
    return torch.stack([d[d.numel() // 2 - length : d.numel() // 2] for d in picked])


def greedy_continue(target: TrainLlama, prompts: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The target's greedy continuation: returns ``[B, prompt + num_tokens]``."""
    seq = prompts
    with torch.no_grad():
        for _ in range(num_tokens):
            logits, _ = target(seq)
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


@attrs.frozen(kw_only=True)
class Acceptance:
    """Offline greedy chain acceptance of one drafter against the target's greedy tokens."""

    mean_accept_length: float  # 1 + mean leading matches (the bonus token counts)
    step_rates: tuple[float, ...]  # P(draft tokens 1..k all match), k = 1..K
    num_positions: int


def measure(matched: list[torch.Tensor], num_steps: int) -> Acceptance:
    """Aggregates per-position leading-match counts."""
    counts = torch.cat(matched).float()
    rates = tuple(float((counts >= k).float().mean()) for k in range(1, num_steps + 1))
    return Acceptance(
        mean_accept_length=1 + float(counts.mean()), step_rates=rates, num_positions=counts.numel()
    )


def leading_matches(drafts: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` drafts vs truth -> ``[B]`` number of leading equal tokens."""
    return (drafts == truth).long().cumprod(dim=1).sum(dim=1)


def draft_acceptance(
    draft: TrainLlama, seq: torch.Tensor, prompt_len: int, num_steps: int
) -> Acceptance:
    """At each position of the greedy continuation: the drafter's K-token chain vs the target."""
    matched = []
    with torch.no_grad():
        for p in range(prompt_len - 1, seq.shape[1] - num_steps):
            chain = seq[:, : p + 1]
            for _ in range(num_steps):
                logits, _ = draft(chain)
                chain = torch.cat([chain, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            matched.append(leading_matches(chain[:, p + 1 :], seq[:, p + 1 : p + 1 + num_steps]))
    return measure(matched, num_steps)


def eagle_acceptance(
    head: EagleHead, target: TrainLlama, seq: torch.Tensor, prompt_len: int, num_steps: int
) -> Acceptance:
    """EAGLE chains: start from the true features f_{<p}, then feed the head's own h forward."""
    matched = []
    with torch.no_grad():
        _, features = target(seq)
        for p in range(prompt_len - 1, seq.shape[1] - num_steps):
            tokens, inputs = seq[:, : p + 1], shifted(features[:, : p + 1])
            drafted = []
            for _ in range(num_steps):
                h = head(target.embed_tokens(tokens), inputs)
                token = eagle_logits(head, target, h[:, -1:]).argmax(-1)
                drafted.append(token)
                tokens = torch.cat([tokens, token], dim=1)
                inputs = torch.cat([inputs, h[:, -1:]], dim=1)
            chain = torch.cat(drafted, dim=1)
            matched.append(leading_matches(chain, seq[:, p + 1 : p + 1 + num_steps]))
    return measure(matched, num_steps)


# --------------------------------------------------------------------------- checkpoints


def llama_config(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> ModelConfig:
    """A byte-level tied-embedding Llama config, stored in the ship dtype."""
    return ModelConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        dtype=SHIP_DTYPE,
    )


def save_llama(model: TrainLlama, directory: Path) -> None:
    """Writes a HF Llama checkpoint through the repo's own `save_paged_llama`."""
    paged = PagedLlama(model.config, num_token_slots=2)
    paged.load_state_dict(model.state_dict(), strict=True)
    save_paged_llama(paged, directory)  # world-readable files: shipped package data


def save_eagle(head: EagleHead, directory: Path) -> None:
    """Writes the EAGLE head: ``config.json`` (``specstate_eagle``) and ``model.safetensors``."""
    config = head.config
    directory.mkdir(parents=True, exist_ok=True)
    raw = {
        "model_type": "specstate_eagle",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "dtype": str(SHIP_DTYPE).removeprefix("torch."),
    }
    (directory / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    tensors = {
        name: t.detach().to(SHIP_DTYPE).contiguous() for name, t in head.state_dict().items()
    }
    write_safetensors(tensors, directory / "model.safetensors")


def paged_logits(model: PagedLlama, ids: torch.Tensor) -> torch.Tensor:
    """Prefill logits ``[T, vocab]`` of one sequence through the paged model."""
    n = ids.numel()
    table = torch.zeros(2, n, dtype=torch.int64)
    table[1] = torch.arange(1, n + 1)
    batch = AttentionBatch(
        input_ids=ids,
        positions=torch.arange(n),
        out_cache_loc=table[1],
        req_pool_indices=torch.tensor([1]),
        req_to_token=table,
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([n]),
    )
    logits: torch.Tensor = model(batch).logits
    return logits


def verify_target(directory: Path, trained: TrainLlama, ids: torch.Tensor) -> float:
    """Loads the shipped target with transformers and `load_paged_llama`; returns max |dlogit|."""
    from transformers import LlamaForCausalLM  # the oracle; only needed here

    paged = load_paged_llama(directory, num_token_slots=ids.numel() + 1, dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        hf_logits: torch.Tensor = hf(ids[None]).logits[0].float()
        ours, _ = trained(ids[None])
    ours_paged = paged_logits(paged, ids)
    worst = max(
        float((hf_logits - ours_paged).abs().max()), float((ours[0] - ours_paged).abs().max())
    )
    if worst > 1e-3:
        raise SystemExit(f"{directory}: transformers and load_paged_llama disagree by {worst}")
    return worst


# --------------------------------------------------------------------------- report


def render_report(results: Results, total_seconds: float, argv: list[str]) -> str:
    """REPORT.md: the recipe, the environment and every measured number."""
    args, corpus = results.args, results.corpus
    tokens_per_step = args.batch_size * args.seq_len
    steps = {"target": args.target_steps, "draft": args.draft_steps, "eagle": args.eagle_steps}
    command = " ".join(["python scripts/train_embedded.py", *argv])
    lines = [
        "# Embedded models: training report",
        "",
        "Written by `scripts/train_embedded.py`; every number below comes from that run.",
        "",
        f"- command: `{command}`",
        f"- environment: Python {platform.python_version()}, torch {torch.__version__},"
        f" {args.threads} threads, seed {args.seed}; total wall time {total_seconds / 60:.1f} min",
        f"- corpus: the stdlib `*.py` sources of that Python; {corpus.num_train_files} train files"
        f" ({corpus.train.numel():,} tokens), {corpus.num_heldout_files} held-out files"
        f" ({corpus.heldout.numel():,} tokens), split by SHA-256 of the relative path",
        "",
        "| model | shape | parameters | steps x tokens | train time | held-out nats/byte | file |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft", "eagle"):
        c = results.configs[name]
        shape = (
            f"hidden {c.hidden_size}, {c.num_hidden_layers if name != 'eagle' else 1} layer(s),"
            f" {c.num_attention_heads}/{c.num_key_value_heads} heads, ffn {c.intermediate_size}"
        )
        loss = f"{results.losses[name]:.3f}" if name in results.losses else "-"
        lines.append(
            f"| {name} | {shape} | {results.params[name]:,} | {steps[name]} x {tokens_per_step}"
            f" | {results.seconds[name] / 60:.1f} min | {loss}"
            f" | {results.sizes[name] / 1e6:.2f} MB |"
        )
    k = args.num_draft_steps
    lines += [
        "",
        f"Shipped size: {sum(results.sizes.values()) / 1e6:.2f} MB of fp16 safetensors"
        " (the EAGLE head's parameters exclude the target's embedding / lm_head it reuses).",
        f"Held-out loss: mean next-byte cross-entropy over {args.eval_windows} non-overlapping"
        f" {args.seq_len}-byte windows.",
        "",
        "## Offline greedy acceptance",
        "",
        f"{args.eval_prompts} held-out prompts of {args.eval_prompt_len} bytes; the target's greedy"
        f" continuation of {args.eval_new_tokens} bytes; at every position of it each drafter"
        f" proposes a greedy chain of K = {k} tokens (EAGLE: starting from the target's true"
        " features, then its own h as the next feature).",
        "Accept length = 1 + the number of leading chain tokens equal to the target's.",
        "",
        "| drafter | positions | mean accept length | "
        + " | ".join(f"P(>= {i})" for i in range(1, k + 1))
        + " |",
        "|---|---|---|" + "---|" * k,
    ]
    for name, acc in results.acceptance.items():
        rates = " | ".join(f"{r:.2f}" for r in acc.step_rates)
        lines.append(f"| {name} | {acc.num_positions} | {acc.mean_accept_length:.2f} | {rates} |")
    lines += [
        "",
        "Target logits, transformers vs `load_paged_llama` (float32): max |difference|"
        f" {results.logit_gap:.2e}.",
        "",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where target/ draft/ eagle/ go"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (fixed: reproducible)"
    )
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--draft-steps", type=int, default=800)
    parser.add_argument("--eagle-steps", type=int, default=800)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--max-train-mb", type=float, default=8.0)
    parser.add_argument("--max-heldout-mb", type=float, default=0.5)
    parser.add_argument("--eval-windows", type=int, default=64, help="held-out loss windows")
    parser.add_argument("--eval-prompts", type=int, default=16)
    parser.add_argument("--eval-prompt-len", type=int, default=128)
    parser.add_argument("--eval-new-tokens", type=int, default=64)
    parser.add_argument("--num-draft-steps", type=int, default=4, help="K for acceptance")
    parser.add_argument("--log-every", type=int, default=50)
    return parser.parse_args(argv)


@attrs.frozen(kw_only=True)
class Results:
    """Everything REPORT.md states."""

    args: argparse.Namespace
    corpus: Corpus
    params: dict[str, int]
    seconds: dict[str, float]
    losses: dict[str, float]
    acceptance: dict[str, Acceptance]
    logit_gap: float
    sizes: dict[str, int]
    configs: dict[str, ModelConfig]


def train_all(args: argparse.Namespace, corpus: Corpus) -> Results:
    """Trains, evaluates and saves the three models."""
    out: Path = args.out
    data = batches(corpus.train, args.batch_size, args.seq_len, args.seed)
    configs = {"target": llama_config(256, 512, 4, 4, 2), "draft": llama_config(192, 512, 1, 4, 2)}
    seconds: dict[str, float] = {}
    target = TrainLlama(configs["target"])
    schedule = Schedule(steps=args.target_steps, lr=3e-3)
    seconds["target"] = run_training(
        "target", target, schedule, data, lm_loss(target), args.log_every
    )
    round_to_ship_dtype(target)
    target.requires_grad_(False)
    draft = TrainLlama(configs["draft"])
    schedule = Schedule(steps=args.draft_steps, lr=4e-3)
    loss = distill_loss(draft, target, kl_weight=0.5)
    seconds["draft"] = run_training("draft", draft, schedule, data, loss, args.log_every)
    round_to_ship_dtype(draft)
    configs["eagle"] = configs["target"]
    head = EagleHead(configs["eagle"], target.norm.weight.detach())
    schedule = Schedule(steps=args.eagle_steps, lr=2e-3)
    loss = eagle_loss(head, target, feature_weight=0.5)
    seconds["eagle"] = run_training("eagle", head, schedule, data, loss, args.log_every)
    round_to_ship_dtype(head)

    log("evaluating")
    windows = args.eval_windows
    losses = {
        name: heldout_loss(model, corpus.heldout, args.seq_len, windows)
        for name, model in (("target", target), ("draft", draft))
    }
    prompts = eval_prompts(corpus, args.eval_prompts, args.eval_prompt_len)
    seq = greedy_continue(target, prompts, args.eval_new_tokens)
    k, plen = args.num_draft_steps, args.eval_prompt_len
    acceptance = {
        "draft": draft_acceptance(draft, seq, plen, k),
        "eagle": eagle_acceptance(head, target, seq, plen, k),
    }
    save_llama(target, out / "target")
    save_llama(draft, out / "draft")
    save_eagle(head, out / "eagle")
    gap = verify_target(out / "target", target, prompts[0])
    return Results(
        args=args,
        corpus=corpus,
        params={
            "target": count_params(target),
            "draft": count_params(draft),
            "eagle": count_params(head),
        },
        seconds=seconds,
        losses=losses,
        acceptance=acceptance,
        logit_gap=gap,
        sizes={
            n: (out / n / "model.safetensors").stat().st_size for n in ("target", "draft", "eagle")
        },
        configs=configs,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    corpus = read_corpus(int(args.max_train_mb * 1e6), int(args.max_heldout_mb * 1e6))
    log(
        f"corpus: {corpus.num_train_files} train files ({corpus.train.numel()} tokens),"
        f" {corpus.num_heldout_files} held out ({corpus.heldout.numel()} tokens)"
    )
    results = train_all(args, corpus)
    total = time.perf_counter() - started
    report = render_report(results, total, argv if argv is not None else sys.argv[1:])
    (args.out / "REPORT.md").write_text(report, encoding="utf-8")
    log(f"done in {total / 60:.1f} min\n{report}")


if __name__ == "__main__":
    main()
