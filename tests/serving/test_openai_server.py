"""The OpenAI-compatible server, started for real on 127.0.0.1 and driven by the `openai` client.

The server runs uvicorn on a thread over an `AsyncEngine` on the embedded byte-level model with
a draft model (speculation and overlap on, the invariant checker after every step). Greedy
outputs are checked against HF ``generate()`` and against the same request run through an
`Engine` directly; seeded sampled outputs against `Engine` directly (a seeded request emits the
same tokens whatever its batch mates). No assertion is timed.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from hf_oracle import greedy
from serving_harness import Served, bounded, serving, speculative_usage, token_ids
from transformers import LlamaForCausalLM

from specstate import AsyncEngineSnapshot, Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.engine.worker import WorkerProtocol
from specstate.reference import embedded
from specstate.reference.workers import default_registry
from specstate.serving.openai_server import ServedModel
from specstate.tools.timed_worker import TimedWaitWorker

MODEL = "embedded-test"
LIMITS = RequestLimits(
    vocab_size=embedded.VOCAB_SIZE,
    max_context_len=1024,
    eos_token_ids={embedded.EOS_ID},
    grammar_vocabulary=embedded.grammar_vocabulary(),
)
TEXTS = (
    "def add(a, b):\n    return ",
    "import os\n\n\nclass Config:\n    def ",
    "for i in range(10):\n    ",
    "    if x is None:\n        ",
    "return self.",
    "# Copyright ",
    'def __repr__(self):\n        return f"',
    "try:\n    import ",
)
NEW = 16


def embedded_worker() -> WorkerProtocol:
    """The embedded target with its draft model, 4 draft steps, float32 (exact)."""
    return default_registry().create(
        "draft_model",
        target=embedded.target_dir(),
        draft=embedded.draft_dir(),
        num_steps=4,
        dtype=torch.float32,
    )


def embedded_engine() -> Engine:
    """An engine on `embedded_worker`, overlap on, checked after every step."""
    config = EngineConfig(
        overlap=True,
        page_size=16,
        kv_tokens=16384,
        max_running=64,
        check_invariants=True,
        check_ownership=True,
    )
    return Engine(embedded_worker(), limits=LIMITS, config=config)


def prompt_ids(text: str) -> list[int]:
    """What the server's byte codec makes of ``text``: BOS, then its bytes."""
    return [embedded.BOS_ID, *embedded.encode(text)]


