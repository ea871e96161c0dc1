"""FIRE past its threshold in training (hf_posenc/engine/attention/form_attention.py with FIRE's FireBiasForm): the
output and every gradient (queries, keys, values, the MLP's weights, c and the threshold) against the paper's
formula, bias_h(i, j) = f(psi(i - j) / psi(max(L, i)))_h, materialised in float64, for queries on both sides of the
threshold (and at it), with caches, left padding and grouped-query attention; and the path serving it."""

from __future__ import annotations

import math

import pytest
import torch

import hf_posenc
from hf_posenc import attention
from hf_posenc.engine.attention import bias_path, form_attention
from hf_posenc.engine.kernels import by_method
from hf_posenc.engine.state import PositionState
from test_attention import CASES, FakeAttention
from tiny_models import random_ids, tiny_model

FIRE_PARAMETERS = ("w1", "b1", "w2", "b2", "log_c", "log_threshold")


def fire_module(threshold: float):
    model = hf_posenc.patch_model(tiny_model("llama"), "fire", threshold=threshold, init="random")
    fire = hf_posenc.get_positional_module(model)
    with torch.no_grad():  # rising, falling and flat units, and a c other than 1
        fire.w1[1, 0] = 0.0
        fire.b1[1, 0] = 0.3
        fire.w1[1, 1] = -abs(fire.w1[1, 1]) - 0.5
        fire.log_c.fill_(math.log(0.7))
    return fire


def paper_bias(params, layer, query_positions, key_positions):
    """float64 [B, H, q, kv]: the MLP of psi(i - j) / psi(max(L, i)), psi(x) = log(c x + 1), written out."""
    w1, b1, w2, b2 = (params[name][layer] for name in ("w1", "b1", "w2", "b2"))
    c, threshold = params["log_c"][layer].exp(), params["log_threshold"][layer].exp()
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).clamp_min(0).double()
    normaliser = torch.log(c * torch.maximum(threshold, query_positions.double()) + 1)
    u = torch.log(c * distance + 1) / normaliser[:, :, None]
    hidden = torch.relu(u[..., None] * w1 + b1)
    return (hidden @ w2 + b2).permute(0, 3, 1, 2)


def reference_attention(params, state, query, key, value, mask, scaling):
    q, kv = query.shape[2], key.shape[2]
    query_slots, key_slots, query_positions, key_positions = state.relative_positions(q, kv, query.device)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    allowed = key_slots[None, :] <= query_slots[:, None]
    if mask is not None:
        allowed = allowed & mask
    scores = query @ key.transpose(2, 3) * scaling + paper_bias(params, 1, query_positions, key_positions)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # padding rows: finite, not NaN
    return (scores.softmax(-1) @ value).transpose(1, 2)


def spy_on_kernel(monkeypatch):
    """The calls of FIRE's fused backward (engine/kernels/cpu_kernels/table_tile.cpp), counted."""
    calls = []
    original = by_method.fire_backward_tiles
    monkeypatch.setattr(by_method, "fire_backward_tiles", lambda *args: calls.append(1) or original(*args))
    return calls


@pytest.mark.parametrize("kernels", ["fused", "torch ops"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)], ids=["MHA", "GQA"])
@pytest.mark.parametrize("case", ["prefill", "chunk after cache", "static cache", "left padded"])
def test_gradients_equal_the_float64_formula(case, heads, kv_heads, kernels, monkeypatch):
    """By the fused kernel where it serves (causality by slots all the mask: not with left padding) and by the
    torch-op tiles (HF_POSENC_CPU_KERNELS=0, and the padded batch)."""
    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "1" if kernels == "fused" else "0")
    fused_calls = spy_on_kernel(monkeypatch)
    monkeypatch.setattr(bias_path, "FORM_BLOCK_ROWS", 8)  # several query blocks
    monkeypatch.setattr(form_attention, "KEY_TILE", 5)  # several key tiles per block in the backward
    monkeypatch.setattr(form_attention, "FORWARD_KEY_CHUNK", 7)  # and pieces of each bias in the forward
    batch, q, kv, offset, pad = CASES[case]
    fire = fire_module(threshold=offset + q // 2 + 0.5)  # queries on both sides of L (no tie: see below)
    state = PositionState(fire, backend="sdpa")
    positions = torch.arange(offset, offset + q)[None].repeat(batch, 1)
    positions[0] -= pad
    state.update(positions, offset)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(batch, h, n, 16, generator=generator).requires_grad_()
                         for h, n in ((heads, q), (kv_heads, kv), (kv_heads, kv)))
    real = torch.ones(batch, q, dtype=torch.bool)
    real[0, :max(0, pad - offset)] = False  # fully masked padding queries are undefined in both
    grad_out = torch.randn(batch, q, heads, 16, generator=generator) * real[:, :, None, None]
    slots = torch.arange(kv)
    mask = (slots[None, :] <= torch.arange(offset, offset + q)[:, None])[None, None].repeat(batch, 1, 1, 1)
    mask[0, :, :, :pad] = False
    mask = mask if pad else None

    served = []
    original = form_attention.FormBiasAttention.apply
    monkeypatch.setattr(form_attention.FormBiasAttention, "apply",
                        staticmethod(lambda *args: served.append(1) or original(*args)))
    out, _ = attention.posenc_attention(FakeAttention(state), query, key, value, mask, scaling=0.25)
    assert served, "the bias-form path did not serve"
    parameters = [getattr(fire, name) for name in FIRE_PARAMETERS]
    grads = torch.autograd.grad(out, [query, key, value, *parameters], grad_out)
    assert bool(fused_calls) == (kernels == "fused" and not pad)

    params = {name: getattr(fire, name).detach().double().requires_grad_() for name in FIRE_PARAMETERS}
    inputs = [t.detach().double().requires_grad_() for t in (query, key, value)]
    expected = reference_attention(params, state, *inputs, mask, 0.25)
    expected_grads = torch.autograd.grad(expected, [*inputs, *params.values()], grad_out.double())

    assert torch.allclose(out[real].double(), expected[real], atol=2e-5)
    for name, got, want in zip(("query", "key", "value", *FIRE_PARAMETERS), grads, expected_grads):
        scale = max(1.0, want.abs().max().item())
        assert (got.double() - want).abs().max().item() <= 2e-5 * scale, name
        assert want.abs().max() > 0, name  # every gradient is exercised


