"""Fused CPU kernels for attention whose per-pair chain has no single SDPA call (cpu_kernels/*.cpp), built on first use.

The blocked path writes each block's [B, H, rows, keys] logits to memory and passes over them several times (the
chain, then its recomputation and backward); a fused kernel keeps them in cache-sized tiles, as SDPA's flash kernel
does. Forward and backward of a causal square (query i is key i, nothing else masked): stick-breaking
(stick_breaking.cpp, 1.3-1.4x causal SDPA's forward+backward at 2048-4096 tokens on the CPU, 9 heads of 64, 2
threads), CoPE (cope.cpp, about SDPA's time with max_pos 64), the near/far scores of Self-Extend and ReRoPE where
the far keys are the triangle j <= i - a (near_far.cpp), plain causal attention whose queries and keys have
another head size than the values (Transformer-XL's and TAPE's kernel form; near_far.cpp with no far key, where SDPA
would pad both to one size), and CAPE's MLP across the heads per pair (cape.cpp; about 3.2x causal SDPA's time at 2048
tokens): docs/attention-paths.md, "Fused CPU kernels". Besides attention, TAPE's turn of queries and keys by its
per-token features (turn.cpp: one pass each way where the eager form takes about ten), and the backward tiles of the
learned distance-table attention (table_tile.cpp; engine/attention/table_attention.py). Which method each attention
kernel serves is by_method.py's table.

The source is compiled with `torch.utils.cpp_extension` (a C++ compiler and ninja, a dependency) the first time a
process needs it, into torch's extension cache (later processes load it in about a second). Like any kernel outside
the blocked path it serves only after check.py compared it on this machine (engine/attention/
compiled_content.py `fused_content_call`); a failed build is such a check's failure: one KernelCheckWarning, and
the blocked path serves.
`HF_POSENC_CPU_KERNELS=0` turns the fused kernels off (nothing is built).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

KERNELS = Path(__file__).parent / "cpu_kernels"
SOURCES = (KERNELS / "stick_breaking.cpp", KERNELS / "cope.cpp", KERNELS / "near_far.cpp", KERNELS / "cape.cpp",
           KERNELS / "turn.cpp", KERNELS / "table_tile.cpp")
# Query rows and keys per tile: the tile's temporaries (a few float32 [rows, keys]) stay in a core's L2. Chosen on the
# first stick-breaking kernel (forward and backward, 9 heads of 64, 2 threads): at 2048 tokens 64 x 256 to 128 x 512
# within 2% of each other (1.19-1.21x causal SDPA), 32 x 128 1.38x; at 4096, 128 x 512 1.30x, 64 x 256 1.43x.
TILE_ROWS = 128
TILE_KEYS = 512
# CAPE's tiles hold every head's pairs (five [H, rows x keys] blocks in the backward): smaller.
CAPE_TILE_ROWS = 64
CAPE_TILE_KEYS = 128
# -ffast-math lets the compiler call glibc's vector exp and log1p in the per-tile loops.
COMPILER_FLAGS = ("-O3", "-ffast-math", "-fopenmp")
# The vector instructions of torch's own CPU capability, named in the build (torch's cache is keyed by the sources and
# flags, not by the machine: a home directory shared by machines of two CPU generations must not hand one the
# other's build). -march=native would tie a cached build to the machine that made it.
CAPABILITY_FLAGS = {"AVX2": ("-mavx2", "-mfma"),
                    "AVX512": ("-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw")}

_lock = threading.Lock()
_loaded = False


# A standalone checkpoint ships Python files only: its models take the blocked path.
_SOURCES_HERE = all(source.is_file() for source in SOURCES)


def fused_kernels_enabled() -> bool:
    """Whether fused CPU kernels may serve (asked on every attention call): HF_POSENC_CPU_KERNELS is not "0" and their
    sources are here."""
    return _SOURCES_HERE and os.environ.get("HF_POSENC_CPU_KERNELS", "1") != "0"


def load() -> None:
    """Build (once per source version, cached by torch) and load the kernels into this process; raises where it
    cannot (no compiler, no ninja), which the caller's kernel check turns into a refusal."""
    global _loaded
    with _lock:
        if _loaded:
            return
        from torch.utils.cpp_extension import load as load_extension

        capability = torch.backends.cpu.get_cpu_capability()
        # torch rebuilds when the sources or the flags change, not a header they include: the flags name them all.
        digest = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(KERNELS.iterdir()))).hexdigest()[:16]
        try:
            # The digest in the name too: torch keeps one build directory per name, and processes of two source
            # versions (two checkouts, two environments) sharing the cache would otherwise rebuild it over each
            # other and load the other's library.
            load_extension(name=f"hf_posenc_cpu_{capability.lower()}_{digest}",
                           sources=[str(source) for source in SOURCES],
                           extra_cflags=[*COMPILER_FLAGS, *CAPABILITY_FLAGS.get(capability, ()),
                                         f"-DHF_POSENC_KERNELS={digest}"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        except Exception as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise RuntimeError(
                f"could not build hf_posenc's fused CPU kernels ({first_line}); install a C++ compiler (g++ or "
                "clang++) and ninja, or set HF_POSENC_CPU_KERNELS=0 to keep the blocked path without trying") from error
        _loaded = True


def _as_rows(*tensors: torch.Tensor):
    """[B, H, L, ...] tensors -> ([B * H, L, ...] each, contiguous, in float32 or float64 where the first is float64;
    a function that turns a kernel's [B * H, L, E] output back into [B, H, L, E] in a given dtype)."""
    batch, heads, length = tensors[0].shape[:3]
    compute = torch.float64 if tensors[0].dtype == torch.float64 else torch.float32
    rows = [x.to(compute).reshape(batch * heads, length, x.shape[-1]).contiguous() for x in tensors]
    return rows, lambda output, dtype: output.reshape(batch, heads, length, -1).to(dtype)


class FusedKernel(torch.autograd.Function):
    """One of the kernels `name` (torch.ops.hf_posenc_cpu.{name}_forward / _backward) on [N, L, ...] float32 or
    float64 contiguous inputs: the forward op takes (*inputs, *options, rows, keys) and returns the output [N, L, E]
    and what its backward needs besides the inputs (stick-breaking: each row's log remainder; CoPE: the logsumexp and
    the window of unclamped positions; near/far: the logsumexp); the backward op takes (*inputs, *those, grad_output,
    *options, rows, keys) and returns the inputs' gradients. Each backward recomputes its tiles from the inputs."""

    @staticmethod
    def forward(ctx, name: str, options: tuple, *inputs):
        output, *kept = getattr(torch.ops.hf_posenc_cpu, f"{name}_forward")(*inputs, *options, *_tiles(name))
        ctx.save_for_backward(*inputs, output, *kept)
        ctx.name, ctx.options = name, options
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grads = getattr(torch.ops.hf_posenc_cpu, f"{ctx.name}_backward")(
            *ctx.saved_tensors, grad_output.contiguous(), *ctx.options, *_tiles(ctx.name))
        return (None, None, *grads)


def _tiles(name: str) -> tuple[int, int]:
    return (CAPE_TILE_ROWS, CAPE_TILE_KEYS) if name == "cape" else (TILE_ROWS, TILE_KEYS)


def stick_breaking_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                          attend_current: bool) -> torch.Tensor:
    """query, key [B, H, L, D] and value [B, H, L, E] (heads matched, query i is key i, no other mask) -> output
    [B, H, L, E] in value's dtype, computed in float32 (float64 for float64 inputs)."""
    load()
    rows, heads = _as_rows(query, key, value)
    output = FusedKernel.apply("stick_breaking", (float(scaling), bool(attend_current)), *rows)
    return heads(output, value.dtype)


def cope_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embeddings: torch.Tensor,
                scaling: float, max_pos: int) -> torch.Tensor:
    """query, key [B, H, L, D], value [B, H, L, E] (heads matched, query i is key i, no other mask) and the layer's
    position embeddings [D, max_pos + 1] -> CoPE's output [B, H, L, E] in value's dtype, computed in float32 (float64
    for float64 inputs)."""
    load()
    rows, heads = _as_rows(query, key, value)
    output = FusedKernel.apply("cope", (float(scaling), float(max_pos)), *rows,
                               embeddings.to(rows[0].dtype).contiguous())
    return heads(output, value.dtype)


