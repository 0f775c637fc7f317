"""Grammar requests through the engine: refusals at submit, dead ends, contract breaks, aborts,
the masks built one forward ahead, and the trace.

Every engine here runs with the invariant checker after every step (`run_checked`), which
includes the grammar table's ``grammar-records``, ``grammar-committed`` and ``grammar-position``.
"""

from __future__ import annotations

import attrs
import pytest
from engine_driver import run_checked
from grammar_oracle import EOS, GRAMMARS, VOCAB, ascii_vocabulary, matches
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints
from spy_worker import SpyWorker

from specstate import FinishReason, InvalidRequest, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvariantViolation
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import OnPublish, WorkerProtocol
from specstate.grammar.spec import Grammar
from specstate.reference.workers import default_registry

PROMPT = list(MIXED_PROMPTS[0])


def limits(*, vocabulary: bool = True) -> RequestLimits:
    """The tiny checkpoints' limits, with (or without) their text vocabulary."""
    return RequestLimits(
        vocab_size=VOCAB,
        max_context_len=64,
        eos_token_ids={EOS},
        grammar_vocabulary=ascii_vocabulary() if vocabulary else None,
    )


def engine(worker: WorkerProtocol, **options: object) -> Engine:
    """An engine with every check on."""
    config = EngineConfig(
        kv_tokens=2048,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **options,  # type: ignore[arg-type]
    )
    return Engine(worker, limits=limits(), config=config)


def grammar(kind: str) -> Grammar:
    """One of the oracle's grammars."""
    return GRAMMARS[kind][0]


# --------------------------------------------------------------------------- submit
def test_a_grammar_that_does_not_compile_is_refused_at_submit(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """`InvalidRequest` names the request, the grammar and the library's error; nothing changes."""
    with engine(partial_ckpt.worker("ngram")) as eng:
        with pytest.raises(InvalidRequest, match=r"request 'bad': grammar regex '\[a-' does not"):
            eng.submit(
                "bad", PROMPT, SamplingParams(max_new_tokens=20, grammar=Grammar.regex("[a-"))
            )
        with pytest.raises(InvalidRequest, match="unclosed character class"):
            eng.submit(
                "bad", PROMPT, SamplingParams(max_new_tokens=20, grammar=Grammar.regex("[a-"))
            )
        with pytest.raises(InvalidRequest, match="Rule 'x' not found"):
            eng.submit(
                "bad2",
                PROMPT,
                SamplingParams(max_new_tokens=20, grammar=Grammar.ebnf("root ::= x")),
            )
        assert eng.is_idle and eng.grammar.snapshot().num_requests == 0
        eng.submit("ok", PROMPT, SamplingParams(max_new_tokens=40, grammar=grammar("regex")))
        run_checked(eng)
        assert matches("regex", eng.request("ok").emitted_ids)


def test_a_draft_tree_refuses_grammar_requests(partial_ckpt: SpecCheckpoints) -> None:
    """Trees do not mask per node: a grammar request for a tree worker is refused at submit."""
    worker = default_registry().create(
        "draft_model", target=partial_ckpt.target, draft=partial_ckpt.draft, num_steps=2, topk=2
    )
    assert not worker.capabilities.supports_grammar
    with (
        engine(worker) as eng,
        pytest.raises(
            InvalidRequest, match=r"does not support grammar \(a draft tree, topk 2: use a chain"
        ),
    ):
        eng.submit("t", PROMPT, SamplingParams(max_new_tokens=20, grammar=grammar("regex")))


def test_grammar_requests_need_a_vocabulary(partial_ckpt: SpecCheckpoints) -> None:
    """Without `RequestLimits.grammar_vocabulary` a grammar cannot be compiled: refused."""
    eng = Engine(
        partial_ckpt.worker("none"), limits=limits(vocabulary=False), config=EngineConfig()
    )
    with eng, pytest.raises(InvalidRequest, match="a grammar needs the tokenizer's vocabulary"):
        eng.submit("v", PROMPT, SamplingParams(max_new_tokens=20, grammar=grammar("regex")))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ignore_eos": True}, "ignore_eos must be False"),
        ({"min_new_tokens": 2}, "min_new_tokens must be 0"),
        ({"grammar": {"yaml": "x"}}, "unknown grammar kind 'yaml'"),
        ({"grammar": {"regex": 3}}, "grammar 'regex' must be a string"),
        ({"grammar": Grammar("regex", "")}, "grammar regex source must be a non-empty string"),
        ({"grammar": Grammar.json_schema("[1]")}, "json_schema must be a JSON object"),
    ],
)
def test_bad_grammar_parameters_are_refused(
    partial_ckpt: SpecCheckpoints, options: dict[str, object], message: str
) -> None:
    """Combinations a grammar cannot serve, and malformed grammars, are refused by name."""
    values: dict[str, object] = {"max_new_tokens": 20, "grammar": grammar("regex"), **options}
    with engine(partial_ckpt.worker("none")) as eng, pytest.raises(InvalidRequest, match=message):
        eng.submit("p", PROMPT, SamplingParams(**values))  # type: ignore[arg-type]


