"""BLOOM: `BloomModel.forward` builds an ALiBi tensor [B*H, 1, kv] and passes it to every block as the
`alibi` keyword; `BloomAttention` adds it to the scores in its own eager code (it does not use
transformers' AttentionInterface).

- Removing position: a forward pre-hook on each block replaces that keyword with zeros.
- Bias methods (and rotary methods that rotate inside attention): each attention module gets a per-instance
  forward that runs BLOOM's own projections and cache update, then the shared attention path.
- RoPE: a hook rotates the q and k parts of the fused `query_key_value` output before the cache update."""

from __future__ import annotations

import types

import torch
from torch import nn
from transformers.models.bloom.modeling_bloom import dropout_add

from ..engine.attention import posenc_attention
from ..engine.attention.geometry import additive_mask_allowed
from ..model_info import ModelInfo
from ..registry import register_family
from ..engine.state import STATE_ATTR
from .base import ModelFamily, RotateProjectionOutput, rotate_projection


def zero_alibi(module: nn.Module, args: tuple, kwargs: dict):
    """Block forward pre-hook: BLOOM's ALiBi tensor becomes zeros."""
    kwargs["alibi"] = torch.zeros_like(kwargs["alibi"])
    return args, kwargs


def sdpa_form_mask(state, mask: torch.Tensor | None, q: int, kv: int) -> torch.Tensor | None:
    """BLOOM's eager mask (additive [B, 1, q, kv]: 0 where a key is attended, the dtype's minimum elsewhere) in the
    form transformers hands LLaMA's sdpa attention: bool, or None where it holds causality only (no padding). The
    paths then treat a BLOOM call as a LLaMA one, to the bit (a float mask reaches SDPA as an additive one, 1e-7
    off the boolean). A caller's mask that adds anything else is kept; under torch.compile too (no host reads)."""
    if mask is None or not mask.is_floating_point() or state.forward.traced:
        return mask

    def read():
        allowed = additive_mask_allowed(mask)
        if allowed is None:
            return mask
        causal = torch.ones(q, kv, dtype=torch.bool, device=mask.device).tril(kv - q)
        return None if bool((allowed == causal).all()) else allowed
    return state.once_per_forward(("bloom sdpa mask", mask.data_ptr(), tuple(mask.shape)), read)


def attention_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                      output_attentions=False, **kwargs):
    """BloomAttention.forward with the score computation replaced by the shared attention path (bound to one
    module instance by `route_attention`; the class is untouched). BLOOM's config always says "eager" (transformers
    has no other implementation for it), so the path is told whether the weights are wanted: without them it takes
    the same kernels as LLaMA under sdpa (SDPA, flash, flex, Triton, the fused CPU kernels) instead of a
    materialised softmax per block."""
    batch, q = hidden_states.shape[:2]
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    dropout = self.attention_dropout.p if self.training else 0.0
    if not output_attentions:
        attention_mask = sdpa_form_mask(getattr(self, STATE_ATTR), attention_mask, q, key.shape[2])
    output, weights = posenc_attention(self, query, key, value, attention_mask, scaling=self.inv_norm_factor,
                                       dropout=dropout, eager=bool(output_attentions))
    output = self.dense(output.reshape(batch, q, -1))
    return dropout_add(output, residual, self.hidden_dropout, self.training), weights


@register_family
class BloomFamily(ModelFamily):
    name = "bloom"
    model_types = ("bloom",)
    native_method = "alibi"
    attention_projections = ("query_key_value", "dense")  # fused query-key-value, output
    mlp_residual_argument = 1  # BloomBlock calls self.mlp(layernorm_output, residual); BloomMLP adds it (dropout_add)

    def model_info(self, model):
        config = model.config
        return ModelInfo(
            model_type=config.model_type,
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=config.hidden_size // config.n_head,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_positions=getattr(config, "seq_length", None),
            rope_theta=None,
            native_method=self.native_method,
            token_embedding=self.base_model(model).word_embeddings.weight,
        )

    def attention_modules(self, model):
        return [block.self_attention for block in self.base_model(model).h]

    def mlp_modules(self, model):
        return [block.mlp for block in self.base_model(model).h]

    def default_positions(self, arguments, q, offset, device):
        # BLOOM has no position_ids; like its own ALiBi, count real tokens in the 2-D padding mask.
        mask = arguments.get("attention_mask")
        if mask is None or mask.dim() != 2:
            return super().default_positions(arguments, q, offset, device)
        positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
        if isinstance(offset, torch.Tensor):  # under torch.compile (a StaticCache's length): the mask ends with the queries
            return positions[:, -q:].to(device)
        return positions[:, offset:offset + q].to(device)

    def remove_native(self, model, state, log, layers=None):
        blocks = self.base_model(model).h
        for block in blocks if layers is None else [blocks[index] for index in layers]:
            log.add_forward_pre_hook(block, zero_alibi, with_kwargs=True)

    def route_attention(self, model, state, log, layers=None):
        for attention in self.layer_attention_modules(model, layers):
            log.set_attr(attention, STATE_ATTR, state)
            log.set_attr(attention, "forward", types.MethodType(attention_forward, attention))

    def add_rotary(self, model, method, state, log, layers=None):
        rotate = RotateBloomQueryKey(state, model.config.n_head, model.config.hidden_size // model.config.n_head)
        for attention in self.layer_attention_modules(model, layers):
            rotate_projection(rotate, attention, "query_key_value", log)


class RotateBloomQueryKey(RotateProjectionOutput):
    """`query_key_value` returns [B, q, heads, 3, head_dim] flattened: per head its query, key and value."""

    def rotate_qk(self, fused, rotate_part):
        parts = fused.reshape(*fused.shape[:-1], self.heads, 3, self.head_dim)
        parts = torch.stack((rotate_part(parts[..., 0, :]), rotate_part(parts[..., 1, :]), parts[..., 2, :]), dim=-2)
        return parts.flatten(-3)
