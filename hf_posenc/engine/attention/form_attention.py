"""Blocked attention with a learned bias that is neither a distance table nor cheap to keep: a method's bias form
(methods/base.py `BiasForm`; FIRE past its threshold), whose gradient the backward sends into the form's few
parameters directly, without a per-pair bias tensor in the autograd graph.

Autograd of the per-block bias (a [B, H, rows, keys] tensor from a chain of gathers) kept every block's chain alive
for the backward and handed SDPA a mask that needs a gradient, which on CPU takes its math path (a materialised
softmax per block, kept too): a FIRE training step past the threshold took 15x native RoPE at 4096 tokens and 27x
at 8192 on an Intel Xeon (issue 56). Here, as in table_attention.py, the forward is aten's CPU flash kernel with each
block's bias as a constant mask (it returns the logsumexp), and the backward recomputes each block KEY_TILE keys at a
time (the standard attention backward, FlashAttention, Dao et al. 2022), the bias of each tile from the form. The
bias's gradient dS of a tile goes to `BiasForm.accumulate`, which reduces it at once to sums per parameter (FIRE:
per segment of its piecewise-linear MLP and head). Memory: a block's bias and a few tiles, never O(L^2).

On the CPU a method's fused kernel (by_method.py `FormKernel`; FIRE's in engine/kernels/cpu_kernels/table_tile.cpp)
serves where causality by slots is all the mask (no padding mask, no key mask of the method's): the forward
flash-style, each tile's bias made in cache (where the torch ops write each block's [B, H, rows, keys] bias to memory
for SDPA to read back), and the whole backward as the distance table's (table_attention.py), each tile's bias and
the form's sums made in the loops between its five products. It serves once it matched these torch-op tiles on a
small problem of the call's own form (`fused_form_serves`, recorded in `kernel_status()`).

tests/test_fire_attention.py checks output and gradients against the float64 formula, materialised, by both.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.by_method import form_kernel
from ..kernels.check import tolerance, verified
from ..kernels.fused_cpu import fused_kernels_enabled
from .table_attention import widened_operands


# Probabilities below e^-60 (1e-26: far below float32's resolution of the sums they enter) are made exactly 0. Left
# as they come (or floored at the smallest normal number, as table_attention.py does for exp's slow path), the
# masked and far entries made dS denormal, and on an Intel Xeon a matmul on denormal operands took 15x as long
# (issue 56); exp(-inf) = 0 takes exp's fast path.
LOG_PROBABILITY_FLOOR = -60.0
FORWARD_KEY_CHUNK = 1024  # keys per piece of a block's bias in the forward
KEY_TILE = 256  # keys per backward tile: its temporaries ([B*H, rows, KEY_TILE] each) stay in cache


def fused_form_applies(call) -> bool:
    """Whether the method's fused kernel for its bias form may serve the AttentionCall: it has one, the fused CPU
    kernels are on, and causality by slots is all the mask (no mask given, no key mask of the method's)."""
    return (form_kernel(call.method) is not None and fused_kernels_enabled() and call.attention_mask is None
            and not call.method.masks_keys)


def form_attention_applies(query: torch.Tensor) -> bool:
    """Whether the form path can serve: aten's CPU flash kernel (which returns the logsumexp the backward needs)
    and a dtype whose mask holds the bias unrounded (float32, float64)."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)


class FormBiasAttention(torch.autograd.Function):
    """query [B, H, q, D]; key, value [B, H_kv, kv, D] in slot order; form: the method's BiasForm for the call;
    blocks: (query rows, key columns) slices per block, the columns from 0; mask(rows, columns, bias, dtype): the
    block's full mask (causality, padding) with `bias` [B or 1, H, r, k] in it (may be written in place); fused:
    (the method's FormKernel, query slots [q], key slots [kv]) where causality by slots is all the mask and the
    kernel may serve, else None; *tensors: form.tensors, so that autograd reaches them. Returns the output
    [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, form, blocks, mask, scaling, fused, *tensors):
        compute = torch.promote_types(query.dtype, torch.float32)
        if fused is not None and not fused_form_serves(fused, form, blocks, scaling, compute):
            fused = None
        if fused is not None:
            kernel, query_slots, key_slots = fused
            output, lse = kernel.forward(form, query_slots, key_slots, query, key, value, scaling)
        else:
            output, lse = torch_form_forward(query, key, value, form, blocks, mask, scaling)
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.form, ctx.blocks, ctx.mask, ctx.scaling, ctx.fused = form, blocks, mask, scaling, fused
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse = ctx.saved_tensors
        form, scaling = ctx.form, ctx.scaling
        batch, heads, q, dim = query.shape
        kv, groups = key.shape[2], query.shape[1] // key.shape[1]
        dtypes = query.dtype, key.dtype, value.dtype
        compute = torch.promote_types(query.dtype, torch.float32)
        operands = widened_operands(query, key, value, output, lse, grad_output, scaling, compute)
        needed = list(ctx.needs_input_grad[8:])
        form.start_backward(compute, needed)
        if ctx.fused is not None and value.shape[-1] == dim:
            kernel, query_slots, key_slots = ctx.fused
            spans = [(rows.start, rows.stop - rows.start, columns.stop) for rows, columns in ctx.blocks]
            grad_query, grad_key, grad_value = kernel.backward(form, query_slots, key_slots, *operands, spans, KEY_TILE,
                                                               scaling, needed)
        else:
            grad_query, grad_key, grad_value = torch_form_tiles(form, ctx.mask, ctx.blocks, *operands, batch,
                                                                KEY_TILE, scaling)
        grad_query = grad_query.view(batch, heads, q, dim)
        grad_key, grad_value = (grad.reshape(batch, heads // groups, groups, kv, -1).sum(2) if groups > 1
                                else grad.reshape(batch, heads, kv, -1) for grad in (grad_key, grad_value))
        grads = [grad.to(dtype) for grad, dtype in zip((grad_query, grad_key, grad_value), dtypes)]
        grads = [grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)]
        return (*grads, None, None, None, None, None, *form.gradients())


def torch_form_forward(query, key, value, form, blocks, mask, scaling):
    """The forward by the form's torch-op tiles: each block's bias and mask made whole, then aten's CPU flash kernel
    -> output [B, H, q, D] and each row's logsumexp [B, H, q]."""
    outputs, lses, storage = [], [], None
    for rows, columns in blocks:
        bias, storage = torch_block_bias(form, rows, columns, storage, blocks[-1][1].stop)
        block_mask = mask(rows, columns, bias, query.dtype)
        output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query[:, :, rows], key[:, :, columns], value[:, :, columns], attn_mask=block_mask, scale=scaling)
        outputs.append(output)
        lses.append(lse)
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return output, torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]


