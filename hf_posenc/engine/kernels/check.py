"""No compiled or external attention kernel serves numbers that were not checked on the machine it runs on.

The first time a kernel (compiled flex_attention, flash-attn, or any later one) is about to serve a *kind* of call
on a device, `serve` runs it beside the blocked path (the portable reference) and compares:

- forward: the kernel runs on the real inputs and on NaN-fenced copies of them (same strides, so no recompilation;
  NaN in every element the inputs do not cover: the gaps of a strided layout and `FENCE_ELEMENTS` after each end),
  and both outputs are compared with the blocked path's on all query rows when there are at most `CHECK_ROWS` (128)
  of them, else on the first and the last `CHECK_ROWS // 2` rows; all batch rows, heads and keys. Rows that attend
  to no key at all (padding queries) are undefined and skipped. The fence makes a kernel that reads outside its
  inputs fail at once, where on the real inputs its numbers depend on whatever lies beside them (compiled flex on
  an AMD EPYC CPU with torch 2.13 reads past the end of the keys: right or wrong, even NaN, for the same shape
  depending on that memory, so one right call of a kind proves nothing without the fence). A check costs the kernel
  twice, the blocked path on at most 128 query rows, and copies of the inputs (skipped above `FENCE_BUDGET_BYTES`,
  1 GiB: larger calls are compared on their real inputs only), once per kind; the real run's output is served.
- gradients, where the call needs them and the kernel has a backward: once per gradient kind, on a small probe cut
  from the inputs (at most 2 batch rows and 64 queries and keys), the kernel's gradients w.r.t. each probe input
  (queries, keys, values, and the bias table where the kernel takes one; NaN-fenced) against a materialised float64
  reference.

The error is the largest |kernel - reference| over the largest |reference|, against a tolerance that fits the
dtype (`tolerance`); NaN or Inf where the reference is finite, or an exception from the kernel or its compiler,
fail too. On a failure: one `KernelCheckWarning` naming the kernel, torch's version, the device (the GPU's name on
CUDA) and the error, and from then on the blocked path serves every call of that kernel on that device for the rest
of the process; the checking call itself is served by the blocked path. A kernel thus serves only kinds of call
it has passed on this device; later calls of a passed kind are not compared again.

What a kind is belongs to each kernel (`_flex_call`, `_flash_call` in engine/attention/bias_path.py,
`compiled_content_call` in engine/attention/compiled_content.py): the calls that run the same compiled code, as
far as its known failure modes go (compiled flex: every new shape; flash-attn: dtype, heads, head size and
power-of-two size classes of batch, queries and keys; compiled content blocks: the method, dtype, heads, head size, mask, grad mode and size classes).

The check's own computations (the fenced run, the gradient probe) keep their saved tensors out of an enclosing
non-reentrant gradient checkpoint (a layer under `gradient_checkpointing_enable()`), whose recomputation, which does
not check again, must save the same tensors as its forward.

`kernel_status()` lists every check made in this process (which kernel serves which kind, and which were refused);
`reset_kernel_status()` forgets them all, so the next call of each kind is checked again.

A new kernel plugs in by building a `KernelCall` for a call it can serve and passing it to `serve`.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

CHECK_ROWS = 128  # query rows compared on a checking call (the first and last half of them when there are more)
PROBE_ROWS = 64  # queries and keys of the gradient probe
PROBE_BATCH = 2
FENCE_ELEMENTS = 2**16  # NaN after each input's last element in the fenced copies (a tail block of 256 x 256 reads)
# A gradient's error counts against at least this share of the probe's largest gradient: one that is zero in exact
# arithmetic (CAPE's output bias adds a constant to every logit of a row, which the softmax cancels) is rounding noise
# on both sides, as large as its own reference values.
GRADIENT_FLOOR = 1e-2
FENCE_BUDGET_BYTES = 2**30  # larger inputs are checked as they are, without fenced copies


class KernelCheckWarning(RuntimeWarning):
    """A compiled or external kernel disagreed with the blocked path; the blocked path serves from now on."""


@dataclass(frozen=True)
class Verdict:
    kernel: str  # "flex", "flash", ...
    device: str  # "cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)"
    kind: tuple  # what was checked: the kernel's kind, or ("gradients", ...) for a gradient probe
    passed: bool
    error: float  # largest |kernel - reference| / largest |reference| (inf for NaN/Inf where the reference is finite)
    detail: str  # what failed, "" when passed


@dataclass
class GradientProbe:
    """A small problem both the kernel and the reference solve: `inputs` (the tensors whose gradients are compared),
    passed by name to `kernel` and `reference`, which return outputs [B, q, ...]; `defined` [B, q] marks the output
    rows that are defined (None: all). `parameters`: tensors both read as they are (a method's parameters), whose
    gradients are compared too."""
    inputs: dict[str, torch.Tensor]
    kernel: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    defined: torch.Tensor | None = None
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class KernelCall:
    """One call a kernel is about to serve, with what checking it takes.

    `function(**inputs)` is the kernel on the call's tensors, output [B, q, ...]; `reference(rows)` the blocked path's
    output for the query rows `rows` (a slice of dimension 1); `defined()` [B, q] bool the rows that attend to at
    least one key (None: all). `gradient_kind` and `gradient_probe` are set where the call needs gradients and the
    kernel has a backward."""
    kernel: str
    device: torch.device
    kind: tuple
    function: Callable[..., torch.Tensor]
    inputs: dict[str, torch.Tensor]
    reference: Callable[[slice], torch.Tensor]
    defined: Callable[[], torch.Tensor] | None = None
    gradient_kind: tuple | None = None
    gradient_probe: Callable[[], GradientProbe] | None = None

    def run(self) -> torch.Tensor:
        return self.function(**self.inputs)


_lock = threading.Lock()
_verdicts: list[Verdict] = []
_passed: set[tuple[str, str, tuple]] = set()  # (kernel, device, kind)
_refused: dict[tuple[str, str], Verdict] = {}  # (kernel, device) -> the failed check


def kernel_status() -> list[Verdict]:
    """Every check made in this process, oldest first. A kernel with a failed verdict on a device is refused there:
    the blocked path serves its calls for the rest of the process (or until `reset_kernel_status`)."""
    with _lock:
        return list(_verdicts)


def reset_kernel_status() -> None:
    """Forget every verdict: the next call of each kind is checked again, refused kernels included."""
    with _lock:
        _verdicts.clear()
        _passed.clear()
        _refused.clear()


@functools.lru_cache(maxsize=None)
def _device_name(device_type: str, index: int | None) -> str:
    if device_type == "cuda":
        index = torch.cuda.current_device() if index is None else index
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return device_type if index is None else f"{device_type}:{index}"


def device_name(device: torch.device) -> str:
    return _device_name(device.type, device.index)


def tolerance(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """Largest error (relative to the largest reference value) a kernel may show in `dtype`. Two correct kernels
    differ by rounding: about 1e-6 in float32, the output's rounding (plus a bias rounded to the dtype in the blocked
    path) in half precision. TF32 matmuls on CUDA round like float16."""
    if dtype == torch.bfloat16:
        return 5e-2
    if dtype == torch.float16:
        return 1e-2
    if dtype == torch.float32 and device is not None and device.type == "cuda" \
            and torch.get_float32_matmul_precision() != "highest":
        return 1e-2
    return 1e-4


def serve(call: KernelCall) -> torch.Tensor | None:
    """The kernel's output for this call where its kind is (or has just been) checked on this device; None where the
    blocked path must serve it (the kernel is refused on this device, now or before)."""
    device = device_name(call.device)
    forward_key = (call.kernel, device, call.kind)
    gradient_key = None if call.gradient_kind is None else (call.kernel, device, ("gradients",) + call.gradient_kind)
    with _lock:
        if (call.kernel, device) in _refused:
            return None
        unchecked = [key for key in (forward_key, gradient_key) if key is not None and key not in _passed]
    if not unchecked:
        return call.run()
    try:
        # In the call's own grad mode, so that a compiled kernel runs the same graph it will serve with.
        with _kept_out_of_checkpointing():
            fenced = call.function(**fenced_inputs(call.inputs)).detach() if forward_key in unchecked else None
        output = call.run()
    except Exception as error:  # a compiler or kernel failure is a verdict, not a crash: blocked serves
        _record(forward_key, math.inf, f"it raised {_first_line(error)}")
        return None
    allowed = tolerance(output.dtype, call.device)
    if forward_key in unchecked:
        error, detail = _forward_error(call, output, fenced)
        if not _record(forward_key, error, _failure(error, detail, allowed, output.dtype)):
            return None
    if gradient_key in unchecked:
        try:
            with _kept_out_of_checkpointing(), torch.enable_grad():
                error, detail = _gradient_error(call.gradient_probe(), 2 * allowed)  # a backward adds its rounding
        except Exception as failure:
            error, detail = math.inf, f"its gradient probe raised {_first_line(failure)}"
        if not _record(gradient_key, error, _failure(error, detail, 2 * allowed, output.dtype)):
            return None
    return output


def verified(kernel: str, device: torch.device, dtype: torch.dtype, measure: Callable[[], tuple[float, float]]) -> bool:
    """Whether `kernel` may serve calls in `dtype` on `device`, for a kernel that no KernelCall fits (a part of a
    backward): checked by `measure()` (its error against the reference and the tolerance) at the first such call,
    an exception a failure, and recorded as `serve`'s checks are; False from then on where the kernel was refused."""
    device = device_name(device)
    key = (kernel, device, (str(dtype),))
    with _lock:
        if (kernel, device) in _refused:
            return False
        if key in _passed:
            return True
    try:
        with _kept_out_of_checkpointing(), torch.no_grad():
            error, allowed = measure()
        failure = _failure(error, "", allowed, dtype)
    except Exception as exception:
        error, failure = math.inf, f"it raised {_first_line(exception)}"
    return _record(key, error, failure)


