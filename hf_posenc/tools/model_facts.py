"""What the tools need to know about a model's family: the attention projections LoRA wraps, the shape that memory
estimates use, and the window the model was trained at.

This is family knowledge: it belongs in the family modules (hf_posenc/families/), which will declare it (issue 11,
engine half). Until then the tools read it here, in one place.
"""

from __future__ import annotations

# PEFT target_modules regex (matched on the full module name) of the attention projections, per model type;
# every other supported type is LLaMA-style.
LORA_TARGETS = {
    "gpt2": r".*\.attn\.(c_attn|c_proj)",
    "bloom": r".*\.self_attention\.(query_key_value|dense)",
}
LLAMA_LORA_TARGETS = r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"


def lora_target_pattern(model) -> str:
    return LORA_TARGETS.get(model.config.model_type, LLAMA_LORA_TARGETS)


def model_shape(model) -> tuple[int, int, int, int]:
    """(hidden size, layers, attention heads, vocabulary) read from the config, under the names of every family."""
    config = model.config

    def first(*names: str, default: int) -> int:
        return int(next((getattr(config, n) for n in names if getattr(config, n, None)), default))

    return (first("hidden_size", "n_embd", default=512), first("num_hidden_layers", "n_layer", default=12),
            first("num_attention_heads", "n_head", default=8), first("vocab_size", default=32000))


def trained_window(model) -> int | None:
    """The model's original window: RoPE scaling keeps it as ``original_max_position_embeddings``."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    for value in (rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None,
                  getattr(config, "max_position_embeddings", None), getattr(config, "n_positions", None)):
        if value:
            return int(value)
    return None