def run_directly(requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """The same requests through an `Engine` driven directly; their emitted tokens."""
    with embedded_engine() as engine:
        reqs = {rid: engine.submit(rid, p, s) for rid, (p, s) in requests.items()}
        engine.run_until_idle()
    return {rid: list(req.emitted_ids) for rid, req in reqs.items()}


@pytest.fixture(scope="module")
def hf_model() -> LlamaForCausalLM:
    """The embedded target in transformers (float32): the oracle."""
    model = LlamaForCausalLM.from_pretrained(embedded.target_dir(), dtype=torch.float32)
    model.train(False)
    return model


@pytest.fixture(scope="module")
def oracle(hf_model: LlamaForCausalLM) -> dict[str, list[int]]:
    """HF greedy continuations of every prompt text."""
    return {text: greedy(hf_model, prompt_ids(text), NEW) for text in TEXTS}


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The server on the embedded model, for the module."""
    model = ServedModel.from_checkpoint(embedded.target_dir(), LIMITS, name=MODEL)
    with serving(embedded_engine(), model) as running:
        yield running


def test_greedy_completion_equals_hf_and_the_engine(
    served: Served, oracle: dict[str, list[int]]
) -> None:
    """Non-streaming greedy text completion: HF generate()'s tokens, Engine's tokens, text."""
    text = TEXTS[0]
    completion = served.client().completions.create(
        model=MODEL, prompt=text, max_tokens=NEW, temperature=0
    )
    choice = completion.choices[0]
    direct = run_directly({"d": (prompt_ids(text), SamplingParams(max_new_tokens=NEW))})["d"]
    assert token_ids(choice) == oracle[text] == direct
    assert choice.text == embedded.decode(direct)
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(prompt_ids(text))
    assert completion.usage.completion_tokens == NEW
    stats = speculative_usage(completion)
    assert stats["verifies"] > 0 and 1.0 < stats["mean_accept_length"] <= 5.0


def test_streaming_yields_the_same_tokens_with_usage_last(
    served: Served, oracle: dict[str, list[int]]
) -> None:
    """Streaming: chunks concatenate to the greedy output; finish on the last; usage after."""
    text = TEXTS[1]
    chunks = list(
        served.client().completions.create(
            model=MODEL,
            prompt=text,
            max_tokens=NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [c for c in chunks if c.choices]
    assert len(pieces) > 1  # tokens arrive in several steps
    assert [t for c in pieces for t in token_ids(c.choices[0])] == oracle[text]
    assert "".join(c.choices[0].text for c in pieces) == embedded.decode(oracle[text])
    assert [c.choices[0].finish_reason for c in pieces][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in pieces[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == NEW


def test_usage_reports_the_prefix_cache_hits_of_the_prompt(served: Served) -> None:
    """A prompt sent twice: the second's ``cached_tokens`` is what the engine's cache supplied
    (`Req.cached_tokens` of the same two requests run directly), the first's 0; streamed too."""
    text = "# usage.cached_tokens: the prompt of this test is sent twice, whole\n" * 2
    prompt = prompt_ids(text)
    with embedded_engine() as engine:
        first = engine.submit("1", prompt, SamplingParams(max_new_tokens=NEW))
        engine.run_until_idle()
        second = engine.submit("2", prompt, SamplingParams(max_new_tokens=NEW))
        engine.run_until_idle()
    assert first.cached_tokens == 0 and 0 < second.cached_tokens < len(prompt)
    client = served.client()
    usages = [
        client.completions.create(model=MODEL, prompt=text, max_tokens=NEW, temperature=0).usage
    ]
    chunks = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append(list(chunks)[-1].usage)
    usages.append(
        client.completions.create(model=MODEL, prompt=text, max_tokens=NEW, temperature=0).usage
    )
    cached = []
    for usage in usages:
        assert usage is not None and usage.prompt_tokens_details is not None
        cached.append(usage.prompt_tokens_details.cached_tokens)
    assert cached == [0, second.cached_tokens, second.cached_tokens]


def test_usage_counts_only_the_accepted_tokens_it_delivered(served: Served) -> None:
    """A length cap that falls inside an accepted run: the verify really accepted past the cap
    (its accept length, run directly on `Engine`, is the uncapped run's), but the usage's
    ``accepted_tokens`` counts only the delivered ones: ``completion_tokens`` less the one
    token the prefill emitted, the last verify cut at the cap."""
    prompt = prompt_ids("# usage.accepted_tokens: a cap inside an accepted run\ndef ")
    with embedded_engine() as engine:
        free = engine.submit("free", prompt, SamplingParams(max_new_tokens=48))
        engine.run_until_idle()
    runs = free.accept_lengths
    assert len(free.emitted_ids) == 1 + sum(runs)  # one prefill token, then verified runs
    j = next(i for i, a in enumerate(runs) if i >= 2 and a >= 3)  # a later run to cut inside
    cap = 1 + sum(runs[:j]) + 1  # one token into run j
    with embedded_engine() as engine:
        capped = engine.submit("capped", prompt, SamplingParams(max_new_tokens=cap))
        engine.run_until_idle()
    assert capped.accept_lengths[-1] == runs[j]  # settled past the cap: a real accept length
    assert sum(capped.accept_lengths) > cap - 1
    completion = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=cap, temperature=0
    )
    assert completion.usage is not None and completion.usage.completion_tokens == cap
    stats = speculative_usage(completion)
    assert stats["accepted_tokens"] == cap - 1 == sum(capped.emitted_accept_lengths)
    assert stats["verifies"] == j + 1
    assert token_ids(completion.choices[0]) == list(free.emitted_ids[:cap])


