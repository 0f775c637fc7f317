"""The prefix cache under speculation, through the real engine: lossless, same acceptance.

Every algorithm (none, draft_model, eagle, ngram, and the hidden-state drafters mtp, eagle3 and
frozen_kv_mtp; chains and EAGLE-2-style trees) serves two
waves of requests with the cache on, the invariant checker after every step: the second wave's
prompts share long prefixes with the first wave's (the next turn of a conversation: prompt +
output + new text; a prompt that is a prefix of an earlier output; the same prompt again, so
its last token is recomputed; a prompt that runs past a stop into tokens the user never saw).
Outputs equal Hugging Face ``generate()`` token for token; the second wave hit the cache; and,
without mixed chunks, every request's per-round accept lengths equal those of the same
workload with the cache off (a wrong draft KV entry, feature or token history on a cached
prefix changes acceptance, which the token oracle cannot see). Drafters agree with the target
only partly, so accept lengths strictly between 1 and the maximum occur.

Under KV pressure the cache is evicted and requests retracted, still lossless.
"""

from __future__ import annotations

import attrs
import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import FAMILIES, SpecCheckpoints, family_options

from specstate import Engine, EngineConfig, Req, RequestLimits, SamplingParams
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

NEW_TOKENS = 12
NUM_STEPS = 3
BASE = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39]
SHAPES = (  # (algorithm, topk)
    ("none", 1),
    ("draft_model", 1),
    ("draft_model", 2),
    ("eagle", 1),
    ("eagle", 2),
    ("ngram", 1),
    ("mtp", 1),
    ("eagle3", 1),
    ("eagle3", 2),
    ("frozen_kv_mtp", 1),
)
CONFIGS = (  # (overlap, page size, chunked prefill, mixed chunk)
    (False, 1, None, False),
    (True, 1, 4, True),
    (False, 16, 4, True),
    (True, 16, 4, False),
)


@attrs.frozen
class Turn:
    """One request of the workload and what the oracle says it emits."""

    prompt: tuple[int, ...]
    stop: int | None
    want: tuple[int, ...]


@attrs.frozen
class Workload:
    """Two waves of requests; the second shares prefixes with the first's prompts and outputs."""

    waves: tuple[tuple[Turn, ...], ...]


def _turn(ckpt: SpecCheckpoints, prompt: list[int], stop_at: int | None = None) -> Turn:
    """A request of ``prompt``; ``stop_at``: stop at the oracle's token at that output index."""
    out = greedy(ckpt.hf, prompt, NEW_TOKENS)
    if stop_at is None:
        return Turn(tuple(prompt), None, tuple(out))
    stop = out[stop_at]
    return Turn(tuple(prompt), stop, tuple(out[: out.index(stop) + 1]))


def make_workload(ckpt: SpecCheckpoints) -> Workload:
    """The two waves of the module docstring, built from the oracle's outputs."""
    first = _turn(ckpt, BASE)
    side = [*BASE[:14], 5, 6]
    stopped = _turn(ckpt, side, stop_at=5)
    full = greedy(ckpt.hf, side, NEW_TOKENS)  # tokens the engine settles past the stop
    second = (
        _turn(ckpt, [*BASE, *first.want, 7, 8, 9]),  # the next turn of the conversation
        _turn(ckpt, [*BASE, *first.want[:5]]),  # a prefix of an earlier output
        _turn(ckpt, BASE),  # the same prompt: its last token is recomputed
        _turn(ckpt, [*side, *full[: len(stopped.want) + 2]], stop_at=3),  # past the stop
        _turn(ckpt, [*side, *stopped.want, 11, 12]),  # the stopped one's next turn
    )
    return Workload(waves=((first, stopped), second))


def spec_worker(ckpt: SpecCheckpoints, algorithm: str, topk: int = 1) -> WorkerProtocol:
    """A reference worker on the partly agreeing drafters (trees: 2 branches, 6 nodes)."""
    options: dict[str, object] = {"target": ckpt.target}
    if algorithm != "none":
        options["num_steps"] = NUM_STEPS
    if topk > 1:
        options.update(topk=topk, num_draft_tokens=6)
    if algorithm == "draft_model":
        options["draft"] = ckpt.draft
    if algorithm == "eagle":
        options["eagle"] = ckpt.eagle
    if algorithm in FAMILIES:
        options.update(family_options(ckpt.target, algorithm))
    return default_registry().create(algorithm, **options)


@attrs.frozen
class Served:
    """What one run of the workload did."""

    reqs: tuple[Req, ...]
    waves: tuple[int, ...]  # the wave of each request
    retracted: tuple[str, ...]
    evicted_pages: int
    hit_tokens: int


def serve(
    worker: WorkerProtocol,
    workload: Workload,
    *,
    options: dict[str, object],
    kv_tokens: int = 4096,
) -> Served:
    """Serve the waves one after the other (each to idle), every check on after every step."""
    config = EngineConfig(
        kv_tokens=kv_tokens,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **options,  # type: ignore[arg-type]
    )
    limits = RequestLimits(vocab_size=97, max_context_len=160)
    reqs: list[Req] = []
    waves: list[int] = []
    retracted: list[str] = []
    with Engine(worker, limits=limits, config=config) as engine:
        for w, wave in enumerate(workload.waves):
            for i, turn in enumerate(wave):
                stops = () if turn.stop is None else (turn.stop,)
                params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=stops)
                reqs.append(engine.submit(f"w{w}r{i}", turn.prompt, params))
                waves.append(w)
            retracted += run_checked(engine).retracted
        snap = engine.snapshot()
    cache = snap.prefix_cache
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    return Served(
        reqs=tuple(reqs),
        waves=tuple(waves),
        retracted=tuple(retracted),
        evicted_pages=0 if cache is None else cache.num_evicted_pages,
        hit_tokens=0 if cache is None else cache.num_hit_tokens,
    )


