"""What a ``generate`` run shows: result rows in input order, the progress bar and the summary.

Rows are written as soon as a request and every earlier one have ended, so nothing computed is
lost if the run stops; the summary is a frozen `RunSummary`, printed to stderr and written by
``--summary-json``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any, Final

import attrs

from specstate.core.request import Req
from specstate.core.status import FinishReason

if TYPE_CHECKING:
    from specstate.engine.engine import Engine
    from specstate.engine.trace import TraceRecorder
    from specstate.serving.text import Codec

__all__ = ["Progress", "ResultWriter", "RunSummary", "write_trace"]


class ResultWriter:
    """Writes result rows in input order, each as soon as it and every earlier one ended."""

    def __init__(self, out: IO[str], reqs: list[Req], codecs: list[Codec | None]) -> None:
        self._out = out
        self._reqs = reqs
        self._codecs = codecs
        self._next = 0

    def flush_finished(self) -> None:
        """Write every finished request not written yet that follows the rows written."""
        while self._next < len(self._reqs) and self._reqs[self._next].is_finished:
            r = self._reqs[self._next]
            codec = self._codecs[self._next]
            row: dict[str, object] = {
                "id": r.request_id,
                "output_ids": list(r.emitted_ids),
                "finish_reason": None if r.finish is None else r.finish.reason.value,
                "accept_lengths": list(r.accept_lengths),
                "verified_lengths": list(r.verified_lengths),
                "draft_acceptance": [list(pair) for pair in r.draft_acceptance()],
                "cached_tokens": r.cached_tokens,
            }
            if codec is not None:
                row["text"] = codec.decode(r.emitted_ids)
            if r.logprobs is not None:
                row["logprobs"] = list(r.logprobs)
            if r.top_logprobs is not None:  # null: an alternative the filters removed (-inf)
                row["top_logprobs"] = [
                    [[t, v if v != -math.inf else None] for t, v in top] for top in r.top_logprobs
                ]
            if r.finish is not None and r.finish.reason is FinishReason.ERROR:
                row["error"] = r.finish.detail
            print(json.dumps(row), file=self._out, flush=True)
            self._next += 1


class Progress:
    """A tqdm bar of ended requests on stderr, with tokens, tok/s and acceptance as postfix."""

    _EVERY_S: Final = 0.5

    def __init__(self, reqs: list[Req], *, show: bool) -> None:
        self._reqs = reqs
        self._live = {id(r): r for r in reqs}
        self._done_tokens = 0
        self._start = self._last = time.perf_counter()
        self._bar: Any = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(
                total=len(reqs), unit="req", desc="generate", file=sys.stderr, dynamic_ncols=True
            )

    def step(self, engine: Engine, ended: Sequence[Req]) -> None:
        """After a step: count the requests that ended; refresh the postfix now and then."""
        for r in ended:
            if self._live.pop(id(r), None) is not None:
                self._done_tokens += len(r.emitted_ids)
        if self._bar is None:
            return
        if ended:
            self._bar.update(len(ended))
        if time.perf_counter() - self._last >= self._EVERY_S:
            self._postfix(engine)

    def _postfix(self, engine: Engine) -> None:
        self._last = now = time.perf_counter()
        tokens = self._done_tokens + sum(r.num_outputs for r in self._live.values())
        rate = tokens / (now - self._start) if now > self._start else 0.0
        accept = engine.snapshot().metrics.mean_accept_length
        self._bar.set_postfix_str(f"{tokens} tok, {rate:.1f} tok/s, accept {accept:.2f}")

    def close(self, engine: Engine) -> None:
        """Show the final numbers and end the bar's line."""
        if self._bar is not None:
            self._postfix(engine)
            self._bar.close()


def write_trace(recorder: TraceRecorder, trace: IO[str] | None, perfetto: IO[str] | None) -> None:
    """Write what was recorded (also after a failed run: it shows what happened)."""
    if trace is not None:
        for record in recorder.records():
            trace.write(json.dumps(record) + "\n")
    if perfetto is not None:
        json.dump({"traceEvents": recorder.chrome_trace(name="specstate generate")}, perfetto)


