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

import functools
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


CAUSAL = "causal"  # a segment's mask in NearFarAttention: the kernel's own causal flag (square segments only)


def _mask_arguments(allowed, dtype: torch.dtype) -> dict:
    """The kernel's mask arguments for a segment's mask: bool allowed keys, None (all allowed) or CAUSAL."""
    if allowed is None:
        return {}
    if isinstance(allowed, str):
        return {"is_causal": True}
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return {"attn_mask": torch.where(allowed, zero, torch.finfo(dtype).min)}  # the kernel takes no bool mask


def mask_segments(allowed: torch.Tensor) -> list[tuple[slice, str | None]]:
    """A part's keys cut into column segments that the kernel runs at full speed where it can: [(columns, kind)] with
    kind None (every row allows every key: no mask), CAUSAL (the last r keys of r rows, exactly their lower triangle:
    the kernel's causal flag, no mask to build or read) or "mask" (the part's mask on those columns). With a
    mask the kernel computes and reads every key of the block: Self-Extend's far keys of a 256-row block at 4096
    tokens are all allowed but the last 256 (a band), and its near keys a band then the causal square."""
    rows, keys = allowed.shape[-2:]
    square = 0
    if 2 <= rows <= keys and bool(allowed[..., keys - rows:].eq(
            torch.ones(rows, rows, dtype=torch.bool, device=allowed.device).tril_()).all()):
        square = rows
    every_row = allowed[..., :keys - square].flatten(0, -2).all(0)  # [k - square]
    prefix = int(every_row.int().cumprod(0).sum())
    segments = [(slice(0, prefix), None)] if prefix else []
    if prefix < keys - square:
        segments.append((slice(prefix, keys - square), "mask"))
    if square:
        segments.append((slice(keys - square, keys), CAUSAL))
    return segments


def near_far_columns(near_allowed: torch.Tensor, far_allowed: torch.Tensor) -> tuple[slice, slice | None]:
    """The key columns of a query block that each part is given: only those where some row uses that part (the near
    keys from the first one a row uses, the far keys up to the last); every column near and None where no row uses a
    far key."""
    far_used = far_allowed.flatten(0, -2).any(0)  # [k]
    if not bool(far_used.any()):
        return slice(0, far_used.shape[0]), None
    near_used = near_allowed.flatten(0, -2).any(0)
    near_start = int(near_used.int().argmax()) if bool(near_used.any()) else near_used.shape[0]
    return slice(near_start, near_used.shape[0]), slice(0, int(far_used.nonzero().max()) + 1)


def near_far_calls(masks: tuple[torch.Tensor, torch.Tensor], dtype,
                   kept_width: int) -> list[tuple[int, slice, dict | None]]:
    """A query block's kernel calls: [(part: 0 near or 1 far, key columns, mask arguments)], each part's columns
    (near_far_columns) cut by mask_segments. A masked segment's float mask is kept where it is at most `kept_width`
    keys wide (a band: O(L r) for a call); a wider one (a padded batch's) is None, built where needed."""
    near_columns, far_columns = near_far_columns(*masks)
    cuts = [(0, slice(near_columns.start + c.start, near_columns.start + c.stop), kind)
            for c, kind in mask_segments(masks[0][..., near_columns])]
    if far_columns is not None:
        cuts += [(1, c, kind) for c, kind in mask_segments(masks[1][..., far_columns])]
    return [(part, c, None if kind == "mask" and c.stop - c.start > kept_width
             else _mask_arguments(masks[part][..., c] if kind == "mask" else kind, dtype)) for part, c, kind in cuts]


def _call_arguments(arguments: dict | None, masks: Callable, part: int, segment: slice, dtype) -> dict:
    """A call's mask arguments: as kept (near_far_calls), or its mask built again from masks() (the block's)."""
    return arguments if arguments is not None else _mask_arguments(masks()[part][..., segment], dtype)


