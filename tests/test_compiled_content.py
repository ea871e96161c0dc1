"""The "compiled" attention path (engine/attention/compiled_content.py `compiled_content_call`): a content method's per-block chain
(its logits or weights, the softmax, the values) under torch.compile, served only after the kernel check
(engine/kernels/check.py) compared it with the eager blocks on this machine, forward and gradients, the method's
parameters' gradients included. Each test compiles for real on the CPU running it (tens of seconds per method)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_posenc
from hf_posenc.tools.finetune import enable_gradient_checkpointing
from hf_posenc import attention as engine
from hf_posenc.engine.attention import compiled_content, content_path, geometry
from helpers import left_pad, max_diff
from tiny_models import random_ids, tiny_model

LAYERS = 2  # the tiny LLaMA's


@pytest.fixture
def several_blocks(monkeypatch):
    """Blocks of a few query rows at these lengths, so that the compiled path runs more than one block per call."""
    monkeypatch.setattr(content_path, "CONTENT_BLOCK_BYTES", 4 * 2 * 4 * 48 * 16 * 6)
    monkeypatch.setattr(geometry, "ACCELERATOR_BLOCK_BYTES", 4 * 2 * 4 * 48 * 16 * 6)  # the eager blocks off the CPU
    monkeypatch.setattr(content_path, "COMPILED_BLOCK_BYTES", 4 * 2 * 4 * 48 * 16)
    engine.reset_kernel_status()
    yield
    engine.reset_kernel_status()


def patched(method: str, device: torch.device | str = "cpu"):
    model = tiny_model("llama")
    hf_posenc.patch_model(model, method)
    return model.to(device).train()


def outputs_and_gradients(model, ids, mask, path: str):
    model.zero_grad()
    with engine.attention_path(path):
        logits = model(ids, attention_mask=mask).logits
        (logits.float().square() * mask[..., None]).mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / max(b.abs().max().item(), 1e-12)


def padded_batch():
    return left_pad([random_ids(1, 45, seed=3)[0], random_ids(1, 30, seed=4)[0]])


@pytest.mark.parametrize("method", ["cope", "stick-breaking"])
def test_compiled_blocks_train_like_the_eager_blocks(method, several_blocks, device):
    model = patched(method, device)
    ids, mask = (x.to(device) for x in padded_batch())
    want_logits, want_grads = outputs_and_gradients(model, ids, mask, "blocked")
    engine.last_paths.clear()
    got_logits, got_grads = outputs_and_gradients(model, ids, mask, "compiled")

    assert engine.last_paths["compiled content"] == LAYERS == engine.last_paths["content"]
    verdicts = engine.kernel_status()
    assert {v.kind[0] == "gradients" for v in verdicts} == {True, False} and all(v.passed for v in verdicts)
    real = mask.bool()
    assert max_diff(got_logits[real], want_logits[real]) < 1e-5
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        assert relative(got_grads[name], grad) < 1e-4, name
    if method == "cope":  # the learned position embeddings get their gradient through the compiled blocks too
        assert want_grads["model.posenc.position_embeddings"].abs().max() > 0


def test_compiled_blocks_under_gradient_checkpointing(several_blocks):
    model = patched("stick-breaking")
    ids, mask = padded_batch()
    want_logits, want_grads = outputs_and_gradients(model, ids, mask, "blocked")
    enable_gradient_checkpointing(model)
    engine.last_paths.clear()
    got_logits, got_grads = outputs_and_gradients(model, ids, mask, "compiled")
    assert engine.last_paths["compiled content"] >= LAYERS
    assert all(v.passed for v in engine.kernel_status())
    for name, grad in want_grads.items():
        assert relative(got_grads[name], grad) < 1e-4, name


def test_compiled_blocks_decode_like_a_full_forward(several_blocks):
    model = patched("cope").eval()
    ids = random_ids(1, 40)
    with torch.no_grad(), engine.attention_path("blocked"):
        want = model(ids).logits
    with torch.no_grad(), engine.attention_path("compiled"):
        full = model(ids).logits
        cache = model(ids[:, :36], use_cache=True).past_key_values
        steps = []
        for index in range(36, 40):
            out = model(ids[:, index:index + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    assert engine.last_paths["compiled content"] > 0
    assert max_diff(full, want) < 1e-5
    assert max_diff(torch.cat(steps, dim=1), want[:, 36:]) < 1e-5


def wrong_in_forward(method, query, key, value, block):
    return engine.content_block_output(method, query, key, value, block) * 1.5


def wrong_in_parameter_gradients(method, query, key, value, block):
    """The right output, but a gradient 1000 times too large for the method's position embeddings alone: only the
    probe's comparison of the parameters' gradients can see it."""
    embeddings = method.position_embeddings
    wrong_gradient = ((embeddings - embeddings.detach()) * 1e3).sum()
    return engine.content_block_output(method, query, key, value, block) + wrong_gradient


@pytest.mark.parametrize("kernel, what", [(wrong_in_forward, "relative to the largest reference value"),
                                          (wrong_in_parameter_gradients, "gradients w.r.t. position_embeddings")])
def test_a_compiled_block_that_disagrees_is_refused(kernel, what, several_blocks, monkeypatch):
    monkeypatch.setattr(compiled_content, "_compiled_block_output", kernel)  # in place of the compiled chain
    model = patched("cope")
    with torch.no_grad():  # moved off zero, so that the embeddings change the logits and get gradients
        model.model.posenc.position_embeddings.normal_(std=0.1)
    ids, mask = padded_batch()
    want_logits, want_grads = outputs_and_gradients(model, ids, mask, "blocked")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.last_paths.clear()
        got_logits, got_grads = outputs_and_gradients(model, ids, mask, "compiled")
    refusals = [w for w in caught if issubclass(w.category, engine.KernelCheckWarning)]
    assert len(refusals) == 1 and "compiled content" in str(refusals[0].message)
    assert what in str(refusals[0].message)
    assert engine.last_paths["compiled content"] == 0  # the eager blocks served every call, the checking one too
    assert max_diff(got_logits, want_logits) == 0
    assert all(torch.equal(got_grads[name], grad) for name, grad in want_grads.items())
