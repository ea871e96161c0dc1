"""CoPE attention in Triton, forward and backward: Contextual Position Encoding (Golovneva, Wang, Weston, Sukhbaatar
2024, "Contextual Position Encoding: Learning to Count What's Important"), the tiling of the fused CPU kernel
(cpu_kernels/cope.cpp) in FlashAttention-2's form (Dao 2023; table_attention.py's conventions).

With z_ij = scaling * q_i . k_j over the keys j allowed for query i (causal, within its document), gates
g_ij = sigmoid(z_ij), positions p_ij = min(sum_{k=j..i} g_ik, max_pos) and the integers' scalars I_i[n] = q_i . e[n]
(e [D, max_pos + 1], the layer's position embeddings), R_i[n] = I_i[n+1] - I_i[n] (R_i[max_pos] = 0):

    l_ij = z_ij + I_i[f] + w R_i[f],   f = floor p_ij, w = p_ij - f,   out_i = softmax_j(l_ij) v_j

Forward, one program per query tile: I and R of its rows (two [rows, max_pos + 1] products), key tiles from the
diagonal leftwards, each row carrying the running sum of its gates (the positions, a suffix sum within the tile) and
the online softmax. Saved: each row's logsumexp, its last clamped key b_i (its position reached max_pos; every key
left of it is clamped too) and its window's sum of gates W_i = sum_{b_i<k<=i} g_ik. Backward, one program per query
tile, key tiles from the left, so that the reverse cumulative sum's adjoint dg_ij = sum_{k<=j} dp_ik is a running
sum carried from the left: positions p_ij = W_i - sum_{b_i<k<j} g_ik in the window, l = z + I[max_pos] left of it.
The positions are summed in float64 both ways, as the CPU kernel's are: the backward's must equal the forward's far
below float32's rounding, or P no longer sums to 1 against the saved logsumexp (in float32 they differ by about 1e-6
of max_pos, which made the float32 gradients' error 5x a plain float32 computation's: 1.3e-5 against 2.7e-6 on 64
tokens).
dl = P (dO . v - dO_i . o_i); dI[f] += (1 - w) dl, dI[f + 1] += w dl; dp = dl R[f] (0 where clamped);
dz = dl + dg g (1 - g). dQ is the program's own; dK and dV of a tile are reduced over its rows (tl.dot) before one
atomic add per tile (query heads of a key head, and query tiles, add into the same keys). dI [B, H, T, max_pos + 1]
(float32; float64 for float64) is each row's own, added to by entry in the window (atomics: entries of one row share
floors) and once per row for the clamped keys; dQ += dI e^T and de = sum over rows of q^T dI are then two matmuls.

Causal prefill only (query i is key i); GQA (key-value heads serving groups of query heads); packed documents as
cu_seqlens of the rows laid end to end (each row starting a document, as engine/attention/triton_content.py gives
them): each query sees the keys of its own document up to itself, and gates outside it count 0, as in the blocked
reference (methods/cope.py ContextualScores). This module imports triton: import it only where a Triton path is
chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .table_attention import (INTERPRETED, _accumulation, _online_softmax_result, _online_softmax_step,
                              _precision, _query_tile)

# Tiles: 64 x 64 on a GPU (FlashAttention-2's for head sizes <= 128); 16 under the interpreter (its smallest tl.dot),
# so that the tests' tiny shapes still span several tiles.
BLOCK = 16 if INTERPRETED else 64


@triton.jit
def _integers(q, Ep, RISEp, dims, slots, D: tl.constexpr, P, ACC: tl.constexpr, PREC: tl.constexpr):
    """A tile's I = q e and R = q (e[:, 1:] - e[:, :-1], 0): [BM, BP] each."""
    where = dims[:, None] * P + slots[None, :]
    inside = (dims[:, None] < D) & (slots[None, :] < P)
    e = tl.load(Ep + where, mask=inside, other=0.0)
    rise = tl.load(RISEp + where, mask=inside, other=0.0)
    q = q.to(ACC)
    return (tl.dot(q, e, out_dtype=ACC, input_precision=PREC),
            tl.dot(q, rise, out_dtype=ACC, input_precision=PREC))


