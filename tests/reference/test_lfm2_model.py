"""The reference LFM2 model equals transformers' Lfm2ForCausalLM, block by block, token by token."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from hf_oracle import greedy
from lfm2_oracle import make_lfm2_checkpoint
from transformers import Lfm2ForCausalLM

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.hybrid import (
    Lfm2LayerKind,
    PagedLfm2,
    is_hybrid_checkpoint,
    load_paged_hybrid,
    read_hybrid_config,
    save_paged_hybrid,
)
from specstate.reference.model import AttentionBatch

PROMPT = [3, 14, 15, 92, 65, 35, 89, 4, 4, 7]
LAYOUT = RecurrentLayout(rows_per_request=5, num_request_slots=4)
TOL = 2e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Lfm2ForCausalLM]:
    """A tiny LFM2 (conv, attention, conv, conv; tied head) saved by transformers."""
    root = tmp_path_factory.mktemp("lfm2_model")
    return root, make_lfm2_checkpoint(root)


class _Rows:
    """A request table with shuffled token slots, driving extends of one or two requests."""

    def __init__(self, model: PagedLfm2, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model = model
        self.table = torch.zeros(4, 64, dtype=torch.int64)
        slots = torch.randperm(255, generator=gen)[:128] + 1
        self.table[1], self.table[2] = slots[:64], slots[64:]

    def extend(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """One forward of ``(slot, tokens, prefix)`` rows; the logits of every token."""
        ids = torch.tensor([t for _, toks, _ in chunks for t in toks])
        positions = torch.cat([torch.arange(p, p + len(t)) for _, t, p in chunks])
        locs = torch.cat([self.table[s, p : p + len(t)] for s, t, p in chunks])
        batch = AttentionBatch(
            input_ids=ids,
            positions=positions,
            out_cache_loc=locs,
            req_pool_indices=torch.tensor([s for s, _, _ in chunks]),
            req_to_token=self.table,
            prefix_lens=torch.tensor([p for _, _, p in chunks]),
            extend_lens=torch.tensor([len(t) for _, t, _ in chunks]),
        )
        logits: torch.Tensor = self.model(batch).logits
        return logits


def _hf_logits(hf: Lfm2ForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([tokens])).logits[0]
    return logits


def _load(root: Path, layout: RecurrentLayout | None = LAYOUT) -> PagedLfm2:
    model = load_paged_hybrid(root, num_token_slots=256, layout=layout)
    assert isinstance(model, PagedLfm2)
    return model


def test_every_block_matches_transformers(ckpt: tuple[Path, Lfm2ForCausalLM]) -> None:
    """Each block's output (short conv and attention, each with its MLP) equals transformers'."""
    root, hf = ckpt
    model = _load(root)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda _m, _i, out: outs.append(out)) for b in model.blocks]
    try:
        _Rows(model).extend([(1, PROMPT, 0)])
    finally:
        for hook in hooks:
            hook.remove()
    kinds = [b.kind for b in model.blocks]
    assert kinds == [Lfm2LayerKind.CONV, Lfm2LayerKind.ATTENTION, *[Lfm2LayerKind.CONV] * 2]
    # transformers records the last block's output after the final norm.
    last = len(outs) - 1
    for i, out in enumerate(outs[:last]):
        assert (out - want[i + 1][0]).abs().max() < TOL, f"block {i} ({kinds[i].value})"
    with torch.no_grad():
        final = model.embedding_norm(outs[last])
    assert (final - want[-1][0]).abs().max() < TOL


def test_whole_model_logits_match(ckpt: tuple[Path, Lfm2ForCausalLM]) -> None:
    """The logits of a whole prompt equal transformers' full forward."""
    root, hf = ckpt
    ours = _Rows(_load(root)).extend([(1, PROMPT, 0)])
    assert (ours - _hf_logits(hf, PROMPT)).abs().max() < TOL


@pytest.mark.parametrize("cuts", [(1, 2), (4, 7), (3, 5, 9)])
def test_chunks_carry_the_state(ckpt: tuple[Path, Lfm2ForCausalLM], cuts: tuple[int, ...]) -> None:
    """A prompt prefilled in chunks (some shorter than the kernel) has the whole prompt's logits."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    bounds = [0, *cuts, len(PROMPT)]
    got = [rows.extend([(1, PROMPT[a:b], a)]) for a, b in itertools.pairwise(bounds)]
    assert (torch.cat(got) - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_one_token_extends_equal_greedy_generate(ckpt: tuple[Path, Lfm2ForCausalLM]) -> None:
    """A prefill, then one-token extends, emits transformers' greedy ``generate()`` tokens."""
    root, hf = ckpt
    want = greedy(hf, PROMPT, 12)
    rows = _Rows(_load(root))
    token = int(rows.extend([(1, PROMPT, 0)])[-1].argmax())
    got = [token]
    for pos in range(len(PROMPT), len(PROMPT) + 11):
        logits = rows.extend([(1, [token], pos)])
        assert (logits - _hf_logits(hf, PROMPT + got)[-1:]).abs().max() < TOL
        token = int(logits[-1].argmax())
        got.append(token)
    assert got == want


