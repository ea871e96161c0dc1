"""The path of additive biases and of rotary methods rotated inside attention (length-dependent scalings, xPos): a
causal SDPA call where nothing else is masked, compiled flex or flash-attn where they apply and are checked on this
machine (kernel_check), else query blocks, whose mask for a distance table is a strided view of one small table.
A learned table's backward: table_attention.py."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from ...methods.base import AttentionBiasMethod, RotaryMethod
from ..kernels.by_method import form_kernel, serves_triton_table
from ..kernels.check import PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall, table_attention_reference
from ..kernels.check import serve as serve_checked
from ..kernels.triton import table_kernel
from .call import AttentionCall
from .geometry import (additive_mask_allowed, block_mask, block_rows, causal_square, combined_mask, distance_table,
                       max_query_position, needs_grad, padded_table, position_span, power_of_two_bucket, query_blocks,
                       rotates_as_one_block, toeplitz_view)
from .paths import chosen_path, count_path
from .form_attention import FormBiasAttention, form_attention_applies, fused_form_applies
from .table_attention import TableBiasAttention

VIEW_BLOCK_ROWS = 256  # query rows per block when the bias is a view: fewer wastes the masked keys less, more calls
FORM_BLOCK_ROWS = 256  # query rows per block of a bias form (form_attention.py): 256 x 256-key tiles were the
# fastest of 64-256 rows x 128-256 keys at 2048 tokens on the Xeon under load (3.2x native there, 128 rows 4.8x)
# Past dynamo's recompile_limit (8) flex runs uncompiled, every score matrix materialised (5x slower on an H200):
# our compiled calls get this allowance, inside the call only (docs/attention-paths.md, dynamo's recompile limit).
FLEX_RECOMPILE_LIMIT = 256
# dynamo's option was cache_size_limit before torch 2.7: the fallback can go once the package requires torch>=2.7.
RECOMPILE_LIMIT_OPTION = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
FLEX_BACKWARD_DEVICES = ("cuda",)  # flex_attention has no CPU backward (torch 2.13)
# One pipeline stage: inductor's default tiles with a captured table ask for more shared memory than an H100/H200
# has, and one stage was 2.5x faster at 2048 tokens (docs/attention-paths.md, flex on a GPU).
FLEX_CUDA_KERNEL_OPTIONS = {"num_stages": 1}
_compiled_flex: dict = {}  # device type -> torch.compile(flex_attention), made at its first call


def bias_attention(call: AttentionCall):
    """A bias or rotary method's attention: (output [B, q, H, D], attention weights or None)."""
    state, method = call.state, call.method
    rotary, has_bias = isinstance(method, RotaryMethod), isinstance(method, AttentionBiasMethod)
    # Keys are cached un-rotated; rotating the whole cache here costs O(kv * D) per layer and step, the same order
    # as attention itself, and keeps length-dependent scalings exact under a KV cache. xPos is rotated here when the
    # call's queries fit its spread (under torch.compile always: the spread is a value), else per block.
    rotate_blocks = False
    if rotary and (state.forward.traced or rotates_as_one_block(call)):
        query, key = state.rotate_query_key(call.query, call.key, call.query_positions, call.key_positions,
                                            call.layer_idx)
        call = call.replace(query=query, key=key)
    else:
        rotate_blocks = rotary
    if state.forward.traced:
        return traced_attention(call)
    if not call.eager and call.dropout == 0.0 and has_bias:
        output = kernel_output(call, rotate_blocks)
        if output is not None:
            return output, None
    query, key = call.query, call.key
    if (not has_bias and not call.eager and not rotate_blocks and not method.masks_keys
            and causal_square(call.attention_mask, query.shape[2], key.shape[2])):
        # No bias and a plain causal square (a full forward without padding): SDPA's own causal kernel.
        count_path(state, "causal")
        output = F.scaled_dot_product_attention(query, key, call.value, dropout_p=call.dropout, scale=call.scaling,
                                                is_causal=True, enable_gqa=query.shape[1] != key.shape[1])
        return output.transpose(1, 2).contiguous(), None
    count_path(state, "blocked")
    return blocked_attention(call, rotate_blocks)


