"""A production-shaped specstate adapter: GPT-2 with its KV cache in the engine's token slots.

`GPT2SlotWorker` implements `specstate.WorkerProtocol` around a Hugging Face GPT-2
(``transformers.GPT2LMHeadModel``, any checkpoint of that architecture). Unlike the recomputing
example (examples/hf_transformers_adapter.py), it has the shape of an engine team's adapter:

* ``attach`` allocates one K and one V buffer per layer with ``memory.num_token_slots`` rows,
  one row per engine token slot (`SlotKvCache`), so the engine's KV pool accounts for every byte
  and retraction frees real memory;
* a forward computes only the new tokens (the prefill chunk, or the verify chain
  ``[x0, d1..dK]``): it writes their K and V at their token slots (``out_cache_loc`` in an
  extend, ``req_to_token[slot, S + j]`` in a verify) and attends over the request's slots
  ``req_to_token[slot, :end]``, the way a paged-attention kernel reads a block table.

Drafts come from n-gram lookup in the request's own tokens (`TokenHistory`) and are verified
greedily (`verify_greedy_chain`), so the output is exactly ``model.generate(do_sample=False)``.
The KV of rejected drafts needs no cleanup: the next round starts at the new frontier and
overwrites those slots, and no forward reads past a frontier. docs/example-kv-adapter.md walks
through this file.

    python examples/hf_kv_cache_adapter.py               # a tiny random GPT-2
    python examples/hf_kv_cache_adapter.py --model DIR   # any local GPT-2 checkpoint

serves a few prompts through `specstate.Engine` in both loops and checks every token against
``model.generate()``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

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

__all__ = ["GPT2SlotWorker", "SlotKvCache", "hf_greedy", "main", "serve", "tiny_gpt2"]


class SlotKvCache:
    """Per-layer K and V, one row per engine token slot: ``[num_token_slots, heads, head_dim]``.

    Invariant: row ``s`` of every buffer holds the KV of the token the engine mapped to slot
    ``s`` (``req_to_token[slot, p] == s``), once a forward has written it; slot 0 is padding.
    """

    def __init__(
        self, num_layers: int, num_slots: int, heads: int, head_dim: int, *, like: torch.Tensor
    ) -> None:
        shape = (num_slots, heads, head_dim)
        self.keys = [like.new_zeros(shape) for _ in range(num_layers)]
        self.values = [like.new_zeros(shape) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the K and V of the tokens at ``slots`` ``[N]`` (``k``, ``v``: ``[N, H, d]``)."""
        self.keys[layer].index_copy_(0, slots, k)
        self.values[layer].index_copy_(0, slots, v)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V at ``slots`` (any shape ``[...]``): ``[..., H, d]`` each, copies."""
        return self.keys[layer][slots], self.values[layer][slots]


class GPT2SlotWorker:
    """A `specstate.WorkerProtocol` for GPT-2 with paged KV in the engine's slots, n-gram drafts.

    Greedy only (``supports_sampling`` is not declared): the engine refuses a sampled request.

    Args:
        model: a ``transformers`` GPT-2 LM, on the device the engine runs on.
        num_steps: K, tokens drafted a round (the model verifies D = K + 1 tokens a row).
        max_ngram: the longest trailing n-gram looked up (then shorter ones, down to 1).
    """

    def __init__(self, model: GPT2LMHeadModel, *, num_steps: int = 3, max_ngram: int = 3) -> None:
        if num_steps < 1 or max_ngram < 1:
            raise ValueError(f"need num_steps >= 1 and max_ngram >= 1: {num_steps}, {max_ngram}")
        model.train(False)  # inference: no dropout
        self._model = model
        self._max_ngram = max_ngram
        self._capabilities = WorkerCapabilities(
            algorithm="gpt2-ngram",
            num_steps=num_steps,
            num_draft_tokens=num_steps + 1,  # D: the bonus x0 and the K drafts
            keeps_draft_kv=False,  # n-gram drafting writes no KV
        )
        self._memory: WorkerMemory | None = None
        self._cache: SlotKvCache | None = None
        self._history: TokenHistory | None = None

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The algorithm and window this worker runs; constant for its lifetime."""
        return self._capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Allocate the KV cache in the engine's slots, and the token table the drafter reads."""
        config = self._model.config
        head_dim = config.n_embd // config.n_head
        like = self._model.transformer.wte.weight  # the model's dtype and device
        self._cache = SlotKvCache(
            config.n_layer, memory.num_token_slots, config.n_head, head_dim, like=like
        )
        num_rows, row_width = memory.req_to_token.shape
        self._history = TokenHistory(num_rows, row_width, device=memory.device)
        self._memory = memory

    @property
    def cache(self) -> SlotKvCache:
        """The KV cache (after `attach`)."""
        if self._cache is None:
            raise RuntimeError("the worker is not attached: the engine calls attach(memory)")
        return self._cache

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """One forward of ``batch``: an extend (prefill, chunk, mixed) or one decode round."""
        with torch.no_grad():  # here, on whichever thread runs the forward (not around it)
            if batch.forward_mode is ForwardMode.DECODE:
                return self._decode(batch, on_publish)
            if batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
                return self._extend(batch, on_publish)
            return self._idle(batch, on_publish)

    def _extend(self, batch: ForwardBatch, on_publish: OnPublish | None) -> GenerationBatchResult:
        input_ids, positions = batch.input_ids, batch.positions
        write_slots, extend_lens = batch.out_cache_loc, batch.extend_lens
        if input_ids is None or positions is None or write_slots is None or extend_lens is None:
            raise ValueError("an extend carries input_ids, positions, out_cache_loc, extend_lens")
        slots, ends = batch.req_pool_indices.long(), batch.seq_lens.long()
        lens = torch.tensor(extend_lens, dtype=torch.int64, device=slots.device)
        row_of = torch.arange(batch.batch_size, device=slots.device).repeat_interleave(lens)
        assert self._history is not None
        self._history.write(slots[row_of], positions, input_ids)  # for the n-gram drafter
        # The chunk's KV goes to out_cache_loc; it attends over the row's slots [0, end).
        hidden = self._run(input_ids, positions, write_slots, row_of, slots, int(ends.max()))
        last = self._lm_head(hidden[torch.cumsum(lens, 0) - 1])  # [B, V]: after each row's end
        next_tokens = last.argmax(-1)
        _publish(on_publish, ends)  # after an extend the frontier stays seq_lens
        return GenerationBatchResult(
            next_token_ids=next_tokens,
            accept_lens=torch.ones_like(next_tokens),
            stride=1,
            new_seq_lens=ends.clone(),
            next_draft_input=RelayPayload(bonus_tokens=next_tokens),
            invalid_rows=_non_finite(last),
        )

    def _decode(self, batch: ForwardBatch, on_publish: OnPublish | None) -> GenerationBatchResult:
        if batch.input_ids is None or self._memory is None or self._history is None:
            raise ValueError("a decode batch carries the bonus tokens; the worker is attached")
        num_steps = self._capabilities.num_steps
        width = num_steps + 1  # D
        slots, start = batch.req_pool_indices.long(), batch.seq_lens.long()  # S: KV-ready
        roots = batch.input_ids.long()  # x0 at position S
        self._history.write(slots, start, roots)
        drafts = self._history.propose(
            slots, start, num_tokens=num_steps, max_ngram=self._max_ngram
        )
        chain = torch.cat([roots[:, None], drafts], dim=1)  # [B, D] at S..S+K
        positions = start[:, None] + torch.arange(width, device=start.device)  # [B, D]
        # The chain's KV goes to the slots the engine reserved for S..S+K.
        write_slots = self._memory.req_to_token[slots[:, None], positions]  # [B, D]
        row_of = torch.arange(batch.batch_size, device=start.device).repeat_interleave(width)
        hidden = self._run(
            chain.reshape(-1),
            positions.reshape(-1),
            write_slots.reshape(-1),
            row_of,
            slots,
            int(start.max()) + width,
        )
        verify_logits = self._lm_head(hidden).view(batch.batch_size, width, -1)  # j: S + j + 1
        verdict = verify_greedy_chain(drafts, verify_logits)
        new_seq_lens = start + verdict.accept_lens  # S + a
        _publish(on_publish, new_seq_lens)  # before the commit below: the host schedules on
        accepted = torch.arange(num_steps, device=start.device) < verdict.last_accepted[:, None]
        self._history.write(
            slots[:, None].expand_as(drafts)[accepted], positions[:, 1:][accepted], drafts[accepted]
        )
        keep = torch.arange(width, device=start.device) < verdict.accept_lens[:, None]
        return GenerationBatchResult(
            next_token_ids=torch.where(keep, verdict.run_tokens, 0).reshape(-1),
            accept_lens=verdict.accept_lens,
            stride=width,
            new_seq_lens=new_seq_lens,
            next_draft_input=RelayPayload(bonus_tokens=verdict.bonus_tokens),
            invalid_rows=_non_finite(verify_logits),
        )

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

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        row_of: torch.Tensor,
        slots: torch.Tensor,
        width: int,
    ) -> torch.Tensor:
        """GPT-2's blocks over ``N`` new tokens; their final hidden states ``[N, hidden]``.

        Token ``i`` (of row ``row_of[i]``, at ``positions[i]``) writes its K and V at
        ``write_slots[i]`` and attends causally over its row's slots
        ``req_to_token[slots[row], :width]``: positions ``<= positions[i]``.
        """
        assert self._memory is not None
        transformer = self._model.transformer
        read_slots = self._memory.req_to_token[slots, :width]  # [B, L]: the rows' block table
        visible = torch.arange(width, device=positions.device) <= positions[:, None]  # [N, L]
        x = transformer.wte(input_ids) + transformer.wpe(positions)
        for layer, block in enumerate(transformer.h):
            assert isinstance(block, GPT2Block)  # ln_1, attn (c_attn, c_proj), ln_2, mlp
            x = x + self._attention(
                layer, block, block.ln_1(x), write_slots, read_slots, row_of, visible
            )
            x = x + block.mlp(block.ln_2(x))
        hidden: torch.Tensor = transformer.ln_f(x)
        return hidden

    def _attention(
        self,
        layer: int,
        block: GPT2Block,
        x: torch.Tensor,
        write_slots: torch.Tensor,
        read_slots: torch.Tensor,
        row_of: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """One layer's attention: write the new K and V in the slots, read the row's back."""
        heads = self._model.config.n_head
        q, k, v = block.attn.c_attn(x).split(self._model.config.n_embd, dim=-1)
        q, k, v = (t.view(t.shape[0], heads, -1) for t in (q, k, v))  # [N, H, d]
        self.cache.write(layer, write_slots, k, v)
        keys, values = self.cache.read(layer, read_slots[row_of])  # [N, L, H, d]
        scores = torch.einsum("nhd,nlhd->nhl", q, keys) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        out = torch.einsum("nhl,nlhd->nhd", scores.softmax(-1), values)
        projected: torch.Tensor = block.attn.c_proj(out.reshape(x.shape))
        return projected

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self._model.lm_head(hidden)
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


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    """A random two-layer GPT-2 with a 97-token vocabulary: seconds on a CPU."""
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=97,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
    )
    model = GPT2LMHeadModel(config)
    model.train(False)
    return model


