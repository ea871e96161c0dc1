"""A content call on the "triton" path: a method's Triton kernel (engine/kernels/by_method.py `TritonKernel`: FoX and
stick-breaking by fla-core, CoPE and CAPE by kernels/triton/cope_attention.py and cape_attention.py) on a causal
prefill, one document per row or packed documents, checked against the method's eager blocks like any kernel
(kernel_check). What the kernel does not serve returns None, and the blocked path serves it as on any other path: a
KV cache before the call, a padding mask or any mask other than packed documents', the method's native bias or key
mask, a call outside the kernel's `applies` (CAPE: positions that are not consecutive, a bias with no distance
table), eager attention (weights asked for), attention dropout, a dtype the kernel does not take (float64 for fla's
and CAPE's; bfloat16 on the CPU, where only the interpreter runs Triton), a head size over 256, or a machine where
Triton cannot run (no GPU and no TRITON_INTERPRET=1, or what the kernel needs not installed: fla-core for fla's,
triton for ours)."""

from __future__ import annotations

import torch

from ..kernels.by_method import TritonKernel, triton_kernel
from ..kernels.check import PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall
from ..kernels.check import serve as serve_checked
from ..kernels.triton import runs_on as triton_runs_on
from ..kernels.triton.fla_content import MAX_HEAD_DIM, cu_seqlens_of, document_starts
from .call import AttentionCall
from .content_blocks import content_block, cut_block
from .geometry import causal_columns, match_heads, needs_grad, power_of_two_bucket

# Query rows compared at a time when a packed mask is checked against its documents: bounds the [B, rows, T] bools.
MASK_CHECK_ROWS = 1024


def triton_content(call: AttentionCall, query, key, value, layer_input, query_state, key_state):
    """The call's output [B, H, q, D] (before the method's `finish_output`) by its Triton kernel, or None where the
    blocked path serves (see the module docstring). query [B, H, q, D], key and value [B, H_kv, kv, D] as the
    method's `prepare_heads` left them; the states as engine/content.py `layer_state` gives them."""
    kernel = triton_kernel(call.method)
    if kernel is None or not _served(call, kernel, query, key, value) \
            or not kernel.applies(call.method, call.layer_idx, call):
        return None
    documents = _documents(call, query.shape[0])
    if documents is False:
        return None
    gates = kernel.gates(call.method, call.layer_idx, layer_input) if kernel.gates is not None else None
    output = serve_checked(_kernel_call(call, kernel, query, key, value, gates, query_state, key_state, documents))
    return output.transpose(1, 2) if output is not None else None


def _served(call: AttentionCall, kernel: TritonKernel, query, key, value) -> bool:
    """Whether the call is one the Triton kernels take, from its sizes and options (no read of a tensor's values)."""
    method, state = call.method, call.state
    q, kv = query.shape[2], key.shape[2]
    return (not call.eager and call.dropout == 0.0 and q == kv and int(state.forward.slot_offset) == 0
            and query.dtype in kernel.dtypes and value.dtype == query.dtype
            # Triton 3.9's interpreter multiplies bfloat16 tl.dot operands as raw bits: on the CPU it stays blocked
            and not (query.device.type == "cpu" and query.dtype == torch.bfloat16)
            and max(query.shape[-1], value.shape[-1]) <= MAX_HEAD_DIM
            and not method.masks_keys
            and method.native_bias(call.layer_idx, call.query_positions[:, :1], call.key_positions[:, :1]) is None
            and triton_runs_on(query.device) and kernel.installed())


def _documents(call: AttentionCall, batch: int):
    """fla's cu_seqlens for the call's rows laid end to end where the given mask is exactly packed documents' (each
    query sees the keys of its own document up to itself, documents starting where position ids do not go up by
    one, as transformers builds that mask); None where there is no mask (each row one causal sequence); False for
    any other mask (padding), which the kernels do not take. Read once per forward and mask."""
    mask = call.attention_mask
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return False

    def read():
        q = mask.shape[-1]
        positions = call.query_positions.expand(batch, -1)
        starts = document_starts(positions)
        document = starts.cumsum(-1)
        given = mask[:, 0].expand(batch, -1, -1)
        slots = torch.arange(q, device=mask.device)
        for start in range(0, q, MASK_CHECK_ROWS):
            rows = slice(start, min(q, start + MASK_CHECK_ROWS))
            expected = (document[:, rows, None] == document[:, None, :]) & (slots[None, :] <= slots[rows, None])
            if not torch.equal(given[:, rows], expected):
                return False
        return cu_seqlens_of(starts) if bool(starts[:, 1:].any()) else None

    return call.state.once_per_forward(("triton documents", id(mask), mask.data_ptr(), tuple(mask.shape), batch),
                                       read)


