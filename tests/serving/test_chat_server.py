"""``POST /v1/chat/completions`` on the real server, driven by the real `openai` client.

One server for the module: the embedded byte-level model with its draft model (speculation and
overlap on, the invariant checker after every step) and the chat template it ships. Every
output is checked against the same request run through an `Engine` directly on the prompt the
template renders (greedy, or seeded: a seeded request emits the same tokens whatever its batch
mates). No assertion is timed.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from serving_harness import Served, bounded, serving

from specstate import Engine, EngineConfig, Grammar, RequestLimits, SamplingParams
from specstate.reference import embedded
from specstate.reference.workers import default_registry
from specstate.serving.chat import parse_tool_calls
from specstate.serving.chat_protocol import ToolSpec, choice_seed
from specstate.serving.chat_template import ChatTemplate, load_chat_template
from specstate.serving.openai_server import ServedModel
from specstate.tools.timed_worker import TimedWaitWorker

MODEL = "embedded-chat"
MAX_N = 4
LIMITS = RequestLimits(
    vocab_size=embedded.VOCAB_SIZE,
    max_context_len=1024,
    eos_token_ids={embedded.EOS_ID},
    grammar_vocabulary=embedded.grammar_vocabulary(),
)
NUM_STEPS = 4
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": [{"type": "text", "text": "def add(a, b):"}]},
]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]


def chat(client: Any, **kwargs: Any) -> Any:
    """``client.chat.completions.create`` untyped (tests send dict messages and extensions)."""
    return client.chat.completions.create(**kwargs)


def chat_stream(client: Any, **kwargs: Any) -> Any:
    """``client.chat.completions.stream`` untyped: the client's own stream assembly."""
    return client.chat.completions.stream(**kwargs)


def engine() -> Engine:
    """The embedded target with its draft model, float32, overlap on, checked every step."""
    worker = default_registry().create(
        "draft_model",
        target=embedded.target_dir(),
        draft=embedded.draft_dir(),
        num_steps=NUM_STEPS,
        dtype=torch.float32,
    )
    config = EngineConfig(
        overlap=True, page_size=16, kv_tokens=16384, max_running=64, check_invariants=True
    )
    return Engine(worker, limits=LIMITS, config=config)


def template() -> ChatTemplate:
    found = load_chat_template(embedded.target_dir())
    assert found is not None
    return found


def rendered(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt ids the server makes of ``messages``: BOS, then the rendered text's bytes."""
    parts = [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m.get("content"), list)
        else m
        for m in messages
    ]
    text = template().render(parts, tools=tools)
    return [embedded.BOS_ID, *embedded.encode(text)]


