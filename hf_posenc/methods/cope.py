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
import torch.nn.functional as F
from torch import nn

from ..model_info import ModelInfo
from ..registry import register_method
from .base import fill_disallowed_
from .content import ContentAttention, ContentConfig


@dataclass
class CopeConfig(ContentConfig):
    max_pos: int = 64  # the largest contextual position (positions are clamped to it); max_pos + 1 embeddings

    def validate(self) -> None:
        super().validate()
        self.require_size("max_pos", 1, "table", why="one learned embedding per integer position 0..max_pos")


@register_method("cope", CopeConfig)
class ContextualPositions(ContentAttention):
    block_cost = 6.0
    scores_maskable_in_place = True

    def __init__(self, config: CopeConfig, info: ModelInfo):
        super().__init__(config, info)
        self.position_embeddings = nn.Parameter(torch.zeros(info.num_layers, info.head_dim, config.max_pos + 1))

    def content_scores(self, query, key, block):
        scores = ContextualScores.apply(query, key, self.position_embeddings[block.layer_idx], block.allowed,
                                        block.scaling, float(self.config.max_pos))
        return scores if block.bias is None else scores + block.bias


class ContextualScores(torch.autograd.Function):
    """A block's CoPE logits float32 [B, H, r, k] from its queries [B, H, r, D], keys [B, H, k, D], the layer's
    embeddings e [D, max_pos + 1] and the allowed keys (bool, broadcast), with the backward written out: autograd
    through the same chain runs about twice as many full passes over the block (a zero-filled [r, max_pos + 1]
    gradient per gather, the flips of the cumulative sum, the masks), and the content methods' training step is
    made of such passes. With the integers' scalars I_n = q . e[n] and their rises R_n = I_{n+1} - I_n (R_max_pos =
    0), the interpolated term is I[floor p] + (p - floor p) R[floor p]. Backward, for dL/dlogits = G:
    dI[floor p] += G, dR[floor p] += (p - floor p) G; dp = G R[floor p] (0 where p was clamped, as the clamp's
    gradient is: there floor p = max_pos); the reverse cumulative sum's adjoint is the forward one,
    dg_ij = sum_{k<=j} dp_ik; dz = G + dg g (1 - g)."""

    @staticmethod
    def forward(ctx, query, key, embeddings, allowed, scaling: float, max_pos: float):
        logits = torch.matmul(query, key.transpose(2, 3)).float().mul_(scaling)
        gates = fill_disallowed_(torch.sigmoid(logits), allowed, 0.0)
        positions = gates.flip(-1).cumsum(-1).flip(-1)
        floor = positions.clamp_(max=max_pos).floor()
        weight = positions.sub_(floor)
        index = floor.long()
        integer = query.float() @ embeddings.float()  # [B, H, r, max_pos + 1]
        rise = F.pad(integer.diff(dim=-1), (0, 1))
        rise_at = rise.gather(-1, index)
        ctx.save_for_backward(query, key, embeddings, gates, weight, index, rise_at)
        ctx.scaling = scaling
        # Not the returned tensor in place: under torch.compile with torch 2.11, a forward's output modified in place
        # came back with zero gradients (fixed by 2.13; the kernel check refused the compiled path for it on an H200).
        return torch.addcmul(logits.add_(integer.gather(-1, index)), weight, rise_at)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        query, key, embeddings, gates, weight, index, rise_at = ctx.saved_tensors
        grad = grad.float()
        grad_integer = torch.zeros(*grad.shape[:-1], embeddings.shape[-1], dtype=grad.dtype, device=grad.device)
        grad_integer.scatter_add_(-1, index, grad)
        grad_rise = torch.zeros_like(grad_integer).scatter_add_(-1, index, grad * weight)[..., :-1]
        grad_integer[..., 1:] += grad_rise
        grad_integer[..., :-1] -= grad_rise
        grad_gates = (grad * rise_at).cumsum(-1)
        grad_logits = grad_gates.mul_(torch.addcmul(gates, gates, gates, value=-1.0)).add_(grad)
        grad_logits = grad_logits.to(query.dtype)
        grad_query = torch.matmul(grad_logits, key).mul_(ctx.scaling) \
            + (grad_integer @ embeddings.float().T).to(query.dtype)
        grad_key = torch.matmul(grad_logits.transpose(2, 3), query).mul_(ctx.scaling)
        grad_embeddings = torch.einsum("bhrd,bhrn->dn", query.float(), grad_integer).to(embeddings.dtype)
        return grad_query, grad_key, grad_embeddings, None, None, None
