"""Reference workers against transformers' greedy generate(), driven by the hand-made loop."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from spec_checkpoints import identity_head
from transformers import LlamaConfig, LlamaForCausalLM
from worker_harness import HarnessRun, run_worker

from specstate import ForwardBatch, ForwardMode, InvalidConfig, SamplingInfo, SamplingParams
from specstate.engine.worker import WorkerMemory, WorkerProtocol
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
from specstate.reference.model import AttentionBatch, ModelOutput, PagedLlama
from specstate.reference.workers import (
    DraftModelWorker,
    EagleWorker,
    NgramWorker,
    PlainWorker,
    TokenHistory,
    default_registry,
)

VOCAB = 96
NUM_NEW = 16
NUM_STEPS = 3
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 33)), [40, 41, 40]]
REPETITIVE = [[7, 8, 9, 10] * 4, [3, 4] * 5, [50, 51, 52, 53, 54, 50, 51, 52]]


def make_hf(path: Path, seed: int, **overrides: Any) -> LlamaForCausalLM:
    """Saves a seeded random tiny Llama (no eos, perturbed norms) to ``path``; returns it."""
    fields: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "initializer_range": 0.1,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig(**(fields | overrides)))
    hf.train(False)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    hf.save_pretrained(path)
    return hf


def hf_greedy(hf: LlamaForCausalLM, prompts: list[list[int]]) -> dict[str, list[int]]:
    """The oracle: ``generate(do_sample=False)`` continuation of each prompt, keyed r0, r1, ..."""
    out = {}
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            full = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NUM_NEW
            )
        out[f"r{i}"] = full[0, len(prompt) :].tolist()
    return out


def random_head(target: PagedLlama, seed: int) -> EagleHead:
    """A seeded random head for ``target`` (norm weights perturbed)."""
    torch.manual_seed(seed)
    head = EagleHead(EagleHeadConfig.for_target(target.config, intermediate_size=48), target)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    return head


@attrs.frozen
class Checkpoints:
    """Tiny checkpoints of one module, and the oracle's outputs."""

    target: Path
    draft: Path
    eagle: Path
    target1: Path
    eagle1: Path
    expected: dict[str, list[int]]
    expected1: dict[str, list[int]]
    expected_repetitive: dict[str, list[int]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """target (2 layers), a smaller drafter, a random head, a 1-layer target with its twin head."""
    root = tmp_path_factory.mktemp("workers")
    hf = make_hf(root / "target", seed=0)
    make_hf(
        root / "draft",
        seed=1,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=32,
    )
    hf1 = make_hf(root / "target1", seed=2, num_hidden_layers=1)
    save_eagle_head(
        random_head(load_paged_llama(root / "target", num_token_slots=2), 3), root / "eagle"
    )
    save_eagle_head(
        identity_head(load_paged_llama(root / "target1", num_token_slots=2)), root / "eagle1"
    )
    return Checkpoints(
        target=root / "target",
        draft=root / "draft",
        eagle=root / "eagle",
        target1=root / "target1",
        eagle1=root / "eagle1",
        expected=hf_greedy(hf, PROMPTS),
        expected1=hf_greedy(hf1, PROMPTS),
        expected_repetitive=hf_greedy(hf, REPETITIVE),
    )


def build(algorithm: str, ckpt: Checkpoints, *, twin: bool = False) -> WorkerProtocol:
    """A worker of ``algorithm``; ``twin``: the drafter is as good as the target itself."""
    registry = default_registry()
    if algorithm == "draft_model":
        draft = ckpt.target if twin else ckpt.draft
        return registry.create(algorithm, target=ckpt.target, draft=draft, num_steps=NUM_STEPS)
    if algorithm == "eagle":
        target, head = (ckpt.target1, ckpt.eagle1) if twin else (ckpt.target, ckpt.eagle)
        return registry.create(algorithm, target=target, eagle=head, num_steps=NUM_STEPS)
    if algorithm == "ngram":
        return registry.create(algorithm, target=ckpt.target, num_steps=NUM_STEPS)
    return registry.create(algorithm, target=ckpt.target)


ALGORITHMS = ["none", "draft_model", "eagle", "ngram"]
LAYOUTS = [pytest.param(1, None, id="page1"), pytest.param(16, 4, id="page16-chunked4")]


@pytest.mark.parametrize(("page_size", "chunk_size"), LAYOUTS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_greedy_output_equals_hf_generate(
    ckpt: Checkpoints, algorithm: str, page_size: int, chunk_size: int | None
) -> None:
    """Three batched prompts decode to exactly HF's greedy tokens, accept_len within [1, D]."""
    worker = build(algorithm, ckpt)
    run = run_worker(
        worker,
        PROMPTS,
        max_new_tokens=NUM_NEW,
        vocab_size=VOCAB,
        page_size=page_size,
        chunk_size=chunk_size,
    )
    assert run.outputs == ckpt.expected
    width = worker.capabilities.num_draft_tokens
    assert all(1 <= a <= width for a in run.all_accept_lens)


def accept_stats(run: HarnessRun, width: int) -> tuple[float, int]:
    """Mean accept length and the number of all-accept rows."""
    lens = run.all_accept_lens
    return sum(lens) / len(lens), sum(a == width for a in lens)


@pytest.mark.parametrize(("page_size", "chunk_size"), LAYOUTS)
@pytest.mark.parametrize("algorithm", ["draft_model", "eagle"])
def test_drafter_as_good_as_target_accepts_whole_chains(
    ckpt: Checkpoints, algorithm: str, page_size: int, chunk_size: int | None
) -> None:
    """A drafter equal to the target accepts every chain (D tokens) and still matches HF."""
    worker = build(algorithm, ckpt, twin=True)
    run = run_worker(
        worker,
        PROMPTS,
        max_new_tokens=NUM_NEW,
        vocab_size=VOCAB,
        page_size=page_size,
        chunk_size=chunk_size,
    )
    assert run.outputs == (ckpt.expected1 if algorithm == "eagle" else ckpt.expected)
    mean, whole = accept_stats(run, NUM_STEPS + 1)
    # Exact on this machine (4.0); the margin only absorbs an argmax near-tie on another BLAS.
    assert mean >= 0.9 * (NUM_STEPS + 1), run.decode_accept_lens
    assert whole >= 0.8 * len(run.all_accept_lens)


@pytest.mark.parametrize("page_size", [1, 16])
def test_ngram_on_repetitive_prompts_accepts_more_than_one(
    ckpt: Checkpoints, page_size: int
) -> None:
    """N-gram lookup on repetitive text accepts > 1 token per round, with all-accept rounds."""
    worker = build("ngram", ckpt)
    assert isinstance(worker, NgramWorker)
    run = run_worker(
        worker, REPETITIVE, max_new_tokens=NUM_NEW, vocab_size=VOCAB, page_size=page_size
    )
    assert run.outputs == ckpt.expected_repetitive
    mean, whole = accept_stats(run, NUM_STEPS + 1)
    assert mean > 1.5, run.decode_accept_lens
    assert whole > 0
    for i, prompt in enumerate(REPETITIVE):  # history = settled tokens (the last bonus aside)
        settled = prompt + run.outputs[f"r{i}"]
        row = worker.history.read(torch.tensor([run.slots[f"r{i}"]]))[0]
        assert row[: len(settled) - 1].tolist() == settled[:-1]


def spy(module: torch.nn.Module, name: str, events: list[str]) -> None:
    """Appends ``name`` to ``events`` before every forward of ``module``."""

    def hook(_module: torch.nn.Module, _args: object) -> None:
        events.append(name)

    module.register_forward_pre_hook(hook)


def drafting_modules(worker: WorkerProtocol) -> list[torch.nn.Module]:
    """The drafter modules of a reference worker (none for ``none`` and ``ngram``)."""
    if isinstance(worker, DraftModelWorker):
        return [worker.draft_model]
    if isinstance(worker, EagleWorker):
        return [worker.head]
    return []


def attach_spies(worker: WorkerProtocol, events: list[str]) -> WorkerProtocol:
    """Wraps ``attach`` so that the built models record their forwards into ``events``."""
    assert isinstance(worker, PlainWorker | DraftModelWorker | EagleWorker | NgramWorker)
    inner = worker.attach

    def attach(memory: WorkerMemory) -> None:
        inner(memory)
        spy(worker.target_model, "target", events)
        for module in drafting_modules(worker):
            spy(module, "draft", events)

    worker.attach = attach  # type: ignore[method-assign]
    return worker


def forwards(events: list[str], mode: str) -> list[list[str]]:
    """The events inside each forward of ``mode``."""
    found: list[list[str]] = []
    current: list[str] | None = None
    for event in events:
        if event.startswith("forward:"):
            current = [] if event == f"forward:{mode}" else None
        elif event == "return" and current is not None:
            found.append(current)
            current = None
        elif current is not None:
            current.append(event)
    return found


ORDER: dict[str, tuple[list[str], list[str]]] = {
    # algorithm: (EXTEND events, DECODE events)
    "none": (["target", "publish"], ["target", "publish"]),
    "ngram": (["target", "publish"], ["target", "publish"]),
    "draft_model": (
        ["target", "publish", "draft"],
        ["draft"] * NUM_STEPS + ["target", "publish", "draft"],
    ),
    "eagle": (
        ["target", "publish", "draft"],
        ["draft"] * NUM_STEPS + ["target", "publish", "draft"],
    ),
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_publish_once_after_verify_before_post_verify_work(
    ckpt: Checkpoints, algorithm: str
) -> None:
    """Each forward publishes once: after the target decided, before the drafter catches up."""
    events: list[str] = []
    worker = attach_spies(build(algorithm, ckpt), events)
    run = run_worker(
        worker,
        PROMPTS,
        max_new_tokens=6,
        vocab_size=VOCAB,
        page_size=4,
        chunk_size=5,
        events=events,
    )
    extend_order, decode_order = ORDER[algorithm]
    extends, decodes = forwards(events, "extend"), forwards(events, "decode")
    assert extends and all(e == extend_order for e in extends)
    assert decodes and all(d == decode_order for d in decodes)
    assert len(run.publishes) == len(extends) + len(decodes)


@attrs.frozen
class HeadCall:
    """One forward of the EAGLE head, and where in the round it happened."""

    mode: str
    after_publish: bool
    index_in_forward: int
    batch: AttentionBatch
    features: torch.Tensor


def record_head_calls(worker: EagleWorker, events: list[str], calls: list[HeadCall]) -> None:
    """Wraps ``attach`` so that every head forward is recorded with its round phase."""
    inner = worker.attach

    def hook(_module: torch.nn.Module, args: tuple[object, ...]) -> None:
        start = max(i for i, e in enumerate(events) if e.startswith("forward:"))
        since = events[start + 1 :]
        batch, features = args[0], args[1]
        assert isinstance(batch, AttentionBatch) and isinstance(features, torch.Tensor)
        mode = events[start].removeprefix("forward:")
        calls.append(HeadCall(mode, "publish" in since, since.count("head"), batch, features))
        events.append("head")

    def attach(memory: WorkerMemory) -> None:
        inner(memory)
        worker.head.register_forward_pre_hook(hook)

    worker.attach = attach  # type: ignore[method-assign]


def true_features(target: Path, tokens: list[int]) -> torch.Tensor:
    """Target features ``[len, hidden]`` of a whole sequence in one dense-layout prefill."""
    model = load_paged_llama(target, num_token_slots=len(tokens) + 1)
    table = torch.arange(len(tokens) + 1)[None, :].repeat(2, 1)
    positions = torch.arange(len(tokens))
    batch = AttentionBatch(
        input_ids=torch.tensor(tokens),
        positions=positions,
        out_cache_loc=positions + 1,
        req_pool_indices=torch.tensor([1]),
        req_to_token=table[:, 1:],
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([len(tokens)]),
    )
    out: ModelOutput = model(batch)
    return out.hidden_states


def checked_tokens(call: HeadCall, truth: dict[int, list[int]]) -> list[tuple[int, int, int]]:
    """``(row index, slot, position)`` of the tokens whose feature must be the true one.

    Extends: every token. Chain step 0: the root. Draft-extend: the chain prefix that matches
    the settled sequence (the accepted tokens).
    """
    batch, chosen, offset = call.batch, [], 0
    for slot, ext in zip(batch.req_pool_indices.tolist(), batch.extend_lens.tolist(), strict=True):
        seq = truth[slot]
        for i in range(ext):
            pos, tok = int(batch.positions[offset + i]), int(batch.input_ids[offset + i])
            if pos >= len(seq) or tok != seq[pos]:
                break
            if call.mode == "extend" or call.after_publish or call.index_in_forward == 0:
                chosen.append((offset + i, slot, pos))
            if call.mode == "decode" and not call.after_publish:
                break  # chain steps past the root use the head's own features
        offset += ext
    return chosen


@pytest.mark.slow
@pytest.mark.parametrize(
    ("twin", "page_size", "chunk_size"),
    [
        pytest.param(False, 1, 3, id="random-head-page1-chunked3"),
        pytest.param(True, 16, None, id="twin-head-page16"),
    ],
)
def test_eagle_head_sees_true_target_features(
    ckpt: Checkpoints, twin: bool, page_size: int, chunk_size: int | None
) -> None:
    """Every head token below the settled frontier gets f_(p-1) of the real sequence (0 at 0).

    The random head is rejected at once (a = 1); the twin head is accepted whole (a = D), so
    both ends of the relayed feature H[S + a - 1] are covered.
    """
    events: list[str] = []
    calls: list[HeadCall] = []
    worker = build("eagle", ckpt, twin=twin)
    assert isinstance(worker, EagleWorker)
    record_head_calls(worker, events, calls)
    run = run_worker(
        worker,
        PROMPTS,
        max_new_tokens=NUM_NEW,
        vocab_size=VOCAB,
        page_size=page_size,
        chunk_size=chunk_size,
        events=events,
    )
    truth = {run.slots[f"r{i}"]: p + run.outputs[f"r{i}"] for i, p in enumerate(PROMPTS)}
    target = ckpt.target1 if twin else ckpt.target
    features = {slot: true_features(target, seq) for slot, seq in truth.items()}
    num_checked = 0
    for call in calls:
        for row, slot, pos in checked_tokens(call, truth):
            expected = features[slot][pos - 1] if pos else torch.zeros(32)
            torch.testing.assert_close(call.features[row], expected, atol=1e-4, rtol=0)
            num_checked += 1
    assert num_checked > sum(len(seq) for seq in truth.values())


def test_ngram_history_drafts_the_continuation_of_the_latest_match() -> None:
    """The trailing n-gram's latest earlier occurrence is continued (periodically); else repeat."""
    history = TokenHistory(4, 12, device=torch.device("cpu"))
    rows = {1: [1, 2, 3, 4, 1, 2, 3], 2: [9, 8, 9, 8, 9], 3: [5, 6, 7]}
    for slot, tokens in rows.items():
        n = len(tokens)
        history.write(torch.full((n,), slot), torch.arange(n), torch.tensor(tokens))
    slots, start = torch.tensor([1, 2, 3]), torch.tensor([6, 4, 2])
    drafts = history.propose(slots, start, num_tokens=5, max_ngram=3)
    assert drafts.tolist() == [[4, 1, 2, 3, 4], [8, 9, 8, 9, 8], [7, 7, 7, 7, 7]]
    two = history.propose(torch.tensor([1]), torch.tensor([4]), num_tokens=2, max_ngram=1)
    assert two.tolist() == [[2, 3]]  # "1" last seen at 0: continue with 2, 3


def test_registry_builds_every_algorithm_with_its_capabilities(ckpt: Checkpoints) -> None:
    """default_registry holds every algorithm; each of those built here satisfies
    WorkerProtocol (the hidden-state and block drafters have their own tests)."""
    assert default_registry().names() == (
        "dflash",
        "draft_model",
        "dspark",
        "eagle",
        "eagle3",
        "frozen_kv_mtp",
        "mtp",
        "ngram",
        "none",
        "uno",
    )
    for algorithm in ALGORITHMS:
        worker = build(algorithm, ckpt)
        assert isinstance(worker, WorkerProtocol)
        caps = worker.capabilities
        assert caps.algorithm == algorithm
        speculative = algorithm != "none"
        assert caps.num_steps == (NUM_STEPS if speculative else 0)
        assert caps.num_draft_tokens == caps.num_steps + 1
        assert caps.keeps_draft_kv == (algorithm in ("draft_model", "eagle"))


def test_draft_vocab_mismatch_names_both_checkpoints(ckpt: Checkpoints, tmp_path: Path) -> None:
    """A drafter with another vocabulary is refused at construction, naming files and sizes."""
    make_hf(tmp_path / "big", seed=4, vocab_size=VOCAB + 4)
    with pytest.raises(
        InvalidConfig,
        match=r"draft .*big/config.json has vocab_size 100 but "
        r"target .*target/config.json has vocab_size 96",
    ):
        DraftModelWorker(target=ckpt.target, draft=tmp_path / "big")


def test_non_llama_checkpoint_gets_the_loaders_error(ckpt: Checkpoints, tmp_path: Path) -> None:
    """A checkpoint that is not a Llama raises the loader's InvalidConfig."""
    raw = json.loads((ckpt.target / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps(raw | {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(InvalidConfig, match=r"config.json: field 'model_type' is 'gpt2'"):
        DraftModelWorker(target=ckpt.target, draft=tmp_path)
    with pytest.raises(InvalidConfig, match=r"field 'model_type' is 'gpt2'"):
        PlainWorker(target=tmp_path)


def test_eagle_head_of_another_width_is_refused(ckpt: Checkpoints) -> None:
    """A head whose hidden size differs from the target's names both files."""
    with pytest.raises(InvalidConfig, match=r"eagle1/config.json has hidden_size 32 but target"):
        EagleWorker(target=ckpt.draft, eagle=ckpt.eagle1)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda c: DraftModelWorker(target=c.target, draft=c.draft, num_steps=0), "num_steps >= 1"),
        (lambda c: NgramWorker(target=c.target, max_ngram=0), "max_ngram >= 1"),
        (lambda c: EagleWorker(target=c.target, eagle=c.eagle, num_steps=0), "num_steps >= 1"),
    ],
)
def test_bad_options_are_refused(
    ckpt: Checkpoints, factory: Callable[[Checkpoints], object], match: str
) -> None:
    """Zero steps or a zero n-gram length raise InvalidConfig."""
    with pytest.raises(InvalidConfig, match=match):
        factory(ckpt)


def decode_batch(temperature: float, mode: ForwardMode = ForwardMode.DECODE) -> ForwardBatch:
    """A one-row DECODE (or ``mode``) batch with the given temperature."""
    params = [SamplingParams(temperature=temperature)]
    return ForwardBatch(
        forward_mode=mode,
        request_ids=("r0",),
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([3]),
        seq_lens_cpu=(3,),
        input_ids=torch.tensor([5]),
        positions=torch.tensor([3]),
        out_cache_loc=None,
        prefix_lens=None,
        extend_lens=None,
        sampling_info=SamplingInfo.from_params(
            params, vocab_size=VOCAB, device=torch.device("cpu")
        ),
        spec_info=None,
    )


def test_worker_internal_modes_are_refused(ckpt: Checkpoints) -> None:
    """A worker-internal mode raises InvalidConfig; nothing runs."""
    worker = build("draft_model", ckpt)
    with pytest.raises(InvalidConfig, match=r"target_verify is worker-internal"):
        worker.forward_batch_generation(decode_batch(0.0, ForwardMode.TARGET_VERIFY))


def test_idle_forward_publishes_empty_lengths(ckpt: Checkpoints) -> None:
    """IDLE publishes an empty frontier and returns an empty result."""
    worker = build("ngram", ckpt)
    idle = attrs.evolve(
        decode_batch(0.0, ForwardMode.IDLE),
        request_ids=(),
        req_pool_indices=torch.zeros(0, dtype=torch.int64),
        seq_lens=torch.zeros(0, dtype=torch.int64),
        sampling_info=SamplingInfo.from_params([], vocab_size=VOCAB, device=torch.device("cpu")),
    )
    published: list[list[int]] = []
    result = worker.forward_batch_generation(
        idle, on_publish=lambda t: published.append(t.tolist())
    )
    assert published == [[]]
    assert result.batch_size == 0 and result.next_token_ids.numel() == 0