def torch_block_bias(form, rows: slice, columns: slice, storage: torch.Tensor | None, most_keys: int):
    """The bias of a block by the form's torch-op tiles, FORWARD_KEY_CHUNK keys at a time, into `storage` (a flat
    buffer for blocks of `most_keys` keys at most, reused by every block; None: made here) -> (bias, storage).
    Made whole, each block allocated (and the system zeroed) a few hundred MiB of per-pair temporaries at 8192
    tokens."""
    chunks = [form.tile(rows, slice(first, min(columns.stop, first + FORWARD_KEY_CHUNK)))[0]
              for first in range(0, min(columns.stop, FORWARD_KEY_CHUNK), FORWARD_KEY_CHUNK)]
    shape = (*chunks[0].shape[:-1], columns.stop)
    if storage is None:
        storage = chunks[0].new_empty(math.prod(shape[:-1]) * most_keys)
    bias = storage[:math.prod(shape)].view(shape)
    bias[..., :chunks[0].shape[-1]] = chunks[0]
    del chunks
    for first in range(FORWARD_KEY_CHUNK, columns.stop, FORWARD_KEY_CHUNK):
        tile = slice(first, min(columns.stop, first + FORWARD_KEY_CHUNK))
        bias[..., tile] = form.tile(rows, tile)[0]
    return bias, storage


