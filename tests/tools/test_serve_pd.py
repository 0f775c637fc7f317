"""`specstate serve --prefill 1 --decode 1`: the real command, the real `openai` client.

The command runs in a process group of its own, as from a terminal: this server process decodes
and hosts the HTTP front door, a spawned process prefills (gloo on 127.0.0.1). Greedy prompts,
whole and streamed, and a seeded sampled one must get the tokens one `Engine` with the same
worker gives (what plain ``specstate serve`` runs), HF ``generate()``'s for the greedy ones, with
the speculation accepting partly; /metrics counts the handoffs. The fault: the prefill process
hangs, then dies, with a request waiting on it: that request and a new one are answered 503
within a bound, /health says why, and the server still stops on Ctrl-C. Every wait is bounded.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import Engine, EngineConfig, SamplingParams
from specstate.distributed import free_port
from specstate.reference.workers import default_registry
from specstate.tools import serve
from specstate.tools.generate import checkpoint_limits

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 240
NEW = 8
STEPS = 3
SAMPLED = ((5, 6, 7), SamplingParams(max_new_tokens=NEW, temperature=0.7, seed=11))


def _env() -> dict[str, str]:
    """This checkout's sources first: both processes import them, not an installed copy."""
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _launch(ckpt: SpecCheckpoints, port: int) -> subprocess.Popen[str]:
    argv = [
        "serve", "--prefill", "1", "--decode", "1",
        "--model", str(ckpt.target), "--algorithm", "eagle", "--draft", str(ckpt.eagle),
        "--num-steps", str(STEPS), "--page-size", "4", "--kv-tokens", "2048",
        "--check-invariants", "--threads", "1", "--port", str(port),
        "--served-model-name", "pd", "--log-level", "warning",
    ]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "specstate.tools.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # a process group of its own, as a terminal's job has
    )


def _wait_healthy(url: str, server: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        assert server.poll() is None, server.communicate()[1][-3000:]
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.3)
    raise AssertionError("the server did not come up")


def _stop(server: subprocess.Popen[str]) -> str:
    """Ctrl-C to the group; the server's stderr once every process is gone."""
    os.killpg(server.pid, signal.SIGINT)
    _, stderr = server.communicate(timeout=BOUND_S)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)
        except ProcessLookupError:
            return stderr
        time.sleep(0.2)
    raise AssertionError(f"a process outlived the server: {stderr[-2000:]}")


@pytest.fixture(scope="module")
def served(partial_ckpt: SpecCheckpoints) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """One ``serve --prefill 1 --decode 1`` for the module."""
    port = free_port()
    server = _launch(partial_ckpt, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        yield url, server
    finally:
        stderr = _stop(server)
    assert server.returncode == 0, stderr[-3000:]
    assert "Traceback" not in stderr and "exited with code" not in stderr, stderr[-3000:]


def _one_engine(
    ckpt: SpecCheckpoints, prompts: list[tuple[int, ...]]
) -> tuple[list[list[int]], list[int]]:
    """One engine with the same worker and options (plain ``specstate serve``'s)."""
    worker = default_registry().create(
        "eagle", target=ckpt.target, eagle=ckpt.eagle, num_steps=STEPS, dtype=torch.float32
    )
    config = EngineConfig(page_size=4, kv_tokens=2048, check_invariants=True)
    with Engine(worker, limits=checkpoint_limits(ckpt.target), config=config) as engine:
        greedy_reqs = [engine.submit(f"g{i}", p, SamplingParams(max_new_tokens=NEW))
                       for i, p in enumerate(prompts)]  # fmt: skip
        sampled = engine.submit("s", *SAMPLED)
        engine.run_until_idle()
    return [list(r.emitted_ids) for r in greedy_reqs], list(sampled.emitted_ids)


@pytest.mark.slow
def test_the_openai_client_gets_one_engines_tokens_through_prefill_then_decode(
    partial_ckpt: SpecCheckpoints, served: tuple[str, subprocess.Popen[str]]
) -> None:
    """Greedy prompts (whole, and one streamed) and a seeded sampled one through prefill →
    decode: one engine's tokens, HF's for the greedy ones, each streamed token once; the
    speculation accepts partly; /metrics counts one handoff a request and their bytes."""
    url, _ = served
    prompts = [tuple(p) for p in MIXED_PROMPTS[:4]]
    expected, expected_sampled = _one_engine(partial_ckpt, prompts)
    assert expected == [greedy(partial_ckpt.hf, p, NEW) for p in prompts]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
    got, accepts = [], []
    for prompt in prompts[:-1]:
        completion = client.completions.create(
            model="pd", prompt=list(prompt), max_tokens=NEW, temperature=0
        )
        got.append((completion.choices[0].model_extra or {})["token_ids"])
        usage = (completion.usage.model_extra or {}) if completion.usage else {}
        accepts.append(usage["speculative"]["mean_accept_length"])
    chunks = client.completions.create(
        model="pd", prompt=list(prompts[-1]), max_tokens=NEW, temperature=0, stream=True
    )
    got.append([t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]])
    sampled = client.completions.create(
        model="pd", prompt=list(SAMPLED[0]), max_tokens=NEW, temperature=0.7, seed=11
    )
    client.close()
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
        metrics = response.read().decode()
    assert got == expected
    assert (sampled.choices[0].model_extra or {})["token_ids"] == expected_sampled
    assert all(1.0 < a < STEPS + 1 for a in accepts), accepts
    assert "specstate_handoffs_total 5.0" in metrics
    assert "specstate_handoff_failures_total 0.0" in metrics
    assert "specstate_handoff_transfer_seconds_count 5.0" in metrics
    found = re.search(r"^specstate_handoff_bytes_total (\S+)$", metrics, re.MULTILINE)
    assert found is not None and float(found.group(1)) > 0
    generated = sum(len(t) for t in got) + len(expected_sampled)
    assert f"specstate_generation_tokens_total {float(generated)}" in metrics


