"""Tooling inputs a user can get wrong: traces, metrics registries, worker factories, results.

* `specstate trace` on a trace with a malformed record exits 2 with one line naming the file,
  the line and the field, in every mode (summary, ``--check``, ``--request``, ``--perfetto``);
* `register_metrics` refuses a prefix its registry already holds (the same engine twice, or
  two engines under one prefix): `InvalidConfig`, nothing exported twice;
* ``generate --worker``: a factory, an import or an attach raising a `BaseException` subclass
  is one line (exit 2), not a traceback; a request line with an integer past the float range
  is one line too;
* a worker whose forward returns None ends its batch with `WorkerResultError` saying so.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from specstate import (
    Engine,
    EngineConfig,
    FinishReason,
    InvalidConfig,
    RequestLimits,
    SamplingParams,
)
from specstate.batch.forward_batch import ForwardBatch
from specstate.engine.metrics import register_metrics
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import OnPublish
from specstate.tools.cli import main
from specstate.tools.timed_worker import TimedWaitWorker

LIMITS = RequestLimits(vocab_size=32, max_context_len=64)


def _engine(**options: Any) -> Engine:
    return Engine(
        TimedWaitWorker(device_seconds=0.0),
        limits=LIMITS,
        config=EngineConfig(kv_tokens=512, check_invariants=True),
        **options,
    )


@pytest.fixture(scope="module")
def trace_lines(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The records of a real recorded run: spans, publishes, rounds and events."""
    recorder = TraceRecorder()
    with _engine(trace=recorder) as engine:
        for i in range(3):
            engine.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=5, ignore_eos=True))
        engine.run_until_idle()
    path = tmp_path_factory.mktemp("trace") / "good.jsonl"
    recorder.write_jsonl(path)
    records = [json.loads(x) for x in path.read_text().splitlines()]
    assert {r["type"] for r in records} == {"header", "span", "publish", "round", "event"}
    return records


def _first(records: list[dict[str, Any]], kind: str) -> int:
    return next(i for i, r in enumerate(records) if r["type"] == kind)


def _break_round_rows(r: dict[str, Any]) -> None:
    del r["rows"]


def _break_span_ts(r: dict[str, Any]) -> None:
    del r["ts_us"]


def _break_round_batch(r: dict[str, Any]) -> None:
    r["batch"] = "7"


def _break_accept_column(r: dict[str, Any]) -> None:
    r["rows"]["accept"] = ["2"] * len(r["rows"]["accept"])


def _break_column_length(r: dict[str, Any]) -> None:
    r["rows"]["committed"] = r["rows"]["committed"][:-1] or [0, 0]


def _break_event_id(r: dict[str, Any]) -> None:
    r["id"] = None


def _break_verify(r: dict[str, Any]) -> None:
    r["verify"] = 1


def _break_header_worker(r: dict[str, Any]) -> None:
    r["worker"] = "eagle"


