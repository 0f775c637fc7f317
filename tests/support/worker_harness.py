"""Test harness: a hand-driven loop that plays scheduler and result processor around one worker.

No engine exists yet, so this loop composes the memory layer (`memory_harness.build_memory`)
with the worker's own speculative window and drives requests the way the non-overlap engine
will: admit, prefill (optionally in chunks), then decode rounds until ``max_new_tokens``::

    SCHEDULER          admit; alloc_for_extend + commit_extend | reserve_for_spec_decode
    WORKER             forward_batch_generation(batch, on_publish=spy)   (no counter writes)
    RESULT_PROCESSOR   advance_committed(accept_lens); append_outputs(run[:cap]); finish
    relay              next_draft_input rows kept per request, stacked into the next spec_info

Every worker call is checked: exactly one ``on_publish`` with the result's ``new_seq_lens``,
the ledger and ``req_to_token`` unchanged by the worker, ``1 <= accept_len <= stride``.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from memory_harness import Memory, build_memory

from specstate import (
    FinishReason,
    FinishState,
    ForwardBatch,
    ForwardMode,
    GenerationBatchResult,
    RelayPayload,
    Req,
    ReqStatus,
    RequestLimits,
    SamplingInfo,
    SamplingParams,
)
from specstate.engine.worker import WorkerMemory, WorkerProtocol
from specstate.internals import Role, ScheduleBatch

CPU = torch.device("cpu")


@attrs.define
class HarnessRun:
    """What one run observed.

    Attributes:
        outputs: request id -> emitted output tokens (capped at ``max_new_tokens``).
        decode_accept_lens: per DECODE round, the worker's accept length of every row.
        publishes: every ``on_publish`` argument, in call order.
        events: the shared event log (``forward:<mode>``, ``publish``, plus spies' entries).
        slots: request id -> request slot it held.
    """

    outputs: dict[str, list[int]] = attrs.Factory(dict)
    decode_accept_lens: list[list[int]] = attrs.Factory(list)
    publishes: list[list[int]] = attrs.Factory(list)
    events: list[str] = attrs.Factory(list)
    slots: dict[str, int] = attrs.Factory(dict)

    @property
    def all_accept_lens(self) -> list[int]:
        """Every decode row's accept length, flattened."""
        return [a for round_lens in self.decode_accept_lens for a in round_lens]


@attrs.define
class _Relay:
    bonus: int
    hidden: torch.Tensor | None


def _ceil(n: int, page: int) -> int:
    return -(-n // page) * page


class WorkerLoop:
    """One worker, its composed memory and the requests it serves (test-only)."""

    def __init__(
        self,
        worker: WorkerProtocol,
        *,
        vocab_size: int,
        page_size: int,
        max_len: int,
        num_requests: int,
        events: list[str] | None = None,
    ) -> None:
        self.worker = worker
        window = worker.capabilities.spec_window(page_size)
        row_width = _ceil(max(max_len + window.reserve, window.row_headroom) + 1, page_size)
        row_width += page_size
        num_pages = num_requests * row_width // page_size + 2
        self.mem: Memory = build_memory(
            page_size=page_size,
            num_pages=num_pages,
            max_requests=num_requests + 1,
            row_width=row_width,
            window=window,
        )
        self.limits = RequestLimits(vocab_size=vocab_size, max_context_len=row_width)
        self.run = HarnessRun(events=[] if events is None else events)
        self._relays: dict[str, _Relay] = {}
        self.running: list[Req] = []
        worker.attach(
            WorkerMemory(
                req_to_token=self.mem.allocator.req_to_token,
                ledger=self.mem.ledger.views().worker,
                num_token_slots=num_pages * page_size,
                device=CPU,
            )
        )

    # ----------------------------------------------------------------- worker
    def call_worker(self, batch: ScheduleBatch) -> GenerationBatchResult:
        """Runs the worker under Role.WORKER and checks what it may and may not do."""
        forward = ForwardBatch.from_schedule(batch)
        forward = attrs.evolve(forward, sampling_info=forward.sampling_info.copy_for_forward())
        published: list[list[int]] = []

        def on_publish(new_seq_lens: torch.Tensor) -> None:
            published.append(new_seq_lens.tolist())
            self.run.events.append("publish")

        ledger_before = self.mem.ledger.batch_snapshot()
        table_before = self.mem.allocator.req_to_token.clone()
        self.run.events.append(f"forward:{batch.forward_mode.value}")
        with self.mem.checker.acting(Role.WORKER):
            result = self.worker.forward_batch_generation(forward, on_publish=on_publish)
        self.run.events.append("return")
        assert self.mem.ledger.batch_snapshot() == ledger_before, "the worker wrote the ledger"
        assert torch.equal(self.mem.allocator.req_to_token, table_before)
        assert len(published) == 1, f"on_publish called {len(published)} times"
        assert result.new_seq_lens is not None
        assert published[0] == result.new_seq_lens.tolist()
        self.run.publishes.extend(published)
        return result

    def _batch(self, reqs: Sequence[Req], mode: ForwardMode, **fields: object) -> ScheduleBatch:
        sampling = SamplingInfo.from_params(
            [r.sampling for r in reqs], vocab_size=self.limits.vocab_size, device=CPU
        )
        return ScheduleBatch(
            reqs=tuple(reqs),
            incarnations=tuple(r.incarnation for r in reqs),
            forward_mode=mode,
            req_pool_indices=self.mem.slots(*reqs),
            sampling_info=sampling,
            spec_info=self._stacked_relays(reqs),
            **fields,  # type: ignore[arg-type]
        )

    def _stacked_relays(self, reqs: Sequence[Req]) -> RelayPayload | None:
        rows = [self._relays.get(r.request_id) for r in reqs]
        if all(row is None for row in rows):
            return None
        bonus = torch.tensor([0 if row is None else row.bonus for row in rows])
        hiddens = [None if row is None else row.hidden for row in rows]
        known = [h for h in hiddens if h is not None]
        if not known:
            return RelayPayload(bonus_tokens=bonus)
        filled = [torch.zeros_like(known[0]) if h is None else h for h in hiddens]
        return RelayPayload(bonus_tokens=bonus, hidden_states=torch.stack(filled))

    def _keep_relays(self, reqs: Sequence[Req], payload: RelayPayload | None) -> None:
        assert payload is not None, "the worker returned no next_draft_input"
        for row, req in enumerate(reqs):
            hidden = None if payload.hidden_states is None else payload.hidden_states[row]
            self._relays[req.request_id] = _Relay(int(payload.bonus_tokens[row]), hidden)

    # ---------------------------------------------------------------- prefill
    def admit(self, reqs: Sequence[Req]) -> None:
        """Admits ``reqs`` (scheduler)."""
        with self.mem.checker.acting(Role.SCHEDULER):
            for req in reqs:
                self.run.slots[req.request_id] = self.mem.allocator.admit(req)
                req.transition(ReqStatus.PREFILL)

    def prefill(self, reqs: Sequence[Req], chunk_size: int | None) -> None:
        """Prefills ``reqs`` together, ``chunk_size`` prompt tokens per request per forward."""
        done = {r.request_id: 0 for r in reqs}
        while pending := [r for r in reqs if done[r.request_id] < len(r.prompt_ids)]:
            starts = [done[r.request_id] for r in pending]
            ends = [
                min(len(r.prompt_ids), s + (chunk_size or len(r.prompt_ids)))
                for r, s in zip(pending, starts, strict=True)
            ]
            self._prefill_chunk(pending, starts, ends)
            for req, end in zip(pending, ends, strict=True):
                done[req.request_id] = end

    def _prefill_chunk(self, reqs: list[Req], starts: list[int], ends: list[int]) -> None:
        slots, ends_t = self.mem.slots(*reqs), torch.tensor(ends)
        with self.mem.checker.acting(Role.SCHEDULER):
            self.mem.allocator.alloc_for_extend(slots, ends_t)
            self.mem.ledger.commit_extend(slots, ends_t)
        table = self.mem.allocator.req_to_token
        batch = self._batch(
            reqs,
            ForwardMode.EXTEND,
            seq_lens=ends_t,
            seq_lens_cpu=tuple(ends),
            input_ids=torch.tensor(
                [t for r, s, e in zip(reqs, starts, ends, strict=True) for t in r.prompt_ids[s:e]]
            ),
            out_cache_loc=torch.cat(
                [table[int(slot), s:e] for slot, s, e in zip(slots, starts, ends, strict=True)]
            ),
            prefix_lens=tuple(starts),
            extend_lens=tuple(e - s for s, e in zip(starts, ends, strict=True)),
        )
        result = self.call_worker(batch)
        assert result.stride == 1 and result.accept_lens.tolist() == [1] * len(reqs)
        assert result.new_seq_lens is not None and result.new_seq_lens.tolist() == ends
        self._keep_relays(reqs, result.next_draft_input)
        finished_prompt = [r for r, e in zip(reqs, ends, strict=True) if e == len(r.prompt_ids)]
        with self.mem.checker.acting(Role.RESULT_PROCESSOR):
            for req in finished_prompt:
                req.append_outputs([self._relays[req.request_id].bonus])
                req.transition(ReqStatus.RUNNING)
        self.running += finished_prompt
        self._finish_capped(finished_prompt)

    # ----------------------------------------------------------------- decode
    def decode_round(self) -> None:
        """One DECODE forward of every running request, settled as the result processor."""
        reqs = list(self.running)
        slots = self.mem.slots(*reqs)
        with self.mem.checker.acting(Role.SCHEDULER):
            if self.worker.capabilities.speculative:
                self.mem.allocator.reserve_for_spec_decode(slots)
            else:
                self.mem.allocator.alloc_for_decode(slots)
        seq_lens = self.mem.ledger.committed(slots)
        bonus = torch.tensor([self._relays[r.request_id].bonus for r in reqs])
        batch = self._batch(
            reqs,
            ForwardMode.DECODE,
            seq_lens=seq_lens,
            seq_lens_cpu=tuple(seq_lens.tolist()),
            input_ids=bonus,
        )
        result = self.call_worker(batch)
        self._settle_decode(reqs, seq_lens, result)

    def _settle_decode(
        self, reqs: list[Req], seq_lens: torch.Tensor, result: GenerationBatchResult
    ) -> None:
        stride, accept = result.stride, result.accept_lens
        assert stride == self.worker.capabilities.num_draft_tokens
        assert bool(((accept >= 1) & (accept <= stride)).all()), accept.tolist()
        assert result.new_seq_lens is not None
        assert torch.equal(result.new_seq_lens, seq_lens + accept)
        self.run.decode_accept_lens.append(accept.tolist())
        tokens = result.next_token_ids.tolist()
        self._keep_relays(reqs, result.next_draft_input)
        with self.mem.checker.acting(Role.RESULT_PROCESSOR):
            self.mem.ledger.advance_committed(self.mem.slots(*reqs), accept)
            for row, req in enumerate(reqs):
                run = tokens[row * stride : row * stride + int(accept[row])]
                assert run[-1] == self._relays[req.request_id].bonus
                assert all(t == 0 for t in tokens[row * stride + len(run) : (row + 1) * stride])
                cap = req.sampling.max_new_tokens - len(req.output_ids)
                req.append_outputs(run[:cap])
        self._finish_capped(reqs)

    def _finish_capped(self, reqs: Sequence[Req]) -> None:
        for req in reqs:
            committed = int(self.mem.ledger.committed(self.mem.slots(req))[0])
            assert req.seqlen == committed + 1 or len(req.output_ids) >= req.sampling.max_new_tokens
            if len(req.output_ids) < req.sampling.max_new_tokens:
                continue
            finish = FinishState(reason=FinishReason.LENGTH, finished_len=len(req.output_ids))
            req.transition(ReqStatus.FINISHED, finish=finish)
            with self.mem.checker.acting(Role.SCHEDULER):
                self.mem.allocator.release(req)
            self.running.remove(req)
            self.run.outputs[req.request_id] = list(req.output_ids)


def run_worker(
    worker: WorkerProtocol,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    vocab_size: int,
    page_size: int = 1,
    chunk_size: int | None = None,
    events: list[str] | None = None,
) -> HarnessRun:
    """Serves ``prompts`` (ids ``r0, r1, ...``) with ``worker`` to ``max_new_tokens`` each."""
    max_len = max(len(p) for p in prompts) + max_new_tokens
    loop = WorkerLoop(
        worker,
        vocab_size=vocab_size,
        page_size=page_size,
        max_len=max_len,
        num_requests=len(prompts),
        events=events,
    )
    params = SamplingParams(max_new_tokens=max_new_tokens)
    reqs = [
        Req.new(f"r{i}", prompt, params, loop.limits, checker=loop.mem.checker)
        for i, prompt in enumerate(prompts)
    ]
    loop.admit(reqs)
    loop.prefill(reqs, chunk_size)
    for _ in range(max_new_tokens + 1):
        if not loop.running:
            break
        loop.decode_round()
    assert not loop.running, "requests still running after max_new_tokens rounds"
    loop.mem.allocator.check_balance()
    return loop.run