def run_directly(requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """The same requests through an `Engine` driven directly; their emitted tokens."""
    with engine() as direct:
        reqs = {rid: direct.submit(rid, p, s) for rid, (p, s) in requests.items()}
        direct.run_until_idle()
    return {rid: list(req.emitted_ids) for rid, req in reqs.items()}


def ids_of(choice: Any) -> list[int]:
    """A choice's output token ids (the ``token_ids`` extension)."""
    return [int(t) for t in (choice.model_extra or {})["token_ids"]]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The chat server for the module (``--max-n`` 4)."""
    model = ServedModel(name=MODEL, limits=LIMITS, codec=_codec(), chat_template=template())
    with serving(engine(), model, max_n=MAX_N) as running:
        yield running


def _codec() -> Any:
    from specstate.serving.text import load_codec

    return load_codec(embedded.target_dir())


def test_chat_equals_the_engine_on_the_rendered_prompt_streaming_and_not(served: Served) -> None:
    """Greedy chat: the text and ids are `Engine`'s greedy output on the rendered prompt, the
    stream's deltas concatenate to the same text, usage counts the rendered prompt."""
    client = served.client()
    whole = chat(
        client, model=MODEL, messages=CONVERSATION, max_completion_tokens=24, temperature=0
    )
    chunks = list(
        chat(
            client,
            model=MODEL,
            messages=CONVERSATION,
            max_tokens=24,
            temperature=0,
            stream=True,
            extra_body={"speculative_stats": True},
        )
    )
    prompt = rendered(CONVERSATION)
    direct = run_directly({"d": (prompt, SamplingParams(max_new_tokens=24))})["d"]
    choice = whole.choices[0]
    assert ids_of(choice) == direct
    assert choice.message.role == "assistant" and choice.message.content == embedded.decode(direct)
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert whole.object == "chat.completion"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == 24
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([p for p in pieces if p]) > 1  # text arrives in several steps
    assert "".join(pieces) == embedded.decode(direct)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    last = chunks[-1].choices[0].model_extra or {}  # the extensions come on the last chunk
    assert last["token_ids"] == direct and last["speculative"]["verifies"] > 0
    assert "speculative" not in (choice.model_extra or {})  # off unless asked for


def test_speculative_stats_per_choice_on_request(served: Served) -> None:
    """``speculative_stats: true`` adds each choice's speculation: accepted of drafted, per
    position, and accept lengths strictly between 1 and the maximum; /metrics counts them."""
    client = served.client()
    whole = chat(
        client,
        model=MODEL,
        messages=CONVERSATION,
        max_completion_tokens=32,
        temperature=0,
        extra_body={"speculative_stats": True},
    )
    stats = (whole.choices[0].model_extra or {})["speculative"]
    by_position = stats["by_position"]
    assert len(by_position) == NUM_STEPS
    assert stats["accepted_drafts"] == sum(p["accepted"] for p in by_position)
    assert stats["verified_drafts"] == sum(p["verified"] for p in by_position)
    assert 1.0 < stats["mean_accept_length"] < NUM_STEPS + 1
    with urllib.request.urlopen(f"{served.url}/metrics", timeout=60) as response:
        text = response.read().decode()
    snap = served.snapshot()
    assert snap.engine is not None
    drafted = float(snap.engine.metrics.num_proposed_drafts)
    assert f"specstate_spec_draft_tokens_total {drafted}" in text


def test_n_choices_with_a_seed_are_the_same_four_on_a_rerun(served: Served) -> None:
    """``n=4`` with a seed: four choices, each the engine's output under its derived seed (so
    a rerun gives the same four), not all alike; usage counts the prompt once, which the
    choices read from the prefix cache (the server prefilled it once for all of them)."""
    client = served.client()
    conversation = [{"role": "user", "content": "import numpy as np\n\n\ndef mean(xs):"}]

    def ask() -> Any:
        return chat(
            client,
            model=MODEL,
            messages=conversation,
            max_completion_tokens=16,
            n=4,
            seed=11,
            temperature=1.0,
        )

    first, again = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    outputs = [ids_of(c) for c in first.choices]
    assert outputs == [ids_of(c) for c in again.choices]
    assert len({tuple(o) for o in outputs}) > 1
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert (first.usage.prompt_tokens_details.cached_tokens or 0) > 0
    prompt = rendered(conversation)
    direct = run_directly(
        {
            str(i): (
                prompt,
                SamplingParams(max_new_tokens=16, temperature=1.0, seed=choice_seed(11, i)),
            )
            for i in range(4)
        }
    )
    assert outputs == [direct[str(i)] for i in range(4)]
    assert first.usage is not None and first.usage.prompt_tokens == len(prompt)
    assert first.usage.completion_tokens == sum(len(o) for o in outputs)


def test_streamed_n_choices_and_the_usage_chunk_match_the_whole_response(served: Served) -> None:
    """Streaming ``n=2`` with ``include_usage``: each index's deltas concatenate to that
    choice's text in the non-streaming response, and the final usage chunk has its counts."""
    client = served.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": CONVERSATION,
        "max_completion_tokens": 20,
        "n": 2,
        "seed": 5,
        "temperature": 0.8,
    }
    whole = chat(client, **kwargs)
    chunks = list(chat(client, **kwargs, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert whole.usage is not None
    assert whole.usage.completion_tokens == sum(len(ids_of(c)) for c in whole.choices)
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == whole.usage.total_tokens


def test_the_second_turn_reads_the_first_from_the_prefix_cache(served: Served) -> None:
    """A conversation's second turn repeats the first as its prompt's head: cached_tokens > 0."""
    client = served.client()
    messages = [{"role": "user", "content": "class Stack:\n    def push(self, item):"}]
    first = chat(client, model=MODEL, messages=messages, max_completion_tokens=40, temperature=0)
    reply = first.choices[0].message.content
    follow = [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "and pop?"},
    ]
    second = chat(client, model=MODEL, messages=follow, max_completion_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < second.usage.prompt_tokens


def test_logprobs_stop_and_stop_token_ids_are_the_engines(served: Served) -> None:
    """``logprobs`` gives the chosen tokens' log-probabilities (the engine's), ``stop`` cuts
    the output where the engine stopped, ``stop_token_ids`` ends it at the id."""
    client = served.client()
    prompt = rendered(CONVERSATION)
    with_lp = chat(
        client,
        model=MODEL,
        messages=CONVERSATION,
        max_completion_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=0,
    ).choices[0]
    direct_ids = run_directly({"d": (prompt, SamplingParams(max_new_tokens=40))})["d"]
    text = embedded.decode(direct_ids)
    stop = text[8:10]  # a string the greedy output contains
    stopped = chat(
        client,
        model=MODEL,
        messages=CONVERSATION,
        max_completion_tokens=40,
        temperature=0,
        stop=[stop],
    ).choices[0]
    by_id = chat(
        client,
        model=MODEL,
        messages=CONVERSATION,
        max_completion_tokens=40,
        temperature=0,
        extra_body={"stop_token_ids": [direct_ids[5]]},
    ).choices[0]
    with engine() as direct:
        lp = direct.submit("lp", prompt, SamplingParams(max_new_tokens=12, logprobs=True))
        direct.run_until_idle()
    assert with_lp.logprobs is not None and with_lp.logprobs.content is not None
    got = [(t.token, t.logprob, t.top_logprobs) for t in with_lp.logprobs.content]
    assert [g[0] for g in got] == [embedded.decode([t]) for t in lp.emitted_ids]
    assert lp.logprobs is not None
    assert [g[1] for g in got] == pytest.approx(list(lp.logprobs), abs=1e-5)
    assert all(g[2] == [] for g in got)
    assert stopped.finish_reason == "stop"
    assert stopped.message.content == text[: text.index(stop)]
    assert by_id.finish_reason == "stop" and ids_of(by_id)[-1] == direct_ids[5]
    assert ids_of(by_id) == direct_ids[: direct_ids.index(direct_ids[5]) + 1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_top_logprobs_are_the_engines(served: Served, stream: bool) -> None:
    """``top_logprobs: k`` gives each token's k most likely alternatives (text, logprob,
    bytes), the engine's own (`Req.top_logprobs`); greedy: the chosen token is the first."""
    client = served.client()
    prompt = rendered(CONVERSATION)
    with engine() as direct:
        sampling = SamplingParams(max_new_tokens=12, logprobs=True, top_logprobs=4)
        req = direct.submit("top", prompt, sampling)
        direct.run_until_idle()
    expected = req.top_logprobs
    assert expected is not None and len(expected) == 12
    created = chat(
        client,
        model=MODEL,
        messages=CONVERSATION,
        max_completion_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        stream=stream,
    )
    chunks: list[Any] = list(created) if stream else [created]
    content = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs is not None
        for entry in chunk.choices[0].logprobs.content or ()
    ]
    assert len(content) == 12
    for entry, pairs in zip(content, expected, strict=True):
        want = [embedded.decode([t]) for t, _ in pairs]
        assert [a.token for a in entry.top_logprobs] == want
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx(
            [v for _, v in pairs], abs=1e-5
        )
        assert [a.bytes for a in entry.top_logprobs] == [list(w.encode()) for w in want]
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)


def test_response_format_constrains_chat_as_the_engine_does(served: Served) -> None:
    """``response_format`` json_schema on chat: the engine's constrained tokens, valid JSON."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    choice = chat(
        served.client(),
        model=MODEL,
        messages=CONVERSATION,
        max_completion_tokens=30,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    ).choices[0]
    grammar = Grammar.json_schema(schema)
    direct = run_directly(
        {"g": (rendered(CONVERSATION), SamplingParams(max_new_tokens=30, grammar=grammar))}
    )["g"]
    assert ids_of(choice) == direct
    assert choice.finish_reason == "stop" and set(json.loads(choice.message.content or "")) == {"n"}


def _valid_weather(arguments: dict[str, Any]) -> bool:
    return (
        set(arguments) == {"city", "days"}
        and arguments["city"] in ("Paris", "Tokyo", "Lima")
        and type(arguments["days"]) is int
        and 1 <= arguments["days"] <= 7
    )


def test_a_forced_tool_call_is_valid_over_20_seeds_streaming_and_not(served: Served) -> None:
    """``tool_choice`` naming a function (and ``required``), sampled with speculation over 20
    seeds: always a call of that function whose arguments validate against its schema, with
    an id; the stream helper of the client assembles the same call."""
    client = served.client()
    accepted = drafted = 0
    for seed in range(20):
        choice = chat(
            client,
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_completion_tokens=64,
            temperature=1.0,
            seed=seed,
            extra_body={"speculative_stats": True},
        ).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].id.startswith("call_")
        assert calls[0].type == "function" and calls[0].function.name == "get_weather"
        assert _valid_weather(json.loads(calls[0].function.arguments))
        stats = (choice.model_extra or {})["speculative"]
        accepted, drafted = accepted + stats["accepted_drafts"], drafted + stats["verified_drafts"]
    assert 0 < accepted < drafted  # speculation ran, and not every draft was accepted
    required = chat(
        client,
        model=MODEL,
        messages=[{"role": "user", "content": "Add one."}],
        tools=TOOLS,
        tool_choice="required",
        max_completion_tokens=64,
        temperature=1.0,
        seed=3,
    ).choices[0]
    assert required.message.tool_calls and required.message.tool_calls[0].function.name in (
        "get_weather",
        "add",
    )
    with chat_stream(
        client,
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Lima?"}],
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_completion_tokens=64,
        temperature=1.0,
        seed=4,
    ) as stream:
        final = stream.get_final_completion()
    call = (final.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert _valid_weather(json.loads(call.function.arguments))
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_tool_calls_parse_the_documented_tags() -> None:
    """``auto``: ``<tool_call>{json}</tool_call>`` blocks become calls (the text around them
    the content); a block that is not a call of a given tool leaves the text as content."""
    spec = ToolSpec(tools=tuple(TOOLS), choice="auto")
    call = '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>'
    content, calls = parse_tool_calls(f"Let me add. {call}", spec)
    assert content == "Let me add. " and len(calls) == 1
    assert calls[0]["function"] == {"name": "add", "arguments": '{"a": 2}'}
    assert parse_tool_calls(call + call, spec)[0] is None
    assert len({c["id"] for c in parse_tool_calls(call + call, spec)[1]}) == 2
    bad = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert parse_tool_calls(bad, spec) == (bad, [])
    assert parse_tool_calls("<tool_call>not json</tool_call>", spec)[1] == []
    assert parse_tool_calls(call, ToolSpec(tools=tuple(TOOLS), choice="none")) == (call, [])


STRICT = (
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
    "{{ raise_exception('system must come first') }}{% endif %}"
    "{{ m.role }}: {{ m.content or '' }}\n{% endfor %}assistant: "
)
GOOD = {"model": MODEL, "messages": CONVERSATION, "max_completion_tokens": 12, "temperature": 0}
BAD_INPUTS: list[tuple[dict[str, Any], str]] = [
    (
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
        "messages",
    ),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages[0].content[0].type",
    ),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id"),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
            ]
        },
        "tools[0].function.parameters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
    ),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"n": MAX_N + 1}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 5000}, "max_completion_tokens"),
    ({"stop": 7}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"functions": []}, "functions"),
    ({"model": "other"}, "model"),
    ({"seed": -1}, "seed"),
    ({"temperature": 1e-40}, "temperature"),  # refused by the engine at submit
]


def test_bad_input_is_a_400_naming_the_field_while_good_requests_stay_exact() -> None:
    """Every malformed field answers 400 with OpenAI's error object naming it, sent while a
    load of well-formed chats runs on the same server; those answer the engine's tokens. A
    template that raises is a 400 naming ``messages``."""
    model = ServedModel(
        name=MODEL,
        limits=LIMITS,
        codec=_codec(),
        chat_template=ChatTemplate(source=STRICT, origin="strict"),
    )
    with serving(engine(), model, max_n=MAX_N) as running:

        async def load() -> tuple[list[Any], list[tuple[int, dict[str, Any]]]]:
            async with running.async_client() as client:
                good = [
                    chat(
                        client,
                        model=MODEL,
                        messages=[{"role": "user", "content": f"def f{i}(x):"}],
                        max_completion_tokens=16,
                        temperature=0,
                    )
                    for i in range(6)
                ]
                bad = [
                    asyncio.to_thread(
                        running.request,
                        "POST",
                        "/v1/chat/completions",
                        json.dumps({**GOOD, **change}).encode(),
                    )
                    for change, _ in BAD_INPUTS
                ]
                results = await asyncio.gather(*good, *bad)
            return list(results[: len(good)]), list(results[len(good) :])

        answers, refused = bounded(load())
    for (status, body), (_, field) in zip(refused, BAD_INPUTS, strict=True):
        assert status == 400, (field, body)
        assert body["error"]["param"] == field, body
        assert body["error"]["type"] == "invalid_request_error"
    failed = refused[0][1]["error"]
    assert failed["code"] == "template_error" and "system must come first" in failed["message"]
    strict = ChatTemplate(source=STRICT, origin="strict")
    prompts = {
        str(i): (
            [
                embedded.BOS_ID,
                *embedded.encode(strict.render([{"role": "user", "content": f"def f{i}(x):"}])),
            ],
            SamplingParams(max_new_tokens=16),
        )
        for i in range(6)
    }
    direct = run_directly(prompts)
    assert [ids_of(a.choices[0]) for a in answers] == [direct[str(i)] for i in range(6)]


def test_a_model_without_a_chat_template_answers_400() -> None:
    """No template: chat is a 400 with ``code: no_chat_template`` saying how to give one."""
    limits = RequestLimits(vocab_size=300, max_context_len=512)
    timed = Engine(
        TimedWaitWorker(device_seconds=0.0), limits=limits, config=EngineConfig(kv_tokens=1024)
    )
    model = ServedModel(name=MODEL, limits=limits, codec=_codec())
    with serving(timed, model) as running:
        status, body = running.request("POST", "/v1/chat/completions", json.dumps(GOOD).encode())
    assert status == 400
    assert body["error"]["code"] == "no_chat_template"
    assert "--chat-template" in body["error"]["message"]


AUTO_CALL = r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9]\}\}</tool_call>'


def test_auto_tool_calls_from_the_output_streaming_and_not(served: Served) -> None:
    """``auto`` on an output that holds a tagged call (made so by a regex grammar): the call
    comes back as ``tool_calls`` and the text around it as content; streamed, no part of the
    tag is ever sent as content, and the client's stream helper assembles the same call."""
    client = served.client()
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Add."}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "max_completion_tokens": 120,
        "temperature": 0,
        "extra_body": {"grammar": {"regex": AUTO_CALL}},
    }
    whole = chat(client, **kwargs).choices[0]
    with chat_stream(client, **kwargs) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion().choices[0]
    for choice in (whole, final):
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure. "
        calls = choice.message.tool_calls or []
        assert len(calls) == 1 and calls[0].function.name == "add"
        assert json.loads(calls[0].function.arguments)["a"] in range(1, 10)
    assert "".join(deltas) == "Sure. " and not any("<" in d for d in deltas)


def test_the_template_sees_the_tools_unless_tool_choice_is_none(served: Served) -> None:
    """The prompt is the template rendered with ``tools`` (``auto``), or without (``none``)."""
    messages = [{"role": "user", "content": "Weather?"}]
    client = served.client()
    counts = {}
    for choice in ("auto", "none"):
        reply = chat(
            client,
            model=MODEL,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            max_completion_tokens=1,
            temperature=0,
        )
        counts[choice] = reply.usage.prompt_tokens
    assert counts == {"auto": len(rendered(messages, TOOLS)), "none": len(rendered(messages))}
