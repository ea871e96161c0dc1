"""GPT-2: `GPT2Model.forward` adds `wpe(position_ids)` to the token embeddings; attention goes through
transformers' AttentionInterface (with `module.scaling` holding the layer-index scaling)."""

from __future__ import annotations

import torch
from torch import nn

from ..methods.base import AbsolutePositionMethod
from ..model_info import ModelInfo
from ..registry import register_family
from .base import ModelFamily, RotateProjectionOutput, rotate_projection


class TokenEmbeddingDtype:
    """The dtype of the base model's token embeddings, read at each call (the model may be cast after patching). A
    deep copy of a module holding it (PEFT's modules_to_save copies the method) refers to the same base model,
    unless the base model is copied with it."""

    def __init__(self, base: nn.Module):
        self.base = base

    def __call__(self) -> torch.dtype:
        return self.base.get_input_embeddings().weight.dtype

    def __deepcopy__(self, memo: dict) -> "TokenEmbeddingDtype":
        return TokenEmbeddingDtype(memo.get(id(self.base), self.base))


class NoPositionEmbedding(nn.Module):
    """Stands in for `wpe`: zeros at every position (zeroing wpe's weights would still fail past n_positions), in
    the token embeddings' dtype. No buffer: the model's buffers stay those of transformers' own GPT-2."""

    def __init__(self, hidden_size: int, dtype: TokenEmbeddingDtype):
        super().__init__()
        self.hidden_size = hidden_size
        self.dtype = dtype

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros((*position_ids.shape, self.hidden_size), dtype=self.dtype(), device=position_ids.device)


class EmbeddingDtype:
    """Forward hook on an absolute method standing in `wpe`: its output in the token embeddings' dtype (methods
    compute in float32; GPT2Model adds wpe's output to the token embeddings as it is)."""

    def __init__(self, base: nn.Module):
        self.dtype = TokenEmbeddingDtype(base)

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output.to(self.dtype())


@register_family
class GPT2Family(ModelFamily):
    name = "gpt2"
    model_types = ("gpt2",)
    native_method = "learned"
    native_per_layer = False
    attention_projections = ("c_attn", "c_proj")  # fused query-key-value, output

    def model_info(self, model):
        config = model.config
        base = self.base_model(model)
        return ModelInfo(
            model_type=config.model_type,
            num_layers=config.n_layer,
            num_heads=config.n_head,
            num_kv_heads=config.n_head,
            head_dim=config.n_embd // config.n_head,
            hidden_size=config.n_embd,
            vocab_size=config.vocab_size,
            max_positions=config.n_positions,
            rope_theta=None,
            native_method=self.native_method,
            token_embedding=base.wte.weight,
            native_position_table=base.wpe.weight if isinstance(base.wpe, nn.Embedding) else None,
        )

    def attention_modules(self, model):
        return [block.attn for block in self.base_model(model).h]

    def mlp_modules(self, model):
        return [block.mlp for block in self.base_model(model).h]

    def method_attribute(self, method):
        # An absolute method stands in `wpe` itself: GPT2Model adds wpe(position_ids) for any input shape (3-D
        # input_ids of GPT2DoubleHeadsModel included), and learned positions keep their name
        # `transformer.wpe.weight`, so a `learned` patch leaves the state dict as it was.
        return "wpe" if isinstance(method, AbsolutePositionMethod) else "posenc"

    def remove_native(self, model, state, log, layers=None):
        if layers is not None:  # a hybrid: wpe is added to the input, not in a layer, so it stays
            return
        base = self.base_model(model)
        if isinstance(state.method, AbsolutePositionMethod):  # install put the method in wpe's place
            log.add_forward_hook(state.method, EmbeddingDtype(base))
            return
        log.set_attr(base, "wpe", NoPositionEmbedding(model.config.n_embd, TokenEmbeddingDtype(base)))

    def add_rotary(self, model, method, state, log, layers=None):
        rotate = RotateGPT2QueryKey(state, model.config.n_head, model.config.n_embd // model.config.n_head)
        for attention in self.layer_attention_modules(model, layers):
            rotate_projection(rotate, attention, "c_attn", log)


class RotateGPT2QueryKey(RotateProjectionOutput):
    """`c_attn` returns [query | key | value], each [B, q, heads * head_dim]."""

    def rotate_qk(self, fused, rotate_part):
        query, key, value = fused.split(self.heads * self.head_dim, dim=-1)
        shape = (*query.shape[:-1], self.heads, self.head_dim)
        query = rotate_part(query.reshape(shape)).flatten(-2)
        key = rotate_part(key.reshape(shape)).flatten(-2)
        return torch.cat((query, key, value), dim=-1)
