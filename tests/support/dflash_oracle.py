"""Test-only: transformers' DFlash generation as the oracle, and an assistant distilled from it.

`hf_dflash_rounds` runs ``generate(..., assistant_model=A, speculation_type="dflash")`` on one
prompt and records, per drafting round, the candidate tokens `DFlashTokenCandidateGenerator`
proposed and the run the target accepted (transformers' own code, only observed: the generator's
``get_candidates`` and ``update_candidate_strategy`` are wrapped to record what they return and
receive).

`distill_assistant` derives an assistant from a target so that it partly agrees with it: a
``MuseGlimmerAssistantModel`` trained for a few hundred steps (Adam, teacher forcing) to predict
the target's greedy continuations from the target's hidden states, exactly the inputs DFlash
feeds it (context hidden states of every position before the anchor, the anchor, the masks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
from transformers import LlamaForCausalLM
from transformers.generation import candidate_generator
from transformers.models.muse_glimmer_assistant import (
    MuseGlimmerAssistantConfig,
    MuseGlimmerAssistantModel,
)


@attrs.frozen
class DFlashRound:
    """One drafting round of transformers' DFlash generation.

    Attributes:
        drafts: the ``block_size - 1`` candidate tokens.
        accept_len: tokens the round emitted (accepted drafts plus the target's bonus).
    """

    drafts: tuple[int, ...]
    accept_len: int


def assistant_config(
    vocab_size: int, hidden: int, *, block_size: int, layer_ids: Sequence[int], num_layers: int = 1
) -> MuseGlimmerAssistantConfig:
    """A full-attention assistant config for a tiny target; mask = the last token."""
    fields: dict[str, Any] = {"vocab_size": vocab_size}  # a field of every config's base
    return MuseGlimmerAssistantConfig(
        **fields,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        block_size=block_size,
        mask_token_id=vocab_size - 1,
        target_layer_ids=list(layer_ids),
        layer_types=["full_attention"] * num_layers,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def greedy_corpus(
    hf: LlamaForCausalLM, *, num: int, prompt_len: int, new_tokens: int, seed: int
) -> torch.Tensor:
    """``[num, prompt_len + new_tokens]``: random prompts and the target's greedy continuations."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, hf.config.vocab_size, (num, prompt_len), generator=gen)
    with torch.no_grad():
        out: torch.Tensor = hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out


def distill_assistant(
    hf: LlamaForCausalLM,
    config: MuseGlimmerAssistantConfig,
    directory: Path,
    *,
    steps: int = 300,
    seed: int = 7,
) -> None:
    """Train an assistant on ``hf``'s greedy continuations and save it to ``directory``."""
    model: Any = hf  # transformers' annotations are partial
    layer_ids: list[int] = list(config.target_layer_ids or ())
    torch.manual_seed(seed)
    assistant = MuseGlimmerAssistantModel(config)
    corpus = greedy_corpus(hf, num=128, prompt_len=6, new_tokens=34, seed=seed)
    with torch.no_grad():
        hidden = model(corpus, output_hidden_states=True).hidden_states
    context = torch.cat([hidden[i + 1] for i in layer_ids], -1)
    embed = model.get_input_embeddings().weight.detach()
    head = model.get_output_embeddings().weight.detach()
    block, rows = config.block_size, corpus.shape[0]
    optimizer = torch.optim.Adam(assistant.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        anchor = int(torch.randint(2, corpus.shape[1] - block, (1,), generator=gen))
        masks = torch.full((rows, block - 1), config.mask_token_id)
        noise = torch.cat([corpus[:, anchor : anchor + 1], masks], 1)
        positions = torch.arange(anchor + block)[None].expand(rows, -1)
        out = assistant(
            noise_embeds=embed[noise],
            context_hidden_states=context[:, :anchor],
            position_ids=positions,
            use_cache=False,
        ).last_hidden_state
        logits = out[:, 1:] @ head.T
        labels = corpus[:, anchor + 1 : anchor + block]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        )
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    assistant.train(False)
    assistant.save_pretrained(directory)


@contextmanager
def _recorded(rounds: list[DFlashRound], block_size: int) -> Iterator[None]:
    """Record the drafts and accept lengths of every DFlash round inside the block."""
    generator: Any = candidate_generator.DFlashTokenCandidateGenerator
    get_candidates, update = generator.get_candidates, generator.update_candidate_strategy
    drafts: list[tuple[int, ...]] = []

    def record_candidates(self: Any, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        ids, logits = get_candidates(self, input_ids, *args, **kwargs)
        new = ids[0, input_ids.shape[1] :].tolist()
        drafts.append(tuple(int(t) for t in new))
        return ids, logits

    def record_accept(self: Any, input_ids: torch.Tensor, scores: Any, n_matches: Any) -> None:
        proposed = drafts[-1]
        if len(proposed) == block_size - 1:  # a drafting round (not the prefill)
            rounds.append(DFlashRound(drafts=proposed, accept_len=int(n_matches) + 1))
        update(self, input_ids, scores, n_matches)

    generator.get_candidates = record_candidates
    generator.update_candidate_strategy = record_accept
    try:
        yield
    finally:
        generator.get_candidates = get_candidates
        generator.update_candidate_strategy = update


def hf_dflash_rounds(
    hf: LlamaForCausalLM, assistant: MuseGlimmerAssistantModel, prompt: Sequence[int], new: int
) -> tuple[list[int], list[DFlashRound]]:
    """transformers' DFlash greedy tokens of ``prompt`` and its drafting rounds."""
    ids = torch.tensor([list(prompt)])
    rounds: list[DFlashRound] = []
    with _recorded(rounds, assistant.config.block_size), torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            assistant_model=assistant,
            speculation_type="dflash",
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]], rounds
