"""The handoff record: what a decode engine needs to continue a request a prefill engine began.

A prefill engine runs a request's prefill (the target's, the drafter's) and samples its first
token; a decode engine continues it. What crosses is exactly the request's committed state::

    request     id, prompt, emitted tokens (the last one is the pending bonus token), sampling
                parameters (grammar included, as its spec: the decode engine compiles it and
                replays the emitted tokens through it); with ``logprobs``, the emitted tokens'
                log-probabilities (and their top alternatives with ``top_logprobs``)
    clock       committed length C = len(prompt) + len(emitted) - 1 (KV positions [0, C));
                nothing speculative crosses
    slot state  per position p < C, every worker buffer kept by KV token slot: the target's K and
                V of each layer, the drafter's (draft model, EAGLE head), the feature store, the
                token histories; one tensor per buffer, ``[C, ...]``, position-major (a layout
                that does not depend on either side's page size or slot numbering)
    draft state the relay payload of the next round: the bonus token and the family's extras
                (EAGLE's hidden state of position C - 1, a tree drafter's top-k)
    state row   a hybrid model's recurrent state after C tokens (target and drafter), one row
                of every state buffer; empty for a model without recurrent state
    descriptor  what the decode engine must match to serve it (`CompatibilityDescriptor`)

Derived, not stored (each rebuilt exactly from the fields above): the penalty counts (the counts
of the emitted tokens; prompt presence from the slot state's token history), the stop state (the
emitted tokens: a stop sequence is matched on them), the seeded sampler's position (a seeded
draw is keyed by ``(seed, position)``, and the next position is C + 1), ``min_new_tokens``
progress (``len(emitted)``).

Invariant: a record is frozen; ``slot_state`` tensors each have ``committed_len`` rows; the bonus
token is the last emitted token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import attrs
import torch

from specstate.core.errors import HandoffMismatch
from specstate.core.params import SamplingParams
from specstate.core.request import TopLogprobs

__all__ = [
    "HANDOFF_VERSION",
    "ROW",
    "CompatibilityDescriptor",
    "DraftState",
    "HandoffRecord",
    "StateLayout",
]

HANDOFF_VERSION = 2
"""The record format version; a decoder refuses any other."""

StateLayout = tuple[tuple[str, str, tuple[int, ...]], ...]
"""``(name, dtype, per-position shape)`` of every slot-state buffer, in export order; a name
that starts with `ROW` is a recurrent state buffer (its shape is one state row's)."""

ROW = "row:"
"""The prefix of a recurrent state buffer's name in a `StateLayout`."""


@attrs.frozen(kw_only=True)
class CompatibilityDescriptor:
    """What a decode engine must share with the prefill engine to continue its requests.

    Attributes:
        model_digest: digest of the target's parameters.
        drafter_digest: digest of the drafter's parameters ("" when nothing drafts from weights).
        dtype: the KV dtype (``"torch.float32"``, ...).
        page_size: tokens per KV page.
        layout: every slot-state buffer: name, dtype, shape of one position.
        algorithm: the worker's algorithm (``none``, ``ngram``, ``draft_model``, ``eagle``, ...).
        num_steps: draft steps per round.
        topk: draft branches per step.
        library_version: the specstate version that wrote the record.
    """

    model_digest: str
    drafter_digest: str
    dtype: str
    page_size: int
    layout: StateLayout
    algorithm: str
    num_steps: int
    topk: int
    library_version: str

    CHECKED = (
        "algorithm",
        "num_steps",
        "topk",
        "page_size",
        "dtype",
        "model_digest",
        "drafter_digest",
        "layout",
        "library_version",
    )
    """The fields `check` compares, in the order it names the first that differs."""

    def check(self, record: CompatibilityDescriptor, *, request_id: str) -> None:
        """Refuse ``record`` (a record's descriptor) if this engine (``self``) cannot serve it.

        Raises:
            HandoffMismatch: naming the first field of `CHECKED` that differs, both values.
        """
        for name in self.CHECKED:
            mine, theirs = getattr(self, name), getattr(record, name)
            if mine != theirs:
                raise HandoffMismatch(
                    f"request {request_id!r}: handoff record has {name} {theirs!r}, this decode "
                    f"engine has {mine!r}; refused before anything was written",
                    field=name,
                    expected=mine,
                    found=theirs,
                )


@attrs.frozen(kw_only=True)
class DraftState:
    """The next round's relay inputs of one request (`RelayPayload`, one row).

    Attributes:
        bonus_token: the pending bonus token (the last emitted token), at position C.
        hidden_states: ``[hidden]`` the feature an EAGLE-family head continues from, or None.
        topk_p: ``[k]`` a tree drafter's carried probabilities, or None.
        topk_index: ``[k]`` their token ids, or None.
    """

    bonus_token: int
    hidden_states: torch.Tensor | None = None
    topk_p: torch.Tensor | None = None
    topk_index: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The extras that are present, by name."""
        found = {
            "hidden_states": self.hidden_states,
            "topk_p": self.topk_p,
            "topk_index": self.topk_index,
        }
        return {k: v for k, v in found.items() if v is not None}


@attrs.frozen(kw_only=True, eq=False)
class HandoffRecord:
    """One request's committed state, handed from a prefill engine to a decode engine.

    See the module docstring for what each part holds and what is derived.

    Attributes:
        version: `HANDOFF_VERSION` of the writer.
        request_id: the request's id (the same on both engines).
        prompt_ids: the prompt.
        output_ids: the emitted tokens (at least one: the first sampled token).
        sampling: the sampling parameters.
        committed_len: KV positions that cross, ``len(prompt_ids) + len(output_ids) - 1``.
        descriptor: the prefill engine's compatibility descriptor.
        slot_state: ``name -> [committed_len, ...]`` by position, in ``descriptor.layout`` order.
        draft_state: the next round's relay inputs.
        recurrent_state: ``name -> one state row`` (the `ROW` names of the layout, in order):
            a hybrid model's state after ``committed_len`` tokens; empty without one.
        output_logprobs: with ``sampling.logprobs``, the log-probability of every emitted
            token (aligned with ``output_ids``; the decode engine's `Req.logprobs` continues
            them); None without.
        output_top_logprobs: with ``sampling.top_logprobs``, every emitted position's top
            alternatives (`Req.top_logprobs`, aligned with ``output_ids``); None without.
    """

    version: int
    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    sampling: SamplingParams
    committed_len: int
    descriptor: CompatibilityDescriptor
    slot_state: Mapping[str, torch.Tensor]
    draft_state: DraftState
    recurrent_state: Mapping[str, torch.Tensor] = attrs.field(factory=dict)
    output_logprobs: tuple[float, ...] | None = None
    output_top_logprobs: tuple[TopLogprobs, ...] | None = None

    @property
    def sampler_position(self) -> int:
        """The position of the next token a seeded draw is keyed on (``committed_len + 1``)."""
        return self.committed_len + 1

    @property
    def penalty_counts(self) -> Counter[int]:
        """Occurrences of each token in the output so far (frequency and presence penalties)."""
        return Counter(self.output_ids)

    @property
    def num_bytes(self) -> int:
        """Bytes of tensor data the record carries."""
        tensors = [
            *self.slot_state.values(),
            *self.recurrent_state.values(),
            *self.draft_state.tensors().values(),
        ]
        return sum(t.numel() * t.element_size() for t in tensors)
