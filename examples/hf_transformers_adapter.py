"""A complete specstate adapter: any Hugging Face causal LM as the target, n-gram drafts.

`HFNgramWorker` implements `specstate.WorkerProtocol` (three members, no base class) around any
``transformers.AutoModelForCausalLM``. Each decode round drafts K tokens by looking the request's
trailing n-gram up in its own tokens (`TokenHistory`, the drafter of specstate's reference
``ngram`` worker) and verifies them greedily with the model (`verify_greedy_chain`). The output
is exactly the model's own greedy decoding, ``model.generate(do_sample=False)``; drafts that hit
only make it take fewer rounds.

Design: *recompute*. The worker keeps no KV cache. It keeps every request's tokens in a table
shaped like the engine's ``req_to_token`` (request slot × position) and runs each row's whole
token sequence through the model in every forward: O(length²) work a round, fine for a tutorial
and a tiny model. docs/example-adapter.md walks through this file and explains how to cache KV
instead.

    python examples/hf_transformers_adapter.py               # a tiny random Llama
    python examples/hf_transformers_adapter.py --model DIR   # any local HF causal LM

serves a few prompts through `specstate.Engine` in both loops and checks every token against
``model.generate()``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationMixin,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

from specstate import (
    Engine,
    EngineConfig,
    ForwardBatch,
    ForwardMode,
    GenerationBatchResult,
    OnPublish,
    RelayPayload,
    RequestLimits,
    SamplingParams,
    WorkerCapabilities,
    WorkerMemory,
)
from specstate.reference.workers import TokenHistory, verify_greedy_chain

__all__ = ["HFNgramWorker", "hf_greedy", "main", "serve", "tiny_llama"]


class HFNgramWorker:
    """A `specstate.WorkerProtocol` for a Hugging Face causal LM with n-gram drafting.

    Greedy only: it declares ``supports_sampling=False``, so the engine refuses a request with
    ``temperature > 0`` at ``submit``.

    Args:
        model: any ``transformers`` causal LM, on the device the engine runs on.
        num_steps: K, tokens drafted a round (the model verifies D = K + 1 tokens a row).
        max_ngram: the longest trailing n-gram looked up (then shorter ones, down to 1).
    """

    def __init__(self, model: PreTrainedModel, *, num_steps: int = 3, max_ngram: int = 3) -> None:
        if num_steps < 1 or max_ngram < 1:
            raise ValueError(f"need num_steps >= 1 and max_ngram >= 1: {num_steps}, {max_ngram}")
        model.train(False)  # inference: no dropout
        self._model = model
        self._max_ngram = max_ngram
        self._capabilities = WorkerCapabilities(
            algorithm="hf-ngram",
            num_steps=num_steps,  # K drafts a round
            topk=1,  # a chain, not a tree
            num_draft_tokens=num_steps + 1,  # D: the bonus x0 and the K drafts
            keeps_draft_kv=False,  # n-gram drafting writes no KV
            supports_sampling=False,  # greedy only
        )
        self._history: TokenHistory | None = None

    # -- WorkerProtocol, 1 of 3 -------------------------------------------------------------
    @property
    def capabilities(self) -> WorkerCapabilities:
        """The algorithm and window this worker runs; constant for its lifetime."""
        return self._capabilities

    # -- WorkerProtocol, 2 of 3 -------------------------------------------------------------
    def attach(self, memory: WorkerMemory) -> None:
        """Allocate the token table: one row per request slot, as wide as ``req_to_token``.

        A KV-caching adapter allocates its KV caches here instead, ``memory.num_token_slots``
        slots each, and keeps ``memory.req_to_token`` to find a request's slots.
        """
        num_rows, row_width = memory.req_to_token.shape
        self._history = TokenHistory(num_rows, row_width, device=memory.device)

    @property
    def history(self) -> TokenHistory:
        """The token table (after `attach`)."""
        if self._history is None:
            raise RuntimeError("the worker is not attached: the engine calls attach(memory)")
        return self._history

    # -- WorkerProtocol, 3 of 3 -------------------------------------------------------------
    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """One forward of ``batch``: an extend (prefill, chunk, mixed) or one decode round."""
        mode = batch.forward_mode
        if mode is ForwardMode.DECODE:
            return self._decode(batch, on_publish)
        if mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return self._extend(batch, on_publish)  # a mixed batch is an extend to a worker
        if mode is ForwardMode.IDLE:
            return self._idle(batch, on_publish)
        raise ValueError(f"the engine never sends {mode.value}")

    # -- EXTEND / MIXED: prefill, a prefill chunk, or a running request's 1-token tail ------
    def _extend(self, batch: ForwardBatch, on_publish: OnPublish | None) -> GenerationBatchResult:
        input_ids, positions, extend_lens = batch.input_ids, batch.positions, batch.extend_lens
        if input_ids is None or positions is None or extend_lens is None:
            raise ValueError("an extend batch carries input_ids, positions and extend_lens")
        slots = batch.req_pool_indices.long()
        ends = batch.seq_lens.long()  # each row's tokens so far: prefix + this chunk
        # 1. Remember the new tokens: all rows' chunks are packed in input_ids, at `positions`.
        lens = torch.tensor(extend_lens, dtype=torch.int64, device=slots.device)
        self.history.write(slots.repeat_interleave(lens), positions, input_ids)
        # 2. Recompute: run every row's tokens [0, end) through the model.
        logits = self._logits(self.history.read(slots)[:, : int(ends.max())])
        last = logits[torch.arange(batch.batch_size, device=slots.device), ends - 1]  # [B, V]
        next_tokens = last.argmax(-1)  # the token after each row's last token
        # 3. Publish: after an extend the frontier stays seq_lens; the new token is the pending
        #    bonus, whose KV the next verify writes. (The engine ignores it after a non-final
        #    chunk.)
        _publish(on_publish, ends)
        return GenerationBatchResult(
            next_token_ids=next_tokens,
            accept_lens=torch.ones_like(next_tokens),
            stride=1,
            new_seq_lens=ends.clone(),
            next_draft_input=RelayPayload(bonus_tokens=next_tokens),
            invalid_rows=_non_finite(last),
        )

    # -- DECODE: draft → verify → accept → publish → commit -----------------------------------
    def _decode(self, batch: ForwardBatch, on_publish: OnPublish | None) -> GenerationBatchResult:
        if batch.input_ids is None:
            raise ValueError("a decode batch carries the bonus tokens in input_ids")
        num_steps = self._capabilities.num_steps
        width = num_steps + 1  # D
        slots = batch.req_pool_indices.long()
        start = batch.seq_lens.long()  # S: tokens [0, S) are settled
        roots = batch.input_ids.long()  # x0: the bonus of the last round, at position S
        # 1. Draft: the bonus becomes part of the history, then the n-gram lookup from it.
        self.history.write(slots, start, roots)
        drafts = self.history.propose(
            slots, start, num_tokens=num_steps, max_ngram=self._max_ngram
        )  # [B, K]
        # 2. Verify: score the chain [x0, d1..dK] at S..S+K after each row's settled tokens.
        chain = torch.cat([roots[:, None], drafts], dim=1)  # [B, D]
        positions = start[:, None] + torch.arange(width, device=start.device)  # [B, D]
        tokens = self.history.read(slots)[:, : int(start.max()) + width]
        tokens = tokens.scatter(1, positions, chain)
        rows = torch.arange(batch.batch_size, device=start.device)[:, None]
        verify_logits = self._logits(tokens)[rows, positions]  # [B, D, V]: j scores S + j + 1
        # 3. Accept: the longest prefix of drafts equal to the model's own argmax, plus one.
        verdict = verify_greedy_chain(drafts, verify_logits)
        new_seq_lens = start + verdict.accept_lens  # S + a
        # 4. Publish the next frontier now: under overlap the host schedules the next round
        #    from it while the commit below still runs.
        _publish(on_publish, new_seq_lens)
        # 5. Commit: the accepted drafts d1..dm (m = a - 1) are settled tokens at S+1..S+m.
        accepted = torch.arange(num_steps, device=start.device) < verdict.last_accepted[:, None]
        self.history.write(
            slots[:, None].expand_as(drafts)[accepted], positions[:, 1:][accepted], drafts[accepted]
        )
        # Row i's run y_0..y_(a-1) at i*D, padded with 0 (never read) to the stride D.
        keep = torch.arange(width, device=start.device) < verdict.accept_lens[:, None]
        return GenerationBatchResult(
            next_token_ids=torch.where(keep, verdict.run_tokens, 0).reshape(-1),
            accept_lens=verdict.accept_lens,
            stride=width,
            new_seq_lens=new_seq_lens,
            next_draft_input=RelayPayload(bonus_tokens=verdict.bonus_tokens),  # y_(a-1)
            invalid_rows=_non_finite(verify_logits),
        )

    # -- IDLE: nothing to run, still exactly one publish ---------------------------------------
    def _idle(self, batch: ForwardBatch, on_publish: OnPublish | None) -> GenerationBatchResult:
        empty = torch.zeros(0, dtype=torch.int64, device=batch.seq_lens.device)
        _publish(on_publish, empty)
        return GenerationBatchResult(
            next_token_ids=empty,
            accept_lens=empty.clone(),
            stride=self._capabilities.num_draft_tokens,
            new_seq_lens=empty.clone(),
            next_draft_input=RelayPayload(bonus_tokens=empty.clone()),
        )

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]`` of every position of the token rows ``tokens`` ``[B, T]``.

        The rows are as long as the longest one; what lies past a shorter row's end (stale
        tokens) cannot change the logits read before it, because attention is causal.
        """
        with torch.no_grad():
            out = self._model(input_ids=tokens, use_cache=False)
        logits: torch.Tensor = out.logits
        return logits


