"""``specstate bench grammar``: the per-round host cost of grammar rows, next to plain rows.

Every request of a steady decode batch (1, 64, 256 by default) runs one chain round per step
through the real engine, once without grammars and once with every request under a JSON schema
(an endless array of small objects, so no request finishes in the timed window). The worker
(`GrammarBenchWorker`) does no model work: it plays a chain drafter through the grammar
contract of docs/workers.md — masked draft steps, the verify masks, the accepted runs — choosing
each token as the best one its mask allows under a fixed score table, and accepting drafts at a
synthetic rate, so rejected drafts are rolled back every round. Reported per batch size, medians
of alternated rounds in µs:

* ``plain``: `Engine.step` of the round without grammars;
* ``grammar``: `Engine.step` of the round with grammars;
* ``rows``: the CPU time spent inside `GrammarRows` calls on the forward stream (masks,
  pushes, rollbacks, the next round's first masks), measured by the worker;
* ``table``: the CPU time of the grammar table's host work of the round (the view at launch,
  the commit and checks at settlement);
* ``per_row``: ``(rows + table) / bs``, specstate's grammar cost per request and round (the
  rest of ``grammar - plain`` is the bench worker's own token choice from the masks, which a
  real engine does on its device).

The vocabulary is the embedded model's (260 byte-level ids), the loop the normal one by default
(``--overlap`` for the overlap loop), the chain 3 steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, TypeVar

import attrs
import numpy as np
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.grammar.rows import RowMasks
from specstate.grammar.spec import Grammar, GrammarVocabulary
from specstate.relay.future_map import RelayPayload
from specstate.tools.bench_steady import decode_whole
from specstate.tools.cli_types import positive, positive_ints

__all__ = ["GrammarBenchWorker", "add_arguments", "run"]

VOCAB: Final = 260
EOS: Final = 257
SCHEMA: Final = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "tag": {"enum": ["a", "bc", "def"]}},
        "required": ["id", "tag"],
    },
}
_PROMPT: Final = tuple(range(40, 72))
_T = TypeVar("_T")
_cpu_clock = time.thread_time
"""The grammar parts are timed in CPU time of the thread that runs them: on a shared machine a
thread that is descheduled mid-call would otherwise be charged for other processes' work."""
_WARMUP: Final = 8


