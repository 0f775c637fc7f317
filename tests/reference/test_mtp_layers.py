"""MTP layers on disk: a checkpoint whose layers are absent, missing, extra or duplicated is
refused (before an engine is built where the config shows it, else at attach), naming the file;
for a NemotronH target too, whose MTP blocks must be declared (``mtp_layer_types``) attention or
MLP blocks, and an LFM2 target is refused."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hybrid_mtp_oracle import make_hybrid_mtp_target
from lfm2_oracle import make_lfm2_checkpoint
from mtp_oracle import make_mtp_target
from safetensors.torch import load_file, save_file

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.hybrid import LayerKind, PagedHybrid, load_paged_hybrid
from specstate.reference.mtp import load_mtp_layers, read_mtp_spec
from specstate.reference.workers import default_registry

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Ernie MoE target with two MTP layers."""
    root = tmp_path_factory.mktemp("mtp_multi")
    make_mtp_target(root, num_mtp_layers=2, layers=2)
    return root


def edited(
    source: Path, target: Path, edit: Callable[[Tensors], Tensors], **config: object
) -> Path:
    """A copy of ``source`` with its tensors passed through ``edit`` and ``config`` merged in."""
    shutil.copytree(source, target)
    tensors = edit(load_file(target / "model.safetensors"))
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**raw, **config}))
    return target


def layer(tensors: Tensors, k: int) -> Tensors:
    """MTP layer ``k``'s tensors, names relative to the layer."""
    prefix = f"mtp.layers.{k}."
    return {n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)}


def load(root: Path) -> object:
    """Load ``root``'s MTP layers for its target."""
    return load_mtp_layers(root, load_paged_llama(root, num_token_slots=8))


def test_spec_reads_the_declared_layers(multi: Path) -> None:
    """``num_mtp_layers`` (or its alias ``num_nextn_predict_layers``) sets L."""
    assert read_mtp_spec(multi).num_layers == 2
    worker = default_registry().create("mtp", target=multi)
    assert worker.capabilities.num_steps == 2 and worker.capabilities.keeps_draft_kv
    layers = load(multi)
    assert len(layers.layers) == 2  # type: ignore[attr-defined]


def test_a_target_without_mtp_layers_is_refused_at_construction(
    multi: Path, tmp_path: Path
) -> None:
    """The #36536 class: a target that ships none fails when the worker is made, not later."""
    root = edited(multi, tmp_path / "none", lambda t: t, num_mtp_layers=0)
    with pytest.raises(InvalidConfig, match=r"config\.json: declares no MTP layers"):
        default_registry().create("mtp", target=root)


def test_a_missing_layer_is_refused(multi: Path, tmp_path: Path) -> None:
    """Layer 1 absent though two are declared: the error names the layer and the count."""
    root = edited(
        multi,
        tmp_path / "missing",
        lambda t: {n: v for n, v in t.items() if "mtp.layers.1." not in n},
    )
    with pytest.raises(InvalidConfig, match=r"MTP layer 1 of the 2 the config declares is missing"):
        load(root)


def test_a_layer_past_the_declared_count_is_refused(multi: Path, tmp_path: Path) -> None:
    """Three layers on disk but two declared: the extra one is named, not silently dropped."""

    def add_third(t: Tensors) -> Tensors:
        return t | {f"mtp.layers.2.{n}": v.clone() for n, v in layer(t, 1).items()}

    root = edited(multi, tmp_path / "extra", add_third)
    with pytest.raises(InvalidConfig, match=r"unexpected MTP tensor 'mtp\.layers\.2\..*declares 2"):
        load(root)


def test_duplicated_layers_are_refused(multi: Path, tmp_path: Path) -> None:
    """The #25368 class: layer 0 copied into layer 1 would make every step run the same layer."""

    def duplicate(t: Tensors) -> Tensors:
        return t | {f"mtp.layers.1.{n}": v.clone() for n, v in layer(t, 0).items()}

    root = edited(multi, tmp_path / "dup", duplicate)
    with pytest.raises(InvalidConfig, match=r"MTP layers 0 and 1 of 2 hold identical weights"):
        load(root)


