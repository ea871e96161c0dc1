"""FoX, the Forgetting Transformer (Lin, Nikishin, He, Courville, ICLR 2025, "Forgetting Transformer: Softmax
Attention with a Forget Gate"), with the FoX-Pro parts as options.

Each head h of each layer has a forget gate computed from the attention layer's input x_t:

    f_t = sigmoid(w_h . x_t + b_h),    c_i = sum_{l <= i} log f_l,
    logits_ij = scaling * q_i . k_j + D_ij,    D_ij = sum_{l=j+1..i} log f_l = c_i - c_j,

then the usual causal softmax. D is the difference of the cumulative log gates, computed in float32 (log f with
`logsigmoid`, never as a product of probabilities); c is the per-token state the KV cache carries (engine/content.py):
a decoding step adds its own log f to the last cached c, so cached decoding uses the very c of a full forward.

Gate-bias init (`gate_init`): "constant", every bias is `gate_bias` (f = sigmoid(gate_bias) for a zero input;
default 0), or "decay-time": head h gets f_h = exp(-1 / T_h) for a zero input, with decay times T_h spread
geometrically over `decay_time` = [T_min, T_max] across heads (bias logit(f_h)). Gate weights start N(0, 0.02^2).

`base="none"` (FoX as in the paper: no RoPE, no other position) or `base="native"`: on top of the model's own
mechanism. On top, log f is multiplied by a per-head `gate_scale` that starts at 0, so at init D = 0 exactly and the
logits are the original ones (up to the attention path's rounding, <= 1e-5); gradients reach `gate_scale` at once,
the gate's weights and bias only once it has moved off 0.

FoX-Pro parts (each off by default):
- `qk_norm`: RMSNorm of each head's query and key (per-head weights, init 1): NOT the identity at init;
- `output_norm`: RMSNorm of each head's attention output (per-head weights, init 1): NOT the identity at init;
- `output_gate`: output * 2 sigmoid(W_o x_t) per channel, W_o zero-initialised: exactly the identity at init (the
  factor 2 makes it so; the paper's gate is sigmoid(W_o x_t), the same family of functions up to that factor).
The key/value token shift of FoX-Pro is not implemented (see docs/methods.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..model_info import ModelInfo
from ..registry import register_method
from .content import ContentAttention, ContentConfig, rms_norm

GATE_INIT_STD = 0.02


@dataclass
class FoxConfig(ContentConfig):
    gate_init: str = "constant"  # "constant": every gate bias is gate_bias; "decay-time": see decay_time
    gate_bias: float = 0.0  # the gate bias for gate_init="constant"
    decay_time: list[float] = field(default_factory=lambda: [16.0, 4096.0])  # [T_min, T_max] for "decay-time"
    qk_norm: bool = False  # FoX-Pro: RMSNorm of each head's query and key (not the identity at init)
    output_norm: bool = False  # FoX-Pro: RMSNorm of each head's output (not the identity at init)
    output_gate: bool = False  # FoX-Pro: output * 2 sigmoid(W_o x), W_o = 0 (the identity at init)

    def validate(self) -> None:
        super().validate()
        self.require_choice("gate_init", ("constant", "decay-time"))
        self.require_number("gate_bias", -60.0, 60.0, why="sigmoid(gate_bias) is the gate of a zero input")
        self.require_numbers("decay_time", 1.0, 2.0 ** 24, why="decay times in tokens, [T_min, T_max]")
        if len(self.decay_time) != 2 or self.decay_time[0] > self.decay_time[1]:
            self.refuse("decay_time", "is not [T_min, T_max] with T_min <= T_max", "two numbers, e.g. [16, 4096]")
        for name in ("qk_norm", "output_norm", "output_gate"):
            self.require_bool(name)


def decay_time_bias(num_heads: int, low: float, high: float) -> torch.Tensor:
    """float32 [H]: the gate bias b_h = logit(exp(-1 / T_h)), T_h geometric from `low` to `high`."""
    times = torch.logspace(math.log10(low), math.log10(high), num_heads, dtype=torch.float64) if num_heads > 1 \
        else torch.tensor([low], dtype=torch.float64)
    gate = torch.exp(-1.0 / times)
    return torch.log(gate / (1 - gate)).float()


@register_method("fox", FoxConfig)
class ForgettingAttention(ContentAttention):
    reads_layer_input = True
    block_cost = 3.0

    def __init__(self, config: FoxConfig, info: ModelInfo):
        super().__init__(config, info)
        layers, heads, hidden, head_dim = info.num_layers, info.num_heads, info.hidden_size, info.head_dim
        generator = torch.Generator().manual_seed(0)
        self.gate_weight = nn.Parameter(torch.randn(layers, heads, hidden, generator=generator) * GATE_INIT_STD)
        if config.gate_init == "decay-time":
            bias = decay_time_bias(heads, *config.decay_time).expand(layers, heads).clone()
        else:
            bias = torch.full((layers, heads), float(config.gate_bias))
        self.gate_bias = nn.Parameter(bias)
        self.gate_scale = nn.Parameter(torch.zeros(layers, heads)) if config.base == "native" else None
        if config.qk_norm:
            self.query_norm = nn.Parameter(torch.ones(layers, heads, head_dim))
            self.key_norm = nn.Parameter(torch.ones(layers, info.num_kv_heads, head_dim))
        if config.output_norm:
            self.output_norm_weight = nn.Parameter(torch.ones(layers, heads, head_dim))
        if config.output_gate:
            self.output_gate_weight = nn.Parameter(torch.zeros(layers, heads * head_dim, hidden))

    def log_forget(self, layer_idx: int, layer_input: torch.Tensor) -> torch.Tensor:
        """log f_t per head, float32 [B, H, q], from the layer input [B, q, hidden]."""
        logits = layer_input.float() @ self.gate_weight[layer_idx].float().T + self.gate_bias[layer_idx].float()
        log_gate = F.logsigmoid(logits)
        if self.gate_scale is not None:
            log_gate = log_gate * self.gate_scale[layer_idx].float()
        return log_gate.transpose(1, 2)

    def token_state(self, layer_idx, layer_input):
        return self.log_forget(layer_idx, layer_input)

    def extend_token_state(self, past, new):
        """c for every token: the cached c (None: none) followed by its last value plus this call's cumsum."""
        cumulative = new.cumsum(dim=2)
        if past is None or past.shape[2] == 0:
            return cumulative
        return torch.cat((past, past[:, :, -1:] + cumulative), dim=2)

    def prepare_heads(self, layer_idx, query, key, value, layer_input):
        if self.config.qk_norm:
            query = rms_norm(query, self.query_norm[layer_idx][None, :, None, :])
            key = rms_norm(key, self.key_norm[layer_idx][None, :, None, :])
        return query, key, value

    def content_scores(self, query, key, block):
        scores = torch.matmul(query, key.transpose(2, 3)).float() * block.scaling
        scores = scores + (block.query_state[..., :, None] - block.key_state[..., None, :])
        return scores if block.bias is None else scores + block.bias

    def finish_output(self, layer_idx, output, layer_input):
        if self.config.output_norm:
            output = rms_norm(output, self.output_norm_weight[layer_idx][None, :, None, :])
        if self.config.output_gate:
            batch, heads, q, head_dim = output.shape
            gate = 2 * torch.sigmoid(layer_input.float() @ self.output_gate_weight[layer_idx].float().T)
            output = output * gate.view(batch, q, heads, head_dim).transpose(1, 2).to(output.dtype)
        return output
