"""RoPE (Su et al. 2021): rotate queries and keys by position-dependent angles theta^(-2k/d) * position."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import RotaryMethod

DEFAULT_THETA = 10000.0


def theta_to_build_on(info: ModelInfo, method: str, what: str) -> float:
    """The RoPE theta that a method working on RoPE (``what`` it does, for the message) builds on: the model's own,
    else that of the `rope` patch it replaces; refused on a model that has neither."""
    theta = info.rope_theta or info.patched_rope_theta
    if theta is None:
        raise PosEncError(
            f"{method!r} {what}, and this {info.model_type} model has no rotary embedding. Patch it to 'rope' first: "
            f"patch_model(model, 'rope'), then patch_model(model, {method!r}, ...).")
    return theta


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """theta^(-2k/dim) for k < dim/2, computed as transformers' default RoPE computes it."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@dataclass
class RopeConfig(PosEncConfig):
    theta: float | None = None  # None: the model's own theta where it has one, else 10000

    def validate(self) -> None:
        self.require_number("theta", MIN_BASE, none_means="the model's own, else 10000", why=BASE_WHY)


@register_method("rope", RopeConfig)
class Rope(RotaryMethod):
    def __init__(self, config: RopeConfig, info: ModelInfo):
        super().__init__(config, info)
        if info.head_dim % 2:
            raise PosEncError(f"RoPE needs an even head dimension; this model's is {info.head_dim}.")
        self.theta = float(config.theta or info.rope_theta or DEFAULT_THETA)
        dim = info.rotary_dim
        self._inv_freq = default_inv_freq(self.theta, dim)

    def is_native(self, info: ModelInfo) -> bool:
        return info.rope_theta is not None and (self.config.theta is None or self.theta == info.rope_theta)

    def native_config_update(self):
        return {"rope_parameters": {"rope_type": "default", "rope_theta": self.theta}}

    def frequencies(self, seq_len):
        return self._inv_freq, 1.0
