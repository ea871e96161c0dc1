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

from .table_attention import _widen, key_tile


def applies(query: torch.Tensor) -> bool:
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
        outputs, lses = [], []
        for rows, columns in blocks:
            bias, _ = form.tile(rows, columns)
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
        grad_query = torch.zeros_like(scaled_query)
        grad_key = torch.zeros_like(key)
        grad_value = torch.zeros_like(value.flatten(0, 1))
        form.start_backward(compute, [needed for needed in ctx.needs_input_grad[7:]])
        floor = math.log(torch.finfo(compute).tiny) + 1  # exp's slow path below it (see table_attention.py)
        width = key_tile(query.device)
        for rows, columns in ctx.blocks:
            block_grad_query = grad_query[:, rows]
            for first in range(columns.start, columns.stop, width):
                tile = slice(first, min(columns.stop, first + width))
                bias, saved = form.tile(rows, tile)
                mask = ctx.mask(rows, tile, bias, compute)
                mask = mask.expand(batch, heads, *mask.shape[2:]).reshape(batch * heads, *mask.shape[2:])
                probs = torch.baddbmm(mask, query_wide[:, rows], key_wide[:, tile].transpose(1, 2))
                del mask
                probs = probs.clamp_min_(floor).exp_()
                grad_value[:, tile].baddbmm_(probs.transpose(1, 2), grad_output[:, rows])
                grad_scores = torch.bmm(grad_wide[:, rows], value_wide[:, tile].transpose(1, 2)).mul_(probs)
                del probs
                block_grad_query.baddbmm_(grad_scores, key[:, tile])
                grad_key[:, tile].baddbmm_(grad_scores.transpose(1, 2), scaled_query[:, rows])
                form.accumulate(saved, grad_scores.view(batch, heads, *grad_scores.shape[1:]))
        grad_query.mul_(scaling)
        grad_query = grad_query.view(batch, heads, q, dim)
        grad_key, grad_value = (grad.view(batch, heads // groups, groups, kv, -1).sum(2) if groups > 1
                                else grad.view(batch, heads, kv, -1) for grad in (grad_key, grad_value))
        grads = [grad.to(dtype) for grad, dtype in zip((grad_query, grad_key, grad_value), dtypes)]
        grads = [grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)]
        return (*grads, None, None, None, None, *form.gradients())
