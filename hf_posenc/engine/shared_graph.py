"""A tensor computed once per forward from a method's parameters and read by every layer (a rotary method's
rotation), made safe to differentiate once per layer.

Reentrant gradient checkpointing (torch.utils.checkpoint with use_reentrant=True) runs each layer's backward as a
backward of its own: one per layer, each reaching the shared tensor's graph. A plain graph is freed by the first
("Trying to backward through the graph a second time", issue 51). `shared_tensor` keeps that graph until the
forward's graph is dropped: each backward through it adds its part of the parameters' gradients, so one backward
(no checkpointing, non-reentrant) or one per layer (reentrant) give the same sums.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


class _KeptGraph(torch.autograd.Function):
    """The tensors compute() returns (a tuple), differentiable w.r.t. `parameters` any number of times: the graph
    from the parameters to them is kept on the node (retain_graph) and freed with it."""

    @staticmethod
    def forward(ctx, compute: Callable[[], tuple], *parameters: torch.Tensor):
        with torch.enable_grad():
            ctx.outputs = compute()
        ctx.parameters = parameters
        return tuple(output.detach() for output in ctx.outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        pairs = [(output, grad) for output, grad in zip(ctx.outputs, grads) if output.requires_grad]
        if not pairs:
            return (None, *(None for _ in ctx.parameters))
        outputs, grads = zip(*pairs)
        found = torch.autograd.grad(outputs, ctx.parameters, grads, retain_graph=True, allow_unused=True)
        return (None, *found)


def shared_tensor(method: nn.Module, compute: Callable[[], Any]):
    """compute() (a tensor or a tuple of tensors), to be read by every layer of a forward: through _KeptGraph where
    it depends on trainable parameters of `method` under grad mode, else as computed."""
    parameters = tuple(p for p in method.parameters() if p.requires_grad)
    if not parameters or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return compute()
    single = []

    def as_tuple():
        outputs = compute()
        single.append(isinstance(outputs, torch.Tensor))
        return (outputs,) if single[0] else tuple(outputs)

    outputs = _KeptGraph.apply(as_tuple, *parameters)
    return outputs[0] if single[0] else outputs
