"""A patched model reads tensor values into Python (`int(t)`, `bool(t)`, `.item()`: aten's _local_scalar_dense) a
fixed number of times per forward, not once or more per layer: on a GPU each read waits for the device to finish
all the work queued before it, so a read per layer stops Python from running ahead of the kernels (SmolLM2's step
on an H200 is bound by launches, docs/benchmarks.md). Facts about the forward's positions are read once
(PositionState.once_per_forward) and slots come from the cache's sizes (PositionState.first_key_slot).

Counted on the CPU with the paths a GPU takes: the fused CPU kernels off (HF_POSENC_CPU_KERNELS=0), FoX's CPU
separable path off, and fill_disallowed_'s column count at 0 as off the CPU; those CPU-only paths read per block,
which costs nothing where the tensors are on the CPU. Each method is counted with 2 and with 4 layers, in a training
step, a left-padded forward, a decoding step after a padded prefill, and a forward of two sequences packed into each
row (positions that restart)."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, DynamicCache

import hf_posenc
from helpers import CONTRACT, ContractCase, patch_for_contract
from tiny_models import CONFIGS, random_ids


class HostReads(TorchDispatchMode):
    """Counts the reads, by the hf_posenc line that made each (for the failure message)."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            ours = [f"{Path(frame.filename).name}:{frame.lineno}" for frame in traceback.extract_stack()
                    if "hf_posenc" in frame.filename]
            self.sites[ours[-1] if ours else "outside hf_posenc"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def gpu_paths(monkeypatch):
    from hf_posenc.engine.attention import content_path, near_far
    from hf_posenc.methods import base

    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "0")
    for path in (content_path, near_far):  # the paths on aten's CPU flash kernel
        monkeypatch.setattr(path, "cpu_flash_applies", lambda query: False)
    from hf_posenc.methods import stick_breaking

    for module in (base, stick_breaking):
        monkeypatch.setattr(module, "unmasked_columns", lambda mask: 0)


def model_with(method: str, layers: int):
    config = CONFIGS["llama"]()
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return patch_for_contract(AutoModelForCausalLM.from_config(config), method)


def reads_in(run) -> collections.Counter:
    with HostReads() as reads:
        run()
    return reads.sites


def training_step(model):
    model.train()
    ids = random_ids(2, 24, seed=1)
    model(ids)  # the first call of a process may check kernels: count the second
    return reads_in(lambda: model(ids).logits.logsumexp(-1).sum().backward())


def padded_batch():
    """(ids, mask, positions) of a left-padded batch of 2 x 24, and the mask one decoding step later."""
    ids = random_ids(2, 24, seed=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, positions, torch.cat((mask, torch.ones(2, 1, dtype=mask.dtype)), dim=-1)


def padded_forward_and_decoding(model):
    model.eval()
    ids, mask, positions, longer = padded_batch()
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=positions)
        padded = reads_in(lambda: model(ids, attention_mask=mask, position_ids=positions))
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        decoding = reads_in(lambda: model(ids[:, -1:], attention_mask=longer, position_ids=positions[:, -1:] + 1,
                                          past_key_values=cache, use_cache=True))
    return padded, decoding


def packed_positions():
    """(ids, position_ids) of two sequences packed into each row (positions 0..9, then 0..13), no mask: the keys'
    positions are not a shift of their slots, so bias methods take the generic per-block bias."""
    return random_ids(2, 24, seed=3), torch.cat((torch.arange(10), torch.arange(14))).expand(2, -1)


def packed_forward(model):
    model.eval()
    ids, positions = packed_positions()
    with torch.no_grad():
        model(ids, position_ids=positions)
        return reads_in(lambda: model(ids, position_ids=positions))


def reads_per_run(method: str, model) -> dict:
    """run name -> the reads it made, for each run `method` supports."""
    reads = {"a training step": training_step(model)}
    if "left_padding" not in CONTRACT.get(method, ContractCase()).unsupported:  # rope-2d: 2-D position_ids only
        reads["a left-padded forward"], reads["a decoding step"] = padded_forward_and_decoding(model)
        reads["a packed forward"] = packed_forward(model)
    return reads


