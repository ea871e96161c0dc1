"""Fused CPU kernels (engine/fused_cpu.py, engine/cpu_kernels/*.cpp): stick-breaking's forward and backward of a
causal square against autograd of the paper's chain (the blocked path's StickBreakingWeights) in float64, across
tile edges and thread splits; float32 within rounding of float64 at a length where the backward's suffix sums cancel;
in a model, served under "auto" after the kernel check and training like the blocked path; never where the call is
not a causal square; a build that fails is a refusal (one warning, the blocked path serves). The kernel is compiled
for real on the machine running the tests (about 20 s once; torch's extension cache keeps it)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_posenc
from hf_posenc import attention as engine
from hf_posenc.engine import fused_cpu
from hf_posenc.methods.stick_breaking import StickBreakingWeights
from helpers import left_pad, max_diff
from tiny_models import random_ids, tiny_model


@pytest.fixture
def fresh_checks():
    engine.reset_kernel_status()
    yield
    engine.reset_kernel_status()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def chain(query, key, value, scaling, attend_current):
    """The blocked path's weights on the whole [L, L] square (StickBreakingWeights, checked against autograd of the
    paper's chain in test_content_methods.py), applied to the values."""
    length = query.shape[-2]
    position = torch.arange(length)
    own = position[None, :] == position[:, None]
    breaks = position[None, :] <= position[:, None] if attend_current else position[None, :] < position[:, None]
    weights = StickBreakingWeights.apply(torch.matmul(query, key.transpose(-1, -2)) * scaling, breaks, own)
    return torch.matmul(weights, value)


def outputs_and_gradients(function, inputs, upstream, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    output = function(*leaves)
    output.backward(upstream.to(dtype))
    return [output] + [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("attend_current", [False, True])
@pytest.mark.parametrize("thread_count", [1, 2])  # 2 threads, 3 heads: each head's query tiles in two runs
def test_stick_breaking_kernel_equals_the_chain_in_float64(attend_current, thread_count, monkeypatch, threads):
    """Tiles of 8 rows and 16 keys over 37 tokens (partial tiles at both ends, rows whose keys start mid-tile), value
    width unlike the heads': output and the gradients of queries, keys and values equal autograd of the chain to
    float64 rounding."""
    monkeypatch.setattr(fused_cpu, "TILE_ROWS", 8)
    monkeypatch.setattr(fused_cpu, "TILE_KEYS", 16)
    threads(thread_count)
    generator = torch.Generator().manual_seed(3)
    query, key = (2 * torch.randn(2, 3, 37, 16, dtype=torch.float64, generator=generator) for _ in range(2))
    value = torch.randn(2, 3, 37, 5, dtype=torch.float64, generator=generator)
    upstream = torch.randn(2, 3, 37, 5, dtype=torch.float64, generator=generator)
    fused = outputs_and_gradients(lambda q, k, v: fused_cpu.stick_breaking_causal(q, k, v, 0.3, attend_current),
                                  (query, key, value), upstream, torch.float64)
    reference = outputs_and_gradients(lambda q, k, v: chain(q, k, v, 0.3, attend_current), (query, key, value),
                                      upstream, torch.float64)
    for ours, theirs in zip(fused, reference):
        assert max_diff(ours, theirs) <= 1e-12 * theirs.abs().max()


def test_stick_breaking_kernel_in_float32_is_float64_within_rounding():
    """At 1500 tokens with the default tiles, float32 against the kernel's own float64: the backward's suffix sums
    cancel far left of the diagonal, which without their float64 sums and bound left dQ about 1e-4 off at 4096."""
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, 2, 1500, 32, dtype=torch.float64, generator=generator) for _ in range(3)]
    upstream = torch.randn(1, 2, 1500, 32, dtype=torch.float64, generator=generator)

    def kernel(q, k, v):
        return fused_cpu.stick_breaking_causal(q, k, v, 32 ** -0.5, False)

    single = outputs_and_gradients(kernel, inputs, upstream, torch.float32)
    double = outputs_and_gradients(kernel, inputs, upstream, torch.float64)
    for ours, theirs in zip(single, double):
        assert ours.dtype == torch.float32
        assert max_diff(ours, theirs) <= 1e-5 * theirs.abs().max()


def train_step(model, ids, attention_mask=None):
    model.zero_grad()
    logits = model(ids, attention_mask=attention_mask).logits
    logits.sin().sum().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
@pytest.mark.parametrize("options", [{}, {"attend_current": True, "base": "native"}])
def test_a_model_trains_on_the_fused_kernel_as_on_the_blocks(model_type, options, fresh_checks):
    """Under "auto" a full batch's layers are served by the fused kernel once it passed its check (forward and
    gradients), and the logits and every parameter's gradient equal the blocked path's; a left-padded batch is not a
    causal square, so the blocks serve it."""
    model = hf_posenc.patch_model(tiny_model(model_type), "stick-breaking", **options)
    layers = model.config.num_hidden_layers
    ids = random_ids(2, 24)  # within tiny GPT-2's learned positions
    engine.last_paths.clear()
    fused = train_step(model, ids)
    assert engine.last_paths["fused content"] == layers
    verdicts = [v for v in engine.kernel_status() if v.kernel == "fused cpu (stick-breaking)"]
    assert [v.passed for v in verdicts] == [True, True] and verdicts[1].kind[0] == "gradients"
    with engine.attention_path("blocked"):
        engine.last_paths.clear()
        blocked = train_step(model, ids)
        assert engine.last_paths["fused content"] == 0 and engine.last_paths["content recomputed"] == layers
    assert len(fused) == len(blocked) > 2
    for ours, theirs in zip(fused, blocked):
        assert max_diff(ours, theirs) <= 1e-5 * max(1.0, theirs.abs().max())
    padded, mask = left_pad([random_ids(1, 12, seed=3)[0], random_ids(1, 7, seed=4)[0]])
    engine.last_paths.clear()
    train_step(model, padded, mask)
    assert engine.last_paths["fused content"] == 0 and engine.last_paths["content recomputed"] == layers


def test_a_failed_build_is_a_refusal_and_the_blocks_serve(monkeypatch, fresh_checks):
    """No compiler (or no ninja) on the machine: the build raises inside the kernel check, which warns once, and the
    blocked path serves that call and the ones after, with the blocked path's numbers."""
    model = hf_posenc.patch_model(tiny_model("llama"), "stick-breaking")
    ids = random_ids(1, 24)
    with torch.no_grad(), engine.attention_path("blocked"):
        expected = model(ids).logits

    def no_compiler():
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(fused_cpu, "load", no_compiler)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        engine.last_paths.clear()
        first, second = model(ids).logits, model(ids).logits
    refusals = [w for w in caught if issubclass(w.category, engine.KernelCheckWarning)]
    assert len(refusals) == 1 and "c++: command not found" in str(refusals[0].message)
    assert engine.last_paths["fused content"] == 0
    assert max_diff(first, expected) == 0 and max_diff(second, expected) == 0


def test_the_environment_turns_the_fused_kernels_off(monkeypatch, fresh_checks):
    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "0")
    model = hf_posenc.patch_model(tiny_model("llama"), "stick-breaking")
    engine.last_paths.clear()
    with torch.no_grad():
        model(random_ids(1, 24))
    assert engine.last_paths["fused content"] == 0 and engine.kernel_status() == []
