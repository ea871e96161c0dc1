"""Learned absolute positions: a trainable table added to the input embeddings (GPT-2's own mechanism)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import HIDDEN_MAX, NORMAL_REACH, PosEncConfig
from ..errors import PosEncError
from ..model_info import ModelInfo
from ..registry import register_method
from .base import AbsolutePositionMethod

DEFAULT_MAX_POSITIONS = 2048


@dataclass
class LearnedConfig(PosEncConfig):
    max_positions: int | None = None  # None: the model's window (max_position_embeddings / n_positions)
    # "auto": copy the model's own table where it has one (GPT-2), else "normal". "zeros" starts as NoPE.
    init: str = "auto"
    init_std: float = 0.02

    def validate(self) -> None:
        self.require_size("max_positions", 1, "table", none_means="the model's window")
        self.require_choice("init", ("auto", "native", "normal", "zeros"))
        self.require_number("init_std", 0.0, HIDDEN_MAX / NORMAL_REACH, why=(
            f"the table is added to the hidden states, whose squares must stay finite in float32: draws up to "
            f"{NORMAL_REACH:g} standard deviations must stay below {HIDDEN_MAX:.4g}"))


@register_method("learned", LearnedConfig)
class LearnedPositions(AbsolutePositionMethod):
    def __init__(self, config: LearnedConfig, info: ModelInfo):
        super().__init__(config, info)
        self.max_positions = config.max_positions or info.max_positions or DEFAULT_MAX_POSITIONS
        native = info.native_position_table
        init = config.init
        if init == "auto":
            init = "native" if native is not None else "normal"
        if init == "native" and native is None:
            raise PosEncError(
                f"LearnedConfig.init='native' needs a model with its own position table; {info.model_type} has "
                "none. Use init='normal' or 'zeros'."
            )
        weight = torch.zeros(self.max_positions, info.hidden_size)
        if init == "native":
            rows = min(self.max_positions, native.shape[0])
            weight[:rows] = native.detach()[:rows].float()
        elif init == "normal":
            weight.normal_(0.0, config.init_std)
        dtype = info.token_embedding.dtype if info.token_embedding is not None else torch.float32
        self.weight = nn.Parameter(weight.to(dtype))

    def embed(self, positions):
        if not torch.compiler.is_compiling():
            highest = int(positions.max())
            if highest >= self.max_positions:
                raise PosEncError(
                    f"Position {highest} is past the learned table (max_positions={self.max_positions}). Patch "
                    "with a larger table, e.g. patch_model(model, 'learned', max_positions=...), or use a method "
                    "defined at any length ('sinusoidal', 'alibi', 'rope')."
                )
        # Left-padded rows may carry negative positions on padding tokens; those outputs are masked anyway.
        return nn.functional.embedding(positions.clamp_min(0), self.weight)
