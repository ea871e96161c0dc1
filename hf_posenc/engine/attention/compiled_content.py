"""A content call by a kernel: the "compiled" path (each block's chain under torch.compile, blocks recomputed in the
backward) and a method's fused CPU kernel on a causal square; both checked against the eager blocks (kernel_check),
with a gradient probe that compares the method's parameters' gradients too."""

from __future__ import annotations

import functools

import torch

from ...methods.base import ContentBlock
from ..kernels.check import PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall
from ..kernels.by_method import causal_kernel
from .bias_path import recompile_allowance
from .call import AttentionCall
from .content_blocks import (RecomputedBlocks, content_block, content_block_of, content_block_output,
                             content_rows_defined, cut_block)
from .geometry import causal_blocks, causal_columns, needs_grad, power_of_two_bucket

_compiled_block_output = None  # torch.compile(content_block_output), made at the first "compiled" call


def compiled_content_call(call: AttentionCall, query, key, value, query_state, key_state, step: int) -> KernelCall:
    """The "compiled" path of a content call (heads matched, no dropout, no attention weights): the blocks of
    `content_attention`, each one's chain (the method's logits or weights, softmax, values) under torch.compile, which
    fuses its elementwise passes. Its kind: the method, dtype, heads, head size, mask, grad mode and size classes of
    the queries and keys (compiled with dynamic shapes, so a new length rarely recompiles)."""
    method, state = call.method, call.state
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    with_grad = needs_grad(method, query, key, value)
    blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), step, False))

    def reference(rows: slice) -> torch.Tensor:
        columns = causal_columns(rows, kv, state.query_offset(q, kv))
        return content_block(call, rows, columns,
                             *cut_block(rows, columns, query, key, value, query_state, key_state))[0].transpose(1, 2)

    name, dtype, masked = method.config.method, str(query.dtype), call.attention_mask is not None
    return KernelCall(
        kernel=f"compiled content ({name})", device=query.device,  # a refusal holds for this method's chain alone
        kind=(name, dtype, heads, head_dim, "mask" if masked else "no mask", "grad" if with_grad else "no grad",
              power_of_two_bucket(q), power_of_two_bucket(kv)),
        function=functools.partial(_compiled_content_kernel, call, blocks=blocks, states=(query_state, key_state),
                                   with_grad=with_grad),
        inputs={"query": query, "key": key, "value": value},
        reference=reference,
        defined=lambda: content_rows_defined(call, batch, blocks),
        gradient_kind=(name, dtype, heads, head_dim, masked) if with_grad else None,
        gradient_probe=lambda: content_gradient_probe(call, query, key, value, (query_state, key_state)))


def fused_content_call(call: AttentionCall, query, key, value) -> KernelCall:
    """A content call of a causal square (`_plain_causal`, no per-token state) by the method's fused CPU kernel
    (engine/kernels/fused_cpu.py); its kind: the method, dtype, grad mode and the length's size class (one
    compiled kernel serves every shape; its tiles split differently by length), and the `variant` of the method's entry in
    engine/kernels/by_method.py (the kernel's code paths its options choose)."""
    method, state, layer_idx, scaling = call.method, call.state, call.layer_idx, call.scaling
    causal = causal_kernel(method)
    q, kv = query.shape[2], key.shape[2]
    with_grad = needs_grad(method, query, key, value)

    def kernel(query, key, value, positions=call.query_positions):
        return causal.run(method, layer_idx, query, key, value, scaling, positions).transpose(1, 2)

    def reference(rows: slice) -> torch.Tensor:
        columns = causal_columns(rows, kv, state.query_offset(q, kv))
        return content_block(call, rows, columns,
                             *cut_block(rows, columns, query, key, value, None, None))[0].transpose(1, 2)

    name, dtype, variant = method.config.method, str(query.dtype), causal.variant(method)
    return KernelCall(
        kernel=f"fused cpu ({name})", device=query.device,
        kind=(name, *variant, dtype, "grad" if with_grad else "no grad", power_of_two_bucket(query.shape[2])),
        function=kernel, inputs={"query": query, "key": key, "value": value}, reference=reference,
        gradient_kind=(name, *variant, dtype) if with_grad else None,
        gradient_probe=lambda: content_gradient_probe(call, query, key, value, (None, None), kernel=kernel))


