"""FoX and stick-breaking on the "triton" path by fla-core's kernels (engine/kernels/triton/fla_content.py,
engine/attention/triton_content.py), checked on the CPU through Triton's interpreter in processes of their own
(fla_interpreter.py says why and how): the kernels' outputs and gradients (queries, keys, values, and FoX's gate
parameters through its log forget gates) against float64 references written from the formulas, one row per
sequence and packed documents, GQA; a tiny patched LLaMA trains under attention_path("triton") as under "blocked",
packed documents included, while a cached decoding step and a left-padded batch fall back to the blocked path. And
here, in the test process itself: where Triton cannot run, or for a call fla does not take, the kernel is never
tried."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config

import hf_posenc
from hf_posenc import attention as engine
from hf_posenc.engine.attention import triton_content
from hf_posenc.engine.kernels import by_method
from helpers import max_diff
from tiny_models import SPECIAL_TOKENS, VOCAB, random_ids, tiny_model

TESTS = Path(__file__).parent

# float32: fla accumulates in float32 like the blocked path; the observed errors are 1e-7..2e-6 of the largest value.
# float16: the inputs and outputs rounded to float16 (2^-11 = 4.9e-4): observed 1e-4..7e-4.
OP_TOLERANCE = {"float32": 1e-5, "float16": 2e-3}
# "triton" against "blocked" in float32: two float32 computations of the same sums (observed <= 2e-6).
MODEL_TOLERANCE = 1e-5


def interpreted(case: str) -> dict:
    """What fla_interpreter.py measures for `case`, in a process of its own under TRITON_INTERPRET=1."""
    root = TESTS.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, str(TESTS / "fla_interpreter.py"), case], capture_output=True,
                            text=True, env=env, cwd=TESTS, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    assert results.pop("autotuners cut") > 0
    return results


@pytest.mark.parametrize("method", ["fox", "stick-breaking"])
def test_fla_kernels_match_the_formula_in_float64(method):
    """Output and every gradient of our glue to fla's kernel (2 rows of 40 tokens, 4 query heads on 2 key-value heads,
    head size 16), each row one sequence or two packed documents (cu_seqlens), float32 and float16, against the
    formula in float64 (stick-breaking with and without attend_current, its left-over stick on the query's value)."""
    results = interpreted(f"{method} op")
    expected = {"output", "query", "key", "value"} | ({"gate_weight", "gate_bias"} if method == "fox" else set())
    assert len(results) == (8 if method == "stick-breaking" else 4)
    for case, errors in results.items():
        assert set(errors) == expected, case
        allowed = OP_TOLERANCE[case.split()[0]]
        assert all(error <= allowed for error in errors.values()), (case, errors)


@pytest.mark.parametrize("method", ["fox", "stick-breaking"])
def test_a_model_trains_on_fla_as_on_the_blocks(method):
    """A tiny LLaMA (2 layers, GQA) patched with the method (FoX also with every FoX-Pro part on top of RoPE;
    stick-breaking also with attend_current): under attention_path("triton") every layer of a causal batch and of a
    packed one (position ids restarting, no cache) is served by fla, and the logits and every parameter's gradient
    equal "blocked"'s; a decoding step after a cached prefill (the prefill served) and a left-padded batch fall back
    to the blocked path, with its numbers. Every kernel check passed."""
    results = interpreted(f"{method} model")
    layers, verdicts = results.pop("layers"), results.pop("verdicts")
    assert len(results) == 8
    for case, measured in results.items():
        if case.endswith(("causal", "packed")):
            assert measured["triton calls"] == layers and measured["blocked's"] == 0, case
            assert measured["difference"] <= MODEL_TOLERANCE, (case, measured)
        elif case.endswith("decode"):
            assert measured["prefill triton calls"] == layers, case
            assert measured["decode triton calls"] == 0 and measured["decode content calls"] == layers, case
            assert measured["difference"] <= MODEL_TOLERANCE, (case, measured)
        else:
            assert case.endswith("left padding") and measured == {"difference": 0.0, "triton calls": 0}, case
    assert verdicts and all(passed for _, _, passed, _ in verdicts)
    kinds = {tuple(kind) for _, kind, _, _ in verdicts}
    assert any("packed" in kind for kind in kinds) and any("gradients" in kind for kind in kinds)


@pytest.fixture
def fresh_checks():
    engine.reset_kernel_status()
    yield
    engine.reset_kernel_status()


def test_where_triton_cannot_run_the_blocks_serve(monkeypatch, fresh_checks):
    """On the CPU without Triton's interpreter, attention_path("triton") computes FoX and stick-breaking by the
    blocked path, and no kernel is tried (nor checked)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ids = random_ids(2, 16)
    for method in ("fox", "stick-breaking"):
        model = hf_posenc.patch_model(tiny_model("llama"), method)
        with torch.no_grad():
            with engine.attention_path("triton"):
                engine.last_paths.clear()
                served = model(ids).logits
                assert engine.last_paths["triton"] == 0 and engine.last_paths["content"] == 2
            with engine.attention_path("blocked"):
                blocked = model(ids).logits
        assert max_diff(served, blocked) == 0.0
    assert engine.kernel_status() == []


def wide_heads_llama_like():
    """A tiny Qwen3 (LLaMA-family attention) with head size 272, over fla's 256."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**SPECIAL_TOKENS, vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=272,
                         max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config).eval()


CALLS_FLA_DOES_NOT_TAKE = {
    "float64": lambda: (tiny_model("llama").double(), {}),
    # the interpreter's bfloat16 products are wrong (Triton 3.9)
    "bfloat16 on the CPU": lambda: (tiny_model("llama").bfloat16(), {}),
    "head size over 256": lambda: (wide_heads_llama_like(), {}),
    "eager attention (weights asked for)": lambda: (tiny_model("llama", attn_implementation="eager"), {}),
    "attention dropout in training": lambda: (tiny_model("llama"), {"dropout": True}),
    "BLOOM's ALiBi kept underneath (base=native)": lambda: (tiny_model("bloom"), {"base": "native"}),
}


@pytest.mark.parametrize("case", list(CALLS_FLA_DOES_NOT_TAKE))
@pytest.mark.parametrize("method", ["fox", "stick-breaking"])
def test_calls_fla_does_not_take_never_reach_it(case, method, monkeypatch, fresh_checks):
    """With Triton taken to run here, a call fla does not serve (float64, bfloat16 on the CPU, a head size over 256,
    eager attention, attention dropout, a native bias) goes to the blocked path without trying the kernel: the kernel here raises,
    which the kernel check would record as a refusal, and no check is recorded."""
    model, options = CALLS_FLA_DOES_NOT_TAKE[case]()
    dropout = options.pop("dropout", False)
    model = hf_posenc.patch_model(model, method, **options)
    if dropout:
        for module in model.modules():
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.5
        model.train()

    def untouchable(*args, **kwargs):
        raise AssertionError("the Triton kernel was called")

    monkeypatch.setattr(triton_content, "triton_runs_on", lambda device: True)
    entry = by_method.kernels_for(hf_posenc.get_positional_module(model))
    triton = dataclasses.replace(entry.triton, run=untouchable, installed=lambda: True)
    monkeypatch.setitem(by_method.KERNELS, method, dataclasses.replace(entry, triton=triton))
    ids = random_ids(2, 12)
    engine.last_paths.clear()
    with engine.attention_path("triton"):
        model(ids).logits.sum().backward()
    assert engine.last_paths["triton"] == 0 and engine.last_paths["content"] == model.config.num_hidden_layers
    assert engine.kernel_status() == []