def _prefill_pid(server: subprocess.Popen[str]) -> int:
    """The spawned prefill process: the server's child that runs ``multiprocessing.spawn``."""
    out = subprocess.run(
        ["ps", "--ppid", str(server.pid), "-o", "pid=,args="],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    pids = [
        int(line.split()[0]) for line in out.stdout.splitlines() if "multiprocessing.spawn" in line
    ]
    assert len(pids) == 1, out.stdout
    return pids[0]


@pytest.mark.slow
def test_a_dead_prefill_process_answers_503_within_a_bound(partial_ckpt: SpecCheckpoints) -> None:
    """The prefill process hangs (SIGSTOP) with a request waiting on it, then dies (SIGKILL):
    that request and a new one are answered 503 naming the prefill side, within seconds;
    /health is 503; /metrics counts the failure; Ctrl-C still stops the server."""
    port = free_port()
    server = _launch(partial_ckpt, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        prefill = _prefill_pid(server)
        os.kill(prefill, signal.SIGSTOP)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        waiting: list[BaseException] = []

        def ask() -> None:
            try:
                client.completions.create(model="pd", prompt=[5, 9, 3], max_tokens=NEW)
            except openai.APIStatusError as exc:
                waiting.append(exc)

        thread = threading.Thread(target=ask)
        thread.start()
        time.sleep(1.0)  # the request waits on the hung prefill process
        os.kill(prefill, signal.SIGKILL)
        started = time.monotonic()
        thread.join(60)
        assert not thread.is_alive(), "the waiting request hung"
        assert time.monotonic() - started < 10.0
        assert [getattr(e, "status_code", None) for e in waiting] == [503]
        assert "the prefill side is unavailable" in str(waiting[0])
        with pytest.raises(openai.APIStatusError, match="the prefill side is unavailable") as new:
            client.completions.create(model="pd", prompt=[7, 7], max_tokens=NEW)
        assert new.value.status_code == 503
        client.close()
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health", timeout=30)
        assert health.value.code == 503
        assert b"the prefill side is unavailable" in health.value.read()
        health.value.close()
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
            assert "specstate_handoff_failures_total 1.0" in response.read().decode()
    finally:
        stderr = _stop(server)
    assert "the prefill process exited with code -9" in stderr, stderr[-3000:]


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--prefill", "2"], "only --prefill 1 --decode 1 is served"),
        (["--prefill", "1", "--decode", "2"], "only --prefill 1 --decode 1 is served"),
        (["--decode", "1"], "--decode needs --prefill"),
        (["--prefill", "1", "--tp", "2"], "--prefill cannot be combined with --tp"),
    ],
)
def test_unserved_counts_are_refused_before_anything_starts(
    argv: list[str], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Counts other than one prefill and one decode process exit 2 with one line."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    assert serve.run(parser.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert why in err and len(err.splitlines()) == 1
