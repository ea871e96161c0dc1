"""What a positional method needs to know about the model it is built for."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelInfo:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int | None  # the trained window, where the config states one
    rope_theta: float | None  # None when the model has no rotary embedding of its own
    native_method: str  # "rope", "learned" or "alibi"
    token_embedding: torch.Tensor | None = None  # the input embedding matrix, for scale-matched inits
    native_position_table: torch.Tensor | None = None  # GPT-2's wpe, for the "learned" identity init
    # The model's own RoPE settings (LLaMA family), or those of the `rope` patch a scaling is applied on top of.
    rope_parameters: dict | None = None
    partial_rotary_factor: float = 1.0
    # The theta of a `rope` patch being replaced, on a model with no RoPE of its own: what a RoPE scaling scales.
    patched_rope_theta: float | None = None
    vocab_size: int | None = None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def original_window(self) -> int | None:
        """The window the model was trained with, before any RoPE scaling in its config."""
        return (self.rope_parameters or {}).get("original_max_position_embeddings") or self.max_positions
