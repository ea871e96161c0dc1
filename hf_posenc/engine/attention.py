"""The one attention path shared by every method that acts inside attention: additive biases, and rotary
methods that must rotate the whole key cache each step (length-dependent scalings, xPos).

Registered once, process-wide, under the name `hf_posenc` in transformers' AttentionInterface (with the
sdpa mask function under the same name in AttentionMaskInterface, so padding masks still arrive). It reads
all per-model state from the attention module it is called with, so any number of models, patched with
different methods, can use it at once. BLOOM, whose attention does not use the interface, reaches the same
function through a per-instance forward (families/bloom.py).

Ways to compute attention with a bias (and content methods' blocks), never materialising a [B, H, L, L] tensor:

- "blocked" (portable, the default on CPU): queries in blocks; each block sees only the keys that causality
  allows it (so the work is about half the square, like causal SDPA). For a bias that depends on i - j alone
  (`bias_table`) with no padding mask, the block's mask is a strided Toeplitz view of a table of length L (no
  copy at all: within a few percent of causal SDPA's time on CPU); with a padding mask it is a copy of that view
  combined with the mask, in blocks of at most `BLOCK_BYTES`; other biases are computed per block. SDPA or eager
  softmax per block: whichever backend the model's config names (`set_attn_implementation("eager" | "sdpa")`).
- "flex": `torch.nn.attention.flex_attention` (compiled) with a `score_mod` that indexes the distance table.
  Only for table methods with a boolean or no mask, no dropout, no sliding window, the sdpa backend, more than one
  query (decoding stays blocked), and on CPU only without gradients (flex has no CPU backward in torch 2.13).
- "flash": flash-attn's `alibi_slopes`, for ALiBi with fixed slopes on CUDA in fp16/bf16 with flash-attn
  installed, no padding mask, and a cache holding exactly the keys seen (not a StaticCache).
- "compiled" (only when chosen): a content method's per-block chain (its logits or weights, the softmax, the
  values) under torch.compile with dynamic shapes, which fuses the chain's elementwise passes (`_compiled_content_call`;
  blocks, and their recomputation in the backward, as in the eager path: `RecomputedBlocks`). Not for eager mode,
  dropout, or `mixes_state` methods (TAPE); every other call takes the blocked path.

- "fused" (a fused CPU kernel, under "auto"): stick-breaking and CoPE on a causal square (query i is key i, nothing
  else masked, no dropout or attention weights), and Self-Extend and ReRoPE there when their far keys are the triangle
  j <= i - a, by one C++ kernel call per layer call, forward and backward, the per-pair chain in cache-sized tiles
  (engine/kernels/fused_cpu.py; built on first use, checked like the others).

Methods that score each query block themselves (Self-Extend, ReRoPE, attention sinks: `_scored_blocks`) and content
methods (`_content_blocks`) compute the block's logits in eager code where they must (attention weights to return,
dropout, or a method with no kernel form); otherwise one SDPA call per block serves: on the method's near and far parts
(`block_near`, `block_parts`; on the CPU each part's segments as kernel calls merged by logsumexp, `NearFarAttention`,
elsewhere side by side, `_near_far_attention`; the masks rebuilt in the backward, never kept), or,
for logits whose bias is a term per query minus one per key (FoX), with that bias as the block's mask and a backward
that sends its gradient into the terms (separable_attention.py), or, for logits that are a dot product of transformed
queries and keys (Transformer-XL, TAPE: `kernel_heads`), on those (`_kernel_content`: one causal call per layer
without a mask).

`set_attention_path("auto" | "blocked" | "flex" | "flash" | "compiled")` (or the `attention_path(...)` context manager)
chooses. "auto" takes flash where it applies, flex on CUDA where it applies, blocked otherwise: on CPU compiled
flex costs seconds of compilation per shape, failed to compile for left-padded decoding, and once compiled ran
1.8x causal SDPA at L=4096 against the blocked view's 1.1x, so it is never chosen automatically there. An explicit
"flex" or "flash" falls back to blocked, silently, for calls it cannot serve (the conditions above); `last_paths`
counts which path served each call, for checking.

No compiled or external kernel serves numbers that were not checked on the machine it runs on (kernel_check): the
first call of each kind that flex, flash or the compiled content blocks are about to serve also runs the kernel on
NaN-fenced copies of its inputs and compares both outputs with the blocked path's (on at most 128 query rows), and,
where the call needs gradients, the kernel's gradients on a small probe; a kind is every new compiled shape for flex,
the dtype, heads and size classes for flash (see `_flex_call`, `_flash_call`). On a mismatch, NaN, or an exception,
one `KernelCheckWarning` names the kernel, torch, the device and the error, and the blocked path serves that kernel's
calls on that device for the rest of the process (the checking call included). `kernel_status()` lists the verdicts
(which kernel serves which kind, which were refused), `reset_kernel_status()` forgets them. Seen on an AMD EPYC CPU
with torch 2.13 (4 heads, 2 KV heads, head size 16): compiled flex at 40 queries and keys (batch 1 or 2) reads past
the end of the keys and gives NaN, or values off by up to 2, depending on what that memory holds; at 16, 32, 37, 48,
64, 100 and 128 (batch 1 or 2, with or without padding) it passed, fenced.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels.check import (PROBE_BATCH, PROBE_ROWS, GradientProbe, KernelCall, KernelCheckWarning,  # noqa: F401
                            kernel_status, reset_kernel_status, serve as serve_checked, table_attention_reference)
from ..methods.base import (AttentionBiasMethod, ContentBlock, ContentMethod, NearFarForm, PositionalMethod,
                           PositionSpan, RotaryMethod, SeparableBiasForm, fill_disallowed_)
from .kernels.by_method import causal_kernel, kernel_heads, serves_near_far
from .kernels.fused_cpu import causal_attention, fused_kernels_enabled, near_far_causal
from .content import layer_state
from .state import STATE_ATTR, PositionState
from .separable_attention import NearFarAttention, SeparableBiasAttention, near_far_calls, near_far_columns
from .separable_attention import causal_separable_attention, separable_path_applies
from .table_attention import TableBiasAttention, sdpa_keeps_block_masks

ATTENTION_NAME = "hf_posenc"
BLOCK_BYTES = 16 * 2**20  # per block temporary on the CPU: about what its caches hold
# On a GPU the per-block Python loop and kernel launches cost more than the memory traffic, and the memory is large:
# bigger blocks, still a constant budget (memory stays linear in L per query block).
ACCELERATOR_BLOCK_BYTES = 256 * 2**20
# The content methods' blocks on the CPU (their eager chains, recomputed in the backward): each block costs a fixed
# few milliseconds of Python and autograd, and twice BLOCK_BYTES halves their number. Per layer step of CoPE and
# stick-breaking at 2048 and 4096 tokens (interleaved): 10-15% faster than at 16 MiB; 64 MiB no faster than 32.
CONTENT_BLOCK_BYTES = 32 * 2**20
# Per float32 [B, H, rows, keys] tensor of a compiled content block on the CPU: its fused chain runs best on a few
# hundred rows (stick-breaking at 4096 keys, 9 heads, forward and backward: 18-row blocks, the eager budget's choice,
# took 2.1x the time of 128- to 512-row ones, where the eager chain gained only 1.1x from 256-row blocks).
COMPILED_BLOCK_BYTES = 64 * 2**20
VIEW_BLOCK_ROWS = 256  # query rows per block when the bias is a view: fewer wastes the masked keys less, more calls
# At most this many query rows per block of near/far parts on the CPU: the kernel computes the masked keys past a
# block's diagonal too (1024-row blocks at 2048 tokens cost it 1.3x 227-row ones); 256 rows was 5% faster than 512 for
# a sinks training step at 4096 tokens, 128 no faster.
PARTS_BLOCK_ROWS = 256
ATTENTION_PATHS = ("auto", "blocked", "flex", "flash", "compiled")

_registered = False
_path = "auto"
_compiled_flex: dict = {}
# Compiled flex recompiles for each new shape, grad mode and dtype, and for the kernel check's probes, across every
# layer and method of the process. Past dynamo's default recompile_limit (8) dynamo silently runs flex_attention
# uncompiled, which materialises every [B, H, q, kv] score matrix: measured on an H200 (torch 2.11), 5x slower, and
# its backward at 16384 tokens raised ("cub sort does not support sorting more than INT_MAX elements"). Our calls
# get this allowance instead, inside the call only (no process-wide setting changes).
FLEX_RECOMPILE_LIMIT = 256
last_paths: Counter = Counter()


def register_attention() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, posenc_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True


class RoutedAttentionConfig:
    """What a routed attention module holds as its `config`: the model's config in every respect but the attention
    implementation, which names this path. The model's own config keeps the implementation the user chose
    ("sdpa" or "eager"), so transformers builds that implementation's masks, `model.set_attn_implementation(...)`
    and `config.output_attentions` behave as on an unpatched model, and this path computes the method's attention
    with the backend the model's config names at each call (the bias is never dropped). Modules that are not
    routed (GPT-2's cross-attention) keep the model's config: no positions there."""

    def __init__(self, model_config):
        object.__setattr__(self, "model_config", model_config)

    @property
    def _attn_implementation(self) -> str:
        return ATTENTION_NAME

    def __getattr__(self, name: str):
        if name == "model_config" or name.startswith("__"):  # not yet set (copy, pickle) or a protocol lookup
            raise AttributeError(name)
        return getattr(self.model_config, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.model_config, name, value)


def set_attention_path(path: str) -> None:
    """Choose how biased attention is computed, process-wide: "auto" (default), "blocked", "flex", "flash" or
    "compiled" (content methods' blocks under torch.compile; see the module docstring)."""
    from ..errors import PosEncError

    if path not in ATTENTION_PATHS:
        raise PosEncError(f"Attention path {path!r} is unknown; use one of {', '.join(ATTENTION_PATHS)}.")
    global _path
    _path = path


def get_attention_path() -> str:
    return _path


@contextlib.contextmanager
def attention_path(path: str):
    previous = _path
    set_attention_path(path)
    try:
        yield
    finally:
        set_attention_path(previous)


def block_rows(batch: int, heads: int, kv: int, cost: float = 1.0, device: torch.device | None = None,
               budget: int | None = None) -> int:
    if budget is None:
        budget = BLOCK_BYTES if device is None or device.type == "cpu" else ACCELERATOR_BLOCK_BYTES
    return max(1, int(budget // (4 * batch * heads * max(kv, 1) * cost)))


def block_mask(state: PositionState, layer_idx: int, rows: slice, query_slots, key_slots, query_positions,
               key_positions, attention_mask, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask for query rows `rows` (all keys given): the method's bias with disallowed keys at dtype's
    minimum [B or 1, H, r, kv], or a boolean mask [B or 1, 1, r, kv] for methods without a bias. This is the
    reference, materialised computation that the fast paths are tested against."""
    allowed = key_slots[None, :] <= query_slots[rows, None]
    bias = None
    if isinstance(state.method, AttentionBiasMethod):
        bias = state.method.bias(layer_idx, query_positions[:, rows], key_positions)
    given = attention_mask[..., rows, :] if attention_mask is not None else None
    return _combine(state, allowed, bias, given, query_positions[:, rows], key_positions, dtype)


def _combine(state, allowed, bias, given, query_positions, key_positions, dtype, fresh=False):
    """Causal slots `allowed` [r, k], the method's extra key mask, the given mask [.., r, k] and the bias -> one
    mask (see block_mask). `fresh`: the bias is this block's own tensor and may be overwritten."""
    extra = state.method.allowed_keys(query_positions, key_positions)
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
    if (not fresh or bias.dtype != torch.float32 or dtype == torch.float64
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


def posenc_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs):
    """AttentionInterface function: query [B, H, q, D], key/value [B, H_kv, kv, D] (the whole cache).
    Returns (output [B, q, H, D], attention weights or None)."""
    state: PositionState | None = getattr(module, STATE_ATTR, None)
    if state is None:
        raise RuntimeError(
            f"{type(module).__name__} uses attention implementation {ATTENTION_NAME!r} but was not patched by "
            "hf_posenc; call hf_posenc.patch_model(model, ...) on this model instead of setting it by hand."
        )
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    scaling = head_dim**-0.5 if scaling is None else scaling
    query_slots, key_slots, query_positions, key_positions = state.relative_positions(q, kv, query.device)
    rotary = isinstance(state.method, RotaryMethod)
    has_bias = isinstance(state.method, AttentionBiasMethod)
    if isinstance(state.method, ContentMethod):
        return _content_blocks(module, state, query, key, value, attention_mask, scaling, dropout, query_slots,
                               key_slots, query_positions, key_positions)
    if rotary and state.method.scores_per_query_block:
        return _scored_blocks(module, state, query, key, value, attention_mask, scaling, dropout, query_slots,
                              key_slots, query_positions, key_positions)
    layer_idx = getattr(module, "layer_idx", 0) or 0
    # Keys are cached un-rotated; rotating the whole cache here costs O(kv * D) per layer and step, the same order
    # as attention itself, and is what keeps length-dependent scalings exact under a KV cache. A method rotated per
    # query block (xPos) is rotated here too when the call's queries fit its spread (under torch.compile: always, as
    # one block, since the spread is a value); otherwise each block of the blocked path is rotated around its own
    # centre (rotate_blocks).
    rotate_blocks = False
    if rotary and (state.call.traced or _one_query_block(state, query_positions, query.dtype)):
        query, key = state.rotate_query_key(query, key, query_positions, key_positions, layer_idx)
    else:
        rotate_blocks = rotary
    dropout = dropout if module.training else 0.0
    eager = state.eager
    if state.call.traced:
        return _traced(module, state, layer_idx, query, key, value, attention_mask, scaling, dropout, eager,
                       query_slots, key_slots, query_positions, key_positions)

    if not eager and dropout == 0.0 and has_bias and state.call.shift is not None:
        output = _kernel_output(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots,
                                key_slots, query_positions, key_positions, kwargs)
        if output is not None:
            return output, None
    if (not has_bias and not eager and not rotate_blocks and not state.method.masks_keys
            and _causal_square(attention_mask, query.shape[2], key.shape[2])):
        # No bias and a plain causal square (a full forward without padding): SDPA's own causal kernel.
        last_paths["causal"] += 1
        output = F.scaled_dot_product_attention(query, key, value, dropout_p=dropout, scale=scaling, is_causal=True,
                                                enable_gqa=query.shape[1] != key.shape[1])
        return output.transpose(1, 2).contiguous(), None
    last_paths["blocked"] += 1
    return _blocked(module, state, layer_idx, query, key, value, attention_mask, scaling, dropout, eager,
                    query_slots, key_slots, query_positions, key_positions, rotate_blocks)


def _blocked(module, state, layer_idx, query, key, value, attention_mask, scaling, dropout, eager, query_slots,
             key_slots, query_positions, key_positions, rotate_blocks: bool = False):
    """The attention of any call, by query blocks (O(block x kv) memory). rotate_blocks: the queries and keys are
    not rotated yet; each block rotates its own around its centre (xPos beyond its spread, see xpos.py)."""
    batch, heads, q, _ = query.shape
    kv = key.shape[2]
    groups = heads // key.shape[1]
    if eager and groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    query_offset = state.query_offset(q, kv)  # slot distance of the first query to the first key
    table = None
    # A distance table indexed by slot distance needs position distances to be slot distances (state.py's shift);
    # eager returns attention weights, in key order: both others take the generic path.
    if not eager and state.call.shift is not None:
        table = distance_table(state.method, layer_idx, query_offset + q, _max_position(state, query_positions),
                               query.device)
    if table is not None:
        # Keys in reversed order (see toeplitz_view); softmax does not care about the order of keys.
        key, value, key_slots, key_positions = key.flip(2), value.flip(2), key_slots.flip(0), key_positions.flip(-1)
        attention_mask = attention_mask.flip(-1) if attention_mask is not None else None
    # A bias table and nothing else to mask: each block's mask is a view of the table (see toeplitz_view).
    as_view = table is not None and attention_mask is None and not state.method.masks_keys
    if table is not None:
        step = VIEW_BLOCK_ROWS if as_view else block_rows(batch, heads, kv, device=query.device)
        padded = padded_table(table, step, query.dtype if as_view else torch.float32)
    else:
        step = block_rows(batch, heads, kv, state.method.block_cost, query.device)
    if as_view and dropout == 0.0 and _needs_grad(state, query, key, value) and (
            padded.requires_grad or sdpa_keeps_block_masks(query.device)):
        # A learned table in training: SDPA takes the bias as a constant, the backward recomputes each block and
        # sends dS into the table (table_attention.py), rather than SDPA's math path for a mask with a gradient.
        # A fixed table too where SDPA would keep a copy of every block's mask (sdpa_keeps_block_masks).
        blocks = [(rows.start, rows.stop - rows.start, max(1, min(kv, query_offset + rows.stop)),
                   step + query_offset + rows.start - max(1, min(kv, query_offset + rows.stop)) + 1)
                  for rows in query_blocks(query_positions, step)]
        output = TableBiasAttention.apply(query, key, value, padded, blocks, scaling)
        return output.transpose(1, 2).contiguous(), None

    outputs, weights = [], []
    for rows in query_blocks(query_positions, step, state.method.max_query_spread(query.dtype) if rotate_blocks
                             else None):
        start, stop = rows.start, rows.stop
        # Keys past the block's last query slot are masked for every row of the block: leave them out
        # (eager mode keeps them, for full-width attention weights).
        keys = kv if eager else max(1, min(kv, query_offset + stop))
        columns = slice(kv - keys, kv) if table is not None else slice(0, keys)
        block_query = query[:, :, rows]
        block_key, block_value = key[:, :, columns], value[:, :, columns]
        if rotate_blocks:
            block_query, block_key = state.method.rotate_query_key(
                block_query, block_key, query_positions[:, rows], key_positions[:, columns], state.call.seq_len)
        if as_view:
            mask = toeplitz_view(padded, step, query_offset + start, stop - start, keys)[None]
            outputs.append(F.scaled_dot_product_attention(block_query, block_key, block_value, attn_mask=mask,
                                                          dropout_p=dropout, scale=scaling, enable_gqa=groups > 1))
            continue
        allowed = key_slots[None, columns] <= query_slots[rows, None]
        if not isinstance(state.method, AttentionBiasMethod):
            bias = None
        elif table is not None:
            bias = toeplitz_view(padded, step, query_offset + start, stop - start, keys).contiguous()[None]
        else:
            bias = state.method.block_bias(layer_idx, query_positions[:, rows], key_positions[:, columns],
                                           position_span(state, query_positions, key_positions))
        given = attention_mask[..., rows, columns] if attention_mask is not None else None
        mask = _combine(state, allowed, bias, given, query_positions[:, rows], key_positions[:, columns],
                        query.dtype, fresh=table is not None)
        if eager:
            scores = torch.matmul(block_query, block_key.transpose(2, 3)) * scaling
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
                else scores + mask
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            probs = F.dropout(probs, p=dropout, training=module.training)
            outputs.append(torch.matmul(probs, block_value))
            weights.append(probs)
        else:
            outputs.append(F.scaled_dot_product_attention(
                block_query, block_key, block_value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                enable_gqa=groups > 1))
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    attn_weights = (torch.cat(weights, dim=2) if len(weights) > 1 else weights[0]) if eager else None
    return output.transpose(1, 2).contiguous(), attn_weights


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


def _scored_blocks(module, state, query, key, value, attention_mask, scaling, dropout, query_slots, key_slots,
                   query_positions, key_positions):
    """Attention for methods whose scores the method computes per query block from un-rotated queries and keys
    (`scores_per_query_block`: Self-Extend, ReRoPE, which merge two position assignments per query). Each block
    holds a few [B, H, rows, keys] tensors (the method's `block_cost`), never [L, L] for the whole sequence.
    Returns (output [B, q, H, D], attention weights [B, H, q, kv] in eager mode, else None)."""
    last_paths["scored"] += 1
    batch, heads, q = query.shape[:3]
    kv = key.shape[2]
    groups = heads // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    eager = state.eager
    dropout = dropout if module.training else 0.0
    low = torch.finfo(torch.float32).min
    if (not eager and dropout == 0.0 and isinstance(state.method, NearFarForm)
            and _causal_square(attention_mask, query.shape[2], kv)
            and state.once_per_forward(("window holds", q, kv),
                                       lambda: state.method.window_holds(query_positions, key_positions))):
        # Every pair within the window: ordinary RoPE attention, one causal call (as native), not two per block.
        last_paths["scored causal"] += 1
        near_query, near_key = state.method.window_heads(query, key, query_positions)
        output = F.scaled_dot_product_attention(near_query, near_key, value, is_causal=True, scale=scaling)
        return output.transpose(1, 2).contiguous(), None
    keys = state.method.block_keys(key, key_positions)
    if not eager and dropout == 0.0:
        # SDPA per block on the method's near and far parts (block_parts); their masks [B or 1, 1, r, <= k] are built
        # from the positions per block and again in the backward, or on the CPU kept only where they are bands (at
        # most 2r wide, shared by the forward's layers): O(r) memory per block and query row, not O(r k)
        step = block_rows(batch, 1, 2 * kv, device=query.device)
        step = min(step, PARTS_BLOCK_ROWS) if query.device.type == "cpu" else step
        blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), step, False))
        block_masks = functools.partial(_near_far_masks, state, attention_mask, query_slots=query_slots,
                                        key_slots=key_slots, query_positions=query_positions,
                                        key_positions=key_positions)
        if separable_path_applies(query):  # the CPU kernel on each part's segments, one autograd node
            plans, far_rows = _near_far_plans(state, attention_mask, kv, blocks, block_masks, query.dtype)
            # The kernel scores every causal key, near or far: not for a method that masks keys (sinks)
            if (plans is not None and far_rows is not None and _path == "auto" and serves_near_far(state.method)
                    and not state.method.masks_keys and fused_kernels_enabled()
                    and _causal_square(attention_mask, query.shape[2], kv)):
                output = serve_checked(_fused_near_far_call(state, query, keys, value, scaling, far_rows,
                                                            query_positions, key_positions))
                if output is not None:
                    last_paths["fused near far"] += 1
                    return output.contiguous(), None
            if plans is not None:  # else an additive mask, or no near mask: block_scores serve
                last_paths["scored parts"] += 1
                last_paths["scored far triangle"] += far_rows is not None
                (near_query, near_key), (far_query, far_key) = state.method.block_parts(
                    query, keys, query_positions, key_positions, True)
                output = NearFarAttention.apply(near_query, far_query, near_key, far_key, value, blocks, plans,
                                                far_rows, block_masks, scaling)
                return output.transpose(1, 2).contiguous(), None
        elif (first := block_masks(*blocks[0])) is not None:
            last_paths["scored parts"] += 1
            # The key columns each part needs (read from the masks) are the same in every layer that sees this mask:
            # read in the first. A weak reference tells a mask freed since, whose id a new one may have taken.
            by_mask = state.once_per_forward(("near far columns", q, kv), dict)
            held = by_mask.get(id(attention_mask))
            if held is None or held[0]() is not attention_mask:
                held = by_mask[id(attention_mask)] = (_weak(attention_mask), {})
            part_columns = held[1]
            outputs = []
            for index, (rows, columns) in enumerate(blocks):
                masks = functools.partial(block_masks, rows, columns)
                block_masks_now = first if index == 0 else masks()
                if (rows.start, rows.stop) not in part_columns:
                    part_columns[rows.start, rows.stop] = near_far_columns(*block_masks_now)
                outputs.append(_near_far_attention(
                    state.method, query[:, :, rows], tuple(part[:, :, columns] for part in keys),
                    query_positions[:, rows], key_positions[:, columns], value[:, :, columns],
                    block_masks_now, masks, scaling, part_columns[rows.start, rows.stop]))
            output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
            return output.transpose(1, 2).contiguous(), None
    outputs, weights = [], []
    step = block_rows(batch, heads, kv, state.method.block_cost, query.device)
    for rows, columns in causal_blocks(q, kv, state.query_offset(q, kv), step, eager):
        scores = state.method.block_scores(query[:, :, rows], tuple(part[:, :, columns] for part in keys),
                                           query_positions[:, rows], key_positions[:, columns]) * scaling
        allowed = key_slots[None, columns] <= query_slots[rows, None]
        given = attention_mask[..., rows, columns] if attention_mask is not None else None
        mask = _combine(state, allowed, None, given, query_positions[:, rows], key_positions[:, columns],
                        torch.float32)
        scores = scores.masked_fill(~mask, low) if mask.dtype == torch.bool else scores + mask
        probs = F.dropout(F.softmax(scores, dim=-1), p=dropout, training=module.training).to(value.dtype)
        outputs.append(torch.matmul(probs, value[:, :, columns]))
        if eager:
            weights.append(probs)
    output = torch.cat(outputs, dim=2)
    return output.transpose(1, 2).contiguous(), torch.cat(weights, dim=2) if eager else None


def _fused_near_far_call(state, query, keys, value, scaling, far_rows: int, query_positions,
                         key_positions) -> KernelCall:
    """A call of a method the near/far kernel serves (Self-Extend, ReRoPE: engine/kernels/by_method.py) whose far
    keys are the causal triangle j <= i - far_rows of a causal square, by the fused CPU kernel
    (engine/kernels/fused_cpu.py near_far_causal) on the method's block_parts for the whole call (`keys`: its
    block_keys, near and far), checked against its block_scores and a softmax like any kernel. Its kind: the method,
    dtype, grad mode and the length's size class."""
    method = state.method

    def kernel(query, near_key, far_key, value, query_positions=query_positions, key_positions=key_positions):
        (near_query, near_key), (far_query, far_key) = method.block_parts(
            query, (near_key, far_key), query_positions, key_positions, True)
        return near_far_causal(near_query, near_key, far_query, far_key, value, far_rows, scaling).transpose(1, 2)

    def scored(query, near_key, far_key, value, rows, columns, query_positions, key_positions):
        scores = method.block_scores(query[:, :, rows], (near_key[:, :, columns], far_key[:, :, columns]),
                                     query_positions[:, rows], key_positions[:, columns]) * scaling
        allowed = torch.arange(columns.start, columns.stop, device=query.device)[None] <= \
            torch.arange(rows.start, rows.stop, device=query.device)[:, None]
        probs = F.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
        return torch.matmul(probs.to(value.dtype), value[:, :, columns]).transpose(1, 2)

    def reference(rows: slice) -> torch.Tensor:
        return scored(query, *keys, value, rows, slice(0, rows.stop), query_positions, key_positions)

    def gradient_probe() -> GradientProbe:  # the last PROBE_ROWS tokens, a causal square again
        size = min(PROBE_ROWS, query.shape[2])
        batch, cut = slice(0, min(PROBE_BATCH, query.shape[0])), slice(query.shape[2] - size, query.shape[2])
        positions = (query_positions[batch][:, cut], key_positions[batch][:, cut])
        inputs = {name: tensor[batch, :, cut] for name, tensor in
                  (("query", query), ("near_key", keys[0]), ("far_key", keys[1]), ("value", value))}
        return GradientProbe(
            inputs, kernel=lambda **probe: kernel(**probe, query_positions=positions[0], key_positions=positions[1]),
            reference=lambda **probe: scored(**probe, rows=slice(0, size), columns=slice(0, size),
                                             query_positions=positions[0], key_positions=positions[1]))

    name, dtype = method.config.method, str(query.dtype)
    needs_grad = _needs_grad(state, query, *keys, value)
    return KernelCall(
        kernel=f"fused cpu ({name})", device=query.device,
        kind=(name, dtype, "grad" if needs_grad else "no grad", size_class(query.shape[2])),
        function=kernel, inputs={"query": query, "near_key": keys[0], "far_key": keys[1], "value": value},
        reference=reference, gradient_kind=(name, dtype) if needs_grad else None,
        gradient_probe=gradient_probe if needs_grad else None)


def _near_far_plans(state, attention_mask, kv: int, blocks: list, block_masks, dtype) -> tuple[list | None, int | None]:
    """(each block's kernel calls for NearFarAttention (separable_attention.near_far_calls, with the masks they keep),
    far_rows (_far_triangle_start): then only the near calls), or (None, None) where block_scores serve (an additive
    mask, or no near mask). Made by the first layer of a forward and reused by the others, which attend with the same
    positions, mask and blocks: building the masks and cutting them cost Self-Extend about 4% of a layer's training
    step at 2048 tokens on the CPU."""
    call = state.call
    key = (state.method, attention_mask, dtype, kv, blocks)
    for known, planned in call.near_far_plans:
        if all(a is b for a, b in zip(known[:3], key)) and known[3:] == key[3:]:
            return planned
    first = block_masks(*blocks[0])
    planned = None, None
    if first is not None:
        kept_width = 2 * (blocks[0][0].stop - blocks[0][0].start)  # a band's: the near keys of r rows, window < r
        far_rows = _far_triangle_start(block_masks, blocks[-1][0].stop, kv)
        plans = []
        for index, (rows, columns) in enumerate(blocks):
            masks = first if index == 0 else block_masks(rows, columns)
            if far_rows is not None and not bool(masks[1].eq(_far_triangle(rows, columns, far_rows, masks[1])).all()):
                far_rows = None
            plans.append(near_far_calls(masks, dtype, kept_width))
        if far_rows is not None:
            plans = [[near for near in calls if near[0] == 0] for calls in plans]
        planned = plans, far_rows
    call.near_far_plans.append((key, planned))
    return planned


def _far_triangle_start(block_masks, q: int, kv: int) -> int | None:
    """The row a from which the far keys of the call would be a causal triangle, row i >= a attending to keys
    j <= i - a (read off the last row's far keys; _near_far_plans checks every block against it), or None where the
    last row has no far key or the first row has one (a chunk after a cache longer than the window)."""
    far = block_masks(slice(q - 1, q), slice(0, kv))[1].flatten(0, -2)[0]
    if not bool(far.any()):
        return None
    start = q - 1 - int(far.nonzero().max())
    return start if start > 0 else None


def _far_triangle(rows: slice, columns: slice, start: int, like: torch.Tensor) -> torch.Tensor:
    """[r, k] bool: key j <= row i - start, over a block's rows and columns."""
    row = torch.arange(rows.start, rows.stop, device=like.device)[:, None]
    return torch.arange(columns.start, columns.stop, device=like.device)[None] <= row - start


def _near_far_masks(state, attention_mask, rows, columns, *, query_slots, key_slots, query_positions, key_positions):
    """(near allowed, far allowed) bool [B or 1, 1, r, k] of a query block of a `block_near` method: causality, padding
    and the method's key mask, split by its near mask; None where the given mask is additive or the method has no
    near mask (block_scores serves)."""
    allowed = key_slots[None, columns] <= query_slots[rows, None]
    given = attention_mask[..., rows, columns] if attention_mask is not None else None
    mask = _combine(state, allowed, None, given, query_positions[:, rows], key_positions[:, columns], torch.float32)
    near = state.method.block_near(query_positions[:, rows], key_positions[:, columns]) \
        if mask.dtype == torch.bool and isinstance(state.method, NearFarForm) else None
    if near is None:
        return None
    return mask & near, mask & ~near


def _weak(tensor: torch.Tensor | None) -> Callable[[], torch.Tensor | None]:
    return weakref.ref(tensor) if tensor is not None else lambda: None


def _near_far_attention(method, query, keys, query_positions, key_positions, value, masks, rebuild, scaling,
                        part_columns):
    """One block of a `block_near` method off the CPU kernel (there, NearFarAttention serves every block): softmax
    over the allowed keys of q_n . k_n where near, else q_f . k_f, as one SDPA call over the keys twice, [near ones;
    far ones], with the queries [q_n, q_f] and the keys [k_n, 0] and [0, k_f] along the head dimension, so that each
    copy scores with its own query. masks: the block's (near allowed, far allowed) (_near_far_masks); with gradients
    the call is checkpointed and rebuild() gives them again in the recomputation, rather than keep them. Only the key
    columns where some row uses a part are given to it (`part_columns`: near_far_columns of the masks)."""
    near_columns, far_columns = part_columns
    far = far_columns is not None
    (near_query, near_key), far_pair = method.block_parts(query, keys, query_positions, key_positions, far)

    def cut(masks):
        return masks[0][..., near_columns], masks[1][..., far_columns] if far else None

    far_query, far_key = far_pair if far else (None, None)
    tensors = (near_query, near_key[:, :, near_columns], far_query, far_key[:, :, far_columns] if far else None,
               value[:, :, near_columns], value[:, :, far_columns] if far else None)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    if not needs_grad:
        return _side_by_side(cut(masks), *tensors, scaling)
    pending = [masks]  # the forward's masks, released once used: the recomputation in the backward rebuilds them

    def kernel(*tensors):
        return _side_by_side(cut(pending.pop() if pending else rebuild()), *tensors, scaling)

    return torch.utils.checkpoint.checkpoint(kernel, *tensors, use_reentrant=False)


def _side_by_side(masks, near_query, near_key, far_query, far_key, near_value, far_value, scaling):
    """SDPA on the near part, or on both parts side by side along the head dimension (see _near_far_attention)."""
    near_allowed, far_allowed = masks
    if far_query is None:
        return F.scaled_dot_product_attention(near_query, near_key, near_value, attn_mask=near_allowed, scale=scaling)
    keys = torch.cat((torch.cat((near_key, torch.zeros_like(near_key)), -1),
                      torch.cat((torch.zeros_like(far_key), far_key), -1)), dim=2)
    values = torch.cat((near_value, far_value), dim=2)
    mask = torch.cat((near_allowed, far_allowed), dim=-1)
    return F.scaled_dot_product_attention(torch.cat((near_query, far_query), -1), keys, values, attn_mask=mask,
                                          scale=scaling)


def _content_blocks(module, state, query, key, value, attention_mask, scaling, dropout, query_slots, key_slots,
                    query_positions, key_positions):
    """Attention for content methods (methods/base.py ContentMethod): the method computes each query block's logits
    (`content_scores`) or, for attention that is not a softmax, its weights (`content_weights`) from the queries, keys
    and carried per-token state (engine/content.py); this path does the blocking, masking, softmax and values. Each
    block holds a few [B, H, rows, keys] tensors (the method's `block_cost`), never [L, L] for the whole sequence.
    Returns (output [B, q, H, D], attention weights [B, H, q, kv] in eager mode, else None)."""
    last_paths["content"] += 1
    method = state.method
    layer_idx = getattr(module, "layer_idx", 0) or 0
    batch, heads, q, _ = query.shape
    kv = key.shape[2]
    layer_input, query_state, key_state = layer_state(state, layer_idx, q, key_slots)
    query, key, value = method.prepare_heads(layer_idx, query, key, value, layer_input, key_state,
                                             state.first_key_slot(q, kv))
    eager = state.eager
    dropout = dropout if module.training else 0.0
    outputs, weights, mixed = [], [], []
    step = block_rows(batch, heads, kv, method.block_cost, query.device,
                      CONTENT_BLOCK_BYTES if query.device.type == "cpu" else None)
    terms = method.separable_terms(query_state, key_state) if isinstance(method, SeparableBiasForm) \
        and not eager and dropout == 0.0 and separable_path_applies(query) else None
    if terms is not None:  # the logits' bias is a term per query minus one per key: SDPA's kernel per block
        last_paths["separable"] += 1

        def block_mask(rows, columns):
            return _content_mask(state, layer_idx, attention_mask, rows, columns, query_slots, key_slots,
                                 query_positions, key_positions)

        if _plain_causal(method, layer_idx, attention_mask, q, kv, query_positions, key_positions):
            last_paths["separable causal"] += 1
            output = causal_separable_attention(query, _match_heads(key, heads), _match_heads(value, heads), *terms,
                                                scaling)
        else:
            separable_rows = block_rows(batch, heads, kv, device=query.device)
            blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), separable_rows, False))
            output = SeparableBiasAttention.apply(query, _match_heads(key, heads), _match_heads(value, heads), *terms,
                                                  blocks, block_mask, scaling)
        return method.finish_output(layer_idx, output, layer_input).transpose(1, 2).contiguous(), None
    fused = _path == "auto" and query.device.type == "cpu" and fused_kernels_enabled()
    # The kernel form turns the keys at their key-value heads, before they are repeated for the query heads.
    heads_form = kernel_heads(method, layer_idx, query, key, query_state, key_state, query_positions,
                              key_positions, fused=fused) if not eager and dropout == 0.0 else None
    kernel = _kernel_content(state, layer_idx, heads_form, value, attention_mask, scaling, query_slots, key_slots,
                             query_positions, key_positions, key_state, fused) if heads_form is not None else None
    if kernel is not None:  # the logits are a dot product of transformed queries and keys: SDPA serves
        last_paths["content kernel"] += 1
        output, mixed_state = kernel
        if method.mixes_state:
            state.call.content.mixed[layer_idx] = mixed_state
        return method.finish_output(layer_idx, output, layer_input).transpose(1, 2).contiguous(), None
    key, value = _match_heads(key, heads), _match_heads(value, heads)
    causal = causal_kernel(method)
    if _path == "auto" and causal is not None and query.device.type == "cpu" and fused_kernels_enabled() \
            and not eager and dropout == 0.0 and query_state is None and key_state is None \
            and _plain_causal(method, layer_idx, attention_mask, q, kv, query_positions, key_positions) \
            and causal.applies(method, layer_idx, query_positions):
        output = serve_checked(_fused_content_call(state, layer_idx, scaling, query, key, value, attention_mask,
                                                   query_slots, key_slots, query_positions, key_positions))
        if output is not None:
            last_paths["fused content"] += 1
            output = method.finish_output(layer_idx, output.transpose(1, 2), layer_input)
            return output.transpose(1, 2).contiguous(), None
    if _path == "compiled" and not eager and dropout == 0.0 and not method.mixes_state:
        rows = max(step, block_rows(batch, heads, kv, budget=COMPILED_BLOCK_BYTES))
        call = _compiled_content_call(state, layer_idx, scaling, query, key, value, attention_mask, rows, query_slots,
                                      key_slots, query_positions, key_positions, query_state, key_state)
        output = serve_checked(call)
        if output is not None:
            last_paths["compiled content"] += 1
            output = method.finish_output(layer_idx, output.transpose(1, 2), layer_input)
            return output.transpose(1, 2).contiguous(), None
    blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), step, eager))
    # Read now, not in the backward's recomputation (when the state may hold a later forward).
    span = position_span(state, query_positions, key_positions) if method.reads_position_span else None
    if not eager and torch.is_grad_enabled() and dropout == 0.0 and not method.mixes_state:
        # Recomputed in the backward pass (the blocks' masks too): otherwise every block's [B, H, rows, keys]
        # temporaries would be kept for it, O(L^2) in all; this way a forward+backward holds one block at a time.
        def block_output(rows, columns, *heads):
            return _content_block(state, layer_idx, scaling, *heads, attention_mask, rows, columns, query_slots,
                                  key_slots, query_positions, key_positions, 0.0, False, span)[0]

        tensors = (query, key, value, query_state, key_state)
        parameters = [parameter for parameter in method.parameters() if parameter.requires_grad]
        outputs.append(RecomputedBlocks.apply(block_output, blocks, len(tensors), *tensors, *parameters))
        last_paths["content recomputed"] += 1
    else:
        for rows, columns in blocks:
            arguments = (state, layer_idx, scaling,
                         *_cut_block(rows, columns, query, key, value, query_state, key_state), attention_mask, rows,
                         columns, query_slots, key_slots, query_positions, key_positions, dropout, module.training,
                         span)
            if eager or not torch.is_grad_enabled():
                output, probs, mixed_state = _content_block(*arguments)
            else:  # dropout (its mask drawn again in the recomputation), or blocks that also mix the keys' state
                output, mixed_state = torch.utils.checkpoint.checkpoint(lambda *a: _content_block(*a)[::2],
                                                                        *arguments, use_reentrant=False)
            outputs.append(output)
            mixed.append(mixed_state)
            if eager:
                weights.append(probs.to(value.dtype))
    if method.mixes_state:  # the attention-weighted state of the keys, for the next layer (engine/content.py)
        state.call.content.mixed[layer_idx] = torch.cat(mixed, dim=2) if len(mixed) > 1 else mixed[0]
    output = method.finish_output(layer_idx, torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0],
                                  layer_input)
    attn_weights = (torch.cat(weights, dim=2) if len(weights) > 1 else weights[0]) if eager else None
    return output.transpose(1, 2).contiguous(), attn_weights


