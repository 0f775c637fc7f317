"""Test-only: programs that spawned ranks run (`specstate.distributed.spawn_ranks`).

Each is a module-level function ``program(group, *args)`` whose return value travels back to
the test in the parent; one spawn runs a whole matrix, because starting a rank costs seconds.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvalidConfig
from specstate.core.params import RequestLimits, SamplingParams
from specstate.distributed.engine import DistributedEngine
from specstate.distributed.groups import RankGroup
from specstate.engine.budgets import BudgetRows, SettledBudgets, VerifyBudgetPolicy
from specstate.engine.config import EngineConfig
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.memory.host_arrays import IntArray
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.model import AttentionBatch, TreeAttentionBatch, TreeMask
from specstate.reference.workers import default_registry
from specstate.reference.workers.sources import build_model

NUM_SLOTS = 256
ROW_WIDTH = 48


def _table(seed: int) -> torch.Tensor:
    """A req_to_token table of 4 rows of scattered slots (row 0 padding)."""
    gen = random.Random(seed)
    slots = list(range(1, NUM_SLOTS))
    gen.shuffle(slots)
    table = torch.zeros(4, ROW_WIDTH, dtype=torch.int64)
    for row in range(1, 4):
        table[row] = torch.tensor(slots[(row - 1) * ROW_WIDTH : row * ROW_WIDTH])
    return table


def _batch(table: torch.Tensor, parts: list[tuple[int, int, list[int]]]) -> AttentionBatch:
    """An extend over ``(row, prefix, new ids)`` parts, on the table's device."""
    ids: list[int] = []
    positions: list[int] = []
    locs: list[int] = []
    for row, prefix, new in parts:
        ids += new
        positions += range(prefix, prefix + len(new))
        locs += table[row, prefix : prefix + len(new)].tolist()
    device = table.device
    return AttentionBatch(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        out_cache_loc=torch.tensor(locs, device=device),
        req_pool_indices=torch.tensor([p[0] for p in parts], device=device),
        req_to_token=table,
        prefix_lens=torch.tensor([p[1] for p in parts], device=device),
        extend_lens=torch.tensor([len(p[2]) for p in parts], device=device),
    )


def _forwards(vocab: int) -> list[list[tuple[int, int, list[int]]]]:
    """Packed prefill of three prompts, a chunk, 1-token decodes and a 4-token verify."""
    gen = random.Random(5)

    def ids(n: int) -> list[int]:
        return [gen.randrange(vocab) for _ in range(n)]

    return [
        [(3, 0, ids(7)), (1, 0, ids(12)), (2, 0, ids(3))],
        [(2, 3, ids(5))],
        [(3, 7, ids(1)), (1, 12, ids(1)), (2, 8, ids(1))],
        [(1, 13, ids(4)), (3, 8, ids(4))],
    ]


def _tree(table: torch.Tensor, vocab: int) -> TreeAttentionBatch:
    """A 4-node tree (root, two children, a grandchild) on row 1 after 17 tokens."""
    base = _batch(table, [(1, 17, [random.Random(9).randrange(vocab) for _ in range(4)])])
    visible = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    device = table.device
    return TreeAttentionBatch(
        input_ids=base.input_ids,
        positions=torch.tensor([17, 18, 18, 19], device=device),
        out_cache_loc=base.out_cache_loc,
        req_pool_indices=base.req_pool_indices,
        req_to_token=table,
        prefix_lens=base.prefix_lens,
        extend_lens=base.extend_lens,
        tree=TreeMask(start=torch.tensor([17], device=device), visible=visible.to(device)),
    )


