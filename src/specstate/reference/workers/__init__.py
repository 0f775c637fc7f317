"""Reference workers: `WorkerProtocol` on the paged Llama, one per speculative algorithm.

`default_registry` registers a factory per algorithm; each takes keyword options only:

    registry = default_registry()
    worker = registry.create("draft_model", target="ckpt/target", draft="ckpt/draft", num_steps=3)
    worker.attach(memory)            # builds the models with memory.num_token_slots KV slots
    result = worker.forward_batch_generation(batch, on_publish=publish)

Every worker takes ``target``, ``device``, ``dtype`` and ``seed``; besides them:

| name | class | options |
|---|---|---|
| ``none`` | `PlainWorker` | none |
| ``draft_model`` | `DraftModelWorker` | ``draft``, ``num_steps``, ``topk``, ``num_draft_tokens`` |
| ``eagle`` | `EagleWorker` | ``eagle``, ``num_steps``, ``topk``, ``num_draft_tokens`` |
| ``ngram`` | `NgramWorker` | ``num_steps``, ``max_ngram``, ``draft_without_match`` |
| ``mtp`` | `MtpWorker` | ``mtp``, ``num_steps`` (default: the checkpoint's MTP layers) |
| ``eagle3`` | `Eagle3Worker` | ``eagle3``, ``num_steps``, ``topk``, ``num_draft_tokens`` |
| ``frozen_kv_mtp`` | `FrozenKvMtpWorker` | ``assistant``, ``num_steps`` |
| ``dflash`` | `DFlashWorker` | ``assistant``, ``num_steps``, ``check_commit_order`` |
| ``dspark`` | `DSparkWorker` | as ``dflash`` (a DSpark assistant; reports draft confidences) |
| ``uno`` | `UnoWorker` | ``adapter``, ``noise_token_id``, the step and tree options of ``eagle`` |

``topk > 1`` makes ``draft_model``, ``eagle``, ``eagle3`` and ``uno`` draft a tree of
``num_draft_tokens`` nodes and verify it in one forward (`specstate.reference.workers.tree`):
greedy rows take the longest matching path, sampled rows recursive rejection sampling over each
node's children; each node sees the penalties and ``min_new_tokens`` state of its own path,
seeded rows verify against their seeded draws, and logprobs and ``speculative=False`` work as
on a chain. Trees do not take an adaptive draft length.

``target`` / ``draft`` are Hugging Face Llama or NemotronH checkpoint directories, or in-memory
`PagedLlama` / `PagedHybrid` models; ``eagle`` is a directory in the
`specstate.reference.eagle_head` format. A NemotronH target or drafter (Mamba2 layers) declares
its recurrent state (`WorkerCapabilities.recurrent`) and keeps it in the engine's state rows;
``none``, ``ngram`` and chain ``draft_model`` serve it (``eagle`` and trees need a Llama).

Rows with ``temperature > 0`` sample: the target and the drafters draw from their top-k / top-p
filtered ``softmax(logits / T)`` and chains are verified by speculative sampling
(`verify_sampled_chain`), so each emitted token follows the target's filtered distribution.
Greedy rows stay argmax, bit-identical to an all-greedy batch. Each worker owns one
`torch.Generator` seeded by ``seed``: for a fixed seed and the same sequence of batches (the
same requests, batched the same way) the sampled tokens are reproducible; ``seed=None`` draws a
fresh seed at attach.
"""

from __future__ import annotations

from specstate.engine.worker import AlgorithmRegistry
from specstate.reference.workers.dflash import DFlashWorker
from specstate.reference.workers.draft_model import DraftModelWorker
from specstate.reference.workers.dspark import DSparkWorker
from specstate.reference.workers.eagle import EagleWorker
from specstate.reference.workers.eagle3 import Eagle3Worker
from specstate.reference.workers.frozen_kv_mtp import FrozenKvMtpWorker
from specstate.reference.workers.history import TokenHistory
from specstate.reference.workers.mtp import MtpWorker
from specstate.reference.workers.ngram import NgramWorker
from specstate.reference.workers.round import ChainRoundWorker, PlainWorker, VerifiedRound
from specstate.reference.workers.sampler import TokenChoice, TokenSampler, filtered_probs
from specstate.reference.workers.sources import ModelSource
from specstate.reference.workers.tree import TreeRoundWorker, VerifiedTree
from specstate.reference.workers.tree_draft import DraftTree, TreeShape
from specstate.reference.workers.tree_verify import TreeVerdict, verify_greedy_tree
from specstate.reference.workers.uno import UnoWorker
from specstate.reference.workers.verify import (
    ChainVerdict,
    DraftChain,
    verify_greedy_chain,
    verify_sampled_chain,
)

__all__ = [
    "ChainRoundWorker",
    "ChainVerdict",
    "DFlashWorker",
    "DSparkWorker",
    "DraftChain",
    "DraftModelWorker",
    "DraftTree",
    "Eagle3Worker",
    "EagleWorker",
    "FrozenKvMtpWorker",
    "ModelSource",
    "MtpWorker",
    "NgramWorker",
    "PlainWorker",
    "TokenChoice",
    "TokenHistory",
    "TokenSampler",
    "TreeRoundWorker",
    "TreeShape",
    "TreeVerdict",
    "UnoWorker",
    "VerifiedRound",
    "VerifiedTree",
    "default_registry",
    "filtered_probs",
    "verify_greedy_chain",
    "verify_greedy_tree",
    "verify_sampled_chain",
]


def default_registry() -> AlgorithmRegistry:
    """A registry holding ``none``, ``draft_model``, ``eagle``, ``ngram``, the hidden-state
    drafters (``mtp``, ``eagle3``, ``frozen_kv_mtp``) and the block drafters (``dflash``,
    ``dspark``, ``uno``)."""
    registry = AlgorithmRegistry()
    registry.register("none", PlainWorker)
    registry.register("draft_model", DraftModelWorker)
    registry.register("eagle", EagleWorker)
    registry.register("ngram", NgramWorker)
    registry.register("mtp", MtpWorker)
    registry.register("eagle3", Eagle3Worker)
    registry.register("frozen_kv_mtp", FrozenKvMtpWorker)
    registry.register("dflash", DFlashWorker)
    registry.register("dspark", DSparkWorker)
    registry.register("uno", UnoWorker)
    return registry
