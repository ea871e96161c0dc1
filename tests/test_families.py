"""What each model family knows about its models, per model type: the shape fields of its config, the trained
window, the attention projections LoRA adapts, and which patches plain transformers computes itself."""

from __future__ import annotations

import re

import pytest

import hf_posenc
from hf_posenc import PosEncError
from hf_posenc.registry import get_family
from helpers import MODEL_TYPES, patch_for_contract
from tiny_models import CONFIGS, tiny_model

# The config fields each family reads its shape from, as transformers names them.
SHAPE_FIELDS = {
    "llama": dict(num_layers="num_hidden_layers", num_heads="num_attention_heads", num_kv_heads="num_key_value_heads",
                  hidden_size="hidden_size", vocab_size="vocab_size"),
    "gpt2": dict(num_layers="n_layer", num_heads="n_head", num_kv_heads="n_head", hidden_size="n_embd",
                 vocab_size="vocab_size"),
    "bloom": dict(num_layers="n_layer", num_heads="n_head", num_kv_heads="n_head", hidden_size="hidden_size",
                  vocab_size="vocab_size"),
}
# The projections PEFT's regexes named per family before the family said it (the fine-tuning tool's table).
LORA_PATTERNS = {
    "llama": r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
    "gpt2": r".*\.attn\.(c_attn|c_proj)",
    "bloom": r".*\.self_attention\.(query_key_value|dense)",
}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_model_info_reads_the_shape_fields_of_the_config(model_type):
    model = tiny_model(model_type)
    family = get_family(model.config)
    info = family.model_info(model)
    for fact, field in SHAPE_FIELDS[family.name].items():
        assert getattr(info, fact) == getattr(model.config, field), fact
    assert info.head_dim == 16 and info.model_type == model_type
    assert info.vocab_size == model.get_input_embeddings().weight.shape[0]


@pytest.mark.parametrize("model_type,window", [("llama", 64), ("mistral", 64), ("qwen2", 64), ("qwen3", 64),
                                               ("gpt2", 32), ("bloom", None)])
def test_trained_window_is_the_window_the_config_states(model_type, window):
    model = tiny_model(model_type)
    family = get_family(model.config)
    assert family.trained_window(model) == window
    if family.native_method == "rope":  # a RoPE scaling written into the config keeps the original window
        patch_for_contract(model, "yarn")
        assert model.config.max_position_embeddings == 4 * window
        assert family.trained_window(model) == window


def test_trained_window_of_a_config_scaled_before_loading():
    config = CONFIGS["llama"]()
    config.rope_parameters = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0,
                              "original_max_position_embeddings": 32}
    from transformers import AutoModelForCausalLM

    assert get_family(config).trained_window(AutoModelForCausalLM.from_config(config)) == 32


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_lora_target_modules_are_every_attention_projection(model_type):
    model = tiny_model(model_type)
    family = get_family(model.config)
    targets = family.lora_target_modules(model)
    modules = dict(model.named_modules())
    assert len(targets) == model.config.num_hidden_layers * len(family.attention_projections)
    assert all(hasattr(modules[name], "weight") for name in targets)
    pattern = re.compile(LORA_PATTERNS[family.name] + "$")
    assert targets == [name for name in modules if pattern.match(name)]
    hf_posenc.patch_model(model, "alibi")  # a patch adds no projection
    assert family.lora_target_modules(model) == targets


def test_lora_targets_come_from_the_family_so_an_unknown_model_type_is_refused():
    model = tiny_model("llama")
    model.config.model_type = "unknown-type"
    with pytest.raises(PosEncError, match="model_type 'unknown-type' is not supported"):
        get_family(model.config).lora_target_modules(model)


@pytest.mark.parametrize("model_type,method,native", [
    ("llama", "rope", True), ("qwen3", "rope", True), ("llama", "yarn", True), ("mistral", "llama3", True),
    ("llama", "dynamic-yarn", False),  # not a transformers type
    ("llama", "alibi", False), ("llama", "nope", False),
    ("gpt2", "rope", False), ("gpt2", "learned", False),  # a new table, with state of its own
    ("bloom", "alibi", False), ("bloom", "yarn", False),
])
def test_is_native_says_when_plain_transformers_computes_the_patch(model_type, method, native):
    model = patch_for_contract(tiny_model(model_type), method)
    assert get_family(model.config).is_native(model, hf_posenc.get_positional_module(model)) is native


@pytest.mark.parametrize("method", ["kerple", "fox"])
def test_bloom_takes_the_kernels_unless_its_weights_are_asked_for(method):
    # BLOOM's config always says "eager" (transformers has no other implementation for it); the patched attention
    # returns weights only when output_attentions asks, and otherwise runs what LLaMA under sdpa runs.
    import torch

    from hf_posenc import attention
    from helpers import left_pad, max_diff
    from tiny_models import random_ids

    model = hf_posenc.patch_model(tiny_model("bloom"), method).eval()
    ids, mask = left_pad([random_ids(1, 20)[0], random_ids(1, 13)[0]])
    with torch.no_grad():
        attention.last_paths.clear()
        plain = model(ids).logits
        fast = dict(attention.last_paths)
        attention.last_paths.clear()
        eager = model(ids, output_attentions=True)
        slow = dict(attention.last_paths)
        padded = model(ids, attention_mask=mask, output_attentions=True)
        padded_plain = model(ids, attention_mask=mask).logits
    layers = model.config.num_hidden_layers
    if method == "fox":  # (a bias method's blocks count "blocked" either way: tests/test_triton_path.py has BLOOM)
        assert fast.get("separable causal") == layers and "separable causal" not in slow, (fast, slow)
    assert max_diff(plain, eager.logits) <= 1e-5
    keep = mask.bool()
    assert max_diff(padded_plain[keep], padded.logits[keep]) <= 1e-5
    for weights in (eager.attentions, padded.attentions):
        assert len(weights) == layers and weights[0].shape == (2, model.config.n_head, 20, 20)
        assert torch.allclose(weights[0].sum(-1), torch.ones(()), atol=1e-5)
    assert torch.equal(padded.attentions[0][1, :, -1, :7], torch.zeros(model.config.n_head, 7))  # the pads