def hf_greedy(model: GPT2LMHeadModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' greedy ``generate()`` continuation of ``prompt``."""
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
    model: GPT2LMHeadModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    overlap: bool,
    num_steps: int = 3,
) -> tuple[list[list[int]], dict[int, int]]:
    """Serve ``prompts`` greedily; each one's tokens, and how often each accept length occurred."""
    limits = RequestLimits(
        vocab_size=model.config.vocab_size,
        max_context_len=max(len(p) for p in prompts) + max_new_tokens + 1,
    )
    config = EngineConfig(
        overlap=overlap,
        page_size=16,
        kv_tokens=4096,
        check_invariants=True,  # every check on: a wrong adapter fails loudly
        check_ownership=True,
        debug_relay=True,
    )
    with Engine(GPT2SlotWorker(model, num_steps=num_steps), limits=limits, config=config) as engine:
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        engine.run_until_idle()
        histogram = dict(engine.snapshot().metrics.histogram)
    return [list(r.emitted_ids) for r in reqs], histogram


def main(argv: Sequence[str] | None = None) -> int:
    """Serve `PROMPTS` in both loops and compare with ``generate()``; 0 when every token agrees."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", help="a local GPT-2 checkpoint (default: a tiny random one)")
    parser.add_argument("--num-steps", type=int, default=3, help="draft tokens a round (K)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model) if args.model else tiny_gpt2()
    if not isinstance(model, GPT2LMHeadModel):
        parser.error(f"--model {args.model} is a {type(model).__name__}, not a GPT-2")
    vocab = model.config.vocab_size
    prompts = [[t % vocab for t in p] for p in PROMPTS]
    expected = [hf_greedy(model, p, args.max_new_tokens) for p in prompts]
    for overlap in (False, True):
        got, histogram = serve(
            model, prompts, max_new_tokens=args.max_new_tokens, overlap=overlap,
            num_steps=args.num_steps,
        )  # fmt: skip
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
