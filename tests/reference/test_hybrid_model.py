"""The reference hybrid model equals transformers' NemotronH, layer by layer and token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hybrid_oracle import make_hybrid_checkpoint
from transformers import NemotronHForCausalLM

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.hybrid import (
    LayerKind,
    PagedHybrid,
    load_paged_hybrid,
    read_hybrid_config,
    save_paged_hybrid,
)
from specstate.reference.model import AttentionBatch

PROMPT = [3, 14, 15, 92, 65, 35, 89, 4, 4, 7]
LAYOUT = RecurrentLayout(rows_per_request=5, num_request_slots=4)
TOL = 2e-5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, NemotronHForCausalLM]:
    """A tiny NemotronH (Mamba2, attention, MLP, Mamba2) saved by transformers."""
    root = tmp_path_factory.mktemp("hybrid_model")
    return root, make_hybrid_checkpoint(root)


class _Rows:
    """A request table with shuffled token slots, driving extends of one or two requests."""

    def __init__(self, model: PagedHybrid, seed: int = 0) -> None:
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


def _hf_logits(hf: NemotronHForCausalLM, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([tokens])).logits[0]
    return logits


def _load(root: Path, layout: RecurrentLayout | None = LAYOUT) -> PagedHybrid:
    model = load_paged_hybrid(root, num_token_slots=256, layout=layout)
    assert isinstance(model, PagedHybrid)  # a NemotronH checkpoint, not an LFM2
    return model


def _prefill(rows: _Rows, prompt: list[int]) -> torch.Tensor:
    return rows.extend([(1, prompt, 0)])


def test_every_block_matches_transformers(ckpt: tuple[Path, NemotronHForCausalLM]) -> None:
    """Each mixer's output (Mamba2, attention, MLP) equals transformers' on the same prompt."""
    root, hf = ckpt
    model = _load(root)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    outs: list[torch.Tensor] = []
    hooks = [
        b.mixer.register_forward_hook(lambda _m, _i, out: outs.append(out)) for b in model.blocks
    ]
    try:
        _prefill(_Rows(model), PROMPT)
    finally:
        for hook in hooks:
            hook.remove()
    kinds = [b.kind for b in model.blocks]
    assert kinds == [LayerKind.MAMBA, LayerKind.ATTENTION, LayerKind.MLP, LayerKind.MAMBA]
    # transformers records each block's output, except the last, which it records after the
    # final norm: the last block is compared through that norm.
    last = len(outs) - 1
    for i, out in enumerate(outs[:last]):
        mixer_want = want[i + 1][0] - want[i][0]
        assert (out - mixer_want).abs().max() < TOL, f"block {i} ({kinds[i].value})"
    with torch.no_grad():
        final = model.norm_f(want[last][0] + outs[last])
    assert (final - want[-1][0]).abs().max() < TOL, f"block {last} ({kinds[last].value})"


def test_whole_model_logits_match(ckpt: tuple[Path, NemotronHForCausalLM]) -> None:
    """The logits of a whole prompt equal transformers' full forward."""
    root, hf = ckpt
    ours = _prefill(_Rows(_load(root)), PROMPT)
    assert (ours - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_chunks_carry_the_state(ckpt: tuple[Path, NemotronHForCausalLM]) -> None:
    """A prompt in chunks of 3, 1 and 6 tokens gives the logits of one full forward."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    parts = [rows.extend([(1, PROMPT[:3], 0)]), rows.extend([(1, PROMPT[3:4], 3)])]
    parts.append(rows.extend([(1, PROMPT[4:], 4)]))
    assert (torch.cat(parts) - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_greedy_decode_matches_generate(ckpt: tuple[Path, NemotronHForCausalLM]) -> None:
    """Prefill then one-token extends reproduce transformers' greedy generate()."""
    root, hf = ckpt
    with torch.no_grad():
        ids = torch.tensor([PROMPT])
        gen = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=12,
            do_sample=False,
            pad_token_id=0,
        )
    want = gen[0, len(PROMPT) :].tolist()
    rows = _Rows(_load(root))
    token = int(_prefill(rows, PROMPT)[-1].argmax())
    got = [token]
    for pos in range(len(PROMPT), len(PROMPT) + 11):
        token = int(rows.extend([(1, [token], pos)])[-1].argmax())
        got.append(token)
    assert got == want


