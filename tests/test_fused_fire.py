"""FIRE past its threshold by its fused CPU kernel (engine/kernels/cpu_kernels/table_tile.cpp, FireBias; served by
engine/attention/form_attention.py where causality by slots is all the mask): the bias and every gradient against the
torch-op tiles of FireBiasForm (methods/fire.py), inference past the threshold against the paper's formula, and a
kernel that fails its first-use check never serving. (Training against the float64 formula, both paths:
test_fire_attention.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from hf_posenc import attention
from hf_posenc.engine.attention import bias_path, form_attention
from hf_posenc.engine.kernels import by_method, fused_cpu
from hf_posenc.engine.state import PositionState
from test_attention import CASES, FakeAttention
from test_fire_attention import FIRE_PARAMETERS, fire_module, reference_attention

FIRE_KERNEL = by_method.KERNELS["fire"].form


def fire_form(threshold, query_positions, key_positions):
    return fire_module(threshold).bias_form(1, query_positions, key_positions, None)


def masked(bias, query_slots, key_slots):
    allowed = key_slots[None, :] <= query_slots[:, None]
    return bias.masked_fill(~allowed, torch.finfo(bias.dtype).min)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-6), (torch.float64, 1e-6)])
@pytest.mark.parametrize("shared", [True, False], ids=["positions shared", "positions per row"])
def test_the_fused_forward_equals_the_torch_op_tiles(dtype, tolerance, shared, monkeypatch):
    """Output and logsumexp: queries on both sides of the threshold after a cache of 10 (keys past each query
    masked), rows of a batch at other positions, grouped-query heads, more rows and keys than one tile of the
    kernel's (fused_cpu.TILE_ROWS x TILE_KEYS, made small here). (In float64 the torch-op tiles make the bias in
    float32, the kernel in float64: see below.)"""
    batch, heads, kv_heads, q, kv, scaling = 2, 4, 2, 30, 40, 0.3
    positions = torch.arange(kv)[None] if shared else torch.stack([torch.arange(kv), torch.arange(kv) + 9])
    form = fire_form(22.5, positions[:, kv - q:], positions)
    query_slots, key_slots = torch.arange(kv - q, kv), torch.arange(kv)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, q, 8, generator=generator, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, kv, 8, generator=generator, dtype=dtype) for _ in range(2))
    blocks = [(slice(first, min(q, first + 11)), slice(0, kv - q + min(q, first + 11))) for first in range(0, q, 11)]

    def mask(rows, columns, bias, dtype):
        return masked(bias.to(dtype), query_slots[rows], key_slots[columns])

    want = form_attention.torch_form_forward(query, key.repeat_interleave(2, 1), value.repeat_interleave(2, 1),
                                             form, blocks, mask, scaling)
    monkeypatch.setattr(fused_cpu, "TILE_ROWS", 7)
    monkeypatch.setattr(fused_cpu, "TILE_KEYS", 9)
    got = FIRE_KERNEL.forward(form, query_slots, key_slots, query, key, value, scaling)
    for name, a, b in zip(("output", "logsumexp"), got, want):
        assert a.shape == b.shape, name
        assert (a - b).abs().max() <= tolerance * b.abs().max(), name


def backward(kernel_or_torch, form, operands, blocks, batch, scaling, query_slots, key_slots, tile):
    needed = [True] * len(form.tensors)
    form.start_backward(operands[0].dtype, needed)
    if kernel_or_torch == "fused":
        spans = [(rows.start, rows.stop - rows.start, columns.stop) for rows, columns in blocks]
        grads = FIRE_KERNEL.backward(form, query_slots, key_slots, *operands, spans, tile, scaling, needed)
    else:
        def mask(rows, columns, bias, dtype):
            return masked(bias.to(dtype), query_slots[rows], key_slots[columns])
        grads = form_attention.torch_form_tiles(form, mask, blocks, *operands, batch, tile, scaling)
    return (*grads, *form.gradients())


# In float64 the kernel computes u and the bias in float64, where the torch-op tiles make them in float32 (the form's
# positions and segment parameters): they differ at float32's resolution, not at float64's.
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 2e-5), (torch.float64, 1e-6)])
@pytest.mark.parametrize("shared", [True, False], ids=["positions shared", "positions per row"])
def test_the_fused_backward_equals_the_torch_op_tiles(dtype, tolerance, shared):
    """Every gradient (queries, keys, values, the MLP's slope and intercept per segment, c and the threshold) over
    three query blocks after a cache of 10 tokens, tiles of 7 keys (remainders), 2 batch rows, 4 heads."""
    batch, heads, q, kv, dim, scaling = 2, 4, 30, 40, 8, 8**-0.5
    positions = torch.arange(kv)[None] if shared else torch.stack([torch.arange(kv), torch.arange(kv) + 9])
    form = fire_form(20.5, positions[:, kv - q:], positions)
    query_slots, key_slots = torch.arange(kv - q, kv), torch.arange(kv)
    blocks = [(slice(first, min(q, first + 11)), slice(0, kv - q + min(q, first + 11))) for first in range(0, q, 11)]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, q, dim, generator=generator, dtype=dtype)
    key, value = (torch.randn(batch, heads, kv, dim, generator=generator, dtype=dtype) for _ in range(2))
    bias = masked(torch.cat([form.tile(rows, slice(0, kv))[0] for rows, _ in blocks], dim=2).to(dtype),
                  query_slots, key_slots).expand(batch, -1, -1, -1)
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=bias,
                                                                            scale=scaling)
    grad = torch.randn(output.shape, generator=generator, dtype=dtype)
    operands = form_attention.widened_operands(query, key, value, output, lse, grad, scaling, dtype)
    got = backward("fused", form, operands, blocks, batch, scaling, query_slots, key_slots, 7)
    want = backward("torch", form, operands, blocks, batch, scaling, query_slots, key_slots, 7)
    names = ("query", "key", "value", "slope", "intercept", "log c", "log threshold")
    for name, a, b in zip(names, got, want):
        assert b.abs().max() > 0, name
        limit = tolerance if a.dtype == dtype else 2e-5  # the parameters' gradients are float32, as they are
        assert (a - b).abs().max() <= limit * b.abs().max(), name


@pytest.mark.parametrize("case", ["prefill", "chunk after cache", "decode one token"])
def test_inference_past_the_threshold_takes_the_fused_kernel(case, monkeypatch):
    """Without gradients too, the fused kernel serves (in place of the per-block torch ops of Fire.block_bias), with
    the paper's output, here where no mask is given."""
    monkeypatch.setattr(bias_path, "FORM_BLOCK_ROWS", 8)
    calls = []
    original = by_method.fire_attention_forward
    monkeypatch.setattr(by_method, "fire_attention_forward", lambda *args: calls.append(1) or original(*args))
    batch, q, kv, offset, _ = CASES[case]
    fire = fire_module(threshold=offset + q // 2 - 0.5)  # queries past it (all of them for one token)
    state = PositionState(fire, backend="sdpa")
    state.update(torch.arange(offset, offset + q)[None].repeat(batch, 1), offset)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(batch, 4, n, 16, generator=generator) for n in (q, kv, kv))
    with torch.no_grad():
        out, _ = attention.posenc_attention(FakeAttention(state), query, key, value, None, scaling=0.25)
    assert calls
    params = {name: getattr(fire, name).detach().double() for name in FIRE_PARAMETERS}
    expected = reference_attention(params, state, query.double(), key.double(), value.double(), None, 0.25)
    assert (out.double() - expected).abs().max() <= 2e-5


def test_a_fused_form_kernel_that_fails_its_check_never_serves(monkeypatch):
    """A fused kernel whose forward is wrong is refused at its first call, with one KernelCheckWarning, and the torch
    ops serve that call and the later ones: the output and gradients are theirs exactly."""
    def run():
        fire = fire_module(threshold=6.5)
        state = PositionState(fire, backend="sdpa")
        state.update(torch.arange(24)[None], 0)
        generator = torch.Generator().manual_seed(0)
        query, key, value = (torch.randn(1, 4, 24, 16, generator=generator).requires_grad_() for _ in range(3))
        out, _ = attention.posenc_attention(FakeAttention(state), query, key, value, None, scaling=0.25)
        parameters = [getattr(fire, name) for name in FIRE_PARAMETERS]
        return (out, *torch.autograd.grad(out.square().sum(), [query, key, value, *parameters]))

    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "0")
    expected = run()
    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "1")
    def wrong_forward(*args):
        output, lse = FIRE_KERNEL.forward(*args)
        return 1.01 * output, lse

    wrong = by_method.FormKernel(FIRE_KERNEL.name, wrong_forward, FIRE_KERNEL.backward)
    monkeypatch.setitem(by_method.KERNELS, "fire", by_method.MethodKernels(triton_table=True, form=wrong))
    attention.reset_kernel_status()
    try:
        with pytest.warns(attention.KernelCheckWarning, match="FIRE past its threshold"):
            first = run()
        second = run()
        assert [verdict.passed for verdict in attention.kernel_status()] == [False]
    finally:
        attention.reset_kernel_status()
    for got in (first, second):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_key_positions_that_fall_are_refused_by_the_kernel():
    """Each segment is a run of keys only where key positions rise along a row: the kernel refuses others (the form
    never hands it such: Fire.bias_form returns None for positions that restart)."""
    positions = torch.tensor([[0.0, 1.0, 3.0, 2.0]])
    slots = torch.arange(4)
    knots, slope = torch.tensor([0.5]), torch.ones(2, 2)
    query = torch.randn(1, 2, 4, 8)
    with pytest.raises(RuntimeError, match="must not fall"):
        fused_cpu.fire_attention_forward(query, query, query, positions, positions, torch.ones(1, 4), slots, slots,
                                         knots, slope, slope, 1.0, 0.3)