def sharded_forwards(group: RankGroup, checkpoint: str) -> dict[str, object]:
    """The sharded model's outputs next to the whole model's, on every extend shape.

    Returns the largest logit and hidden-state differences, this rank's sharded logits (the
    parent compares the ranks bit for bit), the KV cache's head count, and the refusals.
    Everything runs on the group's device.
    """
    device = group.device
    whole = load_paged_llama(checkpoint, num_token_slots=NUM_SLOTS, device=device)
    sharded = load_paged_llama(
        checkpoint, num_token_slots=NUM_SLOTS, device=device, parallel=group.worker
    )
    copied = build_model(whole, num_token_slots=NUM_SLOTS, device=device, parallel=group.worker)
    table = _table(seed=1).to(device)
    logit_diff = hidden_diff = copy_diff = 0.0
    outputs: list[torch.Tensor] = []
    batches: list[AttentionBatch] = [
        _batch(table, parts) for parts in _forwards(whole.config.vocab_size)
    ]
    batches.append(_tree(table, whole.config.vocab_size))
    for batch in batches:
        ref, ours, other = whole(batch), sharded(batch), copied(batch)
        logit_diff = max(logit_diff, float((ours.logits - ref.logits).abs().max()))
        hidden_diff = max(hidden_diff, float((ours.hidden_states - ref.hidden_states).abs().max()))
        copy_diff = max(copy_diff, float((other.logits - ours.logits).abs().max()))
        outputs += [ours.logits, ours.hidden_states]
    refusals = []
    try:
        build_model(sharded, num_token_slots=NUM_SLOTS, device=device)
    except InvalidConfig as exc:
        refusals.append(str(exc))
    return {
        "logit_diff": logit_diff,
        "hidden_diff": hidden_diff,
        "copy_diff": copy_diff,
        "outputs": [t.cpu() for t in outputs],
        "kv_heads": sharded.kv_cache.gather(0, torch.tensor([0], device=device))[0].shape[1],
        "q_rows": sharded.state_dict()["layers.0.self_attn.q_proj.weight"].shape[0],
        "refusals": refusals,
    }


# ------------------------------------------------------------------- serving
LIMITS_VOCAB = 97


class FaultyWorker:
    """A worker that misbehaves at its first decode round, on the ranks told to.

    ``fault``: ``raise`` (a RuntimeError before the forward), ``raise_after`` (a RuntimeError
    after the whole forward, its collectives and publish done), ``sleep`` (``seconds`` before
    it), ``die`` (the process exits), ``perturb`` (every row that accepted more than one token
    accepts one fewer, consistently: frontier and publish follow), ``logprobs`` (every
    log-probability a little lower, tokens and accept lengths unchanged), or None (a plain
    pass-through).
    """

    def __init__(
        self,
        inner: WorkerProtocol,
        fault: str | None,
        *,
        seconds: float = 0.0,
        on_ranks: tuple[int, ...] | None = None,
        every_round: bool = False,
    ) -> None:
        self._inner = inner
        self._fault = fault
        self._seconds = seconds
        self._on_ranks = on_ranks  # None: as constructed; else only on these ranks (at attach)
        self._every_round = every_round
        self._fired = False

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's."""
        return self._inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the inner worker; a rank outside ``on_ranks`` drops the fault."""
        rank = 0 if memory.parallel is None else memory.parallel.rank
        if self._on_ranks is not None and rank not in self._on_ranks:
            self._fault = None
        self._inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The inner forward, with the fault at the first decode round."""
        fault = self._fault
        if fault is None or self._fired or batch.forward_mode is not ForwardMode.DECODE:
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        self._fired = not self._every_round
        if fault == "raise":
            raise RuntimeError("injected worker fault")
        if fault == "sleep":
            time.sleep(self._seconds)
        if fault == "die":
            os._exit(3)
        if fault == "raise_after":
            self._inner.forward_batch_generation(batch, on_publish=on_publish)
            raise RuntimeError("injected worker fault after the forward")
        if fault == "logprobs":
            result = self._inner.forward_batch_generation(batch, on_publish=on_publish)
            assert result.logprobs is not None, "the requests must ask for logprobs"
            return attrs.evolve(result, logprobs=result.logprobs - 1e-3)
        if fault != "perturb":
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        result = self._inner.forward_batch_generation(batch, on_publish=None)
        # Every row, not one: which row a request sits in changes as the persistent batch
        # refills and condenses its rows, and one row may keep accepting exactly one token.
        accept = torch.clamp(result.accept_lens - 1, min=1)
        assert result.new_seq_lens is not None
        frontier = result.new_seq_lens - (result.accept_lens - accept)
        if on_publish is not None:
            on_publish(frontier)
        return attrs.evolve(result, accept_lens=accept, new_seq_lens=frontier)