@triton.jit
def _scores(q, rows, row_ok, lowest, Kp, kv_base, cols, dims, T, scale, D: tl.constexpr, ACC: tl.constexpr,
            PREC: tl.constexpr):
    """A tile's content logits z, the allowed mask, the gates (0 where not allowed) and the keys [BN, BD]."""
    col_ok = cols < T
    k = tl.load(Kp + (kv_base + cols[:, None]) * D + dims[None, :], mask=col_ok[:, None] & (dims[None, :] < D),
                other=0.0)
    z = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=PREC) * scale
    allowed = ((cols[None, :] <= rows[:, None]) & (cols[None, :] >= lowest[:, None]) & row_ok[:, None]
               & col_ok[None, :])
    gates = tl.where(allowed, 1.0 / (1.0 + tl.exp(-z)), 0.0)
    return z, allowed, gates, k


@triton.jit
def _forward(Qp, Kp, Vp, Ep, RISEp, LOW, Op, LSE, LASTp, WINp, H, HK, T, P, scale, max_pos,
             D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BP: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    m_block, bh, b, h, kv_base, rows, dims, row_ok, tile, tile_ok, q, lowest = _query_tile(
        Qp, LOW, H, HK, T, T, D, BD, BM)
    vdims = tl.arange(0, BDV)
    slots = tl.arange(0, BP)
    integer, rise = _integers(q, Ep, RISEp, dims, slots, D, P, ACC, PREC)
    m_i = tl.full([BM], float("-inf"), ACC)
    l_i = tl.zeros([BM], ACC)
    acc = tl.zeros([BM, BDV], ACC)
    carry = tl.zeros([BM], tl.float64)  # the gates of the keys right of the tile
    window = tl.zeros([BM], tl.float64)  # the gates of the keys not clamped
    last_clamped = lowest - 1
    first_tile = tl.min(lowest) // BN  # keys before every row's document are skipped
    last_tile = (tl.minimum(T, m_block * BM + BM) - 1) // BN
    for t in range(0, last_tile - first_tile + 1):
        cols = (last_tile - t) * BN + tl.arange(0, BN)
        z, allowed, gates, k = _scores(q, rows, row_ok, lowest, Kp, kv_base, cols, dims, T, scale, D, ACC, PREC)
        gates = gates.to(tl.float64)  # the positions in float64: see the module docstring
        position = carry[:, None] + tl.cumsum(gates, axis=1, reverse=True)
        clamped = allowed & (position >= max_pos)
        last_clamped = tl.maximum(last_clamped, tl.max(tl.where(clamped, cols[None, :], -1), 1))
        window += tl.sum(tl.where(clamped, 0.0, gates), 1)
        carry += tl.sum(gates, 1)
        position = tl.minimum(position, max_pos).to(ACC)
        floor = tl.minimum(position.to(tl.int32), P - 1)  # p >= 0: truncation is the floor
        s = z + tl.gather(integer, floor, 1) + (position - floor.to(ACC)) * tl.gather(rise, floor, 1)
        v = tl.load(Vp + (kv_base + cols[:, None]) * DV + vdims[None, :],
                    mask=(cols[:, None] < T) & (vdims[None, :] < DV), other=0.0)
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, tl.where(allowed, s, float("-inf")), v, ACC, PREC)
    out, lse = _online_softmax_result(m_i, l_i, acc)
    tl.store(Op + (bh * T + rows[:, None]) * DV + vdims[None, :], out.to(Op.dtype.element_ty),
             mask=row_ok[:, None] & (vdims[None, :] < DV))
    tl.store(LSE + bh * T + rows, lse, mask=row_ok)
    tl.store(LASTp + bh * T + rows, last_clamped, mask=row_ok)
    tl.store(WINp + bh * T + rows, window, mask=row_ok)


