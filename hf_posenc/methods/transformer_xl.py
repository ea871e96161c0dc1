"""Transformer-XL relative attention (Dai, Yang, Yang, Carbonell, Le, Salakhutdinov 2019, "Transformer-XL: Attentive
Language Models Beyond a Fixed-Length Context"), section 3.3:

    logits_ij = scaling * [ q_i . k_j + u . k_j + q_i . W_R R_{i-j} + v . W_R R_{i-j} ]
              = scaling * [ (q_i + u) . k_j + (q_i + v) . W_R R_{i-j} ]

per head, with R_t = [sin(t w_0), ..., sin(t w_{d/2-1}), cos(t w_0), ..., cos(t w_{d/2-1})], w_n = 10000^(-2n/d)
the fixed sinusoid of dimension d = `relative_dim` (default: the head size), W_R [head_dim, d] per head, and the
global content bias u and position bias v [head_dim] per head (all per layer). q and k are the model's own queries
and keys (the content terms (a) and (c) of the paper; the model's key projection is W_{k,E}).

Computed per query block: the distances the block needs, t = i - j (at least 0, as every distance method here),
give W_R R_t once per distinct t ([H, T, head_dim], T <= rows + keys for consecutive positions), then
(q_i + v) . W_R R_t as [B, H, rows, T] and a gather at each (i, j)'s distance: the paper's "relative shift" without
its padding trick, and never an [L, L, d] tensor.

Kernel form (engine/attention/content_path.py `_kernel_content`, wherever the call needs no attention weights and
no dropout): by
sin((p_i - p_j) w) = sin(p_i w) cos(p_j w) - cos(p_i w) sin(p_j w) and cos((p_i - p_j) w) = cos cos + sin sin, with
a = W_R^T (q_i + v) split into a^s (the sine half) and a^c,
    a . R_{p_i - p_j} = sum_n cos(p_j w_n) [a^s_n sin(p_i w_n) + a^c_n cos(p_i w_n)]
                      + sin(p_j w_n) [a^c_n sin(p_i w_n) - a^s_n cos(p_i w_n)],
so the logits are scaling * [q_i + u, those 2 x d/2 query terms] . [k_j, cos(p_j w), sin(p_j w)]: one SDPA call on
head size head_dim + d, values padded to match (SDPA's CPU kernel needs one head size), autograd as is. Exact where
every attended key's position is at most its query's (the distance clamp at 0 is then never in effect); a call with
another pair (position ids that go back among the attended keys) takes the per-block path above. The angles p w are
taken in float64 and rounded once to float32 sin/cos, so the form's logits differ from the per-block path's by that
path's own rounding of t w in float32 (at most about |a| * t * 2^-24 rad; tests/test_content_methods.py measures it at
16k positions).

base="none": W_R ~ N(0, 1/d), u and v ~ N(0, 0.02^2) (the paper's usual init), the model's own positions removed.
base="native": W_R, u and v start at zero, so the method adds exactly nothing at init (the original logits) and the
model's mechanism stays underneath; gradients reach W_R and u at once, v once W_R has moved off zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..model_info import ModelInfo
from ..registry import register_method
from .base import DotProductForm, relative_distance
from .content import ContentAttention, ContentConfig

BIAS_INIT_STD = 0.02


@dataclass
class TransformerXlConfig(ContentConfig):
    relative_dim: int | None = None  # dimension of the sinusoid R (even); None: the model's head size

    def validate(self) -> None:
        super().validate()
        self.require_size("relative_dim", 2, "dim", none_means="the head size", even=True)


def sinusoid_frequencies(dim: int, device=None) -> torch.Tensor:
    """float32 [dim / 2]: the frequencies w_n of R."""
    return 1.0 / (10000 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def sinusoid(distances: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 [..., dim]: Transformer-XL's R_t for distances t (sines, then cosines)."""
    angles = distances.float()[..., None] * sinusoid_frequencies(dim, distances.device)
    return torch.cat((angles.sin(), angles.cos()), dim=-1)