def _kept_out_of_checkpointing():
    """Saved-tensor hooks that keep tensors as they are, around the check's own computations (the fenced run, the
    gradient probe): inside a layer under non-reentrant gradient checkpointing they would otherwise be packed by the
    checkpoint's hooks, whose recomputation (which does not check again) must save the same tensors as its forward."""
    return torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor)


def nan_fenced_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of a floating-point `tensor` with the same shape and strides (so a compiled kernel does not
    recompile for it) in a buffer where every element the tensor does not cover holds NaN: the gaps of a strided
    layout and `FENCE_ELEMENTS` after its end. A kernel that reads outside its inputs then gives NaN, whatever the
    memory beside the real inputs happens to hold. Other tensors (and self-overlapping ones) are returned as they
    are."""
    if not tensor.is_floating_point() or tensor.numel() == 0 \
            or any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride())):
        return tensor
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    buffer = torch.full((span + FENCE_ELEMENTS,), math.nan, dtype=tensor.dtype, device=tensor.device)
    copy = buffer.as_strided(tensor.shape, tensor.stride())
    with torch.no_grad():
        copy.copy_(tensor)
    return copy


def fenced_inputs(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NaN-fenced copies of the inputs (see nan_fenced_copy); the inputs themselves where the copies would take more
    than FENCE_BUDGET_BYTES."""
    size = sum(t.numel() * t.element_size() for t in inputs.values() if t.is_floating_point())
    if size > FENCE_BUDGET_BYTES:
        return inputs
    return {name: nan_fenced_copy(tensor.detach()).requires_grad_(tensor.requires_grad)
            for name, tensor in inputs.items()}