def blocked_attention(call: AttentionCall, rotate_blocks: bool = False):
    """The attention of any call, by query blocks (O(block x kv) memory). rotate_blocks: the queries and keys are
    not rotated yet; each block rotates its own around its centre (xPos beyond its spread, see xpos.py)."""
    state, method, layer_idx, scaling, dropout, eager = (call.state, call.method, call.layer_idx, call.scaling,
                                                         call.dropout, call.eager)
    query, key, value, attention_mask = call.query, call.key, call.value, call.attention_mask
    query_slots, key_slots, query_positions, key_positions = (call.query_slots, call.key_slots, call.query_positions,
                                                              call.key_positions)
    batch, heads, q, _ = query.shape
    kv = key.shape[2]
    groups = heads // key.shape[1]
    if eager and groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    query_offset = state.query_offset(q, kv)  # slot distance of the first query to the first key
    table = None
    # A distance table indexed by slot distance needs position distances to be slot distances (state.py's shift);
    # eager returns attention weights, in key order: both others take the generic path.
    if not eager and state.forward.shift is not None:
        table = distance_table(method, layer_idx, query_offset + q, max_query_position(call), query.device)
    if table is not None:
        # Keys in reversed order (see toeplitz_view); softmax does not care about the order of keys.
        key, value, key_slots, key_positions = key.flip(2), value.flip(2), key_slots.flip(0), key_positions.flip(-1)
        attention_mask = attention_mask.flip(-1) if attention_mask is not None else None
    # A bias table and nothing else to mask: each block's mask is a view of the table (see toeplitz_view).
    as_view = table is not None and attention_mask is None and not method.masks_keys
    if table is not None:
        step = VIEW_BLOCK_ROWS if as_view else block_rows(batch, heads, kv, device=query.device)
        padded = padded_table(table, step, query.dtype if as_view else torch.float32)
    else:
        step = block_rows(batch, heads, kv, method.block_cost, query.device)
    if as_view and dropout == 0.0 and needs_grad(method, query, key, value):
        # A table in training: SDPA takes the bias as a constant, the backward recomputes each block and sends dS
        # into a learned table (table_attention.py), rather than SDPA's math path for a mask with a gradient. A fixed
        # table too: off the CPU SDPA would keep a copy of every block's mask, on it SDPA's backward multiplies the
        # subnormal probabilities of far keys (table_attention.SMALLEST_PROBABILITY): fixed ALiBi 2.4x native at
        # 2048 tokens on an Intel Xeon where the table backward took 1.1-1.5x (issue 56).
        blocks = [(rows.start, rows.stop - rows.start, max(1, min(kv, query_offset + rows.stop)),
                   step + query_offset + rows.start - max(1, min(kv, query_offset + rows.stop)) + 1)
                  for rows in query_blocks(query_positions, step)]
        output = TableBiasAttention.apply(query, key, value, padded, blocks, scaling, state.tuned)
        return output.transpose(1, 2).contiguous(), None

    if (table is None and not eager and dropout == 0.0 and not rotate_blocks and form_attention_applies(query)
            and isinstance(method, AttentionBiasMethod)
            and (needs_grad(method, query, key, value) or fused_form_applies(call))):
        form = method.bias_form(layer_idx, query_positions, key_positions, position_span(call))
        if form is not None:
            # A learned bias with no table (FIRE past its threshold): its gradient goes to the method's parameters
            # without a per-pair tensor in the graph, and the method's fused kernel makes each block's bias in one
            # pass where it applies, with gradients or without (form_attention.py).
            return form_bias_attention(call, form), None

    outputs, weights = [], []
    for rows in query_blocks(query_positions, step, method.max_query_spread(query.dtype) if rotate_blocks
                             else None):
        start, stop = rows.start, rows.stop
        # Keys past the block's last query slot are masked for every row of the block: leave them out
        # (eager mode keeps them, for full-width attention weights).
        keys = kv if eager else max(1, min(kv, query_offset + stop))
        columns = slice(kv - keys, kv) if table is not None else slice(0, keys)
        block_query = query[:, :, rows]
        block_key, block_value = key[:, :, columns], value[:, :, columns]
        if rotate_blocks:
            block_query, block_key = method.rotate_query_key(
                block_query, block_key, query_positions[:, rows], key_positions[:, columns], state.forward.seq_len)
        if as_view:
            mask = toeplitz_view(padded, step, query_offset + start, stop - start, keys)[None]
            outputs.append(F.scaled_dot_product_attention(block_query, block_key, block_value, attn_mask=mask,
                                                          dropout_p=dropout, scale=scaling, enable_gqa=groups > 1))
            continue
        allowed = key_slots[None, columns] <= query_slots[rows, None]
        if not isinstance(method, AttentionBiasMethod):
            bias = None
        elif table is not None:
            bias = toeplitz_view(padded, step, query_offset + start, stop - start, keys).contiguous()[None]
        else:
            bias = method.block_bias(layer_idx, query_positions[:, rows], key_positions[:, columns],
                                     position_span(call))
        given = attention_mask[..., rows, columns] if attention_mask is not None else None
        mask = combined_mask(method, allowed, bias, given, query_positions[:, rows], key_positions[:, columns],
                             query.dtype, owned=table is not None)
        if eager:
            scores = torch.matmul(block_query, block_key.transpose(2, 3)) * scaling
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
                else scores + mask
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            probs = F.dropout(probs, p=dropout, training=dropout > 0)
            outputs.append(torch.matmul(probs, block_value))
            weights.append(probs)
        else:
            outputs.append(F.scaled_dot_product_attention(
                block_query, block_key, block_value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                enable_gqa=groups > 1))
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    attn_weights = (torch.cat(weights, dim=2) if len(weights) > 1 else weights[0]) if eager else None
    return output.transpose(1, 2).contiguous(), attn_weights


