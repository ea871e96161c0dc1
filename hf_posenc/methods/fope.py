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

The formula above, a series over all d/2 frequencies with the clipped ones as constant terms, is the paper's text.
The authors' released code (every released configuration sets `fourier_ignore_zero=True`) has another structure,
`ignore_zero_frequencies=True` here: the zero frequencies are dropped as inputs (C and S are [n, m] over the n
non-zero frequencies), only the first m = min(n, d/4) planes get a series, and the other d/2 - m planes get
cos' = sin' = 1 (a fixed map, x * 1 + rotate_half(x) * 1, the same at every position). init="rope" there is the
authors' "step identity": plane i starts as non-zero frequency i * ceil(n / m), so it is not the model's RoPE.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BASE_WHY, MIN_BASE, PosEncConfig
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
    ignore_zero_frequencies: bool = False  # the released code's structure (fourier_ignore_zero): see the docstring

    def validate(self) -> None:
        self.require_choice("init", ("rope", "random"))
        self.require_number("sigma", 0.0, 1.0)
        self.require_bool("clip_floor")
        self.require_size("window", 1, "positions", none_means="the model's window, else 2048")
        self.require_number("theta", MIN_BASE, none_means="the model's own RoPE theta, else 10000", why=BASE_WHY)
        self.require_bool("per_head")
        self.require_bool("ignore_zero_frequencies")


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
        self.planes = dim // 2
        # The series' input frequencies and the planes that get a series (the others get cos' = sin' = 1).
        self._series_freq, self.series_planes = inv_freq, self.planes
        if config.ignore_zero_frequencies:
            # As the authors' FourierEmbedding with fourier_ignore_zero: inputs are the non-zero frequencies, outputs
            # the first min(n, head_dim // 4) planes (Fourier-Position-Embedding, olmo/model.py).
            self._series_freq = inv_freq[inv_freq != 0]
            self.series_planes = min(len(self._series_freq), dim // 4)
            if self.series_planes == 0:
                raise PosEncError(
                    f"FoPE with ignore_zero_frequencies=True has no plane to give a series: "
                    f"{len(self._series_freq)} non-zero frequencies, rotary dimension {dim}. Pass a larger window "
                    "(fewer frequencies below the floor), clip_floor=False, or ignore_zero_frequencies=False.")
        self.heads = info.num_kv_heads if config.per_head else None
        if config.per_head:
            # A cos/sin per head cannot go through the layers' own rotation (one cos/sin for all heads): rotate
            # queries and the un-rotated key cache inside the shared attention path instead.
            self.rotates_in_attention = True
        inputs = len(self._series_freq)
        self.cos_coefficients = nn.Parameter(self.initial_coefficients(inputs, self.series_planes))
        self.sin_coefficients = nn.Parameter(self.initial_coefficients(inputs, self.series_planes))

    def initial_coefficients(self, inputs: int, outputs: int) -> torch.Tensor:
        """[(heads,) inputs, outputs]: the identity (square), or the authors' step identity, 1 at (i * step, i)
        with step = ceil(inputs / outputs); plus N(0, sigma^2) for init="random"."""
        heads = () if self.heads is None else (self.heads,)
        step = -(-inputs // outputs)
        identity = torch.zeros(inputs, outputs)
        identity[torch.arange(outputs) * step, torch.arange(outputs)] = 1.0
        identity = identity.expand(*heads, inputs, outputs).clone()
        if self.config.init == "random":
            return identity + self.config.sigma * torch.randn(*heads, inputs, outputs)
        return identity

    def frequencies(self, seq_len):
        return self._inv_freq, 1.0

    def cos_sin(self, positions, seq_len=0):
        """positions [B or 1, q] -> (cos, sin) float32 [B or 1, q, rotary_dim] ([B or 1, q, kv heads, rotary_dim]
        per head)."""
        angles = positions[..., None].float() * self._series_freq.to(positions.device)
        if self.heads is None:
            cos = angles.cos() @ self.cos_coefficients.float()
            sin = angles.sin() @ self.sin_coefficients.float()
        else:
            cos = torch.einsum("zqk,hkm->zqhm", angles.cos(), self.cos_coefficients.float())
            sin = torch.einsum("zqk,hkm->zqhm", angles.sin(), self.sin_coefficients.float())
        if self.series_planes < self.planes:  # the authors pad the planes without a series with 1, cos and sin alike
            padding = (0, self.planes - self.series_planes)
            cos, sin = F.pad(cos, padding, value=1.0), F.pad(sin, padding, value=1.0)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)

    def rotate_heads(self, x, rotation):
        if self.heads is None:
            return super().rotate_heads(x, rotation)
        return rotate_per_head(x, rotation, self.heads)
