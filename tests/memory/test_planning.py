"""KV memory planning agrees with what the reference workers really allocate.

The oracle is the KV cache tensors a worker's ``attach`` allocates: every `KvCache` reachable
from an attached worker, measured as ``numel() * element_size()`` of its K and V buffers. The
plan (`kv_layouts`, `kv_bytes_for_tokens`, `kv_tokens_for_budget`) is computed from the
checkpoints' ``config.json`` alone. `requests_that_fit` is checked against the engine: that many
requests of the planned length run at once, to the end, with no retraction.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch
from spec_checkpoints import SpecCheckpoints, make_spec_checkpoints

from specstate import (
    Engine,
    EngineConfig,
    InvalidConfig,
    InvalidRequest,
    KvLayout,
    RequestLimits,
    SamplingParams,
    WorkerProtocol,
    kv_bytes_for_tokens,
    kv_layouts,
    kv_tokens_for_budget,
    requests_that_fit,
)
from specstate.engine import planning
from specstate.engine.planning import format_bytes, parse_bytes
from specstate.reference.eagle_head import EAGLE_MODEL_TYPE
from specstate.reference.model import KvCache
from specstate.reference.workers import default_registry
from specstate.tools.timed_worker import TimedWaitWorker


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A one-layer GQA target (4 heads, 2 KV heads), a narrower draft and an EAGLE head."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("planning"))


def _worker(ckpt: SpecCheckpoints, algorithm: str, dtype: torch.dtype | None) -> WorkerProtocol:
    options: dict[str, object] = {"target": ckpt.target, "dtype": dtype}
    if algorithm != "none":
        options["num_steps"] = 3
    if algorithm == "draft_model":
        options["draft"] = ckpt.draft  # 16 wide: a cache of its own shape
    if algorithm == "eagle":
        options["eagle"] = ckpt.eagle
    return default_registry().create(algorithm, **options)


def _planned(ckpt: SpecCheckpoints, algorithm: str, dtype: torch.dtype | None) -> list[KvLayout]:
    draft = ckpt.draft if algorithm == "draft_model" else None
    eagle = ckpt.eagle if algorithm == "eagle" else None
    return list(kv_layouts(ckpt.target, draft=draft, eagle=eagle, dtype=dtype))


def _allocated_kv_bytes(root: object) -> int:
    """Bytes of every KV cache buffer reachable from ``root`` (each tensor counted once)."""
    seen: set[int] = set()
    buffers: dict[int, torch.Tensor] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor | str | bytes | int | float | Path):
            continue
        seen.add(id(obj))
        if isinstance(obj, KvCache):
            for t in [*obj._keys, *obj._values]:
                buffers[id(t)] = t
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
        elif attrs.has(kind := type(obj)):  # attrs classes have slots, no __dict__
            stack.extend(getattr(obj, a.name) for a in attrs.fields(kind))
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(t.numel() * t.element_size() for t in buffers.values())


def _attached_bytes(worker: WorkerProtocol, vocab_size: int, kv_tokens: int, page: int) -> int:
    config = EngineConfig(kv_tokens=kv_tokens, page_size=page, overlap=False)
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=config) as engine:
        return _allocated_kv_bytes(engine.worker)


@pytest.mark.parametrize("algorithm", ["none", "draft_model", "eagle", "ngram"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["checkpoint", "bf16"])
def test_planned_bytes_equal_the_allocated_caches(
    ckpt: SpecCheckpoints, algorithm: str, page_size: int, dtype: torch.dtype | None
) -> None:
    """kv_bytes_for_tokens == the bytes of the caches attach() allocates, for every worker."""
    kv_tokens = 1000  # not a multiple of 16: the pool keeps whole pages
    worker = _worker(ckpt, algorithm, dtype)
    measured = _attached_bytes(worker, ckpt.vocab_size, kv_tokens, page_size)
    layouts = _planned(ckpt, algorithm, dtype)
    assert measured > 0
    assert kv_bytes_for_tokens(kv_tokens, layouts, page_size=page_size) == measured


@pytest.mark.parametrize("algorithm", ["none", "draft_model", "eagle"])
def test_a_budget_buys_the_most_pages_that_fit(ckpt: SpecCheckpoints, algorithm: str) -> None:
    """The caches of kv_tokens_for_budget(B) fit in B; one more page would not."""
    budget, page = 300_000, 16
    layouts = _planned(ckpt, algorithm, None)
    kv_tokens = kv_tokens_for_budget(budget, layouts, page_size=page)
    assert kv_tokens % page == 0
    fits = _attached_bytes(_worker(ckpt, algorithm, None), ckpt.vocab_size, kv_tokens, page)
    over = _attached_bytes(_worker(ckpt, algorithm, None), ckpt.vocab_size, kv_tokens + page, page)
    assert fits <= budget < over


def test_a_budget_under_two_pages_is_refused(ckpt: SpecCheckpoints) -> None:
    """The engine needs two pages; a smaller budget names its size and the per-slot cost."""
    layouts = _planned(ckpt, "none", None)
    per_token = sum(layout.bytes_per_token for layout in layouts)
    with pytest.raises(InvalidConfig, match=rf"holds 16 token slots at {per_token} bytes"):
        kv_tokens_for_budget(per_token * 31, layouts, page_size=16)


def test_layouts_read_gpt2_qwen2_and_eagle_configs(tmp_path: Path) -> None:
    """GPT-2 names (n_layer, n_head, n_embd), GQA with an explicit head_dim, and a head."""
    gpt2 = {"model_type": "gpt2", "n_layer": 3, "n_head": 4, "n_embd": 64}
    assert KvLayout.from_config(gpt2).bytes_per_token == 2 * 3 * 4 * 16 * 4
    qwen: dict[str, object] = {"num_hidden_layers": 2, "num_attention_heads": 8}
    qwen |= {
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    assert KvLayout.from_config(tmp_path).bytes_per_token == 2 * 2 * 2 * 64 * 2
    head = {"model_type": EAGLE_MODEL_TYPE, "num_attention_heads": 4, "hidden_size": 32}
    assert KvLayout.from_config(head).num_layers == 1
    assert planning.EAGLE_MODEL_TYPE == EAGLE_MODEL_TYPE
    with pytest.raises(InvalidConfig, match="no num_hidden_layers or n_layer"):
        KvLayout.from_config({"num_attention_heads": 4, "hidden_size": 32})


def _submits(
    worker: TimedWaitWorker,
    kv_tokens: int,
    page_size: int,
    prompt: list[int],
    params: SamplingParams,
) -> bool:
    """Whether an engine with ``kv_tokens`` slots takes the request at submit."""
    fresh = TimedWaitWorker(device_seconds=0.0, num_steps=worker.capabilities.num_steps)
    config = EngineConfig(kv_tokens=kv_tokens, page_size=page_size)
    with Engine(
        fresh, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config
    ) as e:
        try:
            e.submit("probe", prompt, params)
        except InvalidRequest:
            return False
    return True


@pytest.mark.parametrize(("num_steps", "page_size"), [(3, 1), (3, 4), (0, 4)])
def test_that_many_requests_run_at_once_without_retraction(num_steps: int, page_size: int) -> None:
    """requests_that_fit(kv_tokens, n) requests of n tokens all run together to the end."""
    worker = TimedWaitWorker(device_seconds=0.0, num_steps=max(num_steps, 1), accept=2)
    caps = worker.capabilities
    if num_steps == 0:
        caps = attrs.evolve(caps, num_steps=0, num_draft_tokens=1)
    prompt_len, new_tokens, kv_tokens = 7, 25, 640
    count = requests_that_fit(kv_tokens, prompt_len + new_tokens, caps, page_size=page_size)
    reserve = caps.spec_window(page_size).reserve
    assert count == (kv_tokens // page_size - 1) // -(
        -(prompt_len + new_tokens + reserve) // page_size
    )
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    alone = -(-(prompt_len + new_tokens + reserve) // page_size) + 2  # the smallest pool for one
    for pages, fits in ((alone, True), (alone - 1, False)):
        planned = requests_that_fit(
            pages * page_size, prompt_len + new_tokens, caps, page_size=page_size
        )
        assert bool(planned) == fits
        if num_steps:  # Engine.submit agrees: it refuses a request the pool cannot hold
            assert _submits(worker, pages * page_size, page_size, [1] * prompt_len, params) == fits
    if num_steps == 0:
        return  # the stand-in worker always speculates: the arithmetic is checked above
    config = EngineConfig(
        kv_tokens=kv_tokens, page_size=page_size, max_running=64, check_invariants=True
    )
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config)
    reqs = [engine.submit(f"r{i}", [1] * prompt_len, params) for i in range(count)]
    most_running, retracted = 0, 0
    while not engine.is_idle:
        report = engine.step()
        retracted += len(report.retracted)
        most_running = max(most_running, engine.snapshot().num_running)
    engine.close()
    assert retracted == 0 and most_running == count
    assert all(len(r.emitted_ids) == new_tokens for r in reqs)


def test_bytes_are_parsed_and_shown_in_both_unit_systems() -> None:
    """2GiB is 2**31, 1.5GB 1.5e9, a bare number bytes; an unknown unit is refused."""
    assert parse_bytes("2GiB") == 2**31 and parse_bytes("512 mib") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a byte size"):
        parse_bytes("2 gigs")
    assert format_bytes(2**31) == "2 GiB" and format_bytes(1536) == "1.5 KiB"