def test_a_training_step_past_the_threshold_takes_the_form_path(monkeypatch):
    """A patched model's training step past the threshold: the bias-form path serves every attention call, and
    the loss gradients of every parameter equal those of the eager backend (autograd of the materialised bias)."""
    ids = random_ids(2, 30)

    def gradients(backend):
        model = hf_posenc.patch_model(tiny_model("llama").double(), "fire", threshold=12.0, init="random")
        model.set_attn_implementation(backend)
        model.train()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    calls = []
    original = form_attention.FormBiasAttention.apply
    monkeypatch.setattr(form_attention.FormBiasAttention, "apply",
                        staticmethod(lambda *args: calls.append(1) or original(*args)))
    monkeypatch.setattr(bias_path, "FORM_BLOCK_ROWS", 8)
    fast = gradients("sdpa")
    assert len(calls) == 2  # one per layer
    reference = gradients("eager")
    assert [name for name in fast if "posenc" in name]
    assert fast.keys() == reference.keys()
    for name in fast:
        assert (fast[name] - reference[name]).abs().max() <= 1e-5 * max(1.0, reference[name].abs().max().item()), name


def test_the_backward_makes_no_denormal_gradients(monkeypatch):
    """Masked and negligible probabilities are exactly 0 in the backward, so dS holds no subnormal number: on an
    Intel Xeon a matmul on denormal operands took 15x as long (issue 56), where the table backward's floor at the
    smallest normal probability made every masked entry of dS denormal."""
    from hf_posenc.methods.fire import FireBiasForm

    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "0")  # the torch-op tiles (the fused kernel's: test_fused_fire.py)
    seen = []
    original = FireBiasForm.accumulate
    monkeypatch.setattr(FireBiasForm, "accumulate", lambda self, saved, grad: seen.append(grad.clone())
                        or original(self, saved, grad))
    monkeypatch.setattr(bias_path, "FORM_BLOCK_ROWS", 16)
    model = hf_posenc.patch_model(tiny_model("llama"), "fire", threshold=8.0)
    with torch.no_grad():  # steep biases: far keys get probabilities far below e^-60
        hf_posenc.get_positional_module(model).w2.mul_(200.0)
    ids = random_ids(1, 64)
    model.train()
    model(ids, labels=ids).loss.backward()
    assert seen
    tiny = torch.finfo(torch.float32).tiny
    for grad in seen:
        assert not ((grad != 0) & (grad.abs() < tiny)).any()
    assert any((grad == 0).float().mean() > 0.2 for grad in seen)  # the masked entries


def test_positions_that_restart_take_the_autograd_path():
    """Past the threshold the form needs key positions in order (each segment a run of keys); packed sequences whose
    positions restart get the per-block bias and autograd instead, with the same gradients."""
    fire = fire_module(threshold=4.0)
    ordered = torch.arange(20)[None]
    restarting = torch.cat([torch.arange(10), torch.arange(10)])[None]
    assert fire.bias_form(1, ordered, ordered, None) is not None
    assert fire.bias_form(1, restarting, restarting, None) is None
    assert fire.bias_form(1, ordered[:, :4], ordered[:, :4], None) is None  # within the threshold: the table
