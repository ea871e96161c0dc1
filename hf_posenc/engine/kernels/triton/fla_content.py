"""FoX and stick-breaking attention by fla-core's Triton kernels (fla-org/flash-linear-attention, MIT;
`fla.ops.forgetting_attn.parallel_forgetting_attn` and `fla.ops.stickbreaking_attn.parallel_stickbreaking_attn`,
written against fla-core 0.6.0): the glue from this library's layouts and conventions to theirs.

fla takes [B, T, H, D] with key-value heads unrepeated (GQA), key width <= 256, and packed documents as one row with
`cu_seqlens` (FlashAttention's varlen form). FoX's gate enters as the per-token log forget gate g_t = log f_t
[B, T, H] (fla takes its cumulative sum, and back through it in the backward); stick-breaking returns the stick each
query left (`rem`), which our formula puts on the query's own value (methods/stick_breaking.py: o + rem * v_i).
fla is imported inside the functions: only a call on the "triton" path needs it.
"""

from __future__ import annotations

import importlib.util

import torch

MAX_HEAD_DIM = 256  # fla's kernels hold a query's whole key width (and value width) in one block
# fla's kernels keep their softmax statistics and sticks in float32: in float64 the forward is float32-accurate
# (1e-8) and, under Triton 3.9's interpreter, the key and value gradients are wrong, so float64 stays on the
# blocked path.
FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def fla_installed() -> bool:
    """Whether fla-core and triton can be imported (the `gpu` extra)."""
    return all(importlib.util.find_spec(name) is not None for name in ("triton", "fla"))


def document_starts(positions: torch.Tensor) -> torch.Tensor:
    """bool [B, T]: the tokens that start a document, as transformers reads packed rows
    (masking_utils.find_packed_sequence_indices): the first token of each row and each one whose position id is not
    its predecessor's plus one."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] - positions[:, :-1] != 1
    return starts


def cu_seqlens_of(starts: torch.Tensor) -> torch.Tensor:
    """The cumulative document lengths [N + 1] (int64) of the B rows of `starts` laid end to end, fla's `cu_seqlens`
    for inputs flattened to one row."""
    batch, length = starts.shape
    flat = torch.nonzero(starts.reshape(-1)).flatten()
    return torch.cat((flat, flat.new_tensor([batch * length]))).to(torch.int64)


def _fla_layout(x: torch.Tensor, packed: bool) -> torch.Tensor:
    """[B, H, T, D] -> fla's [B, T, H, D], the rows laid end to end ([1, B * T, H, D]) for packed documents."""
    x = x.transpose(1, 2)
    return x.reshape(1, -1, *x.shape[2:]) if packed else x


def _our_layout(x: torch.Tensor, batch: int) -> torch.Tensor:
    """fla's [B or 1, B * T, H, ...] -> [B, H, T, ...]."""
    return x.reshape(batch, -1, *x.shape[2:]).transpose(1, 2)


def forgetting_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, log_forget: torch.Tensor,
                         scaling: float, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """FoX's causal attention softmax(scaling q_i . k_j + c_i - c_j) v, c the cumulative sum of `log_forget` within
    each document: query [B, H, T, D], key and value [B, H_kv, T, D], log_forget [B, H, T] (log f_t per query head),
    cu_seqlens the documents of the rows laid end to end (None: each row is one). Returns [B, H, T, D] in the
    query's dtype."""
    from fla.ops.forgetting_attn import parallel_forgetting_attn

    packed, batch = cu_seqlens is not None, query.shape[0]
    gates = log_forget.transpose(1, 2)
    gates = gates.reshape(1, -1, gates.shape[-1]) if packed else gates
    output = parallel_forgetting_attn(_fla_layout(query, packed), _fla_layout(key, packed),
                                      _fla_layout(value, packed), gates, scale=scaling, cu_seqlens=cu_seqlens)
    return _our_layout(output, batch)


def stick_breaking_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                             attend_current: bool, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Stick-breaking attention as methods/stick_breaking.py defines it, o_i = sum_j A_ij v_j + (1 - sum_j A_ij) v_i:
    query [B, H, T, D], key and value [B, H_kv, T, D], cu_seqlens as in `forgetting_attention`. Returns
    [B, H, T, D] in the value's dtype."""
    from fla.ops.stickbreaking_attn import parallel_stickbreaking_attn

    packed, batch = cu_seqlens is not None, query.shape[0]
    heads, kv_heads = query.shape[1], key.shape[1]
    output, rem = parallel_stickbreaking_attn(_fla_layout(query, packed), _fla_layout(key, packed),
                                              _fla_layout(value, packed), scale=scaling,
                                              attend_current=attend_current, cu_seqlens=cu_seqlens)
    output, rem = _our_layout(output, batch), _our_layout(rem, batch)  # [B, H, T, D], [B, H, T]
    # The left-over stick on the query's own value, its key-value head's for each group of query heads.
    shape = (batch, kv_heads, heads // kv_heads, *output.shape[2:])
    own = (rem.float().view(shape[:-1])[..., None] * value.float()[:, :, None]).view(output.shape)
    return (output.float() + own).to(value.dtype)
