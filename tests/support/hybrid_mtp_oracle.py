"""Test-only: tiny NemotronH (Mamba2 + attention) targets with MTP layers, and their oracles.

transformers' ``generate`` refuses assisted generation (``use_mtp=True`` included) for a
stateful model such as NemotronH, so the oracle of the drafts is a plain, unpaged recomputation
(`mtp_oracle.unpaged_drafts`) with transformers' own modules: the target's
``NemotronHForCausalLM`` and an ``MtpModel`` built from it, which follows ``MtpLayer``'s wiring
(each MTP block a ``NemotronHBlock`` of the kind ``mtp_layer_types`` names). The checkpoint
declares what ``MtpModel`` needs: ``num_mtp_layers``, ``mtp_layer_types`` and ``rms_norm_eps``.

The target's final norm has random weights, so the target's normed hidden state (what the MTP
layers read) differs from its raw one by more than a scale. The MTP layers are derived from the
target so that their drafts partly agree with it. As in
`mtp_oracle`, layer ``k`` starts as the target's block of the same kind (its attention block, or
its MLP block) behind a projection that adds the embedding and three times the previous hidden
state, with the target's final norm as post-norm, every parameter with Gaussian noise. That
alone rarely agrees with a target whose Mamba2 layers steer its output, so the layers are then
distilled from the target (`distill`: a hundred seeded Adam steps, one thread, on the target's
greedy continuations of random tokens): their drafts match the target's tokens often but not
always (accept lengths strictly between 1 and the maximum, full runs among them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from hf_oracle import one_thread
from hybrid_oracle import make_hybrid_checkpoint
from mtp_oracle import unpaged_drafts
from spec_checkpoints import perturb
from transformers import NemotronHForCausalLM
from transformers.modeling_layers import MtpModel

from specstate.engine.worker import WorkerProtocol
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.hybrid import LayerKind, PagedHybrid, load_paged_hybrid
from specstate.reference.mtp import MtpLayer, MtpLayers, MtpSpec, save_mtp_layers
from specstate.reference.workers import default_registry

SINGLE = (LayerKind.ATTENTION,)
"""One MTP layer: an attention block."""

MULTI = (LayerKind.ATTENTION, LayerKind.MLP)
"""Two MTP layers: an attention block, then an MLP block (step 2 runs a different kind)."""


def derived_hybrid_mtp_layers(
    target: PagedHybrid, kinds: Sequence[LayerKind], *, noise: float, seed: int
) -> MtpLayers:
    """MTP layers whose blocks are the target's blocks of the same kinds, perturbed."""
    spec = MtpSpec(
        config=target.config,
        num_layers=len(kinds),
        block_kinds=tuple(kinds),
        norm_eps=target.config.layer_norm_epsilon,
    )
    layers = MtpLayers(spec, target)
    hidden = target.config.hidden_size
    sources = {block.kind: block for block in target.blocks}
    with torch.no_grad():
        for k, layer in enumerate(layers.layers):
            assert isinstance(layer, MtpLayer)
            layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), 3 * torch.eye(hidden)], dim=1))
            layer.mtp_block.load_state_dict(sources[kinds[k]].state_dict())
            layer.post_norm.load_state_dict(target.norm_f.state_dict())
            perturb(layer, noise, seed=seed + k)
    return layers