def _wants(workload: Workload) -> list[list[int]]:
    return [list(t.want) for wave in workload.waves for t in wave]


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """The session's target with partly agreeing drafters."""
    return partial_ckpt


@pytest.fixture(scope="module")
def workload(ckpt: SpecCheckpoints) -> Workload:
    """The two waves and the oracle's outputs, built once."""
    return make_workload(ckpt)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "topk"), SHAPES)
@pytest.mark.parametrize(("overlap", "page_size", "chunked", "mixed"), CONFIGS)
def test_lossless_with_the_prefix_cache(
    ckpt: SpecCheckpoints,
    workload: Workload,
    algorithm: str,
    topk: int,
    overlap: bool,
    page_size: int,
    chunked: int | None,
    mixed: bool,
) -> None:
    """HF-exact with the cache on; hits happened; without mixed chunks, the same acceptance."""
    options: dict[str, object] = {
        "overlap": overlap,
        "page_size": page_size,
        "chunked_prefill": chunked,
        "mixed_chunk": mixed,
    }
    on = serve(spec_worker(ckpt, algorithm, topk), workload, options=options)
    assert [list(r.emitted_ids) for r in on.reqs] == _wants(workload)
    hits = [r.cached_tokens for r, w in zip(on.reqs, on.waves, strict=True) if w == 1]
    assert min(hits) >= page_size and on.hit_tokens == sum(r.cached_tokens for r in on.reqs)
    if algorithm != "none":
        runs = {a for r in on.reqs for a in r.accept_lengths}
        assert runs & set(range(2, NUM_STEPS + 1)), runs  # partial acceptance happened
        if algorithm not in FAMILIES:  # (theirs: the families' own matrices stop inside runs)
            assert any(r.num_outputs > len(r.emitted_ids) for r in on.reqs)  # stop inside a run
    if mixed:
        return  # mixed tails are not verify rounds: the rounds differ with the prefill length
    off = serve(
        spec_worker(ckpt, algorithm, topk), workload, options={**options, "prefix_cache": False}
    )
    assert off.hit_tokens == 0
    assert [r.accept_lengths for r in on.reqs] == [r.accept_lengths for r in off.reqs]


@pytest.mark.parametrize("algorithm", FAMILIES)
def test_speculation_keeps_the_cache_hits_of_plain_decoding(
    ckpt: SpecCheckpoints, workload: Workload, algorithm: str
) -> None:
    """A hidden-state drafter's state rides the cached prefix: its requests hit the cache at
    least 0.9x as many tokens as plain decoding's."""
    options: dict[str, object] = {"overlap": True, "page_size": 4}
    plain = serve(spec_worker(ckpt, "none"), workload, options=options)
    spec = serve(spec_worker(ckpt, algorithm), workload, options=options)
    assert plain.hit_tokens > 0
    assert spec.hit_tokens >= 0.9 * plain.hit_tokens, (spec.hit_tokens, plain.hit_tokens)


PRESSURE = (  # (algorithm, topk, overlap, page size, chunked prefill, mixed chunk)
    ("none", 1, False, 1, None, False),
    ("eagle", 1, True, 16, None, False),
    ("draft_model", 2, True, 1, 4, True),
    ("ngram", 1, False, 16, 8, False),
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "topk", "overlap", "page_size", "chunked", "mixed"), PRESSURE
)
def test_kv_pressure_evicts_the_cache_then_retracts_and_stays_lossless(
    ckpt: SpecCheckpoints,
    algorithm: str,
    topk: int,
    overlap: bool,
    page_size: int,
    chunked: int | None,
    mixed: bool,
) -> None:
    """A pool too small for the second wave: cached pages are evicted, requests retracted."""
    first = tuple(_turn(ckpt, [*BASE[i:], *BASE[:i]]) for i in (0, 5, 10, 15))
    turns = tuple(
        _turn(ckpt, [*t.prompt, *t.want[:4], 60 + i, 61 + i]) for i, t in enumerate(first)
    )
    shared = tuple(_turn(ckpt, [*t.prompt[:20], 70 + i]) for i, t in enumerate(first))
    workload = Workload(waves=(first, turns + shared))
    served = serve(
        spec_worker(ckpt, algorithm, topk),
        workload,
        kv_tokens=160 if page_size == 1 else 192,
        options={
            "overlap": overlap,
            "page_size": page_size,
            "chunked_prefill": chunked,
            "mixed_chunk": mixed,
        },
    )
    assert [list(r.emitted_ids) for r in served.reqs] == _wants(workload)
    assert served.hit_tokens > 0, "no prefix was shared"
    assert served.evicted_pages > 0, "nothing was evicted"
    assert served.retracted, "nobody was retracted"
