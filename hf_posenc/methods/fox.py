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
- `qk_norm`: RMSNorm of each head's query and key (per-head weights, init 1, eps 1e-5 as the authors' GroupNorm):
  NOT the identity at init;
- `output_norm`: RMSNorm of each head's attention output (per-head weights, init 1, eps 1e-6 as the authors'
  `norm_eps`): NOT the identity at init;
- `output_gate`: a per-channel gate on the output, of the form `output_gate_form` says: "identity" (default),
  output * 2 sigmoid(W_o x_t) with W_o = 0, exactly the identity at init (the factor 2 makes it so); "authors",
  output * sigmoid(W_o x_t) with W_o ~ N(0, 0.02^2), the authors' code: about half the output at init, so with
  base="native" it changes the model at init. The same family of functions up to the factor 2.
- `key_shift` / `value_shift`: the data-dependent token shift of keys / values (FoX-Pro's "ShiftLinear"): per
  key-value head h,  k'_t = (1 - a_t) k_t + a_t k_{t-1},  a_t = sigmoid(w_h . x_t)  (no bias, w_h ~ N(0, 0.02^2) as
  the gate weights), the same with its own weights for values; k_{t-1} = 0 for the first token and where token t-1
  is padding (per the base model's 2-D attention_mask), so that a left-padded row equals the sequence alone.
  NOT the identity at init: a_t is about 1/2, each key starts near the mean of itself and its predecessor. The shift
  acts on the keys and values as the attention function gets them, before the QK-norm (as in FoX-Pro); under
  base="native" on LLaMA-family models that is after the model's RoPE (the cache holds rotated keys), a case
  FoX-Pro (no RoPE) does not define.
  The KV cache holds the un-shifted keys and values, so k_{t-1} of every cached token is the cache's own exact
  value; a_t and the padding flag of each token are carried as per-token state beside c (engine/content.py), and
  the shifted keys and values of the whole cache are formed again at each call: O(kv * D) per layer and step, the
  order of the attention itself. The state holds the logit w . x_t, so that 1 - a_t is computed as sigmoid(-w . x_t)
  and stays exact in float32 where a_t is near 1. A cache that has dropped a key's predecessor (a sliding-window cache past its
  window) cannot give it, and the shift refuses to run there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import SeparableBiasForm
from .content import ContentAttention, ContentConfig, rms_norm

GATE_INIT_STD = 0.02
# The authors' QK-norm is GroupNorm(is_rms_norm=True) at its default eps 1e-5; their output norm takes norm_eps, 1e-6
# (forgetting-transformer, src/forgetting_transformer/model/forgetting_transformer/modeling_forgetting_transformer.py).
QK_NORM_EPS = 1e-5
OUTPUT_NORM_EPS = 1e-6
OUTPUT_GATE_FORMS = ("identity", "authors")


@dataclass
class FoxConfig(ContentConfig):
    gate_init: str = "constant"  # "constant": every gate bias is gate_bias; "decay-time": see decay_time
    gate_bias: float = 0.0  # the gate bias for gate_init="constant"
    decay_time: list[float] = field(default_factory=lambda: [16.0, 4096.0])  # [T_min, T_max] for "decay-time"
    qk_norm: bool = False  # FoX-Pro: RMSNorm of each head's query and key (not the identity at init)
    output_norm: bool = False  # FoX-Pro: RMSNorm of each head's output (not the identity at init)
    output_gate: bool = False  # FoX-Pro: a per-channel output gate, of the form output_gate_form says
    output_gate_form: str = "identity"  # "identity": 2 sigmoid(W_o x), W_o = 0; "authors": sigmoid(W_o x), N(0, 0.02^2)
    key_shift: bool = False  # FoX-Pro: k'_t = (1 - a_t) k_t + a_t k_{t-1}, a_t = sigmoid(w . x_t) (not the identity)
    value_shift: bool = False  # FoX-Pro: the same for values, with its own weights (not the identity at init)

    def validate(self) -> None:
        super().validate()
        self.require_choice("gate_init", ("constant", "decay-time"))
        self.require_number("gate_bias", -60.0, 60.0, why="sigmoid(gate_bias) is the gate of a zero input")
        self.require_numbers("decay_time", 1.0, 2.0 ** 24, why="decay times in tokens, [T_min, T_max]")
        if len(self.decay_time) != 2 or self.decay_time[0] > self.decay_time[1]:
            self.refuse("decay_time", "is not [T_min, T_max] with T_min <= T_max", "two numbers, e.g. [16, 4096]")
        for name in ("qk_norm", "output_norm", "output_gate", "key_shift", "value_shift"):
            self.require_bool(name)
        self.require_choice("output_gate_form", OUTPUT_GATE_FORMS)


