"""DroPE (Gelberg, Eguchi, Akiba, Cetin, ICLR 2026, "Extending the Context of Pretrained LLMs by Dropping Their
Positional Embeddings"): RoPE is dropped from a pretrained model, which is then recalibrated. Their `qk_norm_nope`
variant (SakanaAI/DroPE custom_models/attention.py `qk_norm`, `llama_qk_norm_nope_attn_forward`) normalises the
queries and keys without positions, to keep attention sharp:

    q' = RMSNorm(q_proj x),  k' = RMSNorm(k_proj x),   logits_ij = softmax_scale * q'_i . k'_j,

each RMSNorm over the whole projection (all heads together: nn.RMSNorm(num_heads * head_dim), and
nn.RMSNorm(num_kv_heads * head_dim) for the keys) with a learned weight starting at 1 and eps the model's
rms_norm_eps (1e-5 for the SmolLM and Llama-2 models they recalibrate), one pair of norms per layer. `softmax_scale`
replaces the module's `scaling` where the config has one (their `from_source`); none of their configs sets it, so the
default is the model's own 1 / sqrt(head_dim).

`qk_norm=False` with `softmax_scale=None` is NoPE exactly (their plain `nope` variant; on BLOOM within float
rounding, since its NoPE keeps BLOOM's eager code and this runs SDPA); with `qk_norm=True` the
model changes at once (the norms are not identities), which the recalibration is for. The KV cache holds the keys
before the norm, normalised again at each call (per token, so cached decoding equals a full forward).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model_info import ModelInfo
from ..registry import register_method
from .base import DotProductForm
from .content import ContentAttention, ContentConfig

# The rms_norm_eps of the models the authors recalibrate (their norms take it from the model's config).
AUTHORS_NORM_EPS = 1e-5


@dataclass
class DropeConfig(ContentConfig):
    qk_norm: bool = True  # the authors' qk_norm_nope: RMSNorm of queries and keys across heads (False: plain NoPE)
    softmax_scale: float | None = None  # None: the model's own scaling (1 / sqrt(head_dim)), as the authors' default
    norm_eps: float = AUTHORS_NORM_EPS

    def validate(self) -> None:
        super().validate()
        if self.base != "none":
            self.refuse("base", "keeps the model's positions, which DroPE drops", "'none'",
                        "to add a mechanism on top of the model's own use fox, cope or transformer-xl with "
                        "base='native'")
        self.require_bool("qk_norm")
        self.require_number("softmax_scale", 1e-4, 1e4, none_means="the model's own scaling",
                            why="it multiplies every q . k")
        self.require_number("norm_eps", 0.0, 1.0)


def norm_across_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [B, heads, n, D] -> RMSNorm of each token's heads * D values together (nn.RMSNorm over the flat
    projection), times `weight` [heads * D], in float32, returned in x's dtype."""
    batch, heads, n, dim = x.shape
    x32 = x.float()
    scale = torch.rsqrt(x32.pow(2).mean(dim=(1, 3), keepdim=True) + eps)
    return (x32 * scale * weight.float().view(1, heads, 1, dim)).to(x.dtype)


@register_method("drope", DropeConfig)
class DroppedPositions(DotProductForm, ContentAttention):
    scores_maskable_in_place = True

    def __init__(self, config: DropeConfig, info: ModelInfo):
        super().__init__(config, info)
        if config.qk_norm:
            self.query_norm = nn.Parameter(torch.ones(info.num_layers, info.num_heads * info.head_dim))
            self.key_norm = nn.Parameter(torch.ones(info.num_layers, info.num_kv_heads * info.head_dim))

    def softmax_scaling(self, model_scaling: float) -> float:
        return model_scaling if self.config.softmax_scale is None else float(self.config.softmax_scale)

    def prepare_heads(self, layer_idx, query, key, value, layer_input, key_state=None, first_key_slot=0):
        if self.config.qk_norm:
            query = norm_across_heads(query, self.query_norm[layer_idx], self.config.norm_eps)
            key = norm_across_heads(key, self.key_norm[layer_idx], self.config.norm_eps)
        return query, key, value

    def kernel_heads(self, layer_idx, query, key, query_state, key_state, query_positions, key_positions):
        return query, key  # already normalised by prepare_heads: the logits are scaling * q . k

    def content_scores(self, query, key, block):
        scores = torch.matmul(query, key.transpose(2, 3)).float() * block.scaling
        return scores if block.bias is None else scores + block.bias