@pytest.mark.parametrize("accept", [1, 2, 4])
def test_a_chain_leaves_the_checkpoint_of_every_accept_length(
    ckpt: tuple[Path, Lfm2ForCausalLM], accept: int
) -> None:
    """After a 4-token chain at S, continuing from S + a reads the state after exactly a tokens."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    head = PROMPT[:6]
    rows.extend([(1, head, 0)])
    chain = [11, 12, 13, 14]
    rows.extend([(1, chain, 6)])  # a verify: writes the checkpoints at row(7) .. row(10)
    nxt = [50, 51]
    ours = rows.extend([(1, nxt, 6 + accept)])  # continues from row(6 + a)
    want = _hf_logits(hf, head + chain[:accept] + nxt)[-2:]
    assert (ours - want).abs().max() < TOL


def test_rows_of_two_requests_do_not_mix(ckpt: tuple[Path, Lfm2ForCausalLM]) -> None:
    """Two requests of different lengths in one batch, then decoding together, stay separate."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    a, b = PROMPT, [8, 9, 10]
    first = rows.extend([(1, a, 0), (2, b, 0)])
    assert (first[: len(a)] - _hf_logits(hf, a)).abs().max() < TOL
    assert (first[len(a) :] - _hf_logits(hf, b)).abs().max() < TOL
    both = rows.extend([(1, [5, 6], len(a)), (2, [7], len(b))])
    assert (both[:2] - _hf_logits(hf, [*a, 5, 6])[-2:]).abs().max() < TOL
    assert (both[2:] - _hf_logits(hf, [*b, 7])[-1:]).abs().max() < TOL


def test_a_fresh_prefill_ignores_what_its_rows_held(ckpt: tuple[Path, Lfm2ForCausalLM]) -> None:
    """A prefix of 0 starts from the zero state, whatever a previous holder left (even NaN)."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    rows.extend([(1, [90, 91, 92, 93, 94], 0)])
    states = rows.model.states
    assert states is not None and states.num_layers == 3
    slot_rows = LAYOUT.rows(torch.tensor(1), torch.arange(LAYOUT.rows_per_request))
    (conv,) = states.read(0, slot_rows)
    states.write(0, slot_rows, torch.full_like(conv, float("nan")))
    assert (rows.extend([(1, PROMPT, 0)]) - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_an_untied_attention_only_model_needs_no_layout(tmp_path: Path) -> None:
    """Without convolution layers no state layout is needed; an untied head loads its own."""
    hf = make_lfm2_checkpoint(
        tmp_path, layer_types=("full_attention", "full_attention"), tie_word_embeddings=False
    )
    model = _load(tmp_path, layout=None)
    assert model.states is None and not model.config.tie_word_embeddings
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)
    assert (_Rows(model).extend([(1, PROMPT, 0)]) - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_a_model_with_state_needs_a_layout(ckpt: tuple[Path, Lfm2ForCausalLM]) -> None:
    """Short-convolution layers without a state layout are refused at construction."""
    assert is_hybrid_checkpoint(ckpt[0])
    with pytest.raises(InvalidConfig, match="3 short-convolution layers needs a recurrent state"):
        load_paged_hybrid(ckpt[0], num_token_slots=64, layout=None)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"layer_types": ["conv", "sliding_attention"]}, "unsupported layers \\['sliding_atte"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "must be default RoPE"),
        ({"num_key_value_heads": 3}, "by num_key_value_heads 3"),
        ({"head_dim": 16}, "'head_dim' must be hidden_size // num_attention_heads"),
    ],
)
def test_unsupported_configs_are_refused(
    ckpt: tuple[Path, Lfm2ForCausalLM], tmp_path: Path, edit: dict[str, object], match: str
) -> None:
    """A config the model would compute wrong is refused, naming the file and field."""
    raw = json.loads((ckpt[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | edit))
    with pytest.raises(InvalidConfig, match=match):
        read_hybrid_config(tmp_path)


def test_a_missing_weight_is_refused(ckpt: tuple[Path, Lfm2ForCausalLM], tmp_path: Path) -> None:
    """A checkpoint without a short convolution's kernel names the missing tensor."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt[0] / "model.safetensors"))
    del tensors["model.layers.2.conv.conv.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((ckpt[0] / "config.json").read_text())
    with pytest.raises(InvalidConfig, match="missing tensor 'model.layers.2.conv.conv.weight'"):
        load_paged_hybrid(tmp_path, num_token_slots=64, layout=LAYOUT)


def test_attention_indices_give_the_layer_types(
    ckpt: tuple[Path, Lfm2ForCausalLM], tmp_path: Path
) -> None:
    """A config with ``full_attn_idxs`` and no ``layer_types`` reads the same layers."""
    raw = json.loads((ckpt[0] / "config.json").read_text())
    del raw["layer_types"]
    (tmp_path / "config.json").write_text(json.dumps(raw | {"full_attn_idxs": [1]}))
    assert read_hybrid_config(tmp_path) == read_hybrid_config(ckpt[0])


@pytest.mark.parametrize("tied", [True, False])
def test_save_and_load_round_trip(tmp_path: Path, tied: bool) -> None:
    """A saved `PagedLfm2` loads in transformers with the same weights and logits (a tied head
    stays tied, an untied one keeps its own), and back into ours with the same config."""
    hf = make_lfm2_checkpoint(tmp_path / "src", tie_word_embeddings=tied)
    save_paged_hybrid(_load(tmp_path / "src"), tmp_path / "out")
    again = Lfm2ForCausalLM.from_pretrained(tmp_path / "out")
    again.train(False)
    mine, theirs = again.state_dict(), hf.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert (_hf_logits(again, PROMPT) - _hf_logits(hf, PROMPT)).abs().max() < TOL
    assert read_hybrid_config(tmp_path / "out") == read_hybrid_config(tmp_path / "src")
    raw = json.loads((tmp_path / "out" / "config.json").read_text())
    assert raw["tie_word_embeddings"] is tied