@triton.jit
def _backward(Qp, Kp, Vp, Ep, RISEp, LOW, DOp, LSE, DELTA, LASTp, WINp, DQp, DKp, DVp, DIp, H, HK, T, P, scale,
              max_pos, D: tl.constexpr, DV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BP: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    m_block, bh, b, h, kv_base, rows, dims, row_ok, tile, tile_ok, q, lowest = _query_tile(
        Qp, LOW, H, HK, T, T, D, BD, BM)
    vdims = tl.arange(0, BDV)
    slots = tl.arange(0, BP)
    do = tl.load(DOp + (bh * T + rows[:, None]) * DV + vdims[None, :],
                 mask=row_ok[:, None] & (vdims[None, :] < DV), other=0.0)
    lse = tl.load(LSE + bh * T + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)
    last_clamped = tl.load(LASTp + bh * T + rows, mask=row_ok, other=-1)
    whole = tl.load(WINp + bh * T + rows, mask=row_ok, other=0.0)
    integer, rise = _integers(q, Ep, RISEp, dims, slots, D, P, ACC, PREC)
    row_slots = (bh * T + rows) * P
    dq = tl.zeros([BM, BD], ACC)
    before = tl.zeros([BM], tl.float64)  # the window's gates left of the tile
    carry_grad = tl.zeros([BM], ACC)  # dp summed over the keys left of the tile
    to_last = tl.zeros([BM], ACC)  # the clamped keys' share of dI[max_pos]
    first_tile = tl.min(lowest) // BN
    end = tl.minimum(T, m_block * BM + BM)
    for n0 in range(first_tile * BN, end, BN):
        cols = n0 + tl.arange(0, BN)
        col_ok = cols < T
        z, allowed, gates, k = _scores(q, rows, row_ok, lowest, Kp, kv_base, cols, dims, T, scale, D, ACC, PREC)
        clamped = allowed & (cols[None, :] <= last_clamped[:, None])
        inside = allowed & (cols[None, :] > last_clamped[:, None])  # the window
        gates = tl.where(inside, gates, 0.0)
        wide = gates.to(tl.float64)
        position = whole[:, None] - before[:, None] - (tl.cumsum(wide, axis=1) - wide)
        before += tl.sum(wide, 1)
        position = tl.minimum(tl.maximum(position, 0.0), max_pos).to(ACC)
        floor = tl.where(inside, tl.minimum(position.to(tl.int32), P - 1), P - 1)
        weight = tl.where(inside, position - floor.to(ACC), 0.0)
        rise_at = tl.gather(rise, floor, 1)
        s = z + tl.gather(integer, floor, 1) + weight * rise_at
        p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
        key_tile = (kv_base + cols[:, None]) * DV + vdims[None, :]
        key_ok = col_ok[:, None] & (vdims[None, :] < DV)
        v = tl.load(Vp + key_tile, mask=key_ok, other=0.0)
        tl.atomic_add(DVp + key_tile, tl.dot(tl.trans(p.to(do.dtype)), do, out_dtype=ACC, input_precision=PREC),
                      mask=key_ok)
        dl = p * (tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC) - delta[:, None])
        to_last += tl.sum(tl.where(clamped, dl, 0.0), 1)
        share = dl * weight
        tl.atomic_add(DIp + row_slots[:, None] + floor, dl - share, mask=inside)
        tl.atomic_add(DIp + row_slots[:, None] + floor + 1, share, mask=inside & (floor + 1 < P))
        dpos = tl.where(inside, dl * rise_at, 0.0)
        dg = carry_grad[:, None] + tl.cumsum(dpos, axis=1)
        carry_grad += tl.sum(dpos, 1)
        dz = dl + dg * gates * (1.0 - gates)  # gates are 0 outside the window
        dq += tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=PREC)
        key_dims = (kv_base + cols[:, None]) * D + dims[None, :]
        tl.atomic_add(DKp + key_dims, tl.dot(tl.trans(dz.to(q.dtype)), q, out_dtype=ACC, input_precision=PREC)
                      * scale, mask=col_ok[:, None] & (dims[None, :] < D))
    tl.atomic_add(DIp + row_slots + P - 1, to_last, mask=row_ok)
    tl.store(DQp + tile, dq * scale, mask=tile_ok)


def _rises(embeddings: torch.Tensor) -> torch.Tensor:
    """e[:, n + 1] - e[:, n], 0 for the last: R = q . rises (the interpolation's slope)."""
    return torch.nn.functional.pad(embeddings.diff(dim=-1), (0, 1)).contiguous()


