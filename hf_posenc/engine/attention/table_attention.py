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
(causal SDPA's backward runs the same five). With torch ops (torch_tiles: off the CPU, with HF_POSENC_CPU_KERNELS=0,
or where the fused kernel failed its check) the elementwise work around them is kept to four passes a tile:
- -lse and -rowsum(dO * O) ride in the matmuls as one more column (Q' = [scale Q, -lse], K' = [K, 1],
  dO' = [dO, -delta], V' = [V, 1]): P = exp(bias + Q' K'^T) is one baddbmm (the bias its accumulator) and an exp,
  dS = (dO' V'^T) * P one matmul and a multiply;
- the multiply writes dS into a skewed buffer (row r shifted r columns right, see skewed_view), so that the
  anti-diagonal sums are one column sum of that buffer (in place of aten's unfold_backward: a tenth off the
  backward at 4096), and the matmuls read dS from it in place.
Those passes and their dispatch still cost about 600 ms of a 2.5 s forward+backward at 8192 tokens on an Intel Xeon
(1 thread; 1.4-1.6x causal SDPA at 512-8192 tokens, up to 2x and more on 2 threads, issue 56). On the CPU the tiles
are the fused kernel's (fused_tiles, engine/kernels/cpu_kernels/table_tile.cpp): per batch x head, one thread, each
tile's bias, exp and dS (with the anti-diagonal sums) one loop each between the five BLAS products, in cache; a tile
whose probabilities are all dropped skips its products. It serves once it matched torch_tiles on a small problem in
this process (fused_tiles_serve). Forward + backward over causal SDPA's on that Xeon (8 heads x 64, float32,
benchmarks/bench_table_attention.py, docs/attention-paths.md "Training learned tables"): 0.93-1.08x at 512-8192
tokens on 1 thread, 1.0-1.4x on 2 of a busy machine, where the torch-op tiles took 1.40-1.54x and 1.8-10x.
On an Intel Xeon the first code took 4-10x (issue 56): the masked keys' probabilities, clamped to e * float32's
smallest normal number, made dS subnormal, and Intel cores take every multiply-add with a subnormal operand through a
microcode assist (75x a product's time); probabilities under SMALLEST_PROBABILITY are now dropped (by both). The
tile size and layout (BackwardPlan: fused, or torch ops reading dS from the skewed buffer or from a contiguous tile)
are timed on the machine at a model's first training call and kept on its state (backward_plan;
`attention.tuned_choices(model)`).
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

from ..kernels.check import tolerance, verified
from ..kernels.fused_cpu import fused_kernels_enabled, table_backward_tiles

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
LAYOUTS = ("fused", "skewed", "contiguous")
MEASURED_MARGIN = 0.1  # a measured plan replaces the default where its backward is this share faster


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward runs its tiles. key_tile: keys per tile. layout: "fused", the fused CPU kernel (fused_tiles;
    "skewed" where it does not serve); "skewed", torch ops, dS written straight into the skewed buffer whose column
    sums are the table's gradient, and the matmuls read it there (strided: one product per batch x head);
    "contiguous", torch ops, dS in a contiguous tile the matmuls read, copied into the skewed buffer for the sums."""

    key_tile: int
    layout: str = "skewed"

    def describe(self) -> str:
        return f"key_tile={self.key_tile}, layout={self.layout}"


def key_tile(device: torch.device) -> int:
    """Keys per tile on `device` where no plan is measured (the logsumexp of the forward, the default plan)."""
    return KEY_TILE if device.type == "cpu" else ACCELERATOR_KEY_TILE


def default_plan(device: torch.device) -> BackwardPlan:
    """KEY_TILE keys a tile by the fused kernel on the CPU where the fused kernels are on; else torch ops (skewed)."""
    fused = device.type == "cpu" and fused_kernels_enabled()
    return BackwardPlan(key_tile(device), "fused" if fused else "skewed")


def candidate_plans() -> list[BackwardPlan]:
    """What a measured plan is picked from on the CPU: half, once and twice KEY_TILE, by the fused kernel where the
    fused kernels are on (the torch-op layouts at KEY_TILE beside them), else each torch-op layout; the default
    first."""
    tiles = (max(1, KEY_TILE // 2), KEY_TILE, 2 * KEY_TILE)
    if fused_kernels_enabled():
        others = [BackwardPlan(tile, "fused") for tile in tiles] + [BackwardPlan(KEY_TILE, layout)
                                                                    for layout in LAYOUTS[1:]]
    else:
        others = [BackwardPlan(tile, layout) for tile in tiles for layout in LAYOUTS[1:]]
    first = default_plan(torch.device("cpu"))
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


def attend_blocks(query, key, value, padded, blocks, scaling):
    """The forward (see TableBiasAttention): output [B, H, q, D] and each row's logsumexp [B, H, q]."""
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
    return output, torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]


