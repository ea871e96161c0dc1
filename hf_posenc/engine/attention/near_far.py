"""The near/far path: methods whose scores mix two position assignments per query block (Self-Extend, ReRoPE:
`scores_per_query_block`) and attention sinks. One causal call where every pair is within the window; else, per
query block, one softmax over the method's near and far parts (`block_parts`): on the CPU each part's key segments
as flash-kernel calls merged by logsumexp (`NearFarAttention`), elsewhere the parts side by side in one SDPA call;
the eager scores (`block_scores`) where weights, dropout or an additive mask are asked for."""

from __future__ import annotations

import functools
import weakref
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..kernels.fused_cpu import fused_kernels_enabled, near_far_causal
from ..kernels.by_method import serves_near_far
from ...methods.base import NearFarForm
from ..kernels.check import PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall
from ..kernels.check import serve as serve_checked
from .call import AttentionCall
from .geometry import (FLASH, FLASH_BACKWARD, block_rows, causal_blocks, causal_square, combined_mask,
                       cpu_flash_applies, needs_grad, power_of_two_bucket)
from .paths import chosen_path, count_path

# Query rows per block of near/far parts on the CPU at most: the kernel computes a block's masked keys too; 256 was
# 5% faster than 512 for a sinks training step at 4096 tokens (docs/attention-paths.md, content-dependent attention).
PARTS_BLOCK_ROWS = 256


def scored_attention(call: AttentionCall):
    """Attention for methods whose scores the method computes per query block from un-rotated queries and keys
    (`scores_per_query_block`: Self-Extend, ReRoPE, which merge two position assignments per query). Each block
    holds a few [B, H, rows, keys] tensors (the method's `block_cost`), never [L, L] for the whole sequence.
    Returns (output [B, q, H, D], attention weights [B, H, q, kv] in eager mode, else None)."""
    state, method, scaling, dropout, eager = call.state, call.method, call.scaling, call.dropout, call.eager
    query, key, value, attention_mask = call.query, call.key, call.value, call.attention_mask
    query_positions, key_positions = call.query_positions, call.key_positions
    count_path(state, "scored")
    batch, heads, q = query.shape[:3]
    kv = key.shape[2]
    groups = heads // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    low = torch.finfo(torch.float32).min
    if (not eager and dropout == 0.0 and isinstance(method, NearFarForm)
            and causal_square(attention_mask, query.shape[2], kv)
            and state.once_per_forward(("window holds", q, kv),
                                       lambda: method.window_holds(query_positions, key_positions))):
        # Every pair within the window: ordinary RoPE attention, one causal call (as native), not two per block.
        count_path(state, "scored causal")
        near_query, near_key = method.window_heads(query, key, query_positions)
        output = F.scaled_dot_product_attention(near_query, near_key, value, is_causal=True, scale=scaling)
        return output.transpose(1, 2).contiguous(), None
    keys = method.block_keys(key, key_positions)
    if not eager and dropout == 0.0:
        # SDPA per block on the method's near and far parts (block_parts); their masks [B or 1, 1, r, <= k] are built
        # from the positions per block and again in the backward, or on the CPU kept only where they are bands (at
        # most 2r wide, shared by the forward's layers): O(r) memory per block and query row, not O(r k)
        step = block_rows(batch, 1, 2 * kv, device=query.device)
        step = min(step, PARTS_BLOCK_ROWS) if query.device.type == "cpu" else step
        blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), step, False))
        block_masks = functools.partial(_near_far_masks, call)
        if cpu_flash_applies(query):  # the CPU kernel on each part's segments, one autograd node
            plans, far_rows = _near_far_plans(call, blocks, block_masks)
            # The kernel scores every causal key, near or far: not for a method that masks keys (sinks)
            if (plans is not None and far_rows is not None and chosen_path(state) == "auto" and serves_near_far(method)
                    and not method.masks_keys and fused_kernels_enabled()
                    and causal_square(attention_mask, query.shape[2], kv)):
                output = serve_checked(_fused_near_far_call(call, keys, value, far_rows))
                if output is not None:
                    count_path(state, "fused near far")
                    return output.contiguous(), None
            if plans is not None:  # else an additive mask, or no near mask: block_scores serve
                count_path(state, "scored parts")
                count_path(state, "scored far triangle", far_rows is not None)
                (near_query, near_key), (far_query, far_key) = method.block_parts(
                    query, keys, query_positions, key_positions, True)
                output = NearFarAttention.apply(near_query, far_query, near_key, far_key, value, blocks, plans,
                                                far_rows, block_masks, scaling)
                return output.transpose(1, 2).contiguous(), None
        elif (first := block_masks(*blocks[0])) is not None:
            count_path(state, "scored parts")
            # The key columns each part needs (read from the masks) are the same in every layer that sees this mask:
            # read in the first. A weak reference tells a mask freed since, whose id a new one may have taken.
            by_mask = state.once_per_forward(("near far columns", q, kv), dict)
            held = by_mask.get(id(attention_mask))
            if held is None or held[0]() is not attention_mask:
                held = by_mask[id(attention_mask)] = (_weak_reference(attention_mask), {})
            part_columns = held[1]
            outputs = []
            for index, (rows, columns) in enumerate(blocks):
                rebuild = functools.partial(block_masks, rows, columns)
                masks = first if index == 0 else rebuild()
                if (rows.start, rows.stop) not in part_columns:
                    part_columns[rows.start, rows.stop] = near_far_columns(*masks)
                outputs.append(_near_far_block(
                    method, query[:, :, rows], tuple(part[:, :, columns] for part in keys),
                    query_positions[:, rows], key_positions[:, columns], value[:, :, columns],
                    masks, rebuild, scaling, part_columns[rows.start, rows.stop]))
            output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
            return output.transpose(1, 2).contiguous(), None
    outputs, weights = [], []
    step = block_rows(batch, heads, kv, method.block_cost, query.device)
    for rows, columns in causal_blocks(q, kv, state.query_offset(q, kv), step, eager):
        scores = method.block_scores(query[:, :, rows], tuple(part[:, :, columns] for part in keys),
                                     query_positions[:, rows], key_positions[:, columns]) * scaling
        mask = combined_mask(method, call.causal_allowed(rows, columns), None, call.given_mask(rows, columns),
                             query_positions[:, rows], key_positions[:, columns], torch.float32)
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
        probs = F.dropout(F.softmax(scores, dim=-1), p=dropout, training=dropout > 0).to(value.dtype)
        outputs.append(torch.matmul(probs, value[:, :, columns]))
        if eager:
            weights.append(probs)
    output = torch.cat(outputs, dim=2)
    return output.transpose(1, 2).contiguous(), torch.cat(weights, dim=2) if eager else None