@attrs.frozen(kw_only=True)
class RunSummary:
    """What one run did: printed to stderr at the end, and ``--summary-json`` writes it.

    ``finished`` counts requests that ended by a stop or the length cap, ``failed`` those that
    ended with an error, ``aborted`` those the engine had to abort; ``wall_s`` runs from the
    first submit to the last result (``load_s``, building the worker and engine, is apart) and
    ``tokens_per_second`` is ``generated_tokens / wall_s``. A run drives one worker, so one
    algorithm: ``mean_accept_length`` is tokens per verify (bonus included; 1.0 without
    speculation) and ``draft_acceptance`` the share of proposed drafts accepted (None without
    drafts).
    """

    requests: int
    finished: int
    failed: int
    aborted: int
    finish_reasons: dict[str, int]
    prompt_tokens: int
    generated_tokens: int
    load_s: float
    wall_s: float
    tokens_per_second: float
    algorithm: str
    num_steps: int
    verifies: int
    mean_accept_length: float
    draft_acceptance: float | None
    overlap: bool
    threads: int
    device: str
    prefix_cache_hit_rate: float | None = None
    prefix_cache_hit_tokens: int = 0

    @classmethod
    def of(cls, engine: Engine, reqs: Sequence[Req], *, load_s: float, wall_s: float) -> RunSummary:
        """The summary of ``engine``'s run of ``reqs``."""
        import torch

        reasons = Counter(r.finish.reason.value for r in reqs if r.finish is not None)
        snap = engine.snapshot()
        metrics, cache = snap.metrics, snap.prefix_cache
        caps = engine.worker.capabilities
        generated = sum(len(r.emitted_ids) for r in reqs)
        proposed = metrics.num_proposed_drafts
        return cls(
            requests=len(reqs),
            finished=reasons["stop"] + reasons["length"],
            failed=reasons["error"],
            aborted=reasons["abort"],
            finish_reasons=dict(sorted(reasons.items())),
            prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
            generated_tokens=generated,
            load_s=round(load_s, 4),
            wall_s=round(wall_s, 4),
            tokens_per_second=round(generated / wall_s, 2) if wall_s > 0 else 0.0,
            algorithm=caps.algorithm,
            num_steps=caps.num_steps,
            verifies=metrics.num_verifies,
            mean_accept_length=round(metrics.mean_accept_length, 4),
            draft_acceptance=round(metrics.num_correct_drafts / proposed, 4) if proposed else None,
            overlap=engine.config.overlap,
            threads=torch.get_num_threads(),
            device=engine.config.device,
            prefix_cache_hit_rate=None if cache is None else round(cache.hit_rate, 4),
            prefix_cache_hit_tokens=0 if cache is None else cache.num_hit_tokens,
        )

    def lines(self) -> list[str]:
        """The summary for people, three lines (four with a prefix cache)."""
        aborted = f", {self.aborted} aborted" if self.aborted else ""
        reasons = ", ".join(f"{k} {v}" for k, v in self.finish_reasons.items()) or "none"
        if self.num_steps:
            drafts = (
                ""
                if self.draft_acceptance is None
                else f", {100 * self.draft_acceptance:.1f}% of drafts accepted"
            )
            accept = (
                f"{self.algorithm} K={self.num_steps}: mean accept length "
                f"{self.mean_accept_length:.2f} over {self.verifies} verifies{drafts}"
            )
        else:
            accept = f"{self.algorithm}: no speculation (1 token per verify)"
        return [
            f"{self.requests} requests: {self.finished} finished, {self.failed} failed"
            f"{aborted} (finish reasons: {reasons})",
            f"{self.generated_tokens} tokens in {self.wall_s:.2f} s = "
            f"{self.tokens_per_second:.1f} tok/s (prompts {self.prompt_tokens} tokens; load "
            f"{self.load_s:.2f} s; {self.threads} torch thread(s), "
            f"{'overlap' if self.overlap else 'normal'} loop on {self.device})",
            accept,
            *self._cache_lines(),
        ]

    def _cache_lines(self) -> list[str]:
        if self.prefix_cache_hit_rate is None:
            return []
        return [
            f"prefix cache: hit rate {100 * self.prefix_cache_hit_rate:.1f}% "
            f"({self.prefix_cache_hit_tokens} prefill tokens came from the cache)"
        ]
