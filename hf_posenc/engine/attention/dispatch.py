"""The entry of every patched attention call: `posenc_attention`, registered in transformers' AttentionInterface
(families/bloom.py calls it directly), routes a call to the content, near/far or bias path.

Nothing here is process-wide: a call reads its model's PositionState. The path is the current thread's or task's
choice (`attention_path(...)`, a ContextVar), else the model's own (`set_attention_path(path, model)`), else "auto";
each call is counted on its model (`path_counts(model)`) and in the thread's `last_paths` (paths.py)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...methods.base import ContentMethod, RotaryMethod
from ..state import STATE_ATTR, PositionState
from .bias_path import bias_attention
from .call import AttentionCall
from .content_path import content_attention
from .near_far import scored_attention

ATTENTION_NAME = "hf_posenc"


def register_attention() -> None:
    """Register `posenc_attention` under ATTENTION_NAME in transformers' AttentionInterface, with the sdpa mask
    function under the same name in AttentionMaskInterface (so padding masks still arrive); again is the same."""
    AttentionInterface.register(ATTENTION_NAME, posenc_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class RoutedAttentionConfig:
    """What a routed attention module holds as its `config`: the model's config in every respect but the attention
    implementation, which names this path. The model's own config keeps the implementation the user chose
    ("sdpa" or "eager"), so transformers builds that implementation's masks, `model.set_attn_implementation(...)`
    and `config.output_attentions` behave as on an unpatched model, and this path computes the method's attention
    with the backend the model's config names at each call (the bias is never dropped). Modules that are not
    routed (GPT-2's cross-attention) keep the model's config: no positions there."""

    def __init__(self, model_config):
        object.__setattr__(self, "model_config", model_config)

    @property
    def _attn_implementation(self) -> str:
        return ATTENTION_NAME

    def __getattr__(self, name: str):
        if name == "model_config" or name.startswith("__"):  # not yet set (copy, pickle) or a protocol lookup
            raise AttributeError(name)
        return getattr(self.model_config, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.model_config, name, value)


def posenc_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     eager: bool | None = None, **kwargs):
    """AttentionInterface function: query [B, H, q, D], key/value [B, H_kv, kv, D] (the whole cache).
    Returns (output [B, q, H, D], attention weights or None). `eager`: whether the weights are returned (None: as
    the model's config says; BLOOM's attention, always "eager" in its config, passes its caller's
    output_attentions). All per-model state is read from `module`, so any
    number of models, patched with different methods, use it at once."""
    state: PositionState | None = getattr(module, STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attention implementation {ATTENTION_NAME!r} but was not patched by "
            "hf_posenc; call hf_posenc.patch_model(model, ...) on this model instead of setting it by hand."
        )
    call = AttentionCall.build(module, state, query, key, value, attention_mask, scaling, dropout, eager, **kwargs)
    if isinstance(call.method, ContentMethod):
        return content_attention(call.replace(scaling=call.method.softmax_scaling(call.scaling)))
    if isinstance(call.method, RotaryMethod) and call.method.scores_per_query_block:
        return scored_attention(call)
    return bias_attention(call)
