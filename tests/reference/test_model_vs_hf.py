"""PagedLlama against transformers' LlamaForCausalLM: every extend shape over paged KV tables."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.model import AttentionBatch, ModelOutput, PagedLlama

ATOL = 1e-4
ROW_WIDTH = 48
NUM_SLOTS = 512

# Config overrides: GQA, MHA, and GQA with head_dim 24 != hidden/heads and a non-default theta.
CONFIGS: dict[str, dict[str, Any]] = {
    "gqa": {"num_attention_heads": 4, "num_key_value_heads": 2},
    "mha": {"num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 48},
    "head_dim_24": {"num_key_value_heads": 2, "head_dim": 24, "rope_theta": 500000.0},
}


def make_hf(tmp_path: Path, **overrides: Any) -> LlamaForCausalLM:
    """Saves a random tiny HF Llama (norm weights perturbed too) to ``tmp_path``; returns it."""
    fields: dict[str, Any] = {
        "vocab_size": 131,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "initializer_range": 0.1,
    }
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**(fields | overrides)))
    hf.train(False)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    hf.save_pretrained(tmp_path)
    return hf


def hf_logits(hf: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Full-sequence logits ``[len(ids), vocab]`` from transformers (the oracle)."""
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([ids])).logits[0].float()
    return logits


