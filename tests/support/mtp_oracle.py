"""Test-only: tiny Ernie 4.5 MoE targets with MTP layers, and transformers' MTP generation.

The target is a random transformers ``Ernie4_5_MoeForCausalLM`` (attention plus a sparse MLP)
that declares ``num_mtp_layers``; its MTP layers are written next to it in the format
transformers' ``MtpModel`` reads. Random MTP layers almost never agree with the target, so the
layers here are *derived* from it: layer ``k``'s block is the target's layer 0, its projection
adds the embedding and the previous hidden state (so both steer the draft: a hidden state taken
from the wrong position changes the drafts), its post-norm is the target's final norm, and then
every parameter gets Gaussian noise. The drafts then match the target's greedy tokens often but not
always (accept lengths strictly between 1 and the maximum), and each layer is distinct.

`RecordingMtp` is the ``mtp`` worker recording each decode round's drafts and accept length.
`hf_mtp_rounds` runs transformers' ``generate(use_mtp=True)`` and records what its
``MTPCandidateGenerator`` drafted each round and how many drafts the target accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from hf_oracle import one_thread
from spec_checkpoints import perturb
from transformers import Ernie4_5_MoeConfig, Ernie4_5_MoeForCausalLM

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerProtocol
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.mtp import MtpLayer, MtpLayers, MtpSpec, save_mtp_layers
from specstate.reference.workers import default_registry
from specstate.reference.workers.mtp import MtpWorker
from specstate.reference.workers.verify import DraftChain


def make_mtp_target(
    directory: Path,
    *,
    num_mtp_layers: int,
    seed: int = 0,
    vocab_size: int = 97,
    hidden: int = 32,
    layers: int = 1,
    noise: float = 0.1,
) -> Ernie4_5_MoeForCausalLM:
    """Save a random tiny Ernie MoE target with ``num_mtp_layers`` derived MTP layers; return
    transformers' model of it (loaded back, so it is exactly what is on disk)."""
    torch.manual_seed(seed)
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "moe_intermediate_size": hidden // 2,
        "moe_k": 2,
        "moe_num_experts": 4,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 0,
        "moe_layer_end_index": layers + num_mtp_layers,  # the MTP blocks are sparse too
        "max_position_embeddings": 256,
        "initializer_range": 0.2,
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": None,
        "num_mtp_layers": num_mtp_layers,  # not a declared field: transformers keeps it as is
    }
    model = Ernie4_5_MoeForCausalLM(Ernie4_5_MoeConfig(**fields))
    with torch.no_grad():  # a router bias that steers the choice, as trained ones do
        for name, param in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape) * 0.1)
    model.train(False)
    model.save_pretrained(directory)
    target = load_paged_llama(directory, num_token_slots=2)
    mtp = derived_mtp_layers(target, num_mtp_layers, noise=noise, seed=seed + 100)
    save_mtp_layers(mtp, directory)
    hf = Ernie4_5_MoeForCausalLM.from_pretrained(directory)
    hf.train(False)
    return hf


def derived_mtp_layers(target: Any, count: int, *, noise: float, seed: int) -> MtpLayers:
    """MTP layers that each compute (roughly) the target's next token, perturbed."""
    spec = MtpSpec(config=target.config, num_layers=count)
    layers = MtpLayers(spec, target)
    hidden = target.config.hidden_size
    with torch.no_grad():
        for k, layer in enumerate(layers.layers):
            assert isinstance(layer, MtpLayer)
            layer.eh_proj.weight.copy_(torch.cat([torch.eye(hidden), 3 * torch.eye(hidden)], dim=1))
            layer.mtp_block.load_state_dict(target.layers[0].state_dict())
            layer.post_norm.load_state_dict(target.norm.state_dict())
            perturb(layer, noise, seed=seed + k)
    return layers


@attrs.frozen
class MtpRounds:
    """transformers' MTP generation of one prompt.

    Attributes:
        tokens: the generated tokens (the prompt excluded).
        drafts: per decode round, the candidates the MTP layers drafted.
        accepted: per decode round, how many of them the target accepted.
    """

    tokens: list[int]
    drafts: list[list[int]]
    accepted: list[int]


def hf_mtp_rounds(hf: Any, prompt: Sequence[int], max_new_tokens: int) -> MtpRounds:
    """Run ``hf.generate(use_mtp=True)`` greedily and record every round's drafts and accepts."""
    drafts: list[list[int]] = []
    accepted: list[int] = []
    build: Callable[..., Any] = hf._get_candidate_generator

    def recording_generator(*args: Any, **kwargs: Any) -> Any:
        generator = build(*args, **kwargs)
        get, update = generator.get_candidates, generator.update_candidate_strategy

        def get_candidates(input_ids: torch.Tensor, *a: Any, **k: Any) -> Any:
            ids, logits = get(input_ids, *a, **k)
            if ids.shape[1] > input_ids.shape[1]:
                drafts.append([int(t) for t in ids[0, input_ids.shape[1] :]])
            return ids, logits

        def update_candidate_strategy(input_ids: torch.Tensor, logits: Any, n: Any) -> Any:
            if len(accepted) < len(drafts):
                accepted.append(int(n))
            return update(input_ids, logits, n)

        generator.get_candidates = get_candidates
        generator.update_candidate_strategy = update_candidate_strategy
        return generator

    hf._get_candidate_generator = recording_generator
    try:
        ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                use_mtp=True,
            )
    finally:
        del hf._get_candidate_generator
    return MtpRounds(
        tokens=[int(t) for t in out[0, len(prompt) :]], drafts=drafts, accepted=accepted
    )


