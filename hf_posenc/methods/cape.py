"""CAPE, context-adaptive positional encoding (Zheng, Gao, Shi, Xiong, Sun, Li, Sun, Li, Zhang, NeurIPS 2024,
"DAPE: Data-Adaptive Positional Encoding for Length Extrapolation"; the authors' later name for it is CAPE): a small
MLP corrects a positional bias with the attention's content, per query-key pair.

With z_ij = scaling * q_i . k_j (one value per head), B_ij the bias of any registered attention-bias method (option
`bias`, default "alibi", built with `bias_options`), and f an MLP across the heads (as in the paper: the 2H values
[z_ij^(1..H), B_ij^(1..H)] -> `mlp_width` -> activation -> H values; `activation` "leaky_relu", slope 0.01, the
authors' in every DAPE module, or "gelu", erf's):

    base="none":    logits_ij = z_ij + B_ij + f(z_ij, B_ij)
    base="native":  logits_ij = z_ij + f(z_ij, B_ij)      (+ the model's own mechanism underneath)

Computed per query block; the MLP sees [B, rows, keys, 2H] at a time, never [L, L] for the whole sequence. On the CPU
a causal square whose bias is a table of distances (consecutive position ids, a bias method with `bias_table`) goes to
a fused kernel (engine/kernels/cpu_kernels/cape.cpp, found by the engine in engine/kernels/by_method.py): every head's
pairs of a tile in cache, the MLP per chunk of a row's pairs on register vectors, flash attention's softmax, the
backward recomputing each tile.

Init: the authors' nn.Linear default for each layer of f (weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in))),
drawn from a generator of its own (seed 0), except that on top of the model's own mechanism (base="native") the
output layer starts at zero: B enters only through f, so at init the method adds exactly nothing and the logits are
the original ones, whatever the activation (gradients then reach the output layer at once, the first layer once the
output layer has moved off zero). Alone (base="none") the bias itself is added too, as in the paper. The bias
method's parameters (FIRE's MLP, ALiBi's slopes with trainable=True, ...) are CAPE's, under `bias_method.*`.

Checkpoints saved before `activation` existed computed GELU: their saved options, which lack it, load as "gelu"
(`options_before`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..model_info import ModelInfo
from ..registry import available_methods, get_method, register_method
# The built-in bias methods CAPE may name, registered by importing them. Standalone export also ships the module of
# the one `bias` names, a user's method too (sub_configs).
from .alibi import Alibi  # noqa: F401
from .relative_biases import Fire, Kerple, Sandwich, T5Bias  # noqa: F401
from .base import AttentionBiasMethod
from .content import ContentAttention, ContentConfig

# nn.LeakyReLU's default slope below zero, which the authors' DAPE modules use (chuanyang-Zheng/CAPE,
# megatron/model/positional_embeddings.py AliBi_C and DAPE.py: nn.Sequential(Linear, nn.LeakyReLU(), Linear)).
LEAKY_RELU_SLOPE = 0.01


def leaky_relu(x: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(x, LEAKY_RELU_SLOPE)


ACTIVATIONS = {"leaky_relu": leaky_relu, "gelu": F.gelu}


def linear_init(layers: int, out_features: int, in_features: int, generator: torch.Generator):
    """nn.Linear's default init for each layer (kaiming_uniform_ with a = sqrt(5), i.e. U(-1/sqrt(fan_in),
    1/sqrt(fan_in)), for the weight and the bias alike) -> (weight [layers, out, in], bias [layers, out])."""
    bound = 1.0 / math.sqrt(in_features)

    def uniform(*shape):
        return (torch.rand(*shape, generator=generator) * 2 - 1) * bound

    return uniform(layers, out_features, in_features), uniform(layers, out_features)


@dataclass
class CapeConfig(ContentConfig):
    bias: str = "alibi"  # a registered attention-bias method
    bias_options: dict = field(default_factory=dict)  # its options
    mlp_width: int = 32
    activation: str = "leaky_relu"  # of the MLP: "leaky_relu" (slope 0.01, the authors') or "gelu"
    # Checkpoints saved before the option existed computed GELU.
    options_before: ClassVar[dict[str, Any]] = {"activation": "gelu"}

    def validate(self) -> None:
        super().validate()
        bias_methods = sorted(name for name in available_methods()
                              if issubclass(get_method(name).module_class, AttentionBiasMethod))
        if not (isinstance(self.bias, str) and self.bias in bias_methods):
            self.refuse("bias", "is not a registered attention-bias method", " or ".join(map(repr, bias_methods)))
        if not isinstance(self.bias_options, dict):
            self.refuse("bias_options", "is not a dict", "the bias method's options as a dict, e.g. {}")
        self.require_size("mlp_width", 1, "width")
        self.require_choice("activation", tuple(ACTIVATIONS))

    def sub_configs(self):
        return [get_method(self.bias).config_class.from_options(**self.bias_options)]


@register_method("cape", CapeConfig)
class ContextAdaptivePositions(ContentAttention):
    scores_maskable_in_place = True
    reads_position_span = True

    def __init__(self, config: CapeConfig, info: ModelInfo):
        super().__init__(config, info)
        spec = get_method(config.bias)
        self.bias_method = spec.module_class(spec.config_class.from_options(**config.bias_options), info)
        layers, heads, width = info.num_layers, info.num_heads, config.mlp_width
        generator = torch.Generator().manual_seed(0)
        input_weight, input_bias = linear_init(layers, width, 2 * heads, generator)
        output_weight, output_bias = linear_init(layers, heads, width, generator)
        if config.base == "native":  # f starts at zero: the model's own logits exactly
            output_weight, output_bias = output_weight.zero_(), output_bias.zero_()
        self.input_weight = nn.Parameter(input_weight)
        self.input_bias = nn.Parameter(input_bias)
        self.output_weight = nn.Parameter(output_weight)
        self.output_bias = nn.Parameter(output_bias)
        # float32 [B, H, r, k] tensors per block: logits, bias, the MLP's input (2H) and hidden (2 x width) per pair.
        self.block_cost = 4.0 + (2 * heads + 2 * width) / heads
        self.leaky_relu_slope = LEAKY_RELU_SLOPE  # what the fused kernel (engine/kernels/by_method.py) reads

    def content_scores(self, query, key, block):
        layer = block.layer_idx
        compute = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for float64 inputs
        logits = torch.matmul(query, key.transpose(2, 3)).to(compute) * block.scaling
        bias = self.bias_method.block_bias(layer, block.query_positions, block.key_positions, block.span)
        bias = bias.to(compute).expand_as(logits)
        pairs = torch.cat((logits, bias), dim=1).permute(0, 2, 3, 1)  # [B, r, k, 2H]
        activation = ACTIVATIONS[self.config.activation]
        hidden = activation(F.linear(pairs, self.input_weight[layer].to(compute), self.input_bias[layer].to(compute)))
        correction = F.linear(hidden, self.output_weight[layer].to(compute), self.output_bias[layer].to(compute))
        scores = logits + correction.permute(0, 3, 1, 2)
        if self.config.base == "none":
            scores = scores + bias
        return scores if block.bias is None else scores + block.bias