def reference_worker(ckpt: dict[str, str], algorithm: str, **options: object) -> WorkerProtocol:
    """A reference worker on the test checkpoints (``ckpt``: target, draft, eagle paths)."""
    opts: dict[str, object] = {"target": ckpt["target"], **options}
    if algorithm in ("draft_model", "eagle", "ngram", "mtp", "eagle3"):
        opts.setdefault("num_steps", 3)
    if algorithm == "draft_model":
        opts.setdefault("draft", ckpt["draft"])
    if algorithm == "eagle":
        opts["eagle"] = ckpt["eagle"]
    if algorithm == "mtp":
        opts["target"] = ckpt["mtp_target"]
    if algorithm == "eagle3":
        opts["eagle3"] = ckpt["eagle3"]
    return default_registry().create(algorithm, **opts)


def serve(
    group: RankGroup,
    worker: WorkerProtocol,
    config: EngineConfig,
    requests: list[tuple[str, tuple[int, ...], SamplingParams]],
    *,
    check: bool = True,
    aborts: tuple[tuple[int, str], ...] = (),
    verify_budget: VerifyBudgetPolicy | None = None,
) -> dict[str, object]:
    """Serve ``requests`` on every rank (rank 0 leads); what each request did, and any error.

    ``aborts``: ``(step, request id)`` pairs rank 0 aborts before that step; ``verify_budget``:
    the engines' verify-budget policy (rank 0's plans are broadcast).
    """
    started = time.monotonic()
    error: tuple[str, str] | None = None
    retracted = steps = 0
    limits = RequestLimits(vocab_size=LIMITS_VOCAB, max_context_len=256)
    outputs: dict[str, tuple[tuple[int, ...], str | None, str, tuple[int, ...]]] = {}
    verified: dict[str, tuple[int, ...]] = {}
    with DistributedEngine(
        worker,
        group=group,
        limits=limits,
        config=config,
        check_agreement=check,
        verify_budget=verify_budget,
    ) as engine:
        try:
            if engine.is_leader:
                for rid, prompt, sampling in requests:
                    engine.submit(rid, prompt, sampling)
                pending = dict(aborts)
                while not engine.is_idle:
                    if steps in pending:
                        engine.abort(pending[steps])
                    report = engine.step()
                    retracted += len(report.retracted)
                    steps += 1
            else:
                steps = engine.follow()
        except Exception as exc:
            error = (type(exc).__name__, str(exc))
        for rid, _, _ in requests:
            req = engine.request(rid)
            finish = req.finish
            outputs[rid] = (
                req.emitted_ids,
                None if finish is None else finish.reason.value,
                "" if finish is None else finish.detail,
                req.accept_lengths,
            )
            verified[rid] = req.verified_lengths
        checked = engine.agreement.num_checked
        snap = engine.snapshot()
        balanced = snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    return {
        "balanced": balanced,
        "outputs": outputs,
        "verified": verified,
        "error": error,
        "seconds": time.monotonic() - started,
        "retracted": retracted,
        "steps": steps,
        "checked": checked,
    }


def greedy_requests(
    prompts: list[tuple[int, ...]], n: int
) -> list[tuple[str, tuple[int, ...], SamplingParams]]:
    """Greedy requests ``r0, r1, ...`` of ``n`` new tokens."""
    return [(f"r{i}", p, SamplingParams(max_new_tokens=n)) for i, p in enumerate(prompts)]


PROMPTS = [(3, 14, 15, 92, 65, 35, 89), (79, 32), (38, 46, 26, 43, 38, 32, 79, 50, 28, 84)]
"""A small workload for the failure tests."""


