"""`specstate serve --tp 2`: two gloo ranks behind one OpenAI-compatible front door.

The command runs for real in a process group of its own, as from a terminal: spawned ranks (this
process is rank 0 and starts rank 1), or one rank per process under torchrun. The real `openai`
client sends greedy prompts whose top-2 logit margin is wide at every step (a sharded matmul
sums in another order, so only those are promised equal across TP sizes), whole and streamed,
and a seeded sampled request; every answer must be the tokens TP = 1 gives (`Engine` driven
directly with the same worker, which is what ``specstate serve`` without ``--tp`` runs) and, for
the greedy ones, Hugging Face ``generate()``'s. Then the group gets SIGINT, as a Ctrl-C would
send it (or the spawned server alone SIGTERM), and every rank must be gone, the spawned
launcher with exit code 0. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import torch
from margin_screen import screen
from spec_checkpoints import SpecCheckpoints

from specstate import Engine, EngineConfig, SamplingParams
from specstate.distributed import free_port
from specstate.reference.workers import default_registry
from specstate.tools.generate import checkpoint_limits

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 240
NEW = 8
SAMPLED = ((5, 6, 7), SamplingParams(max_new_tokens=NEW, temperature=0.7, seed=11))
"""The seeded sampled request `generate --tp`'s test sends too."""


