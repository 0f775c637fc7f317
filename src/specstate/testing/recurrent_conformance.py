"""The conformance kit's check of a hybrid worker's recurrent state: does it commit the state of
the accepted run, whatever happens to the rows around it?

`check_recurrent_state` runs only for a worker that declares `WorkerCapabilities.recurrent`
(``check_worker`` calls it). Each scenario serves the workload through the real `Engine` with
every check on — the recurrent-state invariants (``recurrent-slots``, ``recurrent-commit``,
``recurrent-settlement``) included — and compares the greedy tokens with the oracle (if given)
and with a plain run of the same workload:

=========================  ==================================================================
``zero-draft rounds``      a scripted draft width ``K, 0, K, 1, 0, ...`` (workers that declare
                           ``supports_adaptive_steps``): rounds that draft nothing right after
                           rounds that accepted drafts must read the state those left
``staggered rows``         requests of different lengths, one submitted late: rows leave and
                           join the running batch (filter, merge) between rounds, so a state
                           read by batch row instead of slot shows
``retraction``             a pool too small for the workload: retracted requests discard their
                           state and rebuild it by re-prefill
=========================  ==================================================================

A finding's rule is ``recurrent`` when a recurrent-state invariant failed, ``tokens`` when the
tokens differ, and as in ``check_worker`` otherwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvariantViolation
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol

__all__ = ["ScriptedDraftWidths", "check_recurrent_state"]

Oracle = Callable[[Sequence[int], int], Sequence[int]]
Tokens = tuple[tuple[int, ...], ...]


@attrs.define
class ScriptedDraftWidths:
    """A draft policy that cycles through fixed widths (zero-draft rounds on schedule)."""

    widths: tuple[int, ...]
    _cycle: Iterator[int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._cycle = itertools.cycle(self.widths)

    @property
    def max_steps(self) -> int:
        """The widest scripted round."""
        return max(self.widths)

    def choose(self, batch_size: int) -> int:
        """The next width of the script."""
        del batch_size
        return next(self._cycle)

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Ignored: the widths are scripted."""
        del num_steps, accept_lens


@attrs.frozen(kw_only=True)
class _Scenario:
    name: str
    config: EngineConfig
    max_new: tuple[int, ...]
    late: int | None = None  # the index of a prompt submitted after the first steps
    widths: tuple[int, ...] | None = None


def _scenarios(num_steps: int, adaptive: bool, n: int, max_new: int) -> list[_Scenario]:
    checked = EngineConfig(check_invariants=True, check_ownership=True, debug_relay=True)
    found = [
        _Scenario(
            name=f"staggered rows, {'overlap' if overlap else 'normal'} loop",
            config=attrs.evolve(checked, overlap=overlap, kv_tokens=4096),
            max_new=tuple(max(1, max_new - 3 * i) for i in range(n)),
            late=n - 1,
        )
        for overlap in (False, True)
    ]
    found.append(
        _Scenario(
            name="retraction, overlap loop",
            config=attrs.evolve(checked, overlap=True, kv_tokens=96 + 16 * num_steps),
            max_new=(max_new,) * n,
        )
    )
    if adaptive and num_steps:
        widths = (num_steps, 0, num_steps, 1, 0)
        found += [
            _Scenario(
                name=f"zero-draft rounds {widths}, {'overlap' if overlap else 'normal'} loop",
                config=attrs.evolve(checked, overlap=overlap, kv_tokens=4096),
                max_new=(max_new,) * n,
                widths=widths,
            )
            for overlap in (False, True)
        ]
    return found


def _serve(
    factory: Callable[[], WorkerProtocol],
    scenario: _Scenario,
    vocab_size: int,
    prompts: Sequence[Sequence[int]],
) -> Tokens:
    """Serve the scenario; the emitted tokens of each request (raises what the engine raises)."""
    policy = None if scenario.widths is None else ScriptedDraftWidths(scenario.widths)
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=256)
    with Engine(factory(), limits=limits, config=scenario.config, draft_policy=policy) as engine:
        reqs = []
        for i, prompt in enumerate(prompts):
            if i == scenario.late:
                for _ in range(3):
                    engine.step()
            params = SamplingParams(max_new_tokens=scenario.max_new[i])
            reqs.append(engine.submit(f"h{i}", prompt, params))
        engine.run_until_idle(max_steps=5000)
    for req in reqs:
        finish = req.finish
        if finish is None or finish.reason not in (FinishReason.LENGTH, FinishReason.STOP):
            detail = "never ended" if finish is None else f"{finish.reason}: {finish.detail}"
            raise RuntimeError(f"request {req.request_id} {detail}")
    return tuple(tuple(r.emitted_ids) for r in reqs)


def check_recurrent_state(
    factory: Callable[[], WorkerProtocol],
    *,
    vocab_size: int,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    oracle: Oracle | None = None,
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """The findings ``(rule, scenario, detail)`` and the scenarios run (none without state)."""
    caps = factory().capabilities
    if caps.recurrent is None:
        return [], []
    scenarios = _scenarios(
        caps.num_steps, caps.supports_adaptive_steps, len(prompts), max_new_tokens
    )
    findings: list[tuple[str, str, str]] = []
    longest: dict[int, tuple[int, ...]] = {}  # without an oracle: scenarios must agree
    for scenario in scenarios:
        try:
            got = _serve(factory, scenario, vocab_size, prompts)
        except InvariantViolation as exc:
            rule = "recurrent" if exc.invariant.startswith("recurrent") else "error"
            findings.append((rule, scenario.name, str(exc)))
            continue
        except Exception as exc:  # NOTE: a finding, not a crash of the kit
            findings.append(("error", scenario.name, f"{type(exc).__name__}: {exc}"))
            continue
        for i, tokens in enumerate(got):
            if oracle is not None:
                want = tuple(oracle(prompts[i], max_new_tokens))
            else:
                want = longest.setdefault(i, tokens)
                longest[i] = max(want, tokens, key=len)
            short = min(len(tokens), len(want))
            if tokens[:short] != want[:short]:
                findings.append(
                    ("tokens", scenario.name, f"prompt {i}: {list(tokens)} but {list(want)}")
                )
    return findings, [s.name for s in scenarios]