def _publish(on_publish: OnPublish | None, new_seq_lens: torch.Tensor) -> None:
    """Call ``on_publish`` (None in the normal loop) exactly once per forward."""
    if on_publish is not None:
        on_publish(new_seq_lens)


def _non_finite(logits: torch.Tensor) -> torch.Tensor:
    """``[B]`` True where a row's logits hold a NaN or an infinity: the engine fails that row."""
    return ~torch.isfinite(logits).flatten(1).all(dim=1)


# -- The demo: serve prompts through the engine, compare with model.generate() ------------------

PROMPTS: tuple[tuple[int, ...], ...] = (
    (62, 93, 3, 60, 5, 62, 93, 3, 60, 5),
    (70, 32, 4, 70, 32, 4),
    (78, 85, 1, 11, 78, 85, 1, 11),
    (11, 12, 13, 14, 15, 16, 17, 18),
)
"""Token-id prompts; repetition makes some n-gram drafts hit."""


def tiny_llama(seed: int = 0) -> PreTrainedModel:
    """A random two-layer Llama with a 97-token vocabulary: seconds on a CPU."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    return model


def eos_ids(model: PreTrainedModel) -> frozenset[int]:
    """The end-of-sequence ids ``model.generate()`` stops at."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' greedy ``generate()`` continuation of ``prompt``."""
    if not isinstance(model, GenerationMixin):
        raise TypeError(f"{type(model).__name__} cannot generate()")
    ids = torch.tensor([list(prompt)], device=model.device)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]


