"""Content logits scale * q_i . k_j + u_i - w_j (+ a constant bias), with gradients for u and w: methods whose
per-token state enters the logits as a term per query minus one per key (FoX: cumulative log forget gates;
ContentMethod.separable_terms). Per query block the bias is a float mask and aten's CPU flash kernel computes the
forward (with the logsumexp) and, the mask rebuilt, the backward. The kernel gives no gradient for the mask; what u
and w need of dS = dL/dlogits is its row and column sums:

- rowsum_j dS_ij = sum_j P_ij (dP_ij - delta_i) = 0, since each row of P sums to 1: u gets no gradient;
- colsum_i dS_ij rides in the kernel's key gradient as one more column: with Q' = [Q, 1], K' = [K, 0], V' = [V, 0]
  the logits are unchanged and dK' = scale * dS^T Q' holds scale * colsum(dS) in column D.

CPU only (geometry.cpu_flash_applies). Memory: one block's mask at a time, never kept.
"""

from __future__ import annotations

from typing import Callable

import torch

from .geometry import FLASH, FLASH_BACKWARD


def _wide_head_dim(head_dim: int) -> int:
    """D + 1 rounded up to a multiple of 8: the kernel's backward at D + 1 = 65 took 1.3x its time at 64 on an AVX2
    CPU, at 72 1.1x (its vector loops leave a scalar tail otherwise); the added columns are zeros."""
    return -(-(head_dim + 1) // 8) * 8


def _widen(tensor: torch.Tensor, value: float) -> torch.Tensor:
    """[B, H, n, D] -> [B, H, n, _wide_head_dim(D)]: column D `value`, any further columns 0."""
    head_dim = tensor.shape[-1]
    out = tensor.new_zeros(tensor.shape[:-1] + (_wide_head_dim(head_dim),))
    out[..., :head_dim] = tensor
    out[..., head_dim] = value
    return out


def block_logit_bias(query_term, key_term, rows: slice, columns: slice, allowed, bias, dtype) -> torch.Tensor:
    """[B, H, r, k]: u_i - w_j (+ bias) where allowed, dtype's minimum elsewhere (as the generic path masks)."""
    logits = (query_term[:, :, rows, None] - key_term[:, :, None, columns]).to(dtype)
    if bias is not None:
        logits = logits + bias.to(dtype)
    hidden = ~allowed
    hidden_columns = hidden.flatten(0, -2).any(0)
    if bool(hidden_columns.any()):  # causality hides only the last columns of a block: fill from the first hidden
        first = int(hidden_columns.int().argmax())
        logits[..., first:].masked_fill_(hidden[..., first:], torch.finfo(dtype).min)
    return logits


class SeparableBiasAttention(torch.autograd.Function):
    """query, key, value [B, H, q|kv, D] (heads matched); query_term [B, H, q], key_term [B, H, kv] (float32 or
    float64); blocks: (rows, columns) slices per query block; block_mask(rows, columns) -> (allowed bool
    [B or 1, 1, r, k], constant bias [B or 1, H or 1, r, k] or None). Returns the output [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, query_term, key_term, blocks: list, block_mask: Callable, scaling: float):
        outputs, lses = [], []
        with torch.no_grad():
            for rows, columns in blocks:
                mask = block_logit_bias(query_term, key_term, rows, columns, *block_mask(rows, columns), query.dtype)
                output, lse = FLASH(query[:, :, rows], key[:, :, columns], value[:, :, columns], attn_mask=mask,
                                    scale=scaling)
                outputs.append(output)
                lses.append(lse)
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        lse = torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]
        ctx.save_for_backward(query, key, value, query_term, key_term, output, lse)
        ctx.blocks, ctx.block_mask, ctx.scaling = blocks, block_mask, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, query_term, key_term, output, lse = ctx.saved_tensors
        scaling, head_dim = ctx.scaling, query.shape[-1]
        grad_output = grad_output.to(query.dtype).contiguous()
        query_wide, key_wide, value_wide = _widen(query, 1.0), _widen(key, 0.0), _widen(value, 0.0)
        output_wide, grad_wide = _widen(output, 0.0), _widen(grad_output, 0.0)
        grad_query = torch.empty_like(query)
        grad_key = torch.zeros_like(key_wide)
        grad_value = torch.zeros_like(value)
        with torch.no_grad():
            for rows, columns in ctx.blocks:
                mask = block_logit_bias(query_term, key_term, rows, columns, *ctx.block_mask(rows, columns),
                                        query.dtype)
                block_query, block_key, block_value = FLASH_BACKWARD(
                    grad_wide[:, :, rows], query_wide[:, :, rows], key_wide[:, :, columns],
                    value_wide[:, :, columns], output_wide[:, :, rows], lse[:, :, rows], 0.0, False,
                    attn_mask=mask, scale=scaling)
                grad_query[:, :, rows] = block_query[..., :head_dim]
                grad_key[:, :, columns] += block_key
                grad_value[:, :, columns] += block_value[..., :head_dim]
        grad_key_term = (grad_key[..., head_dim] / -scaling).to(key_term.dtype)  # -colsum(dS): w enters with a minus
        return (grad_query, grad_key[..., :head_dim].contiguous(), grad_value, torch.zeros_like(query_term),
                grad_key_term, None, None, None)


def causal_separable_attention(query, key, value, query_term, key_term, scaling: float) -> torch.Tensor:
    """The same logits with plain causal masking (no padding, queries are the keys): one causal SDPA call on the
    terms folded into the heads, Q' = [Q, u / scale, 1], K' = [K, 1, -w / scale], V' = [V, 0], widened with zeros
    to a multiple of 8 (see _wide_head_dim), autograd through the kernel as it is. The kernel's causal flag skips the
    keys past each query, which a call with a mask computes (FoX's step at 4096 tokens: docs/benchmarks.md, FoX)."""
    head_dim, dtype = query.shape[-1], query.dtype
    width = _wide_head_dim(head_dim + 1)  # two more columns, rounded up to a multiple of 8

    def widened(tensor, first, second):
        columns = (tensor.new_zeros(tensor.shape[:-1] + (width - head_dim - 2,)),)
        return torch.cat((tensor, first[..., None].to(dtype), second[..., None].to(dtype)) + columns, dim=-1)

    query_wide = widened(query, query_term / scaling, torch.ones_like(query_term))
    key_wide = widened(key, torch.ones_like(key_term), -key_term / scaling)
    value_wide = torch.nn.functional.pad(value, (0, width - head_dim))
    output = torch.nn.functional.scaled_dot_product_attention(query_wide, key_wide, value_wide, is_causal=True,
                                                              scale=scaling)
    return output[..., :head_dim]