# Known to read per layer off the CPU in one run, and why it was left.
READS_PER_LAYER = {
    ("transformer-xl", "a packed forward"):
        "where keys follow their queries in position (restarting positions) its kernel form does not serve, and its "
        "content blocks size their table of distances from each block's distances: a table over the forward's span "
        "would do up to twice the position logits' work",
}


@pytest.mark.parametrize("method", hf_posenc.available_methods())
def test_host_reads_do_not_grow_with_depth(gpu_paths, method):
    shallow, deep = reads_per_run(method, model_with(method, 2)), reads_per_run(method, model_with(method, 4))
    growing = {name: dict(deep[name]) for name in shallow
               if shallow[name] != deep[name] and (method, name) not in READS_PER_LAYER}
    assert not growing, f"reads that grow with depth (2 -> 4 layers; where each was made at 4): {growing}"


def test_the_count_sees_a_read_per_layer(gpu_paths, monkeypatch):
    """The counter is not blind: a read added to every layer's attention shows up, and the reads left in
    READS_PER_LAYER still grow (when they stop, take them off it)."""
    from hf_posenc.engine import state

    first_key_slot = state.PositionState.first_key_slot

    def reading(self, q, kv):
        torch.tensor(kv).item()
        return first_key_slot(self, q, kv)

    monkeypatch.setattr(state.PositionState, "first_key_slot", reading)
    assert training_step(model_with("alibi", 2)).total() < training_step(model_with("alibi", 4)).total()
    monkeypatch.setattr(state.PositionState, "first_key_slot", first_key_slot)
    for method, name in READS_PER_LAYER:
        two, four = (reads_per_run(method, model_with(method, layers))[name] for layers in (2, 4))
        assert two.total() < four.total()


@pytest.mark.parametrize("method", ["self-extend", "rerope", "sinks", "xpos", "fire", "alibi", "transformer-xl", "fox",
                                    "t5", "cape"])
def test_host_values_read_once_give_the_logits_of_reading_them_in_every_layer(gpu_paths, monkeypatch, method):
    """What the first layer reads is what every layer would read: the same logits, bit for bit, for a left-padded
    forward, the decoding step after it and a packed forward, with the values kept (CallPositions.host_values) and
    with them read again by each layer."""
    from hf_posenc.engine import state

    def logits(model):
        model.eval()
        ids, mask, positions, longer = padded_batch()
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            padded = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           use_cache=True).logits
            step = model(ids[:, -1:], attention_mask=longer, position_ids=positions[:, -1:] + 1,
                         past_key_values=cache, use_cache=True).logits
            packed_ids, packed = packed_positions()
            return padded, step, model(packed_ids, position_ids=packed).logits

    kept = logits(model_with(method, 4))
    monkeypatch.setattr(state.CallPositions, "host_values", property(lambda self: {}, lambda self, value: None),
                        raising=False)
    again = logits(model_with(method, 4))
    assert all(torch.equal(a, b) for a, b in zip(kept, again))


@pytest.mark.parametrize("method", ["cope", "cape"])  # fla's kernels (FoX's) run under the interpreter only in a
def test_host_reads_on_the_triton_path_do_not_grow_with_depth(gpu_paths, method):  # process of their own
    """Our Triton kernels' path (under Triton's interpreter here, as on a GPU otherwise) reads what it needs of
    the forward's positions once too (CAPE's consecutive positions and highest one, packed documents' starts): a
    training step and a packed forward make the same reads with 2 layers as with 4, and the kernels served them."""
    from hf_posenc import attention

    with attention.attention_path("triton"):
        runs = {}
        for layers in (2, 4):
            model = model_with(method, layers)
            attention.last_paths.clear()
            runs[layers] = {"a training step": training_step(model), "a packed forward": packed_forward(model)}
            assert attention.last_paths["triton"] > 0, dict(attention.last_paths)
    growing = {name: dict(runs[4][name]) for name in runs[2] if runs[2][name] != runs[4][name]}
    assert not growing, f"reads that grow with depth (2 -> 4 layers; where each was made at 4): {growing}"
