"""Test harness: the memory layer composed the way an engine does (one ledger, one allocator)."""

from __future__ import annotations

import attrs
import torch

from specstate import Req, RequestLimits, SamplingParams
from specstate.internals import KvLedger, OwnershipChecker, Role
from specstate.memory.allocation import KvAllocator
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.sizing import SpecWindow
from specstate.memory.slots import ReqToTokenPool


@attrs.frozen
class Memory:
    """A composed memory layer for tests."""

    checker: OwnershipChecker
    ledger: KvLedger
    allocator: KvAllocator
    limits: RequestLimits

    def new_req(self, rid: str, prompt_len: int, max_new_tokens: int = 64) -> Req:
        """A valid request with a prompt of ``prompt_len`` tokens."""
        prompt = [(i * 7 + 3) % self.limits.vocab_size for i in range(prompt_len)]
        params = SamplingParams(max_new_tokens=max_new_tokens)
        return Req.new(rid, prompt, params, self.limits, checker=self.checker)

    def slots(self, *reqs: Req) -> torch.Tensor:
        """The request slots of ``reqs`` as an index tensor."""
        return torch.tensor([self.allocator.slot_of(r) for r in reqs], dtype=torch.int64)

    def prefill(self, req: Req, end: int | None = None) -> None:
        """Admit if needed, allocate and commit the prompt (or up to ``end``)."""
        end = len(req.prompt_ids) if end is None else end
        with self.checker.acting(Role.SCHEDULER):
            if not self.allocator.holds_slot(req):
                self.allocator.admit(req)
            slots = self.slots(req)
            self.allocator.alloc_for_extend(slots, torch.tensor([end]))
            self.ledger.commit_extend(slots, torch.tensor([end]))


def build_memory(
    *,
    page_size: int = 1,
    num_pages: int = 64,
    max_requests: int = 8,
    row_width: int = 64,
    window: SpecWindow | None = None,
    production: bool = False,
) -> Memory:
    """Build a memory layer: page size, pages, request slots, row width, speculative window.

    ``production`` turns the ownership checks and the per-row validation off, as an engine
    without ``check_invariants`` runs (the benchmarks measure that mode).
    """
    checker = OwnershipChecker(enabled=not production)
    window = window or SpecWindow(
        speculative=True,
        num_steps=3,
        topk=1,
        num_draft_tokens=4,
        keeps_draft_kv=True,
        page_size=page_size,
    )
    ledger = KvLedger(max_requests, row_width, checker=checker, validate=not production)
    allocator = KvAllocator(
        ledger=ledger.views().allocator,
        req_pool=ReqToTokenPool(max_requests, row_width),
        token_pool=TokenSlotAllocator(num_pages, page_size),
        window=window,
        checker=checker,
        validate=not production,
    )
    limits = RequestLimits(vocab_size=50, max_context_len=row_width)
    return Memory(checker, ledger, allocator, limits)
