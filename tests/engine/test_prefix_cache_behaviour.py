"""What the prefix cache keeps, when, and how it reports it, through the real engine.

A finished request caches exactly its committed KV of tokens the user saw (never the pending
bonus, never a stop's tail), and a later request is served exactly that, in production mode
too; an aborted one caches nothing; under overlap a finish inserts only
after its deferred release; no forward writes a cached page; a whole-prompt hit recomputes the
last token; speculation costs no hits when memory holds the cache; a worker whose state at p
depends on token p + 1 keeps its acceptance only with BIGRAM keys; the snapshot, the trace and
the Prometheus metrics report the cache.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy
from prometheus_client import CollectorRegistry, generate_latest
from spec_checkpoints import SpecCheckpoints
from successor_worker import SuccessorWorker

from specstate import Engine, EngineConfig, FinishReason, Req, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.metrics import register_metrics
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.memory.prefix_cache import PrefixSharing
from specstate.reference.workers import DraftModelWorker, EagleWorker, default_registry
from specstate.tools.trace import summarize

BASE = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71]
LIMITS = RequestLimits(vocab_size=97, max_context_len=256)


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """The session's target with partly agreeing drafters."""
    return partial_ckpt


def _config(**options: object) -> EngineConfig:
    options = {"kv_tokens": 2048, **options}
    return EngineConfig(
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **options,  # type: ignore[arg-type]
    )


def _cached(engine: Engine, tokens: list[int]) -> int:
    """How many leading positions of ``tokens`` the cache holds (one dummy token past them, so
    the match may cover every one of them)."""
    match = engine.allocator.match_prefix([*tokens, 0])
    return 0 if match is None else match.num_tokens


def _serve(engine: Engine, prompt: list[int], **params: object) -> Req:
    req = engine.submit(f"r{engine.rounds.num_launched}", prompt, SamplingParams(**params))  # type: ignore[arg-type]
    run_checked(engine)
    return req


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_finish_caches_its_committed_visible_prefix_only(
    ckpt: SpecCheckpoints, page_size: int
) -> None:
    """A stop inside an accepted run: only KV below the stop is cached, never the bonus's."""
    out = greedy(ckpt.hf, BASE, 16)
    worker = ckpt.worker("draft_model")  # agreeing drafter: whole runs are accepted
    with Engine(worker, limits=LIMITS, config=_config(page_size=page_size)) as engine:
        stopped = _serve(engine, BASE, max_new_tokens=16, stop_token_ids=(out[5],))
        assert stopped.finish is not None and stopped.finish.reason is FinishReason.STOP
        settled = [*BASE, *stopped.output_ids]
        assert stopped.num_outputs > stopped.finish.finished_len  # the run went past the stop
        visible = len(BASE) + stopped.finish.finished_len
        assert _cached(engine, settled) == visible // page_size * page_size
        # A request that ends by its length cap: everything but its last token (the bonus,
        # whose KV no verify wrote) is committed and cached.
        capped = _serve(engine, [*BASE[:7], 1], max_new_tokens=9, ignore_eos=True)
        seq = [*BASE[:7], 1, *capped.output_ids]
        committed = len(seq) - 1 if capped.num_outputs == 9 else len(BASE[:7]) + 1 + 9
        assert _cached(engine, seq) == committed // page_size * page_size


@pytest.mark.parametrize("checking", [True, False], ids=["checked", "production"])
@pytest.mark.parametrize(
    ("algorithm", "overlap"), [("none", False), ("draft_model", True)], ids=["plain", "spec"]
)
def test_kv_past_the_committed_length_is_never_served_from_the_cache(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool, checking: bool
) -> None:
    """A request ends by its length cap, its last token's KV never written (no verify took it
    as a root; with speculation, a rejected draft's KV may sit in that slot). A later request
    whose prompt holds that whole sequence is served exactly the committed positions from the
    cache and emits HF's tokens, also in production mode, where no run-time check would refuse
    an insert past the committed length."""
    worker = ckpt.worker(algorithm, agreeing=False)
    config = attrs.evolve(
        _config(page_size=1, overlap=overlap),
        check_invariants=checking,
        check_ownership=checking,
        debug_relay=checking,
    )
    with Engine(worker, limits=LIMITS, config=config) as engine:
        first = engine.submit("first", BASE, SamplingParams(max_new_tokens=10, ignore_eos=True))
        (run_checked if checking else Engine.run_until_idle)(engine)
        assert first.finish is not None and first.finish.reason is FinishReason.LENGTH
        # Its last run ended at the cap (not past it): the last token is the pending bonus.
        assert first.num_outputs == 10
        seq = [*BASE, *first.emitted_ids]
        committed = len(seq) - 1
        prompt = [*seq, 5, 17]
        later = engine.submit("later", prompt, SamplingParams(max_new_tokens=6, ignore_eos=True))
        (run_checked if checking else Engine.run_until_idle)(engine)
    assert later.cached_tokens == committed
    assert list(later.emitted_ids) == greedy(ckpt.hf, prompt, 6)


