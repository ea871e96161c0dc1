"""Blocked attention with a learned distance-table bias, and a backward that sends the gradient into the table.

Forward, per query block, is SDPA with the block's bias as a strided Toeplitz view of the table (no copy; see
geometry.toeplitz_view), exactly what the blocked path computes without gradients. Handing SDPA a mask that needs a
gradient would send it down its math path on CPU (a materialised softmax per block, and a second one kept for the
backward); here the mask reaches the kernel as a constant, and the backward recomputes each block:

    S = scale * Q K^T + bias,   P = exp(S - lse),   dV = P^T dO,   dP = dO V^T,
    dS = P * (dP - rowsum(dO * O)),   dQ = scale * dS K,   dK = scale * dS^T Q,

(the standard attention backward, as in FlashAttention, Dao et al. 2022), in float32 at least, with lse each row's
logsumexp from the forward: on CPU the forward is aten's flash kernel itself (what SDPA runs there), which returns
it; elsewhere it is computed beside SDPA's output. Since the bias of entry (r, c) is table[offset + r + c] (keys in
reversed order), the table's gradient is the sum of dS along each anti-diagonal of the block.

Why the backward tiles the keys too (KEY_TILE columns at a time): a block's temporaries are [B*H, rows, keys]; at
8192 tokens, 8 heads and 256 rows that is 64 MiB each, past the CPU's last-level cache, and the elementwise passes
(exp, dS) ran at memory speed. A [B*H, rows, KEY_TILE] tile stays in cache between the matmul that makes it and
the ones that read it, and how long one takes no longer depends on the length. The five matmuls are the floor
(causal SDPA's backward runs the same five); per tile the elementwise work around them is kept to four passes:
- -lse and -rowsum(dO * O) ride in the matmuls as one more column (Q' = [scale Q, -lse], K' = [K, 1],
  dO' = [dO, -delta], V' = [V, 1]): P = exp(bias + Q' K'^T) is one baddbmm (the bias its accumulator) and an exp,
  dS = (dO' V'^T) * P one matmul and a multiply;
- the multiply writes dS into a skewed buffer (row r shifted r columns right, see skewed_view), so that the
  anti-diagonal sums are one column sum of that buffer (in place of aten's unfold_backward: a tenth off the
  backward at 4096), and the matmuls read dS from it in place.
Measured at the op level (8 heads x 64, float32, 2 threads; docs/benchmarks.md, issue 17): forward + backward
1.15-1.21x causal SDPA at 8192 tokens over runs on an AMD EPYC, where the untiled backward took 1.8-2.3x.
On an Intel Xeon the same code took 4-10x (issue 56): the masked keys' probabilities, clamped to e * float32's
smallest normal number, made dS subnormal, and Intel cores take every multiply-add with a subnormal operand through a
microcode assist (75x a product's time); probabilities under SMALLEST_PROBABILITY are now dropped. The tile size and
whether the matmuls read dS from the skewed buffer or from a contiguous tile (BackwardPlan) are timed on the machine
at a model's first training call and kept on its state (backward_plan; `attention.tuned_choices(model)`).
Fixed tables in training (ALiBi, Sandwich, a frozen table) take this backward too (bias_path.py says why).
Memory: a few [B*H, rows, KEY_TILE] tiles and the [B*H, q, D + 1] widened inputs, besides the gradients.

tests/test_table_attention.py checks the gradients of queries, keys, values and the table against autograd of the
materialised computation in float64.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KEY_TILE = 256  # keys per backward tile when no plan is measured (see the module docstring, and BackwardPlan)
# On a GPU the cache argument does not hold and every tile is a dozen kernel launches: a block's keys in one tile. A
# block is already sized to the accelerator budget (geometry.ACCELERATOR_BLOCK_BYTES), which bounds the temporaries.
ACCELERATOR_KEY_TILE = 1 << 30
# Probabilities at most this are dropped (0) in the backward: a smaller one (the masked keys', and ALiBi's or FIRE's
# far keys') times dP - delta is a subnormal number, and every multiply-add with one costs an Intel core a microcode
# assist (a [256, 256] x [256, 64] product with a subnormal triangle: 75x its time on an Intel Xeon, issue 56; AMD's
# Zen 4 takes them at full speed). 2^-60 leaves dS normal down to |dP - delta| of 2^-66, and each dropped probability
# moves a gradient by at most 2^-60 times |dP - delta|, far below float32's resolution of the sums it enters.
SMALLEST_PROBABILITY = 2.0 ** -60
LAYOUTS = ("skewed", "contiguous")
MEASURED_MARGIN = 0.1  # a measured plan replaces the default where its backward is this share faster


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward runs its tiles. key_tile: keys per tile. layout: "skewed", dS written straight into the skewed
    buffer whose column sums are the table's gradient, and the matmuls read it there (strided: one product per batch
    x head); "contiguous", dS in a contiguous tile the matmuls read, copied into the skewed buffer for the sums."""

    key_tile: int
    layout: str = "skewed"

    def describe(self) -> str:
        return f"key_tile={self.key_tile}, layout={self.layout}"


