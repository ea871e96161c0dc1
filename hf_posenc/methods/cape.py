"""CAPE, context-adaptive positional encoding (Zheng, Gao, Shi, Xiong, Sun, Li, Sun, Li, Zhang, NeurIPS 2024,
"DAPE: Data-Adaptive Positional Encoding for Length Extrapolation"; the authors' later name for it is CAPE): a small
MLP corrects a positional bias with the attention's content, per query-key pair.

With z_ij = scaling * q_i . k_j (one value per head), B_ij the bias of any registered attention-bias method (option
`bias`, default "alibi", built with `bias_options`), and f an MLP across the heads (as in the paper: the 2H values
[z_ij^(1..H), B_ij^(1..H)] -> `mlp_width` -> GELU -> H values):

    base="none":    logits_ij = z_ij + B_ij + f(z_ij, B_ij)
    base="native":  logits_ij = z_ij + f(z_ij, B_ij)      (+ the model's own mechanism underneath)

Computed per query block; the MLP sees [B, rows, keys, 2H] at a time, never [L, L] for the whole sequence. On the CPU
a causal square whose bias is a table of distances (consecutive position ids, a bias method with `bias_table`) goes to
a fused kernel (engine/cpu_kernels/cape.cpp): every head's pairs of a tile in cache, the MLP per chunk of a row's pairs
on register vectors, flash attention's softmax, the backward recomputing each tile.

On top of the model's own mechanism B enters only through f, whose output layer starts at zero: at init the method
adds exactly nothing and the logits are the original ones (gradients then reach the output layer at once, the
first layer once the output layer has moved off zero). Alone (base="none") the output layer starts N(0, 0.02^2) and
the bias itself is added, as in the paper. The bias method's parameters (FIRE's MLP, ALiBi's slopes with
trainable=True, ...) are CAPE's, under `bias_method.*`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.fused_cpu import cape_causal
from ..model_info import ModelInfo
from ..registry import available_methods, get_method, register_method
# The built-in bias methods CAPE may name, registered by importing them. Standalone export also ships the module of
# the one `bias` names, a user's method too (sub_configs).
from .alibi import Alibi  # noqa: F401
from .relative_biases import Fire, Kerple, Sandwich, T5Bias  # noqa: F401
from .base import AttentionBiasMethod
from .content import ContentAttention, ContentConfig

OUTPUT_INIT_STD = 0.02


@dataclass
class CapeConfig(ContentConfig):
    bias: str = "alibi"  # a registered attention-bias method
    bias_options: dict = field(default_factory=dict)  # its options
    mlp_width: int = 32

    def validate(self) -> None:
        super().validate()
        bias_methods = sorted(name for name in available_methods()
                              if issubclass(get_method(name).module_class, AttentionBiasMethod))
        if not (isinstance(self.bias, str) and self.bias in bias_methods):
            self.refuse("bias", "is not a registered attention-bias method", " or ".join(map(repr, bias_methods)))
        if not isinstance(self.bias_options, dict):
            self.refuse("bias_options", "is not a dict", "the bias method's options as a dict, e.g. {}")
        self.require_int("mlp_width", 1, 4096)

    def sub_configs(self):
        return [get_method(self.bias).config_class.from_options(**self.bias_options)]


@register_method("cape", CapeConfig)
class ContextAdaptivePositions(ContentAttention):
    fresh_scores = True
    has_fused_causal = True
    reads_position_span = True

    def __init__(self, config: CapeConfig, info: ModelInfo):
        super().__init__(config, info)
        spec = get_method(config.bias)
        self.bias_method = spec.module_class(spec.config_class.from_options(**config.bias_options), info)
        layers, heads, width = info.num_layers, info.num_heads, config.mlp_width
        generator = torch.Generator().manual_seed(0)
        self.input_weight = nn.Parameter(torch.randn(layers, width, 2 * heads, generator=generator)
                                         / math.sqrt(2 * heads))
        self.input_bias = nn.Parameter(torch.zeros(layers, width))
        output = torch.zeros(layers, heads, width) if config.base == "native" else \
            torch.randn(layers, heads, width, generator=generator) * OUTPUT_INIT_STD
        self.output_weight = nn.Parameter(output)
        self.output_bias = nn.Parameter(torch.zeros(layers, heads))
        # float32 [B, H, r, k] tensors per block: logits, bias, the MLP's input (2H) and hidden (2 x width) per pair.
        self.block_cost = 4.0 + (2 * heads + 2 * width) / heads

    def fused_causal_applies(self, layer_idx, positions):
        """The kernel takes the bias as a table of distances i - j: every row's position ids consecutive, and a bias
        method whose bias depends on the distance alone up to the call's last position."""
        if positions.shape[-1] > 1 and not bool((positions.diff(dim=-1) == 1).all()):
            return False
        return self.bias_method.bias_table(layer_idx, 1, int(positions.max()), positions.device) is not None

    def fused_causal(self, layer_idx, query, key, value, scaling, positions):
        table = self.bias_method.bias_table(layer_idx, query.shape[2], int(positions.max()), query.device)
        return cape_causal(query, key, value, table, self.input_weight[layer_idx], self.input_bias[layer_idx],
                           self.output_weight[layer_idx], self.output_bias[layer_idx], scaling,
                           self.config.base == "none")

    def content_scores(self, query, key, block):
        layer = block.layer_idx
        logits = torch.matmul(query, key.transpose(2, 3)).float() * block.scaling
        bias = self.bias_method.block_bias(layer, block.query_positions, block.key_positions, block.span)
        bias = bias.float().expand_as(logits)
        pairs = torch.cat((logits, bias), dim=1).permute(0, 2, 3, 1)  # [B, r, k, 2H]
        hidden = F.gelu(F.linear(pairs, self.input_weight[layer].float(), self.input_bias[layer].float()))
        correction = F.linear(hidden, self.output_weight[layer].float(), self.output_bias[layer].float())
        scores = logits + correction.permute(0, 3, 1, 2)
        if self.config.base == "none":
            scores = scores + bias
        return scores if block.bias is None else scores + block.bias
