"""Engine options and reports: `EngineConfig` (how an engine runs), `StepReport` (what one step
did) and `EngineSnapshot` (the engine at one instant).

The config validates itself at construction and names every wrong field at once, so a bad
configuration never reaches an owner.
"""

from __future__ import annotations

import math
import threading

import attrs

from specstate.core.errors import InvalidConfig
from specstate.core.request import Req
from specstate.engine.budgets import BudgetGuardSnapshot, budget_policy
from specstate.engine.device_check import device_problems
from specstate.engine.settle.results import AcceptMetrics
from specstate.memory.prefix_cache import PrefixCacheSnapshot

__all__ = ["EngineConfig", "EngineSnapshot", "StepReport"]


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How the engine runs. Sizes are in tokens unless named otherwise.

    Attributes:
        overlap: run the overlap loop (one-batch lookahead) instead of the normal loop.
        page_size: KV page size P.
        kv_tokens: KV token slots in the pool (rounded down to whole pages).
        max_running: most requests admitted at once.
        chunked_prefill: tokens per prefill forward; a longer prompt is split in chunks.
            None: a prompt is prefilled whole (the budget is then ``max_prefill_tokens``).
        max_prefill_tokens: token budget of one prefill forward without chunking.
        mixed_chunk: running requests ride in prefill batches as 1-token extends of their
            pending bonus (late-bound from the FutureMap; the result commits ``+1``).
        check_invariants: run `check_engine` after every step (on in tests).
        check_ownership: run-time ownership checks on every counter write (on in tests).
        debug_relay: FutureMap consume-once checks and poisoned buffers.
        device: where batch tensors live (the worker's device).
        finished_history: how many ended requests `Engine.request` still finds by id; older
            ones are forgotten (the `Req` objects returned by `submit` stay valid), so a
            long-running engine holds bounded memory.
        forward_timeout_s: fail a batch whose forward (and result copy) is not done this many
            seconds after the host starts waiting for it: its requests, and those of a batch
            queued behind it, end with `FinishReason.ERROR` (`ForwardTimeout`); the stream is
            abandoned for a fresh one and their KV is quarantined until the abandoned forward
            returns. None (the default): wait forever. The forward then runs on a stream even
            in the normal loop.
        adaptive_draft: choose the draft steps of every decode round with the shipped
            `AcceptanceEma` policy (from the batch size and recent acceptance; speculation
            switches off when drafts are rarely accepted, and back on after a probe). Needs a
            worker that declares ``supports_adaptive_steps``; ignored for a worker that does
            not speculate. ``Engine(draft_policy=...)`` takes a policy of your own instead.
        grammar_mask_threads: threads that build grammar masks (llguidance's parallel
            executor); 1, the default, builds them one request after the other on the forward
            stream, which is faster on a small or busy machine.
        prefix_cache: share committed KV between requests through the prefix cache (a radix
            tree; docs/memory.md, "Prefix cache"): a request whose tokens start like an
            earlier one's maps that KV and prefills only the rest. Used only with a worker
            that declares ``WorkerCapabilities.prefix_sharing`` (TOKEN or BIGRAM); with any
            other worker, or False, nothing is shared.
        verify_budget: a shipped verify-budget policy by name (docs/engine.md, "Verify
            budgets"): ``"fixed"``, ``"goodput"``, ``"confidence"``, or ``"schedule:8=4,64=2"``
            (drafts up to each batch size; ``beyond=N`` for larger batches, default 0). None:
            every row verifies the round's width. ``Engine(verify_budget=...)`` takes a policy
            of your own instead. Needs a worker that declares ``supports_verify_budgets``.
        cost_profile: the JSON file of the `CostProfile` the goodput and confidence policies
            use (`CostProfile.to_json`'s format), or None: a stand-in where each draft costs
            15% of a plain step.
    """

    overlap: bool = True
    page_size: int = 1
    kv_tokens: int = 8192
    max_running: int = 32
    chunked_prefill: int | None = None
    max_prefill_tokens: int = 4096
    mixed_chunk: bool = False
    check_invariants: bool = False
    check_ownership: bool = False
    debug_relay: bool = False
    device: str = "cpu"
    finished_history: int = 10_000
    forward_timeout_s: float | None = None
    adaptive_draft: bool = False
    grammar_mask_threads: int = 1
    prefix_cache: bool = True
    verify_budget: str | None = None
    cost_profile: str | None = None

    def __attrs_post_init__(self) -> None:
        """Refuse wrong types and sizes at once, naming every field that is wrong."""
        flags = (
            "overlap",
            "mixed_chunk",
            "check_invariants",
            "check_ownership",
            "debug_relay",
            "adaptive_draft",
            "prefix_cache",
        )
        problems = [
            f"{name} must be a bool, got {getattr(self, name)!r}"
            for name in flags
            if not isinstance(getattr(self, name), bool)
        ]
        for name, low in (
            ("page_size", 1),
            ("max_running", 1),
            ("max_prefill_tokens", 1),
            ("grammar_mask_threads", 1),
        ):
            value = getattr(self, name)
            if not _is_count(value, low):
                problems.append(
                    f"{name} must be an integer >= {low}, got {value!r:.40} (at most 2**50)"
                )
        if _is_count(self.page_size, 1) and not _is_count(self.kv_tokens, 2 * self.page_size):
            problems.append(
                f"kv_tokens must be an integer >= 2 pages ({2 * self.page_size}) and at most "
                f"2**50, got {self.kv_tokens!r:.40}"
            )
        if not _is_count(self.finished_history, 0):
            problems.append(
                f"finished_history must be an integer >= 0, got "
                f"{self.finished_history!r:.40} (at most 2**50)"
            )
        if not _is_timeout(self.forward_timeout_s):
            problems.append(
                "forward_timeout_s must be None or a finite number > 0 (at most "
                f"{threading.TIMEOUT_MAX:.3g} s, what a wait accepts), got "
                f"{self.forward_timeout_s!r:.40}"
            )
        if self.chunked_prefill is not None and not _is_count(self.chunked_prefill, 1):
            problems.append(
                f"chunked_prefill must be None or an integer >= 1, got {self.chunked_prefill!r}"
            )
        problems.extend(device_problems(self.device))
        if self.verify_budget is not None:
            try:
                budget_policy(self.verify_budget, self.cost_profile)
            except InvalidConfig as exc:
                problems.append(str(exc))
        if self.cost_profile is not None and (self.verify_budget or "").partition(":")[0] not in (
            "goodput",
            "confidence",
        ):
            problems.append(
                f"cost_profile {self.cost_profile!r} is used only by the goodput and confidence "
                f"verify budgets, got verify_budget={self.verify_budget!r}"
            )
        if problems:
            raise InvalidConfig("EngineConfig: " + "; ".join(problems))


MAX_COUNT = 2**50
"""The largest size (tokens, pages, requests) a config takes: every count stays an int64 after
arithmetic; a larger one could never be allocated anyway."""


def _is_count(value: object, low: int) -> bool:
    """An integer (not a bool) in ``[low, MAX_COUNT]``."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_COUNT


def _is_timeout(value: object) -> bool:
    """None, or a finite positive number a thread can wait for (no OverflowError)."""
    if value is None:
        return True
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and 0 < value <= threading.TIMEOUT_MAX
    except OverflowError:  # an integer past the float range
        return False


@attrs.frozen(kw_only=True)
class StepReport:
    """What one step did.

    Attributes:
        launched_mode: the forward mode of the batch launched, or None.
        launched_size: its number of requests.
        finished: ids of the requests that ended (finished, aborted, failed) in this step.
        retracted: ids of the requests retracted in this step.
        ended: the `Req` objects of ``finished``, in the same order (they stay valid after
            the engine forgets them, see ``EngineConfig.finished_history``).
    """

    launched_mode: str | None
    launched_size: int
    finished: tuple[str, ...]
    retracted: tuple[str, ...]
    ended: tuple[Req, ...] = ()


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    """The engine at one instant (`Engine.snapshot`).

    Attributes:
        num_waiting: requests queued for admission (new or retracted).
        num_prefilling: admitted requests whose prompt is not fully prefilled yet.
        num_running: requests decoding.
        num_in_flight: batches launched and not settled yet (0 or 1 under overlap).
        num_open_slots: request slots holding a live or deferred request.
        num_free_pages: KV pages no request holds: free in the token pool, or kept by the
            prefix cache for reuse and evicted on demand.
        num_pages: KV pages in the token pool.
        deferred_releases: requests that ended while a batch was in flight; their KV is
            released when that batch retires.
        quarantined: requests whose KV is held until an abandoned forward stream drains
            (after a `ForwardTimeout`).
        metrics: acceptance statistics so far.
        prefix_cache: the prefix cache's size and hit statistics, or None when the engine
            shares no KV (``EngineConfig.prefix_cache`` off, or a worker that does not
            declare ``prefix_sharing``).
        draft_policy_failure: what disabled the engine's draft policy (it raised, or chose a
            width outside ``[0, max_steps]``: `specstate.engine.capabilities.draft_guard`), or None.
        verify_budget: the verify-budget policy's state (`BudgetGuardSnapshot`: the rows it
            planned at each budget, what disabled it), or None when the engine has none.
    """

    num_waiting: int
    num_prefilling: int
    num_running: int
    num_in_flight: int
    num_open_slots: int
    num_free_pages: int
    num_pages: int
    deferred_releases: tuple[str, ...]
    quarantined: tuple[str, ...]
    metrics: AcceptMetrics
    prefix_cache: PrefixCacheSnapshot | None = None
    draft_policy_failure: str | None = None
    verify_budget: BudgetGuardSnapshot | None = None