def test_the_request_file_form_is_a_grammar() -> None:
    """``{"json_schema": {...}}`` and the other one-key forms read into a `Grammar` and back."""
    params = SamplingParams(
        grammar={"json_schema": GRAMMARS["json_schema"][0].to_json()["json_schema"]}
    )
    assert params.grammar == grammar("json_schema")
    for kind in ("regex", "ebnf", "lark"):
        assert Grammar.from_json(grammar(kind).to_json()) == grammar(kind)


# ------------------------------------------------------------------------ dead ends
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["none", "draft_model"])
def test_a_dead_end_ends_its_request_with_a_grammar_error(
    partial_ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """A grammar the vocabulary cannot finish ("abé": é is not ASCII) ends its request with
    ERROR naming the dead end, after the tokens it could emit; its neighbour and the engine
    go on."""
    with engine(partial_ckpt.worker(algorithm, agreeing=False), overlap=overlap) as eng:
        dead = eng.submit(
            "dead", PROMPT, SamplingParams(max_new_tokens=20, grammar=Grammar.regex("abé"))
        )
        fine = eng.submit(
            "fine", PROMPT, SamplingParams(max_new_tokens=40, grammar=grammar("ebnf"))
        )
        run_checked(eng)
        snap = eng.grammar.snapshot()
    assert dead.finish is not None and dead.finish.reason is FinishReason.ERROR
    assert "GrammarError" in dead.finish.detail and "dead end" in dead.finish.detail
    # "ab", then only é could follow; like a row with non-finite logits, the round that
    # reaches the dead end is dropped whole, so a drafter may end it a few tokens earlier.
    assert dead.emitted_ids == (65, 66)[: len(dead.emitted_ids)]
    if algorithm == "none":
        assert dead.emitted_ids == (65, 66)
    assert matches("ebnf", fine.emitted_ids)
    assert snap.num_dead_ends == 1 and snap.num_violations == 0


class IgnoresGrammar(SpyWorker):
    """A worker that hands the real worker its batch without the grammar view (it still
    declares grammar support: the inner worker's capabilities)."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The inner forward, blind to the grammar."""
        blind = attrs.evolve(batch, grammar=None)
        return super().forward_batch_generation(blind, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_worker_that_ignores_the_grammar_ends_those_requests(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """Rows whose forward never used ``ForwardBatch.grammar`` end with `GrammarError` instead of
    emitting unconstrained tokens; requests without a grammar are served."""
    with engine(IgnoresGrammar(partial_ckpt.worker("ngram")), overlap=overlap) as eng:
        blind = eng.submit("g", PROMPT, SamplingParams(max_new_tokens=10, grammar=grammar("regex")))
        free = eng.submit("f", PROMPT, SamplingParams(max_new_tokens=10))
        run_checked(eng)
    assert blind.finish is not None and blind.finish.reason is FinishReason.ERROR
    assert "did not use its grammar" in blind.finish.detail
    assert blind.emitted_ids == ()
    assert free.finish is not None and free.finish.reason is FinishReason.LENGTH


# ---------------------------------------------------------------------- life cycle
@pytest.mark.parametrize("overlap", [False, True])
def test_an_abort_in_the_middle_of_a_grammar_forgets_its_state(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """An aborted grammar request leaves the table at the step it ends; the others finish."""
    with engine(partial_ckpt.worker("eagle", agreeing=False), overlap=overlap) as eng:
        first = eng.submit(
            "a", PROMPT, SamplingParams(max_new_tokens=40, grammar=grammar("json_schema"))
        )
        other = eng.submit(
            "b", PROMPT, SamplingParams(max_new_tokens=40, grammar=grammar("json_schema"))
        )
        for _ in range(3):
            eng.step()
            check_engine(eng)
        assert not first.is_finished and not other.is_finished
        eng.abort("a")
        eng.step()
        check_engine(eng)
        assert [rid for rid, _ in eng.grammar.snapshot().committed] == ["b"]
        run_checked(eng)
    assert first.finish is not None and first.finish.reason is FinishReason.ABORT
    assert matches("json_schema", other.emitted_ids)


def test_the_checker_sees_a_committed_position_out_of_step(partial_ckpt: SpecCheckpoints) -> None:
    """``grammar-committed``: a committed position that is not the settled outputs is caught."""
    with engine(partial_ckpt.worker("none"), overlap=False) as eng:
        req = eng.submit("c", PROMPT, SamplingParams(max_new_tokens=40, grammar=grammar("regex")))
        for _ in range(3):
            eng.step()
        state = eng.grammar.state(req)
        assert state is not None
        state.num_committed += 1
        with pytest.raises(InvariantViolation, match=r"\[grammar-committed\] request c"):
            check_engine(eng)
        state.num_committed -= 1
        state.push(state.tokens[-1] if state.tokens else 65)
        with pytest.raises(InvariantViolation, match=r"\[grammar-position\] request c"):
            check_engine(eng)


# -------------------------------------------------------------- masks one forward ahead
@pytest.mark.parametrize("algorithm", ["none", "ngram", "draft_model"])
def test_each_round_starts_from_masks_built_in_the_forward_before(
    partial_ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """Under overlap, the mask of every round's first position was built by the previous
    forward, right after that forward's accepted run (for ``none``, all of a round's masks)."""
    with engine(partial_ckpt.worker(algorithm, agreeing=False), overlap=True) as eng:
        reqs = [
            eng.submit(f"m{i}", list(p), SamplingParams(max_new_tokens=40, grammar=grammar(kind)))
            for i, (p, kind) in enumerate(zip(MIXED_PROMPTS, GRAMMARS, strict=False))
        ]
        run_checked(eng)
        snap = eng.grammar.snapshot()
    verifies = sum(len(r.accept_lengths) for r in reqs)
    assert snap.num_prefetched_masks >= verifies > 0


def test_the_trace_shows_grammar_work_inside_each_forward(partial_ckpt: SpecCheckpoints) -> None:
    """``grammar-*`` spans sit on the forward track inside their batch's forward: the masks
    (``grammar-mask``), the accepted run (``grammar-advance``) and the next round's first masks
    (``grammar-next-mask``), while the host's spans stay on the host track."""
    recorder = TraceRecorder()
    config = EngineConfig(kv_tokens=2048, overlap=True, check_invariants=True, check_ownership=True)
    worker = partial_ckpt.worker("draft_model", agreeing=False)
    with Engine(worker, limits=limits(), config=config, trace=recorder) as eng:
        for i, kind in enumerate(("regex", "json_schema")):
            eng.submit(f"t{i}", PROMPT, SamplingParams(max_new_tokens=40, grammar=grammar(kind)))
        run_checked(eng)
    spans = recorder.spans
    forwards = {s.batch: s for s in spans if s.track == "forward" and s.name == "forward"}
    grammar_spans = [s for s in spans if s.name.startswith("grammar-") and s.track == "forward"]
    assert {s.name for s in grammar_spans} == {
        "grammar-mask",
        "grammar-advance",
        "grammar-next-mask",
    }
    for span in grammar_spans:
        outer = forwards[span.batch]
        assert outer.ts_us - 1e-3 <= span.ts_us
        assert span.ts_us + span.dur_us <= outer.ts_us + outer.dur_us + 1e-3
    assert any(s.track == "host" and s.name == "grammar-settle" for s in spans)