def _causal_square(attention_mask, q: int, kv: int) -> bool:
    """Whether query i is key i and nothing is masked but causality: no padding mask, no cache before the call. (With
    q == kv the first query is the first key: PositionState.first_key_slot.)"""
    return attention_mask is None and q == kv


def _plain_causal(method, layer_idx, attention_mask, q, kv, query_positions, key_positions) -> bool:
    """Whether a content call's allowed keys are exactly the causal ones with query i being key i (a causal square,
    no key mask or native bias of the method): then one causal kernel call serves it."""
    return (_causal_square(attention_mask, q, kv) and not method.masks_keys
            and method.native_bias(layer_idx, query_positions[:, :1], key_positions[:, :1]) is None)


def _match_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, n, ...] -> [B, heads, n, ...], each key-value head repeated for its group of query heads."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _pad_heads(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, n, E] -> [B, H, n, width], zeros after the first E columns."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _kernel_content(state, layer_idx, heads_form, value, attention_mask, scaling, query_slots, key_slots,
                    query_positions, key_positions, key_state, fused: bool):
    """A content method's attention as SDPA on its `kernel_heads` (q' [B, H, q, E], k' [B, H_kv, kv, E]) and the
    values [B, H_kv, kv, D]: (output [B, H, q, D] in value's dtype, for `mixes_state` methods the same weights applied
    to the keys' state [B, H, q, ...] in float32, else None), or None where the method's form does not hold for some
    attended pair (kernel_needs_ordered_keys). The keys' state rides beside the values (one call gives both
    averages). SDPA's CPU kernel needs one head size for queries, keys and values (otherwise its math path runs,
    several times slower): the narrower side is padded with zeros, unless `fused` (CPU kernels may serve) and the call
    is a causal square, which the fused causal kernel serves unpadded. One causal call without a mask; otherwise one
    call per causal query block, with the block's mask and bias as a float mask (dtype's minimum where hidden, as the
    generic path masks)."""
    method = state.method
    query, key = heads_form
    dim, batch, kv = value.shape[-1], query.shape[0], key.shape[2]
    heads, q = query.shape[1:3]
    values = value.to(query.dtype)
    if method.mixes_state and key_state is not None:
        features = key_state.to(query.dtype).flatten(3)
        if features.shape[1] != values.shape[1]:
            values, features = (_match_heads(x, heads) for x in (values, features))
        values = torch.cat((values, features), dim=-1)
    key, values = _match_heads(key, heads), _match_heads(values, heads)
    width = max(query.shape[-1], values.shape[-1])
    used = values.shape[-1]
    if _plain_causal(method, layer_idx, attention_mask, query.shape[2], kv, query_positions, key_positions):
        # Query i is key i: every attended key's position is at most the query's iff positions never go back.
        if method.kernel_needs_ordered_keys and not state.once_per_forward(
                ("keys precede their queries", q, kv),
                lambda: bool((key_positions.cummax(-1).values <= query_positions).all())):
            return None
        output = None
        if query.shape[-1] != used and fused:
            output = serve_checked(_fused_causal_call(state, query, key, values, scaling))
        if output is not None:
            last_paths["fused causal"] += 1
            output = output.transpose(1, 2)
        else:
            query, key, values = (_pad_heads(x, width) for x in (query, key, values))
            output = F.scaled_dot_product_attention(query, key, values, is_causal=True, scale=scaling)
    else:
        query, key, values = (_pad_heads(x, width) for x in (query, key, values))
        low = torch.finfo(query.dtype).min
        kernel_rows = block_rows(batch, 1, kv, device=query.device)
        blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), kernel_rows, False))
        if method.kernel_needs_ordered_keys and not _attended_keys_precede(
                state, layer_idx, attention_mask, blocks, query_slots, key_slots, query_positions, key_positions):
            return None
        outputs = []
        for rows, columns in blocks:
            allowed, bias = _content_mask(state, layer_idx, attention_mask, rows, columns, query_slots, key_slots,
                                          query_positions, key_positions)
            mask = torch.where(allowed, bias.to(query.dtype) if bias is not None else 0.0, low).to(query.dtype)
            outputs.append(F.scaled_dot_product_attention(query[:, :, rows], key[:, :, columns],
                                                          values[:, :, columns], attn_mask=mask, scale=scaling))
        output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    mixed = output[..., dim:used].unflatten(-1, key_state.shape[3:]) if used > dim else None
    return output[..., :dim].to(value.dtype), mixed


