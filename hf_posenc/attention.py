"""The one attention path every bias method shares.

Registered once, process-wide, under the name `hf_posenc` in transformers' AttentionInterface (with the
sdpa mask function under the same name in AttentionMaskInterface, so padding masks still arrive). It reads
all per-model state from the attention module it is called with, so any number of models, patched with
different methods, can use it at once.

The bias is built per block of queries (at most `BLOCK_BYTES` of bias at a time) and added to the scores
inside SDPA or the eager softmax, whichever backend the model had before patching.
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


def masked_bias(state: PositionState, layer_idx: int, rows: slice, query_slots, key_slots, query_positions,
                key_positions, attention_mask, dtype: torch.dtype) -> torch.Tensor:
    """The method's bias for query rows `rows`, with disallowed keys set to dtype's minimum. [B or 1, H, r, kv]."""
    bias = state.method.bias(layer_idx, query_positions[:, rows], key_positions)
    # Causal by cache slot, aligned to the lower right: needed whenever the mask function skipped the mask.
    allowed = key_slots[None, :] <= query_slots[rows, None]
    if attention_mask is not None:
        block_mask = attention_mask[..., rows, :]
        if block_mask.dtype == torch.bool:
            allowed = allowed & block_mask
        else:  # an additive float mask given by the caller
            bias = bias + block_mask.float()
    low = torch.finfo(dtype).min
    return torch.where(allowed, bias.clamp_min(low), low).to(dtype)


def posenc_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs):
    """AttentionInterface function: query [B, H, q, D], key/value [B, H_kv, kv, D] (the whole cache)."""
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
    eager = state.backend == "eager"
    groups = heads // key.shape[1]
    if eager and groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)

    outputs, weights = [], []
    step = block_rows(batch, heads, kv)
    for start in range(0, q, step):
        rows = slice(start, min(q, start + step))
        bias = masked_bias(state, module.layer_idx, rows, query_slots, key_slots, query_positions, key_positions,
                           attention_mask, query.dtype)
        block_query = query[:, :, rows]
        if eager:
            scores = torch.matmul(block_query, key.transpose(2, 3)) * scaling + bias
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            probs = F.dropout(probs, p=dropout, training=module.training)
            outputs.append(torch.matmul(probs, value))
            weights.append(probs)
        else:
            outputs.append(F.scaled_dot_product_attention(
                block_query, key, value, attn_mask=bias, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1))
    output = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    attn_weights = (torch.cat(weights, dim=2) if len(weights) > 1 else weights[0]) if eager else None
    return output.transpose(1, 2).contiguous(), attn_weights