def widened_operands(query, key, value, output, lse, grad_output, scaling, compute):
    """The backward's operands in `compute` (see the module docstring): Q' = [scale Q, -lse] and dO' = [dO, -delta]
    [B*H, q, D + 1], K' = [K, 1] and V' = [V, 1] [B*H, kv, D + 1] (key and value heads repeated per query head), so
    that Q' K'^T = scale Q K^T - lse and dO' V'^T = dO V^T - delta."""
    groups = query.shape[1] // key.shape[1]
    grad_output = grad_output.to(compute)
    key, value = key.to(compute), value.to(compute)
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    delta = (grad_output * output.to(compute)).sum(-1)  # rowsum(dO * O): the same for every block of a row
    return (_widen(query.to(compute) * scaling, -lse.to(compute)), _widen(key, 1.0), _widen(grad_output, -delta),
            _widen(value, 1.0))


class TableBiasAttention(torch.autograd.Function):
    """query [B, H, q, D]; key, value [B, H_kv, kv, D] with keys in reversed order (slot kv - 1 - c at column c);
    padded [H, pad + n] (geometry.padded_table); blocks: (first row, rows, keys, start index in `padded`) per query
    block; plan: a BackwardPlan, or a dict of measured plans to pick from or fill (backward_plan), or None for the
    default. Returns the output [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, padded, blocks, scaling, plan=None):
        groups = query.shape[1] // key.shape[1]
        output, lse = attend_blocks(query, key, value, padded, blocks, scaling)
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
        query_wide, key_wide, grad_wide, value_wide = widened_operands(query, key, value, output, lse, grad_output,
                                                                       scaling, compute)
        table_grad = ctx.needs_input_grad[3]  # a fixed table (ALiBi, Sandwich, a frozen T5) takes none
        operands = (query_wide, key_wide, grad_wide, value_wide, padded.to(compute))
        plan = ctx.plan
        if plan.layout == "fused" and (query.device.type != "cpu" or value.shape[-1] != dim
                                       or not fused_tiles_serve(compute)):
            # the kernels are off or failed their check here; or values of another head size than the queries'
            plan = BackwardPlan(plan.key_tile, "skewed")
        tiles = fused_tiles if plan.layout == "fused" else torch_tiles
        grad_query, grad_key, grad_value, grad_padded = tiles(*operands, ctx.blocks, plan, scaling, batch, table_grad)
        grad_query = grad_query.view(batch, heads, q, dim)
        grad_key, grad_value = (grad.view(batch, heads // groups, groups, kv, -1).sum(2) if groups > 1
                                else grad.view(batch, heads, kv, -1) for grad in (grad_key, grad_value))
        grad_padded = grad_padded.sum(0) if grad_padded is not None else None
        grads = (grad if grad is None else grad.to(dtype)
                 for grad, dtype in zip((grad_query, grad_key, grad_value, grad_padded), dtypes))
        return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)), None, None, None)


def torch_tiles(query_wide, key_wide, grad_wide, value_wide, padded, blocks, plan, scaling, batch, table_grad):
    """The backward's tiles by torch ops (the reference, and what serves where the fused kernel does not): the widened
    operands ([B*H, q, D + 1] Q' and dO', [B*H, kv, D + 1] K' and V') and the padded table [H, P] in the compute
    dtype -> the gradients of the queries ([B*H, q, D]), of the keys and values per query head ([B*H, kv, D]) and of
    `padded` ([1, H, P], or None without `table_grad`)."""
    count, q, wide = query_wide.shape
    heads, kv = padded.shape[0], key_wide.shape[1]
    # Views without the widening column: the products read them with a row stride of D + 1, no copy.
    scaled_query, grad_output, key = (tensor[..., :-1] for tensor in (query_wide, grad_wide, key_wide))
    grad_query = query_wide.new_empty(count, q, wide - 1)
    grad_key = key_wide.new_zeros(count, kv, wide - 1)
    grad_value = value_wide.new_zeros(count, kv, value_wide.shape[-1] - 1)
    grad_padded = torch.zeros_like(padded)
    # (rows, width) -> a zeroed buffer for dS (skewed_view), reused: entries outside the view stay zero. A few
    # shapes at most: the tiles are KEY_TILE wide but for one remainder per block, the same in every full block.
    skewed = {}
    # exp's argument is clamped below log(SMALLEST_PROBABILITY), which its result then falls under and is dropped:
    # aten's exp takes a slow path, about 10x, below about -87 in float32, where biases that fall with distance
    # (ALiBi, FIRE) and the masked keys put many entries, and dS must hold no subnormal number (see
    # SMALLEST_PROBABILITY).
    floor = math.log(SMALLEST_PROBABILITY) - 1
    tile_width, contiguous = plan.key_tile, plan.layout == "contiguous"
    for first, rows, keys, start in blocks:
        span = slice(first, first + rows)
        block_grad_query = grad_query[:, span].zero_()
        for tile in range(0, keys, tile_width):
            width = min(tile_width, keys - tile)
            columns = slice(kv - keys + tile, kv - keys + tile + width)
            bias = _block_bias(padded, start + tile, rows, width)
            probs = torch.baddbmm(bias.repeat(batch, 1, 1) if batch > 1 else bias,
                                  query_wide[:, span], key_wide[:, columns].transpose(1, 2))
            probs = torch.threshold_(probs.clamp_min_(floor).exp_(), SMALLEST_PROBABILITY, 0.0)
            grad_value[:, columns].baddbmm_(probs.transpose(1, 2), grad_output[:, span])
            if (rows, width) not in skewed and (table_grad or not contiguous):
                skewed[rows, width] = probs.new_zeros(count, rows, width + rows)
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
    return grad_query, grad_key, grad_value, grad_padded[None] if table_grad else None


def fused_tiles(query_wide, key_wide, grad_wide, value_wide, padded, blocks, plan, scaling, batch, table_grad):
    """torch_tiles by the fused CPU kernel (engine/kernels/cpu_kernels/table_tile.cpp): every pass of a tile between
    its products in one loop, in cache, a thread per batch x head; the table's gradient per batch row."""
    return table_backward_tiles(query_wide, key_wide, grad_wide, value_wide, padded, blocks, plan.key_tile, scaling,
                                table_grad)


