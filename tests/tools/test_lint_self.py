"""specstate's own source writes tracked counters only at reviewed owner sites, exactly."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import specstate
from specstate.tools.lint import scan_paths, site_counts

SRC = Path(specstate.__file__).parent

# (path, scope, kind) -> count. A new writer anywhere fails this test until it is reviewed and
# listed here; a removed one fails it until it is removed from here. Keep it exact.
OWNER_SITES: Counter[tuple[str, str, str]] = Counter(
    {
        # The ledger's own stores: created once, written only by the owner mutators. The host
        # (NumPy) views share the tensors' memory; the hot-path mutators write through them.
        ("core/ledger.py", "KvLedger.__init__", "assign _cache_protected"): 1,
        ("core/ledger.py", "KvLedger.__init__", "assign _kv_committed"): 1,
        ("core/ledger.py", "KvLedger.__init__", "assign _kv_allocated"): 1,
        ("core/ledger.py", "KvLedger.__init__", "assign _kv_committed_host"): 1,
        ("core/ledger.py", "KvLedger.__init__", "assign _kv_allocated_host"): 1,
        ("core/ledger.py", "KvLedger.set_protected", "assign _cache_protected"): 1,
        ("core/ledger.py", "KvLedger.commit_extend", "mutate _kv_committed.index_copy_"): 1,
        ("core/ledger.py", "KvLedger.advance_committed", "mutate _kv_committed.index_copy_"): 1,
        ("core/ledger.py", "KvLedger.advance_committed", "assign _kv_committed_host"): 1,
        ("core/ledger.py", "KvLedger.grow_allocated", "mutate _kv_allocated.index_copy_"): 1,
        ("core/ledger.py", "KvLedger.grow_allocated", "assign _kv_allocated_host"): 1,
        ("core/ledger.py", "KvLedger.__init__", "assign _cache_protected_host"): 1,
        # Req's output: created empty, extended only by the result processor while detached,
        # and copied back from the output table when the request leaves its slot.
        ("core/request.py", "Req.__init__", "assign _output_ids"): 1,
        ("core/request.py", "Req.append_outputs", "mutate _output_ids.extend"): 1,
        ("core/request.py", "Req._leave_rows", "assign _output_ids"): 1,
        # The output table: rows opened at admission, appended only by append_runs.
        ("engine/settle/outputs.py", "OutputTable.__init__", "assign _output_tokens"): 1,
        ("engine/settle/outputs.py", "OutputTable.__init__", "assign _output_tokens_flat"): 1,
        ("engine/settle/outputs.py", "OutputTable.__init__", "assign _output_lengths"): 1,
        ("engine/settle/outputs.py", "OutputTable.open_row", "assign _output_tokens"): 1,
        ("engine/settle/outputs.py", "OutputTable.open_row", "assign _output_lengths"): 1,
        ("engine/settle/outputs.py", "OutputTable.append_runs", "assign _output_tokens_flat"): 1,
        ("engine/settle/outputs.py", "OutputTable.append_runs", "assign _output_lengths"): 1,
        # The allocator: the only opener/closer of ledger slots and grower of allocated.
        ("memory/allocation.py", "KvAllocator.admit", "call open_slot"): 1,
        ("memory/allocation.py", "KvAllocator._grow", "call grow_allocated"): 1,
        # ... and of a row whose first positions map a cached prefix (admission).
        ("memory/allocation.py", "KvAllocator.map_prefix", "call grow_allocated"): 1,
        ("memory/allocation.py", "KvAllocator.release_many", "call close_slots"): 1,
        # The scheduler's prepare-for-extend: committed = the end of the launched chunk; it
        # opens a request's output row at admission.
        ("engine/schedule/scheduler.py", "Scheduler._extend_plan", "call commit_extend"): 1,
        ("engine/schedule/scheduler.py", "Scheduler._admit", "call open_row"): 1,
        # A prefix-cache hit at admission: the cached prefix is committed KV (an extend that
        # already ran) and the cache's (cache_protected_len); the scheduler is the one writer.
        ("engine/schedule/scheduler.py", "Scheduler._share_prefix", "call commit_extend"): 1,
        ("engine/schedule/scheduler.py", "Scheduler._share_prefix", "call set_protected"): 1,
        # The result processor: the only committer after prefill, and the only output writer.
        ("engine/settle/results.py", "ResultProcessor._commit", "call advance_committed"): 1,
        ("engine/settle/results.py", "ResultProcessor._append", "call append_runs"): 1,
        # The recurrent-state pool (hybrid workers): records opened and closed by the allocator
        # with the request slots; committed lengths advanced only by the result processor.
        ("memory/allocation.py", "KvAllocator.admit", "call open_state"): 1,
        ("memory/allocation.py", "KvAllocator.release_many", "call close_states"): 1,
        ("memory/recurrent.py", "RecurrentStatePool.__init__", "assign _recurrent_committed"): 1,
        (
            "memory/recurrent.py",
            "RecurrentStatePool.commit_states",
            "augassign _recurrent_committed",
        ): 1,
        (
            "memory/recurrent.py",
            "RecurrentStatePool.commit_prefilled",
            "assign _recurrent_committed",
        ): 1,
        ("memory/recurrent.py", "RecurrentStatePool.settle_states", "call commit_states"): 2,
        ("memory/recurrent.py", "RecurrentStatePool.settle_states", "call commit_prefilled"): 1,
        ("engine/settle/results.py", "ResultProcessor._commit_states", "call settle_states"): 1,
        # `specstate bench recurrent` times the commit on a standalone pool it owns.
        ("tools/bench_recurrent.py", "_commit_us", "call open_state"): 1,
        ("tools/bench_recurrent.py", "_commit_us", "call settle_states"): 1,
    }
)


def test_owner_sites_match_the_allowlist_exactly() -> None:
    """Surplus sites are new writers to review; missing ones mean the allowlist is stale."""
    found = site_counts(scan_paths([SRC]))
    surplus = found - OWNER_SITES
    missing = OWNER_SITES - found
    assert not surplus, f"new counter writers, review and list them: {dict(surplus)}"
    assert not missing, f"allowlisted sites no longer exist, update OWNER_SITES: {dict(missing)}"