def test_an_aborted_request_caches_nothing(ckpt: SpecCheckpoints) -> None:
    """Its prompt was prefilled and decoded from, but an abort inserts nothing."""
    with Engine(ckpt.worker("eagle"), limits=LIMITS, config=_config(overlap=True)) as engine:
        req = engine.submit("a", BASE, SamplingParams(max_new_tokens=30, ignore_eos=True))
        for _ in range(4):
            engine.step()
        assert req.num_outputs > 0
        engine.abort("a")
        run_checked(engine)
        assert req.finish is not None and req.finish.reason is FinishReason.ABORT
        assert _cached(engine, [*BASE, *req.output_ids]) == 0
        snap = engine.snapshot().prefix_cache
        assert snap is not None and snap.num_cached_pages == 0


def test_a_finish_under_overlap_inserts_only_after_its_deferred_release(
    ckpt: SpecCheckpoints,
) -> None:
    """The finished request's pages reach the cache when the batch in flight retires."""
    with Engine(ckpt.worker("eagle"), limits=LIMITS, config=_config(overlap=True)) as engine:
        engine.submit("a", BASE, SamplingParams(max_new_tokens=6, ignore_eos=True))
        engine.submit("b", BASE[:9], SamplingParams(max_new_tokens=40, ignore_eos=True))
        seen = False
        while not engine.is_idle:
            report = engine.step()
            snap = engine.snapshot()
            assert snap.prefix_cache is not None
            if "a" in report.finished and "a" in snap.deferred_releases:
                seen = True
                assert snap.prefix_cache.num_inserted_pages == 0  # not yet
            if seen and "a" not in snap.deferred_releases:
                assert snap.prefix_cache.num_inserted_pages > 0
        assert seen, "the finish never happened under a batch in flight"


@attrs.define
class CacheAudit:
    """A worker wrapper: no forward changes the KV, draft KV or features of a cached page."""

    inner: DraftModelWorker | EagleWorker
    page_size: int
    pages: Callable[[], torch.Tensor] | None = None  # the cached pages, once the engine exists
    checked: int = 0

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's."""
        return self.inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the inner worker."""
        self.inner.attach(memory)

    def _state(self, slots: torch.Tensor) -> list[torch.Tensor]:
        inner = self.inner
        caches = [inner.target_model.kv_cache]
        extra: list[torch.Tensor] = []
        if isinstance(inner, EagleWorker):
            caches.append(inner.head.kv_cache)
            extra.append(inner.features[slots].clone())
        else:
            caches.append(inner.draft_model.kv_cache)
        for cache in caches:
            for layer in range(cache.num_layers):
                extra.extend(cache.gather(layer, slots))
        return extra

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Run the inner forward; the cached pages' state must not change."""
        assert self.pages is not None
        pages = self.pages()
        size = self.page_size
        slots = (pages[:, None] * size + torch.arange(size)).reshape(-1)
        before = self._state(slots)
        result = self.inner.forward_batch_generation(batch, on_publish=on_publish)
        after = self._state(slots)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        self.checked += int(slots.numel() > 0)
        return result


