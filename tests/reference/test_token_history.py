"""A token history kept by KV slot: a row that maps another row's slots reads its tokens."""

from __future__ import annotations

import pytest
import torch

from specstate import InvalidConfig
from specstate.reference.workers import TokenHistory


def test_a_shared_prefix_brings_its_tokens_and_drafts_from_them() -> None:
    """Row 2 maps row 1's first four slots (a cached prefix) and writes only its own."""
    table = torch.zeros(3, 8, dtype=torch.int64)
    table[1, :6] = torch.arange(1, 7)
    table[2, :6] = torch.tensor([1, 2, 3, 4, 9, 10])  # positions 0..3 share row 1's slots
    history = TokenHistory.by_token_slot(16, table, device=torch.device("cpu"))
    history.write_at(table[1, :6], torch.tensor([5, 6, 7, 5, 6, 7]))
    history.write(torch.tensor([2, 2]), torch.tensor([4, 5]), torch.tensor([6, 5]))
    assert history.read(torch.tensor([2]))[0, :6].tolist() == [5, 6, 7, 5, 6, 5]
    drafts = history.propose(torch.tensor([2]), torch.tensor([5]), num_tokens=2, max_ngram=2)
    assert drafts.tolist() == [[6, 5]]  # "5" last seen at 3, a shared position: then 6, 5
    with pytest.raises(InvalidConfig, match="by \\(slot, position\\)"):
        TokenHistory(3, 8, device=torch.device("cpu")).write_at(table[1, :2], torch.ones(2))
