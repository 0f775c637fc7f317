"""Reference workers: `WorkerProtocol` on the paged Llama, one per speculative algorithm.

`default_registry` registers a factory per algorithm; each takes keyword options only::

    registry = default_registry()
    worker = registry.create("draft_model", target="ckpt/target", draft="ckpt/draft", num_steps=3)
    worker.attach(memory)            # builds the models with memory.num_token_slots KV slots
    result = worker.forward_batch_generation(batch, on_publish=publish)

=============  ==========================================================================
``none``       `PlainWorker`: ``target``, ``device``, ``dtype``
``draft_model``  `DraftModelWorker`: ``target``, ``draft``, ``num_steps``, ``device``, ``dtype``
``eagle``      `EagleWorker`: ``target``, ``eagle``, ``num_steps``, ``device``, ``dtype``
``ngram``      `NgramWorker`: ``target``, ``num_steps``, ``max_ngram``, ``device``, ``dtype``
=============  ==========================================================================

``target`` / ``draft`` are Hugging Face Llama checkpoint directories or in-memory `PagedLlama`
models; ``eagle`` is a directory in the `specstate.reference.eagle_head` format.
"""

from __future__ import annotations

from specstate.engine.worker import AlgorithmRegistry
from specstate.reference.workers.draft_model import DraftModelWorker
from specstate.reference.workers.eagle import EagleWorker
from specstate.reference.workers.ngram import NgramWorker, TokenHistory
from specstate.reference.workers.round import ChainRoundWorker, PlainWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource

__all__ = [
    "ChainRoundWorker",
    "DraftModelWorker",
    "EagleWorker",
    "ModelSource",
    "NgramWorker",
    "PlainWorker",
    "TokenHistory",
    "VerifiedRound",
    "default_registry",
]


def default_registry() -> AlgorithmRegistry:
    """A registry holding ``none``, ``draft_model``, ``eagle`` and ``ngram``."""
    registry = AlgorithmRegistry()
    registry.register("none", PlainWorker)
    registry.register("draft_model", DraftModelWorker)
    registry.register("eagle", EagleWorker)
    registry.register("ngram", NgramWorker)
    return registry