def _compiled_content_kernel(call: AttentionCall, query, key, value, blocks, states, with_grad) -> torch.Tensor:
    """The compiled blocks of a content call (see compiled_content_call): output [B, q, H, D]. With gradients each
    block is recomputed in the backward (as the eager blocks are), so a forward+backward holds one block at a time.
    `states`: the per-token state of the queries and of the keys (or None)."""
    global _compiled_block_output
    if _compiled_block_output is None:
        _compiled_block_output = torch.compile(content_block_output, dynamic=True)
    compiled = _compiled_block_output
    method = call.method
    parameters = [parameter for parameter in method.parameters() if parameter.requires_grad] if with_grad else []

    def block_output(rows, columns, query, key, value, query_state, key_state):
        block = content_block_of(call, rows, columns, query_state, key_state)
        # Contiguous inputs at offset 0: a block's slices have strides and storage offsets that differ from block to
        # block, and dynamo guards on how those relate to sizes (each new relation would recompile).
        block = ContentBlock(**{name: _plain_layout(value) if isinstance(value, torch.Tensor) else value
                                for name, value in vars(block).items()})
        with recompile_allowance(), _no_duck_sizing():  # the backward's recomputation included
            return compiled(method, *(_plain_layout(tensor) for tensor in (query, key, value)), block)

    tensors = (query, key, value, *states)
    if with_grad:
        outputs = [RecomputedBlocks.apply(block_output, blocks, len(tensors), *tensors, *parameters)]
    else:
        outputs = [block_output(rows, columns, *cut_block(rows, columns, *tensors)) for rows, columns in blocks]
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return output.transpose(1, 2).contiguous()


def _plain_layout(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor at storage offset 0 with the values of `tensor` (itself where it already is one)."""
    return tensor if tensor.is_contiguous() and tensor.storage_offset() == 0 else tensor.clone(
        memory_format=torch.contiguous_format)


def _no_duck_sizing():
    """Dynamo's duck sizing off for one compiled content block: with it, sizes that happen to be equal in the first
    call (a block's rows and keys, a slot offset and a length) are guarded equal, and the next block recompiles."""
    import torch.fx.experimental._config as shape_config

    return shape_config.patch(use_duck_shape=False)


def content_gradient_probe(call: AttentionCall, query, key, value, states, kernel=None) -> GradientProbe:
    """A small problem cut from a content call, for checking a kernel's gradients (by default the compiled blocks')
    w.r.t. queries, keys, values and the method's parameters against the eager block: the last PROBE_ROWS queries of
    the first PROBE_BATCH rows, with the keys that end at the last query's slot (in a causal square, a causal square
    again)."""
    query_state, key_state = states
    q = query.shape[2]
    end = min(key.shape[2], int(call.query_slots[-1]) - int(call.key_slots[0]) + 1)
    size = min(PROBE_ROWS, q, end)
    batch = slice(0, min(PROBE_BATCH, query.shape[0]))
    rows, keys = slice(q - size, q), slice(end - size, end)
    mask = call.attention_mask
    probe = call.replace(attention_mask=mask[batch][..., rows, keys] if mask is not None else None,
                         query_slots=call.query_slots[rows], key_slots=call.key_slots[keys],
                         query_positions=call.query_positions[batch][:, rows],
                         key_positions=call.key_positions[batch][:, keys])
    probe_states = (query_state[batch][:, :, rows] if query_state is not None else None,
                    key_state[batch][:, :, keys] if key_state is not None else None)
    block = (slice(0, size), slice(0, size))

    def compiled(query, key, value):
        return _compiled_content_kernel(probe, query, key, value, [block], probe_states, True)

    def reference(query, key, value):
        return content_block(probe, *block, *cut_block(*block, query, key, value, *probe_states))[0].transpose(1, 2)

    def given(query, key, value):  # a kernel of the whole call, on the probe's position ids
        return kernel(query, key, value, positions=probe.query_positions)

    parameters = {name: parameter for name, parameter in call.method.named_parameters() if parameter.requires_grad}
    inputs = {"query": query[batch, :, rows], "key": key[batch, :, keys], "value": value[batch, :, keys]}
    defined = content_rows_defined(probe, inputs["query"].shape[0], [block])
    return GradientProbe(inputs, kernel=given if kernel is not None else compiled, reference=reference,
                         defined=defined, parameters=parameters)
