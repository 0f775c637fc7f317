"""A tap on a target's decoder layers: the hidden states a drafter reads from its forwards.

`LayerTap` owns the outputs of some decoder layers of one `PagedLlama`, captured by forward
hooks on those layers while the model runs a forward the worker did not write (the target
runner's extend or verify), so a drafter gets several layers' hidden states without a second
forward path through the target. What `take` returns, per new token of the latest forward::

    cat([H_l for l in layer_ids], -1)       H_l = output of decoder layer l (the residual
                                            stream); the model's last layer after its final
                                            norm, as Hugging Face's hidden_states[l + 1]

Invariant: `take` returns the capture of exactly one forward, the latest one that ran every
tapped layer, and only once; the tap never changes what the model computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from specstate.core.errors import InvalidConfig
from specstate.reference.model import PagedLlama

__all__ = ["LayerTap"]


class LayerTap:
    """Captures the outputs of ``layer_ids`` of ``model`` at every forward (module docstring).

    Args:
        model: the target; its layers get a forward hook each (until `close`).
        layer_ids: the layers to capture, in the order `take` concatenates them.

    Raises:
        InvalidConfig: a layer id outside ``[0, num_hidden_layers)``.
    """

    def __init__(self, model: PagedLlama, layer_ids: tuple[int, ...]) -> None:
        num_layers = model.config.num_hidden_layers
        if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
            raise InvalidConfig(
                f"layer tap: layers {list(layer_ids)} outside the target's [0, {num_layers})"
            )
        self._model = model
        self._layer_ids = layer_ids
        self._last = num_layers - 1
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles: list[RemovableHandle] = [
            model.layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(layer_ids))
        ]

    def _hook(self, layer: int) -> Callable[[nn.Module, object, torch.Tensor], None]:
        def keep(module: nn.Module, inputs: object, output: torch.Tensor) -> None:
            del module, inputs  # the layer's output is all a drafter reads
            self._outputs[layer] = output

        return keep

    def take(self) -> torch.Tensor:
        """``[T, len(layer_ids) * hidden]`` of the latest forward; consumed.

        Raises:
            InvalidConfig: no forward ran every tapped layer since the last `take`.
        """
        outputs, self._outputs = self._outputs, {}
        missing = sorted(set(self._layer_ids) - set(outputs))
        if missing:
            raise InvalidConfig(
                f"layer tap: no target forward captured layers {missing} since the last take"
            )
        with torch.no_grad():
            parts = [
                self._model.norm(outputs[i]) if i == self._last else outputs[i]
                for i in self._layer_ids
            ]
            return torch.cat(parts, dim=-1)

    def close(self) -> None:
        """Remove the hooks; the tap captures nothing from now on."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._outputs = {}
