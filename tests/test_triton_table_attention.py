"""The Triton distance-table kernel (engine/kernels/triton/table_attention.py) against the formula in float64, through
Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 where torch sees no GPU): the output and
the gradients w.r.t. queries, keys, values and the table, in float64, float32 and float16; causal with a cache
before the queries, GQA, left padding and packed documents (position restarts)."""

import pytest
import torch

pytest.importorskip("triton")

from hf_posenc.engine.kernels.triton.table_attention import table_attention  # noqa: E402


def reference(query, key, value, table, query_positions, key_positions, valid, lowest, offset, scaling):
    """softmax(scale q k^T + table[h, clamp(pos_i - pos_j)]) v over the allowed keys, in float64; rows with no
    allowed key give 0."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    q, kv = query.shape[2], key.shape[2]
    rows, cols = torch.arange(q)[:, None], torch.arange(kv)[None]
    distance = (query_positions[:, :, None] - key_positions[:, None, :]).clamp(0, table.shape[1] - 1)
    allowed = (cols <= rows + offset)[None] & valid[:, None, :] & (cols[None] >= lowest[:, :, None])
    bias = table.double()[:, distance].transpose(0, 1)  # [B, H, q, kv]
    scores = (query.double() @ key.transpose(2, 3)) * scaling + bias
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1))
    return weights @ value


def problem(dtype, batch=2, heads=4, key_heads=2, q=40, offset=0, dim=24, padding=(0, 0), restarts=(), seed=0):
    generator = torch.Generator().manual_seed(seed)
    kv = offset + q
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    query, key, value = make(batch, heads, q, dim), make(batch, key_heads, kv, dim), make(batch, key_heads, kv, dim)
    table = make(heads, kv + 3)
    positions = torch.arange(kv).repeat(batch, 1)
    valid = torch.ones(batch, kv, dtype=torch.bool)
    lowest = torch.zeros(batch, q, dtype=torch.long)
    for row, pad in enumerate(padding):
        valid[row, :pad] = False
        positions[row] = (torch.arange(kv) - pad).clamp_min(1)  # padding's positions as a tokenizer's mask gives
    for start in restarts:  # a new document from slot `start`: positions restart, earlier keys are masked
        positions[:, start:] -= positions[:, start:start + 1].clone()
        lowest[:, max(0, start - offset):] = start
    tensors = [t.to(dtype) for t in (query, key, value)] + [table.to(dtype if dtype == torch.float64 else
                                                                    torch.float32)]
    return tensors, dict(query_positions=positions[:, offset:], key_positions=positions, valid=valid, lowest=lowest,
                         offset=offset, scaling=dim**-0.5)


TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2}
CASES = {"causal": {}, "cache": dict(offset=17), "left padding": dict(padding=(0, 9)),
         "packed": dict(restarts=(13, 29)), "mha, cache, padding": dict(key_heads=4, offset=5, padding=(3, 0))}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_kernel_and_gradients_match_the_formula(dtype, case, device):
    tensors, fixed = problem(dtype, **CASES[case])
    defined = (fixed["valid"][:, None, :] & (torch.arange(fixed["key_positions"].shape[1])[None, None]
               <= torch.arange(tensors[0].shape[2])[None, :, None] + fixed["offset"])).any(-1)  # [B, q]
    weight = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    results = []
    for function, cast, where in ((table_attention, lambda t: t, device), (reference, lambda t: t.double(), "cpu")):
        leaves = [cast(t.detach()).to(where).requires_grad_(True) for t in tensors]
        output = function(*leaves, **{k: v.to(where) if torch.is_tensor(v) else v for k, v in fixed.items()})
        grads = torch.autograd.grad((output.double() * weight.to(where)).sum(), leaves)
        results.append((output.double().cpu(), [g.double().cpu() for g in grads]))
    (got, got_grads), (want, want_grads) = results
    keep = defined[:, None, :, None].expand_as(got)
    assert torch.isfinite(got).all()
    error = ((got - want)[keep].abs().max() / want[keep].abs().max()).item()
    assert error < TOLERANCE[dtype], f"output: {error:.3g}"
    for name, g, w in zip(("query", "key", "value", "table"), got_grads, want_grads):
        error = ((g - w).abs().max() / w.abs().max()).item()
        assert error < 2 * TOLERANCE[dtype], f"gradient w.r.t. {name}: {error:.3g}"
