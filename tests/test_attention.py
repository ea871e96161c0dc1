"""The attention paths (hf_posenc/engine/attention/) against the naive materialised computation: blocked
attention with every kind of bias, cache and padding, the Toeplitz view of distance tables, and the path setting.
(Compiled and external kernels: test_kernel_check.py.)"""

from __future__ import annotations

import math

import pytest
import torch

import hf_posenc
from hf_posenc import PosEncError, attention
from hf_posenc.engine.attention import bias_path, geometry
from hf_posenc.engine.attention.call import AttentionCall
from hf_posenc.engine.state import STATE_ATTR, PositionState
from helpers import left_pad, max_diff
from tiny_models import random_ids, tiny_model


def module_of(method, model_type="llama", **options):
    return hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model(model_type), method, **options))


class FakeAttention(torch.nn.Module):
    def __init__(self, state, layer_idx=1):
        super().__init__()
        setattr(self, STATE_ATTR, state)
        self.layer_idx = layer_idx


def naive_attention(state, layer_idx, query, key, value, attention_mask, scaling):
    """Everything materialised: the full [B, H, q, kv] bias and mask, softmax in float64."""
    q, kv = query.shape[2], key.shape[2]
    query_slots, key_slots, query_positions, key_positions = state.relative_positions(q, kv, query.device)
    if isinstance(state.method, hf_posenc.RotaryMethod):
        query, key = state.method.rotate_query_key(query, key, query_positions, key_positions, 0)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    call = AttentionCall.build(FakeAttention(state, layer_idx), state, query, key, value, attention_mask, scaling)
    mask = attention.block_mask(call, slice(None), torch.float32)
    scores = (query.double() @ key.double().transpose(2, 3)) * scaling
    scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.double()
    return (scores.softmax(-1) @ value.double()).transpose(1, 2).float()


CASES = {  # (batch, query length, keys, cache offset, left padding of row 0)
    "prefill": (1, 37, 37, 0, 0),
    "chunk after cache": (2, 11, 40, 29, 0),
    "static cache": (1, 5, 64, 20, 0),
    "left padded": (2, 30, 30, 0, 7),
    "decode one token": (2, 1, 33, 32, 3),
}


def test_blocks_are_larger_on_an_accelerator():
    """The CPU's block budget stays near its caches; a GPU's is larger (fewer Python iterations and kernel launches),
    still a constant, so memory stays linear in the keys per block."""
    from hf_posenc.engine import attention as engine

    cpu = engine.block_rows(1, 8, 8192, 5.0, torch.device("cpu"))
    gpu = engine.block_rows(1, 8, 8192, 5.0, torch.device("cuda"))
    assert cpu == engine.block_rows(1, 8, 8192, 5.0) == int(engine.BLOCK_BYTES // (4 * 8 * 8192 * 5.0))
    assert gpu == int(engine.ACCELERATOR_BLOCK_BYTES // (4 * 8 * 8192 * 5.0)) > cpu


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("method,options", [("alibi", {}), ("fire", {}), ("fire", {"threshold": 10.0}),
                                            ("t5", {"per_layer": True}), ("kerple", {}), ("sandwich", {}),
                                            ("xpos", {"extrapolation": "bca", "window": 8})])
def test_blocked_attention_equals_materialised(method, options, case, backend, monkeypatch):
    monkeypatch.setattr(geometry, "BLOCK_BYTES", 4 * 2 * 4 * 40 * 3)  # about 3 query rows per block
    monkeypatch.setattr(bias_path, "VIEW_BLOCK_ROWS", 3)
    batch, q, kv, offset, pad = CASES[case]
    module = module_of(method, **options)
    state = PositionState(module, backend=backend)
    positions = torch.arange(offset, offset + q)[None].repeat(batch, 1)
    positions[0] -= pad
    state.update(positions, offset)
    torch.manual_seed(0)
    query, key, value = torch.randn(batch, 4, q, 16), torch.randn(batch, 2, kv, 16), torch.randn(batch, 2, kv, 16)
    slots = torch.arange(kv)
    mask = (slots[None, :] <= torch.arange(offset, offset + q)[:, None])[None, None].repeat(batch, 1, 1, 1)
    mask[0, :, :, :pad] = False
    attention.last_paths.clear()
    out, _ = attention.posenc_attention(FakeAttention(state), query, key, value, mask if pad else None, scaling=0.25)
    expected = naive_attention(state, 1, query, key, value, mask if pad else None, 0.25)
    real = torch.ones(batch, q, dtype=torch.bool)
    real[0, :max(0, pad - offset)] = False  # fully masked padding queries are undefined in both
    assert max_diff(out[real], expected[real]) <= 1e-5
    assert attention.last_paths == {"blocked": 1}


def test_toeplitz_view_equals_a_gather_and_copies_nothing():
    table = torch.randn(3, 50)
    low = torch.finfo(torch.float32).min
    for first, rows, keys in [(0, 5, 1), (10, 4, 14), (20, 7, 9), (44, 6, 50), (0, 6, 6)]:
        padded = attention.padded_table(table, 6, torch.float32)
        block = attention.toeplitz_view(padded, 6, first, rows, keys)
        distance = first + torch.arange(rows)[:, None] - torch.arange(keys - 1, -1, -1)[None]
        expected = torch.where(distance >= 0, table[:, distance.clamp_min(0)], low)
        assert block.shape == (3, rows, keys) and block.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()
        assert torch.equal(block, expected)


@pytest.mark.parametrize("method", ["alibi", "t5", "kerple", "sandwich", "fire"])
def test_unpadded_table_bias_reaches_sdpa_as_a_view_of_the_table(method, monkeypatch):
    """Without padding, the masks SDPA gets are strided views of one small table, never [H, rows, keys] copies."""
    monkeypatch.setattr(bias_path, "VIEW_BLOCK_ROWS", 8)
    model = hf_posenc.patch_model(tiny_model("llama"), method)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    length = 40
    with torch.no_grad():
        model(random_ids(1, length))
    assert len(masks) == 2 * 5  # 2 layers x 5 blocks of 8 rows
    for mask in masks:
        heads, rows, keys = mask.shape[1:]
        assert mask.stride()[-2:] == (1, 1)  # each row is the previous one shifted by one entry
        assert mask.untyped_storage().nbytes() <= 4 * heads * (2 * length + 8)


def test_attention_path_setting():
    assert attention.get_attention_path() == "auto"
    with pytest.raises(PosEncError, match=r"Attention path 'fast' is unknown; use one of auto, blocked, flex, flash"):
        attention.set_attention_path("fast")
    with attention.attention_path("blocked"):
        assert attention.get_attention_path() == "blocked"
    assert attention.get_attention_path() == "auto"
    # on CPU, "auto" never compiles flex; "flash" without CUDA falls back to the blocked path
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    attention.last_paths.clear()
    with torch.no_grad(), attention.attention_path("flash"):
        model(random_ids(1, 8))
    assert attention.last_paths == {"blocked": 2}


def test_two_models_take_their_own_paths_and_count_their_own_calls(monkeypatch):
    """The path is chosen per model: CoPE set to "compiled" and a second CoPE left on "auto"'s default, in one
    process and one thread, each take their own path, and each model's counts hold its own calls; last_paths sums
    the thread's calls over both. A thread's context choice is over every model's, and stays in that thread."""
    import threading

    from hf_posenc.engine.attention import compiled_content

    # the eager chain stands in for the compiled one (the "compiled" path still runs, checked, without compiling)
    monkeypatch.setattr(compiled_content, "_compiled_block_output", attention.content_block_output)
    attention.reset_kernel_status()
    compiled, default = (hf_posenc.patch_model(tiny_model("llama"), "cope", max_pos=4) for _ in range(2))
    attention.set_attention_path("compiled", model=compiled)
    assert (attention.get_attention_path(compiled), attention.get_attention_path(default)) == ("compiled", "auto")
    assert attention.get_attention_path() == "auto"  # no thread-wide choice was made
    layers = compiled.config.num_hidden_layers
    attention.last_paths.clear()
    padded, mask = left_pad([random_ids(1, 12, seed=3)[0], random_ids(1, 9, seed=4)[0]])
    with torch.no_grad():
        compiled(padded, attention_mask=mask)
        default(padded, attention_mask=mask)
    assert attention.path_counts(compiled) == {"content": layers, "compiled content": layers}
    assert attention.path_counts(default) == {"content": layers}
    assert attention.last_paths == {"content": 2 * layers, "compiled content": layers}

    def in_a_thread():  # "blocked" for this thread's calls, the compiled model's included
        with torch.no_grad(), attention.attention_path("blocked"):
            compiled(padded, attention_mask=mask)
        seen.append(dict(attention.last_paths))

    seen = []
    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join()
    assert seen == [{"content": layers}]  # the thread's own counts
    assert attention.path_counts(compiled) == {"content": 2 * layers, "compiled content": layers}
    assert attention.last_paths == {"content": 2 * layers, "compiled content": layers}  # this thread's, unchanged
    assert attention.get_attention_path(compiled) == "compiled"
    attention.reset_kernel_status()


def test_a_path_for_an_unpatched_model_is_refused():
    with pytest.raises(PosEncError, match=r"LlamaForCausalLM is not patched by hf_posenc.*patch_model"):
        attention.set_attention_path("blocked", model=tiny_model("llama"))
    with pytest.raises(PosEncError, match="Attention path 'fast' is unknown"):
        attention.set_attention_path("fast", model=hf_posenc.patch_model(tiny_model("llama"), "alibi"))