def torch_form_tiles(form, mask, blocks, query_wide, key_wide, grad_wide, value_wide, batch, width, scaling):
    """The backward's tiles by torch ops, `width` keys each (the reference of a method's fused kernel): the widened
    operands -> the gradients of the queries ([B*H, q, D]), of the keys and values per query head ([B*H, kv, D]);
    each tile's dS goes to `form.accumulate`."""
    count, q, wide = query_wide.shape
    heads, kv = count // batch, key_wide.shape[1]
    # Views without the widening column: the products read them with a row stride of D + 1, no copy.
    scaled_query, grad_output, key = (tensor[..., :-1] for tensor in (query_wide, grad_wide, key_wide))
    grad_query = query_wide.new_empty(count, q, wide - 1)
    tiles = -(-kv // width)
    # dK and dV by key tile, each tile's [B*H, width, D] contiguous: baddbmm_ into a strided slice of a
    # [B*H, kv, D] tensor falls apart into one addmm_ per batch x head, some of them 100x slower (issue 56).
    grad_key = key_wide.new_zeros(tiles, count, min(width, kv), wide - 1)
    grad_value = key_wide.new_zeros(tiles, count, min(width, kv), value_wide.shape[-1] - 1)
    for rows, columns in blocks:
        block_grad_query = grad_query.new_zeros(count, rows.stop - rows.start, wide - 1)
        for first in range(0, columns.stop, width):
            tile = slice(first, min(columns.stop, first + width))
            tile_grad_key, tile_grad_value = (grad[first // width, :, :tile.stop - first]
                                              for grad in (grad_key, grad_value))
            bias, saved = form.tile(rows, tile)
            tile_mask = mask(rows, tile, bias, query_wide.dtype)
            tile_mask = tile_mask.expand(batch, heads, *tile_mask.shape[2:]).reshape(count, *tile_mask.shape[2:])
            probs = torch.baddbmm(tile_mask, query_wide[:, rows], key_wide[:, tile].transpose(1, 2))
            del tile_mask
            probs = F.threshold_(probs, LOG_PROBABILITY_FLOOR, -math.inf).exp_()
            tile_grad_value.baddbmm_(probs.transpose(1, 2), grad_output[:, rows])
            grad_scores = torch.bmm(grad_wide[:, rows], value_wide[:, tile].transpose(1, 2)).mul_(probs)
            del probs
            block_grad_query.baddbmm_(grad_scores, key[:, tile])
            tile_grad_key.baddbmm_(grad_scores.transpose(1, 2), scaled_query[:, rows])
            form.accumulate(saved, grad_scores.view(batch, heads, *grad_scores.shape[1:]))
        torch.mul(block_grad_query, scaling, out=grad_query[:, rows])
    # [tiles, B*H, width, D] -> [B*H, kv, D]
    grad_key, grad_value = (grad.transpose(0, 1).reshape(count, -1, grad.shape[-1])[:, :kv]
                            for grad in (grad_key, grad_value))
    return grad_query, grad_key, grad_value


def fused_form_serves(fused, form, blocks, scaling: float, compute: torch.dtype) -> bool:
    """Whether the method's fused kernel (fused: (FormKernel, query slots, key slots)) serves a call in `compute`:
    the fused CPU kernels are on, and at the first such call in this process its bias and gradients matched the
    torch-op tiles' on a small problem of this call's form (check_fused_form; recorded as kernel checks are:
    `hf_posenc.attention.kernel_status()`, a KernelCheckWarning on a failure, after which torch ops serve)."""
    kernel = fused[0]
    return fused_kernels_enabled() and verified(kernel.name, torch.device("cpu"), compute,
                                                lambda: check_fused_form(fused, form, blocks, scaling, compute))


def check_fused_form(fused, form, blocks, scaling: float, compute: torch.dtype) -> tuple[float, float]:
    """The fused kernel's largest error against the torch-op tiles, relative to each result's largest value, over
    the output and logsumexp of the forward, the gradients of queries, keys and values and those of the form's
    parameters, on the last (at most) 24 query rows of the call over its keys up to the last block's, 2 batch rows
    where the positions have one, 8-wide heads, backward key tiles of 8; and the tolerance."""
    kernel, query_slots, key_slots = fused
    last, keys = blocks[-1][0].stop, blocks[-1][1].stop
    rows = slice(max(0, last - 24), last)
    part = form.part(rows, slice(0, keys))
    query_slots, key_slots = query_slots[rows].contiguous(), key_slots[:keys].contiguous()
    part_rows = slice(0, rows.stop - rows.start)
    low = torch.finfo(compute).min

    def mask(tile_rows, columns, bias, dtype):
        allowed = key_slots[None, columns] <= query_slots[tile_rows, None]
        return bias.to(dtype).masked_fill(~allowed, low)

    bias = mask(part_rows, slice(0, keys), part.tile(part_rows, slice(0, keys))[0], compute)
    heads = bias.shape[1]
    batch = 2 if bias.shape[0] == 1 else bias.shape[0]
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, part_rows.stop, 8, generator=generator, dtype=compute)
    key, value = (torch.randn(batch, heads, keys, 8, generator=generator, dtype=compute) for _ in range(2))
    output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, attn_mask=bias,
                                                                            scale=scaling)
    got_output, got_lse = kernel.forward(part, query_slots, key_slots, query, key, value, scaling)
    grad = torch.randn(output.shape, generator=generator, dtype=compute)
    operands = widened_operands(query, key, value, output, lse, grad, scaling, compute)
    needed = [True] * len(part.tensors)
    part.start_backward(compute, needed)
    got = kernel.backward(part, query_slots, key_slots, *operands, [(0, part_rows.stop, keys)], 8, scaling, needed)
    got = (got_output, got_lse, *got, *part.gradients())
    part.start_backward(compute, needed)
    want = torch_form_tiles(part, mask, [(part_rows, slice(0, keys))], *operands, batch, 8, scaling)
    want = (output, lse, *want, *part.gradients())
    return max(((a - b).abs().max() / b.abs().max().clamp_min(torch.finfo(compute).tiny)).item()
               for a, b in zip(got, want)), 2 * tolerance(compute)