def _failure(error: float, detail: str, allowed: float, dtype: torch.dtype) -> str:
    """What failed ("" for a pass): the detail found, or the size of the error against the tolerance."""
    if detail or error <= allowed:
        return detail
    return f"an error of {error:.3g} relative to the largest reference value ({dtype} tolerance {allowed:.0e})"


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _record(key: tuple[str, str, tuple], error: float, failure: str) -> bool:
    """Store the verdict of one check (and warn where it is the kernel's first failure on the device, unless another
    kernel failed there for the same reason); True where it passed."""
    kernel, device, kind = key
    verdict = Verdict(kernel, device, kind, not failure, error, failure)
    with _lock:
        _verdicts.append(verdict)
        if verdict.passed:
            _passed.add(key)
            return True
        # One warning per cause: a failed build refuses every fused CPU kernel with the same message.
        first_refusal = (kernel, device) not in _refused and not any(
            earlier.device == device and earlier.detail == failure for earlier in _refused.values())
        _refused.setdefault((kernel, device), verdict)
    if first_refusal:
        warnings.warn(
            f"hf_posenc: the {kernel} attention kernel failed its check against the reference on {device} with torch "
            f"{torch.__version__}, for calls of kind {kind}: {failure}. The blocked path serves every {kernel} call on "
            f"{device} for the rest of this process (hf_posenc.attention.kernel_status() lists the checks).",
            KernelCheckWarning, stacklevel=2)
    return False