class TritonCope(torch.autograd.Function):
    """query [B, H, T, D], key [B, H_kv, T, D], value [B, H_kv, T, E], embeddings [D, max_pos + 1], lowest [B, T]
    (int32, each query's first key: its document's) -> [B, H, T, E]: see the module docstring."""

    @staticmethod
    def forward(ctx, query, key, value, embeddings, lowest, scaling, max_pos):
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        table = embeddings.detach().to(compute).contiguous()
        rises = _rises(table)
        batch, heads, length, dim = query.shape
        key_heads, value_dim, positions = key.shape[1], value.shape[-1], table.shape[1]
        output = torch.empty(batch, heads, length, value_dim, dtype=value.dtype, device=query.device)
        lse = torch.empty(batch, heads, length, dtype=compute, device=query.device)
        last_clamped = torch.empty(batch, heads, length, dtype=torch.int32, device=query.device)
        window = torch.empty(batch, heads, length, dtype=torch.float64, device=query.device)
        _forward[(triton.cdiv(length, BLOCK), batch * heads)](
            query, key, value, table, rises, lowest, output, lse, last_clamped, window, heads, key_heads, length,
            positions, scaling, max_pos, **_sizes(query, value, positions))
        ctx.save_for_backward(query, key, value, table, rises, lowest, output, lse, last_clamped, window)
        ctx.scaling, ctx.max_pos, ctx.embeddings_dtype = scaling, max_pos, embeddings.dtype
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        query, key, value, table, rises, lowest, output, lse, last_clamped, window = ctx.saved_tensors
        batch, heads, length, dim = query.shape
        key_heads, positions = key.shape[1], table.shape[1]
        compute = lse.dtype
        grad_output = grad_output.contiguous().to(value.dtype)
        delta = (grad_output.to(compute) * output.to(compute)).sum(-1)
        grad_query = torch.empty(query.shape, dtype=compute, device=query.device)
        grad_key = torch.zeros(key.shape, dtype=compute, device=query.device)
        grad_value = torch.zeros(value.shape, dtype=compute, device=query.device)
        grad_integer = torch.zeros(batch, heads, length, positions, dtype=compute, device=query.device)
        _backward[(triton.cdiv(length, BLOCK), batch * heads)](
            query, key, value, table, rises, lowest, grad_output, lse, delta, last_clamped, window, grad_query,
            grad_key, grad_value, grad_integer, heads, key_heads, length, positions, ctx.scaling, ctx.max_pos,
            **_sizes(query, value, positions))
        grad_query += grad_integer @ table.T
        grad_embeddings = torch.einsum("bhtd,bhtn->dn", query.to(compute), grad_integer)
        return (grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype),
                grad_embeddings.to(ctx.embeddings_dtype), None, None, None)


def _sizes(query: torch.Tensor, value: torch.Tensor, positions: int) -> dict:
    dim, value_dim = query.shape[-1], value.shape[-1]
    return dict(D=dim, DV=value_dim, BD=max(16, triton.next_power_of_2(dim)),
                BDV=max(16, triton.next_power_of_2(value_dim)), BP=max(16, triton.next_power_of_2(positions)),
                BM=BLOCK, BN=BLOCK, ACC=_accumulation(query.dtype), PREC=_precision(query.dtype))


def document_lowest(cu_seqlens: torch.Tensor | None, batch: int, length: int, device: torch.device) -> torch.Tensor:
    """Each query's first key [B, T] (int32): 0, or its document's first slot in its row where `cu_seqlens` gives
    the documents of the B rows laid end to end (each row starting one)."""
    if cu_seqlens is None:
        return torch.zeros(batch, length, dtype=torch.int32, device=device)
    flat = torch.arange(batch * length, device=device)
    starts = cu_seqlens.to(device=device, dtype=torch.int64)
    first = starts[torch.searchsorted(starts, flat, right=True) - 1]
    return (first - flat // length * length).clamp_min(0).view(batch, length).to(torch.int32)


def cope_attention(query, key, value, embeddings, scaling: float, max_pos: float,
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """CoPE's causal attention: query [B, H, T, D], key [B, H_kv, T, D], value [B, H_kv, T, E], the layer's
    embeddings [D, max_pos + 1], cu_seqlens the documents of the rows laid end to end (None: each row is one).
    Returns [B, H, T, E] in the value's dtype, computed in float32 (float64 for float64 inputs)."""
    batch, _, length, _ = query.shape
    lowest = document_lowest(cu_seqlens, batch, length, query.device)
    return TritonCope.apply(query, key, value, embeddings, lowest, float(scaling), float(max_pos))
