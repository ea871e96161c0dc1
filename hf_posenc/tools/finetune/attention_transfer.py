"""Attention transfer, layer by layer (LoLCATs, Zhang et al. 2024, section 3.1), for ``hf-posenc finetune
--transfer-steps N``: each patched attention layer is trained to reproduce the original model's attention output on
the original's own input to that layer,

    loss_l = ||A'_l(x_l) - A_l(x_l)||^2 / ||A_l(x_l)||^2,    loss = mean over the changed layers of loss_l,

x_l the input the teacher's attention l received in one unpatched forward (its residual stream, normed), A_l the
teacher's attention and A'_l the patched one: what the attention adds to the residual stream, summed over the batch's
tokens and features. Every layer learns at once and independently (each sees the teacher's input, never the patched
layers below it), which turns one end-to-end credit-assignment problem into one local problem per layer.

The teacher's inputs and outputs come from one forward of the teacher (teacher.py: the same model with the patch
taken off where the base weights stay frozen, else a frozen copy or a loaded model) with hooks on the attention
modules. The student's forward is the patched model's own (its masks, positions and rotations) with a hook on each
attention module that swaps the layer's residual-stream inputs (the tensors of the hidden states' shape: the hidden
states, and BLOOM's `residual`, which its attention adds itself) for the teacher's. Those are detached, so gradients
reach the attention's parameters alone (and the patch's); the rest of the student's forward runs but trains nothing.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...errors import PosEncError

if TYPE_CHECKING:
    import torch
    from torch import nn


@dataclass
class LayerTargets:
    """What the teacher's attention layers saw and gave, per layer index: `inputs[l]` the residual-stream tensors
    of its call (by argument position or keyword), `outputs[l]` what it added to the residual stream [B, L, hidden]."""

    inputs: dict[int, dict[int | str, torch.Tensor]]
    outputs: dict[int, torch.Tensor]


def attention_modules(model) -> list[nn.Module]:
    """The attention module of every decoder layer of a transformers model (through PEFT / DDP wrappers)."""
    from hf_posenc.registry import get_family

    from .teacher import _inner_model

    inner = _inner_model(model)
    return get_family(inner.config).attention_modules(inner)


def changed_layers(model) -> list[int]:
    """The layers whose attention the patch changes: all of them, or a hybrid's non-native layers. Refuses an
    absolute method, whose embeddings enter below the first layer: the teacher's layer inputs never carry them."""
    from hf_posenc import get_posenc_config, get_positional_module
    from hf_posenc.methods.base import AbsolutePositionMethod

    from .teacher import _inner_model

    inner = _inner_model(model)
    config, method = get_posenc_config(inner), get_positional_module(inner)
    if config is None:
        raise PosEncError("attention transfer trains a patched model towards the original: this model has no "
                          "positional patch; give --method")
    if isinstance(method, AbsolutePositionMethod):
        raise PosEncError(f"attention transfer feeds each layer the original's input, which carries no trace of "
                          f"{config.method!r}'s embeddings (they enter below the first layer); use --distill-from "
                          "alone (--transfer-steps 0) for an absolute method")
    count = len(attention_modules(inner))
    if hasattr(config, "layer_methods"):  # a hybrid: its native layers are the original's
        return [index for index, name in enumerate(config.layer_methods(count)) if name != "native"]
    return list(range(count))


def _residual_stream(module, args: tuple, kwargs: dict) -> tuple[dict[int | str, torch.Tensor], torch.Tensor | None]:
    """The call's residual-stream tensors (those of the hidden states' shape), and the residual the module adds to
    its output itself (BLOOM's `residual`), or None."""
    import torch

    hidden = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(hidden, torch.Tensor):
        raise PosEncError(f"{type(module).__name__} was called without hidden states; attention transfer cannot "
                          "capture its input")
    stream: dict[int | str, torch.Tensor] = {}
    for key, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == hidden.shape:
            stream[key] = value
    try:
        residual = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments.get("residual")
    except TypeError:
        residual = None
    return stream, residual if isinstance(residual, torch.Tensor) else None


def _added(output, residual) -> torch.Tensor:
    """What an attention module's output adds to the residual stream."""
    out = output[0] if isinstance(output, tuple) else output
    return out if residual is None else out - residual


