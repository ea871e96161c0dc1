"""Sharded engines and a patched model: which modules to hand to FSDP2 (torch's ``fully_shard``), and a ZeRO-3
parameter read whole.

    from torch.distributed.fsdp import fully_shard
    for unit in fsdp_wrap_units(model):   # each decoder layer, then the root
        fully_shard(unit, mesh=mesh)

The patch's positional module (KERPLE's biases, FoX's gates, FIRE's MLP, ...) sits on the base model, outside every
decoder layer, and every layer calls into it; so it is no unit of its own but part of the root's, whose parameters
FSDP2 gathers before the forward and keeps gathered until the backward (the root does not reshard after forward), and
whose gradients it reduce-scatters after the last layer's backward. A unit of its own would gather its parameters only
when its ``forward`` runs, and the layers call its other methods."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


def fsdp_wrap_units(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (patched or not, PEFT-wrapped or not) to ``fully_shard`` in this order: each decoder
    layer (the classes transformers keeps whole, ``_no_split_modules``, as accelerate's TRANSFORMER_BASED_WRAP
    does), then `model` itself, whose unit holds the rest: embeddings, final norm, head and the positional module."""
    from hf_posenc import PosEncError

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    kept_whole = set(getattr(base, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in kept_whole]
    if not layers:
        raise PosEncError(f"fsdp_wrap_units: {type(base).__name__} names no decoder layer class in "
                          "_no_split_modules; call fully_shard on each of its layers by hand, then on the model")
    return [*layers, model]


def whole_parameter(parameter: torch.nn.Parameter):
    """A context in which `parameter` holds all its values: under DeepSpeed ZeRO-3 each process keeps only its part
    (``ds_tensor``; the parameter itself is empty), so it is gathered for the context, a collective that every
    process enters; any other parameter as it is."""
    if not hasattr(parameter, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters([parameter])
