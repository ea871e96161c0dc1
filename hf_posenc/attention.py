"""The one attention path shared by every method that acts inside attention: additive biases, and rotary
methods that must rotate the whole key cache each step (length-dependent scalings, xPos).

Registered once, process-wide, under the name `hf_posenc` in transformers' AttentionInterface (with the
sdpa mask function under the same name in AttentionMaskInterface, so padding masks still arrive). It reads
all per-model state from the attention module it is called with, so any number of models, patched with
different methods, can use it at once. BLOOM, whose attention does not use the interface, reaches the same
function through a per-instance forward (families/bloom.py).

Biases are built per block of queries (at most `BLOCK_BYTES` of bias at a time), in float32, from query and
key positions, and added to the scores inside SDPA or an eager softmax: whichever backend the model had.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .state import STATE_ATTR, PositionState

ATTENTION_NAME = "hf_posenc"
BLOCK_BYTES = 32 * 2**20

_registered = False


def register_attention() -> None:
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, posenc_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True


def block_rows(batch: int, heads: int, kv: int) -> int:
    return max(1, BLOCK_BYTES // (4 * batch * heads * max(kv, 1)))


def block_mask(state: PositionState, layer_idx: int, rows: slice, query_slots, key_slots, query_positions,
               key_positions, attention_mask, dtype: torch.dtype) -> torch.Tensor:
    """The attention mask for query rows `rows`: the method's bias with disallowed keys at dtype's minimum
    [B or 1, H, r, kv], or a boolean mask [B or 1, 1, r, kv] for methods without a bias."""
    # Causal by cache slot, aligned to the lower right: needed whenever the mask function skipped the mask.
    allowed = key_slots[None, :] <= query_slots[rows, None]
    bias = None
    if state.method.kind == "bias":
        bias = state.method.bias(layer_idx, query_positions[:, rows], key_positions)
    if attention_mask is not None:
        given = attention_mask[..., rows, :]
        if given.dtype == torch.bool:
            allowed = allowed & given
        else:  # an additive float mask (BLOOM's, or a caller's)
            bias = given.float() if bias is None else bias + given.float()
    if bias is None:
        return allowed[None, None] if allowed.dim() == 2 else allowed
    low = torch.finfo(dtype).min
    return torch.where(allowed, bias.clamp_min(low), low).to(dtype)


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
    if state.method.kind == "rotary":
        # Keys are cached un-rotated; rotating the whole cache here costs O(kv * D) per layer and step, the same
        # order as attention itself, and is what keeps length-dependent scalings exact under a KV cache.
        query, key = state.method.rotate_query_key(query, key, query_positions, key_positions, state.seq_len)
    eager = state.backend == "eager"
    groups = heads // key.shape[1]
    if eager and groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)

    outputs, weights = [], []
    step = block_rows(batch, heads, kv)
    for start in range(0, q, step):
        rows = slice(start, min(q, start + step))
        mask = block_mask(state, module.layer_idx, rows, query_slots, key_slots, query_positions, key_positions,
                          attention_mask, query.dtype)
        block_query = query[:, :, rows]
        if eager:
            scores = torch.matmul(block_query, key.transpose(2, 3)) * scaling
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool \
                else scores + mask
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            probs = F.dropout(probs, p=dropout, training=module.training)
            outputs.append(torch.matmul(probs, value))
            weights.append(probs)
        else:
            outputs.append(F.scaled_dot_product_attention(
                block_query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1))
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    attn_weights = (torch.cat(weights, dim=2) if len(weights) > 1 else weights[0]) if eager else None
    return output.transpose(1, 2).contiguous(), attn_weights
