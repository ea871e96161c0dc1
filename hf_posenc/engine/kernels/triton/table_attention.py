"""Attention with a per-head distance table, FlashAttention-2 style in Triton (Dao 2023), forward and backward.

    out[b, h, i] = softmax_j(scale * q_i . k_j + table[h, clamp(pos_i - pos_j, 0, n - 1)]) v_j

over the keys j allowed for query i: j <= i + offset (the slot causality of a call after `offset` cached tokens),
valid[b, j] (key padding) and j >= lowest[b, i] (the first key of the query's document: packed documents). The
distance is that of position ids, clamped as the blocked path's table is (a key at a later position than the query,
only with restarts, takes distance 0). Key heads serve groups of query heads (GQA).

Forward: online softmax per query tile, the logsumexp saved. Backward: P recomputed per tile; one kernel per key
tile for dK, dV and the table's gradient (looping over the query heads of its key head, so dK and dV need no
atomics), one per query tile for dQ. The table's gradient of a tile is dS summed along its diagonals (where the
tile's positions are consecutive every diagonal is one distance: the tile is skewed with tl.gather and summed by
column, then one atomic add per distance of the tile); a tile with a restart or gap inside adds per entry.

Reference: engine/attention/table_attention.py (TableBiasAttention, the blocked path's form) and
kernels/check.py's table_attention_reference (the formula in float64), which tests/test_triton_table_attention.py
compares against. This module imports triton: import it only where a Triton path is chosen.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Tiles: 64 x 64 on a GPU (FlashAttention-2's for head sizes <= 128); 16 under the interpreter (its smallest
# tl.dot), so that the tests' tiny shapes still span several tiles.
BLOCK = 16 if INTERPRETED else 64


@triton.jit
def _logits(q, rows, row_ok, qpos, lowest, Kp, Tp, KPOS, VALID, kv_base, b, h, cols, dims,
            KV, N, offset, scale, D: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr):
    """A tile's scaled logits plus bias, the allowed mask and the keys [BN, BD]."""
    col_ok = cols < KV
    k = tl.load(Kp + (kv_base + cols[:, None]) * D + dims[None, :], mask=col_ok[:, None] & (dims[None, :] < D),
                other=0.0)
    s = tl.dot(q, tl.trans(k), out_dtype=ACC, input_precision=PREC) * scale
    kpos = tl.load(KPOS + b * KV + cols, mask=col_ok, other=0)
    valid = tl.load(VALID + b * KV + cols, mask=col_ok, other=0) != 0
    distance = tl.minimum(tl.maximum(qpos[:, None] - kpos[None, :], 0), N - 1)
    s += tl.load(Tp + h * N + distance).to(ACC)
    allowed = ((cols[None, :] <= rows[:, None] + offset) & (cols[None, :] >= lowest[:, None])
               & valid[None, :] & col_ok[None, :] & row_ok[:, None])
    return s, allowed, k, kpos