def test_bad_options_are_refused(multi: Path) -> None:
    """num_steps < 1 and an in-memory target without a checkpoint for its layers."""
    with pytest.raises(InvalidConfig, match=r"num_steps >= 1, got 0"):
        default_registry().create("mtp", target=multi, num_steps=0)
    in_memory = load_paged_llama(multi, num_token_slots=8)
    with pytest.raises(InvalidConfig, match=r"in-memory target needs mtp="):
        default_registry().create("mtp", target=in_memory)
    worker = default_registry().create("mtp", target=in_memory, mtp=multi, num_steps=3)
    assert worker.capabilities.num_steps == 3 and worker.capabilities.num_draft_tokens == 4


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A NemotronH target with two attention MTP layers (not distilled)."""
    root = tmp_path_factory.mktemp("mtp_hybrid")
    make_hybrid_mtp_target(root, (LayerKind.ATTENTION, LayerKind.ATTENTION), steps=0)
    return root


def load_hybrid(root: Path) -> object:
    """Load ``root``'s MTP layers for its NemotronH target."""
    layout = RecurrentLayout(rows_per_request=2, num_request_slots=2)
    target = load_paged_hybrid(root, num_token_slots=8, layout=layout)
    assert isinstance(target, PagedHybrid)
    return load_mtp_layers(root, target)


def test_a_hybrid_target_reads_its_mtp_block_kinds(hybrid: Path) -> None:
    """``mtp_layer_types`` names each MTP block; the worker declares the target's state too."""
    spec = read_mtp_spec(hybrid)
    assert spec.block_kinds == (LayerKind.ATTENTION, LayerKind.ATTENTION)
    worker = default_registry().create("mtp", target=hybrid)
    assert worker.capabilities.num_steps == 2 and worker.capabilities.recurrent is not None
    assert len(load_hybrid(hybrid).layers) == 2  # type: ignore[attr-defined]


def test_a_hybrid_target_refuses_missing_and_duplicated_layers(
    hybrid: Path, tmp_path: Path
) -> None:
    """The same typed errors as a Llama target's, naming the layers and the count."""
    root = edited(
        hybrid,
        tmp_path / "missing",
        lambda t: {n: v for n, v in t.items() if "mtp.layers.1." not in n},
    )
    with pytest.raises(InvalidConfig, match=r"MTP layer 1 of the 2 the config declares is missing"):
        load_hybrid(root)

    def duplicate(t: Tensors) -> Tensors:
        return t | {f"mtp.layers.1.{n}": v.clone() for n, v in layer(t, 0).items()}

    root = edited(hybrid, tmp_path / "dup", duplicate)
    with pytest.raises(InvalidConfig, match=r"MTP layers 0 and 1 of 2 hold identical weights"):
        load_hybrid(root)


@pytest.mark.parametrize(
    ("kinds", "message"),
    [
        (None, r"field 'mtp_layer_types' must list the block of each of the 2 MTP layers"),
        (["full_attention"], r"field 'mtp_layer_types' must list .* got \['full_attention'\]"),
        (
            ["linear_attention", "full_attention"],
            r"MtpSpec: MTP layer 0 is a 'linear_attention' block",
        ),
    ],
)
def test_a_hybrid_target_with_undeclared_or_recurrent_mtp_blocks_is_refused(
    hybrid: Path, tmp_path: Path, kinds: list[str] | None, message: str
) -> None:
    """Refused when the worker is made, naming the file: no declared kinds, the wrong count, or
    a Mamba2 MTP block (it would need recurrent state rows of its own)."""
    root = edited(hybrid, tmp_path / "kinds", lambda t: t, mtp_layer_types=kinds)
    with pytest.raises(InvalidConfig, match=r"config\.json: " + message):
        default_registry().create("mtp", target=root)


def test_an_lfm2_target_is_refused(tmp_path: Path) -> None:
    """MTP layers are served on Llama-architecture and NemotronH targets only."""
    make_lfm2_checkpoint(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_mtp_layers": 1}))
    with pytest.raises(InvalidConfig, match=r"an LFM2 model|an LFM2 target"):
        default_registry().create("mtp", target=tmp_path)
