"""Blocked attention with a learned distance-table bias, and a backward that sends the gradient into the table.

Forward, per query block, is SDPA with the block's bias as a strided Toeplitz view of the table (no copy; see
attention.toeplitz_view), exactly what the blocked path computes without gradients. Handing SDPA a mask that needs a
gradient would send it down its math path on CPU (a materialised softmax per block, and a second one kept for the
backward); here the mask reaches SDPA as a constant, and the backward recomputes each block:

    S = scale * Q K^T + bias,   P = softmax(S),   dV = P^T dO,   dP = dO V^T,
    dS = P * (dP - rowsum(dO * O)),   dQ = scale * dS K,   dK = scale * dS^T Q,

(the standard attention backward, as in FlashAttention, Dao et al. 2022), in float32 at least. On CPU the forward
is aten's flash kernel itself, which also gives each row's logsumexp: the backward's P is then exp(S - lse) with the
bias and -lse folded into the matmul's accumulator (baddbmm), two passes over a block where a softmax takes five,
and dP - rowsum(dO * O) is one baddbmm too. Since the bias of entry (r, c)
is table[offset + r + c] (keys in reversed order), the table's gradient is the sum of dS along each anti-diagonal of
the block (the adjoint of the Toeplitz view, aten's unfold_backward). Memory stays a few [B, H, rows, keys]
tensors per block, as in the forward.

tests/test_table_attention.py checks the gradients of queries, keys, values and the table against autograd of the
materialised computation in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def diagonal_sums(block: torch.Tensor) -> torch.Tensor:
    """[H, r, k] -> [H, r + k - 1]: out[h, n] = sum over r + c = n of block[h, r, c]; the adjoint of the Toeplitz
    view (`unfold`) that made the bias, which is what aten's unfold_backward computes."""
    heads, rows, keys = block.shape
    return torch.ops.aten.unfold_backward(block, [heads, rows + keys - 1], -1, keys, 1)


def _block_bias(padded: torch.Tensor, start: int, rows: int, keys: int) -> torch.Tensor:
    return padded[:, start:start + rows + keys - 1].unfold(-1, keys, 1)


def keeps_logsumexp(device: torch.device) -> bool:
    """Whether the forward runs aten's CPU flash kernel (what SDPA runs there) and keeps its logsumexp."""
    return device.type == "cpu"


class TableBiasAttention(torch.autograd.Function):
    """query [B, H, q, D]; key, value [B, H_kv, kv, D] with keys in reversed order (slot kv - 1 - c at column c);
    padded [H, pad + n] (attention.padded_table); blocks: (first row, rows, keys, start index in `padded`) per query
    block. Returns the output [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, padded, blocks, scaling):
        groups = query.shape[1] // key.shape[1]
        with_lse = keeps_logsumexp(query.device)
        outputs, lses = [], []
        for first, rows, keys, start in blocks:
            columns = slice(key.shape[2] - keys, key.shape[2])
            mask = _block_bias(padded, start, rows, keys)[None]
            block = (query[:, :, first:first + rows], key[:, :, columns], value[:, :, columns])
            if with_lse:
                output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    *block, attn_mask=mask, scale=scaling)
                outputs.append(output)
                lses.append(lse)
            else:
                outputs.append(F.scaled_dot_product_attention(*block, attn_mask=mask, scale=scaling,
                                                              enable_gqa=groups > 1))
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        lse = (torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]) if with_lse else None
        ctx.save_for_backward(query, key, value, padded, output, lse)
        ctx.blocks, ctx.scaling, ctx.groups = blocks, scaling, groups
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, padded, output, lse = ctx.saved_tensors
        scaling, groups = ctx.scaling, ctx.groups
        batch, heads, _, _ = query.shape
        kv = key.shape[2]
        compute = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for float64 inputs
        scaled_query = query.to(compute) * scaling
        grad_output = grad_output.to(compute)
        grad_query = torch.empty_like(scaled_query)
        grad_key = torch.zeros((batch, heads, kv, key.shape[3]), dtype=compute, device=key.device)
        grad_value = torch.zeros((batch, heads, kv, value.shape[3]), dtype=compute, device=value.device)
        grad_padded = torch.zeros_like(padded, dtype=compute)
        # rowsum(dO * O): the same for every block a row belongs to.
        delta = (grad_output * output.to(compute)).sum(-1, keepdim=True)
        for first, rows, keys, start in ctx.blocks:
            span = slice(first, first + rows)
            columns = slice(kv - keys, kv)
            block_query, block_grad = scaled_query[:, :, span], grad_output[:, :, span]
            block_key, block_value = key[:, :, columns].to(compute), value[:, :, columns].to(compute)
            if groups > 1:
                block_key = block_key.repeat_interleave(groups, dim=1)
                block_value = block_value.repeat_interleave(groups, dim=1)
            bias = _block_bias(padded, start, rows, keys).to(compute)
            if lse is not None:  # P = exp(Q K^T + bias - lse), the sum accumulated by the matmul
                shifted = (bias - lse[:, :, span, None].to(compute)).flatten(0, 1)
                probs = torch.baddbmm(shifted, block_query.flatten(0, 1), block_key.flatten(0, 1).transpose(1, 2))
                probs = probs.exp_().view(batch, heads, rows, keys)
                del shifted
            else:
                scores = torch.matmul(block_query, block_key.transpose(2, 3))
                scores += bias
                probs = torch.softmax(scores, dim=-1)
                del scores
            grad_value[:, :, columns] += torch.matmul(probs.transpose(2, 3), block_grad)
            grad_scores = torch.baddbmm(delta[:, :, span].flatten(0, 1).expand(-1, -1, keys),
                                        block_grad.flatten(0, 1), block_value.flatten(0, 1).transpose(1, 2),
                                        beta=-1).view(batch, heads, rows, keys)
            grad_scores.mul_(probs)
            del probs
            grad_query[:, :, span] = torch.matmul(grad_scores, block_key).mul_(scaling)
            grad_key[:, :, columns] += torch.matmul(grad_scores.transpose(2, 3), block_query)
            grad_padded[:, start:start + rows + keys - 1] += diagonal_sums(
                grad_scores[0] if batch == 1 else grad_scores.sum(0))
        if groups > 1:
            grad_key = grad_key.view(batch, heads // groups, groups, kv, -1).sum(2)
            grad_value = grad_value.view(batch, heads // groups, groups, kv, -1).sum(2)
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                grad_padded.to(padded.dtype), None, None)