def _fused_causal_call(state, query, key, value, scaling) -> KernelCall:
    """A content kernel form's causal square whose queries and keys differ in head size from the values
    (Transformer-XL, TAPE) by the fused CPU kernel (engine/kernels/fused_cpu.py causal_attention), unpadded; checked
    against the materialised softmax like any kernel (the distance-table reference with no bias). Its kind: the
    method, dtype, grad mode and the length's size class."""
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

    name, dtype = state.method.config.method, str(query.dtype)
    needs_grad = _needs_grad(state, query, key, value)
    return KernelCall(
        kernel="fused cpu (causal)", device=query.device,
        kind=(name, dtype, "grad" if needs_grad else "no grad", size_class(query.shape[2])),
        function=lambda query, key, value: causal_attention(query, key, value, scaling).transpose(1, 2),
        inputs={"query": query, "key": key, "value": value},
        reference=lambda rows: materialised(query, key, value, rows),
        gradient_kind=(name, dtype) if needs_grad else None, gradient_probe=gradient_probe if needs_grad else None)


def _attended_keys_precede(state, layer_idx, attention_mask, blocks, query_slots, key_slots, query_positions,
                           key_positions) -> bool:
    """Whether no query attends a key at a later position, decided before any kernel call. Usually by the slots
    alone (no key up to a query's slot is at a later position); where positions go back (packed documents, left
    padding), by each block's mask."""
    def by_slots() -> bool:
        last_key = torch.searchsorted(key_slots, query_slots, right=True).clamp_min(1) - 1
        return bool((key_positions.cummax(-1).values[:, last_key] <= query_positions).all())

    if state.once_per_forward(("attended keys precede by slot", query_slots.shape[0], key_slots.shape[0]), by_slots):
        return True
    for rows, columns in blocks:
        allowed, _ = _content_mask(state, layer_idx, attention_mask, rows, columns, query_slots, key_slots,
                                   query_positions, key_positions)
        if bool((allowed & (key_positions[:, None, None, columns] > query_positions[:, None, rows, None])).any()):
            return False
    return True