@pytest.mark.parametrize("mode", [[], ["--check"], ["--request", "r0"], ["--json"], ["--perfetto"]])
@pytest.mark.parametrize(
    ("kind", "breaks", "named"),
    [
        ("round", _break_round_rows, "round record has no 'rows' object"),
        ("span", _break_span_ts, "span record has no field 'ts_us'"),
        ("round", _break_round_batch, "round record field 'batch' must be an integer, got '7'"),
        ("round", _break_accept_column, "column rows.accept must be a list of integers"),
        ("round", _break_column_length, "column rows.committed has"),
        ("round", _break_verify, "field 'verify' must be true or false, got 1"),
        ("event", _break_event_id, "event record field 'id' must be a string, got None"),
        ("header", _break_header_worker, "header field 'worker' must be an object"),
    ],
)
def test_a_malformed_trace_record_is_one_line_exit_2(
    trace_lines: list[dict[str, Any]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    kind: str,
    breaks: Any,
    named: str,
    mode: list[str],
) -> None:
    """Exit 2, one line naming file:line and the field; no traceback, nothing written."""
    records = json.loads(json.dumps(trace_lines))
    index = _first(records, kind)
    breaks(records[index])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "perfetto.json"
    argv = ["trace", str(path), *(mode if mode != ["--perfetto"] else ["--perfetto", str(out)])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"bad.jsonl:{index + 1}: " in err and named in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not out.exists()


def test_the_recorded_trace_itself_reads_in_every_mode(
    trace_lines: list[dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The schema check accepts what the recorder writes (summary, check, request, Perfetto)."""
    path = tmp_path / "good.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in trace_lines))
    for mode in ([], ["--check"], ["--request", "r1"], ["--perfetto", str(tmp_path / "p.json")]):
        assert main(["trace", str(path), *mode]) == 0
    capsys.readouterr()


def test_registering_metrics_twice_is_refused() -> None:
    """Same engine twice, or two engines under one prefix: InvalidConfig; each series once."""
    first, second = _engine(), _engine()
    registry = CollectorRegistry()
    register_metrics(first, registry)
    for engine in (first, second):
        with pytest.raises(InvalidConfig, match=r"already has series named specstate_\*"):
            register_metrics(engine, registry)
    register_metrics(second, registry, prefix="second")  # its own prefix is fine
    text = generate_latest(registry).decode()
    assert text.count("\nspecstate_kv_pages ") == 1 and text.count("\nsecond_kv_pages ") == 1
    first.close()
    second.close()


FACTORIES = """
from specstate import RequestLimits
from specstate.tools.timed_worker import TimedWaitWorker
from test_tool_inputs_boom import Boom


def raises_base(args):
    raise Boom("from the factory")


class _AttachRaises(TimedWaitWorker):
    def attach(self, memory):
        raise Boom("from attach")


def attach_raises(args):
    return _AttachRaises(device_seconds=0.0), RequestLimits(vocab_size=32, max_context_len=64)
"""


@pytest.fixture
def base_factories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[str]:
    """Worker factories that raise a BaseException subclass, in the working directory."""
    name = f"base_factories_{abs(hash(request.node.name))}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    (tmp_path / "test_tool_inputs_boom.py").write_text("class Boom(BaseException):\n    pass\n")
    (tmp_path / f"{name}_import.py").write_text(
        "from test_tool_inputs_boom import Boom\nraise Boom('at import')\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    for module in (name, f"{name}_import", "test_tool_inputs_boom"):
        sys.modules.pop(module, None)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{m}:raises_base", "the factory raised Boom: from the factory (at "),
        ("{m}:attach_raises", "the worker failed to attach (Boom: from attach (at "),
        ("{m}_import:make", "importing {m}_import failed: Boom: at import (at "),
    ],
)
def test_a_factory_raising_a_base_exception_is_one_line(
    base_factories: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    spec: str,
    message: str,
) -> None:
    """A BaseException subclass from the factory, its import or the worker's attach: exit 2,
    one line naming --worker."""
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n')
    spec = spec.format(m=base_factories)
    argv = ["generate", "--worker", spec, "--input", "in.jsonl", "--output", "o.jsonl"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--worker {spec}" in err and message.format(m=base_factories) in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"]
)
def test_an_integer_past_the_float_range_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    """``"temperature": 1 followed by 400 zeros`` exits 2 naming the line and the field."""
    (tmp_path / "in.jsonl").write_text(
        '{"id": "a", "input_ids": [1], "%s": 1%s}\n' % (field, "0" * 400)  # noqa: UP031
    )
    argv = ["generate", "--model", str(tmp_path / "none"), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f'in.jsonl:1: "{field}" must be a number' in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


class _ReturnsNone(TimedWaitWorker):
    """Forgets to return its result on the second forward."""

    calls = 0

    def forward_batch_generation(  # type: ignore[override]
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> None:
        self.calls += 1
        result = super().forward_batch_generation(batch, on_publish=on_publish)
        return None if self.calls == 2 else result  # type: ignore[return-value]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_worker_returning_none_is_a_worker_result_error(overlap: bool) -> None:
    """The batch ends with WorkerResultError naming what came back; the next batch serves."""
    config = EngineConfig(kv_tokens=512, overlap=overlap, check_invariants=True)
    worker: Any = _ReturnsNone(device_seconds=0.0)  # its forward may return None
    with Engine(worker, limits=LIMITS, config=config) as engine:
        first = engine.submit("a", [1, 2], SamplingParams(max_new_tokens=6, ignore_eos=True))
        engine.run_until_idle()
        second = engine.submit("b", [1, 2], SamplingParams(max_new_tokens=6, ignore_eos=True))
        engine.run_until_idle()
    assert first.finish is not None and first.finish.reason is FinishReason.ERROR
    assert first.finish.detail.startswith(
        "WorkerResultError: worker returned NoneType None, not a GenerationBatchResult"
    ), first.finish.detail
    assert second.finish is not None and second.finish.reason is FinishReason.LENGTH