def _forward_error(call: KernelCall, output: torch.Tensor, fenced: torch.Tensor) -> tuple[float, str]:
    """Largest relative error of the kernel's outputs (on the real inputs and on NaN-fenced copies) against the
    blocked path, on the compared rows (see the module docstring), and what failed."""
    q = output.shape[1]
    half = CHECK_ROWS // 2
    spans = [slice(0, q)] if q <= CHECK_ROWS else [slice(0, half), slice(q - half, q)]
    worst, detail = 0.0, ""
    with torch.no_grad():
        defined = call.defined() if call.defined is not None else None
        for rows in spans:
            keep = defined[:, rows] if defined is not None else slice(None)
            want = call.reference(rows)[keep]
            for got, where in ((output, ""), (fenced, " (on NaN-fenced copies of its inputs)")):
                error, problem = relative_error(got[:, rows].detach()[keep], want)
                worst, detail = max(worst, error), detail or (problem + where if problem else "")
    return worst, detail


def _gradient_error(probe: GradientProbe, allowed: float) -> tuple[float, str]:
    """Largest relative error of the probe's output and of its gradients w.r.t. each input (and what failed)."""
    results = {}
    for side in ("kernel", "reference"):
        copy = nan_fenced_copy if side == "kernel" else torch.clone
        leaves = {name: copy(tensor.detach()).requires_grad_(True) for name, tensor in probe.inputs.items()}
        output = getattr(probe, side)(**leaves)
        weight = torch.randn(output.shape, generator=torch.Generator().manual_seed(0)).to(output.device)
        if probe.defined is not None:  # undefined rows carry no gradient in either
            weight = weight * probe.defined.reshape(*probe.defined.shape, *[1] * (output.dim() - 2)).to(weight)
        grads = torch.autograd.grad((output.float() * weight).sum(),
                                    [*leaves.values(), *probe.parameters.values()], allow_unused=True)
        results[side] = (output.detach(), dict(zip([*leaves, *probe.parameters], grads)))
    (got, got_grads), (want, want_grads) = results["kernel"], results["reference"]
    keep = probe.defined if probe.defined is not None else slice(None)
    worst, detail = relative_error(got[keep], want[keep])
    largest = max((float(g.float().abs().max()) for g in want_grads.values()
                   if g is not None and g.numel() and bool(torch.isfinite(g).all())), default=0.0)
    for name, want_grad in want_grads.items():
        got_grad = got_grads[name]
        if want_grad is None and (got_grad is None or not got_grad.any()):  # an input the reference does not read
            continue
        if want_grad is None:
            return math.inf, f"a gradient w.r.t. {name}, which the reference does not read"
        if got_grad is None:
            return math.inf, f"no gradient w.r.t. {name}"
        error, problem = relative_error(got_grad, want_grad, floor=GRADIENT_FLOOR * largest)
        if problem or error > allowed:
            size = f"an error of {error:.3g} relative to its largest reference value (tolerance {allowed:.0e})"
            return error, f"gradients w.r.t. {name}: {problem or size}"
        worst = max(worst, error)
    return worst, detail


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> tuple[float, str]:
    """(largest |got - want| / max(largest |want|, floor), "" or what is wrong), where `want` is finite."""
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    got, want = got[finite], want[finite]
    if got.numel() == 0:
        return 0.0, ""
    if not torch.isfinite(got).all():
        return math.inf, "NaN or Inf where the reference is finite"
    scale = want.abs().max().clamp_min(max(floor, 1e-6))
    return ((got - want).abs().max() / scale).item(), ""


def table_attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor,
                              offset: int, valid: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Distance-table attention materialised in float64, for small probes: query [B, H, q, D], key/value
    [B, H_kv, kv, D], table [H, n] (the bias at distance 0..n-1), query i at key slot offset + i, valid [B, kv] bool
    (None: every key). Returns [B, q, H, D] in the query's dtype; rows with no allowed key are uniform (undefined)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    distance = offset + torch.arange(query.shape[2], device=query.device)[:, None] \
        - torch.arange(key.shape[2], device=query.device)[None]
    allowed = (distance >= 0)[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    bias = table.double()[:, distance.clamp(0, table.shape[1] - 1)]
    scores = (query.double() @ key.transpose(2, 3)) * scaling + bias
    scores = scores.masked_fill(~allowed, torch.finfo(torch.float64).min)
    return (scores.softmax(-1) @ value).transpose(1, 2).to(query.dtype)