def test_token_id_prompts_and_stop_sequences(served: Served) -> None:
    """Token-id prompt and stops (and a stop string): the stop is cut, as OpenAI does."""
    prompt = prompt_ids(TEXTS[2])
    full = run_directly({"f": (prompt, SamplingParams(max_new_tokens=NEW))})["f"]
    stop = full[5:7]  # a stop that the greedy output reaches
    cut = run_directly(
        {"c": (prompt, SamplingParams(max_new_tokens=NEW, stop_sequences=[tuple(stop)]))}
    )["c"]
    assert cut[-2:] == stop and len(cut) < NEW
    client = served.client()
    by_ids = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=NEW,
        temperature=0,
        stop=[stop],  # type: ignore[list-item]
    )
    assert token_ids(by_ids.choices[0]) == cut[:-2]
    assert by_ids.choices[0].finish_reason == "stop"
    text_stop = embedded.decode(stop)
    streamed = client.completions.create(
        model=MODEL, prompt=TEXTS[2], max_tokens=NEW, temperature=0, stop=text_stop, stream=True
    )
    chunks = [c.choices[0] for c in streamed]
    assert [t for c in chunks for t in token_ids(c)] == cut[:-2]
    assert "".join(c.text for c in chunks) == embedded.decode(cut[:-2])
    assert chunks[-1].finish_reason == "stop"


def test_logprobs_are_the_engines(served: Served) -> None:
    """logprobs=0: one log-probability per returned token, the engine's own."""
    prompt = prompt_ids(TEXTS[3])
    sampling = SamplingParams(max_new_tokens=8, logprobs=True)
    with embedded_engine() as engine:
        req = engine.submit("l", prompt, sampling)
        engine.run_until_idle()
        expected = req.logprobs
    completion = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=0
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and expected
    assert logprobs.token_logprobs == pytest.approx(list(expected), abs=1e-5)
    assert logprobs.tokens is not None and len(logprobs.tokens) == 8


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_top_logprobs_are_the_engines(served: Served, stream: bool) -> None:
    """logprobs=k: per returned token a dict of its k most likely alternatives' texts and
    log-probabilities, the engine's own (`Req.top_logprobs`); greedy: the token is the first."""
    prompt = prompt_ids(TEXTS[3])
    sampling = SamplingParams(max_new_tokens=8, logprobs=True, top_logprobs=3)
    with embedded_engine() as engine:
        req = engine.submit("l", prompt, sampling)
        engine.run_until_idle()
        expected = req.top_logprobs
    assert expected is not None and len(expected) == 8
    created = served.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logprobs=3, stream=stream
    )
    chunks: list[Any] = list(created) if stream else [created]
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    for chunk in chunks:
        logprobs = chunk.choices[0].logprobs
        if logprobs is None or not logprobs.tokens:
            continue
        assert logprobs.top_logprobs is not None
        tokens += logprobs.tokens
        tops += logprobs.top_logprobs
    assert len(tops) == len(tokens) == 8
    for top, token, pairs in zip(tops, tokens, expected, strict=True):
        texts = {embedded.decode([t]): v for t, v in reversed(pairs)}  # the likelier kept
        assert top == pytest.approx(texts, abs=1e-5)
        assert next(iter(top)) == token  # greedy: the emitted token is the most likely


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_top_logprobs_are_cut_with_a_stop_sequence(served: Served, stream: bool) -> None:
    """A stop cut from the output takes its tokens' alternatives with it: one dict per
    returned token, the engine's, held back and released with the tokens while streaming."""
    prompt = prompt_ids(TEXTS[0])
    sampling = SamplingParams(max_new_tokens=NEW, logprobs=True, top_logprobs=2)
    with embedded_engine() as engine:
        req = engine.submit("l", prompt, sampling)
        engine.run_until_idle()
    expected = req.top_logprobs
    assert expected is not None
    stop = embedded.decode(list(req.emitted_ids[5:7]))  # a stop the greedy output contains
    created = served.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=NEW,
        temperature=0,
        logprobs=2,
        stop=stop,
        stream=stream,
    )
    chunks: list[Any] = list(created) if stream else [created]
    tokens: list[str] = []
    tops: list[dict[str, float]] = []
    for chunk in chunks:
        logprobs = chunk.choices[0].logprobs
        if logprobs is not None and logprobs.tokens:
            assert logprobs.top_logprobs is not None
            assert len(logprobs.top_logprobs) == len(logprobs.tokens)
            tokens += logprobs.tokens
            tops += logprobs.top_logprobs
    kept = "".join(c.choices[0].text for c in chunks)
    full = embedded.decode(list(req.emitted_ids))
    assert kept == full[: full.index(stop)] and kept.strip()
    assert "".join(tokens) == kept and len(tops) == len(tokens) < len(expected)
    for top, pairs in zip(tops, expected, strict=False):
        assert top == pytest.approx({embedded.decode([t]): v for t, v in reversed(pairs)}, abs=1e-5)


