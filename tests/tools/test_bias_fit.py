"""The bias fitted to the original's attention before training (tools/finetune/bias_fit.py, `finetune
--fit-bias-steps`, issue 55): its KL against a float64 hand computation from each layer's captured input, that the fit
lowers it and moves the bias alone, what it refuses, and the command's record."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_attention_transfer import captured_inputs
from tool_helpers import BOOK, run_cli, save_tiny_model
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_posenc
from hf_posenc.errors import PosEncError
from hf_posenc.methods.t5 import causal_buckets
from hf_posenc.tools.finetune.attention_transfer import attention_modules
from hf_posenc.tools.finetune.bias_fit import bias_fit_kl, capture_attention, fit_positional_bias
from hf_posenc.tools.finetune.teacher import Teacher
from tiny_models import FAMILIES, random_ids, tiny_model


def peaked_llama():
    """The tiny LLaMA with queries 6x larger: attention sharp enough that RoPE's positions matter to it."""
    model = tiny_model("llama")
    with torch.no_grad():
        for attention in attention_modules(model):
            attention.q_proj.weight.mul_(6)
    return model


def hand_weights(attention, x: torch.Tensor, rotation=None, bias=None) -> torch.Tensor:
    """float64 [B, H, L, L]: a LLaMA layer's causal attention weights on input x, RoPE's (cos, sin) or a bias added."""
    config = attention.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    batch, length, _ = x.shape
    q = (x.double() @ attention.q_proj.weight.double().T).view(batch, length, heads, dim).transpose(1, 2)
    k = (x.double() @ attention.k_proj.weight.double().T).view(batch, length, kv_heads, dim).transpose(1, 2)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    if rotation is not None:
        q, k = apply_rotary_pos_emb(q, k, *(part.double() for part in rotation))
    logits = q @ k.transpose(-1, -2) / math.sqrt(dim)
    if bias is not None:
        logits = logits + bias
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


@pytest.mark.parametrize("queries", [None, 7], ids=["every query", "the last 7 queries"])
def test_the_kl_is_the_hand_computation_from_each_layers_original_input(queries):
    original = peaked_llama()
    ids = random_ids(2, 20)
    inputs = captured_inputs(original, ids)
    rotation = original.model.rotary_emb(inputs[0], torch.arange(20)[None])
    teacher = Teacher.original(original, frozen_base=False)
    hf_posenc.patch_model(original, "t5", per_layer=True, num_buckets=8, max_distance=16)
    module = hf_posenc.get_positional_module(original)
    captured = capture_attention(original, teacher, ids, queries)
    kl = bias_fit_kl(module, captured)
    rows = slice(20 - (queries or 20), 20)
    assert kl.shape == (2,) and captured.layers == [0, 1]
    distance = (torch.arange(20)[:, None] - torch.arange(20)[None, :]).clamp_min(0)
    buckets = causal_buckets(distance, 8, 16)
    for layer, (x, attention) in enumerate(zip(inputs, attention_modules(original))):
        target = hand_weights(attention, x, rotation)
        table = module.weight[layer].double()  # [buckets, heads]
        patched = hand_weights(attention, x, bias=table[buckets].permute(2, 0, 1))
        target, patched = target[:, :, rows], patched[:, :, rows]
        held = target > 0
        expected = torch.where(held, target * (target.log() - patched.log()), 0.0).sum(-1).mean()
        assert abs(kl[layer].item() - expected.item()) <= 1e-4 * expected.item() + 1e-7
    assert kl.min() > 1e-3  # RoPE's positions matter to this model: a KL a bias can reduce


