"""A content method's query blocks in eager code: each block's mask, logits or weights, softmax and values, and the
autograd function that recomputes them one block at a time in the backward (`RecomputedBlocks`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...methods.base import ContentBlock, ContentMethod, fill_disallowed_
from .call import AttentionCall
from .geometry import combined_mask

def content_mask(call: AttentionCall, rows: slice, columns: slice):
    """(allowed bool [B or 1, 1, r, k], bias float32 [B or 1, H or 1, r, k] or None) of a content block: causality,
    padding and the method's key mask; the native bias the method keeps and the additive part of a float mask."""
    low = torch.finfo(torch.float32).min
    query_positions, key_positions = call.query_positions[:, rows], call.key_positions[:, columns]
    mask = combined_mask(call.method, call.causal_allowed(rows, columns), None, call.given_mask(rows, columns),
                         query_positions, key_positions, torch.float32)
    bias = call.method.native_bias(call.layer_idx, query_positions, key_positions)
    if mask.dtype != torch.bool:  # an additive float mask: its very negative entries mask, the rest adds
        allowed = mask > low / 2
        given_bias = mask.masked_fill(~allowed, 0.0)
        bias, mask = (given_bias if bias is None else bias + given_bias), allowed
    return mask, bias


QUERY_SIDE = (0, 3)  # the tensors of cut_block cut by rows (the queries and their state); the others by columns


def cut_block(rows, columns, query, key, value, query_state, key_state) -> tuple:
    """A block's queries [B, H, r, D], keys and values [B, H, k, D], and the per-token state of its queries and keys
    (or None), cut from a content call's: the ones at QUERY_SIDE by the block's rows, the others by its columns."""
    return (query[:, :, rows], key[:, :, columns], value[:, :, columns],
            query_state[:, :, rows] if query_state is not None else None,
            key_state[:, :, columns] if key_state is not None else None)


def content_block_of(call: AttentionCall, rows: slice, columns: slice, query_state, key_state,
                     span=None) -> ContentBlock:
    """The ContentBlock of query rows `rows` against key columns `columns` of a content call (the states cut)."""
    mask, bias = content_mask(call, rows, columns)
    return ContentBlock(call.layer_idx, call.scaling, mask, bias, call.query_positions[:, rows],
                        call.key_positions[:, columns], query_state, key_state, call.query_slots[rows],
                        call.key_slots[columns], span)


def content_probabilities(method: ContentMethod, query, key, block: ContentBlock) -> torch.Tensor:
    """A content block's attention weights float32 [B, H, r, k]: the method's own (`content_weights`) or the softmax
    of its logits over the allowed keys."""
    if method.replaces_softmax:
        return method.content_weights(query, key, block)
    low = torch.finfo(torch.float32).min
    scores = method.content_scores(query, key, block)
    if not method.scores_maskable_in_place:
        return F.softmax(scores.masked_fill(~block.allowed, low), dim=-1)
    return F.softmax(fill_disallowed_(scores, block.allowed, low), dim=-1)


def content_block_output(method: ContentMethod, query, key, value, block: ContentBlock) -> torch.Tensor:
    """A content block's output [B, H, r, D]: what the "compiled" path compiles (content_probabilities, then the
    values)."""
    return torch.matmul(content_probabilities(method, query, key, block).to(value.dtype), value)


def content_block(call: AttentionCall, rows: slice, columns: slice, query, key, value, query_state, key_state,
                  dropout: float = 0.0, span=None):
    """Query rows `rows` against key columns `columns` of a content call, from the block's cut of the queries, keys,
    values and states (`cut_block`): (output [B, H, r, D], attention weights float32 [B, H, r, k], for `mixes_state`
    methods the same weights applied to the keys' state [B, H, r, ...] in float32, else None). `span`: the call's
    `position_span`, for methods that read it (else None)."""
    method = call.method
    block = content_block_of(call, rows, columns, query_state, key_state, span)
    probs = F.dropout(content_probabilities(method, query, key, block), p=dropout, training=dropout > 0)
    mixed = None
    if method.mixes_state and key_state is not None:
        keys = key_state.repeat_interleave(probs.shape[1] // key_state.shape[1], dim=1).float()
        mixed = torch.matmul(probs.float(), keys.flatten(3)).unflatten(-1, keys.shape[3:])
    return torch.matmul(probs.to(value.dtype), value), probs, mixed


def content_rows_defined(call: AttentionCall, batch: int, blocks) -> torch.Tensor:
    """bool [B, q]: the query rows that may attend to at least one key (the others' outputs are undefined: a
    softmax over no key)."""
    rows_defined = []
    for rows, columns in blocks:
        allowed, _ = content_mask(call, rows, columns)
        rows_defined.append(allowed.any(-1)[:, 0].expand(batch, -1))
    return torch.cat(rows_defined, dim=-1)


class RecomputedBlocks(torch.autograd.Function):
    """The query blocks of a content call, output = cat(block_output(rows, columns, *cut)) over the queries (cut: the
    block's cut of the tensors, `cut_block`), keeping nothing for the backward but the tensors: the backward
    recomputes one block at a time and differentiates it w.r.t. that cut, made leaves of their own, and `parameters`
    (what it reads besides: a method's parameters). So a block's gradient is added into its slice of one buffer per
    tensor, where differentiating through the cut (as torch.utils.checkpoint per block does) would give every block
    a zero-filled gradient of the whole call's size to add (O(L) per block, O(L^2 / rows) per call). And a compiled
    block_output may be served by another graph of the same code in the recomputation, which torch.utils.checkpoint
    refuses (it checks that as many tensors were saved; with dynamic shapes that can differ: pytorch/pytorch#166926)."""

    @staticmethod
    def forward(ctx, block_output, blocks, count: int, *tensors):
        ctx.block_output, ctx.blocks = block_output, blocks
        ctx.parameters = tensors[count:]
        ctx.save_for_backward(*tensors[:count])
        inputs = [tensor.detach() if tensor is not None else None for tensor in tensors[:count]]
        with torch.no_grad():  # on detached inputs, as a compiled graph saw them in the first call
            outputs = [block_output(rows, columns, *cut_block(rows, columns, *inputs)) for rows, columns in blocks]
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        grads = [torch.zeros_like(tensor) if need and tensor is not None else None
                 for tensor, need in zip(saved, needs)]
        parameter_grads = [None] * len(ctx.parameters)
        wanted = [index for index, need in enumerate(needs) if need]
        detached = [tensor.detach() if tensor is not None else None for tensor in saved]
        for rows, columns in ctx.blocks:
            cut = [tensor.requires_grad_(need) if tensor is not None else None
                   for tensor, need in zip(cut_block(rows, columns, *detached), needs)]
            candidates = [*cut, *ctx.parameters]
            with torch.enable_grad():
                output = ctx.block_output(rows, columns, *cut)
            if not output.requires_grad:  # the inputs that want a gradient do not reach this block
                continue
            block_grads = torch.autograd.grad(output, [candidates[index] for index in wanted],
                                              grad_output[:, :, rows], allow_unused=True)
            for index, grad in zip(wanted, block_grads):
                if grad is None:
                    continue
                if index >= len(saved):
                    slot = index - len(saved)
                    parameter_grads[slot] = grad if parameter_grads[slot] is None else parameter_grads[slot] + grad
                else:
                    grads[index][:, :, rows if index in QUERY_SIDE else columns] += grad
        return (None, None, None, *grads, *parameter_grads)