def form_bias_attention(call: AttentionCall, form) -> torch.Tensor:
    """The output [B, q, H, D] of a call whose bias is a method's BiasForm, by query blocks of FORM_BLOCK_ROWS."""
    method, query_positions, key_positions = call.method, call.query_positions, call.key_positions
    query_slots, key_slots, attention_mask = call.query_slots, call.key_slots, call.attention_mask
    kv = call.key.shape[2]
    query_offset = call.state.query_offset(call.query.shape[2], kv)

    def mask(rows, columns, bias, dtype):
        if attention_mask is None and not method.masks_keys and columns.stop - 1 <= query_offset + rows.start:
            return bias.to(dtype)  # every key of the tile is before every query of the block: nothing to mask
        allowed = key_slots[None, columns] <= query_slots[rows, None]
        given = attention_mask[..., rows, columns] if attention_mask is not None else None
        return combined_mask(method, allowed, bias, given, query_positions[:, rows], key_positions[:, columns],
                             dtype, owned=True)

    blocks = [(rows, slice(0, max(1, min(kv, query_offset + rows.stop))))
              for rows in query_blocks(query_positions, FORM_BLOCK_ROWS)]
    fused = ((form_kernel(method), query_slots.to(torch.int64).contiguous(), key_slots.to(torch.int64).contiguous())
             if fused_form_applies(call) else None)
    output = FormBiasAttention.apply(call.query, call.key, call.value, form, blocks, mask, call.scaling, fused,
                                     *form.tensors)
    return output.transpose(1, 2).contiguous()


def traced_attention(call: AttentionCall):
    """The attention of a call under torch.compile: one block, the mask computed from positions (block_mask), with no
    decision that reads a tensor's value (such decisions would break the graph or recompile per value). No
    path counting: dynamo would guard on the counter and recompile on every call."""
    query, key, value, scaling, dropout = call.query, call.key, call.value, call.scaling, call.dropout
    groups = query.shape[1] // key.shape[1]
    mask = block_mask(call, slice(0, query.shape[2]), query.dtype)
    if not call.eager:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                enable_gqa=groups > 1)
        return output.transpose(1, 2).contiguous(), None
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def kernel_output(call: AttentionCall, rotate_blocks: bool = False):
    """The output [B, q, H, D] of the first compiled or external kernel that applies to this call under the chosen
    path and is (or has just been) checked on this device (see kernel_check), or None: the blocked path serves.
    The Triton kernel takes positions (restarts too); flash and flex need position distances to be slot distances."""
    path, builders = chosen_path(call.state), []
    if not rotate_blocks and (path == "triton" or (path == "auto" and call.query.is_cuda)):
        builders.append(_triton_call)
    if call.state.forward.shift is not None:
        if path in ("auto", "flash"):
            builders.append(_flash_call)
        if path == "flex" or (path == "auto" and call.query.is_cuda):
            builders.append(_flex_call)
    for build in builders:
        kernel_call = build(call)
        output = serve_checked(kernel_call) if kernel_call is not None else None
        if output is not None:
            count_path(call.state, kernel_call.kernel)
            return output
    return None


