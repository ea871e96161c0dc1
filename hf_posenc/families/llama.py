"""LLaMA-style models (llama, mistral, qwen2, qwen3): the base model's `rotary_emb` returns cos/sin for
the forward's position_ids and every attention layer rotates q and k with them before the cache update;
attention goes through transformers' AttentionInterface."""

from __future__ import annotations

import torch
from torch import nn

from ..engine.state import PositionState
from ..model_info import ModelInfo
from ..registry import register_family
from .base import ModelFamily


class NoRotation(nn.Module):
    """Stands in for `rotary_emb`: cos = 1, sin = 0, so the layers' rotation is an exact identity."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        shape = (*position_ids.shape, self.head_dim)
        return x.new_ones(shape), x.new_zeros(shape)

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim = head_dim


class MethodRotation(nn.Module):
    """Stands in for `rotary_emb` with a rotary method's cos/sin of this forward (computed once by the position
    state from the forward's positions, which may be 2-D coordinates), cast to the activations' dtype as native."""

    def __init__(self, state: PositionState):
        super().__init__()
        self.state = state

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = self.state.forward.rotation
        return cos.to(x.dtype), sin.to(x.dtype)


class LayerRotation:
    """Forward pre-hook (with kwargs) on one decoder layer of a hybrid: replaces the layer's `position_embeddings`
    (the model's cos/sin) with the identity (cos 1, sin 0) or with a rotary method's rotation of this forward."""

    def __init__(self, state: PositionState | None):
        self.state = state  # None: the identity

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        cos, sin = kwargs["position_embeddings"]
        if self.state is None:
            kwargs["position_embeddings"] = (torch.ones_like(cos), torch.zeros_like(sin))
        else:
            new_cos, new_sin = self.state.forward.rotation
            kwargs["position_embeddings"] = (new_cos.to(cos.dtype), new_sin.to(sin.dtype))
        return args, kwargs


@register_family
class LlamaFamily(ModelFamily):
    name = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    native_method = "rope"
    attention_projections = ("q_proj", "k_proj", "v_proj", "o_proj")

    def model_info(self, model):
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = getattr(config, "rope_parameters", None) or {}
        return ModelInfo(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_positions=getattr(config, "max_position_embeddings", None),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            native_method=self.native_method,
            token_embedding=self.base_model(model).get_input_embeddings().weight,
            rope_parameters=dict(rope),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
        )

    def attention_modules(self, model):
        return [layer.self_attn for layer in self.base_model(model).layers]

    def mlp_modules(self, model):
        return [layer.mlp for layer in self.base_model(model).layers]

    def remove_native(self, model, state, log, layers=None):
        if layers is None:
            log.set_attr(self.base_model(model), "rotary_emb", NoRotation(self.model_info(model).head_dim))
            return
        for index in layers:
            log.add_forward_pre_hook(self.base_model(model).layers[index], LayerRotation(None), with_kwargs=True)

    def after_install(self, model, method, info, log):
        update = None if self.patch_is_identity(method, info) else method.native_config_update()
        for name, value in (update or {}).items():
            # So that save_pretrained writes a config.json plain transformers loads to the same logits.
            if name == "rope_parameters":
                value = {**{k: v for k, v in (info.rope_parameters or {}).items()
                            if k == "partial_rotary_factor"}, **value}
            log.set_attr(model.config, name, value)

    def is_native(self, model, method):
        """Also true for a rotary method whose native settings (RoPE scalings, a RoPE theta) the patch wrote into
        the config, which transformers then computes itself."""
        if super().is_native(model, method):
            return True
        update = method.native_config_update()
        if method.state_dict() or not update:
            return False
        for name, value in update.items():
            current = getattr(model.config, name, None)
            if isinstance(value, dict):
                if not isinstance(current, dict) or any(current.get(k) != v for k, v in value.items()):
                    return False
            elif current != value:
                return False
        return True

    def add_rotary(self, model, method, state, log, layers=None):
        # The layers already rotate with whatever rotary_emb returns: give them this method's cos/sin.
        if layers is None:
            log.set_attr(self.base_model(model), "rotary_emb", MethodRotation(state))
            return
        for index in layers:
            log.add_forward_pre_hook(self.base_model(model).layers[index], LayerRotation(state), with_kwargs=True)