def test_the_fit_lowers_the_kl_and_moves_the_bias_alone():
    """A teacher with a recency bias to learn: the same weights under ALiBi (a frozen copy, as --distill-from
    PATH loads one); the student, NoPE plus a zero T5 table, fits it."""
    model = peaked_llama()
    teacher = Teacher("loaded", hf_posenc.patch_model(peaked_llama(), "alibi").requires_grad_(False))
    hf_posenc.patch_model(model, "t5", per_layer=True, num_buckets=16, max_distance=32, init="zeros")
    before = {name: value.clone() for name, value in model.state_dict().items()}
    flags = {name: p.requires_grad for name, p in model.named_parameters()}
    fit = fit_positional_bias(model, teacher, random_ids(3, 32), steps=60, lr=0.2)
    assert fit.kl_after < 0.2 * fit.kl_before and len(fit.layer_kl) == 2 and fit.steps == 60
    changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    assert changed == {"model.posenc.weight"}
    assert flags == {name: p.requires_grad for name, p in model.named_parameters()}
    assert all(p.grad is None for p in model.parameters())
    # the fitted table is what the KL reads: measured again on held-out blocks, it is still below the zero table's
    held_out = capture_attention(model, teacher, random_ids(2, 32, seed=7))
    module = hf_posenc.get_positional_module(model)
    fitted = bias_fit_kl(module, held_out).mean()
    with torch.no_grad():
        module.weight.zero_()
    assert fitted < bias_fit_kl(module, held_out).mean()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_fit_runs_on_every_family(model_type):
    model = tiny_model(model_type)
    teacher = Teacher.original(model, frozen_base=True)
    hf_posenc.patch_model(model, "kerple")
    fit = fit_positional_bias(model, teacher, random_ids(2, 16), steps=5)
    assert math.isfinite(fit.kl_after) and fit.kl_after <= fit.kl_before
    assert model.config._attn_implementation == tiny_model(model_type).config._attn_implementation  # put back


@pytest.mark.parametrize("method,options,match", [("nope", {}, "no bias parameters"),
                                                  ("alibi", {}, "no bias parameters"),
                                                  ("kerple", {"layers": "last:1"}, "hybrid")])
def test_what_has_nothing_to_fit_is_refused_and_the_model_untouched(method, options, match):
    model = tiny_model("llama")
    teacher = Teacher.original(model, frozen_base=True)
    hf_posenc.patch_model(model, method, **options)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(PosEncError, match=match):
        fit_positional_bias(model, teacher, random_ids(2, 16), steps=3)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())


def test_a_fit_that_diverges_stops_and_puts_the_bias_back(monkeypatch):
    import hf_posenc.tools.finetune.bias_fit as bias_fit

    model = peaked_llama()
    teacher = Teacher.original(model, frozen_base=True)
    hf_posenc.patch_model(model, "kerple")
    module = hf_posenc.get_positional_module(model)
    start = [p.detach().clone() for p in module.parameters()]
    calls = []
    real = bias_fit.bias_fit_kl

    def turns_nan_at_the_fourth_step(method, captured):
        calls.append(1)
        kl = real(method, captured)
        return kl * float("nan") if len(calls) == 4 else kl

    monkeypatch.setattr(bias_fit, "bias_fit_kl", turns_nan_at_the_fourth_step)
    with pytest.raises(PosEncError, match="turned nan at step 3; lower --fit-bias-lr"):
        fit_positional_bias(model, teacher, random_ids(2, 16), steps=8, lr=0.1)
    assert all(torch.equal(p, s) for p, s in zip(module.parameters(), start))  # three steps moved it, put back


