"""Attention transfer, layer by layer (tools/finetune/attention_transfer.py, issue 55): each layer's loss against a
hand computation from the original's captured input, where its gradient goes, and identity patches giving 0."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_posenc
from hf_posenc.tools.finetune.attention_transfer import attention_modules, attention_transfer_loss, capture_targets
from hf_posenc.tools.finetune.teacher import Teacher
from tiny_models import FAMILIES, random_ids, tiny_model


def captured_inputs(model, ids) -> list[torch.Tensor]:
    """Each layer's attention input in a plain forward of `model`."""
    inputs, handles = [], []
    for attention in attention_modules(model):
        handles.append(attention.register_forward_pre_hook(
            lambda m, args, kwargs: inputs.append(kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True))
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    return inputs


def llama_attention(attention, x: torch.Tensor, rotation=None, norms=None) -> torch.Tensor:
    """A LLaMA attention layer in float64 by hand: GQA, causal softmax at 1/sqrt(D), o_proj; `rotation`: RoPE's
    (cos, sin); `norms`: DroPE's (query weight, key weight, eps), RMSNorm across each token's heads."""
    config = attention.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    batch, length, _ = x.shape
    x = x.double()

    def project(linear):
        return x @ linear.weight.double().T

    q, k, v = project(attention.q_proj), project(attention.k_proj), project(attention.v_proj)
    if norms is not None:
        query_weight, key_weight, eps = norms
        q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + eps) * query_weight.double()
        k = k / torch.sqrt(k.pow(2).mean(-1, keepdim=True) + eps) * key_weight.double()
    q = q.view(batch, length, heads, dim).transpose(1, 2)
    k = k.view(batch, length, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    v = v.view(batch, length, kv_heads, dim).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    if rotation is not None:
        q, k = apply_rotary_pos_emb(q, k, *(part.double() for part in rotation))
    logits = q @ k.transpose(-1, -2) / math.sqrt(dim)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    out = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1) @ v
    return out.transpose(1, 2).reshape(batch, length, heads * dim) @ attention.o_proj.weight.double().T


@pytest.mark.parametrize("method", ["nope", "drope"])
def test_each_layers_loss_is_the_hand_computation_from_the_original_input(method):
    original = tiny_model("llama")
    ids = random_ids(2, 12)
    inputs = captured_inputs(original, ids)
    rotation = original.model.rotary_emb(inputs[0], torch.arange(12)[None])
    student = hf_posenc.patch_model(tiny_model("llama"), method)
    module = hf_posenc.get_positional_module(student)
    with torch.no_grad():  # norms off 1, so that they act
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    teacher = Teacher.original(original, frozen_base=False)  # a frozen copy: `original` stays unpatched
    mean, per_layer = attention_transfer_loss(student, teacher, {"input_ids": ids})
    assert per_layer.shape == (2,)
    for layer, (x, attention) in enumerate(zip(inputs, attention_modules(student))):
        norms = (module.query_norm[layer], module.key_norm[layer], module.config.norm_eps) if method == "drope" \
            else None
        target = llama_attention(attention_modules(original)[layer], x, rotation)
        patched = llama_attention(attention, x, norms=norms)
        expected = (patched - target).pow(2).sum() / target.pow(2).sum()
        assert abs(per_layer[layer].item() - expected.item()) <= 1e-5 * expected.item()
    assert torch.allclose(mean, per_layer.mean())
    assert per_layer.min() > 1e-6  # the layers' own inputs: a loss that only the first layer has would fail above


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_gradient_reaches_the_attention_and_the_patch_alone(model_type):
    model = tiny_model(model_type)
    teacher = Teacher.original(model, frozen_base=True)  # the unpatched view of the same weights
    hf_posenc.patch_model(model, "alibi", trainable=True)
    model.train()
    model.requires_grad_(True)  # everything may train: only what the loss reaches gets a gradient
    mean, per_layer = attention_transfer_loss(model, teacher, {"input_ids": random_ids(2, 10)})
    assert torch.isfinite(per_layer).all() and (per_layer > 0).all()
    mean.backward()
    attention_ids = {id(p) for attention in attention_modules(model) for p in attention.parameters()}
    attention_ids |= {id(p) for p in hf_posenc.get_positional_module(model).parameters()}
    for name, param in model.named_parameters():
        if id(param) in attention_ids:
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_the_gradient_reaches_only_the_trainable_set():
    model = tiny_model("llama")
    teacher = Teacher.original(model, frozen_base=False)
    hf_posenc.patch_model(model, "drope")
    model.requires_grad_(False)
    trainable = [p for attention in attention_modules(model) for p in (attention.q_proj.weight, attention.k_proj.weight)]
    trainable += list(hf_posenc.get_positional_module(model).parameters())
    for param in trainable:
        param.requires_grad_(True)
    attention_transfer_loss(model, teacher, {"input_ids": random_ids(2, 10)})[0].backward()
    trainable_ids = {id(p) for p in trainable}
    for name, param in model.named_parameters():
        assert (param.grad is not None and param.grad.abs().sum() > 0) == (id(param) in trainable_ids), name


