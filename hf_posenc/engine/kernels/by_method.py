"""The kernels of each method, in one table keyed by the method's registered name (`KERNELS`).

An entry takes the method object and reads its parameters; it names the plain form the kernel check compares it with
(check.py), which is what serves wherever the kernel does not apply, fails its check, or is turned off
(`HF_POSENC_CPU_KERNELS=0`). A method registered under another name (a user's subclass of one of these) adds its own
entry: `KERNELS["my-method"] = MethodKernels(...)`.

On the "triton" path (`TritonKernel`): FoX and stick-breaking by fla-core's kernels, CoPE and CAPE by ours
(kernels/triton/cope_attention.py, cape_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ...methods.base import DotProductForm
from .check import PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall, serve as serve_checked
from .fused_cpu import (cape_causal, cope_causal, fire_attention_forward, fire_backward_tiles, stick_breaking_causal,
                        turn_by_features)
from .triton import triton_installed
from .triton.fla_content import FLA_DTYPES, fla_installed, forgetting_attention, stick_breaking_attention


@dataclass(frozen=True)
class CausalKernel:
    """A fused kernel computing a content method's whole call on a causal square (query i is key i, nothing but
    causality masks: no padding, cache, native bias or per-token state), checked against the method's blocks."""

    # (method, layer_idx, query, key [B, H, L, D], value [B, H, L, E], scaling, positions [B or 1, L]) -> output
    # [B, H, L, E] in value's dtype
    run: Callable[..., torch.Tensor]
    reference: str  # the plain form it is checked against (through the engine's eager blocks)
    # (method, layer_idx, positions) -> whether the kernel's form holds for tokens at these position ids
    applies: Callable[..., bool] = lambda method, layer_idx, positions: True
    # method -> the kernel's code paths its options choose: part of the checked kind, so that a check of one path
    # does not vouch for another
    variant: Callable[..., tuple] = lambda method: ()


@dataclass(frozen=True)
class TritonKernel:
    """A Triton kernel computing a content method's whole call on a causal prefill, one row or packed documents
    (no cache before the call, no padding, native bias or key mask; engine/attention/triton_content.py decides),
    checked against the method's blocks, the gradients of the method's parameters included (a kernel that reads one
    itself, as CoPE's reads its position embeddings, must differentiate it). Served on the "triton" attention path."""

    # (method, layer_idx, query [B, H, T, D], key/value [B, H_kv, T, D], gates [B, H, T] or None, scaling,
    # cu_seqlens or None) -> output [B, H, T, D]
    run: Callable[..., torch.Tensor]
    # (method, layer_idx, layer input [B, T, hidden]) -> the per-token gates the kernel takes, float32 [B, H, T],
    # whose cumulative sum is the method's query and key state (FoX's log f_t); None: the kernel takes none
    gates: Callable[..., torch.Tensor] | None = None
    # method -> the kernel's code paths its options choose (part of the checked kind)
    variant: Callable[..., tuple] = lambda method: ()
    # the dtypes it takes (fla's kernels keep float32 statistics: no float64) and what it needs installed
    dtypes: tuple[torch.dtype, ...] = FLA_DTYPES
    installed: Callable[[], bool] = fla_installed
    # (method, layer_idx, the AttentionCall) -> whether the kernel's form holds for the call's positions (values read
    # once per forward: call.state.once_per_forward)
    applies: Callable[..., bool] = lambda method, layer_idx, call: True