def test_the_command_fits_then_trains_and_records_it(tmp_path, capsys):
    model_dir = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    argv = ["--model", str(model_dir), "--method", "t5:per_layer=true", "--text-file", str(BOOK), "--max-length", "32",
            "--max-steps", "2", "--distill-from", "original", "--distill-alpha", "1", "--train-only", "qkvo",
            "--fit-bias-steps", "4", "--fit-bias-blocks", "2", "--fit-bias-length", "64", "--fit-bias-queries", "16",
            "--output-dir", str(out), "--no-progress"]
    assert run_cli("finetune", argv) == 0
    printed = capsys.readouterr()
    assert "fit bias: KL to the teacher's attention" in printed.out and "did not lower the KL" not in printed.err
    record = json.loads((out / "training_args.json").read_text())["bias_fit"]
    assert record["steps"] == 4 and record["blocks"] == 2 and record["kl_after"] < record["kl_before"]
    assert record["length"] == 64 and record["queries"] == 16
    assert json.loads((out / "training_args.json").read_text())["fit_bias_steps"] == 4
    # A fit that never got below its start (here steps too small to move a float32 weight) keeps the start and says
    # so: FIRE's ALiBi-like default on SmolLM2 read 30.65 -> 30.65 in 30 steps, silently.
    stuck = [*argv[:-3], "--fit-bias-lr", "1e-30", "--output-dir", str(tmp_path / "stuck"), "--no-progress"]
    assert run_cli("finetune", stuck) == 0
    assert "warning: --fit-bias-steps 4 did not lower the KL from the method's start" in capsys.readouterr().err
    record = json.loads((tmp_path / "stuck" / "training_args.json").read_text())["bias_fit"]
    assert record["kl_after"] == record["kl_before"]


@pytest.mark.parametrize("options,message", [
    ([], "add --distill-from original"),
    (["--distill-from", "original", "--fit-bias-length", "48"], "must be a multiple of --max-length 32"),
    (["--distill-from", "original", "--fit-bias-queries", "0"], "--fit-bias-queries must be")])
def test_the_command_refuses_a_bad_fit_and_writes_nothing(tmp_path, capsys, options, message):
    model_dir = save_tiny_model(tmp_path / "tiny")
    argv = ["--model", str(model_dir), "--method", "kerple", "--text-file", str(BOOK), "--max-length", "32",
            "--max-steps", "2", "--fit-bias-steps", "4", *options, "--output-dir", str(tmp_path / "out"),
            "--no-progress"]
    assert run_cli("finetune", argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_resumed_fit_run_equals_the_uninterrupted_one(tmp_path):
    """The resumed run skips the fit (its checkpoint holds the fitted bias) and ends with the same weights."""
    model_dir = save_tiny_model(tmp_path / "tiny")
    common = ["--model", str(model_dir), "--method", "t5:per_layer=true", "--text-file", str(BOOK), "--max-length",
              "32", "--max-steps", "4", "--distill-from", "original", "--distill-alpha", "1", "--train-only", "qkvo",
              "--fit-bias-steps", "3", "--fit-bias-blocks", "2", "--no-progress"]

    def digest(directory):
        return json.loads((directory / "training_args.json").read_text())["weights_sha256_per_process"][0]

    assert run_cli("finetune", [*common, "--output-dir", str(tmp_path / "straight")]) == 0
    assert run_cli("finetune", [*common, "--output-dir", str(tmp_path / "cut"), "--save-every", "2"]) == 0
    assert run_cli("finetune", [*common, "--output-dir", str(tmp_path / "resumed"), "--resume-from",
                                str(tmp_path / "cut-checkpoints" / "step-2")]) == 0
    assert digest(tmp_path / "resumed") == digest(tmp_path / "straight")
    resumed = json.loads((tmp_path / "resumed" / "training_args.json").read_text())["bias_fit"]
    assert resumed["steps"] == 3 and resumed["kl_before"] is None  # not fitted again


def test_two_processes_fit_and_train_the_same_weights(tmp_path):
    """Each process fits on the same blocks before accelerate wraps the model: the same bias everywhere."""
    from tool_helpers import launch

    model_dir = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "ft"
    done = launch("finetune", ["--model", str(model_dir), "--method", "t5:per_layer=true", "--text-file", str(BOOK),
                               "--text-fraction", "0:0.1", "--max-length", "32", "--max-steps", "2", "--lr", "1e-3",
                               "--distill-from", "original", "--train-only", "qkvo", "--fit-bias-steps", "3",
                               "--output-dir", str(out), "--no-progress", "--threads", "1"])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "training_args.json").read_text())
    assert summary["num_processes"] == 2 and summary["bias_fit"]["kl_after"] <= summary["bias_fit"]["kl_before"]
    digests = summary["weights_sha256_per_process"]
    assert len(digests) == 2 and digests[0] == digests[1]
