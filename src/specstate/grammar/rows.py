"""The worker's grammar view of one forward: packed bitmasks built from exactly its own drafts.

`GrammarRows` is ``ForwardBatch.grammar``: one per launched batch that holds a request with a
grammar (None otherwise), single use, built by the grammar table at launch and used by the
worker *inside* its forward, on the forward stream. Every mask it returns is a `RowMasks`:
packed int32 bitmasks (bit ``t % 32`` of word ``t // 32`` allows token ``t``) for some rows of
the batch, applied to logits with `RowMasks.apply` (`apply_token_bitmask`). Per forward::

    EXTEND / MIXED   masks = sample_masks()       the token sampled after each row's last input
                     sample with masks applied ─▶ accept_sampled(tokens)
    DECODE           for each draft step k:  masks = draft_masks() ─▶ draft ─▶ push_drafts(d_k)
                     (a drafter that does not sample, like n-gram, skips this loop)
                     masks = verify_masks(drafts)  [R, K+1, words]: position j after d1 .. dj
                     verify with masks applied ─▶ on_publish ─▶ accept(run_tokens, accept_lens)

Why inside the forward: round N+1's masks depend on round N's accepted run and on round N+1's
own drafts, and under overlap the host schedules round N+1 before it has settled round N. The
matcher is relay state: forward N leaves it at its accepted run (stream order is the fence, as
for the FutureMap) and forward N+1 continues from there. `accept` also builds the mask of the
next round's first position, so that much of round N+1's grammar work runs in forward N
(all of it for a worker without drafts).

* Drafts are grammatical: a draft step's logits are masked, and a draft a drafter proposed
  without masks (n-gram) is checked against the mask of its position; the chain is pruned at
  the first draft the grammar refuses (its later positions get no mask: they are never
  emitted, the target's masked token differs from a refused draft).
* The masks of the verify are built from exactly the drafts the verify scores: `verify_masks`
  refuses drafts that differ from the ones pushed while drafting, and a row whose request was
  retracted since scheduling (a new incarnation) takes no part.
* After the verify, rejected drafts are rolled back with the matcher's rollback; the run is kept
  up to the first end token (the grammar ended: the finish cuts the output there, and the ended
  matcher is never asked for a mask again); a run token the mask did not allow, or a position no
  token can follow (a dead end), ends the request with `GrammarError` at settlement.

Invariant: after `accept` (or `accept_sampled`), every active row's matcher holds exactly the
tokens the forward settled for it (up to an end token), and `outcome` reports them.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, Protocol

import attrs
import numpy as np
import torch

from specstate.core.errors import GrammarError
from specstate.grammar.state import GrammarState, MaskArray

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarRows", "GrammarStats", "RowMasks", "RowOutcome", "apply_token_bitmask"]


class _Incarnated(Protocol):
    """A request, as the view sees it: its incarnation changes when it is retracted."""

    @property
    def incarnation(self) -> int:
        """The request's current incarnation."""
        ...


_ALL: Final = -1  # a mask word with every bit set: no constraint
_BITS: Final = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[..., V]`` with -inf wherever ``bitmask`` ``[..., words]`` clears the bit
    (a new tensor; the leading shapes must agree)."""
    packed = bitmask.to(device=logits.device, dtype=torch.int32)  # unpack where the logits are
    allowed = ((packed.unsqueeze(-1) >> _BITS.to(logits.device)) & 1).flatten(-2)
    vocab = logits.shape[-1]
    return logits.masked_fill(allowed[..., :vocab] == 0, float("-inf"))


@attrs.frozen
class RowMasks:
    """Packed grammar bitmasks for some rows of a batch.

    Attributes:
        rows: ``[R]`` int64 batch rows that have a mask (other rows are unconstrained).
        bitmask: ``[R, ..., words]`` int32, one packed mask per position of each row.
    """

    rows: torch.Tensor
    bitmask: torch.Tensor

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, ..., V]`` masked at ``rows`` (a new tensor; other rows as they are)."""
        rows = self.rows.to(logits.device)
        masked = apply_token_bitmask(logits.index_select(0, rows), self.bitmask)
        return logits.index_copy(0, rows, masked)


