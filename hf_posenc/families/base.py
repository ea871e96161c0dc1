"""A model family is everything hf_posenc knows about one kind of architecture (dispatched on
`config.model_type`): where position enters its models and how the native mechanism is removed, its shape fields
and trained window (`model_info`, `trained_window`), the attention projections LoRA adapts
(`lora_target_modules`), and when plain transformers computes a patch itself (`is_native`).

The shared parts live here: routing attention through the shared path, and rotating a fused qkv projection's
output. A family subclass names its modules and overrides what its architecture does differently. Which of these a
method takes (by its kind), and the per-forward position capture, is engine/install.py's `install_method`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..engine.attention import RoutedAttentionConfig, register_attention
from ..engine.state import STATE_ATTR, PositionState, positions_after_offset
from ..engine.undo import UndoLog
from ..methods.base import PositionalMethod, RotaryMethod
from ..model_info import ModelInfo


class ModelFamily:
    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    native_method: ClassVar[str]  # the method that computes what the family's own mechanism does
    # False when the native mechanism is not in the layers (GPT-2's learned input embedding): a hybrid keeps it,
    # unless its parts run every layer (then it is the full patch's).
    native_per_layer: ClassVar[bool] = True
    # The projections inside each attention module (queries, keys, values, output): what LoRA adapts.
    attention_projections: ClassVar[tuple[str, ...]]
    # Where each layer's MLP takes the residual as an argument and adds it itself (BLOOM): that argument's index.
    mlp_residual_argument: ClassVar[int | None] = None

    # --- what each family must say about its models -------------------------------------------------
    def model_info(self, model: nn.Module) -> ModelInfo:
        """The model's shape, read from the family's config fields (n_embd or hidden_size, n_layer or
        num_hidden_layers, ...), its window and RoPE settings: what methods are built from."""
        raise NotImplementedError

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """The attention module of every layer, in order."""
        raise NotImplementedError

    def mlp_modules(self, model: nn.Module) -> list[nn.Module]:
        """The MLP of every layer, in order (its output is what the layer adds to the residual stream after its
        attention, but where `mlp_residual_argument` says the MLP adds the residual itself)."""
        raise NotImplementedError

    def remove_native(self, model: nn.Module, state: PositionState, log: UndoLog, layers: list[int] | None = None
                      ) -> None:
        """Take the family's own positional mechanism out (of the given layers only, for a hybrid; None: all)."""
        raise NotImplementedError

    def add_rotary(self, model: nn.Module, method: RotaryMethod, state: PositionState, log: UndoLog,
                   layers: list[int] | None = None) -> None:
        raise NotImplementedError

    # --- shared behaviour ------------------------------------------------------------------------------
    def base_model(self, model: nn.Module) -> nn.Module:
        return model.base_model

    def default_positions(self, arguments: dict[str, Any], q: int, offset: int, device: torch.device):
        return positions_after_offset(arguments, q, offset, device)

    def patch_is_identity(self, method: PositionalMethod, info: ModelInfo) -> bool:
        """True when the method is exactly what the model already computes (the patch removes and adds nothing)."""
        return method.is_native(info)

    def trained_window(self, model: nn.Module) -> int | None:
        """The context the model's weights were trained at, as its config states it: the window before any RoPE
        scaling (original_max_position_embeddings), else max_position_embeddings / n_positions; None when the
        config states none (BLOOM)."""
        return self.model_info(model).original_window

    def lora_target_modules(self, model: nn.Module) -> list[str]:
        """Full names (as in model.named_modules()) of the attention projections of every layer, for LoRA's
        target_modules."""
        names = {id(module): name for name, module in model.named_modules()}
        return [f"{names[id(attention)]}.{projection}" for attention in self.attention_modules(model)
                for projection in self.attention_projections]

    def is_native(self, model: nn.Module, method: PositionalMethod) -> bool:
        """True when plain transformers, reading this model's config as the patch left it, computes exactly what
        `method` computes on it (so a saved checkpoint needs no hf_posenc): the method keeps the model's own
        mechanism and has no state of its own."""
        return not method.state_dict() and self.patch_is_identity(method, self.model_info(model))

    def after_install(self, model: nn.Module, method: PositionalMethod, info: ModelInfo, log: UndoLog) -> None:
        """What the family changes once the method is installed (engine/install.py `install_method`): by default
        nothing."""

    def layer_attention_modules(self, model: nn.Module, layers: list[int] | None) -> list[nn.Module]:
        modules = self.attention_modules(model)
        return modules if layers is None else [modules[index] for index in layers]

    def method_attribute(self, method: PositionalMethod) -> str:
        """The attribute of the base model the method module is installed as (its parameters are named
        `<base model>.<attribute>.*`). Absolute methods installed as "posenc" are added to the input embeddings by
        the position capture; a family that names its own position-embedding module here calls the method there."""
        return "posenc"

    def route_attention(self, model: nn.Module, state: PositionState, log: UndoLog,
                        layers: list[int] | None = None) -> None:
        """Send attention through the shared path (for families that use transformers' AttentionInterface): each
        self-attention module looks its implementation up in a view of the model's config that names the shared
        path (RoutedAttentionConfig); the model's config keeps the user's implementation as its backend."""
        register_attention()
        for attention in self.layer_attention_modules(model, layers):
            log.set_attr(attention, STATE_ATTR, state)
            log.set_attr(attention, "config", RoutedAttentionConfig(model.config))


