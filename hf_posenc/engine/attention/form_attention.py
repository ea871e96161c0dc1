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

tests/test_fire_attention.py checks output and gradients against the float64 formula, materialised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .table_attention import _widen


# Probabilities below e^-60 (1e-26: far below float32's resolution of the sums they enter) are made exactly 0. Left
# as they come (or floored at the smallest normal number, as table_attention.py does for exp's slow path), the
# masked and far entries made dS denormal, and on an Intel Xeon a matmul on denormal operands took 15x as long
# (issue 56); exp(-inf) = 0 takes exp's fast path.
LOG_PROBABILITY_FLOOR = -60.0
FORWARD_KEY_CHUNK = 1024  # keys per piece of a block's bias in the forward
KEY_TILE = 256  # keys per backward tile: its temporaries ([B*H, rows, KEY_TILE] each) stay in cache


def form_attention_applies(query: torch.Tensor) -> bool:
    """Whether the form path can serve: aten's CPU flash kernel (which returns the logsumexp the backward needs)
    and a dtype whose mask holds the bias unrounded (float32, float64)."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)


class FormBiasAttention(torch.autograd.Function):
    """query [B, H, q, D]; key, value [B, H_kv, kv, D] in slot order; form: the method's BiasForm for the call;
    blocks: (query rows, key columns) slices per block; mask(rows, columns, bias, dtype): the block's full mask
    (causality, padding) with `bias` [B or 1, H, r, k] in it (may be written in place); *tensors: form.tensors, so
    that autograd reaches them. Returns the output [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, form, blocks, mask, scaling, *tensors):
        outputs, lses, storage = [], [], None
        for rows, columns in blocks:
            # The block's bias, FORWARD_KEY_CHUNK keys at a time into one buffer reused by every block: made whole,
            # each block allocated (and the system zeroed) a few hundred MiB of per-pair temporaries at 8192 tokens.
            chunks = [form.tile(rows, slice(first, min(columns.stop, first + FORWARD_KEY_CHUNK)))[0]
                      for first in range(0, min(columns.stop, FORWARD_KEY_CHUNK), FORWARD_KEY_CHUNK)]
            shape = (*chunks[0].shape[:-1], columns.stop)
            if storage is None:
                storage = chunks[0].new_empty(shape[0] * shape[1] * shape[2] * blocks[-1][1].stop)
            bias = storage[:math.prod(shape)].view(shape)
            bias[..., :chunks[0].shape[-1]] = chunks[0]
            del chunks
            for first in range(FORWARD_KEY_CHUNK, columns.stop, FORWARD_KEY_CHUNK):
                tile = slice(first, min(columns.stop, first + FORWARD_KEY_CHUNK))
                bias[..., tile] = form.tile(rows, tile)[0]
            block_mask = mask(rows, columns, bias, query.dtype)
            output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query[:, :, rows], key[:, :, columns], value[:, :, columns], attn_mask=block_mask, scale=scaling)
            outputs.append(output)
            lses.append(lse)
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        lse = torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]
        ctx.save_for_backward(query, key, value, output, lse)
        ctx.form, ctx.blocks, ctx.mask, ctx.scaling = form, blocks, mask, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, output, lse = ctx.saved_tensors
        form, scaling = ctx.form, ctx.scaling
        batch, heads, q, dim = query.shape
        kv, groups = key.shape[2], query.shape[1] // key.shape[1]
        dtypes = query.dtype, key.dtype, value.dtype
        compute = torch.promote_types(query.dtype, torch.float32)
        grad_output = grad_output.to(compute)
        key, value = key.to(compute), value.to(compute)
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scaled_query = query.to(compute) * scaling
        delta = (grad_output * output.to(compute)).sum(-1)
        # Widened operands as in table_attention.py: Q' K'^T = scale Q K^T - lse, dO' V'^T = dO V^T - delta.
        query_wide, key_wide = _widen(scaled_query, -lse.to(compute)), _widen(key, 1.0)
        grad_wide, value_wide = _widen(grad_output, -delta), _widen(value, 1.0)
        scaled_query, grad_output, key = scaled_query.flatten(0, 1), grad_output.flatten(0, 1), key.flatten(0, 1)
        grad_query = torch.empty_like(scaled_query)
        width = KEY_TILE
        tiles = -(-kv // width)
        # dK and dV by key tile, each tile's [B*H, width, D] contiguous: baddbmm_ into a strided slice of a
        # [B*H, kv, D] tensor falls apart into one addmm_ per batch x head, some of them 100x slower (issue 56).
        grad_key = key.new_zeros(tiles, batch * heads, min(width, kv), dim)
        grad_value = key.new_zeros(tiles, batch * heads, min(width, kv), value.shape[-1])
        form.start_backward(compute, [needed for needed in ctx.needs_input_grad[7:]])
        for rows, columns in ctx.blocks:
            block_grad_query = grad_query.new_zeros(batch * heads, rows.stop - rows.start, dim)
            for first in range(0, columns.stop, width):
                tile = slice(first, min(columns.stop, first + width))
                tile_grad_key, tile_grad_value = (grad[first // width, :, :tile.stop - first]
                                                  for grad in (grad_key, grad_value))
                bias, saved = form.tile(rows, tile)
                mask = ctx.mask(rows, tile, bias, compute)
                mask = mask.expand(batch, heads, *mask.shape[2:]).reshape(batch * heads, *mask.shape[2:])
                probs = torch.baddbmm(mask, query_wide[:, rows], key_wide[:, tile].transpose(1, 2))
                del mask
                probs = F.threshold_(probs, LOG_PROBABILITY_FLOOR, -math.inf).exp_()
                tile_grad_value.baddbmm_(probs.transpose(1, 2), grad_output[:, rows])
                grad_scores = torch.bmm(grad_wide[:, rows], value_wide[:, tile].transpose(1, 2)).mul_(probs)
                del probs
                block_grad_query.baddbmm_(grad_scores, key[:, tile])
                tile_grad_key.baddbmm_(grad_scores.transpose(1, 2), scaled_query[:, rows])
                form.accumulate(saved, grad_scores.view(batch, heads, *grad_scores.shape[1:]))
            torch.mul(block_grad_query, scaling, out=grad_query[:, rows])
        grad_query = grad_query.view(batch, heads, q, dim)
        # [tiles, B*H, width, D] -> [B*H, kv, D]
        grad_key, grad_value = (grad.transpose(0, 1).reshape(batch * heads, -1, grad.shape[-1])[:, :kv]
                                for grad in (grad_key, grad_value))
        grad_key, grad_value = (grad.reshape(batch, heads // groups, groups, kv, -1).sum(2) if groups > 1
                                else grad.reshape(batch, heads, kv, -1) for grad in (grad_key, grad_value))
        grads = [grad.to(dtype) for grad, dtype in zip((grad_query, grad_key, grad_value), dtypes)]
        grads = [grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)]
        return (*grads, None, None, None, None, *form.gradients())