def _mixed_request(i: int) -> tuple[str, dict[str, Any], SamplingParams]:
    """Request ``i`` of the mixed load: greedy or seeded, speculating or not."""
    text = TEXTS[i % len(TEXTS)]
    kind = (i // len(TEXTS)) % 4
    speculative = kind in (0, 2)
    fields: dict[str, Any] = {"temperature": 0.0}
    sampling = SamplingParams(max_new_tokens=NEW, speculative=speculative)
    if kind >= 2:
        fields = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
        sampling = SamplingParams(
            max_new_tokens=NEW, temperature=0.8, top_p=0.95, seed=1000 + i, speculative=speculative
        )
    return text, {**fields, "extra_body": {"speculative": speculative}}, sampling


def test_64_concurrent_streams_with_mixed_sampling(
    served: Served, oracle: dict[str, list[int]]
) -> None:
    """64 concurrent clients (greedy/seeded, speculative on/off, streamed or not) are exact."""
    requests = {i: _mixed_request(i) for i in range(64)}

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[list[int], dict[str, float]]:
        text, fields, _ = requests[i]
        if i % 2:
            completion = await client.completions.create(
                model=MODEL, prompt=text, max_tokens=NEW, **fields
            )
            return token_ids(completion.choices[0]), speculative_usage(completion)
        tokens: list[int] = []
        stats: dict[str, float] = {}
        stream = await client.completions.create(
            model=MODEL,
            prompt=text,
            max_tokens=NEW,
            stream=True,
            stream_options={"include_usage": True},
            **fields,
        )
        async for chunk in stream:
            if chunk.choices:
                tokens += token_ids(chunk.choices[0])
            else:
                stats = speculative_usage(chunk)
        return tokens, stats

    async def everyone() -> list[tuple[list[int], dict[str, float]]]:
        async with served.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    outs = bounded(everyone())
    seeded = {
        str(i): (prompt_ids(text), sampling)
        for i, (text, _, sampling) in requests.items()
        if sampling.seed is not None
    }
    direct = run_directly(seeded)
    spec_accepted = spec_verifies = 0
    for i, (tokens, stats) in enumerate(outs):
        text, _, sampling = requests[i]
        expected = oracle[text] if sampling.seed is None else direct[str(i)]
        assert tokens == expected, f"request {i}"
        if not sampling.speculative:
            assert stats["mean_accept_length"] == 1.0  # one token per verify: no speculation
        else:
            spec_accepted += int(stats["accepted_tokens"])
            spec_verifies += int(stats["verifies"])
    assert 1.0 < spec_accepted / spec_verifies < 5.0
    snap = served.snapshot()
    assert snap.engine is not None and snap.engine.num_open_slots == 0


def _accepted_since(before: AsyncEngineSnapshot, after: AsyncEngineSnapshot) -> int:
    """Tokens the engine's verifies accepted between two snapshots."""
    assert before.engine is not None and after.engine is not None
    return after.engine.metrics.num_accepted_tokens - before.engine.metrics.num_accepted_tokens


def test_a_client_that_disconnects_mid_stream_is_aborted(served: Served) -> None:
    """Closing a stream mid-way aborts its request; its KV is released; pools balance."""
    before = served.snapshot()
    stream = served.client().completions.create(
        model=MODEL,
        prompt=TEXTS[4],
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()
    after = served.snapshot()
    assert after.num_cancelled == before.num_cancelled + 1
    assert after.num_ended == before.num_ended + 1
    assert _accepted_since(before, after) < 899  # it stopped early: it did not run to 900
    assert after.num_streams == 0 and after.engine is not None
    assert after.engine.num_open_slots == 0
    assert after.engine.num_free_pages == after.engine.num_pages
    assert after.engine.deferred_releases == () and after.engine.quarantined == ()


def test_a_client_that_leaves_a_whole_completion_is_aborted(served: Served) -> None:
    """A non-streaming client that closes its connection mid-request has it aborted too."""
    before = served.snapshot()
    body = _body(prompt=TEXTS[5], max_tokens=900, temperature=0, ignore_eos=True)
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body)

    async def submitted() -> None:  # the request is in the engine before the client leaves
        while (await served.front.snapshot()).num_submitted == before.num_submitted:
            await asyncio.sleep(0.01)

    bounded(submitted())
    conn.close()
    after = served.snapshot()
    assert after.num_cancelled == before.num_cancelled + 1
    assert _accepted_since(before, after) < 899  # it stopped early: it did not run to 900
    assert after.engine is not None and after.engine.num_open_slots == 0
    assert after.engine.num_free_pages == after.engine.num_pages


def _body(**fields: object) -> bytes:
    """A request body: a one-letter text prompt to the served model, with ``fields``."""
    return json.dumps({"model": MODEL, "prompt": "x", **fields}).encode()


BAD_REQUESTS: list[tuple[str, bytes, str | None]] = [
    ("wrong type", _body(max_tokens="ten"), "max_tokens"),
    ("negative max_tokens", _body(max_tokens=-3), "max_tokens"),
    ("unknown model", _body(model="gpt-9"), "model"),
    ("oversized prompt", _body(prompt=[65] * 1100), "prompt"),
    ("no room to generate", _body(max_tokens=1024), "max_tokens"),
    ("not JSON", b"{model: embedded-test", None),
    ("not an object", b'["model", "prompt"]', None),
    ("not UTF-8", b'{"model": "\xff\xfe"}', None),
    ("NaN", b'{"model": "embedded-test", "prompt": "x", "temperature": NaN}', None),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, None),
    ("unknown field", _body(best_ofs=2), "best_ofs"),
    ("token outside vocab", _body(prompt=[1, 9999]), "prompt"),
    ("empty prompt", _body(prompt=""), "prompt"),
    ("missing prompt", json.dumps({"model": MODEL}).encode(), "prompt"),
    ("batch of prompts", _body(prompt=["a", "b"]), "prompt"),
    ("negative temperature", _body(temperature=-1), "temperature"),
    ("top logprobs past the maximum", _body(logprobs=21), "logprobs"),
    ("negative logprobs", _body(logprobs=-1), "logprobs"),
    ("n above 1", _body(n=2), "n"),
    ("bool as int", _body(max_tokens=True), "max_tokens"),
    ("empty stop", _body(stop=[""]), "stop"),
    ("seed too big", _body(seed=2**63), "seed"),
    ("speculative not bool", _body(speculative=1), "speculative"),
    ("options without stream", _body(stream_options={}), "stream_options"),
    ("grammar of an unknown kind", _body(grammar={"glob": "*"}), "grammar"),
    ("grammar that does not compile", _body(grammar={"regex": "(["}), "grammar"),
    ("unknown response_format", _body(response_format={"type": "xml"}), "response_format"),
    (
        "grammar and response_format",
        _body(grammar={"regex": "a+"}, response_format={"type": "json_object"}),
        "grammar",
    ),
    ("min_tokens past max_tokens", _body(max_tokens=4, min_tokens=5), "min_tokens"),
    ("grammar and min_tokens", _body(grammar={"regex": "a+"}, min_tokens=2), "min_tokens"),
    ("grammar and ignore_eos", _body(grammar={"regex": "a+"}, ignore_eos=True), "ignore_eos"),
    ("temperature too small for float32", _body(temperature=1e-40), "temperature"),
    ("stop token outside vocab", _body(stop_token_ids=[9999]), "stop_token_ids"),
    (
        "response_format schema that does not compile",
        _body(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}),
        "response_format",
    ),
    ("lone surrogate in the prompt", _body(prompt="ab\ud800"), "prompt"),
    ("lone surrogate in a prompt list", _body(prompt=["\udfff"]), "prompt"),
    ("lone surrogate in a stop", _body(stop=["\ud800"]), "stop"),
    ("lone surrogate in a grammar", _body(grammar={"regex": "\ud800+"}), "grammar"),
    (
        "lone surrogate in a schema",
        _body(
            response_format={"type": "json_schema", "json_schema": {"schema": {"const": "\udc00"}}}
        ),
        "response_format",
    ),
    ("lone surrogate as a field name", _body(**{"\ud800": 1}), "\ud800"),
]


