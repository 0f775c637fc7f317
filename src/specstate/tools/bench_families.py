"""The drafter families a host benchmark models: the window each declares and what it relays.

The host benchmarks (``bench host``, ``bench engine``) replace the model with a worker that does
no model work, so the engine's host cost of a family is what its `WorkerCapabilities` and its
relay payload make the engine do. At one draft width (three proposals past the bonus, a verify
of four positions, ``L = 4``, ``R = 8``) the families differ only in the payload::

    eagle    chain of 3 steps, D = 4, draft KV   bonus + top-1 (p, index) + hidden [B, 256]
    dflash   block of 4 (3 drafts), D = 4        bonus only: the context KV stays at the
                                                 token slots, materialized by the worker
    uno      root + 2 drafts, D = 4              bonus only: tokens and lengths

`family_capabilities` and `family_payload` are that table; the workers that replay it live in
`specstate.tools.bench_host` and `specstate.tools.timed_worker`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from specstate.core.errors import InvalidConfig

if TYPE_CHECKING:  # torch loads when a worker is built, not when a command parses its flags
    import torch

    from specstate.engine.worker import WorkerCapabilities
    from specstate.relay.future_map import RelayPayload

__all__ = ["FAMILIES", "HIDDEN", "family_capabilities", "family_payload"]

FAMILIES: Final = ("eagle", "dflash", "uno")
HIDDEN: Final = 256
"""Width of the hidden state an EAGLE round relays."""
_STEPS: Final = 3


def family_capabilities(family: str, **fields: Any) -> WorkerCapabilities:
    """The window of ``family`` at the common width; ``fields`` are further capability fields.

    Raises:
        InvalidConfig: an unknown family.
    """
    import attrs

    from specstate.engine.worker import WorkerCapabilities

    if family not in FAMILIES:
        raise InvalidConfig(f"unknown drafter family {family!r} (one of {', '.join(FAMILIES)})")
    chain = WorkerCapabilities.chain(family, num_steps=_STEPS, keeps_draft_kv=True)
    return attrs.evolve(chain, **fields)


def family_payload(
    family: str, bonus: torch.Tensor, generator: torch.Generator | None = None
) -> RelayPayload:
    """What a round of ``family`` stashes for ``bonus.shape[0]`` rows (random extras)."""
    import torch

    from specstate.relay.future_map import RelayPayload

    if family != "eagle":
        return RelayPayload(bonus_tokens=bonus)
    rows = bonus.shape[0]
    return RelayPayload(
        bonus_tokens=bonus,
        topk_p=torch.rand((rows, 1), generator=generator),
        topk_index=torch.randint(0, 31, (rows, 1), generator=generator),
        hidden_states=torch.randn((rows, HIDDEN), generator=generator).to(torch.bfloat16),
    )
