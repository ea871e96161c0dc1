"""The backward of learned distance-table biases (hf_posenc/engine/attention/table_attention.py): gradients of queries, keys,
values and the table against autograd of the materialised computation in float64, and the blocked path using it
(and only it) when a table takes a gradient."""

from __future__ import annotations

import pytest
import torch

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
def test_gradients_equal_materialised_autograd(batch, heads, kv_heads, q, offset, step, logsumexp, key_tile,
                                               monkeypatch, device):
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
    output = TableBiasAttention.apply(query, key.flip(2), value.flip(2), padded, blocks, scaling)
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


def test_not_used_without_gradient_or_for_fixed_biases(monkeypatch):
    calls = []
    monkeypatch.setattr(table_attention.TableBiasAttention, "apply",
                        staticmethod(lambda *args: calls.append(1)))
    ids = random_ids(1, 20)
    trained = hf_posenc.patch_model(tiny_model("llama"), "t5")
    with torch.no_grad():
        trained(ids)
    fixed = hf_posenc.patch_model(tiny_model("llama"), "alibi").train()
    fixed(ids, labels=ids).loss.backward()
    assert not calls


@pytest.mark.parametrize("method,frozen", [("sandwich", False), ("alibi", False), ("t5", True)])
def test_fixed_tables_take_the_table_backward_where_sdpa_would_keep_block_masks(method, frozen, monkeypatch):
    """Off the CPU, SDPA keeps an aligned copy of each block's mask for the backward (O(L^2) per layer: Sandwich at
    3.3x native's peak on an H200), so there a fixed table goes through TableBiasAttention too: the device test is
    forced here on the CPU. A learned table frozen (T5, as under LoRA) is a fixed one. Gradients equal the default
    path's (SDPA with the mask, autograd), in float64, and the table, which takes no gradient, gets none."""
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
    reference = gradients()
    assert not calls  # on the CPU SDPA keeps the mask's view: the default path
    monkeypatch.setattr(bias_path, "sdpa_keeps_block_masks", lambda device: True)
    fast = gradients()
    assert calls and not any(calls), "the table backward did not serve the fixed table"
    assert fast.keys() == reference.keys() and not any("posenc" in name for name in fast)
    for name in fast:
        assert max_diff(fast[name], reference[name]) < 1e-10 * max(1.0, reference[name].abs().max().item()), name


def test_key_tiles_are_for_the_cpu_cache_and_a_gpu_takes_a_block_in_one_tile():
    """On an H200 the 256-key tiles made each block's backward dozens of small launches (blocked fwd+bwd of a learned
    table 12-16x causal SDPA at 8192 tokens); a block, already sized to the accelerator budget, is one tile there."""
    assert table_attention.key_tile(torch.device("cpu")) == table_attention.KEY_TILE
    assert table_attention.key_tile(torch.device("cuda")) >= 1 << 20