class RotateProjectionOutput:
    """How a family rotates the output of a fused qkv projection: its query and key parts with the positions of the
    current forward, so the KV cache holds rotated keys exactly as a native RoPE model's does.

    A family subclasses it with `rotate_qk(output, fn)`, its knowledge of the fused layout: apply fn to the query
    and key parts, each viewed as [B, q, heads, head_dim], and return the new fused output."""

    def __init__(self, state: PositionState, heads: int, head_dim: int):
        self.state = state
        self.heads = heads
        self.head_dim = head_dim

    def rotate_qk(self, fused: torch.Tensor, rotate_part) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, fused: torch.Tensor) -> torch.Tensor:
        method, rotation = self.state.method, self.state.forward.rotation
        return self.rotate_qk(fused, lambda x: method.rotate_heads(x.transpose(1, 2), rotation).transpose(1, 2))


def rotate_projection(rotate: RotateProjectionOutput, attention: nn.Module, slot: str, log: UndoLog) -> None:
    """Rotate the output of `attention.<slot>` (its fused qkv projection) with `rotate`, whatever module holds that
    place when attention runs: see RotatedProjection."""
    rotated = RotatedProjection(rotate, attention, slot, log)
    log.add_forward_hook(attention._modules[slot], rotated)
    log.add_forward_pre_hook(attention, FollowProjection(rotated))


class RotatedProjection:
    """Forward hook on the module in one attention module's projection place (`attention.<slot>`): rotates its output.

    PEFT's LoRA puts a wrapper in that place after a patch: the projection becomes the wrapper's base_layer, and the
    wrapper adds its own update to the base layer's output. The rotation must take the sum (else LoRA's query and
    key updates stay unrotated and merge_and_unload moves the logits), so the hook acts only on the module now in
    the place; FollowProjection adds it to a module newly put there."""

    def __init__(self, rotate: RotateProjectionOutput, attention: nn.Module, slot: str, log: UndoLog):
        self.rotate = rotate
        self.attention = attention
        self.slot = slot
        self.log = log  # hooks added later go into the patch's undo log: unpatch_model removes them too
        self.hooked = [attention._modules[slot]]

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if self.attention._modules.get(self.slot) is not module:
            return None  # a wrapper's base layer: the wrapper's own hook rotates the whole projection
        return self.rotate(output)


class FollowProjection:
    """Forward pre-hook on an attention module: gives the module now in its projection's place (a PEFT wrapper put
    there after the patch) the RotatedProjection hook, once."""

    def __init__(self, rotated: RotatedProjection):
        self.rotated = rotated

    def __call__(self, attention: nn.Module, args: tuple) -> None:
        rotated = self.rotated
        current = attention._modules.get(rotated.slot)
        if current is rotated.hooked[-1] or current is None:
            return
        if not any(current is module for module in rotated.hooked):
            rotated.log.add_forward_hook(current, rotated)
        rotated.hooked.append(current)
