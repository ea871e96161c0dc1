"""2-D RoPE (Heo et al. 2024, "Rotary Position Embedding for Vision Transformer"): RoPE over 2-D positions (row y,
column x), given as `position_ids` of shape [B, L, 2], for decoders over patch grids:

- "axial": half of the rotary pairs turn with the column, half with the row, each with RoPE frequencies over d/4:
  angle_k = x * w_k for k < d/4, y * w_(k - d/4) otherwise (fixed: no parameters);
- "mixed": every pair turns with both, angle_k = x * wx_k + y * wy_k, with trainable frequencies wx and wy
  (RoPE-Mixed; the paper learns them per head and layer; by default one set shared by heads and layers, as the
  cos/sin of LLaMA-family layers are; per_head=True gives one set per key-value head and per_layer=True one set per
  layer, both together the paper's; either rotates inside the shared attention path by the coordinates of the
  queries and of the cached keys, the cos/sin computed once per forward and layer).

Either way q_(y,x) . k_(y',x') depends on (y' - y, x' - x) only. Mixed, init="rope" starts wx at the model's own
RoPE frequencies and wy at 0: on a 1 x L grid (row 0, column = token position), which is what a call without
position_ids gets, that is the model's own RoPE (its logits exactly). init="random": wx_k = w_k cos(phi_k),
wy_k = w_k sin(phi_k), phi_k ~ U[0, 2 pi) (the paper's init). The axial variant has no such state: on a 1 x L grid
its row pairs do not turn. 1-D position_ids are refused: a token's place on the grid cannot be guessed from one
number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import RotaryMethod, rotate_per_head
from .rope import DEFAULT_THETA, default_inv_freq


@dataclass
class Rope2dConfig(PosEncConfig):
    variant: str = "mixed"  # "mixed" (trainable frequencies) or "axial" (fixed, half the pairs per axis)
    init: str = "rope"  # mixed: "rope" (the model's RoPE on a 1 x L grid) or "random" (the paper's random angles)
    theta: float | None = None  # RoPE base; None: the model's own, else 10000
    per_head: bool = False  # mixed: frequencies per key-value head (rotated inside the attention path), not shared
    per_layer: bool = False  # mixed: frequencies per layer (rotated inside the attention path), as the paper's

    def validate(self) -> None:
        self.require_choice("variant", ("mixed", "axial"))
        self.require_choice("init", ("rope", "random"))
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_bool("per_head")
        self.require_bool("per_layer")
        for name in ("per_head", "per_layer"):
            if getattr(self, name) and self.variant == "axial":
                self.refuse(name, f"has nothing to learn per {name[4:]} with variant='axial' (fixed frequencies)",
                            "False, or variant='mixed'")


@register_method("rope-2d", Rope2dConfig)
class Rope2d(RotaryMethod):
    position_axes = 2

    def __init__(self, config: Rope2dConfig, info: ModelInfo):
        super().__init__(config, info)
        dim = info.rotary_dim
        if dim % 4:
            raise PosEncError(f"2-D RoPE needs a rotary dimension divisible by 4; this model's is {dim}.")
        self.initial_theta = float(config.theta or info.rope_theta or info.patched_rope_theta or DEFAULT_THETA)
        self.heads = info.num_kv_heads if config.per_head else None
        if config.variant == "axial":
            quarter = default_inv_freq(self.initial_theta, dim // 2)
            zeros = torch.zeros_like(quarter)
            self._column_rates, self._row_rates = torch.cat((quarter, zeros)), torch.cat((zeros, quarter))
            return
        if config.per_head or config.per_layer:
            # A cos/sin per head or layer cannot go through the layers' own rotation (one cos/sin for all heads and
            # layers): rotate queries and the un-rotated key cache inside the shared attention path, by the tokens'
            # coordinates.
            self.rotates_in_attention = True
        self.per_layer_rotation = config.per_layer
        rates = default_inv_freq(self.initial_theta, dim)
        if self.heads is not None:
            rates = rates.expand(self.heads, -1).clone()
        if config.per_layer:
            rates = rates.expand(info.num_layers, *rates.shape).clone()  # [layers, (heads,) d/2]
        if config.init == "rope":
            column, row = rates, torch.zeros_like(rates)
        else:
            phase = 2 * math.pi * torch.rand_like(rates)
            column, row = rates * phase.cos(), rates * phase.sin()
        self.column_rates = nn.Parameter(column)
        self.row_rates = nn.Parameter(row)

    def rates(self, layer_idx: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(column, row) angular rates per rotary pair of layer `layer_idx`, float32 [(kv heads,) d/2] each."""
        if self.config.variant == "axial":
            return self._column_rates, self._row_rates
        if self.config.per_layer:
            return self.column_rates[layer_idx].float(), self.row_rates[layer_idx].float()
        return self.column_rates.float(), self.row_rates.float()

    def default_coordinates(self, positions):
        return torch.stack((torch.zeros_like(positions), positions), dim=-1)

    def cos_sin(self, positions, seq_len=0, layer_idx: int = 0):
        """positions [B or 1, q, 2] (row, column) -> float32 (cos, sin), each [B or 1, q, rotary_dim] ([B or 1, q,
        kv heads, rotary_dim] per head), with layer `layer_idx`'s rates (per_layer)."""
        column, row = (rate.to(positions.device) for rate in self.rates(layer_idx))
        coordinates = positions.float()
        if self.heads is not None:
            coordinates = coordinates[..., None, :]  # [B, q, 1, 2] against rates [heads, d/2]
        angles = coordinates[..., 1:] * column + coordinates[..., :1] * row
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def layer_rotation(self, layer_idx, positions, seq_len=0):
        return self.cos_sin(positions, seq_len, layer_idx)

    def rotate_heads(self, x, rotation):
        if self.heads is None:
            return super().rotate_heads(x, rotation)
        return rotate_per_head(x, rotation, self.heads)
