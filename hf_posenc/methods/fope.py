"""FoPE (Hua et al. 2024, "Fourier Position Embedding: Enhancing Attention's Periodic Extension for Length
Generalization"): each rotary dimension is a Fourier series over all the frequencies instead of a single one, and
the frequencies too low to be trained within the window (w_k < 2 pi / L: less than one period over the training
length L) are clipped to 0:

    cos'_m(p) = sum_k C_km cos(w_k p),   sin'_m(p) = sum_k S_km sin(w_k p),
    q' = q * cos' + rotate_half(q) * sin'   (the same for keys, in the half-split layout),

with trainable C and S [d/2, d/2]. A clipped frequency contributes a constant (cos 1, sin 0). init="rope" starts C
and S at the identity (the extra Fourier terms at zero): with clip_floor=False that is exactly the model's own RoPE
(its logits), with clip_floor=True (the paper's FoPE) it is RoPE with the floor frequencies clipped. init="random"
adds N(0, sigma^2) to every coefficient (the paper's random Fourier coefficients). By default the coefficients are
shared by heads and layers: the rotation stays a cos/sin pair per dimension, which every family applies before the
KV cache as native RoPE does. per_head=True gives every key-value head its own C and S (the paper's are per head;
GQA query heads share their key head's), rotated inside the shared attention path with the keys cached un-rotated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..config import BASE_WHY, MAX_DISTANCE, MIN_BASE, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import RotaryMethod, rotate_per_head
from .rope import DEFAULT_THETA, default_inv_freq

DEFAULT_WINDOW = 2048


@dataclass
class FopeConfig(PosEncConfig):
    init: str = "rope"  # "rope": identity coefficients; "random": identity + N(0, sigma^2)
    sigma: float = 0.1  # std of the random coefficients (init="random"; our default, the paper tunes it)
    clip_floor: bool = True  # zero the frequencies with less than one period in the window
    window: int | None = None  # the training length L of the floor 2 pi / L; None: the model's window, else 2048
    theta: float | None = None  # RoPE base; None: the model's own, else 10000
    per_head: bool = False  # coefficients per key-value head (rotated inside the attention path), not shared

    def validate(self) -> None:
        self.require_choice("init", ("rope", "random"))
        self.require_number("sigma", 0.0, 1.0)
        self.require_bool("clip_floor")
        self.require_int("window", 1, MAX_DISTANCE, none_means="the model's window, else 2048")
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_bool("per_head")


@register_method("fope", FopeConfig)
class Fope(RotaryMethod):
    def __init__(self, config: FopeConfig, info: ModelInfo):
        super().__init__(config, info)
        dim = info.rotary_dim
        if dim % 2:
            raise PosEncError(f"FoPE needs an even rotary dimension; this model's is {dim}.")
        self.initial_theta = float(config.theta or info.rope_theta or info.patched_rope_theta or DEFAULT_THETA)
        inv_freq = default_inv_freq(self.initial_theta, dim)
        if config.clip_floor:
            self.window = config.window or info.original_window or DEFAULT_WINDOW
            inv_freq = torch.where(inv_freq < 2 * math.pi / self.window, torch.zeros_like(inv_freq), inv_freq)
        self._inv_freq = inv_freq
        self.heads = info.num_kv_heads if config.per_head else None
        if config.per_head:
            # A cos/sin per head cannot go through the layers' own rotation (one cos/sin for all heads): rotate
            # queries and the un-rotated key cache inside the shared attention path instead.
            self.rotates_in_attention = True
        self.cos_coefficients = nn.Parameter(self.initial_coefficients(dim // 2))
        self.sin_coefficients = nn.Parameter(self.initial_coefficients(dim // 2))

    def initial_coefficients(self, size: int) -> torch.Tensor:
        heads = () if self.heads is None else (self.heads,)
        identity = torch.eye(size).expand(*heads, size, size).clone()
        if self.config.init == "random":
            return identity + self.config.sigma * torch.randn(*heads, size, size)
        return identity

    def frequencies(self, seq_len):
        return self._inv_freq, 1.0

    def cos_sin(self, positions, seq_len=0):
        """positions [B or 1, q] -> (cos, sin) float32 [B or 1, q, rotary_dim] ([B or 1, q, kv heads, rotary_dim]
        per head)."""
        angles = positions[..., None].float() * self._inv_freq.to(positions.device)
        if self.heads is None:
            cos = angles.cos() @ self.cos_coefficients.float()
            sin = angles.sin() @ self.sin_coefficients.float()
        else:
            cos = torch.einsum("zqk,hkm->zqhm", angles.cos(), self.cos_coefficients.float())
            sin = torch.einsum("zqk,hkm->zqhm", angles.sin(), self.sin_coefficients.float())
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def rotate_heads(self, x, rotation):
        if self.heads is None:
            return super().rotate_heads(x, rotation)
        return rotate_per_head(x, rotation, self.heads)
