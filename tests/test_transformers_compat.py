"""A patched model behaves as a transformers model where transformers users reach for it: set_attn_implementation,
config.output_attentions, GPT-2's 3-D input_ids and cross-attention, its state dict, base-model checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, GPT2DoubleHeadsModel, GPT2LMHeadModel

import hf_posenc

from helpers import max_diff
from tiny_models import CONFIGS, random_ids, tiny_model

TOL = 1e-5


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_set_attn_implementation_keeps_the_bias(model_type):
    model = hf_posenc.patch_model(tiny_model(model_type), "alibi")
    ids = random_ids(2, 9)
    with torch.no_grad():
        expected = model(ids).logits
        model.set_attn_implementation("eager")
        eager = model(ids, output_attentions=True)
        model.set_attn_implementation("sdpa")
        sdpa = model(ids).logits
        unpatched = hf_posenc.unpatch_model(model)(ids).logits
    assert max_diff(eager.logits, expected) < TOL and max_diff(sdpa, expected) < TOL
    assert eager.attentions[0].shape == (2, 4, 9, 9)  # the eager backend returns the weights
    assert max_diff(unpatched, expected) > 1e-2  # the bias mattered: dropping it would have been seen


def test_attention_implementation_the_path_cannot_serve_is_refused():
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(hf_posenc.PosEncError, match="set_attn_implementation\\('sdpa'\\).*unpatch_model"):
        model(random_ids(1, 4))


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_config_output_attentions_on_a_bias_patched_model(model_type):
    model = hf_posenc.patch_model(tiny_model(model_type, attn_implementation="eager"), "alibi")
    ids = random_ids(1, 7)
    with torch.no_grad():
        by_argument = model(ids, output_attentions=True)
        model.config.output_attentions = True
        by_config = model(ids)
    assert len(by_config.attentions) == 2
    assert all(torch.equal(a, b) for a, b in zip(by_config.attentions, by_argument.attentions))


@pytest.mark.parametrize("method", ["learned", "rope", "alibi"])
def test_gpt2_double_heads_3d_input_ids(method):
    torch.manual_seed(0)
    model = GPT2DoubleHeadsModel(CONFIGS["gpt2"]()).eval()
    ids = random_ids(6, 5).reshape(2, 3, 5)  # [batch, choices, length]
    with torch.no_grad():
        unpatched = model(ids).logits
        hf_posenc.patch_model(model, method)
        patched = model(ids).logits
        flat = model(ids.reshape(6, 5)).logits.reshape(2, 3, 5, -1)  # each choice on its own
    assert patched.shape == (2, 3, 5, model.config.vocab_size)
    assert max_diff(patched, flat) < TOL
    if method == "learned":  # GPT-2's own mechanism: an identity
        assert max_diff(patched, unpatched) < TOL


@pytest.mark.parametrize("method", ["alibi", "rope", "t5"])
def test_gpt2_cross_attention_keeps_plain_attention(method):
    config = CONFIGS["gpt2"]()
    config.add_cross_attention = True
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    ids, encoder_states = random_ids(2, 6), torch.randn(2, 3, config.n_embd)
    hf_posenc.patch_model(model, method)
    with torch.no_grad():
        logits = model(ids, encoder_hidden_states=encoder_states).logits
        # Cross-attention carries no positions: moving the encoder states around only permutes what it reads.
        permuted = model(ids, encoder_hidden_states=encoder_states.flip(1)).logits
    assert max_diff(logits, permuted) < TOL
    assert all(not hasattr(block.crossattention, "hf_posenc_state") for block in model.transformer.h)


def test_gpt2_learned_keeps_wpe_in_the_state_dict():
    model = tiny_model("gpt2")
    ids = random_ids(2, 7)
    keys = list(model.state_dict())
    with torch.no_grad():
        expected = model(ids).logits
        hf_posenc.patch_model(model, "learned")
        assert list(model.state_dict()) == keys
        assert max_diff(model(ids).logits, expected) < TOL
        hf_posenc.get_positional_module(model).weight[3] += torch.randn(model.config.n_embd)  # as after training
        trained = model(ids).logits
        plain = GPT2LMHeadModel.from_pretrained(None, config=model.config, state_dict=model.state_dict()).eval()
        assert max_diff(plain(ids).logits, trained) < TOL
    assert max_diff(trained, expected) > 1e-3


def test_gpt2_absolute_method_in_bfloat16_keeps_the_dtype():
    model = tiny_model("gpt2").to(torch.bfloat16)
    hf_posenc.patch_model(model, "sinusoidal")
    with torch.no_grad():
        assert model(random_ids(1, 5)).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("model_type, method", [("gpt2", "t5"), ("llama", "t5"), ("gpt2", "learned")])
def test_patched_base_model_checkpoint_loads_with_and_without_head(model_type, method, tmp_path):
    from hf_posenc.checkpoint import POSENC_CONFIG_NAME, load_saved_patch, read_metadata

    torch.manual_seed(0)
    base = hf_posenc.patch_model(AutoModel.from_config(CONFIGS[model_type]()).eval(), method)
    with torch.no_grad():
        for parameter in hf_posenc.get_positional_module(base).parameters():
            parameter.add_(torch.randn_like(parameter))  # as after training: not what a fresh patch builds
    ids = random_ids(2, 6)
    base.save_pretrained(tmp_path / "base")
    head = hf_posenc.from_pretrained(tmp_path / "base")  # base checkpoint -> model with a head
    head.save_pretrained(tmp_path / "head")
    plain_base = AutoModel.from_pretrained(tmp_path / "head")  # head checkpoint -> base model, as the plugin does
    load_saved_patch(plain_base, str(tmp_path / "head"), read_metadata(tmp_path / "head" / POSENC_CONFIG_NAME), {})
    with torch.no_grad():
        expected = base(ids).last_hidden_state
        assert max_diff(head.base_model(ids).last_hidden_state, expected) < TOL
        assert max_diff(plain_base(ids).last_hidden_state, expected) < TOL


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
def test_cache_names_follow_the_installed_transformers(model_type):
    """transformers 5.24 renamed the forward's and the outputs' `past_key_values` to `cache`: the engine reads
    either, and callers pass the one the installed forward takes (no deprecation warning on either version)."""
    import inspect
    import warnings

    from transformers import DynamicCache

    from hf_posenc.engine.cache_names import cache_argument, cache_keyword, cache_output, forward_cache_keyword

    model = tiny_model(model_type)
    name = forward_cache_keyword(model)
    assert name in inspect.signature(model.forward).parameters
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        output = model(random_ids(1, 5), **{name: cache}, use_cache=True)
        assert cache_output(output) is cache
    assert cache_argument({name: cache}) is cache and cache_keyword({name: cache}) == name
    assert cache_argument({}) is None and cache_keyword({}) == "past_key_values"