def _content_mask(state, layer_idx, attention_mask, rows, columns, query_slots, key_slots, query_positions,
                  key_positions):
    """(allowed bool [B or 1, 1, r, k], bias float32 [B or 1, H or 1, r, k] or None) of a content block: causality,
    padding and the method's key mask; the native bias the method keeps and the additive part of a float mask."""
    low = torch.finfo(torch.float32).min
    allowed = key_slots[None, columns] <= query_slots[rows, None]
    given = attention_mask[..., rows, columns] if attention_mask is not None else None
    mask = _combine(state, allowed, None, given, query_positions[:, rows], key_positions[:, columns], torch.float32)
    bias = state.method.native_bias(layer_idx, query_positions[:, rows], key_positions[:, columns])
    if mask.dtype != torch.bool:  # an additive float mask: its very negative entries mask, the rest adds
        allowed = mask > low / 2
        given_bias = mask.masked_fill(~allowed, 0.0)
        bias, mask = (given_bias if bias is None else bias + given_bias), allowed
    return mask, bias


CUT_BY_ROWS = (0, 3)  # _cut_block's queries and their state


def _cut_block(rows, columns, query, key, value, query_state, key_state) -> tuple:
    """A block's queries [B, H, r, D], keys and values [B, H, k, D], and the per-token state of its queries and keys
    (or None), cut from a content call's: the ones at CUT_BY_ROWS by the block's rows, the others by its columns."""
    return (query[:, :, rows], key[:, :, columns], value[:, :, columns],
            query_state[:, :, rows] if query_state is not None else None,
            key_state[:, :, columns] if key_state is not None else None)


