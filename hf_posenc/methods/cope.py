"""CoPE, Contextual Position Encoding (Golovneva, Wang, Weston, Sukhbaatar 2024, "Contextual Position Encoding:
Learning to Count What's Important"): positions counted by content-dependent gates, so a head can count words,
sentences or any token class rather than tokens.

For query i and an earlier key j (z_ij = scaling * q_i . k_j, the content logit):

    g_ij = sigmoid(z_ij),    p_ij = min(sum_{k=j..i} g_ik, max_pos)
    logits_ij = z_ij + q_i . e[p_ij],    q_i . e[p] = (1 - w) q_i . e[floor p] + w q_i . e[ceil p],  w = p - floor p

with learned position embeddings e[0..max_pos] (per layer, shared by its heads, as in the paper; head_dim each).
Computed in the paper's efficient form: the scalars q_i . e[n] for the integers n = 0..max_pos once per query
block ([B, H, rows, max_pos + 1]), then gathered at floor p and ceil p and interpolated; p is a reverse cumulative
sum of the gates over each row's keys (masked keys count 0), per query block. No [L, L, d] tensor.

e starts at zero, as in the paper's reference code: at init the method adds nothing. So base="native" (the model's
own mechanism kept: RoPE-rotated q and k on LLaMA, learned wpe on GPT-2, ALiBi added on BLOOM) reproduces the
original logits exactly at init, and base="none" starts as NoPE. Gradients reach e at once (through q_i . e).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..model_info import ModelInfo
from ..registry import register_method
from .content import ContentAttention, ContentConfig


@dataclass
class CopeConfig(ContentConfig):
    max_pos: int = 64  # the largest contextual position (positions are clamped to it); max_pos + 1 embeddings

    def validate(self) -> None:
        super().validate()
        self.require_int("max_pos", 1, 2 ** 20, why="one learned embedding per integer position 0..max_pos")


@register_method("cope", CopeConfig)
class ContextualPositions(ContentAttention):
    block_cost = 6.0

    def __init__(self, config: CopeConfig, info: ModelInfo):
        super().__init__(config, info)
        self.position_embeddings = nn.Parameter(torch.zeros(info.num_layers, info.head_dim, config.max_pos + 1))

    def contextual_positions(self, logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """p_ij = min(sum_{k=j..i} sigmoid(z_ik), max_pos) over allowed keys, float32 [B, H, r, k]."""
        gates = torch.sigmoid(logits).masked_fill(~allowed, 0.0)
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=float(self.config.max_pos))

    def content_scores(self, query, key, block):
        logits = torch.matmul(query, key.transpose(2, 3)).float() * block.scaling
        positions = self.contextual_positions(logits, block.allowed)
        integer = query.float() @ self.position_embeddings[block.layer_idx].float()  # [B, H, r, max_pos + 1]
        floor = positions.floor()
        weight = positions - floor
        below = integer.gather(-1, floor.long())
        above = integer.gather(-1, positions.ceil().long())
        scores = logits + below * (1 - weight) + above * weight
        return scores if block.bias is None else scores + block.bias
