"""The conformance kit's ``draft_state`` rule: the draft state depends on the committed tokens only.

Drafts never change what a greedy request emits (verification is lossless), so a drafter whose
state crosses the round wrong — a hidden state taken from the wrong position after a partial
acceptance, a relay row that belongs to another request, a state left over from a round of
another width — emits the right tokens and only accepts less. The kit sees two things of it, and
for a worker that shares prefixes (`WorkerCapabilities.prefix_sharing`: its per-position state
depends on the tokens alone) both are functions of a greedy request's frontier ``F``:

* the relayed hidden state (``next_draft_input.hidden_states``) of the row at frontier ``F``,
  whichever forward relayed it (a prefill chunk, a mixed one-token extend, a decode round after
  a full or a partial acceptance): equal within float tolerance;
* the accept length of a decode round at ``S`` of width ``w``::

      accept(S, w) = min(accept(S, K), w + 1)        K: the worker's num_steps

The kit's configurations reach the same frontiers in different ways (chunk boundaries, mixed
chunks, the adaptive widths), so a state that depends on *how* a frontier was reached breaks an
equality somewhere. `RoundRecorder` keeps what greedy rows relayed and accepted (the watched
worker records it; tensors are read once the configuration is done); `draft_state_problems`
compares every configuration's records with every other's.

Invariant: the recorder never reads a device tensor during a forward, and holds only tensors
the worker returned (which nobody writes again) and the batch's frozen fields.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult

__all__ = ["DecodeRound", "RelayedState", "RoundRecorder", "draft_state_problems"]


@attrs.frozen(kw_only=True)
class DecodeRound:
    """One greedy, speculating row of one decode round."""

    request_id: str
    start: int
    width: int
    accept: int


@attrs.frozen(kw_only=True)
class RelayedState:
    """What one greedy row relayed at its frontier (``hidden`` on the host)."""

    request_id: str
    frontier: int
    hidden: torch.Tensor


@attrs.frozen
class _PendingRelay:
    request_ids: tuple[str, ...]
    frontier: torch.Tensor
    hidden: torch.Tensor
    keep: torch.Tensor


@attrs.frozen
class _Pending:
    request_ids: tuple[str, ...]
    seq_lens: torch.Tensor
    width: int
    accept_lens: torch.Tensor
    keep: torch.Tensor


class RoundRecorder:
    """Keeps the decode rounds of greedy rows that speculate (module docstring).

    Args:
        num_steps: the worker's full width ``K`` (a round without ``num_draft_steps`` has it).
    """

    def __init__(self, num_steps: int) -> None:
        self._num_steps = num_steps
        self._pending: list[_Pending] = []
        self._relays: list[_PendingRelay] = []

    def record(self, batch: ForwardBatch, result: GenerationBatchResult) -> None:
        """Keep ``batch``'s greedy rows: relayed states, and accept lengths of a DECODE
        forward (no host read here)."""
        if batch.forward_mode is ForwardMode.IDLE or not batch.batch_size:
            return
        sampling = batch.sampling_info
        greedy = sampling.temperatures == 0
        relay = result.next_draft_input
        frontier = result.new_seq_lens
        if relay is not None and relay.hidden_states is not None and frontier is not None:
            self._relays.append(
                _PendingRelay(tuple(batch.request_ids), frontier, relay.hidden_states, greedy)
            )
        if batch.forward_mode is not ForwardMode.DECODE:
            return
        keep = greedy
        if sampling.speculative is not None:
            keep = keep & sampling.speculative.to(keep.device)
        width = batch.draft_steps(self._num_steps)
        self._pending.append(
            _Pending(tuple(batch.request_ids), batch.seq_lens, width, result.accept_lens, keep)
        )

    def relays(self) -> list[RelayedState]:
        """Every recorded relay row (reads the kept tensors: call once the forwards are done)."""
        out = []
        for p in self._relays:
            hidden = p.hidden.detach().float().cpu()
            rows = zip(p.request_ids, p.frontier.tolist(), p.keep.tolist(), hidden, strict=True)
            out += [
                RelayedState(request_id=rid, frontier=int(f), hidden=h)
                for rid, f, keep, h in rows
                if keep
            ]
        return out

    def rounds(self) -> list[DecodeRound]:
        """Every recorded row (reads the kept tensors: call once the forwards are done)."""
        out = []
        for p in self._pending:
            rows = zip(
                p.request_ids, p.seq_lens.tolist(), p.accept_lens.tolist(), p.keep.tolist(),
                strict=True,
            )  # fmt: skip
            out += [
                DecodeRound(request_id=rid, start=int(s), width=p.width, accept=int(a))
                for rid, s, a, keep in rows
                if keep
            ]
        return out


def draft_state_problems(
    runs: Mapping[str, Sequence[DecodeRound]],
    num_steps: int,
    relays: Mapping[str, Sequence[RelayedState]] | None = None,
) -> list[tuple[str, str, str]]:
    """``(configuration, detail, request id)`` of every relayed state or round that disagrees
    with another configuration's (or another forward's) at the same request and frontier
    (module docstring)."""
    return _relay_problems(relays or {}) + _accept_problems(runs, num_steps)


def _relay_problems(relays: Mapping[str, Sequence[RelayedState]]) -> list[tuple[str, str, str]]:
    first: dict[tuple[str, int], tuple[torch.Tensor, str]] = {}
    problems = []
    for name, states in relays.items():
        for state in states:
            key = (state.request_id, state.frontier)
            known = first.setdefault(key, (state.hidden, name))
            same = known[0].shape == state.hidden.shape and torch.allclose(
                known[0], state.hidden, rtol=1e-3, atol=1e-3
            )
            if not same:
                diff = (
                    float((known[0] - state.hidden).abs().max())
                    if known[0].shape == (state.hidden.shape)
                    else float("nan")
                )
                problems.append(
                    (
                        name,
                        f"{state.request_id}: the hidden state relayed at frontier "
                        f"{state.frontier} differs by {diff:.3g} from the one relayed at the same "
                        f"frontier in {known[1]!r}; it must depend only on the committed tokens "
                        "(a hidden state taken from the wrong position after a partial "
                        "acceptance?)",
                        state.request_id,
                    )
                )
    return problems


def _accept_problems(
    runs: Mapping[str, Sequence[DecodeRound]], num_steps: int
) -> list[tuple[str, str, str]]:
    full: dict[tuple[str, int], tuple[int, str]] = {}
    for name, rounds in runs.items():
        for r in rounds:
            if r.width == num_steps:
                full.setdefault((r.request_id, r.start), (r.accept, name))
    problems = []
    for name, rounds in runs.items():
        for r in rounds:
            known = full.get((r.request_id, r.start))
            if known is None:
                continue
            accept, where = known
            want = min(accept, r.width + 1)
            if r.accept != want:
                problems.append(
                    (
                        name,
                        f"{r.request_id}: the round at frontier {r.start} (width {r.width}) "
                        f"accepted {r.accept}, but {want} follows from the round at the same "
                        f"frontier in {where!r} (width {num_steps}, accepted {accept}); a "
                        "round's drafts must depend only on the committed tokens (a draft state "
                        "taken from the wrong position?)",
                        r.request_id,
                    )
                )
    return problems
