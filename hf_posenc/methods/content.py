"""What the content methods (fox, stick-breaking, cope, transformer-xl) share: the `base` option, and keeping the
model's own mechanism underneath where it is a bias the shared attention path must add (BLOOM's ALiBi).

`base="none"` removes the model's own positional mechanism (exactly as `nope` does) and the method alone orders
tokens; `base="native"` keeps it: on LLaMA-family models the queries and keys reach the method RoPE-rotated (the
cache holds rotated keys, as native), on GPT-2 the learned `wpe` stays, on BLOOM the attention path adds ALiBi's
-slope_h * (i - j) (the relative form of BLOOM's slope_h * j: equal after the softmax, which is invariant to a
per-row constant).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PosEncConfig
from ..model_info import ModelInfo
from .alibi import bloom_slopes
from .base import ContentMethod, relative_distance

BASES = ("none", "native")


@dataclass
class ContentConfig(PosEncConfig):
    base: str = "none"  # "none": replace the model's positional mechanism; "native": keep it and add the method

    def validate(self) -> None:
        self.require_choice("base", BASES)


class ContentAttention(ContentMethod):
    """A ContentMethod that keeps BLOOM's ALiBi under base="native" (see the module docstring)."""

    def __init__(self, config: ContentConfig, info: ModelInfo):
        super().__init__(config, info)
        # Fixed, out of the state dict (as BLOOM's own slopes are), float32 whatever the model's dtype.
        self._native_slopes = bloom_slopes(info.num_heads) if (config.base == "native"
                                                               and info.native_method == "alibi") else None

    def native_bias(self, layer_idx, query_positions, key_positions):
        if self._native_slopes is None:
            return None
        slopes = self._native_slopes.to(query_positions.device)
        return -slopes[None, :, None, None] * relative_distance(query_positions, key_positions)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension in float32, scaled by `weight` (broadcast), returned in x's dtype."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