def _kernel_call(call: AttentionCall, kernel: TritonKernel, query, key, value, gates, query_state, key_state,
                 cu_seqlens) -> KernelCall:
    """The call by `kernel` as a checked kernel call (outputs [B, q, H, D]): against the method's eager blocks on the
    call's rows, and for gradients on a probe of its last PROBE_ROWS tokens (w.r.t. queries, keys, values, the
    gates, through which the method's gate parameters get theirs, and the method's parameters, which a kernel may
    read itself: CoPE's position embeddings, CAPE's MLP and bias). Its kind: the method and its variant, dtype, grad
    mode, packed or not, the head counts and sizes (the kernels' compile-time constants) and the length's size
    class."""
    method, scaling = call.method, call.scaling
    batch, heads, q, head_dim = query.shape
    with_grad = needs_grad(method, query, key, value)

    def function(query, key, value, gates=None, cu_seqlens=cu_seqlens):
        return kernel.run(method, call.layer_idx, query, key, value, gates, scaling, cu_seqlens).transpose(1, 2)

    def reference(rows: slice) -> torch.Tensor:
        columns = causal_columns(rows, q, 0)
        cut = cut_block(rows, columns, query, match_heads(key, heads), match_heads(value, heads), query_state,
                        key_state)
        return content_block(call, rows, columns, *cut)[0].transpose(1, 2)

    def gradient_probe() -> GradientProbe:  # the last PROBE_ROWS tokens of the first rows: packed documents again
        size, rows_of = min(PROBE_ROWS, q), slice(0, min(PROBE_BATCH, batch))
        rows = slice(q - size, q)
        mask = call.attention_mask
        probe = call.replace(attention_mask=mask[rows_of][..., rows, rows] if mask is not None else None,
                             query_slots=call.query_slots[rows], key_slots=call.key_slots[rows],
                             query_positions=call.query_positions[rows_of][:, rows],
                             key_positions=call.key_positions[rows_of][:, rows])
        inputs = {"query": query[rows_of, :, rows], "key": key[rows_of, :, rows], "value": value[rows_of, :, rows]}
        if gates is not None:
            inputs["gates"] = gates[rows_of, :, rows]
        probe_batch = inputs["query"].shape[0]
        probe_documents = None if cu_seqlens is None else cu_seqlens_of(
            document_starts(probe.query_positions.expand(probe_batch, -1)))
        block = (slice(0, size), slice(0, size))

        def probe_reference(query, key, value, gates=None):
            state = gates.float().cumsum(-1) if gates is not None else None  # the method's c of these tokens
            return content_block(probe, *block, query, match_heads(key, heads), match_heads(value, heads), state,
                                 state)[0].transpose(1, 2)

        # Both sides read the method's parameters as they are; one that neither reads has no gradient on either.
        parameters = {name: parameter for name, parameter in method.named_parameters() if parameter.requires_grad}
        return GradientProbe(inputs, kernel=lambda **probe_inputs: function(**probe_inputs,
                                                                             cu_seqlens=probe_documents),
                             reference=probe_reference, parameters=parameters)

    name, dtype, variant = method.config.method, str(query.dtype), kernel.variant(method)
    layout = ("packed" if cu_seqlens is not None else "causal", heads, key.shape[1], head_dim, value.shape[-1])
    inputs = {"query": query, "key": key, "value": value}
    if gates is not None:
        inputs["gates"] = gates
    return KernelCall(
        kernel=f"triton ({name})", device=query.device,
        kind=(name, *variant, dtype, "grad" if with_grad else "no grad", *layout, power_of_two_bucket(q)),
        function=function, inputs=inputs, reference=reference,
        gradient_kind=(name, *variant, dtype, *layout) if with_grad else None,
        gradient_probe=gradient_probe if with_grad else None)
