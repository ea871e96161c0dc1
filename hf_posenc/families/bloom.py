"""BLOOM: `BloomModel.forward` builds an ALiBi tensor [B*H, 1, kv] and passes it to every block as the
`alibi` keyword; `BloomAttention` adds it to the scores in its own eager code (it does not use
transformers' AttentionInterface). A forward pre-hook on each block rewrites that keyword: zeros to remove
position, or the method's [B*H, q, kv] bias. RoPE rotates the q and k parts of the fused qkv projection."""

from __future__ import annotations

import torch
from torch import nn

from ..model_info import ModelInfo
from ..registry import register_family
from ..state import PositionState
from .base import ModelFamily, RotateProjectionOutput


class ReplaceAlibi:
    """Block forward pre-hook: swaps BLOOM's `alibi` keyword for zeros or for the method's bias."""

    def __init__(self, state: PositionState, layer_idx: int, num_heads: int):
        self.state = state
        self.layer_idx = layer_idx
        self.num_heads = num_heads

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        alibi = kwargs["alibi"]
        if self.state.method.kind != "bias":
            kwargs["alibi"] = torch.zeros_like(alibi)
            return args, kwargs
        hidden_states = args[0] if args else kwargs["hidden_states"]
        batch, q = hidden_states.shape[:2]
        kv = alibi.shape[-1]
        query_slots, key_slots, query_positions, key_positions = self.state.relative_positions(q, kv, alibi.device)
        # BLOOM adds its own causal/padding mask afterwards, so only the bias itself goes in here.
        bias = self.state.method.bias(self.layer_idx, query_positions, key_positions)
        bias = bias.expand(batch, self.num_heads, q, kv).clamp_min(torch.finfo(alibi.dtype).min)
        kwargs["alibi"] = bias.reshape(batch * self.num_heads, q, kv).to(alibi.dtype)
        return args, kwargs


@register_family
class BloomFamily(ModelFamily):
    name = "bloom"
    model_types = ("bloom",)
    native_method = "alibi"

    def model_info(self, model):
        config = model.config
        return ModelInfo(
            model_type=config.model_type,
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=config.hidden_size // config.n_head,
            hidden_size=config.hidden_size,
            max_positions=getattr(config, "seq_length", None),
            rope_theta=None,
            native_method=self.native_method,
            token_embedding=self.base_model(model).word_embeddings.weight,
        )

    def attention_modules(self, model):
        return [block.self_attention for block in self.base_model(model).h]

    def default_positions(self, arguments, q, offset, device):
        # BLOOM has no position_ids; like its own ALiBi, count real tokens in the 2-D padding mask.
        mask = arguments.get("attention_mask")
        if mask is None or mask.dim() != 2:
            return super().default_positions(arguments, q, offset, device)
        return (mask.long().cumsum(-1) - 1).clamp_min(0)[:, offset:offset + q].to(device)

    def remove_native(self, model, state, log):
        for layer_idx, block in enumerate(self.base_model(model).h):
            hook = ReplaceAlibi(state, layer_idx, model.config.n_head)
            log.add_hook(block.register_forward_pre_hook(hook, with_kwargs=True))

    def route_bias(self, model, state, log):
        pass  # ReplaceAlibi, installed by remove_native, already writes the bias into BLOOM's own path

    def add_rotary(self, model, method, state, log):
        heads = model.config.n_head
        head_dim = model.config.hidden_size // heads

        def rotate_qk(fused: torch.Tensor, rotate) -> torch.Tensor:
            parts = fused.reshape(*fused.shape[:-1], heads, 3, head_dim)
            parts = torch.stack((rotate(parts[..., 0, :]), rotate(parts[..., 1, :]), parts[..., 2, :]), dim=-2)
            return parts.flatten(-3)

        hook = RotateProjectionOutput(state, rotate_qk)
        for attention in self.attention_modules(model):
            log.add_hook(attention.query_key_value.register_forward_hook(hook))