def serve(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    overlap: bool,
    num_steps: int = 3,
    chunked_prefill: int | None = None,
) -> tuple[list[list[int]], dict[int, int]]:
    """Serve ``prompts`` greedily; each one's tokens, and how often each accept length occurred."""
    limits = RequestLimits(
        vocab_size=model.config.vocab_size,
        max_context_len=max(len(p) for p in prompts) + max_new_tokens + 1,
        eos_token_ids=eos_ids(model),
    )
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=4096,
        chunked_prefill=chunked_prefill,
        check_invariants=True,  # every check on: a wrong adapter fails loudly
        check_ownership=True,
        debug_relay=True,
    )
    worker = HFNgramWorker(model, num_steps=num_steps)
    with Engine(worker, limits=limits, config=config) as engine:
        params = SamplingParams(max_new_tokens=max_new_tokens)
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        histogram = dict(engine.snapshot().metrics.histogram)
    return [list(r.emitted_ids) for r in reqs], histogram


def main(argv: Sequence[str] | None = None) -> int:
    """Serve `PROMPTS` in both loops and compare with ``generate()``; 0 when every token agrees."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", help="a local Hugging Face causal LM (default: a tiny one)")
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens a round (K)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model) if args.model else tiny_llama()
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    expected = [hf_greedy(model, p, args.max_new_tokens) for p in prompts]
    for overlap in (False, True):
        got, histogram = serve(
            model,
            prompts,
            max_new_tokens=args.max_new_tokens,
            overlap=overlap,
            num_steps=args.num_steps,
        )
        loop = "overlap" if overlap else "normal"
        print(f"{loop} loop: accept lengths {dict(sorted(histogram.items()))}")
        for i, (tokens, want) in enumerate(zip(got, expected, strict=True)):
            if tokens != want:
                print(f"prompt {i}: engine {tokens}\n          generate {want}")
                return 1
    print(f"lossless: {len(prompts)} prompts equal model.generate() in both loops")
    return 0


if __name__ == "__main__":
    sys.exit(main())