def make_table(num_rows: int, page_size: int, seed: int) -> torch.Tensor:
    """A req_to_token table whose rows hold shuffled pages of scattered slots; row 0 is padding."""
    gen = random.Random(seed)
    pages_per_row = ROW_WIDTH // page_size
    pages = list(range(1, NUM_SLOTS // page_size))  # page 0 holds padding slot 0: never used
    gen.shuffle(pages)
    table = torch.zeros(num_rows, ROW_WIDTH, dtype=torch.int64)
    for row in range(1, num_rows):
        chosen = pages[(row - 1) * pages_per_row : row * pages_per_row]
        slots = [p * page_size + k for p in chosen for k in range(page_size)]
        table[row] = torch.tensor(slots)
    return table


def extend(
    model: PagedLlama,
    table: torch.Tensor,
    parts: list[tuple[int, int, list[int]]],
    logit_rows: torch.Tensor | None = None,
) -> ModelOutput:
    """Runs one forward over ``(req_pool_index, prefix_len, new_ids)`` parts, packed in order.

    ``out_cache_loc`` comes from the table, as the scheduler would compute it; a padding part
    ``(0, 0, [t])`` writes and reads padding slot 0.
    """
    ids: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    for row, prefix, new in parts:
        ids += new
        positions += range(prefix, prefix + len(new))
        locs += table[row, prefix : prefix + len(new)].tolist()
    batch = AttentionBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(positions),
        out_cache_loc=torch.tensor(locs),
        req_pool_indices=torch.tensor([p[0] for p in parts]),
        req_to_token=table,
        prefix_lens=torch.tensor([p[1] for p in parts]),
        extend_lens=torch.tensor([len(p[2]) for p in parts]),
    )
    out: ModelOutput = model(batch, logit_rows=logit_rows)
    return out


def split_rows(logits: torch.Tensor, parts: list[tuple[int, int, list[int]]]) -> list[torch.Tensor]:
    """Splits packed ``[T, V]`` logits back into one tensor per part."""
    return list(torch.split(logits, [len(p[2]) for p in parts]))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """Asserts max |ours - ref| <= ATOL, reporting the measured difference."""
    diff = (ours - ref).abs().max().item()
    assert diff <= ATOL, f"max abs logit diff {diff:.3g} > {ATOL}"


def random_ids(gen: random.Random, n: int, vocab: int = 131) -> list[int]:
    """``n`` random token ids."""
    return [gen.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=list(CONFIGS))
def test_packed_prefill_matches_hf(tmp_path: Path, overrides: dict[str, Any]) -> None:
    """Three prompts of different lengths packed into one prefill give HF's logits."""
    hf = make_hf(tmp_path, **overrides)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    gen = random.Random(1)
    prompts = [random_ids(gen, n) for n in (5, 11, 2)]
    table = make_table(4, 1, seed=2)
    parts = [(row, 0, prompt) for row, prompt in zip((3, 1, 2), prompts, strict=True)]
    for ours, prompt in zip(
        split_rows(extend(model, table, parts).logits, parts), prompts, strict=True
    ):
        assert_close(ours, hf_logits(hf, prompt))


def test_chunked_prefill_then_decode_matches_hf(tmp_path: Path) -> None:
    """Chunks of 3, 1-token extends, then decode steps reproduce HF's full-sequence logits."""
    hf = make_hf(tmp_path)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    gen = random.Random(3)
    seqs = {1: random_ids(gen, 14), 2: random_ids(gen, 10)}
    # Request 1: chunks [3, 3, 1, 1] then decodes; request 2 joins later with chunks of 3.
    schedule = [{1: 3}, {1: 3}, {1: 1, 2: 3}, {1: 1, 2: 3}, {1: 1, 2: 3}, {1: 1, 2: 1}, {1: 1}]
    schedule += [{1: 1, 2: 0}] * 3
    table, done = make_table(3, 1, seed=4), {1: 0, 2: 0}
    got: dict[int, list[torch.Tensor]] = {1: [], 2: []}
    for step in schedule:
        parts = [(r, done[r], seqs[r][done[r] : done[r] + n]) for r, n in step.items() if n]
        for (row, _, new), rows in zip(
            parts, split_rows(extend(model, table, parts).logits, parts), strict=True
        ):
            got[row].append(rows)
            done[row] += len(new)
    for row, seq in seqs.items():
        assert_close(torch.cat(got[row]), hf_logits(hf, seq[: done[row]]))
    assert done == {1: 14, 2: 10}


def test_target_verify_chain_matches_hf(tmp_path: Path) -> None:
    """A chain of D=4 drafts verified in one forward, beside a decode, gives HF's 4 rows."""
    hf = make_hf(tmp_path, **CONFIGS["head_dim_24"])
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    gen = random.Random(5)
    target, other = random_ids(gen, 13), random_ids(gen, 8)
    table = make_table(3, 16, seed=6)
    extend(model, table, [(2, 0, target[:9]), (1, 0, other[:7])])
    parts = [(1, 7, other[7:8]), (2, 9, target[9:13])]
    decode_rows, verify_rows = split_rows(extend(model, table, parts).logits, parts)
    assert_close(verify_rows, hf_logits(hf, target)[9:13])
    assert_close(decode_rows, hf_logits(hf, other)[7:8])


@pytest.mark.parametrize("page_size", [1, 16])
def test_scattered_slots_and_padding_rows_match_hf(tmp_path: Path, page_size: int) -> None:
    """Shuffled slot layouts with padding rows mixed in (slot 0) leave real rows exact."""
    hf = make_hf(tmp_path, **CONFIGS["mha"])
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    gen = random.Random(page_size)
    seqs = {row: random_ids(gen, 20) for row in (1, 2, 3)}
    table = make_table(4, page_size, seed=7 + page_size)
    pad = (0, 0, [5])
    steps = [
        [pad, (2, 0, seqs[2][:6]), pad, (1, 0, seqs[1][:17]), (3, 0, seqs[3][:1])],
        [(3, 1, seqs[3][1:17]), pad, (1, 17, seqs[1][17:18]), (2, 6, seqs[2][6:20])],
        [(1, 18, seqs[1][18:20]), pad, pad, (3, 17, seqs[3][17:20])],
    ]
    got: dict[int, list[torch.Tensor]] = {1: [], 2: [], 3: []}
    for parts in steps:
        for (row, _, _), rows in zip(
            parts, split_rows(extend(model, table, parts).logits, parts), strict=True
        ):
            if row:
                got[row].append(rows)
    for row, seq in seqs.items():
        assert_close(torch.cat(got[row]), hf_logits(hf, seq))


def test_corrupted_req_to_token_changes_logits(tmp_path: Path) -> None:
    """A stale prefix slot or a prefix entry swapped with an unwritten one changes the logits."""
    hf = make_hf(tmp_path)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    gen = random.Random(8)
    seq, other = random_ids(gen, 12), random_ids(gen, 10)
    table = make_table(3, 1, seed=9)
    extend(model, table, [(1, 0, seq[:8]), (2, 0, other)])
    verify = [(1, 8, seq[8:12])]
    expected = hf_logits(hf, seq)[8:12]
    assert_close(extend(model, table, verify).logits, expected)
    stale = table.clone()
    stale[1, 3] = table[2, 3]  # prefix entry 3 points at another request's KV
    swapped = table.clone()
    swapped[1, [2, 30]] = table[1, [30, 2]]  # prefix entry 2 <-> an unwritten slot
    for corrupted in (stale, swapped):
        diff = (extend(model, corrupted, verify).logits - expected).abs().max().item()
        assert diff > 1e-2, f"corruption went unnoticed (max diff {diff:.3g})"
        assert_close(extend(model, table, verify).logits, expected)


def test_tied_embeddings_match_hf(tmp_path: Path) -> None:
    """A tied-embedding checkpoint (no lm_head.weight) gives HF's logits."""
    hf = make_hf(tmp_path, tie_word_embeddings=True)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    assert model.lm_head is None
    ids = random_ids(random.Random(10), 9)
    table = make_table(2, 1, seed=11)
    assert_close(extend(model, table, [(1, 0, ids)]).logits, hf_logits(hf, ids))


def test_hidden_states_are_last_layer_output_before_final_norm(tmp_path: Path) -> None:
    """hidden_states equal the last decoder layer's output, before model.norm."""
    hf = make_hf(tmp_path)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    ids = random_ids(random.Random(12), 7)
    captured: list[torch.Tensor] = []

    def capture(module: torch.nn.Module, args: object, output: object) -> None:
        captured.append(output[0] if isinstance(output, tuple) else output)  # type: ignore[arg-type]

    handle = hf.model.layers[-1].register_forward_hook(capture)
    try:
        hf_logits(hf, ids)
    finally:
        handle.remove()
    out = extend(model, make_table(2, 1, seed=13), [(1, 0, ids)])
    assert out.hidden_states.shape == (7, 32)
    assert_close(out.hidden_states, captured[0].reshape(7, 32))


def test_logit_rows_select_rows_and_keep_all_hidden_states(tmp_path: Path) -> None:
    """logit_rows returns only those rows' logits; hidden states still cover every token."""
    hf = make_hf(tmp_path)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    gen = random.Random(14)
    a, b = random_ids(gen, 6), random_ids(gen, 4)
    table = make_table(3, 1, seed=15)
    out = extend(model, table, [(1, 0, a), (2, 0, b)], logit_rows=torch.tensor([5, 9]))
    assert out.logits.shape == (2, 131)
    assert out.logits.dtype == torch.float32
    assert out.hidden_states.shape == (10, 32)
    assert_close(out.logits, torch.stack([hf_logits(hf, a)[5], hf_logits(hf, b)[3]]))


def test_forward_rejects_inconsistent_batches(tmp_path: Path) -> None:
    """Batches inconsistent with the tokens or tables, or a one-slot cache, raise InvalidConfig."""
    make_hf(tmp_path)
    model = load_paged_llama(tmp_path, num_token_slots=NUM_SLOTS)
    table = make_table(2, 1, seed=16)
    fields: dict[str, torch.Tensor] = {
        "input_ids": torch.tensor([1, 2, 3]),
        "positions": torch.tensor([0, 1, 2]),
        "out_cache_loc": table[1, :3],
        "req_pool_indices": torch.tensor([1]),
        "req_to_token": table,
        "prefix_lens": torch.tensor([0]),
        "extend_lens": torch.tensor([3]),
    }
    bad = [
        ({"extend_lens": torch.tensor([2])}, r"extend_lens \[2\].*sum to the 3 new tokens"),
        ({"prefix_lens": torch.tensor([46])}, r"reach 49, past req_to_token row width 48"),
        ({"req_pool_indices": torch.tensor([2])}, r"req_pool_indices \[2\] outside 2"),
        ({"out_cache_loc": torch.tensor([1, 2, 999])}, r"out_cache_loc has a slot outside"),
    ]
    for change, match in bad:
        with pytest.raises(InvalidConfig, match=match):
            model(AttentionBatch(**(fields | change)))
    with pytest.raises(InvalidConfig, match=r"num_token_slots must be >= 2 \(slot 0 is padding\)"):
        load_paged_llama(tmp_path, num_token_slots=1)
    with pytest.raises(InvalidConfig, match=r"positions, out_cache_loc must be equal 1-D"):
        AttentionBatch(**(fields | {"positions": torch.tensor([0, 1])}))