def _reference_rows(call: AttentionCall):
    """rows -> the blocked path's output [B, r, H, D] for those query rows (all keys): what kernels are checked
    against."""
    def reference(rows: slice) -> torch.Tensor:
        mask = call.attention_mask
        if mask is not None and mask.shape[-2] == call.query.shape[2]:
            mask = mask[..., rows, :]
        return blocked_attention(call.replace(query=call.query[:, :, rows], attention_mask=mask, dropout=0.0,
                                              eager=False, query_slots=call.query_slots[rows],
                                              query_positions=call.query_positions[:, rows]))[0]
    return reference


def _key_validity(attention_mask, batch: int, kv: int, device=None):
    """[B, kv] bool: keys the last query row may see (padding masked), from a boolean mask; None if unusable."""
    if attention_mask is None:  # made where it is used: a copy to a GPU waits for the work queued before it
        return torch.ones(batch, kv, dtype=torch.bool, device=device)
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return None
    return attention_mask[:, 0, -1, :].expand(batch, kv)


def _flex_call(call: AttentionCall) -> KernelCall | None:
    """Compiled flex_attention with a distance-table score_mod, or None where it does not apply (a table method, a
    boolean or no mask, no sliding window, more than one query, and on CPU no gradients). Its kind is the exact
    compiled shape: on CPU it compiles once per shape (dynamic=False), and the torch 2.13 CPU failures depend on
    batch size and length; on CUDA a check per new shape costs at most the blocked path on 128 query rows, and flex
    never serves decoding, whose shape changes every step."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401 (availability)
    except ImportError:
        return None
    state, query, key, attention_mask = call.state, call.query, call.key, call.attention_mask
    if call.method.masks_keys or call.options.get("sliding_window") or getattr(call.module, "sliding_window", None):
        return None
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    if q == 1:  # decoding: one row of bias, a view of the table in the blocked path; flex would recompile per length
        return None
    with_grad = needs_grad(call.method, query, key, call.value)
    if with_grad and query.device.type not in FLEX_BACKWARD_DEVICES:
        return None
    valid = _key_validity(attention_mask, batch, kv, query.device)
    if valid is None:
        return None
    offset = state.query_offset(q, kv)
    table = distance_table(call.method, call.layer_idx, offset + q, max_query_position(call), query.device)
    if table is None:
        return None
    valid = valid.to(query.device)
    dtype = str(query.dtype)
    masked = attention_mask is not None
    return KernelCall(
        kernel="flex", device=query.device,
        kind=(dtype, tuple(query.shape), tuple(key.shape), offset, "mask" if masked else "no mask",
              "grad" if with_grad else "no grad"),
        function=functools.partial(_flex_kernel, offset=offset, valid=valid, scaling=call.scaling),
        inputs={"query": query, "key": key, "value": call.value, "table": table},
        reference=_reference_rows(call),
        defined=lambda: valid.cumsum(-1)[:, offset:offset + q] > 0,
        gradient_kind=(dtype, heads, key.shape[1], head_dim, masked) if with_grad else None,
        gradient_probe=lambda: _table_gradient_probe(_flex_kernel, query, key, call.value, table, offset + q, valid,
                                                     call.scaling))


def _flex_kernel(query, key, value, table, offset: int, valid, scaling) -> torch.Tensor:
    """torch.compile(flex_attention) on a distance-table problem (see kernel_check.table_attention_reference):
    output [B, q, H, D]."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, heads, q, _ = query.shape
    kv = key.shape[2]
    offset_t = torch.tensor(offset, device=query.device)
    last = table.shape[1] - 1

    def score_mod(score, b, h, q_idx, kv_idx):
        distance = (q_idx + offset_t - kv_idx).clamp(0, last)
        return score + table[h, distance]

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset_t) & valid[b, kv_idx]

    device = query.device.type
    if device not in _compiled_flex:
        # Inductor's CPU flex template failed to compile with dynamic shapes (torch 2.13): one compile per shape.
        _compiled_flex[device] = torch.compile(flex_attention, dynamic=False if device == "cpu" else None)
    blocks = create_block_mask(mask_mod, batch, None, q, kv, device=query.device)
    with recompile_allowance():
        output = _compiled_flex[device](query, key, value, score_mod=score_mod, block_mask=blocks, scale=scaling,
                                        enable_gqa=heads != key.shape[1],
                                        kernel_options=FLEX_CUDA_KERNEL_OPTIONS if device == "cuda" else None)
    return output.transpose(1, 2).contiguous()