FUSED_KERNEL = "fused cpu (table backward)"


def fused_tiles_serve(compute: torch.dtype) -> bool:
    """Whether the fused kernel serves the backward's tiles in `compute` (float32 or float64): the fused CPU kernels
    are on, and at the first such backward in this process its gradients matched torch_tiles' on a small problem
    (check_fused_tiles; recorded as kernel checks are: `hf_posenc.attention.kernel_status()`, a KernelCheckWarning
    on a failure, a failed build included, after which torch ops serve)."""
    return fused_kernels_enabled() and verified(FUSED_KERNEL, torch.device("cpu"), compute,
                                                lambda: check_fused_tiles(compute))


def check_fused_tiles(compute: torch.dtype) -> tuple[float, float]:
    """The fused kernel's largest error against torch_tiles, relative to each gradient's largest value, over the
    gradients of queries, keys, values and table, on two batch rows of 4 query heads sharing 2 key-value heads, 40
    tokens in blocks of 16 rows, tiles of 8 keys (remainders, masked keys, a steep fall that drops whole tiles); and
    the tolerance."""
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, length, dim, step, scaling = 2, 4, 2, 40, 8, 16, 8**-0.5
    query = torch.randn(batch, heads, length, dim, generator=generator, dtype=compute)
    key, value = (torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=compute) for _ in range(2))
    table = torch.randn(heads, length, generator=generator, dtype=compute)
    table[-1] = -8.0 * torch.arange(length, dtype=compute)  # past a few keys every probability is dropped
    padded = torch.cat([table.new_full((heads, step), torch.finfo(compute).min), table], dim=1)
    blocks = [(first, min(step, length - first), first + min(step, length - first),
               step + 1 - min(step, length - first)) for first in range(0, length, step)]
    output, lse = attend_blocks(query, key, value, padded, blocks, scaling)
    grad = torch.randn(output.shape, generator=generator, dtype=compute)
    operands = (*widened_operands(query, key, value, output, lse, grad, scaling, compute), padded)
    plan = BackwardPlan(8, "fused")
    got = fused_tiles(*operands, blocks, plan, scaling, batch, True)
    want = torch_tiles(*operands, blocks, plan, scaling, batch, True)
    got = (*got[:3], got[3].sum(0))
    want = (*want[:3], want[3].sum(0))
    error = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))
    return error, 2 * tolerance(compute)
