"""NoPE: no positional information at all (Kazemnejad et al. 2023); the causal mask alone orders tokens."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import PosEncConfig
from ..registry import register_method
from .base import PositionalMethod


@dataclass
class NopeConfig(PosEncConfig):
    pass


@register_method("nope", NopeConfig)
class NoPositions(PositionalMethod):
    """Adds nothing: the family only removes the model's own mechanism."""