def decay_time_bias(num_heads: int, low: float, high: float) -> torch.Tensor:
    """float32 [H]: the gate bias b_h = logit(exp(-1 / T_h)), T_h geometric from `low` to `high`."""
    times = torch.logspace(math.log10(low), math.log10(high), num_heads, dtype=torch.float64) if num_heads > 1 \
        else torch.tensor([low], dtype=torch.float64)
    gate = torch.exp(-1.0 / times)
    return torch.log(gate / (1 - gate)).float()


@register_method("fox", FoxConfig)
class ForgettingAttention(SeparableBiasForm, ContentAttention):
    reads_layer_input = True
    block_cost = 3.0
    scores_maskable_in_place = True

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
            shape = (layers, heads * head_dim, hidden)
            if config.output_gate_form == "authors":  # their ogate_proj: nn.Linear initialised N(0, 0.02^2)
                gate_generator = torch.Generator().manual_seed(2)  # its own seed: the other parameters stay as they were
                self.output_gate_weight = nn.Parameter(torch.randn(shape, generator=gate_generator) * GATE_INIT_STD)
            else:
                self.output_gate_weight = nn.Parameter(torch.zeros(shape))
        self.num_heads, self.num_kv_heads = heads, info.num_kv_heads
        # The token shifts' mixing weights, one row per key-value head (seeded on their own: enabling one leaves
        # the other parameters' initial values as they were).
        shift_generator = torch.Generator().manual_seed(1)
        self.shifts = [name for name in ("key", "value") if getattr(config, f"{name}_shift")]
        if config.key_shift:
            self.key_shift_weight = nn.Parameter(
                torch.randn(layers, info.num_kv_heads, hidden, generator=shift_generator) * GATE_INIT_STD)
        if config.value_shift:
            self.value_shift_weight = nn.Parameter(
                torch.randn(layers, info.num_kv_heads, hidden, generator=shift_generator) * GATE_INIT_STD)

    def log_forget(self, layer_idx: int, layer_input: torch.Tensor) -> torch.Tensor:
        """log f_t per head, float32 [B, H, q], from the layer input [B, q, hidden]."""
        logits = layer_input.float() @ self.gate_weight[layer_idx].float().T + self.gate_bias[layer_idx].float()
        log_gate = F.logsigmoid(logits)
        if self.gate_scale is not None:
            log_gate = log_gate * self.gate_scale[layer_idx].float()
        return log_gate.transpose(1, 2)

    def token_state(self, layer_idx, layer_input, real=None):
        """[B, H + S, q]: log f per head, then (with a token shift) the key shift's logit w . x_t per key-value head
        (a_t = sigmoid of it; 1 - a_t = sigmoid of minus it, exact where a_t is near 1), the value shift's, and 1.0
        for a real token, 0.0 for padding."""
        log_forget = self.log_forget(layer_idx, layer_input)
        if not self.shifts:
            return log_forget
        x = layer_input.float()
        rows = [log_forget]
        for name in self.shifts:
            weight = getattr(self, f"{name}_shift_weight")[layer_idx].float()
            rows.append((x @ weight.T).transpose(1, 2))
        batch, q = layer_input.shape[:2]
        rows.append(real.float()[:, None] if real is not None else x.new_ones(batch, 1, q))
        return torch.cat(rows, dim=1)

    def extend_token_state(self, past, new):
        """c for every token: the cached c (None: none) followed by its last value plus this call's cumsum; the
        token shift's rows (if any) are per token, appended as they are."""
        heads = self.num_heads
        cumulative = new[:, :heads].cumsum(dim=2)
        if past is not None and past.shape[2] > 0:
            cumulative = torch.cat((past[:, :heads], past[:, :heads, -1:] + cumulative), dim=2)
        if not self.shifts:
            return cumulative
        rest = new[:, heads:] if past is None or past.shape[2] == 0 else torch.cat((past[:, heads:], new[:, heads:]), 2)
        return torch.cat((cumulative, rest), dim=1)

    def prepare_heads(self, layer_idx, query, key, value, layer_input, key_state=None, first_key_slot=0):
        if self.shifts:
            key, value = self.token_shift(key, value, key_state, first_key_slot)
        if self.config.qk_norm:
            query = rms_norm(query, self.query_norm[layer_idx][None, :, None, :], eps=QK_NORM_EPS)
            key = rms_norm(key, self.key_norm[layer_idx][None, :, None, :], eps=QK_NORM_EPS)
        return query, key, value

    def token_shift(self, key, value, key_state, first_key_slot: int = 0):
        """FoX-Pro's token shift of the whole cache's keys and values [B, H_kv, kv, D] with the carried a_t and
        padding flags (`key_state` [B, H + S, kv]): x'_t = (1 - a_t) x_t + a_t x_{t-1} real_{t-1}."""
        if key.shape[2] and first_key_slot > 0:
            raise PosEncError(
                f"FoX's token shift (key_shift/value_shift) mixes each key and value with its predecessor, and this KV "
                f"cache no longer holds the predecessor of its first key (slot {first_key_slot}): a sliding-window "
                "or evicting cache. Use a DynamicCache or StaticCache with room for every token, or patch without "
                "key_shift/value_shift.")
        rows = key_state[:, self.num_heads:]
        real = rows[:, -1:]
        previous_real = torch.cat((torch.zeros_like(real[..., :1]), real[..., :-1]), dim=-1)
        mixed = []
        for name, tensor in zip(("key", "value"), (key, value)):
            if name not in self.shifts:
                mixed.append(tensor)
                continue
            heads = self.num_kv_heads
            start = self.shifts.index(name) * heads
            logit = rows[:, start:start + heads, :, None]  # [B, H_kv, kv, 1]
            previous = torch.cat((torch.zeros_like(tensor[:, :, :1]), tensor[:, :, :-1]), dim=2).float()
            previous = previous * previous_real[..., None]
            mixed.append((torch.sigmoid(-logit) * tensor.float() + torch.sigmoid(logit) * previous).to(tensor.dtype))
        return mixed[0], mixed[1]

    def content_scores(self, query, key, block):
        scores = torch.matmul(query, key.transpose(2, 3)).float() * block.scaling
        heads = self.num_heads  # the forget gate's rows of the state (a token shift's follow them)
        scores = scores + (block.query_state[:, :heads, :, None] - block.key_state[:, :heads, None, :])
        return scores if block.bias is None else scores + block.bias

    def separable_terms(self, query_state, key_state):
        """D_ij = c_i - c_j (content_scores without the q . k part)."""
        if query_state is None or key_state is None:
            return None
        return query_state[:, :self.num_heads], key_state[:, :self.num_heads]

    def finish_output(self, layer_idx, output, layer_input):
        if self.config.output_norm:
            output = rms_norm(output, self.output_norm_weight[layer_idx][None, :, None, :], eps=OUTPUT_NORM_EPS)
        if self.config.output_gate:
            batch, heads, q, head_dim = output.shape
            gate = torch.sigmoid(layer_input.float() @ self.output_gate_weight[layer_idx].float().T)
            if self.config.output_gate_form == "identity":
                gate = 2 * gate
            output = output * gate.view(batch, q, heads, head_dim).transpose(1, 2).to(output.dtype)
        return output