@attrs.frozen
class RowOutcome:
    """What one forward did to one row's grammar (read by the host at settlement).

    Attributes:
        row: the batch row.
        tokens: the tokens the grammar kept for the row in this forward (the run up to an end
            token), which settlement checks against the settled run.
        failure: why the request must end (a dead end, or a run token the mask did not
            allow), or None.
        dead_end: the failure is a dead end (no token could follow), not a broken contract.
    """

    row: int
    tokens: tuple[int, ...]
    failure: str | None
    dead_end: bool = False


@attrs.frozen
class GrammarStats:
    """Counters of one forward's grammar work."""

    masks: int = 0
    prefetched: int = 0
    rollbacks: int = 0
    rolled_back_tokens: int = 0
    pruned_drafts: int = 0
    rebuilds: int = 0


class GrammarRows:
    """The worker's grammar view of one forward; see the module docstring.

    Built by the engine's `GrammarTable` at launch. Rows are the batch's rows whose
    request has a grammar and samples a token in this forward (a prefill chunk that is not the
    last samples nothing the engine keeps).

    Args:
        batch_rows: ``[R]`` batch row of each grammar row.
        states: the request's `GrammarState` of each grammar row.
        resume: per grammar row, the committed position to roll back to first (a prefill's last
            chunk: the request may have been retracted with a round in flight), or None.
        owners: per grammar row, its request (anything with an ``incarnation``).
        incarnations: per grammar row, the request's incarnation when the batch was scheduled
            (a row whose request moved on since takes no part).
        executor: llguidance's parallel mask executor, or None: one matcher at a time.
        mask_words: ``ceil(vocab_size / 32)``.
        traced: record the clock marks of each grammar step (`spans`).
    """

    def __init__(
        self,
        *,
        batch_rows: Sequence[int],
        states: Sequence[GrammarState],
        resume: Sequence[int | None],
        owners: Sequence[_Incarnated],
        incarnations: Sequence[int],
        executor: llguidance.LLExecutor | None,
        mask_words: int,
        traced: bool = False,
    ) -> None:
        self._rows = tuple(batch_rows)
        self._states = tuple(states)
        self._resume = tuple(resume)
        self._owners = owners
        self._incarnations = incarnations
        self._executor = executor
        self._words = mask_words
        self._traced = traced
        self.spans: list[tuple[str, int, int]] = []  # (name, start ns, end ns), when traced
        self._phase = "new"
        self._await_push = False
        n = len(self._rows)
        self._active = np.zeros(n, dtype=np.bool_)
        self._open = np.zeros(n, dtype=np.bool_)
        self._pushed: list[list[int]] = [[] for _ in range(n)]
        self._dead_step: list[int | None] = [None] * n
        self._steps: list[MaskArray] = []
        self._kept: list[tuple[int, ...]] = [() for _ in range(n)]
        self._failure: list[str | None] = [None] * n
        self._dead_end = [False] * n  # the failure is a dead end (else a broken contract)
        self._masks = self._prefetched = self._rollbacks = self._rolled_back = self._pruned = 0
        self._rebuilds = 0

    # ------------------------------------------------------------------ reads
    @property
    def num_rows(self) -> int:
        """Grammar rows in this forward."""
        return len(self._rows)

    @property
    def batch_rows(self) -> tuple[int, ...]:
        """The batch row of each grammar row."""
        return self._rows

    def outcome(self) -> tuple[RowOutcome, ...]:
        """What the forward did to every grammar row that took part (host, after the forward)."""
        return tuple(
            RowOutcome(
                row=self._rows[r],
                tokens=self._kept[r],
                failure=self._failure[r],
                dead_end=self._dead_end[r],
            )
            for r in range(len(self._rows))
            if self._active[r]
        )

    def stats(self) -> GrammarStats:
        """This forward's grammar counters."""
        return GrammarStats(
            masks=self._masks,
            prefetched=self._prefetched,
            rollbacks=self._rollbacks,
            rolled_back_tokens=self._rolled_back,
            pruned_drafts=self._pruned,
            rebuilds=self._rebuilds,
        )

    # ---------------------------------------------------------- extend rows
    def sample_masks(self) -> RowMasks | None:
        """Masks of the token each row samples after its last input (EXTEND / MIXED).

        Returns None when no row is constrained.
        """
        start = self._enter("new", "sampling")
        self._begin()
        masks = self._fill_step(0)
        self._mark(start, "grammar-mask")
        return self._row_masks(masks)

    def accept_sampled(self, tokens: torch.Tensor) -> None:
        """Consume the sampled token of every row (``tokens`` ``[B]``); build the next masks."""
        start = self._enter("sampling", "done")
        chosen = tokens.detach().cpu().numpy()
        for r in np.flatnonzero(self._active).tolist():
            if self._failure[r] is None:
                self._keep(r, int(chosen[self._rows[r]]), self._steps[0][r], step=0)
        self._mark(start, "grammar-advance")
        self._prefetch()

    # ---------------------------------------------------------- decode rows
    def draft_masks(self) -> RowMasks | None:
        """Masks of the next draft position (step k after drafts d1 .. dk), or None."""
        start = self._enter(("new", "drafting"), "drafting")
        if self._await_push:
            raise GrammarError("draft_masks() twice without push_drafts() in between")
        if not self._steps:
            self._begin()
        self._await_push = True
        masks = self._fill_step(len(self._steps))
        self._mark(start, "grammar-mask")
        return self._row_masks(masks, only_open=True)

    def push_drafts(self, tokens: torch.Tensor) -> None:
        """Consume the drafts of the current step (``tokens`` ``[B]``) where the grammar allows
        them; a row whose draft it refuses stops drafting under the grammar (pruned)."""
        self._enter("drafting", "drafting")
        if not self._await_push:
            raise GrammarError("push_drafts() without a draft_masks() for this step")
        self._await_push = False
        self._push_step(tokens.detach().cpu().numpy(), len(self._steps) - 1)

    def verify_masks(self, drafts: torch.Tensor) -> RowMasks | None:
        """Masks of the verify ``[R, K+1, words]`` for ``drafts`` ``[B, K]``: position j is the
        mask after d1 .. dj. Drafts not pushed while drafting are checked and pushed now.

        Raises:
            GrammarError: drafts differ from the ones the draft masks were built from.
        """
        start = self._enter(("new", "drafting"), "verifying")
        if self._await_push:
            raise GrammarError("verify_masks() after draft_masks() without push_drafts()")
        if not self._steps:
            self._begin()
        chain = drafts.detach().cpu().numpy()
        num_steps = chain.shape[1]
        self._check_pushed(chain)
        while len(self._steps) <= num_steps:
            step = len(self._steps)
            self._fill_step(step)
            if step < num_steps:
                self._push_step(chain[:, step], step)
        self._mark(start, "grammar-mask")
        if not self._active.any():
            return None
        index = np.flatnonzero(self._active)
        stacked = np.stack([self._steps[k][index] for k in range(num_steps + 1)], axis=1)
        return RowMasks(
            rows=torch.tensor([self._rows[r] for r in index], dtype=torch.int64),
            bitmask=torch.from_numpy(stacked),
        )

    def accept(self, run_tokens: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """Keep each row's accepted run (``run_tokens`` ``[B, D]``, ``accept_lens`` ``[B]``):
        roll back the rejected drafts, consume the bonus; build the next round's first masks."""
        start = self._enter("verifying", "done")
        runs = run_tokens.detach().cpu().numpy()
        lens = accept_lens.detach().cpu().numpy()
        for r in np.flatnonzero(self._active).tolist():
            if self._failure[r] is None:
                self._accept_row(r, runs[self._rows[r]], int(lens[self._rows[r]]))
        self._mark(start, "grammar-advance")
        self._prefetch()

    # -------------------------------------------------------------- helpers
    def _enter(self, allowed: str | tuple[str, ...], then: str) -> int:
        phases = (allowed,) if isinstance(allowed, str) else allowed
        if self._phase not in phases:
            raise GrammarError(
                f"grammar rows used out of order: {self._phase} -> {then} (a GrammarRows is "
                "used once, in the order of its module docstring)"
            )
        self._phase = then
        return time.perf_counter_ns() if self._traced else 0

    def _mark(self, start: int, name: str) -> None:
        if self._traced:
            self.spans.append((name, start, time.perf_counter_ns()))

    def _begin(self) -> None:
        """Forward entry: which rows take part, and which are open to masks.

        A prefill's last chunk first rolls back to its committed position (the request may have
        been retracted with a round in flight). A row whose request was retracted since
        scheduling, or whose grammar ended, takes no part (its result is skipped at settlement:
        the request ends or re-prefills); a row found at a dead end reports it.
        """
        incarnations = self._incarnations
        for r, (state, owner) in enumerate(zip(self._states, self._owners, strict=True)):
            if owner.incarnation != incarnations[r]:
                continue  # retracted since scheduling: its result is skipped at settlement
            target = self._resume[r]
            if target is not None and target < state.position:
                state.dead = None  # a dead end found past the kept tokens is not this one's
                self._rollbacks += 1
                self._rolled_back += self._undo(state, state.position - target)
            if state.ended:
                continue  # it finishes at its end token; the matcher is asked for nothing
            self._active[r] = True
            if state.dead is not None:
                self._failure[r] = state.dead  # found when the previous forward looked ahead
                self._dead_end[r] = True
            else:
                self._open[r] = True

    def _undo(self, state: GrammarState, num_tokens: int) -> int:
        """``state.rollback``, counting a rebuild it needed."""
        before = state.num_rebuilds
        undone = state.rollback(num_tokens)
        self._rebuilds += state.num_rebuilds - before
        return undone

    def _fill_step(self, step: int) -> MaskArray:
        """The masks of ``step`` for the open rows (others: no constraint)."""
        masks = np.full((len(self._rows), self._words), _ALL, dtype=np.int32)
        todo: list[tuple[Any, int]] = []
        open_rows = np.flatnonzero(self._open).tolist()
        for r in open_rows:
            state = self._states[r]
            cached = state.prefetched
            if step == 0 and cached is not None and cached[0] == state.version:
                masks[r] = cached[1]  # built by the previous forward, after its accepted run
                self._prefetched += 1
            else:
                todo.append((state.matcher_for_mask(), r))
        if todo:
            self._fill(todo, masks)
        for r in open_rows:
            state = self._states[r]
            if state.is_error():  # a dead end: nothing can follow this position
                masks[r] = _ALL  # keep the logits finite; the row never emits from here
                self._open[r] = False
                self._dead_step[r] = step
                if step == 0:
                    self._failure[r] = state.mark_dead(state.position)
                    self._dead_end[r] = True
        self._steps.append(masks)
        return masks

    def _fill(self, todo: list[tuple[Any, int]], masks: MaskArray) -> None:
        """Compute the mask of each ``(matcher, index)`` into ``masks[index]`` (C-contiguous).

        One call per matcher (each releases the interpreter lock), or llguidance's parallel
        executor when the table was given threads.
        """
        self._masks += len(todo)
        if self._executor is not None:
            from llguidance.numpy import fill_next_token_bitmask_par

            fill_next_token_bitmask_par(self._executor, todo, masks)
            return
        base, row_bytes = masks.ctypes.data, masks.shape[1] * 4
        for matcher, index in todo:
            matcher.unsafe_compute_mask_ptr(base + index * row_bytes, row_bytes)

    def _push_step(self, chosen: np.ndarray[Any, Any], step: int) -> None:
        open_rows = np.flatnonzero(self._open)
        if open_rows.size == 0:
            return
        tokens = chosen[np.asarray(self._rows)[open_rows]].astype(np.int64)
        valid = _allowed_bits(self._steps[step][open_rows], tokens)
        for r, token, ok in zip(open_rows.tolist(), tokens.tolist(), valid.tolist(), strict=True):
            if not ok:
                self._open[r] = False  # pruned: the grammar refuses this draft
                self._pruned += 1
                continue
            state = self._states[r]
            state.push(token)
            self._pushed[r].append(token)
            if state.ended:
                self._open[r] = False

    def _check_pushed(self, chain: np.ndarray[Any, Any]) -> None:
        for r in np.flatnonzero(self._active).tolist():
            pushed = self._pushed[r]
            row = chain[self._rows[r], : len(pushed)].tolist()
            if row != pushed:
                raise GrammarError(
                    f"request {self._states[r].request_id}: verify drafts {row} differ from the "
                    f"drafts {pushed} its grammar masks were built from"
                )

    def _accept_row(self, r: int, run: np.ndarray[Any, Any], accept_len: int) -> None:
        """Roll back the rejected drafts of row ``r`` and keep its bonus."""
        state = self._states[r]
        pushed = self._pushed[r]
        kept_drafts = accept_len - 1
        if state.ended and kept_drafts >= len(pushed):
            self._kept[r] = tuple(pushed)  # the run passed the end token: the grammar ended
            return
        dead = self._dead_step[r]
        if dead is not None and kept_drafts >= dead:
            # The run reached a position no token can follow: its token there is not real.
            self._rolled_back += self._undo(state, len(pushed) - dead)
            self._failure[r] = state.mark_dead(state.position)
            self._dead_end[r] = True
            self._kept[r] = tuple(pushed[:dead])
            return
        if kept_drafts > len(pushed):
            self._failure[r] = (
                f"request {state.request_id}: the verify accepted {kept_drafts} drafts but its "
                f"grammar allowed only {len(pushed)} (the forward did not apply the masks)"
            )
            return
        extra = len(pushed) - kept_drafts
        if extra > 0:
            self._rollbacks += 1
            self._rolled_back += self._undo(state, extra)
        self._keep(r, int(run[kept_drafts]), self._steps[kept_drafts][r], step=kept_drafts)
        self._kept[r] = tuple(pushed[:kept_drafts]) + self._kept[r]

    def _keep(self, r: int, token: int, mask: MaskArray, *, step: int) -> None:
        state = self._states[r]
        if not _allows(mask, token):
            self._failure[r] = (
                f"request {state.request_id}: token {token} at output {state.position} is not "
                f"allowed by its grammar {state.grammar.describe()} (the forward did not apply "
                f"the mask of position {step})"
            )
            return
        state.push(token)
        self._kept[r] = (token,)

    def _prefetch(self) -> None:
        """Build the mask of each continuing row's next position now (the next round's first)."""
        start = time.perf_counter_ns() if self._traced else 0
        todo = [
            r
            for r in np.flatnonzero(self._active).tolist()
            if self._failure[r] is None and self._states[r].is_active
        ]
        if not todo:
            return
        masks = np.full((len(todo), self._words), _ALL, dtype=np.int32)
        self._fill([(self._states[r].matcher_for_mask(), i) for i, r in enumerate(todo)], masks)
        for i, r in enumerate(todo):
            state = self._states[r]
            if state.is_error():
                state.mark_dead(state.position)
            else:
                state.prefetched = (state.version, masks[i])
        self._mark(start, "grammar-next-mask")

    def _row_masks(self, masks: MaskArray, *, only_open: bool = False) -> RowMasks | None:
        rows = self._open if only_open else self._active
        index = np.flatnonzero(rows)
        if index.size == 0:
            return None
        return RowMasks(
            rows=torch.tensor([self._rows[r] for r in index], dtype=torch.int64),
            bitmask=torch.from_numpy(masks[index]),
        )


def _allowed_bits(masks: MaskArray, tokens: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Per row, whether ``masks[i]`` allows ``tokens[i]`` (vectorized; ids past the mask: no)."""
    words = tokens >> 5
    inside = (tokens >= 0) & (words < masks.shape[1])
    picked = masks[np.arange(len(tokens)), np.clip(words, 0, masks.shape[1] - 1)]
    allowed: np.ndarray[Any, Any] = inside & (((picked >> (tokens & 31)) & 1) == 1)
    return allowed


def _allows(mask: MaskArray, token: int) -> bool:
    """Whether the packed ``mask`` allows ``token`` (a token past the mask is refused)."""
    word = token >> 5
    return 0 <= word < mask.shape[0] and bool((int(mask[word]) >> (token & 31)) & 1)