@pytest.mark.parametrize(("algorithm", "page_size"), [("eagle", 1), ("draft_model", 4)])
def test_no_forward_writes_a_cached_page(
    ckpt: SpecCheckpoints, algorithm: str, page_size: int
) -> None:
    """Target KV, draft KV and EAGLE features of every cached page stay as they were."""
    inner = ckpt.worker(algorithm, agreeing=False)
    assert isinstance(inner, DraftModelWorker | EagleWorker)
    audit = CacheAudit(inner, page_size)
    config = _config(overlap=False, page_size=page_size, chunked_prefill=8, mixed_chunk=True)
    with Engine(audit, limits=LIMITS, config=config) as engine:
        prefix = engine.allocator.prefix
        assert prefix is not None
        audit.pages = lambda: torch.from_numpy(prefix.cache.pages_and_refs()[0])
        first = _serve(engine, BASE, max_new_tokens=10)
        prompts = [[*BASE, *first.output_ids, 5], [*BASE[:12], 6], BASE]
        reqs = [
            engine.submit(f"n{i}", p, SamplingParams(max_new_tokens=10))
            for i, p in enumerate(prompts)
        ]
        run_checked(engine)
    assert audit.checked > 0 and all(r.cached_tokens > 0 for r in reqs)
    for req, prompt in zip(reqs, prompts, strict=True):
        assert list(req.emitted_ids) == greedy(ckpt.hf, prompt, 10)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_whole_prompt_hit_recomputes_its_last_token(
    ckpt: SpecCheckpoints, page_size: int
) -> None:
    """The same 32-token prompt again: all but the last token (whole pages) come cached."""
    prompt = [*BASE, *BASE[:11]]
    with Engine(ckpt.worker("eagle"), limits=LIMITS, config=_config(page_size=page_size)) as engine:
        first = _serve(engine, prompt, max_new_tokens=8)
        again = _serve(engine, prompt, max_new_tokens=8)
    assert first.cached_tokens == 0
    assert again.cached_tokens == (len(prompt) - 1) // page_size * page_size
    assert again.emitted_ids == first.emitted_ids
    assert again.accept_lengths == first.accept_lengths  # the first round on a cached prefix


def _conversation(engine: Engine, turns: int) -> tuple[int, list[list[int]]]:
    """Four conversations, each turn = the previous prompt + its output + new text."""
    prompts = [[(7 * c + 3 * i) % 97 for i in range(12)] for c in range(4)]
    outputs = []
    for t in range(turns):
        params = SamplingParams(max_new_tokens=10, ignore_eos=True)
        reqs = [engine.submit(f"c{c}t{t}", p, params) for c, p in enumerate(prompts)]
        run_checked(engine, max_steps=3000)
        for c, req in enumerate(reqs):
            outputs.append(list(req.emitted_ids))
            prompts[c] = [*prompts[c], *req.emitted_ids, (c * 11 + t * 5) % 97, c]
    snap = engine.snapshot().prefix_cache
    assert snap is not None and snap.num_evicted_pages == 0
    return snap.num_hit_tokens, outputs


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_speculation_costs_no_hits_when_memory_holds_the_cache(
    ckpt: SpecCheckpoints, page_size: int
) -> None:
    """Multi-turn, equal KV memory: every algorithm hits at least what plain decoding hits.

    At most one token more per request: an accepted run that passes the length cap commits
    the KV of the last emitted token, which plain decoding never writes.
    """
    results = {}
    for algorithm in ("none", "draft_model", "eagle", "ngram"):
        with Engine(
            ckpt.worker(algorithm, agreeing=False),
            limits=LIMITS,
            config=_config(page_size=page_size, kv_tokens=1024),
        ) as engine:
            results[algorithm] = _conversation(engine, turns=4)
    hits, outputs = results.pop("none")
    assert hits > 0
    for algorithm, (spec_hits, spec_outputs) in results.items():
        assert spec_outputs == outputs, algorithm
        assert hits <= spec_hits <= hits + 16, (algorithm, hits, spec_hits)