def position_sin_cos(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (sin, cos) of p w_n, each [B or 1, 1, n, dim / 2], for positions [B or 1, n]. The angles are taken in
    float64 (the float32 frequencies made exact there): the kernel form combines the angles of two positions, and a
    float32 angle of a far position would be off by half its ulp (1e-3 rad at 16k) even where the distance is small."""
    device = positions.device
    if device.type == "mps":  # Apple GPUs have no float64: take the angles on the CPU
        positions = positions.cpu()
    angles = positions.double()[:, None, :, None] * sinusoid_frequencies(dim, positions.device).double()
    return angles.sin().float().to(device), angles.cos().float().to(device)


@register_method("transformer-xl", TransformerXlConfig)
class TransformerXlAttention(DotProductForm, ContentAttention):
    block_cost = 5.0
    scores_maskable_in_place = True

    def __init__(self, config: TransformerXlConfig, info: ModelInfo):
        super().__init__(config, info)
        layers, heads, head_dim = info.num_layers, info.num_heads, info.head_dim
        self.relative_dim = config.relative_dim or head_dim + head_dim % 2
        shape = (layers, heads, head_dim, self.relative_dim)
        if config.base == "native":
            relative, content_bias, position_bias = torch.zeros(shape), torch.zeros(layers, heads, head_dim), \
                torch.zeros(layers, heads, head_dim)
        else:
            generator = torch.Generator().manual_seed(0)
            relative = torch.randn(shape, generator=generator) / math.sqrt(self.relative_dim)
            content_bias = torch.randn(layers, heads, head_dim, generator=generator) * BIAS_INIT_STD
            position_bias = torch.randn(layers, heads, head_dim, generator=generator) * BIAS_INIT_STD
        self.relative_projection = nn.Parameter(relative)  # W_R
        self.content_bias = nn.Parameter(content_bias)  # u
        self.position_bias = nn.Parameter(position_bias)  # v

    def position_logits(self, query: torch.Tensor, layer_idx: int, distances: torch.Tensor) -> torch.Tensor:
        """(q_i + v) . W_R R_{t_ij}, float32 [B, H, r, k], for integer distances t [B or 1, 1, r, k]."""
        low, high = int(distances.min()), int(distances.max())
        rows, keys = distances.shape[-2:]
        if high - low + 1 <= 2 * (rows + keys):  # consecutive-ish positions: every distance in the range
            table_distances = torch.arange(low, high + 1, device=distances.device)
            index = distances - low
        else:  # far-apart position ids: only the distances that occur
            table_distances, index = torch.unique(distances, return_inverse=True)
        projected = torch.einsum("hdr,tr->htd", self.relative_projection[layer_idx].float(),
                                 sinusoid(table_distances, self.relative_dim))  # W_R R_t [H, T, D]
        shifted = query.float() + self.position_bias[layer_idx].float()[None, :, None, :]
        per_distance = shifted @ projected.transpose(1, 2)[None]  # [B, H, r, T]
        return per_distance.gather(-1, index.expand(*per_distance.shape[:-1], keys))

    kernel_needs_ordered_keys = True  # relative_distance clamps a key after the query to distance 0

    def kernel_heads(self, layer_idx, query, key, query_state, key_state, query_positions, key_positions):
        """The logits as one dot product (module docstring, "Kernel form"): [q_i + u, a^s sin + a^c cos,
        a^c sin - a^s cos] (angles p_i w) against [k_j, cos(p_j w), sin(p_j w)], a = W_R^T (q_i + v)."""
        query = query.float()
        content = query + self.content_bias[layer_idx].float()[None, :, None, :]
        coefficients = torch.einsum("bhqd,hdr->bhqr", query + self.position_bias[layer_idx].float()[None, :, None, :],
                                    self.relative_projection[layer_idx].float())
        sines, cosines = coefficients.chunk(2, dim=-1)  # a^s, a^c: the coefficients of sin(t w) and cos(t w)
        query_sin, query_cos = position_sin_cos(query_positions, self.relative_dim)
        key_sin, key_cos = position_sin_cos(key_positions, self.relative_dim)
        augmented_query = torch.cat((content, sines * query_sin + cosines * query_cos,
                                     cosines * query_sin - sines * query_cos), dim=-1)
        batch, heads, keys = key.shape[:3]
        augmented_key = torch.cat((key.float(), key_cos.expand(batch, heads, keys, -1),
                                   key_sin.expand(batch, heads, keys, -1)), dim=-1)
        return augmented_query, augmented_key

    def content_scores(self, query, key, block):
        layer = block.layer_idx
        content = (query.float() + self.content_bias[layer].float()[None, :, None, :]) @ key.float().transpose(2, 3)
        distances = relative_distance(block.query_positions, block.key_positions).long()
        scores = (content + self.position_logits(query, layer, distances)) * block.scaling
        return scores if block.bias is None else scores + block.bias
