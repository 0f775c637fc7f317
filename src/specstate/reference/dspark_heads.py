"""DSpark's two heads on a DFlash block: a low-rank Markov head and a confidence head.

A DSpark assistant is a DFlash assistant (`specstate.reference.dflash_assistant`) whose block
draft is refined by two small heads that read the block's normed hidden states ``h_i`` (block
row ``i``, drafting the token at ``S + i``, ``i = 1 .. W-1``) and the token before each
position::

    Markov head (rank r)   bias_i = B @ A[t_(i-1)]                         vanilla
                           bias_i = sigmoid(g . h_i + g0) * B @ A[t_(i-1)]  gated
                           logits_i = lm_head(h_i) + bias_i
    confidence head        c_i = sigmoid(w . h_i + w0)

``t_0`` is the bonus ``x0`` and ``t_(i-1)`` for ``i >= 2`` the draft chosen at position
``i - 1``, so drafting is sequential over the block (one small matrix product per position
after the one block forward). ``A`` is ``[vocab, r]`` (the previous token's code), ``B``
``[vocab, r]``. ``c_i`` is the predicted probability that draft ``i`` is accepted given that
drafts ``1 .. i-1`` were: the worker reports it per position (``draft_confidences``) and
`specstate.engine.budgets.ConfidenceBudget` plans the next verify budget from it.

Tensor names (in the assistant's ``model.safetensors``, next to the DFlash tensors):
``markov_head.prev_embed.weight`` ``[vocab, r]``, ``markov_head.out_proj.weight``
``[vocab, r]``, gated only ``markov_head.gate.weight`` ``[1, hidden]`` and
``markov_head.gate.bias`` ``[1]``; ``confidence_head.weight`` ``[1, hidden]`` and
``confidence_head.bias`` ``[1]``.

Invariant: the heads read the block's hidden states and tokens only; they hold no state
between rounds (nothing to commit, reserve or share).
"""

from __future__ import annotations

from typing import Final, Literal

import attrs
import torch
from torch import nn

from specstate.core.errors import InvalidConfig

__all__ = [
    "HEAD_PREFIXES",
    "MARKOV_VARIANTS",
    "ConfidenceHead",
    "DSparkHeadConfig",
    "DSparkHeads",
    "MarkovHead",
    "MarkovVariant",
]

MarkovVariant = Literal["vanilla", "gated"]
MARKOV_VARIANTS: Final[tuple[MarkovVariant, ...]] = ("vanilla", "gated")
HEAD_PREFIXES: Final = ("markov_head.", "confidence_head.")
"""The tensor name prefixes of the heads (everything else in the file is the DFlash backbone)."""


@attrs.frozen(kw_only=True)
class DSparkHeadConfig:
    """The shape of the heads.

    Attributes:
        vocab_size: the target's (and the backbone's) vocabulary.
        hidden_size: the backbone's hidden size.
        markov_rank: r, the rank of the Markov head's factorisation.
        markov_variant: ``vanilla`` (the bias alone) or ``gated`` (scaled by a gate of ``h_i``).

    Invariant: every size is >= 1 and ``markov_variant`` is one of `MARKOV_VARIANTS`.
    """

    vocab_size: int
    hidden_size: int
    markov_rank: int
    markov_variant: MarkovVariant = "vanilla"

    def __attrs_post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "markov_rank"):
            if getattr(self, name) < 1:
                raise InvalidConfig(
                    f"DSparkHeadConfig: {name} must be >= 1, got {getattr(self, name)}"
                )
        if self.markov_variant not in MARKOV_VARIANTS:
            raise InvalidConfig(
                f"DSparkHeadConfig: markov_variant {self.markov_variant!r} is not one of "
                f"{list(MARKOV_VARIANTS)}"
            )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of the heads' tensors (module docstring)."""
        vocab, rank, hidden = self.vocab_size, self.markov_rank, self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "markov_head.prev_embed.weight": (vocab, rank),
            "markov_head.out_proj.weight": (vocab, rank),
            "confidence_head.weight": (1, hidden),
            "confidence_head.bias": (1,),
        }
        if self.markov_variant == "gated":
            shapes |= {"markov_head.gate.weight": (1, hidden), "markov_head.gate.bias": (1,)}
        return shapes


class MarkovHead(nn.Module):
    """``bias = B @ A[prev]``, times ``sigmoid(gate(h))`` when gated (module docstring)."""

    def __init__(self, config: DSparkHeadConfig) -> None:
        super().__init__()
        self.prev_embed = nn.Embedding(config.vocab_size, config.markov_rank)
        self.out_proj = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        self.gate = nn.Linear(config.hidden_size, 1) if config.markov_variant == "gated" else None

    def forward(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The logit bias ``[B, vocab]`` (float32) of positions whose previous tokens are
        ``prev_tokens`` ``[B]`` and hidden states ``hidden`` ``[B, hidden]``."""
        bias: torch.Tensor = self.out_proj(self.prev_embed(prev_tokens.long())).float()
        if self.gate is not None:
            bias = torch.sigmoid(self.gate(hidden).float()) * bias
        return bias


class ConfidenceHead(nn.Linear):
    """``c = sigmoid(w . h + w0)``: the predicted acceptance of each position (float32)."""

    def __init__(self, config: DSparkHeadConfig) -> None:
        super().__init__(config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[...]`` confidences of hidden states ``[..., hidden]``."""
        logits: torch.Tensor = super().forward(hidden)
        return torch.sigmoid(logits.float()).squeeze(-1)


class DSparkHeads(nn.Module):
    """Both heads (inference only), in ``dtype`` on ``device``.

    Raises:
        InvalidConfig: through `DSparkHeadConfig`.
    """

    def __init__(
        self,
        config: DSparkHeadConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device(device or "cpu"):
            self.markov_head = MarkovHead(config)
            self.confidence_head = ConfidenceHead(config)
        self.to(dtype=dtype)
        self.requires_grad_(False)

    def markov_bias(self, prev_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`MarkovHead` of one block position for every row (``[B]``, ``[B, hidden]``)."""
        with torch.no_grad():
            bias: torch.Tensor = self.markov_head(prev_tokens, hidden.to(self._dtype))
            return bias

    def confidences(self, hidden: torch.Tensor) -> torch.Tensor:
        """`ConfidenceHead` of every position: ``[B, K, hidden]`` -> ``[B, K]`` float32."""
        with torch.no_grad():
            out: torch.Tensor = self.confidence_head(hidden.to(self._dtype))
            return out

    @property
    def _dtype(self) -> torch.dtype:
        return self.confidence_head.weight.dtype
