"""A model family says where position enters its models and how the native mechanism is removed.

The shared parts live here: reading the positions of each forward (a pre-hook on the base model), adding
absolute embeddings there, and routing attention through the shared bias path. A family subclass names its
modules and overrides what its architecture does differently.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from ..engine.attention import ATTENTION_NAME, register_attention
from ..methods.base import AttentionBiasMethod, PositionalMethod, RotaryMethod, rotate
from ..engine.replay import PrefixReplay
from ..model_info import ModelInfo
from ..engine.state import (STATE_ATTR, PositionCapture, PositionState, RecordKeyPositions, forward_parameter_names,
                     positions_after_offset)
from ..engine.undo import UndoLog


class ModelFamily:
    name: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    native_method: ClassVar[str]

    # --- what each family must say about its models -------------------------------------------------
    def model_info(self, model: nn.Module) -> ModelInfo:
        raise NotImplementedError

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        raise NotImplementedError

    def remove_native(self, model: nn.Module, state: PositionState, log: UndoLog) -> None:
        """Take the family's own positional mechanism out."""
        raise NotImplementedError

    def add_rotary(self, model: nn.Module, method: RotaryMethod, state: PositionState, log: UndoLog) -> None:
        raise NotImplementedError

    # --- shared behaviour ------------------------------------------------------------------------------
    def base_model(self, model: nn.Module) -> nn.Module:
        return model.base_model

    def default_positions(self, arguments: dict[str, Any], q: int, offset: int, device: torch.device):
        return positions_after_offset(arguments, q, offset, device)

    def keeps_native(self, method: PositionalMethod, info: ModelInfo) -> bool:
        """True when the method is exactly what the model already computes (nothing to remove or add)."""
        return method.is_native(info)

    def install(self, model: nn.Module, method: PositionalMethod, info: ModelInfo, log: UndoLog) -> PositionState:
        base = self.base_model(model)
        state = PositionState(method, backend=model.config._attn_implementation)
        log.set_attr(base, "posenc", method)  # registers the method's parameters under the base model
        parameter_names = forward_parameter_names(base)
        replay = None
        if isinstance(method, RotaryMethod) and method.length_dependent and method.exact_cache:
            replay = PrefixReplay(method, "position_ids" in parameter_names, model.config)
            log.add_forward_hook(base, replay.cut_outputs, with_kwargs=True)
        log.add_forward_pre_hook(base, PositionCapture(state, parameter_names, self.default_positions, replay),
                                 with_kwargs=True)
        log.add_forward_hook(base, RecordKeyPositions(state), with_kwargs=True)
        if self.keeps_native(method, info):
            return state
        self.remove_native(model, state, log)
        rotates_in_attention = isinstance(method, RotaryMethod) and method.rotates_in_attention
        if isinstance(method, AttentionBiasMethod) or rotates_in_attention:
            self.route_attention(model, state, log)
        elif isinstance(method, RotaryMethod):
            self.add_rotary(model, method, state, log)
        return state

    def route_attention(self, model: nn.Module, state: PositionState, log: UndoLog) -> None:
        """Send attention through the shared path (for families that use transformers' AttentionInterface)."""
        register_attention()
        for attention in self.attention_modules(model):
            log.set_attr(attention, STATE_ATTR, state)
        config = model.config
        # Recorded through set_attr so that undo puts back the exact value, whatever set_attn_implementation does.
        log.set_attr(config, "_attn_implementation_internal", config._attn_implementation_internal)
        model.set_attn_implementation(ATTENTION_NAME)


class RotateProjectionOutput:
    """Forward hook on a fused qkv projection: rotates its query and key parts with the positions of the
    current forward, so the KV cache holds rotated keys exactly as a native RoPE model's does.

    A family subclasses it with `rotate_qk(output, fn)`, its knowledge of the fused layout: apply fn to the query
    and key parts, each viewed as [B, q, heads, head_dim], and return the new fused output."""

    def __init__(self, state: PositionState, heads: int, head_dim: int):
        self.state = state
        self.heads = heads
        self.head_dim = head_dim

    def rotate_qk(self, fused: torch.Tensor, rotate_part) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        cos, sin = self.state.call.cos_sin
        cos, sin = cos[:, :, None].to(output.dtype), sin[:, :, None].to(output.dtype)
        return self.rotate_qk(output, lambda x: rotate(x, cos, sin))