@dataclass(frozen=True)
class FormKernel:
    """A fused CPU kernel for a method's BiasForm (engine/attention/form_attention.py): forward and backward where
    causality by slots is all the mask, checked against the form's torch-op tiles (`tile`, `accumulate`) on the
    call's own form."""

    name: str  # as kernel_status() records its check
    # (form, query slots, key slots, query [B, H, q, D], key, value [B, H_kv, kv, D], scaling) -> the output
    # [B, H, q, D] and each row's logsumexp [B, H, q], in the inputs' dtype (float32 or float64)
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (form, query slots, key slots, Q', K', dO', V' (the widened operands), blocks [(first, rows, keys)], key_tile,
    # scaling, needed) -> the gradients of queries [B*H, q, D], keys and values per query head [B*H, kv, D]; the
    # form's sums added (BiasForm.add_sums)
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class MethodKernels:
    causal: CausalKernel | None = None
    triton: TritonKernel | None = None
    # (method, *kernel_heads' arguments) -> kernel_heads computed by fused CPU kernels; reference: method.kernel_heads
    heads: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # The fused near/far kernel (fused_cpu.near_far_causal) may serve the method's block_parts where the far keys are
    # a causal triangle: its block_parts are all there is to its scores. Reference: block_scores and a softmax.
    near_far: bool = False
    # The Triton distance-table kernel (kernels/triton/table_attention.py) may serve the method's calls where its
    # `bias_table` gives a table: the bias depends on the distance alone. Reference: the blocked path.
    triton_table: bool = False
    form: FormKernel | None = None


# --- stick-breaking, CoPE, CAPE: a causal square in one call ---------------------------------------------------------

def stick_breaking_kernel(method, layer_idx, query, key, value, scaling, positions):
    return stick_breaking_causal(query, key, value, scaling, method.config.attend_current)


def cope_kernel(method, layer_idx, query, key, value, scaling, positions):
    return cope_causal(query, key, value, method.position_embeddings[layer_idx], scaling, method.config.max_pos)


def cape_applies(method, layer_idx, positions) -> bool:
    """cape.cpp takes the bias as a table of distances i - j: every row's position ids consecutive, and a bias
    method whose bias depends on the distance alone up to the call's last position."""
    if positions.shape[-1] > 1 and not bool((positions.diff(dim=-1) == 1).all()):
        return False
    return method.bias_method.bias_table(layer_idx, 1, int(positions.max()), positions.device) is not None


def cape_triton_applies(method, layer_idx, call) -> bool:
    """cape_applies for a call on the "triton" path, its reads of the positions made once per forward (on a GPU each
    read waits for the device: docs/attention-paths.md, "Reads of tensor values")."""
    positions = call.query_positions
    consecutive, highest = call.state.once_per_forward(
        ("consecutive query positions, highest", positions.shape[-1]),
        lambda: (positions.shape[-1] <= 1 or bool((positions.diff(dim=-1) == 1).all()), int(positions.max())))
    return consecutive and method.bias_method.bias_table(layer_idx, 1, highest, positions.device) is not None


def cape_kernel(method, layer_idx, query, key, value, scaling, positions):
    table = method.bias_method.bias_table(layer_idx, query.shape[2], int(positions.max()), query.device)
    return cape_causal(query, key, value, table, method.input_weight[layer_idx], method.input_bias[layer_idx],
                       method.output_weight[layer_idx], method.output_bias[layer_idx], scaling,
                       method.config.base == "none", activation=method.config.activation,
                       negative_slope=method.leaky_relu_slope)


# --- the "triton" path: FoX and stick-breaking by fla-core's kernels (kernels/triton/fla_content.py), CoPE and CAPE
# by ours ----------------------------------------------------------------------------------------------------------

def cape_triton(method, layer_idx, query, key, value, gates, scaling, cu_seqlens):
    """CAPE by kernels/triton/cape_attention.py where cape_triton_applies holds (no packed documents: their positions
    restart). The table for the call's T distances: a bias that depends on the distance alone has the same table
    whatever the highest position (cape_applies asked with the real one), and positions from 0 reach T - 1."""
    from .triton.cape_attention import cape_attention

    length = query.shape[2]
    table = method.bias_method.bias_table(layer_idx, length, length - 1, query.device)
    return cape_attention(query, key, value, table, method.input_weight[layer_idx], method.input_bias[layer_idx],
                          method.output_weight[layer_idx], method.output_bias[layer_idx], scaling,
                          method.config.base == "none", activation=method.config.activation,
                          negative_slope=method.leaky_relu_slope)


def fox_triton(method, layer_idx, query, key, value, gates, scaling, cu_seqlens):
    return forgetting_attention(query, key, value, gates, scaling, cu_seqlens)


def fox_gates(method, layer_idx, layer_input):
    """log f_t per head: FoX's state c is its cumulative sum (methods/fox.py extend_token_state)."""
    return method.log_forget(layer_idx, layer_input)


def stick_breaking_triton(method, layer_idx, query, key, value, gates, scaling, cu_seqlens):
    return stick_breaking_attention(query, key, value, scaling, method.config.attend_current, cu_seqlens)


def cope_triton(method, layer_idx, query, key, value, gates, scaling, cu_seqlens):
    """CoPE by our Triton kernel (kernels/triton/cope_attention.py), which reads the layer's position embeddings."""
    from .triton.cope_attention import cope_attention
    return cope_attention(query, key, value, method.position_embeddings[layer_idx], scaling, method.config.max_pos,
                          cu_seqlens)


# --- FIRE past its threshold: its bias form by table_tile.cpp --------------------------------------------------------

def _fire_inputs(form, query_slots, key_slots, dtype):
    """FireBiasForm's positions, normaliser psi(max(L, i)), knots, slope and intercept in `dtype`, with the slots."""
    as_dtype = (form.query_positions, form.key_positions, form.normaliser, form.knots, form.slope, form.intercept)
    query_positions, key_positions, normaliser, knots, slope, intercept = (tensor.to(dtype).contiguous()
                                                                           for tensor in as_dtype)
    return query_positions, key_positions, normaliser, query_slots, key_slots, knots, slope, intercept, float(form.c)


def fire_form_forward(form, query_slots, key_slots, query, key, value, scaling):
    return fire_attention_forward(query, key, value, *_fire_inputs(form, query_slots, key_slots, query.dtype), scaling)


def fire_form_backward(form, query_slots, key_slots, query_wide, key_wide, grad_wide, value_wide, blocks, key_tile,
                       scaling, needed):
    """fused_cpu.fire_backward_tiles on the form's inputs, its sums added to the form ([B*H, ...] -> [B, H, ...])."""
    count = query_wide.shape[0]
    heads = form.slope.shape[0]
    form_grad, c_grad = any(needed), bool(needed[2])
    grad_query, grad_key, grad_value, dS, dS_u, gu, ga = fire_backward_tiles(
        query_wide, key_wide, grad_wide, value_wide, *_fire_inputs(form, query_slots, key_slots, query_wide.dtype),
        blocks, key_tile, scaling, form_grad, c_grad)
    if form_grad:
        batch = count // heads
        form.add_sums(dS.view(batch, heads, -1), dS_u.view(batch, heads, -1), gu.view(batch, heads, -1).sum(1),
                      ga.view(batch, heads, -1).sum(1) if c_grad else None)
    return grad_query, grad_key, grad_value


# --- TAPE: queries and keys turned by their features ----------------------------------------------------------------

def tape_heads(method, layer_idx, query, key, query_state, key_state, query_positions, key_positions):
    """TAPE's kernel_heads with each turn by the fused kernel (turn.cpp, one pass where `Tape.turn` takes about ten)
    where its check on this machine passed, else by `turn`."""
    return turn_checked(method, query, query_state), turn_checked(method, key, key_state)


def turn_checked(method, x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    output = serve_checked(fused_turn_call(method, x, features))
    return output.transpose(1, 2) if output is not None else method.turn(x, features)


def fused_turn_call(method, x: torch.Tensor, features: torch.Tensor) -> KernelCall:
    """The fused turn of x [B, H, n, D] by features [B, G, n, d] as a checked kernel call (outputs [B, n, H, D]),
    against `method.turn`; its kind: dtype, grad mode and heads per feature group."""
    def kernel(x, features):
        return turn_by_features(x, features).transpose(1, 2)

    def reference(x, features):
        return method.turn(x, features).transpose(1, 2)

    def gradient_probe() -> GradientProbe:
        cut = (slice(0, PROBE_BATCH), slice(None), slice(max(0, x.shape[2] - PROBE_ROWS), None))
        return GradientProbe({"x": x[cut], "features": features[cut]}, kernel=kernel, reference=reference)

    needs_grad = torch.is_grad_enabled() and (x.requires_grad or features.requires_grad)
    kind = (str(x.dtype), "grad" if needs_grad else "no grad", x.shape[1] // features.shape[1])
    return KernelCall(kernel="fused cpu (turn)", device=x.device, kind=kind, function=kernel,
                      inputs={"x": x, "features": features},
                      reference=lambda rows: reference(x[:, :, rows], features[:, :, rows]),
                      gradient_kind=kind[:1] if needs_grad else None,
                      gradient_probe=gradient_probe if needs_grad else None)


KERNELS: dict[str, MethodKernels] = {
    "stick-breaking": MethodKernels(causal=CausalKernel(stick_breaking_kernel, reference="content_weights"),
                                    triton=TritonKernel(stick_breaking_triton,
                                                        variant=lambda method: (method.config.attend_current,))),
    "fox": MethodKernels(triton=TritonKernel(fox_triton, gates=fox_gates)),
    "cope": MethodKernels(causal=CausalKernel(cope_kernel, reference="content_scores"),
                          triton=TritonKernel(cope_triton, variant=lambda method: (method.config.max_pos,),
                                              dtypes=(*FLA_DTYPES, torch.float64), installed=triton_installed)),
    "cape": MethodKernels(causal=CausalKernel(cape_kernel, reference="content_scores", applies=cape_applies,
                                              variant=lambda method: (method.config.activation,)),
                          triton=TritonKernel(cape_triton, applies=cape_triton_applies, installed=triton_installed,
                                              variant=lambda method: (method.config.activation, method.config.base))),
    "tape": MethodKernels(heads=tape_heads),
    "self-extend": MethodKernels(near_far=True),
    "rerope": MethodKernels(near_far=True),
    **{name: MethodKernels(triton_table=True) for name in ("alibi", "sandwich", "t5", "kerple")},
    "fire": MethodKernels(triton_table=True, form=FormKernel("fused cpu (FIRE past its threshold)", fire_form_forward,
                                                             fire_form_backward)),
}
NO_KERNELS = MethodKernels()


def kernels_for(method) -> MethodKernels:
    """The kernels of `method` (a method module): its entry in KERNELS, or none."""
    return KERNELS.get(getattr(method.config, "method", None), NO_KERNELS)


def causal_kernel(method) -> CausalKernel | None:
    return kernels_for(method).causal


def triton_kernel(method) -> TritonKernel | None:
    return kernels_for(method).triton


def serves_near_far(method) -> bool:
    return kernels_for(method).near_far


def serves_triton_table(method) -> bool:
    return kernels_for(method).triton_table


def form_kernel(method) -> FormKernel | None:
    return kernels_for(method).form


def kernel_heads(method, layer_idx, query, key, query_state, key_state, query_positions, key_positions,
                 fused: bool = False):
    """The method's `kernel_heads` (None for a method whose logits are no dot product, DotProductForm), by its fused
    entry where `fused` (the CPU kernels may serve) and it has one."""
    if not isinstance(method, DotProductForm):
        return None
    heads = kernels_for(method).heads if fused else None
    if heads is not None:
        return heads(method, layer_idx, query, key, query_state, key_state, query_positions, key_positions)
    return method.kernel_heads(layer_idx, query, key, query_state, key_state, query_positions, key_positions)
