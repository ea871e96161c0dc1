"""What the basic methods compute (NoPE, ALiBi, learned, sinusoidal, RoPE): ALiBi's slopes, identity patches of a
family's own mechanism, float32 biases in low precision models, methods defined at any length, parameters only where
a method learns. (FIRE, T5, KERPLE, Sandwich, xPos: test_relative_biases.py; RoPE scalings: test_rope_scaling.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_posenc
from hf_posenc import PosEncError
from helpers import TOL, decode_token_by_token, left_pad, max_diff
from tiny_models import random_ids, tiny_model

RELATIVE_METHODS = ["fire", "t5", "kerple", "sandwich", "xpos"]


@pytest.mark.parametrize("method", ["nope", "rope", "sinusoidal", "alibi", "sandwich", "xpos"])
def test_parameter_free_methods_add_no_trainable_parameters(method):
    model = tiny_model("llama")
    count = sum(p.numel() for p in model.parameters())
    hf_posenc.patch_model(model, method)
    assert sum(p.numel() for p in model.parameters()) == count


def test_bf16_model_keeps_float32_bias():
    model = tiny_model("llama").to(torch.bfloat16)
    hf_posenc.patch_model(model, "alibi")
    method = hf_posenc.get_positional_module(model)
    positions = torch.tensor([[1000]])
    bias = method.bias(0, positions, torch.tensor([[0, 999]]))
    assert bias.dtype == torch.float32
    assert bias[0, 0, 0, 1].item() == pytest.approx(-method.head_slopes(torch.device("cpu"))[0].item())


@pytest.mark.parametrize("method", ["alibi", "nope", "rope", "sinusoidal"] + RELATIVE_METHODS)
def test_gpt2_runs_past_n_positions_with_methods_defined_at_any_length(method):
    # FIRE's threshold defaults to n_positions (32): past it, the per-query normaliser path is exercised too.
    model = hf_posenc.patch_model(tiny_model("gpt2"), method)
    length = model.config.n_positions + 16
    ids = random_ids(1, length)
    with torch.no_grad():
        full = model(ids).logits
        cached = decode_token_by_token(model, ids, DynamicCache(config=model.config))
    assert full.shape[1] == length and torch.isfinite(full).all()
    assert max_diff(full, cached) <= TOL


def test_learned_table_refuses_positions_past_its_end():
    model = hf_posenc.patch_model(tiny_model("gpt2"), "learned")
    with pytest.raises(PosEncError, match=r"Position 32 is past the learned table \(max_positions=32\)"):
        model(random_ids(1, 33))
    hf_posenc.patch_model(model, "learned", max_positions=64)
    assert torch.isfinite(model(random_ids(1, 48)).logits).all()


# 6. ALiBi slopes and identity patches -------------------------------------------------------------------------
def test_alibi_slopes_equal_bloom_for_1_to_64_heads():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    from hf_posenc.methods.alibi import bloom_slopes

    for heads in range(1, 65):
        assert torch.equal(bloom_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu"))), heads


def test_geometric_and_explicit_slopes():
    from hf_posenc.methods.alibi import geometric_slopes

    assert torch.allclose(geometric_slopes(8), torch.tensor([2.0 ** -(k) for k in range(1, 9)]))
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", slopes=[0.5, 0.25, 0.125, 0.0625])
    assert torch.equal(hf_posenc.get_positional_module(model).head_slopes(torch.device("cpu")),
                       torch.tensor([0.5, 0.25, 0.125, 0.0625]))


@pytest.mark.parametrize("model_type,method,exact", [
    ("llama", "rope", True), ("mistral", "rope", True), ("qwen2", "rope", True), ("qwen3", "rope", True),
    ("gpt2", "learned", True),
    # BLOOM's own ALiBi adds slope * j; ours adds -slope * (i - j). They differ by a constant per query row,
    # which softmax removes, so the logits agree to float rounding rather than bit for bit.
    ("bloom", "alibi", False),
])
def test_native_method_is_an_identity(model_type, method, exact):
    model = tiny_model(model_type)
    ids = random_ids(2, 12)
    ids_padded, mask = left_pad([ids[0], ids[1, :7]])
    with torch.no_grad():
        original = model(ids).logits
        original_padded = model(ids_padded, attention_mask=mask).logits
        hf_posenc.patch_model(model, method)
        patched = model(ids).logits
        patched_padded = model(ids_padded, attention_mask=mask).logits
    if exact:
        assert torch.equal(original, patched)
    else:
        assert max_diff(original, patched) <= 1e-5
    assert max_diff(original_padded[mask.bool()], patched_padded[mask.bool()]) <= 1e-5


def test_rope_theta_option_changes_llama_and_gpt2():
    llama = tiny_model("llama")
    ids = random_ids(1, 20)
    with torch.no_grad():
        native = llama(ids).logits
        hf_posenc.patch_model(llama, "rope", theta=500.0)
        assert max_diff(llama(ids).logits, native) > 1e-3
        hf_posenc.patch_model(llama, "rope", theta=10000.0)  # the model's own theta: the identity again
        assert torch.equal(llama(ids).logits, native)
    gpt2 = hf_posenc.patch_model(tiny_model("gpt2"), "rope")
    assert hf_posenc.get_positional_module(gpt2).theta == 10000.0


@pytest.mark.parametrize("method,options", [("alibi", {"trainable": True}), ("learned", {}), ("fire", {}), ("t5", {}),
                                            ("kerple", {})])
def test_methods_that_learn_add_their_parameters_to_the_model(method, options):
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
    params = list(hf_posenc.get_positional_module(model).parameters())
    assert params and all(p.requires_grad for p in params)
    assert all(any(p is q for q in model.parameters()) for p in params)
