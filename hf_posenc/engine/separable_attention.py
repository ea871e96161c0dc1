"""Blocked attention whose logits are scale * q_i . k_j + u_i - w_j (+ a constant bias), with gradients for u and w:
the content methods whose per-token state enters the logits as a term per query minus a term per key (FoX: the
cumulative log forget gates, u = w = c). See ContentMethod.separable_terms.

The generic content path computes each block's logits, softmax and values in eager code, and recomputes the block in
the backward (checkpointing): about 1.5x SDPA's time. Here, per query block, the logits' bias is a float mask built
from u, w, the block's allowed keys and its constant bias, and SDPA's own CPU flash kernel computes the forward (with
the rows' logsumexp) and, with the same mask recomputed, the backward. The kernel's backward gives no gradient for
the mask; what u and w need of dS = dL/dlogits is its row and column sums:

- rowsum_j dS_ij = sum_j P_ij (dP_ij - delta_i) = 0, since each row of P sums to 1: u gets no gradient (a term per
  query shifts that query's logits alike, which the softmax ignores);
- colsum_i dS_ij rides in the kernel's key gradient as one more column: with Q' = [Q, 1], K' = [K, 0], V' = [V, 0]
  the logits are unchanged and dK' = scale * dS^T Q' holds scale * colsum(dS) in column D.

Only on CPU, where the kernel returns the logsumexp (elsewhere the generic path serves). Memory: one block's mask
[B, H, r, k] at a time (recomputed in the backward, never kept), the widened inputs [B, H, q, D + 1 rounded up to a
multiple of 8] in the backward.
tests/test_content_methods.py checks outputs and gradients against the generic path in float64.
"""

from __future__ import annotations

from typing import Callable

import torch

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def separable_path_applies(query: torch.Tensor) -> bool:
    """Whether this path can serve: CPU (the flash kernel returns the logsumexp there), float32 or float64 (the mask
    holds the logits' bias in the queries' dtype: in half precision it would round c_i - c_j)."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)


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
    keys past each query, which a call with a mask computes (FoX's step at 4096 tokens: see docs/benchmarks.md)."""
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


CAUSAL = "causal"  # a part's mask in TwoPartAttention: the kernel's own causal flag (square parts only)


def _mask_arguments(allowed, dtype: torch.dtype) -> dict:
    """The kernel's mask arguments for a part's mask: bool allowed keys, None (all allowed) or CAUSAL."""
    if allowed is None:
        return {}
    if isinstance(allowed, str):
        return {"is_causal": True}
    return {"attn_mask": torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, torch.finfo(dtype).min)}


class TwoPartAttention(torch.autograd.Function):
    """One softmax over two sets of keys, each scored with its own queries (Self-Extend / ReRoPE's near and far
    assignments, attention.py `_near_far_attention`): the CPU flash kernel on each part gives its output and
    logsumexp, merged as out = sum_p exp(lse_p - lse) out_p with lse = logaddexp(lse_near, lse_far). The backward is
    the kernel's backward on each part with the merged output and logsumexp, which is exactly the merged softmax's
    gradient restricted to that part's keys. Unlike one call on both parts side by side, the head dimension stays D.
    The far part may be None (far_query, far_key, far_value): then this is the kernel on the near part alone.
    masks: (near allowed, far allowed or None), bool [B or 1, 1, r, k_part], None (all keys allowed) or CAUSAL, for
    the forward only; rebuild() gives them again in the backward. Only the queries, keys, values, output and logsumexp are kept: O(r) per block, where
    keeping the masks would hold a byte per query-key pair over a whole training step."""

    @staticmethod
    def forward(ctx, near_query, near_key, far_query, far_key, near_value, far_value, masks: tuple,
                rebuild: Callable, scaling: float):
        near_allowed, far_allowed = masks
        dtype = near_query.dtype
        output, lse = FLASH(near_query, near_key, near_value, **_mask_arguments(near_allowed, dtype), scale=scaling)
        if far_query is not None:
            far_out, far_lse = FLASH(far_query, far_key, far_value, **_mask_arguments(far_allowed, dtype),
                                     scale=scaling)
            merged = torch.logaddexp(lse, far_lse)
            output = output * (lse - merged).exp()[..., None] + far_out * (far_lse - merged).exp()[..., None]
            lse = merged
        ctx.save_for_backward(near_query, near_key, far_query, far_key, near_value, far_value, output, lse)
        ctx.rebuild, ctx.scaling = rebuild, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        near_query, near_key, far_query, far_key, near_value, far_value, output, lse = ctx.saved_tensors
        grad_output = grad_output.to(output.dtype).contiguous()
        grads = []
        with torch.no_grad():
            masks = ctx.rebuild()
        for (query, key, value), allowed in zip(((near_query, near_key, near_value), (far_query, far_key, far_value)),
                                                masks):
            if query is None:
                grads.extend((None, None, None))
                continue
            arguments = _mask_arguments(allowed, query.dtype)
            grads.extend(FLASH_BACKWARD(grad_output, query, key, value, output, lse, 0.0,
                                        arguments.pop("is_causal", False), **arguments, scale=ctx.scaling))
        near_grad_query, near_grad_key, near_grad_value, far_grad_query, far_grad_key, far_grad_value = grads
        return (near_grad_query, near_grad_key, far_grad_query, far_grad_key, near_grad_value, far_grad_value, None,
                None, None)