def key_tile(device: torch.device) -> int:
    """Keys per tile on `device` where no plan is measured (the logsumexp of the forward, the default plan)."""
    return KEY_TILE if device.type == "cpu" else ACCELERATOR_KEY_TILE


def default_plan(device: torch.device) -> BackwardPlan:
    return BackwardPlan(key_tile(device), "skewed")


def candidate_plans() -> list[BackwardPlan]:
    """What a measured plan is picked from on the CPU: half, once and twice KEY_TILE, each layout; the default
    (KEY_TILE, skewed) first."""
    others = [BackwardPlan(tile, layout) for tile in (max(1, KEY_TILE // 2), KEY_TILE, 2 * KEY_TILE)
              for layout in LAYOUTS]
    first = BackwardPlan(KEY_TILE, "skewed")
    return [first, *(plan for plan in others if plan != first)]


def backward_plan(tuned: dict, device: torch.device, dtype: torch.dtype, heads: int, dim: int,
                  keys: int | None = None) -> BackwardPlan:
    """The plan for calls of this kind (device, dtype, heads, head size, threads), measured at its first call (see
    measure_plan) and kept in `tuned` (a patched model's PositionState.tuned: no process-wide state); off the CPU
    the default, one tile a block. A call whose blocks have at most `keys` keys, within the smallest candidate
    tile, takes the default unmeasured: every plan is one tile there, and the timing would cost more than the call.
    `hf_posenc.attention.tuned_choices(model)` lists the picks."""
    candidates = candidate_plans()
    if device.type != "cpu" or (keys is not None and keys <= min(plan.key_tile for plan in candidates)):
        return default_plan(device)
    kind = ("table backward", device.type, str(dtype).removeprefix("torch."), heads, dim, torch.get_num_threads())
    plan = tuned.get(kind)
    if plan is None:
        plan = tuned[kind] = measure_plan(candidates, dtype, heads, dim)
    return plan


def measure_plan(candidates: list[BackwardPlan], dtype: torch.dtype, heads: int, dim: int,
                 repeats: int = 3) -> BackwardPlan:
    """The candidate whose backward of one block (256 rows at most, keys twice the largest tile) takes least time,
    the minimum over `repeats` interleaved runs after a warm-up each (a few tenths of a second on 2 cores), where it
    beats the first candidate by MEASURED_MARGIN."""
    keys = 2 * max(plan.key_tile for plan in candidates)
    rows = min(256, keys)
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, n, dim, generator=generator, dtype=dtype).requires_grad_()
                         for n in (rows, keys, keys))
    table = (0.1 * torch.randn(heads, keys, generator=generator, dtype=dtype)).requires_grad_()
    grad = torch.randn(1, heads, rows, dim, generator=generator, dtype=dtype)
    blocks = [(0, rows, keys, 1)]  # the last `rows` queries over all keys (bias_path's blocks, query offset keys - rows)

    def backward_seconds(plan: BackwardPlan) -> float:
        padded = torch.cat([table.new_full((heads, rows), torch.finfo(dtype).min), table], dim=1)
        output = TableBiasAttention.apply(query, key, value, padded, blocks, dim**-0.5, plan)
        start = time.perf_counter()
        torch.autograd.grad(output, (query, key, value, table), grad)
        return time.perf_counter() - start

    times = {plan: [] for plan in candidates}
    # Identity saved-tensor hooks: inside a layer under non-reentrant checkpointing the timing's own saved tensors
    # stay out of the checkpoint (whose recomputation, which finds the plan kept, must save what its forward did).
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
        for plan in candidates:
            backward_seconds(plan)
        for _ in range(repeats):
            for plan in candidates:
                times[plan].append(backward_seconds(plan))
    # The first candidate (the default) unless another is a tenth faster: on a busy machine the times scatter, and
    # a pick from noise should fall on the plan measured before (docs/benchmarks.md).
    best = min(candidates, key=lambda plan: min(times[plan]))
    return best if min(times[best]) < (1 - MEASURED_MARGIN) * min(times[candidates[0]]) else candidates[0]