def agreement_faults(group: RankGroup, ckpt: dict[str, str]) -> dict[str, object]:
    """The recoverable and the detected faults, in one spawn (the group survives each).

    ``result``: rank 1 perturbs an accept length; ``logprobs``: rank 1 reports different
    log-probabilities (nothing else differs); ``plan``: rank 1 admits fewer requests;
    ``both_raise``: every rank's worker raises at the same round (the batch fails, serving
    goes on); ``after``: a workload served after all of them.
    """
    config = EngineConfig(
        overlap=False, kv_tokens=1024, check_invariants=True, check_ownership=True
    )
    agreeing = {"draft": ckpt["target"]}  # a drafter equal to the target: every draft accepted
    out: dict[str, object] = {}
    fault = "perturb" if group.rank == 1 else None
    worker: WorkerProtocol = FaultyWorker(reference_worker(ckpt, "draft_model", **agreeing), fault)
    out["result"] = serve(group, worker, config, greedy_requests(PROMPTS, 8))
    fault = "logprobs" if group.rank == 1 else None
    worker = FaultyWorker(reference_worker(ckpt, "draft_model", **agreeing), fault)
    with_logprobs = [
        (rid, prompt, attrs.evolve(sampling, logprobs=True))
        for rid, prompt, sampling in greedy_requests(PROMPTS, 8)
    ]
    out["logprobs"] = serve(group, worker, config, with_logprobs)
    plan_config = attrs.evolve(config, max_running=4 if group.rank == 0 else 1)
    worker = reference_worker(ckpt, "draft_model", **agreeing)
    out["plan"] = serve(group, worker, plan_config, greedy_requests(PROMPTS, 8))
    worker = FaultyWorker(reference_worker(ckpt, "ngram"), "raise")
    out["both_raise"] = serve(group, worker, config, greedy_requests(PROMPTS, 8))
    out["after"] = serve(
        group, reference_worker(ckpt, "ngram"), config, greedy_requests(PROMPTS, 8)
    )
    return out


def fatal_fault(
    group: RankGroup, ckpt: dict[str, str], fault: str, overlap: bool
) -> dict[str, object]:
    """Rank 1's worker raises (before or after its forward), sleeps past the timeouts, or dies
    at the first decode round."""
    config = EngineConfig(
        overlap=overlap, kv_tokens=1024, check_invariants=True, check_ownership=True
    )
    worker = FaultyWorker(
        reference_worker(ckpt, "ngram"),
        fault if group.rank == 1 else None,
        seconds=2.5 * group.timeout_s,
    )
    return serve(group, worker, config, greedy_requests(PROMPTS, 8))


def lossless_matrix(
    group: RankGroup, ckpt: dict[str, str], scenarios: list[dict[str, Any]]
) -> dict[str, dict[str, object]]:
    """Serve every scenario (algorithm, options, config, requests, aborts) in this spawn.

    A scenario with ``adaptive`` runs the adaptive draft policy (rank 0's widths, broadcast).
    """
    results = {}
    for scenario in scenarios:
        worker = reference_worker(ckpt, scenario["algorithm"], **scenario["options"])
        config = scenario["config"]
        if group.device.type == "cuda":  # each rank's engine on its own device
            config = attrs.evolve(config, device=str(group.device))
        results[scenario["name"]] = serve(
            group,
            worker,
            config,
            scenario["requests"],
            aborts=scenario.get("aborts", ()),
            verify_budget=RankSkewedBudgets(group.rank) if scenario.get("budgets") else None,
        )
    return results


class RankSkewedBudgets:
    """Ragged budgets that differ on every rank (the rank is mixed in): only rank 0's plan may
    reach the rounds, which the plan digests then show to be the same everywhere."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self._rounds = 0

    def plan(self, rows: BudgetRows) -> IntArray:
        self._rounds += 1
        return np.array(
            [(i + self._rounds + self._rank) % (rows.width + 1) for i in range(rows.batch_size)],
            dtype=np.int64,
        )

    def observe(self, settled: SettledBudgets) -> None:
        """Nothing to learn."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """Nothing kept."""


def skewed_worker(ckpt: dict[str, str]) -> WorkerProtocol:
    """An n-gram worker that, on rank 1 only, accepts one token fewer in every decode round
    (in every row that accepted more than one)."""
    return FaultyWorker(reference_worker(ckpt, "ngram"), "perturb", on_ranks=(1,), every_round=True)


def healthy_programs(
    group: RankGroup, model_dir: str, ckpt: dict[str, str], scenarios: list[dict[str, Any]]
) -> dict[str, object]:
    """Everything that leaves the group healthy, in one spawn: the sharded-model forwards, the
    lossless matrix, and the faults the group survives (`agreement_faults`)."""
    return {
        "sharded": sharded_forwards(group, model_dir),
        "matrix": lossless_matrix(group, ckpt, scenarios),
        "faults": agreement_faults(group, ckpt),
    }
