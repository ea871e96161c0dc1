"""Tiny random models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config,
                          Qwen3Config)

VOCAB = 97
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None}  # no EOS: generate runs full length

CONFIGS = {
    "llama": lambda: LlamaConfig(**SPECIAL_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "mistral": lambda: MistralConfig(**SPECIAL_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SPECIAL_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "qwen3": lambda: Qwen3Config(**SPECIAL_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                 max_position_embeddings=64),
    "gpt2": lambda: GPT2Config(**SPECIAL_TOKENS, vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32),
    "bloom": lambda: BloomConfig(**SPECIAL_TOKENS, vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
}

FAMILIES = ["llama", "gpt2", "bloom"]  # one model type per family for the full matrix


def tiny_model(model_type: str, attn_implementation: str | None = None, seed: int = 0):
    torch.manual_seed(seed)
    config = CONFIGS[model_type]()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    return model.eval()


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (batch, length), generator=generator)