def _fused_near_far_call(call: AttentionCall, keys, value, far_rows: int) -> KernelCall:
    """A call of a method the near/far kernel serves (Self-Extend, ReRoPE: engine/kernels/by_method.py) whose far
    keys are the causal triangle j <= i - far_rows of a causal square, by the fused CPU kernel
    (engine/kernels/fused_cpu.py near_far_causal) on the method's block_parts for the whole call (`keys`: its block_keys, near and far), checked against its block_scores and a softmax like any
    kernel. Its kind: the method, dtype, grad mode and the length's size class."""
    method, query, scaling = call.method, call.query, call.scaling
    query_positions, key_positions = call.query_positions, call.key_positions

    def kernel(query, near_key, far_key, value, query_positions=query_positions, key_positions=key_positions):
        (near_query, near_key), (far_query, far_key) = method.block_parts(
            query, (near_key, far_key), query_positions, key_positions, True)
        return near_far_causal(near_query, near_key, far_query, far_key, value, far_rows, scaling).transpose(1, 2)

    def scored(query, near_key, far_key, value, rows, columns, query_positions, key_positions):
        scores = method.block_scores(query[:, :, rows], (near_key[:, :, columns], far_key[:, :, columns]),
                                     query_positions[:, rows], key_positions[:, columns]) * scaling
        allowed = torch.arange(columns.start, columns.stop, device=query.device)[None] <= \
            torch.arange(rows.start, rows.stop, device=query.device)[:, None]
        probs = F.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
        return torch.matmul(probs.to(value.dtype), value[:, :, columns]).transpose(1, 2)

    def reference(rows: slice) -> torch.Tensor:
        return scored(query, *keys, value, rows, slice(0, rows.stop), query_positions, key_positions)

    def gradient_probe() -> GradientProbe:  # the last PROBE_ROWS tokens, a causal square again
        size = min(PROBE_ROWS, query.shape[2])
        batch, cut = slice(0, min(PROBE_BATCH, query.shape[0])), slice(query.shape[2] - size, query.shape[2])
        positions = (query_positions[batch][:, cut], key_positions[batch][:, cut])
        inputs = {name: tensor[batch, :, cut] for name, tensor in
                  (("query", query), ("near_key", keys[0]), ("far_key", keys[1]), ("value", value))}
        return GradientProbe(
            inputs, kernel=lambda **probe: kernel(**probe, query_positions=positions[0], key_positions=positions[1]),
            reference=lambda **probe: scored(**probe, rows=slice(0, size), columns=slice(0, size),
                                             query_positions=positions[0], key_positions=positions[1]))

    name, dtype = method.config.method, str(query.dtype)
    with_grad = needs_grad(method, query, *keys, value)
    return KernelCall(
        kernel=f"fused cpu ({name})", device=query.device,
        kind=(name, dtype, "grad" if with_grad else "no grad", power_of_two_bucket(query.shape[2])),
        function=kernel, inputs={"query": query, "near_key": keys[0], "far_key": keys[1], "value": value},
        reference=reference, gradient_kind=(name, dtype) if with_grad else None,
        gradient_probe=gradient_probe if with_grad else None)


