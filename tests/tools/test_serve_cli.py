"""`specstate serve`: light --help, the install hint without the extra, and a real run.

The real run starts the command itself in a subprocess with no ``--model`` (the embedded
model, as on a fresh install), sends the curl request docs/serving.md shows (with the port the
test picked), checks the answer against the same request run through an `Engine` directly,
and stops the server with Ctrl-C (exit 0). Another interrupts a server with long requests live:
they end with ``abort`` and the command exits within the bound docs/serving.md states. Every
wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from specstate import Engine, EngineConfig, Grammar, RequestLimits, SamplingParams
from specstate.engine.planning import kv_layouts, kv_tokens_for_budget
from specstate.reference import embedded
from specstate.reference.workers import default_registry
from specstate.serving.uvicorn_server import SHUTDOWN_BOUND_S
from specstate.tools import serve
from specstate.tools.serve import INSTALL_HINT

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "specstate.tools.cli"]
BOUND_S = 180


def _env() -> dict[str, str]:
    """This checkout's sources first, as the tests import them (and the test-only modules)."""
    paths = [str(ROOT / "src"), str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_serve_help_loads_no_torch_and_no_server() -> None:
    """`specstate serve --help` imports neither torch nor Starlette / uvicorn."""
    code = (
        "import contextlib, io, sys\n"
        "from specstate.tools.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['serve', '--help'])\n"
        "    except SystemExit: pass\n"
        "heavy = [m for m in ('torch', 'starlette', 'uvicorn', 'specstate.tools.generate')\n"
        "         if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_serve_without_the_extra_prints_the_install_line() -> None:
    """Without uvicorn the command prints one install line and exits 2."""
    code = (
        "import sys; sys.modules['uvicorn'] = None\n"
        "from specstate.tools.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env())
    assert out.returncode == 2
    assert out.stderr.strip() == INSTALL_HINT


def test_serve_with_a_missing_checkpoint_exits_2(tmp_path: Path) -> None:
    """A --model that is not a checkpoint fails before serving, one line, exit 2."""
    out = subprocess.run(
        [*CLI, "serve", "--model", str(tmp_path / "nowhere"), "--port", str(_free_port())],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=BOUND_S,
    )
    assert out.returncode == 2
    assert out.stderr.startswith("specstate serve: ") and len(out.stderr.splitlines()) == 1


def test_serve_builds_the_engine_generate_flags_describe(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`serve` takes generate's worker and engine flags: the engine it builds has the prefix
    cache off, the page size, the running cap and the pool a ``--kv-memory`` budget buys (one
    stderr line says so), and the n-gram worker with the steps asked for."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    argv = ["--algorithm", "ngram", "--num-steps", "3", "--no-prefix-cache", "--page-size", "16"]
    args = parser.parse_args([*argv, "--kv-memory", "8MiB", "--max-running", "7"])
    front, model = serve.build(args)
    try:
        read = front.read(lambda engine: (engine.config, engine.worker.capabilities))
        config, caps = asyncio.run(asyncio.wait_for(read, BOUND_S))
    finally:
        asyncio.run(asyncio.wait_for(front.close(), BOUND_S))
    layouts = kv_layouts(embedded.target_dir(), dtype=torch.float32)
    assert config.kv_tokens == kv_tokens_for_budget(8 * 2**20, layouts, page_size=16)
    assert (config.prefix_cache, config.page_size, config.max_running) == (False, 16, 7)
    assert (caps.algorithm, caps.num_steps, model.name) == ("ngram", 3, serve.EMBEDDED_NAME)
    bought = f"specstate serve: --kv-memory 8 MiB: --kv-tokens {config.kv_tokens}, "
    assert capsys.readouterr().err.startswith(bought)


def _docs_page() -> str:
    return (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")


def _docs_curls(port: int) -> list[list[str]]:
    """The curl commands of docs/serving.md (completions: plain, structured; chat: plain,
    streamed, n choices, a tool call, JSON, a second turn; top logprobs: a completion, a
    chat), pointed at ``port``."""
    text = _docs_page()
    lines = re.findall(r"^\$ (curl .*)$", text, re.M)
    assert len(lines) == 10, lines
    return [shlex.split(line.replace("127.0.0.1:8000", f"127.0.0.1:{port}")) for line in lines]


def _check_chat_answers(answers: list[str], engine: Engine) -> None:
    """The chat curls' answers: the greedy chat is `Engine`'s greedy output on the rendered
    prompt, the stream the same text with a usage chunk last, two seeded choices with
    log-probabilities and speculation, a tool call that fits its schema, a JSON object, and
    the next turn (the first answer as its history) partly from the prefix cache."""
    from specstate.serving.chat_template import load_chat_template

    template = load_chat_template(embedded.target_dir())
    assert template is not None
    curls = [shlex.split(line) for line in re.findall(r"^\$ (curl .*)$", _docs_page(), re.M)]
    bodies = [json.loads(curl[curl.index("-d") + 1]) for curl in curls[2:8]]
    prompts = [
        [embedded.BOS_ID, *embedded.encode(template.render(b["messages"]))] for b in bodies[:2]
    ]
    reqs = [
        engine.submit(f"chat{i}", p, SamplingParams(max_new_tokens=16))
        for i, p in enumerate(prompts)
    ]
    engine.run_until_idle()
    plain = json.loads(answers[0])
    assert plain["object"] == "chat.completion"
    assert plain["choices"][0]["token_ids"] == list(reqs[0].emitted_ids)
    assert plain["choices"][0]["message"]["content"] == embedded.decode(reqs[0].emitted_ids)
    events = [
        line[len("data: ") :] for line in answers[1].splitlines() if line.startswith("data: ")
    ]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == embedded.decode(reqs[1].emitted_ids)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 16
    many = json.loads(answers[2])["choices"]
    assert [c["index"] for c in many] == [0, 1]
    assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) > 0 for c in many)
    assert all(c["speculative"]["verifies"] >= 0 for c in many)
    call = json.loads(answers[3])["choices"][0]
    assert call["finish_reason"] == "tool_calls"
    arguments = json.loads(call["message"]["tool_calls"][0]["function"]["arguments"])
    assert arguments["city"] in ("Paris", "Tokyo") and 1 <= arguments["days"] <= 7
    assert isinstance(json.loads(json.loads(answers[4])["choices"][0]["message"]["content"]), dict)
    turn = json.loads(answers[5])
    assert turn["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert bodies[5]["messages"][2]["content"] == plain["choices"][0]["message"]["content"]
    assert turn["choices"][0]["finish_reason"] in ("stop", "length")
    if turn["choices"][0]["finish_reason"] == "stop":
        assert turn["choices"][0]["token_ids"][-1] == 10


def _check_top_answers(answers: list[str], engine: Engine) -> None:
    """The top-logprobs curls' answers: per token its 3 alternatives, `Engine`'s
    (`Req.top_logprobs`) on the same prompt, the greedy token first."""
    from specstate.serving.chat_template import load_chat_template

    template = load_chat_template(embedded.target_dir())
    assert template is not None
    curls = [shlex.split(line) for line in re.findall(r"^\$ (curl .*)$", _docs_page(), re.M)]
    completion_body, chat_body = (json.loads(c[c.index("-d") + 1]) for c in curls[8:])
    prompts = [
        [embedded.BOS_ID, *embedded.encode(completion_body["prompt"])],
        [embedded.BOS_ID, *embedded.encode(template.render(chat_body["messages"]))],
    ]
    sampling = SamplingParams(max_new_tokens=4, logprobs=True, top_logprobs=3)
    reqs = [engine.submit(f"top{i}", p, sampling) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    expected = [req.top_logprobs for req in reqs]
    assert expected[0] is not None and expected[1] is not None
    completion = json.loads(answers[0])["choices"][0]["logprobs"]
    assert len(completion["top_logprobs"]) == len(expected[0]) == 4
    for token, top, pairs in zip(
        completion["tokens"], completion["top_logprobs"], expected[0], strict=True
    ):
        assert next(iter(top)) == token
        want = {embedded.decode([t]): v for t, v in reversed(pairs)}
        assert top == pytest.approx(want, abs=1e-5)
    content = json.loads(answers[1])["choices"][0]["logprobs"]["content"]
    assert len(content) == len(expected[1]) == 4
    for entry, pairs in zip(content, expected[1], strict=True):
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert [a["token"] for a in entry["top_logprobs"]] == [
            embedded.decode([t]) for t, _ in pairs
        ]
        assert [a["logprob"] for a in entry["top_logprobs"]] == pytest.approx(
            [v for _, v in pairs], abs=1e-5
        )


def _wait_healthy(url: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[1]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)
    raise AssertionError("the server did not come up")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/bin/curl").exists(), reason="needs curl")
def test_serve_on_a_fresh_install_answers_the_docs_curls() -> None:
    """`specstate serve` (embedded model) answers docs/serving.md's curls exactly (the structured
    one with a JSON object, as `Engine` emits it under that grammar); Ctrl-C exits 0."""
    port = _free_port()
    server = subprocess.Popen(
        [*CLI, "serve", "--algorithm", "draft_model", "--port", str(port), "--threads", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        _wait_healthy(f"http://127.0.0.1:{port}", server)
        plain, structured, *chats = (
            subprocess.run(curl, capture_output=True, text=True, check=True, timeout=BOUND_S)
            for curl in _docs_curls(port)
        )
    finally:
        server.send_signal(signal.SIGINT)
        _, stderr = server.communicate(timeout=BOUND_S)
    assert server.returncode == 0, stderr
    assert "specstate-embedded (bytes codec)" in stderr
    answer, constrained = json.loads(plain.stdout), json.loads(structured.stdout)
    worker = default_registry().create(
        "draft_model",
        target=embedded.target_dir(),
        draft=embedded.draft_dir(),
        num_steps=4,
        dtype=torch.float32,
    )
    limits = RequestLimits(
        vocab_size=embedded.VOCAB_SIZE,
        max_context_len=1024,
        eos_token_ids={embedded.EOS_ID},
        grammar_vocabulary=embedded.grammar_vocabulary(),
    )
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=4096)) as engine:
        prompt = [embedded.BOS_ID, *embedded.encode("def add(a, b):\n    return ")]
        req = engine.submit("d", prompt, SamplingParams(max_new_tokens=16))
        as_object = SamplingParams(
            max_new_tokens=32, grammar=Grammar.json_schema({"type": "object"})
        )
        obj = engine.submit("o", [embedded.BOS_ID, *embedded.encode("x = ")], as_object)
        engine.run_until_idle()
        _check_chat_answers([c.stdout for c in chats[:6]], engine)
        _check_top_answers([c.stdout for c in chats[6:]], engine)
    assert answer["model"] == "specstate-embedded"
    assert answer["choices"][0]["token_ids"] == list(req.emitted_ids)
    assert answer["choices"][0]["text"] == embedded.decode(req.emitted_ids)
    shown = re.search(r"Its choice's `text` is `(.*?)`", _docs_page())  # what the page says
    assert shown is not None and answer["choices"][0]["text"] == json.loads(shown.group(1))
    choice = constrained["choices"][0]
    assert choice["token_ids"] == list(obj.emitted_ids)
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["text"]), dict), choice["text"]


def _events(response: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data:`` payloads of a server-sent event stream, until the server closes it."""
    while line := response.readline():
        if line.startswith(b"data: "):
            yield line[len(b"data: ") :].decode().strip()


def _running(url: str) -> float:
    """The engine's running requests, from /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=BOUND_S) as response:
        text = response.read().decode()
    found = re.search(r'^specstate_requests\{state="running"\} (\S+)$', text, re.M)
    return 0.0 if found is None else float(found.group(1))


@pytest.mark.slow
def test_ctrl_c_ends_live_requests_and_exits_within_the_bound() -> None:
    """Ctrl-C while a stream and a whole completion each have tens of seconds of tokens to go:
    both end at once with ``finish_reason: "abort"`` (the stream with that last chunk, then
    ``[DONE]``), and the server exits 0 within the bound docs/serving.md states."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--worker",
            "slow_serve_worker:make",
            "--port",
            str(port),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    whole: dict[str, Any] = {}
    long = {"model": "slow_serve_worker:make", "prompt": [1, 2, 3], "max_tokens": 4000}

    def ask_whole() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
        conn.request("POST", "/v1/completions", json.dumps(long).encode())
        response = conn.getresponse()
        whole.update(status=response.status, body=json.loads(response.read()))
        conn.close()

    asker = threading.Thread(target=ask_whole)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=BOUND_S)
    try:
        _wait_healthy(url, server)
        asker.start()
        conn.request("POST", "/v1/completions", json.dumps({**long, "stream": True}).encode())
        response = conn.getresponse()
        assert response.status == 200
        events = _events(response)
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None
        deadline = time.monotonic() + BOUND_S
        while _running(url) < 2:  # the whole completion runs too
            assert time.monotonic() < deadline, "the second request never ran"
            time.sleep(0.05)
        interrupted = time.monotonic()
        server.send_signal(signal.SIGINT)
        rest = list(events)
        _, stderr = server.communicate(timeout=BOUND_S)
        exited = time.monotonic() - interrupted
        asker.join(BOUND_S)
    finally:
        conn.close()
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert rest[-1] == "[DONE]", rest[-3:]
    last = json.loads(rest[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert whole["status"] == 200, whole
    choice = whole["body"]["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 4000
    assert server.returncode == 0, stderr
    assert exited < SHUTDOWN_BOUND_S, f"exited {exited:.1f} s after Ctrl-C"
    docs = (ROOT / "docs" / "serving.md").read_text(encoding="utf-8")
    assert f"exits within {SHUTDOWN_BOUND_S} s of the interrupt" in docs