@pytest.mark.parametrize("model_type,method", [("llama", "rope"), ("gpt2", "alibi"), ("bloom", "alibi")])
def test_an_identity_patch_has_loss_zero(model_type, method):
    model = tiny_model(model_type)
    teacher = Teacher.original(model, frozen_base=True)
    hf_posenc.patch_model(model, method)  # the model's own mechanism on LLaMA and BLOOM; not on GPT-2
    mean, per_layer = attention_transfer_loss(model, teacher, {"input_ids": random_ids(2, 10)})
    if (model_type, method) == ("gpt2", "alibi"):
        assert (per_layer > 1e-3).all()  # a real change, so the zeros below are not the hooks doing nothing
    elif model_type == "llama":
        assert torch.equal(per_layer, torch.zeros(2))
    else:  # BLOOM + alibi agrees to float rounding (a constant per query row that softmax removes)
        assert per_layer.max() <= 1e-10


def test_a_hybrids_native_layer_has_loss_zero():
    model = tiny_model("llama")
    teacher = Teacher.original(model, frozen_base=True)
    hf_posenc.patch_model(model, "nope", layers=[1])
    mean, per_layer = attention_transfer_loss(model, teacher, {"input_ids": random_ids(2, 10)}, layers=[0, 1])
    assert per_layer[0].item() <= 1e-12 and per_layer[1].item() > 1e-6
    only_changed, changed = attention_transfer_loss(model, teacher, {"input_ids": random_ids(2, 10)})
    assert changed.shape == (1,) and torch.allclose(changed[0], per_layer[1])


def test_an_absolute_method_is_refused_with_the_fix():
    model = tiny_model("llama")
    teacher = Teacher.original(model, frozen_base=True)
    hf_posenc.patch_model(model, "sinusoidal")
    with pytest.raises(hf_posenc.PosEncError, match="--transfer-steps 0"):
        attention_transfer_loss(model, teacher, {"input_ids": random_ids(1, 6)})


@pytest.mark.parametrize("model_type", FAMILIES)
def test_capturing_the_inputs_alone_keeps_the_same_inputs_and_no_outputs(model_type):
    """The bias fit captures each layer's input only (outputs=False): the same tensors, and no per-layer output held
    (0.57 GB for SmolLM2 at 8192 tokens)."""
    model, ids = tiny_model(model_type), random_ids(1, 12)
    layers = list(range(len(attention_modules(model))))
    both = capture_targets(model, {"input_ids": ids}, layers)
    alone = capture_targets(model, {"input_ids": ids}, layers, outputs=False)
    assert sorted(both.outputs) == layers and alone.outputs == {}
    assert sorted(alone.inputs) == layers
    for index in layers:
        assert alone.inputs[index].keys() == both.inputs[index].keys()
        for key, value in alone.inputs[index].items():
            assert torch.equal(value, both.inputs[index][key])
    assert torch.equal(alone.inputs[0][next(iter(alone.inputs[0]))][0], captured_inputs(model, ids)[0][0])