def test_bad_inputs_get_400_while_good_streams_finish(
    served: Served, oracle: dict[str, list[int]]
) -> None:
    """Malformed requests get 400 naming the field; concurrent good streams are unharmed."""
    good: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def good_streams() -> None:
        async def one(client: openai.AsyncOpenAI, i: int) -> None:
            stream = await client.completions.create(
                model=MODEL, prompt=TEXTS[i], max_tokens=NEW, temperature=0, stream=True
            )
            good[i] = [t async for c in stream for t in token_ids(c.choices[0])]

        async def all_of_them() -> None:
            async with served.async_client() as client:
                await asyncio.gather(*(one(client, i) for i in range(len(TEXTS))))

        try:
            bounded(all_of_them())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=good_streams)
    thread.start()
    try:
        wrong = []  # every mismatch at once: (name, status, type, param, message)
        for name, body, param in BAD_REQUESTS:
            status, answer = served.request("POST", "/v1/completions", body)
            error = answer.get("error") or {}
            got = (status, error.get("type"), error.get("param"), bool(error.get("message")))
            if got != (400, "invalid_request_error", param, True):
                wrong.append((name, *got[:3], error.get("message")))
        assert not wrong, "\n".join(map(repr, wrong))
        with pytest.raises(openai.BadRequestError) as info:
            served.client().completions.create(model=MODEL, prompt="x", max_tokens=-1)
        assert info.value.status_code == 400
        assert served.request("GET", "/v1/completions")[0] == 405
        assert served.request("GET", "/nowhere")[0] == 404
    finally:
        thread.join(300)
    assert errors == []
    assert good == {i: oracle[text] for i, text in enumerate(TEXTS)}
    assert served.request("GET", "/health") == (200, {"status": "ok"})


