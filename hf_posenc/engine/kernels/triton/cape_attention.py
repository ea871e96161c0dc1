"""CAPE attention in Triton, forward and backward: the Triton port of the fused CPU kernel (cpu_kernels/cape.cpp).

CAPE, context-adaptive positional encoding (Zheng et al., NeurIPS 2024, "DAPE: Data-Adaptive Positional Encoding for
Length Extrapolation"; methods/cape.py has the method and its blocked reference, content_scores). On a causal square
(query i is key i) whose bias depends on the distance alone, with z_ij^h = scale * q_i^h . k_j^h and
B_ij^h = table[h, i - j], an MLP across the heads corrects each pair's logits:

    x_ij = [z_ij^1..H, B_ij^1..H],  a_ij = W1 x_ij + b1,  c_ij = W2 act(a_ij) + b2,
    l_ij^h = z_ij^h + c_ij^h (+ B_ij^h where the bias is added: base="none"),  out_i^h = softmax_j(l_ij^h) v_j^h

act LeakyReLU (its slope below zero) or GELU (erf's). The bias half of W1 sees the distance alone, so its part of a
with b1 is a column of E = W1[:, H:] table + b1 [W, L], computed by torch outside (autograd takes dE back to W1, b1
and the table).

The MLP mixes heads, so one program holds every head of one batch row: a query tile (forward) or a key tile
(backward) of all H heads as [H, rows, keys] tiles (heads padded to 16, tl.dot's smallest size, with zero weights);
the MLP's layers are two products over the tile's pairs ([W, H] x [H, rows * keys] and back). Forward: online softmax
per head, the logsumexp saved. Backward, one program per key tile looping over the query tiles, recomputing each
tile from the logsumexp: dl = P (dO . v - dO_i . o_i), da = (W2^T dl) act'(a), dz = dl + W1[:, :H]^T da;
dk and dv kept by the program, dq added atomically; dW1[:, :H], dW2 and db2 summed over the program's tiles, then one
atomic add each; dE (and the table's own gradient, dl, where the bias is added) summed along each tile's diagonals
(one distance each: skewed with tl.gather and summed by column, as table_attention.py does) before one atomic add per
distance of the tile.

Takes key-value heads matched to the query heads (the wrapper repeats them: GQA through autograd). Reference: the
method's eager blocks (the kernel check) and tests/test_triton_cape.py's formula in float64. This module imports
triton: import it only where a Triton path is chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .table_attention import INTERPRETED, _accumulation, _precision

# 16 x 16 tiles: a tile's hidden layer is [W, 256] values in registers (W = 32 for SmolLM2), which larger tiles would
# spill on a GPU; untuned there. 16 is also tl.dot's smallest size, so the tests' tiny shapes span several tiles.
BLOCK = 16
ACTIVATIONS = ("leaky_relu", "gelu")
SQRT_HALF = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act(a, slope, GELU: tl.constexpr):
    if GELU:
        return 0.5 * a * (1.0 + tl.erf(a * SQRT_HALF))
    else:
        return tl.where(a >= 0, a, a * slope)


@triton.jit
def _act_slope(a, slope, GELU: tl.constexpr):
    """act'(a), as torch's backward takes it (LeakyReLU: the slope at a <= 0)."""
    if GELU:
        return 0.5 * (1.0 + tl.erf(a * SQRT_HALF)) + a * INV_SQRT_2PI * tl.exp(-0.5 * a * a)
    else:
        return tl.where(a > 0, 1.0, slope)


@triton.jit
def _head_tile(X, b, heads, slots, dims, T, D, H: tl.constexpr):
    """Offsets and mask of the [HP, slots, dims] tile of X [B, H, T, D]."""
    offsets = ((b * H + heads[:, None, None]) * T + slots[None, :, None]) * D + dims[None, None, :]
    mask = (heads[:, None, None] < H) & (slots[None, :, None] < T) & (dims[None, None, :] < D)
    return offsets, mask


@triton.jit
def _pairs(q, k, w1, w2, b2, E, TAB, rows, cols, heads, hidden, slope, T, L, scale,
           H: tl.constexpr, W: tl.constexpr, HP: tl.constexpr, WP: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr,
           ACC: tl.constexpr, PREC: tl.constexpr, GELU: tl.constexpr, ADD_BIAS: tl.constexpr):
    """A tile's logits z [HP, BM, BN], the MLP's input z as [HP, BM * BN], its pre-activation a and activation
    [WP, BM * BN], the corrected logits l [HP, BM, BN] and the allowed mask [BM, BN]."""
    z = tl.dot(q, tl.permute(k, (0, 2, 1)), out_dtype=ACC, input_precision=PREC) * scale
    distance = tl.minimum(tl.maximum(rows[:, None] - cols[None, :], 0), L - 1)
    e = tl.load(E + hidden[:, None, None] * L + distance[None, :, :], mask=hidden[:, None, None] < W, other=0.0)
    x = tl.reshape(z, (HP, BM * BN))
    a = tl.dot(w1, x, out_dtype=ACC, input_precision=PREC) + tl.reshape(e.to(ACC), (WP, BM * BN))
    act = _act(a, slope, GELU)
    c = tl.dot(w2, act, out_dtype=ACC, input_precision=PREC)
    logits = z + tl.reshape(c, (HP, BM, BN)) + b2[:, None, None]
    if ADD_BIAS:
        logits += tl.load(TAB + heads[:, None, None] * L + distance[None, :, :], mask=heads[:, None, None] < H,
                          other=0.0).to(ACC)
    allowed = (cols[None, :] <= rows[:, None]) & (cols[None, :] < T) & (rows[:, None] < T)
    return z, x, a, act, logits, allowed


@triton.jit
def _weights(W1, W2, B2, heads, hidden, H: tl.constexpr, W: tl.constexpr):
    """W1[:, :H] [WP, HP], W2 [HP, WP] and b2 [HP], zero where padded."""
    head_ok, hidden_ok = heads < H, hidden < W
    w1 = tl.load(W1 + hidden[:, None] * H + heads[None, :], mask=hidden_ok[:, None] & head_ok[None, :], other=0.0)
    w2 = tl.load(W2 + heads[:, None] * W + hidden[None, :], mask=head_ok[:, None] & hidden_ok[None, :], other=0.0)
    b2 = tl.load(B2 + heads, mask=head_ok, other=0.0)
    return w1, w2, b2


@triton.jit
def _forward(Qp, Kp, Vp, W1, E, W2, B2, TAB, SLOPE, Op, LSE, T, L, scale,
             H: tl.constexpr, W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HP: tl.constexpr,
             WP: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             ACC: tl.constexpr, PREC: tl.constexpr, GELU: tl.constexpr, ADD_BIAS: tl.constexpr):
    m_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*T*D may pass 2^31 elements
    heads = tl.arange(0, HP)
    hidden = tl.arange(0, WP)
    rows = m_block * BM + tl.arange(0, BM)
    dims = tl.arange(0, BD)
    vdims = tl.arange(0, BDV)
    w1, w2, b2 = _weights(W1, W2, B2, heads, hidden, H, W)
    slope = tl.load(SLOPE)
    query_tile, query_ok = _head_tile(Qp, b, heads, rows, dims, T, D, H)
    q = tl.load(Qp + query_tile, mask=query_ok, other=0.0)
    m_i = tl.full([HP, BM], float("-inf"), ACC)
    l_i = tl.zeros([HP, BM], ACC)
    acc = tl.zeros([HP, BM, BDV], ACC)
    end = tl.minimum(T, m_block * BM + BM)
    for n0 in range(0, end, BN):
        cols = n0 + tl.arange(0, BN)
        key_tile, key_ok = _head_tile(Kp, b, heads, cols, dims, T, D, H)
        k = tl.load(Kp + key_tile, mask=key_ok, other=0.0)
        z, x, a, act, logits, allowed = _pairs(q, k, w1, w2, b2, E, TAB, rows, cols, heads, hidden, slope, T, L,
                                               scale, H, W, HP, WP, BM, BN, ACC, PREC, GELU, ADD_BIAS)
        logits = tl.where(allowed[None, :, :], logits, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(logits, 2))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padded row: no key allowed
        p = tl.exp(logits - m_safe[:, :, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 2)
        value_tile, value_ok = _head_tile(Vp, b, heads, cols, vdims, T, DV, H)
        v = tl.load(Vp + value_tile, mask=value_ok, other=0.0)
        # p unrounded (v widened): the output, and with it the backward's dO . o, is then the softmax's own, so
        # each row's dl sums to zero as the output bias's gradient needs (p in half precision made it 1e-3).
        acc = acc * alpha[:, :, None] + tl.dot(p, v.to(ACC), out_dtype=ACC, input_precision=PREC)
        m_i = m_new
    defined = l_i > 0
    out = acc / tl.where(defined, l_i, 1.0)[:, :, None]
    out_tile, out_ok = _head_tile(Op, b, heads, rows, vdims, T, DV, H)
    tl.store(Op + out_tile, out.to(Op.dtype.element_ty), mask=out_ok)
    stat = (b * H + heads[:, None]) * T + rows[None, :]
    tl.store(LSE + stat, tl.where(defined, m_i + tl.log(tl.where(defined, l_i, 1.0)), float("inf")),
             mask=(heads[:, None] < H) & (rows[None, :] < T))


@triton.jit
def _diagonal_sums(values, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WD: tl.constexpr):
    """[R, BM, BN] -> [R, WD]: the sums along the tile's diagonals r - c = d - (BN - 1), d < BM + BN - 1."""
    flat = tl.reshape(values, (R * BM, BN))
    diagonal = tl.arange(0, WD)
    column = (tl.arange(0, R * BM) % BM)[:, None] + (BN - 1) - diagonal[None, :]
    inside = (column >= 0) & (column < BN)
    skewed = tl.gather(flat, tl.minimum(tl.maximum(column, 0), BN - 1), 1)
    return tl.sum(tl.reshape(tl.where(inside, skewed, 0.0), (R, BM, WD)), 1)