@triton.jit
def _query_tile(Qp, LOW, H, HK, Q, KV, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr):
    """What a query-tile program (the forward's, dQ's; CoPE's too) starts from: its ids, the offsets of its [BM, BD]
    tile, the queries and their first allowed keys. Offsets in int64: B*H*T*D may pass 2^31 elements."""
    m_block = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    kv_base = (b * HK + h // (H // HK)) * KV
    rows = m_block * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    row_ok = rows < Q
    tile = (bh * Q + rows[:, None]) * D + dims[None, :]
    tile_ok = row_ok[:, None] & (dims[None, :] < D)
    q = tl.load(Qp + tile, mask=tile_ok, other=0.0)
    lowest = tl.load(LOW + b * Q + rows, mask=row_ok, other=KV)
    return m_block, bh, b, h, kv_base, rows, dims, row_ok, tile, tile_ok, q, lowest


@triton.jit
def _online_softmax_step(m_i, l_i, acc, s, v, ACC: tl.constexpr, PREC: tl.constexpr):
    """One key tile of FlashAttention-2's forward (s: the tile's logits, -inf where not allowed; v: its values):
    each row's running maximum m_i, sum of exponentials l_i and unnormalised output acc, updated."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key allowed yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=ACC, input_precision=PREC)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _online_softmax_result(m_i, l_i, acc):
    """(output, logsumexp) of the rows after their last key tile; a row with no allowed key (a padding query) gives
    0 and a logsumexp of +inf, so that it gets no gradient."""
    defined = l_i > 0
    out = acc / tl.where(defined, l_i, 1.0)[:, None]
    return out, tl.where(defined, m_i + tl.log(tl.where(defined, l_i, 1.0)), float("inf"))


@triton.jit
def _forward(Qp, Kp, Vp, Tp, QPOS, KPOS, VALID, LOW, Op, LSE, H, HK, Q, KV, N, offset, scale,
             D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             ACC: tl.constexpr, PREC: tl.constexpr):
    m_block, bh, b, h, kv_base, rows, dims, row_ok, tile, tile_ok, q, lowest = _query_tile(
        Qp, LOW, H, HK, Q, KV, D, BD, BM)
    qpos = tl.load(QPOS + b * Q + rows, mask=row_ok, other=0)
    m_i = tl.full([BM], float("-inf"), ACC)
    l_i = tl.zeros([BM], ACC)
    acc = tl.zeros([BM, BD], ACC)
    start = (tl.min(lowest) // BN) * BN  # keys before every row's document are skipped
    end = tl.minimum(KV, offset + m_block * BM + BM)
    for n0 in range(start, end, BN):
        cols = n0 + tl.arange(0, BN)
        s, allowed, k, kpos = _logits(q, rows, row_ok, qpos, lowest, Kp, Tp, KPOS, VALID, kv_base, b, h, cols,
                                      dims, KV, N, offset, scale, D, ACC, PREC)
        v = tl.load(Vp + (kv_base + cols[:, None]) * D + dims[None, :],
                    mask=(cols[:, None] < KV) & (dims[None, :] < D), other=0.0)
        m_i, l_i, acc = _online_softmax_step(m_i, l_i, acc, tl.where(allowed, s, float("-inf")), v, ACC, PREC)
    out, lse = _online_softmax_result(m_i, l_i, acc)
    tl.store(Op + tile, out.to(Op.dtype.element_ty), mask=tile_ok)
    tl.store(LSE + bh * Q + rows, lse, mask=row_ok)


@triton.jit
def _backward_query(Qp, Kp, Vp, Tp, QPOS, KPOS, VALID, LOW, DOp, LSE, DELTA, DQp, H, HK, Q, KV, N, offset, scale,
                    D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    ACC: tl.constexpr, PREC: tl.constexpr):
    m_block, bh, b, h, kv_base, rows, dims, row_ok, tile, tile_ok, q, lowest = _query_tile(
        Qp, LOW, H, HK, Q, KV, D, BD, BM)
    qpos = tl.load(QPOS + b * Q + rows, mask=row_ok, other=0)
    do = tl.load(DOp + tile, mask=tile_ok, other=0.0)
    lse = tl.load(LSE + bh * Q + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(DELTA + bh * Q + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BM, BD], ACC)
    start = (tl.min(lowest) // BN) * BN
    end = tl.minimum(KV, offset + m_block * BM + BM)
    for n0 in range(start, end, BN):
        cols = n0 + tl.arange(0, BN)
        s, allowed, k, kpos = _logits(q, rows, row_ok, qpos, lowest, Kp, Tp, KPOS, VALID, kv_base, b, h, cols,
                                      dims, KV, N, offset, scale, D, ACC, PREC)
        p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
        v = tl.load(Vp + (kv_base + cols[:, None]) * D + dims[None, :],
                    mask=(cols[:, None] < KV) & (dims[None, :] < D), other=0.0)
        dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, out_dtype=ACC, input_precision=PREC)
    tl.store(DQp + tile, (dq * scale).to(DQp.dtype.element_ty), mask=tile_ok)


@triton.jit
def _backward_key(Qp, Kp, Vp, Tp, QPOS, KPOS, VALID, LOW, DOp, LSE, DELTA, DKp, DVp, DTp, H, HK, Q, KV, N, offset,
                  scale, D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, W: tl.constexpr,
                  ACC: tl.constexpr, PREC: tl.constexpr, TABLE_GRAD: tl.constexpr):
    n_block = tl.program_id(0)
    bhk = tl.program_id(1).to(tl.int64)  # int64 offsets, as in _query_tile
    b = bhk // HK
    hk = bhk % HK
    groups = H // HK
    kv_base = bhk * KV
    cols = n_block * BN + tl.arange(0, BN)
    dims = tl.arange(0, BD)
    col_ok = cols < KV
    key_tile = (kv_base + cols[:, None]) * D + dims[None, :]
    key_ok = col_ok[:, None] & (dims[None, :] < D)
    v = tl.load(Vp + key_tile, mask=key_ok, other=0.0)
    dk = tl.zeros([BN, BD], ACC)
    dv = tl.zeros([BN, BD], ACC)
    start = (tl.maximum(n_block * BN - offset, 0) // BM) * BM  # earlier queries see none of these keys
    diagonal = tl.arange(0, W)  # r - c + BN - 1 of a tile's entry (r, c)
    for g in range(0, groups):
        h = hk * groups + g
        bh = b * H + h
        for m0 in range(start, Q, BM):
            rows = m0 + tl.arange(0, BM)
            row_ok = rows < Q
            tile = (bh * Q + rows[:, None]) * D + dims[None, :]
            tile_ok = row_ok[:, None] & (dims[None, :] < D)
            q = tl.load(Qp + tile, mask=tile_ok, other=0.0)
            do = tl.load(DOp + tile, mask=tile_ok, other=0.0)
            qpos = tl.load(QPOS + b * Q + rows, mask=row_ok, other=0)
            lowest = tl.load(LOW + b * Q + rows, mask=row_ok, other=KV)
            lse = tl.load(LSE + bh * Q + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(DELTA + bh * Q + rows, mask=row_ok, other=0.0)
            s, allowed, k, kpos = _logits(q, rows, row_ok, qpos, lowest, Kp, Tp, KPOS, VALID, kv_base, b, h, cols,
                                          dims, KV, N, offset, scale, D, ACC, PREC)
            p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, out_dtype=ACC, input_precision=PREC)
            dp = tl.dot(do, tl.trans(v), out_dtype=ACC, input_precision=PREC)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, out_dtype=ACC, input_precision=PREC)
            if TABLE_GRAD:
                # pos_i - pos_j = e + (i - j) with e = (pos_i - i) - (pos_j - j): one e over the allowed entries
                # means each diagonal of the tile is one distance.
                e = (qpos - rows)[:, None] - (kpos - cols)[None, :]
                e_high = tl.max(tl.where(allowed, e, -(1 << 30)))
                e_low = tl.min(tl.where(allowed, e, 1 << 30))
                if e_high == e_low:
                    column = tl.arange(0, BM)[:, None] + (BN - 1) - diagonal[None, :]
                    inside = (column >= 0) & (column < BN)
                    skewed = tl.gather(ds, tl.minimum(tl.maximum(column, 0), BN - 1), 1)
                    sums = tl.sum(tl.where(inside, skewed, 0.0), 0)
                    distance = e_high + m0 - n_block * BN + diagonal - (BN - 1)
                    tl.atomic_add(DTp + h * N + tl.minimum(tl.maximum(distance, 0), N - 1), sums,
                                  mask=diagonal < BM + BN - 1)
                elif e_high > e_low:
                    distance = tl.minimum(tl.maximum(qpos[:, None] - kpos[None, :], 0), N - 1)
                    tl.atomic_add(DTp + h * N + distance, ds, mask=allowed)
    tl.store(DKp + key_tile, (dk * scale).to(DKp.dtype.element_ty), mask=key_ok)
    tl.store(DVp + key_tile, dv.to(DVp.dtype.element_ty), mask=key_ok)


def _accumulation(dtype: torch.dtype):
    return tl.float64 if dtype == torch.float64 else tl.float32


def _precision(dtype: torch.dtype) -> str:
    """tl.dot's precision: TF32 for float32 on a GPU unless torch asks for full float32 matmuls."""
    if dtype == torch.float32 and not INTERPRETED and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


class TritonTableAttention(torch.autograd.Function):
    """query [B, H, q, D], key/value [B, H_kv, kv, D], table [H, n], query_positions [B, q], key_positions [B, kv]
    (int32), valid [B, kv] (int8), lowest [B, q] (int32): see the module docstring. Returns [B, H, q, D]."""

    @staticmethod
    def forward(ctx, query, key, value, table, query_positions, key_positions, valid, lowest, offset, scaling):
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        table_c = table.detach().to(compute).contiguous()
        batch, heads, q, dim = query.shape
        key_heads, kv = key.shape[1], key.shape[2]
        output = torch.empty_like(query)
        lse = torch.empty(batch, heads, q, dtype=compute, device=query.device)
        grid = (triton.cdiv(q, BLOCK), batch * heads)
        _forward[grid](query, key, value, table_c, query_positions, key_positions, valid, lowest, output, lse,
                       heads, key_heads, q, kv, table_c.shape[1], offset, scaling, D=dim,
                       BD=max(16, triton.next_power_of_2(dim)), BM=BLOCK, BN=BLOCK, ACC=_accumulation(query.dtype),
                       PREC=_precision(query.dtype))
        ctx.save_for_backward(query, key, value, table_c, query_positions, key_positions, valid, lowest, output, lse)
        ctx.offset, ctx.scaling, ctx.table_dtype = offset, scaling, table.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, table, query_positions, key_positions, valid, lowest, output, lse = ctx.saved_tensors
        batch, heads, q, dim = query.shape
        key_heads, kv = key.shape[1], key.shape[2]
        compute = lse.dtype
        grad_output = grad_output.contiguous().to(query.dtype)
        delta = (grad_output.to(compute) * output.to(compute)).sum(-1)
        grad_query = torch.empty_like(query)
        grad_key, grad_value = torch.empty_like(key), torch.empty_like(value)
        table_grad = ctx.needs_input_grad[3]
        grad_table = torch.zeros_like(table) if table_grad else table  # (unused without TABLE_GRAD)
        shared = dict(D=dim, BD=max(16, triton.next_power_of_2(dim)), BM=BLOCK, BN=BLOCK,
                      ACC=_accumulation(query.dtype), PREC=_precision(query.dtype))
        common = (query, key, value, table, query_positions, key_positions, valid, lowest, grad_output, lse, delta)
        sizes = (heads, key_heads, q, kv, table.shape[1], ctx.offset, ctx.scaling)
        _backward_query[(triton.cdiv(q, BLOCK), batch * heads)](*common, grad_query, *sizes, **shared)
        _backward_key[(triton.cdiv(kv, BLOCK), batch * key_heads)](
            *common, grad_key, grad_value, grad_table, *sizes, W=triton.next_power_of_2(2 * BLOCK - 1),
            TABLE_GRAD=table_grad, **shared)
        return (grad_query, grad_key, grad_value, grad_table.to(ctx.table_dtype) if table_grad else None,
                None, None, None, None, None, None)


def table_attention(query, key, value, table, query_positions, key_positions, valid=None, lowest=None,
                    offset: int = 0, scaling: float | None = None) -> torch.Tensor:
    """The kernel's output [B, H, q, D]: query_positions [B or 1, q], key_positions [B or 1, kv] (ints), valid
    [B, kv] bool or None (every key), lowest [B, q] the first key slot each query may see or None (0)."""
    batch, _, q, dim = query.shape
    kv = key.shape[2]
    device = query.device
    query_positions = query_positions.to(device=device, dtype=torch.int32).expand(batch, q).contiguous()
    key_positions = key_positions.to(device=device, dtype=torch.int32).expand(batch, kv).contiguous()
    valid = (torch.ones(batch, kv, dtype=torch.int8, device=device) if valid is None
             else valid.to(device=device, dtype=torch.int8).expand(batch, kv).contiguous())
    lowest = (torch.zeros(batch, q, dtype=torch.int32, device=device) if lowest is None
              else lowest.to(device=device, dtype=torch.int32).expand(batch, q).contiguous())
    return TritonTableAttention.apply(query, key, value, table, query_positions, key_positions, valid, lowest,
                                      int(offset), dim**-0.5 if scaling is None else float(scaling))