def recompile_allowance():
    """dynamo's recompile limit raised to FLEX_RECOMPILE_LIMIT for the duration of one compiled call (flex, or a
    compiled content block)."""
    config = torch._dynamo.config
    if getattr(config, RECOMPILE_LIMIT_OPTION) >= FLEX_RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return config.patch(**{RECOMPILE_LIMIT_OPTION: FLEX_RECOMPILE_LIMIT})


def _table_gradient_probe(kernel, query, key, value, table, end: int, valid, scaling,
                          table_gradient: bool = True) -> GradientProbe:
    """A small square problem cut from a call, for checking the gradients of `kernel(query, key, value, table,
    offset, valid, scaling)` w.r.t. queries, keys, values and (where `table_gradient`) the table: the last
    PROBE_ROWS queries of the first PROBE_BATCH rows, with the keys that end at the last query's slot (key index
    `end` - 1)."""
    size = min(PROBE_ROWS, query.shape[2], end)
    rows = slice(0, min(PROBE_BATCH, query.shape[0]))
    keys = slice(end - size, end)
    fixed = {"offset": 0, "scaling": scaling, "valid": valid[rows, keys] if valid is not None else None}
    inputs = {"query": query[rows, :, -size:], "key": key[rows, :, keys], "value": value[rows, :, keys]}
    if table_gradient:
        inputs["table"] = table[:, :size]
    else:
        fixed["table"] = table[:, :size]
    return GradientProbe(
        inputs, kernel=lambda **tensors: kernel(**tensors, **fixed),
        reference=lambda **tensors: table_attention_reference(**tensors, **fixed),
        defined=fixed["valid"].cumsum(-1) > 0 if valid is not None else None)


def _triton_masks(call: AttentionCall, offset: int):
    """(valid [B, kv] bool, lowest [B, q] long) such that the given mask is exactly: key j valid, j >= lowest[i]
    (the query's document starts there) and j <= i + offset; (None, None) without a mask; None where the mask is
    not of that form (the Triton kernel cannot serve it). Read once per forward: every layer gets the same mask."""
    mask = call.attention_mask
    if mask is None:
        return None, None
    q, kv = call.query.shape[2], call.key.shape[2]
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (q, kv):
        return None

    def read():
        if mask.dtype == torch.bool:
            allowed = mask[:, 0]
        elif mask.is_floating_point():  # an additive mask of 0 and "minus infinity" only
            allowed = additive_mask_allowed(mask[:, 0])
            if allowed is None:
                return None
        else:
            return None
        valid = allowed.any(-2)
        lowest = allowed.to(torch.int8).argmax(-1)
        columns = torch.arange(kv, device=mask.device)
        rebuilt = (valid[:, None, :] & (columns >= lowest[..., None])
                   & (columns <= torch.arange(q, device=mask.device)[:, None] + offset))
        return (valid, lowest) if torch.equal(rebuilt, allowed.expand_as(rebuilt)) else None
    return call.state.once_per_forward(("triton masks", mask.data_ptr(), tuple(mask.shape), offset), read)