@triton.jit
def _backward(Qp, Kp, Vp, W1, E, W2, B2, TAB, DOp, LSE, DELTA, DQp, DKp, DVp, DW1, DE, DW2, DB2, DTAB,
              SLOPE, T, L, scale,
              H: tl.constexpr, W: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HP: tl.constexpr,
              WP: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              WD: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, GELU: tl.constexpr,
              ADD_BIAS: tl.constexpr, TABLE_GRAD: tl.constexpr):
    n_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)  # int64 offsets: B*H*T*D may pass 2^31 elements
    heads = tl.arange(0, HP)
    hidden = tl.arange(0, WP)
    cols = n_block * BN + tl.arange(0, BN)
    dims = tl.arange(0, BD)
    vdims = tl.arange(0, BDV)
    head_ok, hidden_ok = heads < H, hidden < W
    w1, w2, b2 = _weights(W1, W2, B2, heads, hidden, H, W)
    slope = tl.load(SLOPE)
    key_tile, key_ok = _head_tile(Kp, b, heads, cols, dims, T, D, H)
    value_tile, value_ok = _head_tile(Vp, b, heads, cols, vdims, T, DV, H)
    k = tl.load(Kp + key_tile, mask=key_ok, other=0.0)
    v = tl.load(Vp + value_tile, mask=value_ok, other=0.0)
    dk = tl.zeros([HP, BN, BD], ACC)
    dv = tl.zeros([HP, BN, BDV], ACC)
    dw1 = tl.zeros([WP, HP], ACC)
    dw2 = tl.zeros([HP, WP], ACC)
    db2 = tl.zeros([HP], ACC)
    diagonal = tl.arange(0, WD)
    start = (n_block * BN // BM) * BM  # earlier queries see none of these keys
    for m0 in range(start, T, BM):
        rows = m0 + tl.arange(0, BM)
        query_tile, query_ok = _head_tile(Qp, b, heads, rows, dims, T, D, H)
        out_tile, out_ok = _head_tile(DOp, b, heads, rows, vdims, T, DV, H)
        q = tl.load(Qp + query_tile, mask=query_ok, other=0.0)
        do = tl.load(DOp + out_tile, mask=out_ok, other=0.0)
        stat = (b * H + heads[:, None]) * T + rows[None, :]
        stat_ok = head_ok[:, None] & (rows[None, :] < T)
        lse = tl.load(LSE + stat, mask=stat_ok, other=float("inf"))
        delta = tl.load(DELTA + stat, mask=stat_ok, other=0.0)
        z, x, a, act, logits, allowed = _pairs(q, k, w1, w2, b2, E, TAB, rows, cols, heads, hidden, slope, T, L,
                                               scale, H, W, HP, WP, BM, BN, ACC, PREC, GELU, ADD_BIAS)
        p = tl.where(allowed[None, :, :], tl.exp(logits - lse[:, :, None]), 0.0)
        dv += tl.dot(tl.permute(p.to(do.dtype), (0, 2, 1)), do, out_dtype=ACC, input_precision=PREC)
        dp = tl.dot(do, tl.permute(v, (0, 2, 1)), out_dtype=ACC, input_precision=PREC)
        dl = p * (dp - delta[:, :, None])  # [HP, BM, BN], zero where not allowed
        dc = tl.reshape(dl, (HP, BM * BN))
        db2 += tl.sum(dc, 1)
        dw2 += tl.dot(dc, tl.trans(act), out_dtype=ACC, input_precision=PREC)
        da = tl.dot(tl.trans(w2), dc, out_dtype=ACC, input_precision=PREC) * _act_slope(a, slope, GELU)
        dw1 += tl.dot(da, tl.trans(x), out_dtype=ACC, input_precision=PREC)
        dz = dl + tl.reshape(tl.dot(tl.trans(w1), da, out_dtype=ACC, input_precision=PREC), (HP, BM, BN))
        dq = tl.dot(dz.to(k.dtype), k, out_dtype=ACC, input_precision=PREC) * scale
        tl.atomic_add(DQp + query_tile, dq, mask=query_ok)
        dk += tl.dot(tl.permute(dz.to(q.dtype), (0, 2, 1)), q, out_dtype=ACC, input_precision=PREC)
        # Query m0 + r and key n_block * BN + c are at distance m0 - n_block * BN + (r - c): one per diagonal.
        distance = m0 - n_block * BN + diagonal - (BN - 1)
        distance_ok = (distance >= 0) & (distance < L) & (diagonal < BM + BN - 1)
        hidden_sums = _diagonal_sums(tl.reshape(da, (WP, BM, BN)), WP, BM, BN, WD)
        tl.atomic_add(DE + hidden[:, None] * L + distance[None, :], hidden_sums,
                      mask=hidden_ok[:, None] & distance_ok[None, :])
        if TABLE_GRAD:
            head_sums = _diagonal_sums(dl, HP, BM, BN, WD)
            tl.atomic_add(DTAB + heads[:, None] * L + distance[None, :], head_sums,
                          mask=head_ok[:, None] & distance_ok[None, :])
    tl.store(DKp + key_tile, (dk * scale).to(DKp.dtype.element_ty), mask=key_ok)
    tl.store(DVp + value_tile, dv.to(DVp.dtype.element_ty), mask=value_ok)
    tl.atomic_add(DW1 + hidden[:, None] * H + heads[None, :], dw1, mask=hidden_ok[:, None] & head_ok[None, :])
    tl.atomic_add(DW2 + heads[:, None] * W + hidden[None, :], dw2, mask=head_ok[:, None] & hidden_ok[None, :])
    tl.atomic_add(DB2 + heads, db2, mask=head_ok)


def _sizes(heads: int, width: int, dim: int, value_dim: int) -> dict:
    return dict(H=heads, W=width, D=dim, DV=value_dim, HP=max(16, triton.next_power_of_2(heads)),
                WP=max(16, triton.next_power_of_2(width)), BD=max(16, triton.next_power_of_2(dim)),
                BDV=max(16, triton.next_power_of_2(value_dim)), BM=BLOCK, BN=BLOCK)


class TritonCapeAttention(torch.autograd.Function):
    """query, key [B, H, T, D], value [B, H, T, E] (heads matched), content_weight W1[:, :H] [W, H], by_distance E
    [W, L], output_weight [H, W], output_bias [H], table [H, L] (read where `add_bias`), all but the first three in
    the compute dtype: see the module docstring. Returns [B, H, T, E] in the query's dtype."""

    @staticmethod
    def forward(ctx, query, key, value, content_weight, by_distance, output_weight, output_bias, table, scaling,
                add_bias, activation, negative_slope):
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        weights = [t.detach().contiguous() for t in (content_weight, by_distance, output_weight, output_bias, table)]
        batch, heads, length, dim = query.shape
        compute = torch.float64 if query.dtype == torch.float64 else torch.float32
        # In the compute dtype, for the backward's dO . o: rounded to half precision it shifts each row's sum of dl
        # off zero, and the output bias's gradient (zero in exact arithmetic) by 5e-4 of the largest gradient.
        output = torch.empty(batch, heads, length, value.shape[-1], dtype=compute, device=query.device)
        lse = torch.empty(batch, heads, length, dtype=compute, device=query.device)
        options = dict(ACC=_accumulation(query.dtype), PREC=_precision(query.dtype),
                       GELU=activation == "gelu", ADD_BIAS=bool(add_bias),
                       **_sizes(heads, content_weight.shape[0], dim, value.shape[-1]))
        slope = torch.full((1,), negative_slope, dtype=compute, device=query.device)  # exact in float64
        _forward[(triton.cdiv(length, BLOCK), batch)](query, key, value, *weights, slope, output, lse, length,
                                                      by_distance.shape[1], scaling, **options)
        ctx.save_for_backward(query, key, value, *weights, slope, output, lse)
        ctx.options, ctx.scaling = options, scaling
        return output.to(query.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        query, key, value, content_weight, by_distance, output_weight, output_bias, table, slope, output, lse = \
            ctx.saved_tensors
        batch, heads, length, _ = query.shape
        compute = lse.dtype
        grad_output = grad_output.contiguous().to(query.dtype)
        delta = (grad_output.to(compute) * output.to(compute)).sum(-1).contiguous()
        grad_query = torch.zeros(query.shape, dtype=compute, device=query.device)
        grad_key, grad_value = torch.empty_like(key), torch.empty_like(value)
        grads = [torch.zeros_like(t) for t in (content_weight, by_distance, output_weight, output_bias)]
        table_grad = ctx.options["ADD_BIAS"] and ctx.needs_input_grad[7]
        grad_table = torch.zeros_like(table) if table_grad else table  # (unused without TABLE_GRAD)
        _backward[(triton.cdiv(length, BLOCK), batch)](
            query, key, value, content_weight, by_distance, output_weight, output_bias, table, grad_output, lse,
            delta, grad_query, grad_key, grad_value, *grads, grad_table, slope, length, by_distance.shape[1],
            ctx.scaling, WD=triton.next_power_of_2(2 * BLOCK - 1), TABLE_GRAD=table_grad, **ctx.options)
        return (grad_query.to(query.dtype), grad_key, grad_value, *grads, grad_table if table_grad else None,
                None, None, None, None)


def cape_attention(query, key, value, table, input_weight, input_bias, output_weight, output_bias, scaling: float,
                   add_bias: bool, activation: str = "leaky_relu", negative_slope: float = 0.01) -> torch.Tensor:
    """CAPE's causal attention (see the module docstring): query [B, H, T, D], key [B, H_kv, T, D], value
    [B, H_kv, T, E], table [H, L >= T] (the bias at distances 0..L-1), the layer's MLP W1 [W, 2H], b1 [W], W2 [H, W],
    b2 [H]; `add_bias`: base="none". Returns [B, H, T, E] in the query's dtype; gradients reach every tensor."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"CAPE's Triton kernel computes {ACTIVATIONS}, not {activation!r}")
    heads = query.shape[1]
    groups = heads // key.shape[1]
    if groups > 1:  # GQA: each key-value head's gradient is its query heads' sum, by autograd
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32
    input_weight, table = input_weight.to(compute), table.to(compute)
    by_distance = input_weight[:, heads:] @ table + input_bias.to(compute)[:, None]
    return TritonCapeAttention.apply(query, key, value, input_weight[:, :heads], by_distance,
                                     output_weight.to(compute), output_bias.to(compute), table, float(scaling),
                                     bool(add_bias), activation, float(negative_slope))