def _near_far_plans(call: AttentionCall, blocks: list, block_masks) -> tuple[list | None, int | None]:
    """(each block's kernel calls for NearFarAttention (near_far_calls, with the masks they keep),
    far_rows (_far_triangle_start): then only the near calls), or (None, None) where block_scores serve (an additive
    mask, or no near mask). Made by the first layer of a forward and reused by the others, which attend with the same
    positions, mask and blocks: building the masks and cutting them cost Self-Extend about 4% of a layer's training
    step at 2048 tokens on the CPU."""
    forward, dtype, kv = call.state.forward, call.query.dtype, call.key.shape[2]
    key = (call.method, call.attention_mask, dtype, kv, blocks)
    for known, planned in forward.near_far_plans:
        if all(a is b for a, b in zip(known[:3], key)) and known[3:] == key[3:]:
            return planned
    first = block_masks(*blocks[0])
    planned = None, None
    if first is not None:
        kept_width = 2 * (blocks[0][0].stop - blocks[0][0].start)  # a band's: the near keys of r rows, window < r
        far_rows = _far_triangle_start(block_masks, blocks[-1][0].stop, kv)
        plans = []
        for index, (rows, columns) in enumerate(blocks):
            masks = first if index == 0 else block_masks(rows, columns)
            if far_rows is not None and not bool(masks[1].eq(_far_triangle(rows, columns, far_rows, masks[1])).all()):
                far_rows = None
            plans.append(near_far_calls(masks, dtype, kept_width))
        if far_rows is not None:
            plans = [[near for near in calls if near[0] == 0] for calls in plans]
        planned = plans, far_rows
    forward.near_far_plans.append((key, planned))
    return planned


def _far_triangle_start(block_masks, q: int, kv: int) -> int | None:
    """The row a from which the far keys of the call would be a causal triangle, row i >= a attending to keys
    j <= i - a (read off the last row's far keys; _near_far_plans checks every block against it), or None where the
    last row has no far key or the first row has one (a chunk after a cache longer than the window)."""
    far = block_masks(slice(q - 1, q), slice(0, kv))[1].flatten(0, -2)[0]
    if not bool(far.any()):
        return None
    start = q - 1 - int(far.nonzero().max())
    return start if start > 0 else None


def _far_triangle(rows: slice, columns: slice, start: int, like: torch.Tensor) -> torch.Tensor:
    """[r, k] bool: key j <= row i - start, over a block's rows and columns."""
    row = torch.arange(rows.start, rows.stop, device=like.device)[:, None]
    return torch.arange(columns.start, columns.stop, device=like.device)[None] <= row - start


