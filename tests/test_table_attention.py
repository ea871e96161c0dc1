"""The backward of learned distance-table biases (hf_posenc/engine/attention/table_attention.py): gradients of queries, keys,
values and the table against autograd of the materialised computation in float64, and the blocked path using it
(and only it) when a table takes a gradient."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hf_posenc
from hf_posenc import attention
from hf_posenc.engine.attention import bias_path, table_attention
from hf_posenc.engine.attention.table_attention import TableBiasAttention, skewed_view
from helpers import max_diff
from tiny_models import random_ids, tiny_model


def test_skewed_buffer_column_sums_are_the_diagonal_sums():
    """What the backward sums into the table's gradient: a block written through skewed_view into a zeroed buffer
    has, as the buffer's column sums, the block's anti-diagonal sums (r + c = n)."""
    block = torch.randn(3, 5, 7, dtype=torch.float64)
    expected = torch.zeros(3, 11, dtype=torch.float64)
    for r in range(5):
        for c in range(7):
            expected[:, r + c] += block[:, r, c]
    buffer = torch.zeros(3, 5, 7 + 5, dtype=torch.float64)
    skewed_view(buffer, 7).copy_(block)
    assert torch.allclose(buffer.sum(1)[:, :11], expected)


def served(args) -> bool:
    """Whether a TableBiasAttention.apply call serves a model's attention (its plan argument the model's dict of
    measured plans), not the timing that fills that dict (which forces each candidate plan)."""
    return isinstance(args[6], dict)


def materialised(query, key, value, table, offset, scaling):
    """Attention with bias table[i - j] over slots (queries at offset..offset+q-1, keys at 0..kv-1), causal, all
    materialised in float64; keys in their natural order."""
    q, kv = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    distance = (torch.arange(q, device=query.device)[:, None] + offset) - torch.arange(kv, device=query.device)
    bias = table[:, distance.clamp(0, table.shape[1] - 1)]
    bias = bias.masked_fill(distance < 0, float("-inf"))
    scores = query @ key.transpose(2, 3) * scaling + bias
    return scores.softmax(-1) @ value


@pytest.mark.parametrize("batch,heads,kv_heads,q,offset,step", [
    (1, 2, 2, 9, 0, 4),     # prefill, blocks of 4 rows
    (2, 4, 2, 7, 5, 3),     # a chunk after a cache of 5, grouped-query attention
    (1, 2, 1, 12, 0, 256),  # one block
])
@pytest.mark.parametrize("logsumexp", [True, False], ids=["lse from the kernel (CPU)", "lse computed (other devices)"])
@pytest.mark.parametrize("key_tile", [3, 256], ids=["key tiles of 3", "one key tile"])
@pytest.mark.parametrize("layout", table_attention.LAYOUTS)
def test_gradients_equal_materialised_autograd(batch, heads, kv_heads, q, offset, step, logsumexp, key_tile, layout,
                                               monkeypatch, device):
    """Each plan the machine may pick (tile size, dS layout), forced, against autograd in float64."""
    if logsumexp and device.type != "cpu":
        pytest.skip("only aten's CPU flash kernel returns the logsumexp the forward keeps")
    monkeypatch.setattr(table_attention, "keeps_logsumexp", lambda device: logsumexp)
    monkeypatch.setattr(table_attention, "KEY_TILE", key_tile)  # 3: several tiles per block, and remainders
    generator = torch.Generator().manual_seed(0)
    kv, dim, scaling = offset + q, 8, 0.3

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(device).requires_grad_()

    query, key, value = rand(batch, heads, q, dim), rand(batch, kv_heads, kv, dim), rand(batch, kv_heads, kv, dim)
    table = rand(heads, kv)
    grad_out = torch.randn(batch, heads, q, dim, generator=generator, dtype=torch.float64).to(device)

    expected = materialised(query, key, value, table, offset, scaling)
    expected_grads = torch.autograd.grad(expected, (query, key, value, table), grad_out)

    padded = attention.padded_table(table, step, torch.float64)
    blocks = [(rows.start, rows.stop - rows.start, min(kv, offset + rows.stop),
               step + offset + rows.start - min(kv, offset + rows.stop) + 1)
              for rows in attention.query_blocks(torch.arange(q, device=device)[None], step)]
    plan = table_attention.BackwardPlan(key_tile, layout)
    output = TableBiasAttention.apply(query, key.flip(2), value.flip(2), padded, blocks, scaling, plan)
    grads = torch.autograd.grad(output, (query, key, value, table), grad_out)

    assert torch.allclose(output, expected, atol=1e-10)
    for name, got, want in zip(("query", "key", "value", "table"), grads, expected_grads):
        assert torch.allclose(got, want, atol=1e-10), name


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2"])  # BLOOM's attention is eager: no table path
@pytest.mark.parametrize("method,options", [("t5", {}), ("kerple", {}), ("fire", {}), ("alibi", {"trainable": True})])
def test_training_step_gradients_equal_the_eager_path(model_type, method, options, monkeypatch, device):
    """A patched tiny model's loss gradients (every parameter, the positional ones included) equal those of the eager
    backend, which materialises each block's softmax and leaves the gradient to autograd; and the custom backward
    served the attention calls."""
    ids = random_ids(2, 30).to(device)  # within the tiny GPT-2 window, where FIRE has a distance table

    def gradients(backend):
        model = tiny_model(model_type).double().to(device)
        for module in model.modules():  # GPT-2's dropouts: a step must be deterministic to compare
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        hf_posenc.patch_model(model, method, **options)
        model.set_attn_implementation(backend)
        model.train()
        model(ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    calls = []
    original = TableBiasAttention.apply
    monkeypatch.setattr(table_attention.TableBiasAttention, "apply",
                        staticmethod(lambda *args: served(args) and calls.append(1) or original(*args)))
    monkeypatch.setattr(bias_path, "VIEW_BLOCK_ROWS", 16)  # several blocks over 30 tokens
    monkeypatch.setattr(table_attention, "KEY_TILE", 8)  # and several key tiles per block in the backward
    fast = gradients("sdpa")
    assert calls, "the table backward did not serve the training step"
    calls.clear()
    reference = gradients("eager")
    assert not calls
    positional = [name for name in fast if "posenc" in name]
    assert positional, "no positional parameter got a gradient"
    assert fast.keys() == reference.keys()
    for name in fast:  # the eager backend's softmax runs in float32 even for a float64 model: hence 1e-6
        assert max_diff(fast[name], reference[name]) < 1e-6 * max(1.0, reference[name].abs().max().item()), name


def test_not_used_without_gradient(monkeypatch):
    calls = []
    monkeypatch.setattr(table_attention.TableBiasAttention, "apply",
                        staticmethod(lambda *args: calls.append(1)))
    ids = random_ids(1, 20)
    for method in ("t5", "alibi"):
        model = hf_posenc.patch_model(tiny_model("llama"), method)
        with torch.no_grad():
            model(ids)
    assert not calls


@pytest.mark.parametrize("method,frozen", [("sandwich", False), ("alibi", False), ("t5", True)])
def test_fixed_tables_take_the_table_backward(method, frozen, monkeypatch):
    """A fixed table in training goes through TableBiasAttention too: off the CPU SDPA keeps an aligned copy of each
    block's mask for the backward (O(L^2) per layer: Sandwich at 3.3x native's peak on an H200), on the CPU its
    backward multiplies the subnormal probabilities of far keys (fixed ALiBi 2.4x native on an Intel Xeon, issue
    56). A learned table frozen (T5, as under LoRA) is a fixed one. Gradients equal SDPA's with the mask under
    autograd (the path without the table backward), in float64, and the table, which takes no gradient, gets
    none."""
    ids = random_ids(2, 30)

    def gradients():
        model = hf_posenc.patch_model(tiny_model("llama").double(), method).train()
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(not (frozen and "posenc" in name))
        model(ids, labels=ids).loss.backward()
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(bias_path, "VIEW_BLOCK_ROWS", 16)
    monkeypatch.setattr(table_attention, "KEY_TILE", 8)
    calls = []
    original = TableBiasAttention.apply
    monkeypatch.setattr(table_attention.TableBiasAttention, "apply",
                        staticmethod(lambda *args: served(args) and calls.append(args[3].requires_grad)
                                     or original(*args)))
    fast = gradients()
    assert calls and not any(calls), "the table backward did not serve the fixed table"
    calls.clear()
    with monkeypatch.context() as patched:
        patched.setattr(bias_path, "needs_grad", lambda *args: False)  # SDPA per block, autograd's backward
        reference = gradients()
    assert not calls
    assert fast.keys() == reference.keys() and not any("posenc" in name for name in fast)
    for name in fast:
        assert max_diff(fast[name], reference[name]) < 1e-10 * max(1.0, reference[name].abs().max().item()), name


def test_key_tiles_are_for_the_cpu_cache_and_a_gpu_takes_a_block_in_one_tile():
    """On an H200 the 256-key tiles made each block's backward dozens of small launches (blocked fwd+bwd of a learned
    table 12-16x causal SDPA at 8192 tokens); a block, already sized to the accelerator budget, is one tile there."""
    assert table_attention.key_tile(torch.device("cpu")) == table_attention.KEY_TILE
    assert table_attention.key_tile(torch.device("cuda")) >= 1 << 20


def test_the_backward_multiplies_no_subnormal_number():
    """On an Intel core every multiply-add with a subnormal operand is a microcode assist (a product with a subnormal
    triangle took 75x its time on a Xeon, issue 56): the masked keys and a steep ALiBi-like fall put probabilities
    under float32's smallest normal number, and dS = P * (dP - delta) under it. No matrix product of the backward
    reads one."""
    heads, length, dim, step = 2, 64, 8, 16
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, heads, length, dim, generator=generator).requires_grad_() for _ in range(3))
    table = (-2.0 * torch.arange(length, dtype=torch.float32)).expand(heads, -1).clone().requires_grad_()
    blocks = [(rows.start, rows.stop - rows.start, rows.stop, step + rows.start - rows.stop + 1)
              for rows in attention.query_blocks(torch.arange(length)[None], step)]
    aten = torch.ops.aten
    products = {aten.bmm, aten.baddbmm, aten.baddbmm_, aten.mm, aten.addmm, aten.addmm_}
    subnormal = []

    class Products(TorchDispatchMode):  # sees the aten products autograd's backward runs
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in products:
                for operand in args:
                    if isinstance(operand, torch.Tensor) and operand.is_floating_point():
                        magnitude = operand.detach().abs()
                        subnormal.append(int(((magnitude > 0) & (magnitude < torch.finfo(operand.dtype).tiny))
                                             .sum()))
            return func(*args, **(kwargs or {}))

    for layout in table_attention.LAYOUTS:
        padded = attention.padded_table(table, step, torch.float32)
        output = TableBiasAttention.apply(query, key.flip(2), value.flip(2), padded, blocks, dim**-0.5,
                                          table_attention.BackwardPlan(16, layout))
        with Products():
            output.backward(torch.randn(output.shape, generator=generator))
    assert subnormal and sum(subnormal) == 0, f"{sum(subnormal)} subnormal operands"


def test_a_plan_is_measured_once_per_kind_and_kept_on_the_model(monkeypatch):
    """The machine's choice (tile size, layout) is timed at a model's first training call, among candidate_plans,
    kept on that model's state (no process-wide cache: another model measures its own), listed by tuned_choices,
    and not measured again."""
    measured = []
    original = table_attention.measure_plan
    monkeypatch.setattr(table_attention, "measure_plan",
                        lambda *args, **kwargs: measured.append(args) or original(*args, **kwargs))
    monkeypatch.setattr(table_attention, "KEY_TILE", 8)
    monkeypatch.setattr(bias_path, "VIEW_BLOCK_ROWS", 16)
    ids = random_ids(1, 30)
    model = hf_posenc.patch_model(tiny_model("llama"), "t5").train()
    for _ in range(2):
        model(ids, labels=ids).loss.backward()
    assert len(measured) == 1  # every layer and step: one kind of call
    choices = attention.tuned_choices(model)
    assert len(choices) == 1
    (kind, picked), = choices.items()
    assert kind.startswith("table backward, cpu, float32")
    assert picked in {plan.describe() for plan in table_attention.candidate_plans()}
    other = hf_posenc.patch_model(tiny_model("llama"), "t5").train()
    assert attention.tuned_choices(other) == {} and attention.tuned_choices(tiny_model("llama")) == {}
    other(ids, labels=ids).loss.backward()
    assert len(measured) == 2
    short = hf_posenc.patch_model(tiny_model("llama"), "t5").train()  # 4 keys: one tile of every candidate
    short(ids[:, :4], labels=ids[:, :4]).loss.backward()
    assert len(measured) == 2 and attention.tuned_choices(short) == {}


def test_measure_plan_picks_the_fastest_candidate(monkeypatch):
    """The pick is the candidate of least time: a candidate made slow (a sleep in its backward) is not picked."""
    slow, fast = table_attention.BackwardPlan(4, "skewed"), table_attention.BackwardPlan(4, "contiguous")
    original = TableBiasAttention.backward

    def backward(ctx, grad_output):
        if ctx.plan == slow:
            time.sleep(0.02)
        return original(ctx, grad_output)

    monkeypatch.setattr(TableBiasAttention, "backward", staticmethod(backward))
    assert table_attention.measure_plan([slow, fast], torch.float32, 2, 8) == fast
    assert table_attention.measure_plan([fast, slow], torch.float32, 2, 8) == fast
    # within the margin, the first (the default) stays
    assert table_attention.measure_plan([fast, fast], torch.float32, 2, 8) == fast
    assert table_attention.candidate_plans()[0] == table_attention.default_plan(torch.device("cpu"))


def fused_case(dtype, batch=2, heads=4, kv_heads=2, length=40, step=16, tile=8, steep=True):
    """Inputs of a backward with several blocks and tiles (remainders, masked keys, a head whose steep fall drops
    whole tiles): query, key, value, table, grad_output, blocks, the table's padding (the block rows), plan's tile."""
    generator = torch.Generator().manual_seed(1)
    dim = 8

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype)

    query, key, value = rand(batch, heads, length, dim), rand(batch, kv_heads, length, dim), rand(batch, kv_heads,
                                                                                                 length, dim)
    table = 0.5 * rand(heads, length)
    if steep:
        table[-1] = -4.0 * torch.arange(length, dtype=dtype)
    blocks = [(rows.start, rows.stop - rows.start, rows.stop, step + rows.start - rows.stop + 1)
              for rows in attention.query_blocks(torch.arange(length)[None], step)]
    return query, key, value, table, rand(batch, heads, length, dim), blocks, step, tile


def backward_grads(case, layout, table_grad=True):
    query, key, value, table, grad_out, blocks, step, tile = case
    inputs = [tensor.clone().requires_grad_() for tensor in (query, key, value)]
    table = table.clone().requires_grad_(table_grad)
    padded = attention.padded_table(table, step, table.dtype)
    output = TableBiasAttention.apply(inputs[0], inputs[1].flip(2), inputs[2].flip(2), padded, blocks, 8**-0.5,
                                      table_attention.BackwardPlan(tile, layout))
    wanted = (*inputs, table) if table_grad else inputs
    return torch.autograd.grad(output, wanted, grad_out)


@pytest.mark.parametrize("dtype,allowed", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("shape", [{}, {"batch": 1, "heads": 2, "kv_heads": 2, "length": 7, "step": 4, "tile": 3},
                                   {"batch": 3, "heads": 2, "kv_heads": 1, "length": 33, "step": 256, "tile": 256}],
                         ids=["GQA, batch 2, blocks and tiles", "tiles of 3", "one block, one tile"])
@pytest.mark.parametrize("table_grad", [True, False], ids=["learned table", "fixed table"])
def test_the_fused_tiles_equal_the_torch_op_tiles(dtype, allowed, shape, table_grad):
    """The fused kernel's gradients of queries, keys, values and table against the torch-op tiles' (each gradient's
    largest error relative to its largest value), and in float64 against autograd of the materialised computation;
    a fixed table gets no gradient, and the others are unchanged."""
    case = fused_case(dtype, **shape)
    fused, reference = backward_grads(case, "fused", table_grad), backward_grads(case, "skewed", table_grad)
    assert len(fused) == len(reference) == (4 if table_grad else 3)
    for name, got, want in zip(("query", "key", "value", "table"), fused, reference):
        assert max_diff(got, want) <= allowed * want.abs().max().item(), name
    assert any(verdict.kernel == table_attention.FUSED_KERNEL and verdict.passed
               for verdict in attention.kernel_status())
    if dtype == torch.float64:
        query, key, value, table, grad_out = case[:5]
        inputs = [tensor.clone().requires_grad_(index < 3 or table_grad)
                  for index, tensor in enumerate((query, key, value, table))]
        expected = materialised(*inputs, 0, 8**-0.5)
        for name, got, want in zip(("query", "key", "value", "table"), fused,
                                   torch.autograd.grad(expected, inputs[:len(fused)], grad_out)):
            assert torch.allclose(got, want, atol=1e-10), name


def test_the_fused_kernel_drops_what_the_torch_ops_drop():
    """The probability pass (clamp, exp, threshold in one loop) keeps no probability at most SMALLEST_PROBABILITY,
    so dS = P * dP' holds no subnormal number from it (test_the_backward_multiplies_no_subnormal_number for the torch
    ops), and keeps the same probabilities as the torch ops."""
    from hf_posenc.engine.kernels import fused_cpu

    fused_cpu.load()
    logits = torch.linspace(-120.0, 10.0, 100_003)
    got = torch.ops.hf_posenc_cpu.table_probabilities(logits)
    floor = math.log(table_attention.SMALLEST_PROBABILITY) - 1
    want = torch.threshold(logits.clamp_min(floor).exp(), table_attention.SMALLEST_PROBABILITY, 0.0)
    assert not ((got > 0) & (got <= table_attention.SMALLEST_PROBABILITY)).any()
    assert torch.equal(got > 0, want > 0) and max_diff(got, want) <= 1e-6 * want.max().item()


def test_the_torch_op_tiles_serve_where_the_kernels_are_off(monkeypatch):
    """HF_POSENC_CPU_KERNELS=0: the default plan is the torch ops', a forced fused plan runs them (nothing built or
    checked), and the gradients are the same."""
    case = fused_case(torch.float64)
    expected = backward_grads(case, "skewed")
    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "0")
    attention.reset_kernel_status()
    assert table_attention.default_plan(torch.device("cpu")).layout == "skewed"
    assert all(plan.layout != "fused" for plan in table_attention.candidate_plans())
    calls = []
    monkeypatch.setattr(table_attention, "fused_tiles", lambda *args: calls.append(1))
    got = backward_grads(case, "fused")
    assert not calls and attention.kernel_status() == []
    for name, a, b in zip(("query", "key", "value", "table"), got, expected):
        assert max_diff(a, b) < 1e-12 * b.abs().max().item(), name


def test_a_fused_kernel_that_fails_its_check_never_serves(monkeypatch):
    """A fused kernel whose gradients are wrong (or whose build fails) is refused at its first backward, with one
    KernelCheckWarning, and the torch ops serve that backward and the later ones."""
    case = fused_case(torch.float32)
    expected = backward_grads(case, "skewed")
    original = table_attention.fused_tiles
    monkeypatch.setattr(table_attention, "fused_tiles",
                        lambda *args: tuple(None if grad is None else 1.01 * grad for grad in original(*args)))
    attention.reset_kernel_status()
    try:
        with pytest.warns(attention.KernelCheckWarning, match="fused cpu \\(table backward\\)"):
            first = backward_grads(case, "fused")
        second = backward_grads(case, "fused")
        assert [verdict.passed for verdict in attention.kernel_status()] == [False]
    finally:
        attention.reset_kernel_status()
    for got in (first, second):
        for name, a, b in zip(("query", "key", "value", "table"), got, expected):
            assert max_diff(a, b) == 0, name
