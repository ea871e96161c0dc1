"""Base classes of the positional methods. A method is an nn.Module built from its config and the
model's ModelInfo; its kind says where it acts:

- "none":     nothing (NoPE);
- "absolute": `embed(positions)` is added to the input embeddings;
- "bias":     `bias(layer_idx, query_positions, key_positions)` is added to attention scores;
- "rotary":   `cos_sin(positions)` rotates queries and keys.

Everything here is computed in float32 whatever the model's dtype (a bf16 bias or frequency table
loses the precision that long contexts need).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from ..config import PosEncConfig
from ..model_info import ModelInfo


class PositionalMethod(nn.Module):
    kind: ClassVar[str] = "none"

    def __init__(self, config: PosEncConfig, info: ModelInfo):
        super().__init__()
        self.config = config
        self.num_heads = info.num_heads

    def extra_repr(self) -> str:
        return repr(self.config)


class AbsolutePositionMethod(PositionalMethod):
    kind: ClassVar[str] = "absolute"

    def embed(self, positions: torch.Tensor) -> torch.Tensor:
        """positions [B or 1, q] (long) -> float32 [B or 1, q, hidden]."""
        raise NotImplementedError


class AttentionBiasMethod(PositionalMethod):
    kind: ClassVar[str] = "bias"

    def bias(self, layer_idx: int, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """query_positions [B or 1, q], key_positions [B or 1, kv] -> float32 [B or 1, heads, q, kv].

        Only entries with key position <= query position are used (the rest are masked)."""
        raise NotImplementedError


class RotaryMethod(PositionalMethod):
    kind: ClassVar[str] = "rotary"

    def is_native(self, info: ModelInfo) -> bool:
        """True when the model's own rotary embedding already computes exactly this method."""
        return False

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B or 1, q] -> float32 (cos, sin), each [B or 1, q, rotary_dim]."""
        raise NotImplementedError


def relative_distance(query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
    """i - j as float32 [B or 1, 1, q, kv]."""
    return (query_positions[:, None, :, None] - key_positions[:, None, None, :]).float()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout that LLaMA checkpoints use; cos/sin broadcast over x."""
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin
