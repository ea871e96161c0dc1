"""The fine-tune's per-process memory estimate under each engine (estimates.estimate_training_bytes with `engine`,
and longest_training_length, which docs/finetuning-and-evaluation.md's table of context lengths comes from)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from hf_posenc import PosEncError
from hf_posenc.tools.estimates import (DEEPSPEED_BUCKET_ELEMENTS, ENGINES, estimate_training_bytes,
                                       longest_training_length)

LENGTH, BATCH = 128, 1


def state_bytes(model, engine: str, processes: int) -> float:
    """What the engine changes: the estimate less its activations (the one-process estimate with nothing trained)."""
    trainable = sum(p.numel() for p in model.parameters())
    activations = (estimate_training_bytes(model, LENGTH, BATCH, 0, True) / 1.25
                   - sum(p.numel() * p.element_size() for p in model.parameters()))
    return estimate_training_bytes(model, LENGTH, BATCH, trainable, True, engine=engine,
                                   processes=processes) / 1.25 - activations


def test_each_engine_holds_what_it_shards():
    model = tiny_model("llama")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters())
    layers = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model.model.layers]
    outside = weights - sum(layers)  # embeddings, head, final norm
    n = 4
    expected = {"none": weights + 12 * trainable, "ddp": weights + 16 * trainable,
                "zero2": weights + 4 * trainable + 12 * trainable / n,
                "zero3": weights / n + outside + 2 * max(layers) + 4 * trainable + 12 * trainable / n,
                "fsdp2": weights / n + 2 * (outside + 2 * max(layers)) + 12 * trainable / n}
    assert set(expected) == set(ENGINES)
    for engine, value in expected.items():
        assert state_bytes(model, engine, n) == pytest.approx(value, rel=1e-6, abs=2), engine
    assert trainable < DEEPSPEED_BUCKET_ELEMENTS  # the reduce bucket is the whole gradient here


def test_sharded_engines_hold_less_on_more_processes_and_ddp_does_not():
    model = tiny_model("llama")
    for engine in ("zero2", "zero3", "fsdp2"):
        assert state_bytes(model, engine, 8) < state_bytes(model, engine, 2) < state_bytes(model, "ddp", 2)
    assert state_bytes(model, "ddp", 8) == state_bytes(model, "ddp", 2)


def test_longest_training_length_is_the_longest_that_the_check_allows():
    model = tiny_model("llama")
    trainable = sum(p.numel() for p in model.parameters())
    memory = 2**30
    for engine in ("ddp", "zero3"):
        longest = longest_training_length(model, memory, engine, 8)
        assert longest > 0 and longest % 256 == 0
        needed = [estimate_training_bytes(model, n, 1, trainable, True, engine=engine, processes=8)
                  for n in (longest, longest + 256)]
        assert needed[0] <= 0.9 * memory < needed[1]
    assert longest_training_length(model, 2**20, "ddp", 1) == 0  # not even 256 tokens in 1 MiB


def test_an_unknown_engine_is_refused():
    with pytest.raises(PosEncError, match="engine 'zero4': choose one of none, ddp, zero2, zero3, fsdp2"):
        estimate_training_bytes(tiny_model("llama"), LENGTH, BATCH, 10, True, engine="zero4")


def test_a_zero3_partitioned_parameter_counts_whole():
    from hf_posenc.tools.estimates import parameter_count

    empty = torch.nn.Parameter(torch.empty(0))
    empty.ds_numel = 1000  # what DeepSpeed leaves on a partitioned parameter
    assert parameter_count(empty) == 1000 and parameter_count(torch.nn.Parameter(torch.ones(3))) == 3