def _env() -> dict[str, str]:
    """This checkout's sources first: the ranks import them, not an installed copy."""
    src = str(ROOT / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def _serve_argv(ckpt: SpecCheckpoints, port: int) -> list[str]:
    return [
        "serve", "--tp", "2",
        "--model", str(ckpt.target), "--algorithm", "eagle", "--draft", str(ckpt.eagle),
        "--num-steps", "3", "--page-size", "4", "--kv-tokens", "2048",
        "--check-invariants", "--threads", "1", "--port", str(port),
        "--served-model-name", "tp", "--log-level", "warning",
    ]  # fmt: skip


def _launch(how: str, ckpt: SpecCheckpoints, port: int) -> subprocess.Popen[str]:
    cli = ["-m", "specstate.tools.cli", *_serve_argv(ckpt, port)]
    if how == "torchrun":
        torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
        cli = [*torchrun, "--master-port", str(free_port()), *cli]
    return subprocess.Popen(
        [sys.executable, *cli],
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


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _tp1(
    ckpt: SpecCheckpoints, prompts: list[tuple[int, ...]]
) -> tuple[list[list[int]], list[int]]:
    """TP = 1: the same worker and engine options on one `Engine`; greedy, then sampled."""
    worker = default_registry().create(
        "eagle", target=ckpt.target, eagle=ckpt.eagle, num_steps=3, dtype=torch.float32
    )
    config = EngineConfig(page_size=4, kv_tokens=2048, check_invariants=True)
    with Engine(worker, limits=checkpoint_limits(ckpt.target), config=config) as engine:
        greedy = [engine.submit(f"g{i}", p, SamplingParams(max_new_tokens=NEW))
                  for i, p in enumerate(prompts)]  # fmt: skip
        sampled = engine.submit("s", *SAMPLED)
        engine.run_until_idle()
    return [list(r.emitted_ids) for r in greedy], list(sampled.emitted_ids)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "stop"),
    [("spawned", "ctrl-c"), ("spawned", "sigterm"), ("torchrun", "ctrl-c")],
)
def test_serve_tp2_answers_the_openai_client_with_the_tp1_tokens(
    how: str, stop: str, partial_ckpt: SpecCheckpoints
) -> None:
    """``serve --tp 2`` (spawned, or under torchrun) answers greedy prompts, whole and
    streamed, and a seeded sampled one with TP = 1's tokens (HF's too, for the greedy ones);
    its /metrics counts them; a Ctrl-C (SIGINT to the group), or SIGTERM to the spawned
    server alone, stops every rank."""
    screened = screen(partial_ckpt.hf, (5, 9, 3, 12, 7), vocab_size=97, max_new_tokens=NEW, keep=3)
    prompts = list(screened)
    expected, expected_sampled = _tp1(partial_ckpt, prompts)
    assert expected == [screened[p] for p in prompts]
    port = free_port()
    server = _launch(how, partial_ckpt, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
        )
        got = []
        for prompt in prompts[:-1]:
            completion = client.completions.create(
                model="tp", prompt=list(prompt), max_tokens=NEW, temperature=0
            )
            got.append((completion.choices[0].model_extra or {})["token_ids"])
        chunks = client.completions.create(
            model="tp", prompt=list(prompts[-1]), max_tokens=NEW, temperature=0, stream=True
        )
        got.append([t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]])
        sampled = client.completions.create(
            model="tp", prompt=list(SAMPLED[0]), max_tokens=NEW, temperature=0.7, seed=11
        )
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as response:
            metrics = response.read().decode()
        client.close()
    finally:
        if stop == "ctrl-c":
            os.killpg(server.pid, signal.SIGINT)  # a terminal sends it to the whole group
        else:
            server.send_signal(signal.SIGTERM)  # to rank 0 alone, as a service manager does
        _, stderr = server.communicate(timeout=BOUND_S)
    assert got == expected
    assert (sampled.choices[0].model_extra or {})["token_ids"] == expected_sampled
    generated = sum(len(t) for t in got) + len(expected_sampled)
    assert f"specstate_generation_tokens_total {float(generated)}" in metrics
    deadline = time.monotonic() + 60
    while not _group_gone(server.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _group_gone(server.pid), "a rank outlived the server"
    if how == "spawned":  # torchrun itself reports the signal it got, with a traceback
        # After SIGTERM, as with one rank: uvicorn shuts down, then re-raises what it caught.
        clean = 0 if stop == "ctrl-c" else -signal.SIGTERM
        assert server.returncode == clean, stderr[-3000:]
        assert "exited with code" not in stderr and "Traceback" not in stderr, stderr[-3000:]


def test_serve_help_lists_tp(capsys: pytest.CaptureFixture[str]) -> None:
    """``serve --help`` offers ``--tp N`` (a usage error before: unrecognized arguments)."""
    from specstate.tools.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--tp N" in capsys.readouterr().out


def test_a_busy_port_fails_before_any_rank_starts() -> None:
    """``serve --tp 2`` on a port something listens on exits 2 at once, one line, no rank."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "specstate.tools.cli", "serve", "--tp", "2", "--port",
             str(port)],
            capture_output=True, text=True, env=_env(), timeout=BOUND_S, check=False,
        )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith(f"specstate serve: cannot listen on 127.0.0.1:{port}")
    assert len(done.stderr.splitlines()) == 1


def _rank_one_pid(server: subprocess.Popen[str]) -> int:
    """The spawned follower's process: the server's child that runs ``spawn_main`` (not
    multiprocessing's resource tracker)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == server.pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            return int(proc.name)
    raise AssertionError("no follower process")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the follower through /proc")
def test_a_dead_rank_makes_the_server_unhealthy_not_hung(partial_ckpt: SpecCheckpoints) -> None:
    """Rank 1 killed while the server idles: the next request answers 503 (the engine can no
    longer step), /health says so, and the command, stopped, exits 2 naming rank 1. (A server
    whose rank 0 did not drive rank 1 would answer as if nothing happened.)"""
    port = free_port()
    server = _launch("spawned", partial_ckpt, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
        )
        first = client.completions.create(model="tp", prompt=[5, 6, 7], max_tokens=4)
        assert first.choices[0].finish_reason == "length"
        os.kill(_rank_one_pid(server), signal.SIGKILL)
        with pytest.raises(openai.APIStatusError) as failed:
            client.completions.create(model="tp", prompt=[5, 6, 7], max_tokens=4)
        assert failed.value.status_code == 503
        assert "RankFailure" in failed.value.message
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{url}/health", timeout=60)
        health.value.close()
        assert health.value.code == 503
        client.close()
    finally:
        os.killpg(server.pid, signal.SIGINT)
        _, stderr = server.communicate(timeout=BOUND_S)
    assert server.returncode == 2, stderr[-3000:]
    assert "specstate serve: rank 1 exited with code -9" in stderr
