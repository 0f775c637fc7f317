"""What a hybrid worker declares about its recurrent state, and where each request's states sit.

Values only (the owner of the committed states is `specstate.memory.recurrent`): a worker
declares its state shapes (`RecurrentStateSpec`: per layer group, the tensors of one state row);
the engine sizes ``C = D + 1`` rows per request slot from the worker's window
(`rows_per_request`) and hands the worker a `RecurrentLayout`, in which the state after ``p``
tokens of slot ``s`` is row ``s * C + p % C``::

    rows of slot s      s*C + 0    s*C + 1   s*C + 2    ...   s*C + C-1
    a verify at S       S+D ckpt   read S    S+1 ckpt   ...   S+D-1 ckpt   (C = D + 1, S % C = 1)

Invariant: every spec is validated at construction (`InvalidConfig`), and `RecurrentLayout.rows`
never leaves the rows of the slot it is given.
"""

from __future__ import annotations

import attrs
import torch

from specstate.core.errors import InvalidConfig

__all__ = [
    "RecurrentGroupSpec",
    "RecurrentLayout",
    "RecurrentStateSpec",
    "StateTensorSpec",
    "rows_per_request",
]


@attrs.frozen(kw_only=True)
class StateTensorSpec:
    """One tensor of a recurrent layer's state, per state row.

    Attributes:
        name: what it holds (``conv``: the last inputs of a causal convolution; ``ssm``: the
            state-space state).
        shape: its shape per state row (the buffer is ``[num_rows, *shape]``).
        dtype: its dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __attrs_post_init__(self) -> None:
        if not self.shape or any(not isinstance(d, int) or d < 1 for d in self.shape):
            raise InvalidConfig(f"state tensor {self.name!r}: shape {self.shape} must be >= 1")

    @property
    def num_bytes(self) -> int:
        """Bytes of one state row of this tensor."""
        count = 1
        for d in self.shape:
            count *= d
        return count * torch.empty(0, dtype=self.dtype).element_size()


@attrs.frozen(kw_only=True)
class RecurrentGroupSpec:
    """Layers of one kind that share a state shape (e.g. every Mamba2 layer of a target).

    Attributes:
        name: the group (``target.mamba2``, ``draft.mamba2``).
        num_layers: how many layers hold a state of this shape.
        tensors: the state tensors of one layer.
    """

    name: str
    num_layers: int
    tensors: tuple[StateTensorSpec, ...]

    def __attrs_post_init__(self) -> None:
        if self.num_layers < 1 or not self.tensors:
            raise InvalidConfig(
                f"recurrent group {self.name!r}: needs num_layers >= 1 and a state tensor, got "
                f"{self.num_layers} layers, {len(self.tensors)} tensors"
            )

    @property
    def num_bytes(self) -> int:
        """Bytes of one state row over every layer of the group."""
        return self.num_layers * sum(t.num_bytes for t in self.tensors)


@attrs.frozen(kw_only=True)
class RecurrentStateSpec:
    """What a hybrid worker declares (`WorkerCapabilities.recurrent`): its state shapes.

    The engine sizes the state rows from it and the worker's window (`rows_per_request`); a
    worker with a drafter that has recurrent layers declares the drafter's groups too (the
    drafter's states use the same rows, as its KV uses the same token slots).

    Attributes:
        groups: one entry per layer group, in the worker's order.
    """

    groups: tuple[RecurrentGroupSpec, ...]

    def __attrs_post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if not names or len(set(names)) != len(names):
            raise InvalidConfig(f"recurrent state spec needs distinct groups, got {names}")

    @property
    def bytes_per_row(self) -> int:
        """Bytes of one state row over every group (one request holds ``C`` rows)."""
        return sum(g.num_bytes for g in self.groups)

    def merged(self, other: RecurrentStateSpec | None) -> RecurrentStateSpec:
        """This spec followed by ``other``'s groups (a target's and its drafter's)."""
        return self if other is None else RecurrentStateSpec(groups=self.groups + other.groups)


def rows_per_request(num_draft_tokens: int) -> int:
    """``C``: state rows per request for a verify of ``num_draft_tokens`` (D) tokens.

    ``D + 1``: the committed state plus one checkpoint per token a verify absorbs, so that the
    checkpoints of a round never alias the state it starts from. Without speculation D is 1.
    """
    if num_draft_tokens < 1:
        raise InvalidConfig(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    return num_draft_tokens + 1


@attrs.frozen(kw_only=True)
class RecurrentLayout:
    """Where request states sit in a worker's state buffers (handed over at attach).

    Attributes:
        rows_per_request: ``C``, state rows per request slot (`rows_per_request`).
        num_request_slots: request slots including the padding slot 0 (whose rows padded
            batch rows write harmlessly).

    Invariant: the rows of slot ``s`` are ``[s*C, (s+1)*C)``; `rows` never leaves them.
    """

    rows_per_request: int
    num_request_slots: int

    def __attrs_post_init__(self) -> None:
        if self.rows_per_request < 2 or self.num_request_slots < 2:
            raise InvalidConfig(
                f"recurrent layout needs rows_per_request >= 2 and num_request_slots >= 2, got "
                f"{self.rows_per_request}, {self.num_request_slots}"
            )

    @property
    def num_rows(self) -> int:
        """State rows every buffer must hold (``num_request_slots * C``)."""
        return self.num_request_slots * self.rows_per_request

    def rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The row holding the state after ``positions`` tokens of ``slots`` (broadcast).

        ``slots * C + positions % C``, on the tensors' device (no host synchronization).
        """
        c = self.rows_per_request
        return slots.long() * c + torch.remainder(positions.long(), c)
