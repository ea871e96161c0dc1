"""Block geometry shared by every path: how many query rows a block holds, which keys each block may see, the
Toeplitz view of a distance table, the mask of a block (causality, padding, the method's key mask and bias), and
what a call's positions span."""

from __future__ import annotations

import torch

from ...methods.base import AttentionBiasMethod, PositionalMethod, PositionSpan, RotaryMethod
from .call import AttentionCall

# aten's CPU flash kernel, which returns each row's logsumexp (the near/far and separable paths merge by it)
FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


BLOCK_BYTES = 16 * 2**20  # per block temporary on the CPU: about what its caches hold
# On a GPU the per-block Python loop and kernel launches cost more than the memory traffic, and the memory is large:
# bigger blocks, still a constant budget (memory stays linear in L per query block).
ACCELERATOR_BLOCK_BYTES = 256 * 2**20


def block_rows(batch: int, heads: int, kv: int, cost: float = 1.0, device: torch.device | None = None,
               budget: int | None = None) -> int:
    """Query rows per block: `budget` bytes (BLOCK_BYTES on the CPU, ACCELERATOR_BLOCK_BYTES elsewhere) per float32
    [B, H, rows, kv] temporary, of which a block holds `cost`."""
    if budget is None:
        budget = BLOCK_BYTES if device is None or device.type == "cpu" else ACCELERATOR_BLOCK_BYTES
    return max(1, int(budget // (4 * batch * heads * max(kv, 1) * cost)))


def block_mask(call: AttentionCall, rows: slice, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask for query rows `rows` (all keys given): the method's bias with disallowed keys at dtype's
    minimum [B or 1, H, r, kv], or a boolean mask [B or 1, 1, r, kv] for methods without a bias. This is the
    reference, materialised computation that the fast paths are tested against."""
    every_key = slice(None)
    bias = None
    if isinstance(call.method, AttentionBiasMethod):
        bias = call.method.bias(call.layer_idx, call.query_positions[:, rows], call.key_positions)
    return combined_mask(call.method, call.causal_allowed(rows, every_key), bias, call.given_mask(rows, every_key),
                         call.query_positions[:, rows], call.key_positions, dtype)


def combined_mask(method: PositionalMethod, allowed, bias, given, query_positions, key_positions, dtype,
                  owned: bool = False) -> torch.Tensor:
    """Causal slots `allowed` [r, k], the method's extra key mask, the given mask [.., r, k] and the bias -> one
    mask (see block_mask). `owned`: the bias is this block's own tensor and may be overwritten."""
    extra = method.allowed_keys(query_positions, key_positions)
    if extra is not None:
        allowed = allowed & extra
    if given is not None:
        if given.dtype == torch.bool:
            allowed = allowed & given
        else:  # an additive float mask (BLOOM's, or a caller's)
            bias = given.float() if bias is None else bias + given.float()
    if bias is None:
        return allowed[None, None] if allowed.dim() == 2 else allowed
    low = torch.finfo(dtype).min
    if (not owned or bias.dtype != torch.float32 or dtype == torch.float64
            or torch.broadcast_shapes(bias.shape, allowed.shape) != bias.shape):
        return torch.where(allowed, bias.to(dtype).clamp_min(low), low)
    # In place, so that no second [B, H, r, k] tensor is made.
    bias = bias.clamp_min_(low).masked_fill_(~allowed, low)
    return bias if dtype == torch.float32 else bias.to(dtype)


def distance_table(method: PositionalMethod, layer_idx: int, num_distances: int, max_position: int,
                   device) -> torch.Tensor | None:
    """float32 [H, num_distances] for methods whose bias depends on i - j alone (for these queries), else None."""
    if not isinstance(method, AttentionBiasMethod):
        return None
    return method.bias_table(layer_idx, num_distances, max_position, device)


def padded_table(table: torch.Tensor, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """[H, pad + n]: the distance table in `dtype` behind `pad` entries of dtype's minimum, which stand for the
    negative distances (keys after the query), so that a Toeplitz view of it is the causally masked bias."""
    low = torch.finfo(dtype).min
    table = table.to(dtype).clamp_min(low)  # clamped after the cast: -inf from fp16 overflow becomes its minimum
    return torch.cat([table.new_full((table.shape[0], pad), low), table], dim=1)


def toeplitz_view(padded: torch.Tensor, pad: int, first: int, rows: int, keys: int) -> torch.Tensor:
    """The masked bias of a query block with its keys in REVERSED order, as a strided view of `padded` (see
    padded_table): out[h, r, c] = table[h, first + r - (keys-1-c)], and dtype's minimum where that index is below
    0 (needs pad >= rows - 1 - first). Reversing the keys makes every row a forward window of the table, so the
    view is one `unfold`: no [H, rows, keys] tensor is made. SDPA reads a strided mask as it is, and the rows
    overlap in memory, so the bias it reads stays in cache: on CPU this costs a few percent over causal SDPA,
    where a contiguous copy of the same block costs about half again."""
    start = pad + first - keys + 1
    return padded[:, start:start + rows + keys - 1].unfold(-1, keys, 1)


def causal_blocks(q: int, kv: int, query_offset: int, step: int, full_width: bool):
    """(rows, columns) per block of `step` of the q query rows, keys in slot order, the first query `query_offset`
    slots after the first key (PositionState.query_offset): keys past the block's last query slot are masked for all
    its rows and left out (causal_columns), unless `full_width` (eager: attention weights over every key)."""
    for start in range(0, q, step):
        rows = slice(start, min(q, start + step))
        yield rows, slice(0, kv) if full_width else causal_columns(rows, kv, query_offset)


def causal_columns(rows: slice, kv: int, query_offset: int) -> slice:
    """The keys a block of query rows may attend: those up to its last query's slot (at least one)."""
    return slice(0, max(1, min(kv, query_offset + rows.stop)))


def max_query_position(call: AttentionCall) -> int:
    """The highest of the call's query positions (what a distance table must reach), read once per forward."""
    state, query_positions = call.state, call.query_positions
    return state.once_per_forward(("max query position", query_positions.shape[-1]),
                                  lambda: int(query_positions.max()))


def position_span(call: AttentionCall) -> PositionSpan:
    """What the call's positions span (what a bias method sizes a table of distances from), read once per forward."""
    key_positions = call.key_positions
    lowest_key = call.state.once_per_forward(("min key position", key_positions.shape[-1]),
                                             lambda: int(key_positions.min()))
    return PositionSpan(max_query_position(call), lowest_key)


def rotates_as_one_block(call: AttentionCall) -> bool:
    """Whether all queries can be rotated together: always, but for methods rotated per query block (xPos), whose
    queries must then lie within the method's spread for the dtype (a padded batch's pads included: their positions
    are the model's, often 1)."""
    method, query_positions, dtype = call.method, call.query_positions, call.query.dtype
    if not (isinstance(method, RotaryMethod) and method.rotates_per_query_block):
        return True
    return call.state.once_per_forward(("queries within spread", dtype, query_positions.shape[-1]),
                                       lambda: within_spread(query_positions, method.max_query_spread(dtype)))


def within_spread(positions: torch.Tensor, max_spread: float) -> bool:
    return float((positions.amax(-1) - positions.amin(-1)).max()) <= max_spread


def query_blocks(query_positions: torch.Tensor, step: int, max_spread: float | None = None) -> list[slice]:
    """Query rows in blocks of at most `step`; with `max_spread`, a block is halved until the positions of each of its
    rows lie within max_spread of each other (for methods that scale around a centre per block, see xpos.py)."""
    q = query_positions.shape[-1]
    blocks, start = [], 0
    while start < q:
        stop = min(q, start + step)
        while max_spread is not None and stop - start > 1:
            if within_spread(query_positions[:, start:stop], max_spread):
                break
            stop = start + (stop - start) // 2
        blocks.append(slice(start, stop))
        start = stop
    return blocks


def needs_grad(method: PositionalMethod, *tensors: torch.Tensor) -> bool:
    """Whether autograd records this call: a tensor or a parameter of the method wants a gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *method.parameters()))


def power_of_two_bucket(n: int) -> int:
    """n's power-of-two size class: 1, 2-3, 4-7, 8-15, ... (kernel_check checks each new class of a kind once)."""
    return int(n).bit_length()


def additive_mask_allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """bool, where an additive float mask of 0 (attended) and "minus infinity" (at most half the dtype's minimum:
    masked) attends; None where it holds anything else (a bias a boolean mask cannot carry)."""
    allowed = mask == 0
    return allowed if bool((allowed | (mask <= torch.finfo(mask.dtype).min / 2)).all()) else None


def causal_square(attention_mask, q: int, kv: int) -> bool:
    """Whether query i is key i and nothing is masked but causality: no padding mask, no cache before the call. (With
    q == kv the first query is the first key: PositionState.first_key_slot.)"""
    return attention_mask is None and q == kv


def match_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, n, ...] -> [B, heads, n, ...], each key-value head repeated for its group of query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def cpu_flash_applies(query: torch.Tensor) -> bool:
    """Whether the paths on aten's CPU flash kernel (near/far parts, separable content) can serve: CPU (the kernel
    returns the logsumexp there), float32 or float64 (a mask holding a bias in the queries' dtype would round it in
    half precision)."""
    return query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