def _near_far_masks(call: AttentionCall, rows: slice, columns: slice):
    """(near allowed, far allowed) bool [B or 1, 1, r, k] of a query block of a `block_near` method: causality, padding
    and the method's key mask, split by its near mask; None where the given mask is additive or the method has no
    near mask (block_scores serves)."""
    query_positions, key_positions = call.query_positions[:, rows], call.key_positions[:, columns]
    mask = combined_mask(call.method, call.causal_allowed(rows, columns), None, call.given_mask(rows, columns),
                         query_positions, key_positions, torch.float32)
    near = call.method.block_near(query_positions, key_positions) \
        if mask.dtype == torch.bool and isinstance(call.method, NearFarForm) else None
    if near is None:
        return None
    return mask & near, mask & ~near


def _weak_reference(tensor: torch.Tensor | None) -> Callable[[], torch.Tensor | None]:
    """() -> the tensor while it lives, else None (and None for no tensor)."""
    return weakref.ref(tensor) if tensor is not None else lambda: None


def _near_far_block(method, query, keys, query_positions, key_positions, value, masks, rebuild, scaling,
                    part_columns):
    """One block of a `block_near` method off the CPU kernel (there, NearFarAttention serves every block): softmax
    over the allowed keys of q_n . k_n where near, else q_f . k_f, as one SDPA call over the keys twice, [near ones;
    far ones], with the queries [q_n, q_f] and the keys [k_n, 0] and [0, k_f] along the head dimension, so that each
    copy scores with its own query. masks: the block's (near allowed, far allowed) (_near_far_masks); with gradients
    the call is checkpointed and rebuild() gives them again in the recomputation, rather than keep them. Only the key
    columns where some row uses a part are given to it (`part_columns`: near_far_columns of the masks)."""
    near_columns, far_columns = part_columns
    far = far_columns is not None
    (near_query, near_key), far_pair = method.block_parts(query, keys, query_positions, key_positions, far)

    def cut(masks):
        return masks[0][..., near_columns], masks[1][..., far_columns] if far else None

    far_query, far_key = far_pair if far else (None, None)
    tensors = (near_query, near_key[:, :, near_columns], far_query, far_key[:, :, far_columns] if far else None,
               value[:, :, near_columns], value[:, :, far_columns] if far else None)
    with_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not with_grad:
        return _near_far_sdpa(cut(masks), *tensors, scaling)
    pending = [masks]  # the forward's masks, released once used: the recomputation in the backward rebuilds them

    def kernel(*tensors):
        return _near_far_sdpa(cut(pending.pop() if pending else rebuild()), *tensors, scaling)

    return torch.utils.checkpoint.checkpoint(kernel, *tensors, use_reentrant=False)


def _near_far_sdpa(masks, near_query, near_key, far_query, far_key, near_value, far_value, scaling):
    """SDPA on the near part, or on both parts side by side along the head dimension (see _near_far_block)."""
    near_allowed, far_allowed = masks
    if far_query is None:
        return F.scaled_dot_product_attention(near_query, near_key, near_value, attn_mask=near_allowed, scale=scaling)
    keys = torch.cat((torch.cat((near_key, torch.zeros_like(near_key)), -1),
                      torch.cat((torch.zeros_like(far_key), far_key), -1)), dim=2)
    values = torch.cat((near_value, far_value), dim=2)
    mask = torch.cat((near_allowed, far_allowed), dim=-1)
    return F.scaled_dot_product_attention(torch.cat((near_query, far_query), -1), keys, values, attn_mask=mask,
                                          scale=scaling)


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
    """Every query block of a layer call of a `block_near` method on the CPU (Self-Extend, ReRoPE, sinks:
    `scored_attention`): per block, one softmax over two sets of keys, each scored with its own queries (the near and
    far assignments). Each part's keys are cut into segments (near_far_calls, mask_segments: no mask, a mask, the
    causal square); the CPU flash kernel on each segment gives its output and logsumexp, merged as
    out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s. The backward is the kernel's backward on each
    segment with the merged output and logsumexp, which is exactly the merged softmax's gradient restricted to that
    segment's keys; it adds each block's gradients into whole-call tensors in place (one autograd node per layer call:
    with one per block, each block's key gradient was a zero-filled tensor of every key, summed by autograd, which
    cost Self-Extend's training step at 4096 tokens more than its masks did).
    Where the far keys of the whole call are a causal triangle, query i >= far_rows attending to keys
    j <= i - far_rows (Self-Extend's and ReRoPE's keys past the window, no padding, no cache longer than the window:
    _far_triangle_start), the far part is one causal kernel call for the call instead of two per block
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
