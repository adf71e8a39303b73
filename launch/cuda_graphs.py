"""``trainer.cuda_graphs``: one CUDA graph per TransformerLayer, and the static step around it.

Per layer, ``tp_fuse.make_graphed_callables`` captures the forward and the backward of
every ``model.layers[i]`` (one call for all layers: they form one FP8 step, whose delayed
amax reduction and scale update run after each backward pass, outside the graphs). The
embedding, the output layer and the loss stay eager; they have no host read
(``torch._assert_async`` range checks), and under the launcher's ``fp8_autocast`` their
forward bookkeeping is the eager one.

What the graphs need from the loop, and where it is done:

* **static inputs**: torch's graphed forward copies each call's input into the
  captured input buffer (one device copy); the micro-batch's tokens reach the device
  from pinned staging with ``non_blocking=True`` (``launch/data.py``);
* **static gradient buffers** (:func:`make_grads_static`): every parameter's ``.grad``
  is allocated once, zeroed in place by ``zero_grad(set_to_none=False)``, so
  ``AccumulateGrad`` adds each micro-batch's graph output into the same buffer and never
  keeps a graph output as ``.grad`` (``tests/test_launch_cuda_graphs.py``);
* **a capturable optimizer** (``optim.capturable``): AdamW's step counts on the GPU.

Validation (``no_grad``, ``eval``) runs the layers eagerly: torch's graphed forward
replays only in training mode with grad enabled. Refused combinations are checked at the
config check (``launch/config.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import tp_fuse
from tp_fuse.recipe import Recipe

__all__ = ["graph_layers", "make_grads_static"]


def make_grads_static(params: list[torch.nn.Parameter]) -> None:
    """Allocate every parameter's ``.grad`` now (zeros), to be kept for the whole run:
    the loop then zeroes it in place (``zero_grad(set_to_none=False)``)."""
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)


def graph_layers(model: torch.nn.Module, *, seq_len: int, micro_batch_size: int, dtype: torch.dtype,
                 device: torch.device, recipe: Optional[Recipe], fp8_group: Any) -> None:
    """Replace each ``model.layers[i]``'s forward with its graphed replay (in place).

    The sample input is a layer's activation ``[seq_len, micro_batch_size, hidden]``
    (``requires_grad``: the graphs produce the input gradient the layer below needs).
    """
    layers = tuple(model.layers)
    hidden = model.config.hidden_size
    sample = tuple((torch.randn(seq_len, micro_batch_size, hidden, dtype=dtype, device=device,
                                requires_grad=True),) for _ in layers)
    tp_fuse.make_graphed_callables(layers, sample, fp8_enabled=recipe is not None, fp8_recipe=recipe,
                                   fp8_group=fp8_group)