def test_bigram_keys_keep_the_acceptance_of_a_next_token_drafter(ckpt: SpecCheckpoints) -> None:
    """A drafter whose state at p holds token p + 1: BIGRAM keys keep acceptance, TOKEN not.

    Request B shares A's prompt up to and including token z, then differs (x, not A's y); B's
    first emitted token is z again, so the drafter looks at the position of the shared z, whose
    stored successor is x for B but y for A, and y is what the target emits next.
    """
    base, x, y = _successor_case(ckpt)
    waves = [[*base, y]], [[*base, x]]
    runs = {}
    for name, sharing, cache in (
        ("off", PrefixSharing.BIGRAM, False),
        ("bigram", PrefixSharing.BIGRAM, True),
        ("token", PrefixSharing.TOKEN, True),
    ):
        worker = SuccessorWorker(target=ckpt.target, sharing=sharing)
        with Engine(worker, limits=LIMITS, config=_config(prefix_cache=cache)) as engine:
            reqs = []
            for w, wave in enumerate(waves):
                reqs += [engine.submit(f"w{w}", p, SamplingParams(max_new_tokens=8)) for p in wave]
                run_checked(engine)
        runs[name] = ([r.accept_lengths for r in reqs], [r.cached_tokens for r in reqs])
        assert [list(r.emitted_ids) for r in reqs] == [greedy(ckpt.hf, p[0], 8) for p in waves]
    assert runs["bigram"][1][1] == len(base) - 1 and runs["token"][1][1] == len(base)
    assert runs["bigram"][0] == runs["off"][0]
    assert runs["token"][0] != runs["off"][0]  # the case is sharp: sharing by token changes it


def _successor_case(ckpt: SpecCheckpoints) -> tuple[list[int], int, int]:
    """A prompt ``base`` ending in z and tokens x != y such that greedy(base + [x]) = z, y..."""
    for shift in range(40):
        base = [(t + shift) % 97 for t in BASE[:12]]
        z = base[-1]
        if z in base[:-1]:
            continue
        for x in range(97):
            if x == z:
                continue
            first, second = greedy(ckpt.hf, [*base, x], 2)
            if first == z and second != x:
                return base, x, second
    raise AssertionError("no prompt has the property; change BASE")


def test_the_snapshot_trace_and_metrics_report_the_cache(
    ckpt: SpecCheckpoints, tmp_path: object
) -> None:
    """Hits and sizes agree between the snapshot, the trace summary and the metrics."""
    trace = TraceRecorder()
    engine = Engine(ckpt.worker("ngram"), limits=LIMITS, config=_config(), trace=trace)
    registry = CollectorRegistry()
    register_metrics(engine, registry)
    first = _serve(engine, BASE, max_new_tokens=8)
    second = _serve(engine, [*BASE, *first.emitted_ids, 4], max_new_tokens=8)
    engine.close()
    snap = engine.snapshot().prefix_cache
    assert snap is not None and second.cached_tokens == len(BASE) + 7
    assert (snap.num_admissions, snap.num_hit_tokens) == (2, second.cached_tokens)
    assert snap.num_queried_tokens == len(BASE) + second.seqlen - second.num_outputs
    summary = summarize(list(trace.records()))["prefix_cache"]
    assert summary["hit_tokens"] == snap.num_hit_tokens
    assert summary["queried_tokens"] == snap.num_queried_tokens
    assert summary["hit_rate"] == pytest.approx(snap.hit_rate)
    text = generate_latest(registry).decode()
    assert f"specstate_prefix_cache_hit_tokens_total {float(snap.num_hit_tokens)}" in text
    assert f"specstate_prefix_cache_pages {float(snap.num_cached_pages)}" in text


def test_the_cache_is_off_when_disabled_or_undeclared(ckpt: SpecCheckpoints) -> None:
    """``prefix_cache=False`` or a worker that declares no sharing: nothing is shared."""
    undeclared: WorkerProtocol = default_registry().create("ngram", target=ckpt.target)
    caps = undeclared.capabilities
    assert caps.prefix_sharing is PrefixSharing.TOKEN
    for worker, config in (
        (ckpt.worker("ngram"), _config(prefix_cache=False)),
        (_Undeclared(undeclared), _config()),
    ):
        with Engine(worker, limits=LIMITS, config=config) as engine:
            _serve(engine, BASE, max_new_tokens=4)
            again = _serve(engine, BASE, max_new_tokens=4)
            assert again.cached_tokens == 0 and engine.snapshot().prefix_cache is None


@attrs.define
class _Undeclared:
    """A worker that declares no prefix sharing (the default)."""

    inner: WorkerProtocol

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's, without the sharing declaration."""
        return attrs.evolve(self.inner.capabilities, prefix_sharing=PrefixSharing.NONE)

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the inner worker."""
        self.inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The inner forward."""
        return self.inner.forward_batch_generation(batch, on_publish=on_publish)