def _content_block_of(state, layer_idx, scaling, query_state, key_state, attention_mask, rows, columns, query_slots,
                      key_slots, query_positions, key_positions, span=None) -> ContentBlock:
    """The ContentBlock of query rows `rows` against key columns `columns` in `_content_blocks` (the states cut)."""
    mask, bias = _content_mask(state, layer_idx, attention_mask, rows, columns, query_slots, key_slots,
                               query_positions, key_positions)
    return ContentBlock(layer_idx, scaling, mask, bias, query_positions[:, rows], key_positions[:, columns],
                        query_state, key_state, query_slots[rows], key_slots[columns], span)


def content_probabilities(method: ContentMethod, query, key, block: ContentBlock) -> torch.Tensor:
    """A content block's attention weights float32 [B, H, r, k]: the method's own (`content_weights`) or the softmax
    of its logits over the allowed keys."""
    if method.replaces_softmax:
        return method.content_weights(query, key, block)
    low = torch.finfo(torch.float32).min
    scores = method.content_scores(query, key, block)
    if not method.scores_maskable_in_place:
        return F.softmax(scores.masked_fill(~block.allowed, low), dim=-1)
    return F.softmax(fill_disallowed_(scores, block.allowed, low), dim=-1)


def content_block_output(method: ContentMethod, query, key, value, block: ContentBlock) -> torch.Tensor:
    """A content block's output [B, H, r, D]: what the "compiled" path compiles (content_probabilities, then the
    values)."""
    return torch.matmul(content_probabilities(method, query, key, block).to(value.dtype), value)