def distill(hf: Any, mtp: Any, *, steps: int, seed: int, rows: int = 48, length: int = 24) -> None:
    """Train ``mtp``'s layers (transformers' ``MtpModel`` of ``hf``) in place to predict the
    target's greedy tokens: layer ``k`` at position ``p`` the token at ``p + 1`` from the token
    at ``p`` and the previous layer's output at ``p - 1`` (``MtpLayer``'s wiring)."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.randint(0, hf.config.vocab_size, (rows, 1), generator=gen)
    with torch.no_grad():
        seqs = hf.generate(
            first,
            attention_mask=torch.ones_like(first),
            max_new_tokens=length,
            do_sample=False,
            pad_token_id=0,
        )
        target_hidden = hf(seqs, output_hidden_states=True).hidden_states[-1]
    params = list(mtp.layers.parameters())
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(params, lr=1e-2)
    width = seqs.shape[1]
    with torch.enable_grad():
        for param in params:
            param.requires_grad_(True)
        for _ in range(steps):
            optimizer.zero_grad()
            hidden = target_hidden[:, :-1]
            loss: torch.Tensor = torch.zeros(())
            for k in range(mtp.num_mtp_layers):
                positions = torch.arange(k + 1, width)[None].expand(rows, -1)
                out = mtp.forward_layer(k, hidden, positions, None, input_ids=seqs[:, k + 1 :])
                logits = mtp._project_to_logits(out[:, :-1])
                labels = seqs[:, k + 2 :]
                loss = loss + F.cross_entropy(logits.flatten(0, 1), labels.flatten())
                hidden = out[:, :-1]
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        for param in params:
            param.requires_grad_(False)


def make_hybrid_mtp_target(
    directory: Path,
    kinds: Sequence[LayerKind],
    *,
    seed: int = 0,
    vocab_size: int = 97,
    noise: float = 0.1,
    steps: int = 100,
) -> NemotronHForCausalLM:
    """Save a tiny NemotronH target with derived MTP layers of ``kinds``, distilled for
    ``steps`` steps; return transformers' model of it (loaded back from disk)."""
    made = make_hybrid_checkpoint(directory, seed=seed, vocab_size=vocab_size)
    with torch.no_grad():  # a final norm that is not the identity: g_(-1) is normed, not raw
        norm = made.model.norm_f.weight
        norm.copy_(0.5 + torch.rand(norm.shape, generator=torch.Generator().manual_seed(seed)))
    made.save_pretrained(directory)
    layout = RecurrentLayout(rows_per_request=2, num_request_slots=2)
    target = load_paged_hybrid(directory, num_token_slots=2, layout=layout)
    assert isinstance(target, PagedHybrid)
    layers = derived_hybrid_mtp_layers(target, kinds, noise=noise, seed=seed + 100)
    save_mtp_layers(layers, directory)
    hf = NemotronHForCausalLM.from_pretrained(directory)
    hf.train(False)
    trained = hf_mtp_model(hf)
    distill(hf, trained, steps=steps, seed=seed + 200)
    state = {n: t for n, t in trained.state_dict().items() if n.startswith("layers.")}
    layers.load_state_dict(state, strict=True)
    save_mtp_layers(layers, directory)
    return hf


def hf_mtp_model(hf: Any) -> Any:
    """transformers' ``MtpModel`` of ``hf``'s checkpoint (its ``mtp.*`` tensors)."""
    mtp = MtpModel.from_pretrained(hf, device_map={"": torch.device("cpu")})
    mtp.train(False)
    return mtp


@attrs.frozen
class HybridMtpCheckpoints:
    """NemotronH targets with one MTP layer and with two, their transformers models and
    ``MtpModel`` s."""

    single: Path
    multi: Path
    hf_single: NemotronHForCausalLM
    hf_multi: NemotronHForCausalLM
    mtp_single: Any
    mtp_multi: Any
    vocab_size: int

    def target(self, layers: int) -> Path:
        """The checkpoint with ``layers`` (1 or 2) MTP layers."""
        return self.single if layers == 1 else self.multi

    def hf(self, layers: int) -> NemotronHForCausalLM:
        """transformers' target with ``layers`` MTP layers."""
        return self.hf_single if layers == 1 else self.hf_multi

    def worker(self, *, layers: int = 2, num_steps: int | None = None) -> WorkerProtocol:
        """An ``mtp`` worker on the target with ``layers`` MTP layers."""
        return default_registry().create("mtp", target=self.target(layers), num_steps=num_steps)

    def drafts(self, layers: int, tokens: Sequence[int], num_steps: int) -> list[int]:
        """The unpaged recomputation's greedy drafts after ``tokens`` (`unpaged_drafts`)."""
        mtp = self.mtp_single if layers == 1 else self.mtp_multi
        return unpaged_drafts(self.hf(layers), mtp, tokens, num_steps)


def make_hybrid_mtp_checkpoints(root: Path, *, vocab_size: int = 97) -> HybridMtpCheckpoints:
    """Build and save both targets under ``root``."""
    with one_thread():
        hf_single = make_hybrid_mtp_target(root / "single", SINGLE, vocab_size=vocab_size)
        hf_multi = make_hybrid_mtp_target(root / "multi", MULTI, seed=2, vocab_size=vocab_size)
        return HybridMtpCheckpoints(
            single=root / "single",
            multi=root / "multi",
            hf_single=hf_single,
            hf_multi=hf_multi,
            mtp_single=hf_mtp_model(hf_single),
            mtp_multi=hf_mtp_model(hf_multi),
            vocab_size=vocab_size,
        )
