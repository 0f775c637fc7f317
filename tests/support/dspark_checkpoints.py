"""Test-only: DSpark assistants derived from the block drafters' target and DFlash assistant.

`make_dspark_assistant` fits the two heads (`specstate.reference.dspark_heads`) on top of the
distilled DFlash assistant of `block_checkpoints`, on the target's own greedy continuations
(teacher forcing, exactly the inputs a DSpark round feeds them):

* the Markov head (rank 8) by cross-entropy of ``lm_head(h_i) + bias(t_(i-1))`` against the
  target's token, so it corrects some of the backbone's drafts;
* the confidence head by logistic regression on whether that biased argmax equals the target's
  token, so its confidences are calibrated: high where the drafts are accepted, low where not
  (low enough, on the first position of some rounds, for `ConfidenceBudget` to cut a row to 0).

The directory is written with `save_dspark_assistant`, backbone copied from the DFlash one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from block_checkpoints import BlockCheckpoints
from dflash_oracle import greedy_corpus

from specstate.reference.dspark_checkpoint import save_dspark_assistant
from specstate.reference.dspark_heads import DSparkHeadConfig, DSparkHeads, MarkovVariant

MARKOV_RANK = 8


def block_states(
    ckpt: BlockCheckpoints, assistant: Any, corpus: torch.Tensor, anchor: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``assistant`` (unpaged) on the block at ``anchor`` of every corpus row:
    the normed hidden states ``[rows, W - 1, hidden]`` of block rows 1 .. W-1 (the bonus
    ``corpus[:, anchor]``, then masks) and their base logits (the target's LM head)."""
    hf: Any = ckpt.hf
    config = assistant.config
    layer_ids = list(config.target_layer_ids)
    with torch.no_grad():
        hidden = hf(corpus[:, :anchor], output_hidden_states=True).hidden_states
        context = torch.cat([hidden[i + 1] for i in layer_ids], -1)
        rows, block = corpus.shape[0], config.block_size
        masks = torch.full((rows, block - 1), config.mask_token_id)
        noise = torch.cat([corpus[:, anchor : anchor + 1], masks], 1)
        out = assistant(
            noise_embeds=hf.get_input_embeddings()(noise),
            context_hidden_states=context,
            position_ids=torch.arange(anchor + block)[None].expand(rows, -1),
            use_cache=False,
        ).last_hidden_state[:, 1:]
        return out, hf.lm_head(out)


def make_dspark_assistant(
    ckpt: BlockCheckpoints,
    directory: Path,
    *,
    variant: MarkovVariant = "vanilla",
    steps: int = 200,
    seed: int = 11,
) -> Path:
    """Fit the heads (module docstring) and save the DSpark assistant to ``directory``."""
    torch.manual_seed(seed)
    corpus = greedy_corpus(ckpt.hf, num=96, prompt_len=6, new_tokens=30, seed=seed)
    assistant = ckpt.hf_assistant()
    block = assistant.config.block_size
    anchors = range(3, corpus.shape[1] - block)
    states = {a: block_states(ckpt, assistant, corpus, a) for a in anchors}
    config = DSparkHeadConfig(
        vocab_size=ckpt.vocab_size, hidden_size=32, markov_rank=MARKOV_RANK, markov_variant=variant
    )
    heads = DSparkHeads(config)
    heads.requires_grad_(True)
    markov, confidence = heads.markov_head, heads.confidence_head
    optimizer = torch.optim.Adam(markov.parameters(), lr=2e-2)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        a = list(anchors)[int(torch.randint(len(anchors), (1,), generator=gen))]
        hidden, base = states[a]
        prev, labels = corpus[:, a : a + block - 1], corpus[:, a + 1 : a + block]
        bias = torch.stack([markov(prev[:, i], hidden[:, i]) for i in range(block - 1)], 1)
        loss = F.cross_entropy((base + bias).reshape(-1, ckpt.vocab_size), labels.reshape(-1))
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    with torch.no_grad():  # the accepted labels of the fitted drafts, every anchor
        feats, hits = [], []
        for a, (hidden, base) in states.items():
            prev, labels = corpus[:, a : a + block - 1], corpus[:, a + 1 : a + block]
            bias = torch.stack([markov(prev[:, i], hidden[:, i]) for i in range(block - 1)], 1)
            feats.append(hidden.reshape(-1, hidden.shape[-1]))
            hits.append(((base + bias).argmax(-1) == labels).float().reshape(-1))
        x, y = torch.cat(feats), torch.cat(hits)
    optimizer = torch.optim.Adam(confidence.parameters(), lr=5e-2)
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(torch.nn.Linear.forward(confidence, x)[:, 0], y)
        optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    heads.requires_grad_(False)
    save_dspark_assistant(directory, backbone=ckpt.assistant, heads=heads)
    return directory