def _content_block(state, layer_idx, scaling, query, key, value, query_state, key_state, attention_mask, rows, columns,
                   query_slots, key_slots, query_positions, key_positions, dropout, training, span=None):
    """Query rows `rows` against key columns `columns` in `_content_blocks`, from the block's cut of the queries, keys,
    values and states (`_cut_block`): (output [B, H, r, D], attention weights float32 [B, H, r, k], for `mixes_state`
    methods the same weights applied to the keys' state [B, H, r, ...] in float32, else None). `span`: the call's
    `position_span`, for methods that read it (else None)."""
    method = state.method
    block = _content_block_of(state, layer_idx, scaling, query_state, key_state, attention_mask, rows, columns,
                              query_slots, key_slots, query_positions, key_positions, span)
    probs = F.dropout(content_probabilities(method, query, key, block), p=dropout, training=training)
    mixed = None
    if method.mixes_state and key_state is not None:
        keys = key_state.repeat_interleave(probs.shape[1] // key_state.shape[1], dim=1).float()
        mixed = torch.matmul(probs.float(), keys.flatten(3)).unflatten(-1, keys.shape[3:])
    return torch.matmul(probs.to(value.dtype), value), probs, mixed


_compiled_block_output = None  # torch.compile(content_block_output), made at the first "compiled" call


def _compiled_content_call(state, layer_idx, scaling, query, key, value, attention_mask, step, query_slots, key_slots,
                           query_positions, key_positions, query_state, key_state) -> KernelCall:
    """The "compiled" path of a content call (heads matched, no dropout, no attention weights): the blocks of
    `_content_blocks`, each one's chain (the method's logits or weights, softmax, values) under torch.compile, which
    fuses its elementwise passes; checked against the eager blocks like any kernel (kernel_check), the gradient probe
    comparing the method's parameters' gradients too. Its kind: the method, dtype, heads, head size, mask, grad mode
    and size classes of the queries and keys (compiled with dynamic shapes, so a new length rarely recompiles)."""
    method = state.method
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    needs_grad = _needs_grad(state, query, key, value)
    fixed = (attention_mask, query_slots, key_slots, query_positions, key_positions, query_state, key_state)
    blocks = list(causal_blocks(q, kv, state.query_offset(q, kv), step, False))

    def reference(rows: slice) -> torch.Tensor:
        columns = causal_columns(rows, kv, state.query_offset(q, kv))
        return _content_block(state, layer_idx, scaling,
                              *_cut_block(rows, columns, query, key, value, query_state, key_state), attention_mask,
                              rows, columns, query_slots, key_slots, query_positions, key_positions, 0.0,
                              False)[0].transpose(1, 2)

    name, dtype, masked = method.config.method, str(query.dtype), attention_mask is not None
    return KernelCall(
        kernel=f"compiled content ({name})", device=query.device,  # a refusal holds for this method's chain alone
        kind=(name, dtype, heads, head_dim, "mask" if masked else "no mask", "grad" if needs_grad else "no grad",
              size_class(q), size_class(kv)),
        function=functools.partial(_compiled_content_kernel, state, layer_idx, scaling, blocks=blocks, fixed=fixed,
                                   needs_grad=needs_grad),
        inputs={"query": query, "key": key, "value": value},
        reference=reference,
        defined=lambda: _content_rows_defined(state, layer_idx, batch, blocks, *fixed[:5]),
        gradient_kind=(name, dtype, heads, head_dim, masked) if needs_grad else None,
        gradient_probe=lambda: _content_gradient_probe(state, layer_idx, scaling, query, key, value, fixed))


def _fused_content_call(state, layer_idx, scaling, query, key, value, attention_mask, query_slots, key_slots,
                        query_positions, key_positions) -> KernelCall:
    """A content call of a causal square (`_plain_causal`, no per-token state) by the method's fused CPU kernel
    (engine/kernels/fused_cpu.py), checked against the eager blocks like any kernel; its kind: the method, dtype, grad
    mode and the length's size class (one compiled kernel serves every shape; its tiles split differently by
    length), and the `variant` of the method's entry in engine/kernels/by_method.py (the kernel's code paths its
    options choose)."""
    method = state.method
    causal = causal_kernel(method)
    q, kv = query.shape[2], key.shape[2]
    needs_grad = _needs_grad(state, query, key, value)
    fixed = (attention_mask, query_slots, key_slots, query_positions, key_positions, None, None)

    def kernel(query, key, value, positions=query_positions):
        return causal.run(method, layer_idx, query, key, value, scaling, positions).transpose(1, 2)

    def reference(rows: slice) -> torch.Tensor:
        columns = causal_columns(rows, kv, state.query_offset(q, kv))
        return _content_block(state, layer_idx, scaling, *_cut_block(rows, columns, query, key, value, None, None),
                              attention_mask, rows, columns, query_slots, key_slots, query_positions, key_positions,
                              0.0, False)[0].transpose(1, 2)

    name, dtype, variant = method.config.method, str(query.dtype), causal.variant(method)
    return KernelCall(
        kernel=f"fused cpu ({name})", device=query.device,
        kind=(name, *variant, dtype, "grad" if needs_grad else "no grad", size_class(query.shape[2])),
        function=kernel, inputs={"query": query, "key": key, "value": value}, reference=reference,
        gradient_kind=(name, *variant, dtype) if needs_grad else None,
        gradient_probe=lambda: _content_gradient_probe(state, layer_idx, scaling, query, key, value, fixed,
                                                       kernel=kernel))


def _content_rows_defined(state, layer_idx, batch, blocks, attention_mask, query_slots, key_slots, query_positions,
                          key_positions) -> torch.Tensor:
    """bool [B, q]: the query rows that may attend to at least one key (the others' outputs are undefined: a
    softmax over no key)."""
    rows_defined = []
    for rows, columns in blocks:
        allowed, _ = _content_mask(state, layer_idx, attention_mask, rows, columns, query_slots, key_slots,
                                   query_positions, key_positions)
        rows_defined.append(allowed.any(-1)[:, 0].expand(batch, -1))
    return torch.cat(rows_defined, dim=-1)


def _compiled_content_kernel(state, layer_idx, scaling, query, key, value, blocks, fixed, needs_grad) -> torch.Tensor:
    """The compiled blocks of a content call (see _compiled_content_call): output [B, q, H, D]. With gradients each
    block is recomputed in the backward (as the eager blocks are), so a forward+backward holds one block at a time."""
    global _compiled_block_output
    if _compiled_block_output is None:
        _compiled_block_output = torch.compile(content_block_output, dynamic=True)
    compiled = _compiled_block_output
    attention_mask, query_slots, key_slots, query_positions, key_positions, _, _ = fixed
    parameters = [parameter for parameter in state.method.parameters() if parameter.requires_grad] \
        if needs_grad else []

    def block_output(rows, columns, query, key, value, query_state, key_state):
        block = _content_block_of(state, layer_idx, scaling, query_state, key_state, attention_mask, rows, columns,
                                  query_slots, key_slots, query_positions, key_positions)
        # Fresh contiguous inputs: a block's slices have strides and storage offsets that differ from block to
        # block, and dynamo guards on how those relate to sizes (each new relation would recompile).
        block = ContentBlock(**{name: _fresh(value) if isinstance(value, torch.Tensor) else value
                                for name, value in vars(block).items()})
        with _recompile_allowance(), _no_duck_sizing():  # the backward's recomputation included
            return compiled(state.method, *(_fresh(tensor) for tensor in (query, key, value)), block)

    tensors = (query, key, value, *fixed[5:])
    if needs_grad:
        outputs = [RecomputedBlocks.apply(block_output, blocks, len(tensors), *tensors, *parameters)]
    else:
        outputs = [block_output(rows, columns, *_cut_block(rows, columns, *tensors)) for rows, columns in blocks]
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return output.transpose(1, 2).contiguous()


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor at storage offset 0 with the values of `tensor` (itself where it already is one)."""
    return tensor if tensor.is_contiguous() and tensor.storage_offset() == 0 else tensor.clone(
        memory_format=torch.contiguous_format)


def _no_duck_sizing():
    """Dynamo's duck sizing off for one compiled content block: with it, sizes that happen to be equal in the first
    call (a block's rows and keys, a slot offset and a length) are guarded equal, and the next block recompiles."""
    import torch.fx.experimental._config as shape_config

    return shape_config.patch(use_duck_shape=False)


class RecomputedBlocks(torch.autograd.Function):
    """The query blocks of a content call, output = cat(block_output(rows, columns, *cut)) over the queries (cut: the
    block's cut of the tensors, `_cut_block`), keeping nothing for the backward but the tensors: the backward
    recomputes one block at a time and differentiates it w.r.t. that cut, made leaves of their own, and `parameters`
    (what it reads besides: a method's parameters). So a block's gradient is added into its slice of one buffer per
    tensor, where differentiating through the cut (as torch.utils.checkpoint per block does) would give every block
    a zero-filled gradient of the whole call's size to add (O(L) per block, O(L^2 / rows) per call). And a compiled
    block_output may be served by another graph of the same code in the recomputation, which torch.utils.checkpoint
    refuses (it checks that as many tensors were saved; with dynamic shapes that can differ: pytorch/pytorch#166926)."""

    @staticmethod
    def forward(ctx, block_output, blocks, count: int, *tensors):
        ctx.block_output, ctx.blocks = block_output, blocks
        ctx.parameters = tensors[count:]
        ctx.save_for_backward(*tensors[:count])
        inputs = [tensor.detach() if tensor is not None else None for tensor in tensors[:count]]
        with torch.no_grad():  # on detached inputs, as a compiled graph saw them in the first call
            outputs = [block_output(rows, columns, *_cut_block(rows, columns, *inputs)) for rows, columns in blocks]
        return torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[3:]
        grads = [torch.zeros_like(tensor) if need and tensor is not None else None
                 for tensor, need in zip(saved, needs)]
        parameter_grads = [None] * len(ctx.parameters)
        wanted = [index for index, need in enumerate(needs) if need]
        detached = [tensor.detach() if tensor is not None else None for tensor in saved]
        for rows, columns in ctx.blocks:
            cut = [tensor.requires_grad_(need) if tensor is not None else None
                   for tensor, need in zip(_cut_block(rows, columns, *detached), needs)]
            candidates = [*cut, *ctx.parameters]
            with torch.enable_grad():
                output = ctx.block_output(rows, columns, *cut)
            if not output.requires_grad:  # the inputs that want a gradient do not reach this block
                continue
            block_grads = torch.autograd.grad(output, [candidates[index] for index in wanted],
                                              grad_output[:, :, rows], allow_unused=True)
            for index, grad in zip(wanted, block_grads):
                if grad is None:
                    continue
                if index >= len(saved):
                    slot = index - len(saved)
                    parameter_grads[slot] = grad if parameter_grads[slot] is None else parameter_grads[slot] + grad
                else:
                    grads[index][:, :, rows if index in CUT_BY_ROWS else columns] += grad
        return (None, None, None, *grads, *parameter_grads)


def _content_gradient_probe(state, layer_idx, scaling, query, key, value, fixed, kernel=None) -> GradientProbe:
    """A small problem cut from a content call, for checking a kernel's gradients (by default the compiled blocks')
    w.r.t. queries, keys, values and the method's parameters against the eager block: the last PROBE_ROWS queries of
    the first PROBE_BATCH rows, with the keys that end at the last query's slot (in a causal square, a causal square
    again)."""
    attention_mask, query_slots, key_slots, query_positions, key_positions, query_state, key_state = fixed
    q = query.shape[2]
    end = min(key.shape[2], int(query_slots[-1]) - int(key_slots[0]) + 1)
    size = min(PROBE_ROWS, q, end)
    batch = slice(0, min(PROBE_BATCH, query.shape[0]))
    rows, keys = slice(q - size, q), slice(end - size, end)
    cut = (attention_mask[batch][..., rows, keys] if attention_mask is not None else None, query_slots[rows],
           key_slots[keys], query_positions[batch][:, rows], key_positions[batch][:, keys],
           query_state[batch][:, :, rows] if query_state is not None else None,
           key_state[batch][:, :, keys] if key_state is not None else None)
    block = (slice(0, size), slice(0, size))

    def compiled(query, key, value):
        return _compiled_content_kernel(state, layer_idx, scaling, query, key, value, [block], cut, True)

    def reference(query, key, value):
        return _content_block(state, layer_idx, scaling, *_cut_block(*block, query, key, value, *cut[5:]), cut[0],
                              *block, *cut[1:5], 0.0, False)[0].transpose(1, 2)

    def given(query, key, value):  # a kernel of the whole call, on the probe's position ids
        return kernel(query, key, value, positions=cut[3])

    parameters = {name: parameter for name, parameter in state.method.named_parameters() if parameter.requires_grad}
    inputs = {"query": query[batch, :, rows], "key": key[batch, :, keys], "value": value[batch, :, keys]}
    defined = _content_rows_defined(state, layer_idx, inputs["query"].shape[0], [block], *cut[:5])
    return GradientProbe(inputs, kernel=given if kernel is not None else compiled, reference=reference,
                         defined=defined, parameters=parameters)


def _traced(module, state, layer_idx, query, key, value, attention_mask, scaling, dropout, eager, query_slots,
            key_slots, query_positions, key_positions):
    """The attention of a call under torch.compile: one block, the mask computed from positions (block_mask), with no
    decision that reads a tensor's value (such decisions would break the graph or recompile per value). No
    `last_paths` bookkeeping: dynamo would guard on the counter and recompile on every call."""
    groups = query.shape[1] // key.shape[1]
    rows = slice(0, query.shape[2])
    mask = block_mask(state, layer_idx, rows, query_slots, key_slots, query_positions, key_positions, attention_mask,
                      query.dtype)
    if not eager:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                                enable_gqa=groups > 1)
        return output.transpose(1, 2).contiguous(), None
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool else scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _max_position(state, query_positions: torch.Tensor) -> int:
    """The highest of the call's query positions (what a distance table must reach), read once per forward."""
    return state.once_per_forward(("max query position", query_positions.shape[-1]),
                                  lambda: int(query_positions.max()))


def position_span(state, query_positions: torch.Tensor, key_positions: torch.Tensor) -> PositionSpan:
    """What the call's positions span (what a bias method sizes a table of distances from), read once per forward."""
    lowest_key = state.once_per_forward(("min key position", key_positions.shape[-1]),
                                        lambda: int(key_positions.min()))
    return PositionSpan(_max_position(state, query_positions), lowest_key)


def _one_query_block(state, query_positions: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether all queries can be rotated together: always, but for methods rotated per query block (xPos), whose
    queries must then lie within the method's spread for the dtype (a padded batch's pads included: their positions
    are the model's, often 1)."""
    method = state.method
    if not (isinstance(method, RotaryMethod) and method.rotates_per_query_block):
        return True
    return state.once_per_forward(("queries within spread", dtype, query_positions.shape[-1]),
                                  lambda: _within_spread(query_positions, method.max_query_spread(dtype)))


def _within_spread(positions: torch.Tensor, max_spread: float) -> bool:
    return float((positions.amax(-1) - positions.amin(-1)).max()) <= max_spread


def query_blocks(query_positions: torch.Tensor, step: int, max_spread: float | None = None) -> list[slice]:
    """Query rows in blocks of at most `step`; with `max_spread`, a block is halved until the positions of each of its
    rows lie within max_spread of each other (for methods that scale around a centre per block, see xpos.py)."""
    q = query_positions.shape[-1]
    blocks, start = [], 0
    while start < q:
        stop = min(q, start + step)
        while max_spread is not None and stop - start > 1:
            if _within_spread(query_positions[:, start:stop], max_spread):
                break
            stop = start + (stop - start) // 2
        blocks.append(slice(start, stop))
        start = stop
    return blocks


def _kernel_output(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots, key_slots,
                   query_positions, key_positions, kwargs):
    """The output [B, q, H, D] of the first compiled or external kernel that applies to this call under the chosen
    path and is (or has just been) checked on this device (see kernel_check), or None: the blocked path serves."""
    builders = []
    if _path in ("auto", "flash"):
        builders.append(_flash_call)
    if _path == "flex" or (_path == "auto" and query.is_cuda):
        builders.append(_flex_call)
    for build in builders:
        call = build(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots, key_slots,
                     query_positions, key_positions, kwargs)
        output = serve_checked(call) if call is not None else None
        if output is not None:
            last_paths[call.kernel] += 1
            return output
    return None


def _reference_rows(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots, key_slots,
                    query_positions, key_positions):
    """rows -> the blocked path's output [B, r, H, D] for those query rows (all keys): what kernels are checked
    against."""
    def reference(rows: slice) -> torch.Tensor:
        mask = attention_mask
        if mask is not None and mask.shape[-2] == query.shape[2]:
            mask = mask[..., rows, :]
        return _blocked(module, state, layer_idx, query[:, :, rows], key, value, mask, scaling, 0.0, False,
                        query_slots[rows], key_slots, query_positions[:, rows], key_positions)[0]
    return reference


def _needs_grad(state, *tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *state.method.parameters()))


def size_class(n: int) -> int:
    """Power-of-two size class: 1, 2-3, 4-7, 8-15, ... (each new class of a kind is checked once)."""
    return int(n).bit_length()


def _key_validity(attention_mask, batch: int, kv: int, device=None):
    """[B, kv] bool: keys the last query row may see (padding masked), from a boolean mask; None if unusable."""
    if attention_mask is None:  # made where it is used: a copy to a GPU waits for the work queued before it
        return torch.ones(batch, kv, dtype=torch.bool, device=device)
    if attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return None
    return attention_mask[:, 0, -1, :].expand(batch, kv)


FLEX_BACKWARD_DEVICES = ("cuda",)  # flex_attention has no CPU backward in torch 2.13
# Triton options for compiled flex on CUDA. With a captured distance table, inductor's default tiles (num_stages 3 or
# more) ask for more shared memory than an H100 or H200 has (245760-311296 bytes against 232448; "No valid triton
# configs. OutOfMemoryError"), for the forward in bfloat16 and the backward with GQA in float32. One stage fits, and
# was also 2.5x faster than the default in float32 at 2048 tokens (H100, torch 2.11; docs/benchmarks.md).
FLEX_CUDA_KERNEL_OPTIONS = {"num_stages": 1}


def _flex_call(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots, key_slots,
               query_positions, key_positions, kwargs) -> KernelCall | None:
    """Compiled flex_attention with a distance-table score_mod, or None where it does not apply (see the module
    docstring). Its kind is the exact compiled shape: on CPU it compiles once per shape (dynamic=False), and the
    torch 2.13 CPU failures depend on batch size and length; on CUDA a check per new shape costs at most the blocked
    path on 128 query rows, and flex never serves decoding, whose shape changes every step."""
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401 (availability)
    except ImportError:
        return None
    if state.method.masks_keys or kwargs.get("sliding_window") \
            or getattr(module, "sliding_window", None):
        return None
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    if q == 1:  # decoding: one row of bias, a view of the table in the blocked path; flex would recompile per length
        return None
    needs_grad = _needs_grad(state, query, key, value)
    if needs_grad and query.device.type not in FLEX_BACKWARD_DEVICES:
        return None
    valid = _key_validity(attention_mask, batch, kv, query.device)
    if valid is None:
        return None
    offset = state.query_offset(q, kv)
    table = distance_table(state.method, layer_idx, offset + q, _max_position(state, query_positions), query.device)
    if table is None:
        return None
    valid = valid.to(query.device)
    dtype = str(query.dtype)
    masked = attention_mask is not None
    return KernelCall(
        kernel="flex", device=query.device,
        kind=(dtype, tuple(query.shape), tuple(key.shape), offset, "mask" if masked else "no mask",
              "grad" if needs_grad else "no grad"),
        function=functools.partial(_flex_kernel, offset=offset, valid=valid, scaling=scaling),
        inputs={"query": query, "key": key, "value": value, "table": table},
        reference=_reference_rows(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots,
                                  key_slots, query_positions, key_positions),
        defined=lambda: valid.cumsum(-1)[:, offset:offset + q] > 0,
        gradient_kind=(dtype, heads, key.shape[1], head_dim, masked) if needs_grad else None,
        gradient_probe=lambda: _table_gradient_probe(_flex_kernel, query, key, value, table, offset + q, valid,
                                                     scaling))


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
        # Inductor's CPU flex template failed to compile with dynamic shapes (torch 2.13): one compile per shape there.
        _compiled_flex[device] = torch.compile(flex_attention, dynamic=False if device == "cpu" else None)
    blocks = create_block_mask(mask_mod, batch, None, q, kv, device=query.device)
    with _recompile_allowance():
        output = _compiled_flex[device](query, key, value, score_mod=score_mod, block_mask=blocks, scale=scaling,
                                        enable_gqa=heads != key.shape[1],
                                        kernel_options=FLEX_CUDA_KERNEL_OPTIONS if device == "cuda" else None)
    return output.transpose(1, 2).contiguous()


def _recompile_allowance():
    """dynamo's recompile limit raised to FLEX_RECOMPILE_LIMIT for the duration of one compiled call (flex, or a
    compiled content block)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) >= FLEX_RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return config.patch(**{name: FLEX_RECOMPILE_LIMIT})


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


def _flash_device(query: torch.Tensor) -> bool:
    """flash-attn runs on CUDA in fp16/bf16 only."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)


def _flash_call(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots, key_slots,
                query_positions, key_positions, kwargs) -> KernelCall | None:
    """flash-attn with alibi_slopes, or None where it does not apply (see the module docstring). flash-attn is a
    fixed kernel with run-time shapes: its kind is the dtype, heads and head size, whether it decodes (one query)
    or the queries are all the keys, and power-of-two size classes of batch, queries and keys, so a generation
    checks about log2(length) kinds, not every step."""
    if not _flash_device(query):
        return None
    slopes = state.method.alibi_slopes(query.device) if isinstance(state.method, AttentionBiasMethod) else None
    if slopes is None:
        return None
    batch, heads, q, head_dim = query.shape
    kv = key.shape[2]
    # A boolean mask whose last row is all True holds no padding: it is the causal mask, which flash applies.
    if attention_mask is not None and not (attention_mask.dtype == torch.bool
                                           and bool(attention_mask[:, :, -1, :].all())):
        return None
    # flash-attn aligns causal attention to the lower right: key slots must be exactly 0..offset+q-1.
    if state.first_key_slot(q, kv) != 0 or int(state.call.slot_offset) + q != kv:
        return None
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        return None
    slopes = slopes.float()
    needs_grad = _needs_grad(state, query, key, value)
    dtype = str(query.dtype)

    def kernel(query, key, value, scaling=scaling, **ignored):  # flash-attn applies the causal mask and ALiBi itself
        return flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                               softmax_scale=scaling, causal=True, alibi_slopes=slopes)

    def gradient_probe():
        table = distance_table(state.method, layer_idx, min(q, PROBE_ROWS), 0, query.device)
        return _table_gradient_probe(kernel, query, key, value, table, kv, None, scaling, table_gradient=False)

    return KernelCall(
        kernel="flash", device=query.device,
        kind=(dtype, heads, key.shape[1], head_dim, "decoding" if q == 1 else "square" if q == kv else "chunk",
              size_class(batch), size_class(q), size_class(kv), "grad" if needs_grad else "no grad"),
        function=kernel, inputs={"query": query, "key": key, "value": value},
        reference=_reference_rows(module, state, layer_idx, query, key, value, attention_mask, scaling, query_slots,
                                  key_slots, query_positions, key_positions),
        gradient_kind=(dtype, heads, key.shape[1], head_dim) if needs_grad else None,
        gradient_probe=gradient_probe if needs_grad else None)