class GrammarBenchWorker:
    """A chain drafter of ``num_steps`` that does no model work but serves grammars.

    Each token is the one its mask allows with the highest score in a fixed table (which ranks
    ``]`` and EOS last, so an array never closes); draft ``k`` is accepted with probability
    ``accept_rates[k - 1]`` given the ones before it; a rejected position takes its second
    best allowed token. Rows without a grammar take a constant token.

    Args:
        num_steps: draft steps per round.
        accept_rates: synthetic acceptance per draft position.
        seed: seeds the acceptance draws and the score table.
    """

    def __init__(
        self,
        *,
        num_steps: int = 3,
        accept_rates: Sequence[float] = (0.7, 0.5, 0.3),
        seed: int = 0,
    ) -> None:
        self._num_steps = num_steps
        self._rates = np.asarray(accept_rates, dtype=float)
        self._rng = np.random.default_rng(seed)
        scores = np.random.default_rng(seed + 1).random((num_steps + 2, VOCAB))
        scores[:, [ord("]"), EOS]] = -1.0
        self._scores = scores
        self.grammar_seconds: list[float] = []  # time inside GrammarRows calls, per forward

    @property
    def capabilities(self) -> WorkerCapabilities:
        """A chain of ``num_steps`` that serves grammars."""
        caps = WorkerCapabilities.chain(
            "grammar_bench", num_steps=self._num_steps, keeps_draft_kv=False
        )
        return attrs.evolve(caps, supports_grammar=True)

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build."""

    def _choose(self, masks: RowMasks | None, size: int, step: int, rank: int = 0) -> torch.Tensor:
        tokens = np.full(size, 65, dtype=np.int64)
        if masks is not None:
            packed = masks.bitmask.numpy().reshape(masks.bitmask.shape[0], -1)
            bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
            scored = np.where(bits == 1, self._scores[step], -2.0)
            order = np.argsort(-scored, axis=1)[:, : rank + 1]
            pick = order[:, rank] if rank else order[:, 0]
            fallback = order[:, 0]
            # A second choice never closes the array (score -1): the best one is taken then.
            chosen = np.where(scored[np.arange(len(pick)), pick] >= 0.0, pick, fallback)
            tokens[masks.rows.numpy()] = chosen
        return torch.from_numpy(tokens)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Play one forward through ``batch.grammar``; no model work."""
        rows = batch.batch_size
        grammar = batch.grammar
        spent = 0.0
        if not batch.forward_mode.is_decode():
            start = _cpu_clock()
            masks = None if grammar is None else grammar.sample_masks()
            spent += _cpu_clock() - start
            tokens = self._choose(masks, rows, 0)
            start = _cpu_clock()
            if grammar is not None:
                grammar.accept_sampled(tokens)
            spent += _cpu_clock() - start
            self.grammar_seconds.append(spent)
            if on_publish is not None:
                on_publish(batch.seq_lens)
            return GenerationBatchResult(
                next_token_ids=tokens,
                accept_lens=torch.ones(rows, dtype=torch.int64),
                stride=1,
                new_seq_lens=batch.seq_lens.clone(),
                next_draft_input=RelayPayload(bonus_tokens=tokens.clone()),
            )
        k = self._num_steps
        drafts = []
        for step in range(k):
            start = _cpu_clock()
            masks = None if grammar is None else grammar.draft_masks()
            spent += _cpu_clock() - start
            token = self._choose(masks, rows, step + 1)
            start = _cpu_clock()
            if grammar is not None:
                grammar.push_drafts(token)
            spent += _cpu_clock() - start
            drafts.append(token)
        chain = torch.stack(drafts, dim=1)
        start = _cpu_clock()
        verify = None if grammar is None else grammar.verify_masks(chain)
        spent += _cpu_clock() - start
        hits = self._rng.random((rows, k)) < self._rates
        accept = torch.from_numpy(1 + np.cumprod(hits, axis=1).sum(axis=1).astype(np.int64))
        run = torch.cat([chain, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
        for m in range(k + 1):  # the bonus at m: second best where a draft was rejected
            at = accept == m + 1
            if bool(at.any()):
                masks = None
                if verify is not None:
                    masks = RowMasks(rows=verify.rows, bitmask=verify.bitmask[:, m].contiguous())
                bonus = self._choose(masks, rows, m + 1, rank=1 if m < k else 0)
                run[:, m] = torch.where(at, bonus, run[:, m])
        new_seq_lens = batch.seq_lens + accept
        if on_publish is not None:
            on_publish(new_seq_lens)
        start = _cpu_clock()
        if grammar is not None:
            grammar.accept(run, accept)
        spent += _cpu_clock() - start
        self.grammar_seconds.append(spent)
        bonus_tokens = run.gather(1, (accept - 1)[:, None]).squeeze(1)
        return GenerationBatchResult(
            next_token_ids=run.reshape(-1),
            accept_lens=accept,
            stride=k + 1,
            new_seq_lens=new_seq_lens,
            next_draft_input=RelayPayload(bonus_tokens=bonus_tokens),
        )


@attrs.frozen(kw_only=True)
class _Row:
    """One batch size: medians in µs per steady decode round."""

    bs: int
    rounds: int
    plain_us: float
    grammar_us: float
    rows_us: float
    table_us: float
    per_row_us: float


@attrs.frozen(kw_only=True)
class _Run:
    """Per timed round: `Engine.step`, the worker's time in `GrammarRows` calls, and the
    grammar table's time at launch and settlement (seconds)."""

    step: list[float]
    rows: list[float]
    table: list[float]


def _engine(
    batch_size: int, rounds: int, *, grammar: bool, overlap: bool, mask_threads: int
) -> tuple[Any, ...]:
    from specstate import Engine, EngineConfig, RequestLimits, SamplingParams

    worker = GrammarBenchWorker()
    max_new = 4 * (rounds + _WARMUP + 8)
    context = len(_PROMPT) + max_new
    limits = RequestLimits(
        vocab_size=VOCAB,
        max_context_len=context,
        eos_token_ids={EOS},
        grammar_vocabulary=GrammarVocabulary.byte_level(VOCAB),
    )
    config = EngineConfig(
        overlap=overlap,
        page_size=16,
        kv_tokens=batch_size * (context + 64) + 64,
        max_running=batch_size,
        max_prefill_tokens=max(4096, batch_size * len(_PROMPT)),
        check_invariants=False,
        check_ownership=False,
        grammar_mask_threads=mask_threads,
    )
    params = SamplingParams(
        max_new_tokens=max_new, grammar=Grammar.json_schema(SCHEMA) if grammar else None
    )
    engine = Engine(worker, limits=limits, config=config)
    reqs = [engine.submit(f"bench-{i}", _PROMPT, params) for i in range(batch_size)]
    return engine, worker, reqs


def _timed(spent: list[float], method: Callable[..., _T]) -> Callable[..., _T]:
    """``method``, adding its wall time to ``spent[0]``."""

    def call(*args: Any, **kwargs: Any) -> _T:
        start = _cpu_clock()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += _cpu_clock() - start

    return call


def _run(
    batch_size: int, rounds: int, *, grammar: bool, overlap: bool, mask_threads: int = 1
) -> _Run:
    """Time ``rounds`` steady decode rounds of ``batch_size`` requests."""
    engine, worker, reqs = _engine(
        batch_size, rounds, grammar=grammar, overlap=overlap, mask_threads=mask_threads
    )
    table_time = [0.0]
    hooks = engine.rounds.hooks  # the grammar's points in the round, timed
    hooks.on_launch = tuple(
        _timed(table_time, h) if h == engine.grammar.on_launch else h for h in hooks.on_launch
    )
    hooks.on_result = tuple(
        _timed(table_time, h) if h == engine.grammar.on_result else h for h in hooks.on_result
    )
    with engine:
        decode_whole(engine, batch_size)
        for _ in range(_WARMUP):
            engine.step()
        first = len(worker.grammar_seconds)
        steps, tables = [], []
        gc.collect()
        gc.freeze()  # as the other benches: no collector pass inside a timed round
        try:
            for _ in range(rounds):
                table_time[0] = 0.0
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
                tables.append(table_time[0])
        finally:
            gc.unfreeze()
        inside = worker.grammar_seconds[first : first + rounds]
        if any(r.is_finished for r in reqs):  # asked before close, which ends the rest
            raise RuntimeError(f"bs {batch_size}: a request finished inside the timed window")
    return _Run(step=steps, rows=inside, table=tables)


def _median_us(seconds: Sequence[float]) -> float:
    return round(statistics.median(seconds) * 1e6, 1) if seconds else 0.0


def _row(batch_size: int, rounds: int, repeats: int, overlap: bool, mask_threads: int = 1) -> _Row:
    plain: list[float] = []
    runs: list[_Run] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(repeats):  # alternated, so drift hits both alike
            plain += _run(batch_size, rounds, grammar=False, overlap=overlap).step
            runs.append(
                _run(batch_size, rounds, grammar=True, overlap=overlap, mask_threads=mask_threads)
            )
    finally:
        torch.set_num_threads(threads)
    rows = _median_us([s for r in runs for s in r.rows])
    table = _median_us([s for r in runs for s in r.table])
    return _Row(
        bs=batch_size,
        rounds=rounds * repeats,
        plain_us=_median_us(plain),
        grammar_us=_median_us([s for r in runs for s in r.step]),
        rows_us=rows,
        table_us=table,
        per_row_us=round((rows + table) / batch_size, 2),
    )


def add_arguments(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``grammar`` under ``specstate bench``."""
    parser = benches.add_parser("grammar", help="host cost per round of grammar rows vs plain")
    parser.add_argument(
        "--batch-sizes",
        type=positive_ints,
        default=(1, 64, 256),
        metavar="N,N,...",
        help="grammar requests per round (default: 1,64,256)",
    )
    parser.add_argument("--rounds", type=positive, default=40, help="timed rounds per run")
    parser.add_argument("--repeats", type=positive, default=3, help="alternated runs per size")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument(
        "--mask-threads",
        type=positive,
        default=1,
        metavar="N",
        help="EngineConfig.grammar_mask_threads of the grammar runs (default: 1, one mask after "
        "the other on the forward stream)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")
    parser.set_defaults(bench_run=run)


def run(args: argparse.Namespace) -> int:
    """Measure every batch size; print a table (or JSON)."""
    rows = []
    for bs in args.batch_sizes:
        print(f"bench grammar: bs {bs}, {args.repeats} x {args.rounds} rounds", file=sys.stderr)
        rows.append(_row(bs, args.rounds, args.repeats, args.overlap, args.mask_threads))
    if args.json:
        config = {
            "overlap": args.overlap,
            "vocab": VOCAB,
            "num_steps": 3,
            "mask_threads": args.mask_threads,
        }
        print(
            json.dumps(
                {"bench": "grammar", "config": config, "results": [attrs.asdict(r) for r in rows]},
                indent=2,
            )
        )
        return 0
    loop = "overlap" if args.overlap else "normal"
    threads = f", {args.mask_threads} mask threads" if args.mask_threads > 1 else ""
    print(
        f"Engine.step per steady decode round, µs ({loop} loop, chain K=3, vocab {VOCAB}{threads})"
    )
    print(f"{'bs':>5} {'plain':>10} {'grammar':>10} {'rows':>10} {'table':>8} {'µs/row':>8}")
    for r in rows:
        cells = f"{r.plain_us:>10.1f} {r.grammar_us:>10.1f} {r.rows_us:>10.1f} {r.table_us:>8.1f}"
        print(f"{r.bs:>5} {cells} {r.per_row_us:>8.2f}")
    return 0