def test_the_context_boundary_is_exact(served: Served) -> None:
    """Prompt plus ``max_tokens`` equal to the context is served to its last token, one more is
    a 400 naming ``max_tokens``; a prompt one short of the context is served one token, a
    prompt of the whole context is a 400 naming ``prompt``."""
    context = LIMITS.max_context_len
    cases = [  # (prompt length, max_tokens, the refused field or None)
        (context - 24, 24, None),
        (context - 24, 25, "max_tokens"),
        (context - 1, 1, None),
        (context, 1, "prompt"),
    ]
    for length, max_tokens, refused in cases:
        body = _body(prompt=[65] * length, max_tokens=max_tokens, ignore_eos=True)
        status, answer = served.request("POST", "/v1/completions", body)
        if refused is not None:
            assert status == 400, (length, max_tokens, answer)
            assert answer["error"]["param"] == refused, (length, max_tokens, answer)
            assert answer["error"]["code"] == "context_length_exceeded"
            continue
        assert status == 200, (length, max_tokens, answer)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert len(answer["choices"][0]["token_ids"]) == max_tokens
        assert answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"] == (
            length + max_tokens
        )


def test_a_request_past_the_kv_pool_is_a_400_naming_max_tokens() -> None:
    """A context larger than the KV pool: the prompt and ``max_tokens`` fit the context, but
    the engine refuses the request at submit (it could never fit the pool); the 400 names the
    field the client sent, ``max_tokens``, and the server serves a request that fits."""
    limits = RequestLimits(vocab_size=32, max_context_len=1024)
    engine = Engine(
        TimedWaitWorker(device_seconds=0.0),
        limits=limits,
        config=EngineConfig(kv_tokens=256, check_invariants=True),
    )
    model = ServedModel(name="small-pool", limits=limits)
    with serving(engine, model) as small:
        body = json.dumps({"model": "small-pool", "prompt": [1, 2, 3], "max_tokens": 600})
        status, answer = small.request("POST", "/v1/completions", body.encode())
        assert status == 400, answer
        assert answer["error"]["param"] == "max_tokens"
        assert "pool" in answer["error"]["message"]
        fits = json.dumps({"model": "small-pool", "prompt": [1, 2, 3], "max_tokens": 20})
        status, answer = small.request("POST", "/v1/completions", fits.encode())
        assert status == 200 and len(answer["choices"][0]["token_ids"]) == 20