def near_far_causal(near_query: torch.Tensor, near_key: torch.Tensor, far_query: torch.Tensor, far_key: torch.Tensor,
                    value: torch.Tensor, far_from: int, scaling: float) -> torch.Tensor:
    """Queries and keys [B, H, L, D] of both assignments and values [B, H, L, E] (heads matched, query i is key i, no
    other mask; key j far for query i where j <= i - far_from, else near) -> output [B, H, L, E] in value's dtype,
    computed in float32 (float64 for float64 inputs)."""
    load()
    rows, heads = _as_rows(near_query, near_key, far_query, far_key, value)
    output = FusedKernel.apply("near_far", (int(far_from), float(scaling)), *rows)
    return heads(output, value.dtype)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal softmax attention, query and key [B, H, L, D], value [B, H, L, E] (heads matched, query i is key i, no
    other mask) -> output [B, H, L, E] in value's dtype, computed in float32 (float64 for float64 inputs): SDPA where
    D and E may differ (near_far.cpp with no far key)."""
    load()
    rows, heads = _as_rows(query, key, value)
    return heads(FusedKernel.apply("causal", (float(scaling),), *rows), value.dtype)


# The activations of CAPE's MLP that cape.cpp computes, by its codes (its enum Activation).
CAPE_ACTIVATIONS = {"gelu": 0, "leaky_relu": 1}


def cape_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, table: torch.Tensor,
                input_weight: torch.Tensor, input_bias: torch.Tensor, output_weight: torch.Tensor,
                output_bias: torch.Tensor, scaling: float, add_bias: bool, *, activation: str,
                negative_slope: float = 0.0) -> torch.Tensor:
    """CAPE's attention (methods/cape.py) on query, key [B, H, L, D] and value [B, H, L, E] (heads matched, query i is
    key i, no other mask), the bias table [H, L] (distances 0..L-1) and the layer's MLP (W1 [W, 2H], b1 [W],
    W2 [H, W], b2 [H]) with `activation` ("leaky_relu", of slope `negative_slope` below zero, or "gelu", erf's);
    `add_bias`: the bias is added to the logits too (base="none") -> output [B, H, L, E] in value's dtype, computed in
    float32 (float64 for float64 inputs). Gradients reach every input (the table's only where it requires one)."""
    load()
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    inputs = [x.to(compute).contiguous() for x in (query, key, value, table, input_weight, input_bias, output_weight,
                                                   output_bias)]
    options = (float(scaling), bool(add_bias), table.requires_grad and torch.is_grad_enabled(),
               CAPE_ACTIVATIONS[activation], float(negative_slope))
    return FusedKernel.apply("cape", options, *inputs).to(value.dtype)


class TurnByFeatures(torch.autograd.Function):
    """turn.cpp's forward and backward (see turn_by_features)."""

    @staticmethod
    def forward(ctx, x, features):
        ctx.save_for_backward(x, features)
        return torch.ops.hf_posenc_cpu.turn_forward(x, features)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grad_x, grad_features = torch.ops.hf_posenc_cpu.turn_backward(*ctx.saved_tensors, grad_output.contiguous())
        return grad_x, grad_features


def turn_by_features(x: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] turned per rotary plane k (dimensions k and k + d/2) by the complex number c + i s of
    features [B, G, n, d] (the c's, then the s's; G divides H, and the H / G heads of a group share their key-value
    head's features; the dimensions past d pass through), as methods/tape.py `Tape.turn` -> [B, H, n, D] in float32
    (float64 where both are)."""
    load()
    compute = torch.float64 if x.dtype == features.dtype == torch.float64 else torch.float32
    x = x.to(compute)
    return TurnByFeatures.apply(x if x.stride(-1) == 1 else x.contiguous(), features.to(compute).contiguous())


def table_backward_tiles(query_wide: torch.Tensor, key_wide: torch.Tensor, grad_wide: torch.Tensor,
                         value_wide: torch.Tensor, padded: torch.Tensor, blocks: list, key_tile: int, scaling: float,
                         table_grad: bool):
    """table_tile.cpp on table_attention's widened operands ([B*H, q, D + 1] Q' and dO', [B*H, kv, D + 1] K' and V',
    one float dtype) and padded table [H, P] -> the gradients of the scaled queries times `scaling` ([B*H, q, D]),
    of the keys and values ([B*H, kv, D], per query head) and, where `table_grad`, of `padded` per batch row
    ([B, H, P]; else None)."""
    load()
    spans = torch.tensor(blocks, dtype=torch.int64).reshape(-1, 4)
    grads = torch.ops.hf_posenc_cpu.table_backward(
        *(tensor.contiguous() for tensor in (query_wide, key_wide, grad_wide, value_wide, padded)), spans,
        int(key_tile), float(scaling), bool(table_grad))
    grad_query, grad_key, grad_value = grads[:3]
    grad_padded = grads[3].view(-1, *padded.shape) if table_grad else None
    return grad_query, grad_key, grad_value, grad_padded


def fire_backward_tiles(query_wide: torch.Tensor, key_wide: torch.Tensor, grad_wide: torch.Tensor,
                        value_wide: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor,
                        normaliser: torch.Tensor, query_slots: torch.Tensor, key_slots: torch.Tensor,
                        knots: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor, c: float, blocks: list,
                        key_tile: int, scaling: float, form_grad: bool, c_grad: bool):
    """table_tile.cpp's backward with FIRE's bias (fire_attention_forward's inputs) on form_attention's widened operands
    ([B*H, q, D + 1] Q' and dO', [B*H, kv, D + 1] K' and V') and blocks (first row, rows, keys from 0) -> the
    gradients of the queries ([B*H, q, D], times `scaling`), keys and values per query head ([B*H, kv, D]) and, where
    `form_grad`, per batch x head the sums of dS and dS u per segment [B*H, W + 1] and per query row those of g u and
    (where `c_grad`) g cd / (1 + cd) [B*H, q] (FireBiasForm.add_sums)."""
    load()
    spans = torch.tensor([(first, rows, keys, 0) for first, rows, keys in blocks], dtype=torch.int64).reshape(-1, 4)
    return torch.ops.hf_posenc_cpu.fire_backward(
        *(tensor.contiguous() for tensor in (query_wide, key_wide, grad_wide, value_wide, query_positions,
                                             key_positions, normaliser, query_slots, key_slots, knots, slope,
                                             intercept)),
        spans, int(key_tile), float(scaling), float(c), bool(form_grad), bool(c_grad))


def fire_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_positions: torch.Tensor,
                           key_positions: torch.Tensor, normaliser: torch.Tensor, query_slots: torch.Tensor,
                           key_slots: torch.Tensor, knots: torch.Tensor, slope: torch.Tensor, intercept: torch.Tensor,
                           c: float, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FIRE's attention past its threshold (methods/fire.py FireBiasForm) by table_tile.cpp, its bias computed per tile
    in cache: query [B, H, q, D], key [B, H_kv, kv, D], value [B, H_kv, kv, E] (H_kv divides H), positions [B or 1, q]
    and [B or 1, kv] (rising along each row), each query's psi(max(L, i)) [B or 1, q], slots [q] and [kv] (int64,
    rising; a key is masked for a query whose slot is before its own), the MLP's sorted knots [W] and per-segment
    slope and intercept [H, W + 1], all in one float dtype but the slots -> output [B, H, q, E] and each row's
    logsumexp [B, H, q]."""
    load()
    batch, heads, q = query.shape[:3]
    rows = [tensor.reshape(-1, *tensor.shape[2:]).contiguous() for tensor in (query, key, value)]
    output, lse = torch.ops.hf_posenc_cpu.fire_forward(
        *rows, *(tensor.contiguous() for tensor in (query_positions, key_positions, normaliser, query_slots,
                                                     key_slots, knots, slope, intercept)),
        TILE_ROWS, TILE_KEYS, float(scaling), float(c))
    return output.view(batch, heads, q, -1), lse.view(batch, heads, q)