class NearFarAttention(torch.autograd.Function):
    """Every query block of a layer call of a `block_near` method on the CPU (Self-Extend, ReRoPE, sinks: attention.py
    `_scored_blocks`): per block, one softmax over two sets of keys, each scored with its own queries (the near and
    far assignments). Each part's keys are cut into segments (near_far_calls, mask_segments: no mask, a mask, the
    causal square); the CPU flash kernel on each segment gives its output and logsumexp, merged as
    out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s. The backward is the kernel's backward on each
    segment with the merged output and logsumexp, which is exactly the merged softmax's gradient restricted to that
    segment's keys; it adds each block's gradients into whole-call tensors in place (one autograd node per layer call:
    with one per block, each block's key gradient was a zero-filled tensor of every key, summed by autograd, which
    cost Self-Extend's training step at 4096 tokens more than its masks did).
    Where the far keys of the whole call are a causal triangle, query i >= far_rows attending to keys
    j <= i - far_rows (Self-Extend's and ReRoPE's keys past the window, no padding, no cache longer than the window:
    attention.py _far_triangle_start), the far part is one causal kernel call for the call instead of two per block
    (an unmasked prefix and a masked band), merged with the near blocks once.
    near_query, far_query [B, H, q, D]: every query under each assignment; near_key, far_key, value [B, H, kv, D];
    blocks: (rows, columns) per query block; plans: each block's calls (near_far_calls, made once per forward for all
    its layers; only the near ones where far_rows is given); block_masks(rows, columns) -> (near allowed, far allowed)
    bool [B or 1, 1, r, k], called for a masked segment whose mask the plan does not keep (wider than a band), in the
    forward and again in the backward (never kept: a byte per query-key pair over a training step). Kept: the inputs,
    the output and the logsumexp, O(q + kv), and the plans' band masks, O(q r)."""

    @staticmethod
    def forward(ctx, near_query, far_query, near_key, far_key, value, blocks: list, plans: list, far_rows: int | None,
                block_masks: Callable, scaling: float):
        queries, keys = (near_query, far_query), (near_key, far_key)
        outputs, lses = [], []
        for (rows, columns), calls in zip(blocks, plans):
            masks = functools.cache(functools.partial(block_masks, rows, columns))
            output = lse = None
            for part, segment, arguments in calls:
                key_columns = slice(columns.start + segment.start, columns.start + segment.stop)
                out, out_lse = FLASH(queries[part][:, :, rows], keys[part][:, :, key_columns],
                                     value[:, :, key_columns],
                                     **_call_arguments(arguments, masks, part, segment, near_query.dtype),
                                     scale=scaling)
                if output is None:
                    output, lse = out, out_lse
                    continue
                output, lse = _merged(output, lse, out, out_lse)
            outputs.append(output)
            lses.append(lse)
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        lse = torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]
        if far_rows is not None:
            far_keys = near_query.shape[2] - far_rows
            far_output, far_lse = FLASH(far_query[:, :, far_rows:], far_key[:, :, :far_keys],
                                        value[:, :, :far_keys], is_causal=True, scale=scaling)
            output[:, :, far_rows:], lse[:, :, far_rows:] = _merged(output[:, :, far_rows:], lse[:, :, far_rows:],
                                                                    far_output, far_lse)
        ctx.save_for_backward(near_query, far_query, near_key, far_key, value, output, lse)
        ctx.blocks, ctx.plans, ctx.far_rows = blocks, plans, far_rows
        ctx.block_masks, ctx.scaling = block_masks, scaling
        return output

    @staticmethod
    def backward(ctx, grad_output):
        near_query, far_query, near_key, far_key, value, output, lse = ctx.saved_tensors
        grad_output = grad_output.to(output.dtype).contiguous()
        queries, keys = (near_query, far_query), (near_key, far_key)
        grad_queries = (torch.zeros_like(near_query), torch.zeros_like(far_query))
        grad_keys = (torch.zeros_like(near_key), torch.zeros_like(far_key))
        grad_value = torch.zeros_like(value)
        with torch.no_grad():
            if (far_rows := ctx.far_rows) is not None:
                far_keys = near_query.shape[2] - far_rows
                (grad_queries[1][:, :, far_rows:], grad_keys[1][:, :, :far_keys],
                 grad_value[:, :, :far_keys]) = FLASH_BACKWARD(
                    grad_output[:, :, far_rows:], far_query[:, :, far_rows:], far_key[:, :, :far_keys],
                    value[:, :, :far_keys], output[:, :, far_rows:], lse[:, :, far_rows:], 0.0, True,
                    scale=ctx.scaling)
            for (rows, columns), calls in zip(ctx.blocks, ctx.plans):
                masks = functools.cache(functools.partial(ctx.block_masks, rows, columns))
                for part, segment, arguments in calls:
                    key_columns = slice(columns.start + segment.start, columns.start + segment.stop)
                    arguments = _call_arguments(arguments, masks, part, segment, near_query.dtype)
                    grad_query, grad_key, grad_val = FLASH_BACKWARD(
                        grad_output[:, :, rows], queries[part][:, :, rows], keys[part][:, :, key_columns],
                        value[:, :, key_columns], output[:, :, rows], lse[:, :, rows], 0.0,
                        arguments.get("is_causal", False), attn_mask=arguments.get("attn_mask"), scale=ctx.scaling)
                    grad_queries[part][:, :, rows] += grad_query
                    grad_keys[part][:, :, key_columns] += grad_key
                    grad_value[:, :, key_columns] += grad_val
        return (grad_queries[0], grad_queries[1], grad_keys[0], grad_keys[1], grad_value, None, None, None, None,
                None)


def _merged(output, lse, out, out_lse):
    """Two softmaxes over disjoint keys (outputs [..., r, D], logsumexps [..., r]) as one over both."""
    merged = torch.logaddexp(lse, out_lse)
    return output * (lse - merged).exp()[..., None] + out * (out_lse - merged).exp()[..., None], merged
