"""A Mamba2 layer whose recurrent state lives in state rows that specstate lays out.

`StateBuffers` owns the states of one group of recurrent layers (here every Mamba2 layer of a
model: per layer a convolution state ``[num_rows, conv_dim, conv_kernel - 1]``, the last inputs
of the causal convolution, and an SSM state ``[num_rows, heads, head_dim, d_state]`` in float32;
LFM2's short convolutions keep the convolution state alone). A request's rows are placed by
`specstate.memory.recurrent.RecurrentLayout`: the state after ``p`` tokens of slot ``s`` is row
``s * C + p % C``.

`Mamba2Mixer` computes transformers' ``NemotronHMamba2Mixer`` exactly, one token at a time (the
recurrence transformers' one-token decode step uses), for a batch of rows of different
lengths laid out ``[B, L]``::

    in_proj(x) -> gate | xBC | dt
    xBC  -> causal conv (state: the previous conv_kernel - 1 inputs) -> silu -> x | B | C
    dt   -> softplus(dt + dt_bias), clamped below by time_step_min; A = -exp(A_log)
    h_t  = exp(dt A) h_(t-1) + dt B x_t         y_t = C h_t + D x_t        (per head)
    out  = out_proj(gated_rmsnorm(y * silu(gate)))   (the norm per group of channels)

Each row reads its start state (the zero state for a row whose prefix is 0) before writing
anything, and writes the state after each of its last ``C`` tokens to that token's row, so a
verify leaves the checkpoint of every accept length, and an extend its final state.

Invariant: a forward reads only the start row of each batch row and writes only the rows of
positions it absorbs; padded positions (past a row's extend length) change no state.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentGroupSpec, RecurrentLayout
from specstate.reference.hybrid.config import HybridConfig

__all__ = ["Mamba2Mixer", "StateBuffers", "TokenGrid", "causal_conv"]


@attrs.frozen(kw_only=True)
class TokenGrid:
    """The packed ``[T]`` tokens of a forward laid out as ``[B, L]`` (built once per forward).

    Attributes:
        token_req: ``[T]`` batch row of each token.
        token_offset: ``[T]`` index of each token within its row's extend.
        valid: ``[B, L]`` True where a real token sits.
        start_rows: ``[B]`` state row each batch row starts from.
        fresh: ``[B, 1, 1]`` bool, True where the row starts from the zero state (prefix 0).
        write_rows: ``[B, L]`` state row of the state after each token.
        write_mask: ``[B, L]`` the tokens whose state is written (each row's last ``C``).
    """

    token_req: torch.Tensor
    token_offset: torch.Tensor
    valid: torch.Tensor
    start_rows: torch.Tensor
    fresh: torch.Tensor
    write_rows: torch.Tensor
    write_mask: torch.Tensor

    @classmethod
    def build(
        cls,
        *,
        slots: torch.Tensor,
        prefix_lens: torch.Tensor,
        extend_lens: torch.Tensor,
        layout: RecurrentLayout,
    ) -> TokenGrid:
        """The grid of one forward; reads the longest extend on the host (the padded width)."""
        device = extend_lens.device
        ext, pre = extend_lens.long(), prefix_lens.long().to(device)
        width = int(ext.max()) if ext.numel() else 0
        token_req = torch.repeat_interleave(torch.arange(ext.shape[0], device=device), ext)
        starts = torch.cumsum(ext, 0) - ext
        token_offset = torch.arange(token_req.shape[0], device=device) - starts[token_req]
        steps = torch.arange(width, device=device)[None, :]
        valid = steps < ext[:, None]
        slots = slots.long().to(device)
        positions_after = pre[:, None] + steps + 1
        write_mask = valid & (steps >= ext[:, None] - layout.rows_per_request)
        return cls(
            token_req=token_req,
            token_offset=token_offset,
            valid=valid,
            start_rows=layout.rows(slots, pre),
            fresh=(pre == 0)[:, None, None],
            write_rows=layout.rows(slots[:, None], positions_after),
            write_mask=write_mask,
        )

    @property
    def width(self) -> int:
        """L, the longest extend."""
        return int(self.valid.shape[1])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, ...]`` as ``[B, L, ...]`` (zeros where no token sits)."""
        grid = x.new_zeros(self.valid.shape[0], self.width, *x.shape[1:])
        grid[self.token_req, self.token_offset] = x
        return grid

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, L, ...]`` back to the packed ``[T, ...]``."""
        return x[self.token_req, self.token_offset]


class StateBuffers:
    """Owner of the states of one group of recurrent layers, indexed by state row.

    Built from the `RecurrentGroupSpec` the model declares: per layer, one buffer
    ``[layout.num_rows, *shape]`` for each of the group's state tensors (a Mamba2 layer's
    ``conv`` and ``ssm``; a short-convolution layer's ``conv`` alone).

    Invariant: every buffer has ``layout.num_rows`` rows; rows change only through `write`.
    """

    def __init__(
        self, group: RecurrentGroupSpec, layout: RecurrentLayout, *, device: torch.device | str
    ) -> None:
        self.layout = layout
        self.group = group
        self._buffers = [
            tuple(
                torch.zeros((layout.num_rows, *t.shape), dtype=t.dtype, device=device)
                for t in group.tensors
            )
            for _ in range(group.num_layers)
        ]

    @property
    def num_layers(self) -> int:
        """Layers whose states this holds."""
        return len(self._buffers)

    @property
    def num_bytes(self) -> int:
        """Bytes of every buffer held (what the state rows of this group cost)."""
        return sum(b.numel() * b.element_size() for layer in self._buffers for b in layer)

    def buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer by name (``{group}.{layer}.{tensor}``), indexed by state row on dim 0:
        the buffers themselves (a prefill → decode handoff copies one row of each)."""
        return {
            f"{self.group.name}.{layer}.{spec.name}": buffer
            for layer, buffers in enumerate(self._buffers)
            for spec, buffer in zip(self.group.tensors, buffers, strict=True)
        }

    def read(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of the state tensors of ``layer`` at ``rows``, in the group's order."""
        return tuple(buffer[rows] for buffer in self._buffers[layer])

    def write(self, layer: int, rows: torch.Tensor, *states: torch.Tensor) -> None:
        """Store the state tensors of ``layer`` at ``rows`` (distinct, except padding rows of
        slot 0), one per tensor of the group, in its order."""
        buffers = self._buffers[layer]
        if len(states) != len(buffers):
            raise InvalidConfig(
                f"state group {self.group.name!r}: write of {len(states)} tensors, expected "
                f"{len(buffers)}"
            )
        for buffer, state in zip(buffers, states, strict=True):
            buffer.index_copy_(0, rows, state.to(buffer.dtype))


def causal_conv(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution of ``x`` ``[B, L, ch]`` continuing from ``state``.

    ``state`` ``[B, ch, K-1]`` holds each row's previous ``K - 1`` inputs; ``weight`` is
    ``[ch, 1, K]``. Returns the outputs ``[B, L, ch]`` and the state after each token
    ``[B, L, ch, K-1]`` (the inputs ``i-K+2 .. i``).
    """
    seq = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=2)  # [B, ch, K-1+L]
    out = F.conv1d(seq, weight, bias, groups=x.shape[2]).transpose(1, 2)
    after = seq.unfold(2, weight.shape[2] - 1, 1)[:, :, 1:].transpose(1, 2)
    return out, after


class _GatedRmsNorm(nn.Module):
    """``weight * rmsnorm_per_group(y * silu(gate))`` in float32, as transformers computes it."""

    def __init__(self, size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * groups.view(h.shape).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer (the module docstring); ``index`` is its place among the Mamba2 layers."""

    def __init__(self, config: HybridConfig, index: int) -> None:
        super().__init__()
        inner, heads = config.mamba_intermediate, config.mamba_num_heads
        self.config = config
        self.index = index
        self.in_proj = nn.Linear(
            config.hidden_size, inner + config.conv_dim + heads, bias=config.use_bias
        )
        self.conv1d = nn.Conv1d(
            config.conv_dim,
            config.conv_dim,
            kernel_size=config.conv_kernel,
            groups=config.conv_dim,
            bias=config.use_conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = _GatedRmsNorm(inner, inner // config.n_groups, config.layer_norm_epsilon)
        self.out_proj = nn.Linear(inner, config.hidden_size, bias=config.use_bias)

    def forward(self, x: torch.Tensor, grid: TokenGrid, states: StateBuffers) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; reads start states, writes checkpoints."""
        cfg = self.config
        inner, groups, n = cfg.mamba_intermediate, cfg.n_groups, cfg.ssm_state_size
        projected: torch.Tensor = self.in_proj(x)
        gate, xbc, dt = torch.split(projected, [inner, cfg.conv_dim, cfg.mamba_num_heads], -1)
        conv0, ssm0 = states.read(self.index, grid.start_rows)
        # A row with prefix 0 starts from the zero state, whatever its row holds (even NaN).
        conv0 = torch.where(grid.fresh, 0.0, conv0)
        ssm0 = torch.where(grid.fresh[..., None], 0.0, ssm0)
        conv, conv_after = causal_conv(grid.pad(xbc), conv0, self.conv1d.weight, self.conv1d.bias)
        xbc_act = F.silu(conv)  # [B, L, conv_dim]
        hs, b, c = torch.split(xbc_act, [inner, groups * n, groups * n], -1)
        y, ssm_after = self._scan(hs, b, c, grid.pad(dt), grid.valid, ssm0)
        self._write(grid, states, conv_after, ssm_after)
        y = grid.unpad(y.reshape(*y.shape[:2], inner))
        out: torch.Tensor = self.out_proj(self.norm(y, gate).to(x.dtype))
        return out

    def _scan(
        self,
        hs: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        dt: torch.Tensor,
        valid: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The SSM recurrence over ``L`` steps; outputs ``[B, L, H, P]`` and states per step."""
        cfg = self.config
        rows, width = hs.shape[:2]
        heads, dim, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size
        per_group = heads // cfg.n_groups
        x = hs.reshape(rows, width, heads, dim).float()
        b = b.reshape(rows, width, cfg.n_groups, n).repeat_interleave(per_group, 2).float()
        c = c.reshape(rows, width, cfg.n_groups, n).repeat_interleave(per_group, 2).float()
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp_min(cfg.time_step_min)
        dt = torch.where(valid[..., None], dt, 0.0).float()  # padding: decay 1, no input
        a = -torch.exp(self.A_log.float())
        outputs, after = [], []
        for t in range(width):
            step = dt[:, t]  # [B, H]
            decay = torch.exp(step * a)[:, :, None, None]
            state = state * decay + (step[:, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
            after.append(state)
            y = (state * c[:, t, :, None, :]).sum(-1) + x[:, t] * self.D.float()[:, None]
            outputs.append(y)
        if not outputs:
            empty = x.new_zeros(rows, 0, heads, dim)
            return empty, x.new_zeros(rows, 0, heads, dim, n)
        return torch.stack(outputs, 1).to(hs.dtype), torch.stack(after, 1)

    def _write(
        self,
        grid: TokenGrid,
        states: StateBuffers,
        conv_after: torch.Tensor,
        ssm_after: torch.Tensor,
    ) -> None:
        mask = grid.write_mask
        if not grid.width:
            return
        rows = grid.write_rows[mask]
        states.write(self.index, rows, conv_after[mask], ssm_after[mask])


def check_layout(config: HybridConfig, layout: RecurrentLayout | None) -> RecurrentLayout | None:
    """``layout`` if the model needs state rows; `InvalidConfig` when one is needed and absent."""
    if config.num_mamba_layers and layout is None:
        raise InvalidConfig(
            f"a model with {config.num_mamba_layers} Mamba2 layers needs a recurrent state layout "
            "(WorkerMemory.recurrent)"
        )
    return layout