@pytest.mark.parametrize("accept", [1, 2, 4])
def test_a_chain_leaves_the_checkpoint_of_every_accept_length(
    ckpt: tuple[Path, NemotronHForCausalLM], accept: int
) -> None:
    """After a 4-token chain at S, continuing from S + a reads the state after exactly a tokens."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    head = PROMPT[:6]
    _prefill(rows, head)
    chain = [11, 12, 13, 14]
    rows.extend([(1, chain, 6)])  # a verify: writes the checkpoints at row(7) .. row(10)
    nxt = [50, 51]
    ours = rows.extend([(1, nxt, 6 + accept)])  # continues from row(6 + a)
    want = _hf_logits(hf, head + chain[:accept] + nxt)[-2:]
    assert (ours - want).abs().max() < TOL


def test_rows_of_two_requests_do_not_mix(ckpt: tuple[Path, NemotronHForCausalLM]) -> None:
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


def test_a_fresh_prefill_ignores_what_its_rows_held(
    ckpt: tuple[Path, NemotronHForCausalLM],
) -> None:
    """A prefix of 0 starts from the zero state, whatever a previous holder left (even NaN)."""
    root, hf = ckpt
    rows = _Rows(_load(root))
    _prefill(rows, [90, 91, 92, 93, 94])  # leaves states in every row of slot 1
    rows.extend([(1, [1, 2, 3, 4, 5], 5)])
    states = rows.model.states
    assert states is not None
    slot_rows = LAYOUT.rows(torch.tensor(1), torch.arange(LAYOUT.rows_per_request))
    conv, ssm = states.read(0, slot_rows)
    states.write(0, slot_rows, torch.full_like(conv, float("nan")), torch.full_like(ssm, 1e30))
    assert (_prefill(rows, PROMPT) - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_save_and_load_round_trip(ckpt: tuple[Path, NemotronHForCausalLM], tmp_path: Path) -> None:
    """A saved model loads in transformers with the same logits, and back into ours."""
    root, hf = ckpt
    save_paged_hybrid(_load(root), tmp_path)
    again = NemotronHForCausalLM.from_pretrained(tmp_path)
    mine, theirs = again.state_dict(), hf.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert read_hybrid_config(tmp_path) == read_hybrid_config(root)


def test_attention_only_model_needs_no_layout(tmp_path: Path) -> None:
    """A model with no Mamba2 layer needs no state layout; ``tie_word_embeddings`` is ignored
    (transformers' NemotronH always keeps its own lm_head)."""
    hf = make_hybrid_checkpoint(tmp_path, pattern="*-*", tie_word_embeddings=True)
    model = _load(tmp_path, layout=None)
    assert model.states is None
    assert (_prefill(_Rows(model), PROMPT) - _hf_logits(hf, PROMPT)).abs().max() < TOL


def test_a_model_with_state_needs_a_layout(ckpt: tuple[Path, NemotronHForCausalLM]) -> None:
    """Mamba2 layers without a state layout are refused at construction."""
    with pytest.raises(InvalidConfig, match="2 Mamba2 layers needs a recurrent state layout"):
        load_paged_hybrid(ckpt[0], num_token_slots=64, layout=None)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"layers_block_type": ["moe"]}, "unsupported layers \\['moe'\\]"),
        ({"mlp_hidden_act": "silu"}, "'mlp_hidden_act' is 'silu'"),
        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "expected 'nemotron_h'"),
        ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads 3"),
    ],
)
def test_unsupported_configs_are_refused(
    ckpt: tuple[Path, NemotronHForCausalLM], tmp_path: Path, edit: dict[str, object], match: str
) -> None:
    """A config the model would compute wrong is refused, naming the file and field."""
    raw = json.loads((ckpt[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | edit))
    with pytest.raises(InvalidConfig, match=match):
        read_hybrid_config(tmp_path)
