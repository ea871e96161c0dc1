"""The content path: methods whose logits or weights depend on the queries, keys and per-token state (CoPE,
stick-breaking, CAPE, FoX, Transformer-XL, TAPE; methods/base.py ContentMethod). In order: on the "triton" path a
method's Triton kernel (triton_content.py), the separable form (separable.py), the kernel form on transformed queries
and keys (`kernel_heads`), a fused CPU kernel, the compiled blocks (compiled_content.py), else the eager blocks,
recomputed in the backward (content_blocks.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..content import layer_state
from ..kernels.fused_cpu import causal_attention, fused_kernels_enabled
from ..kernels.by_method import causal_kernel, kernel_heads
from ...methods.base import SeparableBiasForm
from ..kernels.check import PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall, table_attention_reference
from ..kernels.check import serve as serve_checked
from .call import AttentionCall
from .compiled_content import compiled_content_call, fused_content_call
from .content_blocks import RecomputedBlocks, content_block, content_mask, cut_block
from .geometry import (block_rows, causal_blocks, causal_square, cpu_flash_applies, match_heads, needs_grad,
                       position_span, power_of_two_bucket)
from .paths import chosen_path, count_path
from .separable import SeparableBiasAttention, causal_separable_attention
from .triton_content import triton_content

# Eager content blocks on the CPU: each costs a fixed few ms of Python and autograd; 32 MiB was 10-15% faster than
# 16 MiB for CoPE and stick-breaking at 2048-4096 tokens (docs/attention-paths.md, content-dependent attention).
CONTENT_BLOCK_BYTES = 32 * 2**20
# Compiled content blocks on the CPU: the fused chain runs best on a few hundred rows (2.1x faster than the eager
# budget's 18-row blocks for stick-breaking at 4096 keys; docs/attention-paths.md, compiled content blocks).
COMPILED_BLOCK_BYTES = 64 * 2**20


def content_attention(call: AttentionCall):
    """Attention for content methods (methods/base.py ContentMethod): the method computes each query block's logits
    (`content_scores`) or, for attention that is not a softmax, its weights (`content_weights`) from the queries, keys
    and carried per-token state (engine/content.py); this path does the blocking, masking, softmax and values. Each
    block holds a few [B, H, rows, keys] tensors (the method's `block_cost`), never [L, L] for the whole sequence.
    Returns (output [B, q, H, D], attention weights [B, H, q, kv] in eager mode, else None)."""
    state, method, layer_idx, scaling, dropout, eager = (call.state, call.method, call.layer_idx, call.scaling,
                                                         call.dropout, call.eager)
    attention_mask, query_positions, key_positions = call.attention_mask, call.query_positions, call.key_positions
    count_path(state, "content")
    batch, heads, q, _ = call.query.shape
    kv = call.key.shape[2]
    layer_input, query_state, key_state = layer_state(state, layer_idx, q, call.key_slots)
    query, key, value = method.prepare_heads(layer_idx, call.query, call.key, call.value, layer_input, key_state,
                                             state.first_key_slot(q, kv))
    if chosen_path(state) == "triton":
        output = triton_content(call, query, key, value, layer_input, query_state, key_state)
        if output is not None:
            count_path(state, "triton")
            return method.finish_output(layer_idx, output, layer_input).transpose(1, 2).contiguous(), None
    outputs, weights, mixed = [], [], []
    step = block_rows(batch, heads, kv, method.block_cost, query.device,
                      CONTENT_BLOCK_BYTES if query.device.type == "cpu" else None)
    terms = method.separable_terms(query_state, key_state) if isinstance(method, SeparableBiasForm) \
        and not eager and dropout == 0.0 \
        and cpu_flash_applies(query) else None
    if terms is not None:  # the logits' bias is a term per query minus one per key: SDPA's kernel per block
        count_path(state, "separable")

        def block_mask(rows, columns):
            return content_mask(call, rows, columns)

        if _plain_causal(call, q, kv):
            count_path(state, "separable causal")
            output = causal_separable_attention(query, match_heads(key, heads), match_heads(value, heads), *terms,
                                                scaling)
        else:
            separable_rows = block_rows(batch, heads, kv, device=query.device)
            blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), separable_rows, False))
            output = SeparableBiasAttention.apply(query, match_heads(key, heads), match_heads(value, heads), *terms,
                                                  blocks, block_mask, scaling)
        return method.finish_output(layer_idx, output, layer_input).transpose(1, 2).contiguous(), None
    fused = chosen_path(state) == "auto" and query.device.type == "cpu" and fused_kernels_enabled()
    # The kernel form turns the keys at their key-value heads, before they are repeated for the query heads.
    kernel_query_key = kernel_heads(method, layer_idx, query, key, query_state, key_state, query_positions,
                                    key_positions, fused=fused) if not eager and dropout == 0.0 else None
    kernel = _kernel_content(call, kernel_query_key, value, key_state, fused) if kernel_query_key is not None else None
    if kernel is not None:  # the logits are a dot product of transformed queries and keys: SDPA serves
        count_path(state, "content kernel")
        output, mixed_state = kernel
        if method.mixes_state:
            state.forward.content.mixed[layer_idx] = mixed_state
        return method.finish_output(layer_idx, output, layer_input).transpose(1, 2).contiguous(), None
    key, value = match_heads(key, heads), match_heads(value, heads)
    causal = causal_kernel(method)
    if chosen_path(state) == "auto" and causal is not None and query.device.type == "cpu" \
            and fused_kernels_enabled() and not eager and dropout == 0.0 and query_state is None \
            and key_state is None and _plain_causal(call, q, kv) and causal.applies(method, layer_idx,
                                                                                   query_positions):
        output = serve_checked(fused_content_call(call, query, key, value))
        if output is not None:
            count_path(state, "fused content")
            output = method.finish_output(layer_idx, output.transpose(1, 2), layer_input)
            return output.transpose(1, 2).contiguous(), None
    if chosen_path(state) == "compiled" and not eager and dropout == 0.0 and not method.mixes_state:
        rows = max(step, block_rows(batch, heads, kv, budget=COMPILED_BLOCK_BYTES))
        output = serve_checked(compiled_content_call(call, query, key, value, query_state, key_state, rows))
        if output is not None:
            count_path(state, "compiled content")
            output = method.finish_output(layer_idx, output.transpose(1, 2), layer_input)
            return output.transpose(1, 2).contiguous(), None
    blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), step, eager))
    # Read now, not in the backward's recomputation (when the state may hold a later forward).
    span = position_span(call) if method.reads_position_span else None
    if not eager and torch.is_grad_enabled() and dropout == 0.0 and not method.mixes_state:
        # Recomputed in the backward pass (the blocks' masks too): otherwise every block's [B, H, rows, keys]
        # temporaries would be kept for it, O(L^2) in all; this way a forward+backward holds one block at a time.
        def block_output(rows, columns, *heads):
            return content_block(call, rows, columns, *heads, span=span)[0]

        tensors = (query, key, value, query_state, key_state)
        parameters = [parameter for parameter in method.parameters() if parameter.requires_grad]
        outputs.append(RecomputedBlocks.apply(block_output, blocks, len(tensors), *tensors, *parameters))
        count_path(state, "content recomputed")
    else:
        for rows, columns in blocks:
            arguments = (call, rows, columns, *cut_block(rows, columns, query, key, value, query_state, key_state),
                         dropout, span)
            if eager or not torch.is_grad_enabled():
                output, probs, mixed_state = content_block(*arguments)
            else:  # dropout (its mask drawn again in the recomputation), or blocks that also mix the keys' state
                output, mixed_state = torch.utils.checkpoint.checkpoint(lambda *a: content_block(*a)[::2],
                                                                        *arguments, use_reentrant=False)
            outputs.append(output)
            mixed.append(mixed_state)
            if eager:
                weights.append(probs.to(value.dtype))
    if method.mixes_state:  # the attention-weighted state of the keys, for the next layer (engine/content.py)
        state.forward.content.mixed[layer_idx] = torch.cat(mixed, dim=2) if len(mixed) > 1 else mixed[0]
    output = method.finish_output(layer_idx, torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0],
                                  layer_input)
    attn_weights = (torch.cat(weights, dim=2) if len(weights) > 1 else weights[0]) if eager else None
    return output.transpose(1, 2).contiguous(), attn_weights


def _plain_causal(call: AttentionCall, q: int, kv: int) -> bool:
    """Whether a content call's allowed keys are exactly the causal ones with query i being key i (a causal square,
    no key mask or native bias of the method): then one causal kernel call serves it."""
    method = call.method
    return (causal_square(call.attention_mask, q, kv) and not method.masks_keys
            and method.native_bias(call.layer_idx, call.query_positions[:, :1], call.key_positions[:, :1]) is None)


def _pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, n, E] -> [B, H, n, width], zeros after the first E columns."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _kernel_content(call: AttentionCall, kernel_query_key, value, key_state, fused: bool):
    """A content method's attention as SDPA on its `kernel_heads` (q' [B, H, q, E], k' [B, H_kv, kv, E]) and the
    values [B, H_kv, kv, D]: (output [B, H, q, D] in value's dtype, for `mixes_state` methods the same weights applied
    to the keys' state [B, H, q, ...] in float32, else None), or None where the method's form does not hold for some
    attended pair (kernel_needs_ordered_keys). The keys' state rides beside the values (one call gives both
    averages). SDPA's CPU kernel needs one head size for queries, keys and values (otherwise its math path runs,
    several times slower): the narrower side is padded with zeros, unless `fused` (CPU kernels may serve) and the call
    is a causal square, which the fused causal kernel serves unpadded. One causal call without a mask; otherwise one
    call per causal query block, with the block's mask and bias as a float mask (dtype's minimum where hidden, as the
    generic path masks)."""
    state, method, scaling = call.state, call.method, call.scaling
    query_positions, key_positions = call.query_positions, call.key_positions
    query, key = kernel_query_key
    dim, batch, kv = value.shape[-1], query.shape[0], key.shape[2]
    heads, q = query.shape[1:3]
    values = value.to(query.dtype)
    if method.mixes_state and key_state is not None:
        features = key_state.to(query.dtype).flatten(3)
        if features.shape[1] != values.shape[1]:
            values, features = (match_heads(x, heads) for x in (values, features))
        values = torch.cat((values, features), dim=-1)
    key, values = match_heads(key, heads), match_heads(values, heads)
    width = max(query.shape[-1], values.shape[-1])
    used = values.shape[-1]
    if _plain_causal(call, query.shape[2], kv):
        # Query i is key i: every attended key's position is at most the query's iff positions never go back.
        if method.kernel_needs_ordered_keys and not state.once_per_forward(
                ("keys precede their queries", q, kv),
                lambda: bool((key_positions.cummax(-1).values <= query_positions).all())):
            return None
        output = None
        if query.shape[-1] != used and fused:
            output = serve_checked(_fused_causal_call(call, query, key, values))
        if output is not None:
            count_path(state, "fused causal")
            output = output.transpose(1, 2)
        else:
            query, key, values = (_pad_heads(x, width) for x in (query, key, values))
            output = F.scaled_dot_product_attention(query, key, values, is_causal=True, scale=scaling)
    else:
        query, key, values = (_pad_heads(x, width) for x in (query, key, values))
        low = torch.finfo(query.dtype).min
        kernel_rows = block_rows(batch, 1, kv, device=query.device)
        blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), kernel_rows, False))
        if method.kernel_needs_ordered_keys and not _attended_keys_precede(call, blocks):
            return None
        outputs = []
        for rows, columns in blocks:
            allowed, bias = content_mask(call, rows, columns)
            mask = torch.where(allowed, bias.to(query.dtype) if bias is not None else 0.0, low).to(query.dtype)
            outputs.append(F.scaled_dot_product_attention(query[:, :, rows], key[:, :, columns],
                                                          values[:, :, columns], attn_mask=mask, scale=scaling))
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    mixed = output[..., dim:used].unflatten(-1, key_state.shape[3:]) if used > dim else None
    return output[..., :dim].to(value.dtype), mixed


def _fused_causal_call(call: AttentionCall, query, key, value) -> KernelCall:
    """A content kernel form's causal square whose queries and keys differ in head size from the values
    (Transformer-XL, TAPE) by the fused CPU kernel (engine/kernels/fused_cpu.py causal_attention), unpadded;
    checked against the materialised softmax like any kernel (the distance-table reference with no bias). Its kind:
    the method, dtype, grad mode and the length's size class."""
    scaling = call.scaling
    no_bias = query.new_zeros(query.shape[1], 1)

    def materialised(query, key, value, rows: slice) -> torch.Tensor:
        return table_attention_reference(query[:, :, rows], key[:, :, :rows.stop], value[:, :, :rows.stop], no_bias,
                                         rows.start, None, scaling)

    def gradient_probe() -> GradientProbe:  # the last PROBE_ROWS tokens, a causal square again
        size = min(PROBE_ROWS, query.shape[2])
        cut = (slice(0, min(PROBE_BATCH, query.shape[0])), slice(None), slice(query.shape[2] - size, None))
        return GradientProbe({"query": query[cut], "key": key[cut], "value": value[cut]},
                             kernel=lambda **probe: causal_attention(**probe, scaling=scaling).transpose(1, 2),
                             reference=lambda **probe: materialised(**probe, rows=slice(0, size)))

    name, dtype = call.method.config.method, str(query.dtype)
    with_grad = needs_grad(call.method, query, key, value)
    return KernelCall(
        kernel="fused cpu (causal)", device=query.device,
        kind=(name, dtype, "grad" if with_grad else "no grad", power_of_two_bucket(query.shape[2])),
        function=lambda query, key, value: causal_attention(query, key, value, scaling).transpose(1, 2),
        inputs={"query": query, "key": key, "value": value},
        reference=lambda rows: materialised(query, key, value, rows),
        gradient_kind=(name, dtype) if with_grad else None, gradient_probe=gradient_probe if with_grad else None)


def _attended_keys_precede(call: AttentionCall, blocks) -> bool:
    """Whether no query attends a key at a later position, decided before any kernel call. Usually by the slots
    alone (no key up to a query's slot is at a later position); where positions go back (packed documents, left
    padding), by each block's mask."""
    query_slots, key_slots = call.query_slots, call.key_slots
    query_positions, key_positions = call.query_positions, call.key_positions

    def by_slots() -> bool:
        last_key = torch.searchsorted(key_slots, query_slots, right=True).clamp_min(1) - 1
        return bool((key_positions.cummax(-1).values[:, last_key] <= query_positions).all())

    if call.state.once_per_forward(("attended keys precede by slot", query_slots.shape[0], key_slots.shape[0]),
                                   by_slots):
        return True
    for rows, columns in blocks:
        allowed, _ = content_mask(call, rows, columns)
        if bool((allowed & (key_positions[:, None, None, columns] > query_positions[:, None, rows, None])).any()):
            return False
    return True
