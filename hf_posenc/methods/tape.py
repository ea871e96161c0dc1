"""TAPE, contextualized equivariant position encoding (Zhu, Wang, Cai, Lee, Li, Wang 2025, "Rethinking Addressing in
Language Models via Contextualized Equivariant Positional Encoding", ICML 2025, arXiv:2501.00712): every token carries
position features that each layer updates with the content, in a way that keeps attention a function of relative
position.

Position features. Token t has, per key-value head g and rotary plane k (dimensions k and k + d/2 of the half-split
layout), a complex number z_t[g, k] = c + i s, stored as float32 [B, H_kv, tokens, rotary_dim] (the c's, then the
s's). At the first layer z_t[g, k] = exp(i p_t w_k), RoPE's, with w_k = theta^(-2k/d) and p_t the token's position.

Attention (layer l). Queries and keys are turned by their token's features, as RoPE turns them by exp(i p w):
    q'_i = q_i * z_i,  k'_j = k_j * z_j   (per plane, as complex numbers: the 2 x 2 matrix [[c, -s], [s, c]]),
    logits_ij = scaling * Re sum_k q'_ik conj(k'_jk) = scaling * Re sum_k Q_ik conj(K_jk) z_ik conj(z_jk).

Update (from layer l-1 to layer l; x_i: the input of layer l's attention, a_i^h: head h's attention average of the
keys' features at layer l-1, computed with the weights that average the values):
    u_i = z_i^(l-1) + A_l a_i,                                 A_l [H_kv, H]             (attention update)
    z_i^(l) = u_i + D_l diag(act(W_l x_i)) U_l u_i,            U_l [m, H_kv], D_l [m], W_l [m, hidden] (content update)
Both mix the features only across heads and tokens, with real weights, and the same for every plane and for c and s.

Equivariance (the paper's Prop.: attention is invariant, and the updates equivariant, under an orthogonal transform of
the features). Multiplying every token's z[., k] by one unit complex number u_k per plane (a rotation of each plane)
multiplies every updated z by the same u_k (the updates are real-linear across heads and tokens) and leaves every
logit unchanged (z_i conj(z_j) is unchanged). Shifting all positions by D is such a transform (u_k = exp(i D w_k)), so
logits depend on relative positions only, whatever the content updates learn; tests/test_rotations.py checks both
numerically. (The group here is SO(2) per plane, the one RoPE's shifts live in; reflections are not symmetries of
RoPE's form.)

init="rope" starts A_l and U_l at zero (the paper's reference code zero-inits the same two maps), so every layer's
features stay RoPE's and a LLaMA-family model computes its own RoPE logits (<= 1e-5): that is TAPE's RoPE state.
init="random" draws A_l and U_l ~ N(0, init_std^2) (the updates act from the start). D_l, W_l start N(0, 0.02^2) either
way; `width` is m. The features of every token and layer stay on the KV cache beside the keys (engine/content.py), so
cached decoding sees the features a full forward computed. Our changes to the paper's form: by default the content
gate reads the input of the next layer's attention (the residual stream after the MLP, normed), not the MLP output
(gate_input="mlp_output" reads that, as the authors' PELayer does: the family's MLP hooks catch it,
engine/content.py); features per key-value head, shared by the query heads of a GQA group.

Kernel form (engine/attention/content_path.py `_kernel_content`, wherever the call needs no attention weights and
no dropout):
the logits are a plain dot product of the turned q'_i and k'_j (`kernel_heads`, the keys turned at their key-value
heads), and a_i is the same softmax weights applied to the keys' features, so one SDPA call per layer on q', k' and
the values with the keys' features beside them (queries and keys padded with zeros to that width: SDPA's CPU kernel
needs one head size; on the CPU a causal square takes the fused causal kernel, unpadded) gives the attention output
and a_i at once, autograd as is. On the CPU the turn itself is a fused kernel too (engine/kernels/by_method.py
`tape_heads`, turn.cpp), checked against `turn` like any kernel.

`base="none"` (default): TAPE replaces the model's positional mechanism. `base="native"` keeps it underneath (GPT-2's
learned positions, BLOOM's ALiBi); refused on RoPE models, whose RoPE TAPE already is at init.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BASE_WHY, MIN_BASE
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import DotProductForm, rotate
from .content import ContentAttention, ContentConfig
from .rope import DEFAULT_THETA, default_inv_freq

GATE_INIT_STD = 0.02
GATE_INPUTS = ("attention_input", "mlp_output")


@dataclass
class TapeConfig(ContentConfig):
    init: str = "rope"  # "rope": the updates start at zero (RoPE exactly); "random": they start N(0, init_std^2)
    init_std: float = 0.02
    width: int = 16  # m: channels of the content update
    theta: float | None = None  # RoPE base of the first layer's features; None: the model's own, else 10000
    # What the content gate W_l reads: "attention_input" the input of the attention the features go to (the
    # residual stream after the previous layer, normed), "mlp_output" the previous layer's MLP output (the authors'
    # PELayer, models/llama/adape.py: self.pe(self.mlp(...), position_states))
    gate_input: str = "attention_input"

    def validate(self) -> None:
        super().validate()
        self.require_choice("init", ("rope", "random"))
        self.require_number("init_std", 0.0, 1.0)
        self.require_size("width", 1, "width", why="channels of the content update of the position features")
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_choice("gate_input", GATE_INPUTS)


@register_method("tape", TapeConfig)
class Tape(DotProductForm, ContentAttention):
    reads_layer_input = True
    mixes_state = True
    block_cost = 3.0
    scores_maskable_in_place = True

    @property
    def reads_mlp_output(self) -> bool:
        return self.config.gate_input == "mlp_output"

    def __init__(self, config: TapeConfig, info: ModelInfo):
        super().__init__(config, info)
        if config.base == "native" and info.native_method == "rope":
            raise PosEncError("tape with base='native' would turn queries and keys twice on a RoPE model (TAPE starts "
                              "as RoPE): use base='none' (the default).")
        dim = info.rotary_dim
        if dim % 2:
            raise PosEncError(f"TAPE needs an even rotary dimension; this model's is {dim}.")
        self.initial_theta = float(config.theta or info.rope_theta or info.patched_rope_theta or DEFAULT_THETA)
        self._inv_freq = default_inv_freq(self.initial_theta, dim)
        layers, heads, kv_heads, width = info.num_layers, info.num_heads, info.num_kv_heads, config.width
        self.kv_heads = kv_heads
        generator = torch.Generator().manual_seed(0)

        def random(*shape, std):
            return torch.randn(*shape, generator=generator) * std

        update = (lambda *shape: torch.zeros(shape)) if config.init == "rope" else \
            (lambda *shape: random(*shape, std=config.init_std))
        self.attention_mix = nn.Parameter(update(layers, kv_heads, heads))  # A_l
        self.feature_up = nn.Parameter(update(layers, width, kv_heads))  # U_l
        self.feature_down = nn.Parameter(random(layers, kv_heads, width, std=GATE_INIT_STD))  # D_l
        self.content_gate = nn.Parameter(random(layers, width, info.hidden_size, std=GATE_INIT_STD))  # W_l

    def initial_features(self, positions: torch.Tensor, batch: int) -> torch.Tensor:
        """RoPE's features exp(i p w) of positions [B or 1, q] -> float32 [batch, H_kv, q, rotary_dim] (c's, s's)."""
        angles = positions[..., None].float() * self._inv_freq.to(positions.device)
        features = torch.cat((angles.cos(), angles.sin()), dim=-1)[:, None]
        return features.expand(batch, self.kv_heads, -1, -1).contiguous()

    def update_features(self, layer_idx: int, layer_input: torch.Tensor, previous: torch.Tensor,
                        mixed: torch.Tensor) -> torch.Tensor:
        """z^(l) from z^(l-1) [B, H_kv, q, d], the attention average a [B, H, q, d] and the layer input x [B, q, hidden]
        (the module docstring's two updates), float32."""
        mix = self.attention_mix[layer_idx].float()
        features = previous + torch.einsum("gh,bhqd->bgqd", mix, mixed)
        gate = F.silu(layer_input.float() @ self.content_gate[layer_idx].float().T)  # [B, q, m]
        # D diag(gate_i) U as one [H_kv, H_kv] matrix per token: H_kv^2 products per feature instead of 2 m H_kv, and
        # no [B, m, q, d] intermediates kept for the backward (half the update's time at SmolLM2's shapes)
        content_mix = (self.feature_down[layer_idx].float() * gate[..., None, :]) @ self.feature_up[layer_idx].float()
        return features + (content_mix @ features.transpose(1, 2)).transpose(1, 2)

    def layer_token_state(self, layer_idx, layer_input, positions, previous, mixed):
        if previous is None:
            return self.initial_features(positions, layer_input.shape[0])
        return self.update_features(layer_idx, layer_input, previous, mixed)

    def turn(self, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """x [B, H, n, D] turned by features [B, H_kv, n, d] (per plane, times c + i s), in float32."""
        features = features.repeat_interleave(x.shape[1] // features.shape[1], dim=1)
        real, imaginary = features.chunk(2, dim=-1)
        return rotate(x.float(), torch.cat((real, real), dim=-1), torch.cat((imaginary, imaginary), dim=-1))

    def kernel_heads(self, layer_idx, query, key, query_state, key_state, query_positions, key_positions):
        return self.turn(query, query_state), self.turn(key, key_state)

    def content_scores(self, query, key, block):
        scores = torch.matmul(self.turn(query, block.query_state),
                              self.turn(key, block.key_state).transpose(2, 3)) * block.scaling
        return scores if block.bias is None else scores + block.bias