def test_models_health_and_metrics(served: Served) -> None:
    """/v1/models names the model; /health is ok; /metrics exports the engine's counters."""
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert served.request("GET", "/health") == (200, {"status": "ok"})
    import urllib.request

    with urllib.request.urlopen(f"{served.url}/metrics", timeout=60) as response:
        text = response.read().decode()
    snap = served.snapshot()
    assert snap.engine is not None
    verifies = snap.engine.metrics.num_verifies
    assert f"specstate_spec_verifies_total {float(verifies)}" in text
    assert "specstate_kv_free_pages" in text


SERVED_ROUTES = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "GET /v1/models",
    "GET /health",
    "GET /metrics",
]


@pytest.mark.parametrize(
    ("method", "path", "status", "hint"),
    [
        ("POST", "/v1/embeddings", 404, "POST /v1/chat/completions"),
        ("GET", "/v2/models", 404, "POST /v1/completions"),
        ("GET", "/v1/completions", 405, "POST /v1/completions"),
    ],
)
def test_an_unknown_route_answers_with_the_served_routes(
    served: Served, method: str, path: str, status: int, hint: str
) -> None:
    """A route the server does not have (or a method it does not take there) answers OpenAI's
    error object whose message names the routes served, and lists them in ``routes``; the
    table of docs/serving.md lists the same routes."""
    got, body = served.request(method, path, b"{}" if method == "POST" else None)
    assert got == status
    assert body["routes"] == SERVED_ROUTES
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_route"
    assert f"{method} {path}" in error["message"] and hint in error["message"]
    page = (Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = page.split("### Routes")[1].split("###")[0]
    documented = re.findall(r"^\| `(\w+ /[\w/]+)` \|", table, re.M)
    assert documented == SERVED_ROUTES
    if path == "/v1/embeddings":  # the page shows this answer whole
        shown = re.search(r"```json\n(.*?)\n```", table, re.S)
        assert shown is not None and json.loads(shown.group(1)) == body


def test_grammar_and_response_format_constrain_the_output_as_the_engine_does(
    served: Served,
) -> None:
    """A regex through the ``grammar`` extension and a JSON schema through OpenAI's
    ``response_format``: outputs match their grammar and equal the same requests run through
    `Engine` directly (greedy, speculative); `json_object` yields a JSON object."""
    from specstate import Grammar

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    regex = "(def|class) [a-z]{2,8}\\(\\):"
    text = TEXTS[0]
    client = served.client()
    by_regex = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=40,
        temperature=0,
        extra_body={"grammar": {"regex": regex}},
    ).choices[0]
    by_schema = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
    ).choices[0]
    as_object = client.completions.create(
        model=MODEL,
        prompt=text,
        max_tokens=60,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    ).choices[0]
    direct = run_directly(
        {
            "regex": (
                prompt_ids(text),
                SamplingParams(max_new_tokens=40, grammar=Grammar.regex(regex)),
            ),
            "schema": (
                prompt_ids(text),
                SamplingParams(max_new_tokens=60, grammar=Grammar.json_schema(schema)),
            ),
        }
    )
    assert token_ids(by_regex) == direct["regex"]
    assert token_ids(by_schema) == direct["schema"]
    assert re.fullmatch(regex, by_regex.text), by_regex.text
    assert by_regex.finish_reason == "stop"
    assert by_schema.finish_reason == as_object.finish_reason == "stop"
    parsed = json.loads(by_schema.text)
    assert set(parsed) == {"name", "n"} and isinstance(parsed["n"], int)
    assert isinstance(json.loads(as_object.text), dict)
