"""Token history: the token at every position of every request, for drafters and logit controls.

`TokenHistory` stores token ids in one of two layouts, with the same reads and writes:

* **by KV token slot** (`TokenHistory.by_token_slot`, what the reference workers use): one token
  per KV slot, the same index as the KV caches. A row reads its history through the engine's
  ``req_to_token`` table, so a prefix another request computed and the prefix cache mapped into
  this row brings its tokens along, exactly like its KV. Writes land only where the forward
  writes KV (its ``out_cache_loc``, or its reserved window), never in a slot the prefix cache
  shares;
* **by request row** (the constructor): a table shaped like ``req_to_token``, position ``p`` of a
  request at ``[slot, p]``. Simpler, but a shared prefix arrives without its tokens, so a worker
  that keeps its history this way must not declare `PrefixSharing` (the default).

::

    write(slots, positions, tokens)   the token of (slot, position)
    read(slots)                       [B, row_width]: position p of each row at [:, p]

Writes are idempotent (a replayed or overlapped write stores the same token). Positions of a
row past what it maps read stale tokens; every reader looks only below the row's frontier.

The n-gram drafter proposes from it (`propose`): the trailing n-gram ``h[S-n+1 .. S]`` (n =
``max_ngram`` down to 1), its most recent earlier occurrence starting at ``i``, and the tokens
that followed it, ``h[i+n], h[i+n+1], ...``, repeating with period ``S+1-(i+n)`` when they run
past ``S`` (so "abcab" drafts "c a b ..."); with no occurrence, the bonus repeated.

Invariant: every position below a row's frontier reads that position's token (the row's own
forwards wrote it, or, by slot, the request that computed a shared prefix did).
"""

from __future__ import annotations

import torch

from specstate.core.errors import InvalidConfig

__all__ = ["TokenHistory"]


class TokenHistory:
    """Owner of one worker's token history (see the module docstring).

    The constructor keeps it by request row: ``num_rows`` request slots (padding row 0
    included) of ``row_width`` positions; `by_token_slot` keeps it by KV slot.

    Args:
        num_rows: request slots, padding row 0 included.
        row_width: positions per row (the engine's ``req_to_token`` width).
        device: where the rows live.
    """

    def __init__(self, num_rows: int, row_width: int, *, device: torch.device) -> None:
        self._tokens = torch.zeros(num_rows, row_width, dtype=torch.int64, device=device)
        self._table: torch.Tensor | None = None

    @classmethod
    def by_token_slot(
        cls, num_token_slots: int, req_to_token: torch.Tensor, *, device: torch.device
    ) -> TokenHistory:
        """A history of one token per KV slot, read through ``req_to_token`` (read only)."""
        history = cls(0, 0, device=device)
        history._tokens = torch.zeros(num_token_slots, dtype=torch.int64, device=device)
        history._table = req_to_token
        return history

    @property
    def slot_tokens(self) -> torch.Tensor:
        """The tokens by KV slot ``[num_token_slots]`` (the buffer itself; a history by slot).

        Raises:
            InvalidConfig: the history is kept by request row.
        """
        if self._table is None:
            raise InvalidConfig("a history by request row is not kept by KV slot")
        return self._tokens

    def write(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Stores ``tokens[i]`` at position ``positions[i]`` of request slot ``slots[i]``."""
        table = self._table
        if table is None:
            self._tokens.index_put_((slots.long(), positions.long()), tokens.long())
            return
        locs = table[slots.long().to(table.device), positions.long().to(table.device)]
        self.write_at(locs, tokens)

    def write_at(self, locs: torch.Tensor, tokens: torch.Tensor) -> None:
        """By KV slot: stores ``tokens[i]`` at slot ``locs[i]`` (a forward's ``out_cache_loc``).

        Raises:
            InvalidConfig: the history is kept by request row.
        """
        if self._table is None:
            raise InvalidConfig("a history by request row is written by (slot, position)")
        self._tokens.index_put_((locs.long().to(self._tokens.device),), tokens.long())

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """The history of the rows of ``slots``: ``[B, row_width]`` (a copy)."""
        table = self._table
        if table is None:
            return self._tokens.index_select(0, slots.long())
        rows = table.index_select(0, slots.long().to(table.device))
        return self._tokens[rows.to(self._tokens.device)]

    def propose(
        self, slots: torch.Tensor, start: torch.Tensor, *, num_tokens: int, max_ngram: int
    ) -> torch.Tensor:
        """Drafts ``[B, num_tokens]`` following the trailing n-gram that ends at ``start``."""
        return self.propose_matched(slots, start, num_tokens=num_tokens, max_ngram=max_ngram)[0]

    def propose_matched(
        self, slots: torch.Tensor, start: torch.Tensor, *, num_tokens: int, max_ngram: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`propose`, and ``[B]`` True where a trailing n-gram occurred earlier (no fallback)."""
        rows = self.read(slots)
        length = start.long() + 1  # tokens known per row, the bonus at `start` included
        best = torch.full_like(length, -1)
        chosen_n = torch.zeros_like(length)
        for n in range(max_ngram, 0, -1):
            found = self._latest_occurrence(rows, length, n)
            take = (best < 0) & (found >= 0)
            best = torch.where(take, found, best)
            chosen_n = torch.where(take, n, chosen_n)
        first = best + chosen_n  # the token after the occurrence
        period = (length - first).clamp_min(1)
        steps = torch.arange(num_tokens, device=rows.device)[None, :]
        index = (first[:, None] + steps % period[:, None]).clamp(0, rows.shape[1] - 1)
        drafts = rows.gather(1, index)
        bonus = rows.gather(1, start.long()[:, None]).expand_as(drafts)
        return torch.where((best >= 0)[:, None], drafts, bonus), best >= 0

    @staticmethod
    def _latest_occurrence(rows: torch.Tensor, length: torch.Tensor, n: int) -> torch.Tensor:
        """Start of the latest n-gram equal to each row's last ``n`` tokens, ending before them.

        Returns ``-1`` where there is none (or the row is shorter than ``n + 1``).
        """
        width = rows.shape[1]
        if width < n + 1:
            return torch.full_like(length, -1)
        offsets = torch.arange(n, device=rows.device)[None, :]
        suffix = rows.gather(1, (length[:, None] - n + offsets).clamp_min(0))
        windows = rows.unfold(1, n, 1)  # [B, width - n + 1, n]
        equal = (windows == suffix[:, None, :]).all(-1)
        starts = torch.arange(windows.shape[1], device=rows.device)[None, :]
        earlier = starts <= (length - n - 1)[:, None]  # the occurrence ends before the suffix
        return torch.where(equal & earlier, starts, -1).max(dim=1).values