@attrs.frozen
class MtpCheckpoints:
    """Ernie MoE targets with one MTP layer and with two, and transformers' models of them."""

    single: Path
    multi: Path
    hf_single: Ernie4_5_MoeForCausalLM
    hf_multi: Ernie4_5_MoeForCausalLM
    vocab_size: int

    def worker(self, *, layers: int = 2, num_steps: int | None = None) -> WorkerProtocol:
        """An ``mtp`` worker on the target with ``layers`` (1 or 2) MTP layers."""
        target = self.single if layers == 1 else self.multi
        return default_registry().create("mtp", target=target, num_steps=num_steps)


def make_mtp_checkpoints(root: Path, *, vocab_size: int = 97) -> MtpCheckpoints:
    """Build and save both targets under ``root``."""
    with one_thread():
        return _make_mtp_checkpoints(root, vocab_size=vocab_size)


def _make_mtp_checkpoints(root: Path, *, vocab_size: int) -> MtpCheckpoints:
    hf_single = make_mtp_target(root / "single", num_mtp_layers=1, vocab_size=vocab_size)
    # NOTE: transformers reads checkpoint layers numbered >= num_hidden_layers as MTP layers
    # too (DeepSeek's layout), so a target needs at least as many layers as MTP layers.
    hf_multi = make_mtp_target(
        root / "multi", num_mtp_layers=2, seed=1, vocab_size=vocab_size, layers=2
    )
    return MtpCheckpoints(
        single=root / "single",
        multi=root / "multi",
        hf_single=hf_single,
        hf_multi=hf_multi,
        vocab_size=vocab_size,
    )


def unpaged_drafts(hf: Any, mtp: Any, tokens: Sequence[int], num_steps: int) -> list[int]:
    """The ``num_steps`` greedy drafts after ``tokens`` (its last token is the pending bonus at
    ``S = len(tokens) - 1``), recomputed from scratch with transformers' modules and no cache:
    the target over ``tokens[:-1]``, then MTP layer ``k`` over positions ``k + 1 ..`` with step
    ``j`` on layer ``min(j - 1, L - 1)`` (past ``L`` the last layer takes its own outputs)."""
    seq, start = list(tokens), len(tokens) - 1
    with torch.no_grad():
        out = hf(torch.tensor([seq[:-1]]), output_hidden_states=True)
        inputs = out.hidden_states[-1]  # g_(-1) at 0 .. S-1
        last, drafts = mtp.num_mtp_layers - 1, []
        for j in range(1, num_steps + 1):
            k = min(j - 1, last)
            lo = k + 1  # layer k sees positions k+1 .. S+j-1
            ids = torch.tensor([seq[lo : start + j]])
            g = mtp.forward_layer(k, inputs, torch.arange(lo, start + j)[None], None, input_ids=ids)
            drafts.append(int(mtp._project_to_logits(g[:, -1:]).argmax(-1)))
            seq.append(drafts[-1])
            # the next step's inputs: this layer's outputs (next layer), or its own chain
            inputs = g if j - 1 < last else torch.cat([inputs, g[:, -1:]], dim=1)
    return drafts


def unpaged_chain(hf: Any, mtp: Any, tokens: Sequence[int]) -> list[torch.Tensor]:
    """``[g_(-1), g_0, .., g_(L-2)]`` over ``tokens`` (each ``[len(tokens), H]``), recomputed
    from scratch: ``g_(-1)`` is the target's normed last hidden state, ``g_k`` MTP layer ``k``'s
    output (rows ``0 .. k`` are undefined, NaN here: no layer reads them)."""
    n = len(tokens)
    with torch.no_grad():
        out = hf(torch.tensor([list(tokens)]), output_hidden_states=True)
        chain = [out.hidden_states[-1][0]]
        for k in range(mtp.num_mtp_layers - 1):
            lo = k + 1
            g = mtp.forward_layer(
                k,
                chain[-1][lo - 1 : n - 1][None],
                torch.arange(lo, n)[None],
                None,
                input_ids=torch.tensor([list(tokens[lo:])]),
            )[0]
            chain.append(torch.cat([torch.full((lo, g.shape[1]), float("nan")), g]))
    return chain


@attrs.define
class Round:
    """One decode round of one request: its frontier, drafts and accept length."""

    start: int
    drafts: list[int]
    accept: int = 0


class RecordingMtp(MtpWorker):
    """The ``mtp`` worker, recording every decode round's drafts and accept lengths by request."""

    def __init__(self, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.rounds: dict[str, list[Round]] = {}
        self.stores: list[tuple[str, torch.Tensor]] = []  # (request, store below S) per round

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        chain = super()._propose(batch, start, roots)
        table = self._target.req_to_token
        for i, (rid, s, row) in enumerate(
            zip(batch.request_ids, start.tolist(), chain.tokens.tolist(), strict=True)
        ):
            self.rounds.setdefault(rid, []).append(Round(start=s, drafts=row))
            slots = table[int(batch.req_pool_indices[i]), :s].long()
            self.stores.append((rid, self.features[:, slots].clone()))
        return chain

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        result = super().forward_batch_generation(batch, on_publish=on_publish)
        if batch.forward_mode is ForwardMode.DECODE:
            for rid, accept in zip(batch.request_ids, result.accept_lens.tolist(), strict=True):
                self.rounds[rid][-1].accept = accept
        return result