def skewed_view(buffer: torch.Tensor, keys: int) -> torch.Tensor:
    """buffer [N, rows, keys + rows] (zeros outside the view) -> view [N, rows, keys] whose entry (r, c) is
    buffer[:, r, r + c]: row r shifted r columns right, so buffer.sum(1)[:, n] is the sum of the view's
    anti-diagonal r + c = n, the adjoint of the Toeplitz view (`unfold`) that made the bias."""
    count, rows, width = buffer.shape
    return buffer.as_strided((count, rows, keys), (rows * width, width + 1, 1), buffer.storage_offset())


def _block_bias(padded: torch.Tensor, start: int, rows: int, keys: int) -> torch.Tensor:
    return padded[:, start:start + rows + keys - 1].unfold(-1, keys, 1)


def keeps_logsumexp(device: torch.device) -> bool:
    """Whether the forward runs aten's CPU flash kernel (what SDPA runs there), which returns the logsumexp."""
    return device.type == "cpu"


def _widen(tensor: torch.Tensor, column) -> torch.Tensor:
    """[B, H, n, D] -> [B*H, n, D + 1], the last column `column` (a scalar or [B, H, n])."""
    out = tensor.new_empty(tensor.shape[:-1] + (tensor.shape[-1] + 1,))
    out[..., :-1] = tensor
    out[..., -1] = column
    return out.flatten(0, 1)


