"""What a drafter family puts on the host's path each round: the owner of the benches' shapes.

The host benchmarks (`specstate bench host`, `specstate bench engine`) time the engine around a
stand-in worker; the one thing a drafter family changes in that work is what its worker declares
and relays: whether its drafting keeps KV (the reservation), and the extras of its relay payload
(what the FutureMap stashes and gathers every round). `DRAFT_SHAPES` holds them for every
reference family, as the reference workers relay them::

    eagle           draft KV; hidden [H] + top-k (the tree/EAGLE extras)
    mtp             draft KV; the hidden chain of its two MTP layers [2H]
    eagle3          draft KV; three target layers' hidden states [3H]
    frozen_kv_mtp   no draft KV; the normed hidden state [H]
    dflash          the assistant's KV; the bonus only (the context stays in that KV)
    dspark          as dflash (its heads keep no state; confidences ride the result)
    uno             draft KV; the bonus only (tokens and lengths)

At the benches' one width (3 proposals past the bonus, a verify of 4, ``L = 4``, ``R = 8``) the
block families declare the same window as a chain: DFLASH's block of 4 holds the bonus and its
3 drafts, UNO's pass drafts the root and 2 more.
"""

from __future__ import annotations

from typing import Final

import attrs

__all__ = ["DRAFT_SHAPES", "DraftShape"]


@attrs.frozen(kw_only=True)
class DraftShape:
    """One family's host-side shape.

    Attributes:
        algorithm: the registry name the stand-in worker declares.
        keeps_draft_kv: whether the family's drafting writes KV (`WorkerCapabilities`).
        hidden_multiple: the relayed hidden state's width in units of the model width (0: the
            relay carries no hidden state).
        topk: whether the relay carries ``topk_p`` / ``topk_index`` too.
    """

    algorithm: str
    keeps_draft_kv: bool
    hidden_multiple: int
    topk: bool


DRAFT_SHAPES: Final = {
    "eagle": DraftShape(algorithm="eagle", keeps_draft_kv=True, hidden_multiple=1, topk=True),
    "mtp": DraftShape(algorithm="mtp", keeps_draft_kv=True, hidden_multiple=2, topk=False),
    "eagle3": DraftShape(algorithm="eagle3", keeps_draft_kv=True, hidden_multiple=3, topk=False),
    "frozen_kv_mtp": DraftShape(
        algorithm="frozen_kv_mtp", keeps_draft_kv=False, hidden_multiple=1, topk=False
    ),
    "dflash": DraftShape(algorithm="dflash", keeps_draft_kv=True, hidden_multiple=0, topk=False),
    "dspark": DraftShape(algorithm="dspark", keeps_draft_kv=True, hidden_multiple=0, topk=False),
    "uno": DraftShape(algorithm="uno", keeps_draft_kv=True, hidden_multiple=0, topk=False),
}
"""Every family the benches take (``--algorithm``), by name."""