def _triton_call(call: AttentionCall) -> KernelCall | None:
    """The Triton distance-table kernel (kernels/triton/table_attention.py), or None where it does not apply (a
    method without a distance table or KERNELS entry, a key mask or sliding window, a mask that is not padding and
    documents). Its kind: dtype, heads, key heads, head size, masked or not, grad mode (one JIT kernel with run-time
    shapes)."""
    state, method, query, key = call.state, call.method, call.query, call.key
    if not serves_triton_table(method) or method.masks_keys or call.options.get("sliding_window") \
            or getattr(call.module, "sliding_window", None):
        return None
    triton_attention = table_kernel(query.device, forced=chosen_path(state) == "triton")
    if triton_attention is None:
        return None
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    offset = state.query_offset(q, kv)
    masks = _triton_masks(call, offset)
    if masks is None:
        return None
    valid, lowest = masks
    table = distance_table(method, call.layer_idx, position_span(call).distances, max_query_position(call),
                           query.device)
    if table is None:
        return None
    if query.dtype == torch.float64:
        table = table.double()
    with_grad = needs_grad(method, query, key, call.value)
    dtype = str(query.dtype)
    query_positions, key_positions = call.query_positions, call.key_positions

    def kernel(query, key, value, table):
        return triton_attention(query, key, value, table, query_positions, key_positions, valid, lowest,
                                       offset, call.scaling).transpose(1, 2).contiguous()

    def probe_kernel(query, key, value, table, offset, valid, scaling):
        end = key.shape[2]
        positions = torch.arange(end, device=query.device)[None]
        return triton_attention(query, key, value, table, positions[:, end - query.shape[2]:], positions,
                                       valid, None, offset + end - query.shape[2], scaling).transpose(1, 2)

    defined = None
    if valid is not None:
        defined = lambda: (valid[:, None, :] & (torch.arange(kv, device=query.device)  # noqa: E731
                           >= lowest[..., None]) & (torch.arange(kv, device=query.device)
                           <= torch.arange(q, device=query.device)[:, None] + offset)).any(-1)
    return KernelCall(
        kernel="triton", device=query.device,
        kind=(dtype, heads, key.shape[1], head_dim, "mask" if valid is not None else "no mask",
              "grad" if with_grad else "no grad"),
        function=kernel, inputs={"query": query, "key": key, "value": call.value, "table": table},
        reference=_reference_rows(call), defined=defined,
        gradient_kind=(dtype, heads, key.shape[1], head_dim) if with_grad else None,
        gradient_probe=(lambda: _table_gradient_probe(probe_kernel, query, key, call.value, table, offset + q, None,
                                                      call.scaling)) if with_grad else None)


def _flash_device(query: torch.Tensor) -> bool:
    """flash-attn runs on CUDA in fp16/bf16 only."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def _flash_call(call: AttentionCall) -> KernelCall | None:
    """flash-attn with alibi_slopes, or None where it does not apply (ALiBi with fixed slopes on CUDA in fp16/bf16,
    no padding, a cache holding exactly the keys seen: not a StaticCache). flash-attn is a
    fixed kernel with run-time shapes: its kind is the dtype, heads and head size, whether it decodes (one query)
    or the queries are all the keys, and power-of-two size classes of batch, queries and keys, so a generation
    checks about log2(length) kinds, not every step."""
    state, method, query, key, attention_mask, scaling = (call.state, call.method, call.query, call.key,
                                                          call.attention_mask, call.scaling)
    if not _flash_device(query):
        return None
    slopes = method.alibi_slopes(query.device) if isinstance(method, AttentionBiasMethod) else None
    if slopes is None:
        return None
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    # A boolean mask whose last row is all True holds no padding: it is the causal mask, which flash applies.
    if attention_mask is not None and not (attention_mask.dtype == torch.bool
                                           and bool(attention_mask[:, :, -1, :].all())):
        return None
    # flash-attn aligns causal attention to the lower right: key slots must be exactly 0..offset+q-1.
    if state.first_key_slot(q, kv) != 0 or int(state.forward.slot_offset) + q != kv:
        return None
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    slopes = slopes.float()
    with_grad = needs_grad(method, query, key, call.value)
    dtype = str(query.dtype)

    def kernel(query, key, value, scaling=scaling, **ignored):  # flash-attn applies the causal mask and ALiBi itself
        return flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                               softmax_scale=scaling, causal=True, alibi_slopes=slopes)

    def gradient_probe():
        table = distance_table(method, call.layer_idx, min(q, PROBE_ROWS), 0, query.device)
        return _table_gradient_probe(kernel, query, key, call.value, table, kv, None, scaling, table_gradient=False)

    return KernelCall(
        kernel="flash", device=query.device,
        kind=(dtype, heads, key.shape[1], head_dim, "decoding" if q == 1 else "square" if q == kv else "chunk",
              power_of_two_bucket(batch), power_of_two_bucket(q), power_of_two_bucket(kv),
              "grad" if with_grad else "no grad"),
        function=kernel, inputs={"query": query, "key": key, "value": call.value},
        reference=_reference_rows(call),
        gradient_kind=(dtype, heads, key.shape[1], head_dim) if with_grad else None,
        gradient_probe=gradient_probe if with_grad else None)