@contextlib.contextmanager
def _hooks(modules: list[nn.Module], pre, post):
    handles = []
    try:
        for index, module in enumerate(modules):
            handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, index=index: pre(index, m, args, kwargs), with_kwargs=True))
            handles.append(module.register_forward_hook(
                lambda m, args, kwargs, output, index=index: post(index, m, args, kwargs, output), with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def capture_targets(model, inputs: dict[str, Any], layers: list[int], modules: list[nn.Module] | None = None,
                    outputs: bool = True) -> LayerTargets:
    """One forward of `model` (the teacher: called as it is, without gradients) on `inputs`, keeping each of `layers`'
    attention input and what it added to the residual stream (`outputs=False`: the inputs alone, as the bias fit
    needs: an output per layer is 30 x 8192 x 576 floats, 0.57 GB, for SmolLM2 at 8192 tokens). `modules`: its
    attention modules (default: found)."""
    import torch

    modules = attention_modules(model) if modules is None else modules
    wanted = set(layers)
    targets = LayerTargets({}, {})

    def keep_input(index, module, args, kwargs):
        if index in wanted:
            targets.inputs[index] = {key: value.detach() for key, value in _residual_stream(module, args, kwargs)[0].items()}

    def keep_output(index, module, args, kwargs, output):
        if outputs and index in wanted:
            targets.outputs[index] = _added(output, _residual_stream(module, args, kwargs)[1]).detach()

    with torch.no_grad(), _hooks(modules, keep_input, keep_output):
        model(**inputs)
    return targets


def teacher_targets(teacher, student, inputs: dict[str, Any], layers: list[int]) -> LayerTargets:
    """`capture_targets` from a teacher.Teacher: its own model, or the student with the patch taken off."""
    from .teacher import unpatched

    if teacher.model is not None:
        return capture_targets(teacher.model, inputs, layers)
    with unpatched(student) as original:
        return capture_targets(original, inputs, layers)


@contextlib.contextmanager
def fed_teacher_inputs(modules: list[nn.Module], targets: LayerTargets, keep_output=None):
    """Inside the block, each attention module of `targets.inputs` is called with the teacher's residual-stream
    inputs in place of its own; `keep_output(index, module, args, kwargs, output)` sees every module's output."""

    def feed_teacher_input(index, module, args, kwargs):
        if index not in targets.inputs:
            return None
        swapped = targets.inputs[index]
        args = tuple(swapped.get(position, value) for position, value in enumerate(args))
        kwargs = {key: swapped.get(key, value) for key, value in kwargs.items()}
        return args, kwargs

    with _hooks(modules, feed_teacher_input, keep_output or (lambda *_: None)):
        yield


def layer_losses(student, inputs: dict[str, Any], targets: LayerTargets) -> torch.Tensor:
    """float32 [len(targets.outputs)], in layer order: each target layer's ||A'(x) - A(x)||^2 / ||A(x)||^2, the
    patched attention fed the teacher's input x of that layer (with gradients, through the patched attention only)."""
    import torch

    modules = attention_modules(student)
    layers = sorted(targets.outputs)
    produced: dict[int, torch.Tensor] = {}

    def keep_output(index, module, args, kwargs, output):
        if index in targets.outputs:
            produced[index] = _added(output, _residual_stream(module, args, kwargs)[1])

    with fed_teacher_inputs(modules, targets, keep_output):
        student(**inputs)
    missing = [index for index in layers if index not in produced]
    if missing:
        raise PosEncError(f"attention layers {missing} did not run in the student's forward; attention transfer "
                          "needs every target layer's output")
    losses = []
    for index in layers:
        target = targets.outputs[index].float()
        error = (produced[index].float() - target).pow(2).sum()
        losses.append(error / target.pow(2).sum().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.stack(losses)


def attention_transfer_loss(student, teacher, inputs: dict[str, Any], layers: list[int] | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the mean over `layers` of the per-layer relative MSE, the per-layer losses [len(layers)]): the teacher's
    targets captured first, then the patched `student` fed them. `layers`: default, the layers the patch changes."""
    layers = changed_layers(student) if layers is None else layers
    if not layers:
        raise PosEncError("attention transfer has no layer to train: the patch changes none")
    per_layer = layer_losses(student, inputs, teacher_targets(teacher, student, inputs, layers))
    return per_layer.mean(), per_layer