def _logsumexp(query, key, padded, start, rows, keys, scaling):
    """[B, H, rows]: each row's logsumexp of scale * Q K^T + bias, KEY_TILE keys at a time (devices other than CPU,
    where SDPA does not return it)."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1) if groups > 1 else key
    compute = torch.promote_types(query.dtype, torch.float32)
    query = query.to(compute) * scaling
    result, tile = None, key_tile(query.device)
    for first in range(0, keys, tile):
        width = min(tile, keys - first)
        scores = torch.matmul(query, key[:, :, first:first + width].to(compute).transpose(2, 3))
        scores += _block_bias(padded, start + first, rows, width).to(compute)
        part = scores.logsumexp(-1)
        result = part if result is None else torch.logaddexp(result, part)
    return result


class TableBiasAttention(torch.autograd.Function):
    """query [B, H, q, D]; key, value [B, H_kv, kv, D] with keys in reversed order (slot kv - 1 - c at column c);
    padded [H, pad + n] (geometry.padded_table); blocks: (first row, rows, keys, start index in `padded`) per query
    block; plan: a BackwardPlan, or a dict of measured plans to pick from or fill (backward_plan), or None for the
    default. Returns the output [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, padded, blocks, scaling, plan=None):
        groups = query.shape[1] // key.shape[1]
        kernel_lse = keeps_logsumexp(query.device)
        outputs, lses = [], []
        for first, rows, keys, start in blocks:
            columns = slice(key.shape[2] - keys, key.shape[2])
            mask = _block_bias(padded, start, rows, keys)[None]
            block = (query[:, :, first:first + rows], key[:, :, columns], value[:, :, columns])
            if kernel_lse:
                output, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    *block, attn_mask=mask, scale=scaling)
            else:
                output = F.scaled_dot_product_attention(*block, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)
                lse = _logsumexp(*block[:2], padded, start, rows, keys, scaling)
            outputs.append(output)
            lses.append(lse)
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
        lse = torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]
        ctx.save_for_backward(query, key, value, padded, output, lse)
        ctx.blocks, ctx.scaling, ctx.groups = blocks, scaling, groups
        if plan is None:
            plan = default_plan(query.device)
        elif not isinstance(plan, BackwardPlan):
            plan = backward_plan(plan, query.device, torch.promote_types(query.dtype, torch.float32),
                                 query.shape[1], query.shape[3], max(keys for _, _, keys, _ in blocks))
        ctx.plan = plan
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, padded, output, lse = ctx.saved_tensors
        scaling, groups = ctx.scaling, ctx.groups
        batch, heads, q, dim = query.shape
        dtypes = query.dtype, key.dtype, value.dtype, padded.dtype
        kv = key.shape[2]
        compute = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for float64 inputs
        grad_output = grad_output.to(compute)
        key, value = key.to(compute), value.to(compute)
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scaled_query = query.to(compute) * scaling
        delta = (grad_output * output.to(compute)).sum(-1)  # rowsum(dO * O): the same for every block of a row
        # The widened operands (see the module docstring): Q' K'^T = scale Q K^T - lse, dO' V'^T = dO V^T - delta.
        query_wide, key_wide = _widen(scaled_query, -lse.to(compute)), _widen(key, 1.0)
        grad_wide, value_wide = _widen(grad_output, -delta), _widen(value, 1.0)
        scaled_query, grad_output, key = scaled_query.flatten(0, 1), grad_output.flatten(0, 1), key.flatten(0, 1)
        grad_query = torch.empty_like(scaled_query)
        grad_key = torch.zeros_like(key)
        grad_value = torch.zeros_like(value.flatten(0, 1))
        table_grad = ctx.needs_input_grad[3]  # a fixed table (ALiBi, Sandwich, a frozen T5) takes none
        grad_padded = torch.zeros_like(padded, dtype=compute)
        # (rows, width) -> a zeroed buffer for dS (skewed_view), reused: entries outside the view stay zero. A few
        # shapes at most: the tiles are KEY_TILE wide but for one remainder per block, the same in every full block.
        skewed = {}
        # exp's argument is clamped below log(SMALLEST_PROBABILITY), which its result then falls under and is dropped:
        # aten's exp takes a slow path, about 10x, below about -87 in float32, where biases that fall with distance
        # (ALiBi, FIRE) and the masked keys put many entries, and dS must hold no subnormal number (see
        # SMALLEST_PROBABILITY).
        floor = math.log(SMALLEST_PROBABILITY) - 1
        tile_width, contiguous = ctx.plan.key_tile, ctx.plan.layout == "contiguous"
        for first, rows, keys, start in ctx.blocks:
            span = slice(first, first + rows)
            block_grad_query = grad_query[:, span].zero_()
            for tile in range(0, keys, tile_width):
                width = min(tile_width, keys - tile)
                columns = slice(kv - keys + tile, kv - keys + tile + width)
                bias = _block_bias(padded, start + tile, rows, width).to(compute)
                probs = torch.baddbmm(bias.repeat(batch, 1, 1) if batch > 1 else bias,
                                      query_wide[:, span], key_wide[:, columns].transpose(1, 2))
                probs = torch.threshold_(probs.clamp_min_(floor).exp_(), SMALLEST_PROBABILITY, 0.0)
                grad_value[:, columns].baddbmm_(probs.transpose(1, 2), grad_output[:, span])
                if (rows, width) not in skewed and (table_grad or not contiguous):
                    skewed[rows, width] = probs.new_zeros(batch * heads, rows, width + rows)
                buffer = skewed.get((rows, width))
                grad_scores = torch.bmm(grad_wide[:, span], value_wide[:, columns].transpose(1, 2))
                if contiguous:
                    grad_scores.mul_(probs)
                else:
                    grad_scores = torch.mul(grad_scores, probs, out=skewed_view(buffer, width))
                del probs
                block_grad_query.baddbmm_(grad_scores, key[:, columns])
                grad_key[:, columns].baddbmm_(grad_scores.transpose(1, 2), scaled_query[:, span])
                if table_grad:
                    if contiguous:
                        skewed_view(buffer, width).copy_(grad_scores)
                    sums = buffer.view(batch, heads, rows, width + rows).sum((0, 2) if batch > 1 else 2)
                    grad_padded[:, start + tile:start + tile + rows + width - 1] += sums.view(heads, -1)[
                        :, :rows + width - 1]
            block_grad_query.mul_(scaling)
        grad_query = grad_query.view(batch, heads, q, dim)
        grad_key, grad_value = (grad.view(batch, heads // groups, groups, kv, -1).sum(2) if groups > 1
                                else grad.view(batch, heads, kv, -1) for grad in (grad_key, grad_value))
        grads = (grad.to(dtype) for grad, dtype in zip((grad_query, grad_key, grad_value, grad_padded), dtypes))
        return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)), None, None, None)
