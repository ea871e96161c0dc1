"""Training-free context extension by remapped positions (Self-Extend, ReRoPE, attention sinks): the shared attention
path against an independent float64 reference that materialises the whole score matrix, whole models against the
unpatched model within the window, and the sinks' bounded cache. (The contract suite, test_contract.py, checks
caches, padding, unpatch, gradients, low precision and checkpoints for both on every model type.)"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, StaticCache

import hf_posenc
from hf_posenc.engine import attention as attention_module
from hf_posenc.engine.attention import geometry, near_far
from hf_posenc.engine.state import STATE_ATTR
from hf_posenc import PosEncError
from helpers import (decode_token_by_token, left_pad, max_diff, padded_and_cached_outputs_and_gradients,
                     patch_for_contract, without_kernel)
from tiny_models import random_ids, tiny_model

THETA = 10000.0


def rotate_float64(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout as a complex rotation: pair k is (x[k], x[k + d/2]), turned by position *
    theta^(-2k/d). x [B, H, n, d], positions [B, n] (any real values)."""
    half = x.shape[-1] // 2
    inv_freq = THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    turn = torch.polar(torch.ones(()).double(), positions[:, None, :, None].double() * inv_freq)
    pairs = torch.complex(x[..., :half].double(), x[..., half:].double()) * turn
    return torch.cat((pairs.real, pairs.imag), dim=-1)


def reference_attention(method: str, options: dict, query, key, value, query_positions, key_positions, scaling):
    """float64, the full [q, kv] score matrix: near scores for keys within the window, far scores beyond, one
    softmax over the causal keys (by position)."""
    window = options["window"]
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    visible = torch.ones_like(distance, dtype=torch.bool)
    if method == "sinks":
        # StreamingLLM with positions by cache slot: the query at min(t, S + W - 1), a sink j at j; beyond the window
        # only the sinks are visible.
        sinks = options["num_sinks"]
        far_query = query_positions.clamp(max=sinks + window - 1)
        far_key = key_positions
        visible = (key_positions[:, None, None, :] < sinks) | (distance < window)
    elif method == "self-extend":
        group = options["group"]
        far_query = torch.div(query_positions, group, rounding_mode="floor") + window - window // group
        far_key = torch.div(key_positions, group, rounding_mode="floor")
    else:
        far_query, far_key = torch.full_like(query_positions, window), torch.zeros_like(key_positions)
        if options.get("log_scaling"):
            log_n = (query_positions + 1).double().log() / math.log(options["original_max_position_embeddings"])
            query = query.double() * log_n.clamp(min=1)[:, None, :, None]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    near = rotate_float64(query, query_positions) @ rotate_float64(key, key_positions).transpose(-1, -2)
    far = rotate_float64(query, far_query) @ rotate_float64(key, far_key).transpose(-1, -2)
    scores = torch.where(distance < window, near, far) * scaling
    scores = scores.masked_fill((distance < 0) | ~visible, -math.inf)
    return (scores.softmax(-1) @ value).transpose(1, 2)


CASES = [
    ("self-extend", {"window": 6, "group": 3}),
    ("self-extend", {"window": 8, "group": 4}),
    ("rerope", {"window": 6}),
    ("rerope", {"window": 4, "log_scaling": True, "original_max_position_embeddings": 8}),
    ("sinks", {"num_sinks": 3, "window": 6}),
    ("sinks", {"num_sinks": 1, "window": 5}),
]


@pytest.mark.parametrize("method,options", CASES)
@pytest.mark.parametrize("offset", [0, 17])  # a full forward; a chunk after 17 cached tokens
def test_attention_equals_a_float64_materialised_reference(method, options, offset, monkeypatch):
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
    module = model.model.layers[0].self_attn
    state = getattr(module, STATE_ATTR)
    generator = torch.Generator().manual_seed(0)
    q, kv = 23, offset + 23
    query = torch.randn(2, 4, q, 16, generator=generator)
    key, value = torch.randn(2, 2, kv, 16, generator=generator), torch.randn(2, 2, kv, 16, generator=generator)
    positions = torch.arange(kv)[None].expand(2, -1)
    state.update(positions[:, offset:], offset, positions[:, :offset])
    monkeypatch.setattr(geometry, "BLOCK_BYTES", 4 * 2 * 4 * kv * 5 * 4)  # blocks of 4 query rows
    with torch.no_grad():
        output, _ = attention_module.posenc_attention(module, query, key, value, None, scaling=0.25)
    expected = reference_attention(method, options, query, key, value, positions[:, offset:], positions, 0.25)
    assert output.shape == expected.shape
    assert max_diff(output, expected) <= 1e-5


@pytest.mark.parametrize("method", ["self-extend", "rerope"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
def test_within_the_window_logits_equal_the_unpatched_model(method, model_type):
    model = tiny_model(model_type)
    if model_type != "llama":
        hf_posenc.patch_model(model, "rope")  # the unpatched RoPE model these build on
    ids = random_ids(2, 24)
    with torch.no_grad():
        original = model(ids).logits
        hf_posenc.patch_model(model, method, window=24, original_max_position_embeddings=32)
        patched = model(ids).logits
        hf_posenc.patch_model(model, method, window=8, original_max_position_embeddings=32)
        remapped = model(ids).logits
    assert max_diff(patched, original) <= 1e-5
    assert max_diff(remapped[:, :8], original[:, :8]) <= 1e-5  # the first 8 queries see only near keys
    # past the window the positions are remapped (BLOOM's tiny random model is the least sensitive: 8e-5)
    assert max_diff(remapped[:, 8:], original[:, 8:]) > 2e-5


@pytest.mark.parametrize("method,options", [("self-extend", {"window": 6, "group": 3}),
                                            ("rerope", {"window": 6, "log_scaling": True,
                                                        "original_max_position_embeddings": 16})])
def test_decoding_past_the_window_equals_a_full_forward(method, options):
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
    ids = random_ids(2, 40)
    with torch.no_grad():
        full = model(ids).logits
        dynamic = decode_token_by_token(model, ids, DynamicCache(config=model.config))
        static = decode_token_by_token(model, ids, StaticCache(config=model.config, max_cache_len=48))
    assert max_diff(full, dynamic) <= 1e-4
    assert max_diff(full, static) <= 1e-4


def test_eager_models_return_attention_weights_of_the_remapped_scores():
    model = hf_posenc.patch_model(tiny_model("llama", attn_implementation="eager"), "self-extend", window=4, group=2)
    sdpa = hf_posenc.patch_model(tiny_model("llama"), "self-extend", window=4, group=2)
    ids = random_ids(1, 20)
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        assert max_diff(out.logits, sdpa(ids).logits) <= 1e-5
    weights = out.attentions[0]
    assert weights.shape == (1, 4, 20, 20)
    assert torch.allclose(weights.sum(-1), torch.ones(1, 4, 20))


@pytest.mark.parametrize("method,options,message", [
    ("self-extend", {"group": 0}, r"SelfExtendConfig.group=0 .*pass an integer"),
    ("self-extend", {"window": 2.5}, r"SelfExtendConfig.window=2.5 .*pass an integer"),
    ("rerope", {"log_scaling": "yes"}, r"ReropeConfig.log_scaling='yes' is not a bool"),
])
def test_bad_options_are_named(method, options, message):
    with pytest.raises(PosEncError, match=message):
        hf_posenc.patch_model(tiny_model("llama"), method, **options)


@pytest.mark.parametrize("method", ["self-extend", "rerope"])
def test_a_model_without_rope_is_told_to_patch_rope_first(method):
    with pytest.raises(PosEncError, match=r"Patch it to 'rope' first"):
        hf_posenc.patch_model(tiny_model("gpt2"), method)
    with pytest.raises(PosEncError, match=r"window is required"):
        hf_posenc.patch_model(hf_posenc.patch_model(tiny_model("bloom"), "rope"), method)


# --- attention sinks (StreamingLLM) ---------------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
def test_sinks_within_sinks_plus_window_logits_equal_the_unpatched_model(model_type):
    model = tiny_model(model_type)
    if model_type != "llama":
        hf_posenc.patch_model(model, "rope")
    ids = random_ids(2, 24)
    with torch.no_grad():
        original = model(ids).logits
        hf_posenc.patch_model(model, "sinks", num_sinks=4, window=20)  # 4 + 20 = the whole text
        patched = model(ids).logits
        hf_posenc.patch_model(model, "sinks", num_sinks=2, window=8)
        streamed = model(ids).logits
    assert max_diff(patched, original) <= 1e-5
    assert max_diff(streamed[:, :10], original[:, :10]) <= 1e-5  # queries 0..9 see every earlier key
    assert max_diff(streamed[:, 10:], original[:, 10:]) > 2e-5  # later ones lose the middle of the text


def sink_model(model_type: str = "llama", **options):
    model = tiny_model(model_type)
    if model_type != "llama":
        hf_posenc.patch_model(model, "rope")
    return hf_posenc.patch_model(model, "sinks", **options)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
def test_sinks_decoding_with_the_bounded_cache_equals_a_full_forward(model_type):
    model = sink_model(model_type, num_sinks=2, window=6)
    ids = random_ids(2, 40)
    with torch.no_grad():
        full = model(ids).logits
        cache = hf_posenc.sink_cache(model)
        decoded = decode_token_by_token(model, ids, cache)
        chunked_cache = hf_posenc.sink_cache(model)  # a prompt longer than the cache in one chunk, then more chunks
        chunks = [model(ids[:, a:b], past_key_values=chunked_cache, use_cache=True).logits
                  for a, b in ((0, 13), (13, 20), (20, 21), (21, 40))]
        dynamic = decode_token_by_token(model, ids, DynamicCache(config=model.config))  # unbounded, same numbers
    assert max_diff(full, decoded) <= 1e-5
    assert max_diff(full, torch.cat(chunks, dim=1)) <= 1e-5
    assert max_diff(full, dynamic) <= 1e-5
    for layer in (*cache.layers, *chunked_cache.layers):
        assert layer.keys.shape[-2] == layer.values.shape[-2] == 2 + 6 - 1
    assert cache.get_seq_length() == 40
    assert torch.equal(cache.hf_posenc_key_positions, torch.cat((torch.arange(2), torch.arange(35, 40)))[None])


def test_sinks_generate_ten_times_the_window_in_bounded_memory(monkeypatch):
    model = sink_model("llama")  # window: the tiny model's 64 - 4 sinks
    held = []
    prepare = hf_posenc.SinkCache.prepare

    def recording(cache, *args, **kwargs):
        held.append(sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized))
        return prepare(cache, *args, **kwargs)

    monkeypatch.setattr(hf_posenc.SinkCache, "prepare", recording)
    prompt = random_ids(1, 8)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=640, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    assert isinstance(cache, hf_posenc.SinkCache) and cache.get_seq_length() == 8 + 640 - 1
    capacity = 4 + 60 - 1
    per_token = 2 * 2 * 2 * 16  # layers x (keys, values) x kv heads x head size
    assert len(held) == 640 and max(held) == capacity * per_token  # full after the window, never more
    assert held[-1] == held[100] == capacity * per_token
    with torch.no_grad():  # every step equals a full forward of the text so far (10x the trained window)
        full = model(out.sequences[:, :-1]).logits[0, 7:]
    assert max_diff(torch.stack(out.scores, dim=1)[0], full) <= 1e-4


def test_sinks_left_padded_generation_past_the_window_equals_each_row_alone():
    model = sink_model("llama", num_sinks=2, window=5)
    sequences = [random_ids(1, 11, seed=3)[0], random_ids(1, 4, seed=4)[0]]
    ids, mask = left_pad(sequences)
    options = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True,
                   pad_token_id=0)
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, **options)
        for row, seq in enumerate(sequences):
            alone = model.generate(seq[None], **options)
            assert torch.equal(batch.sequences[row, ids.shape[1]:], alone.sequences[0, len(seq):])
            for step_batch, step_alone in zip(batch.scores, alone.scores):
                assert max_diff(step_batch[row], step_alone[0]) <= 1e-4
    assert batch.past_key_values.layers[0].keys.shape[-2] == 2 + 5 - 1


def test_sinks_bad_caches_and_options_are_refused():
    model = sink_model("llama", num_sinks=2, window=6)
    ids = random_ids(1, 10)
    with pytest.raises(PosEncError, match=r"keeps 4 sinks and a window of 6.*hf_posenc.sink_cache\(model\)"):
        model(ids, past_key_values=hf_posenc.SinkCache(2, num_sinks=4, window=6), use_cache=True)
    alibi = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    with pytest.raises(PosEncError, match=r"patched with 'alibi', which attends to all of them"):
        alibi(ids, past_key_values=hf_posenc.SinkCache(2, num_sinks=2, window=6), use_cache=True)
    with pytest.raises(PosEncError, match=r"needs a model patched with 'sinks'; this one is not patched"):
        hf_posenc.sink_cache(tiny_model("llama"))
    with pytest.raises(PosEncError, match=r"SinksConfig.num_sinks=0 .*pass an integer"):
        hf_posenc.patch_model(tiny_model("llama"), "sinks", num_sinks=0)
    with pytest.raises(PosEncError, match=r"leaves no room for a window"):
        hf_posenc.patch_model(tiny_model("llama"), "sinks", num_sinks=64)
    with pytest.raises(PosEncError, match=r"SinksConfig.window is required"):
        hf_posenc.patch_model(hf_posenc.patch_model(tiny_model("bloom"), "rope"), "sinks")
    with pytest.raises(PosEncError, match=r"Patch it to 'rope' first"):
        hf_posenc.patch_model(tiny_model("gpt2"), "sinks", window=8)


def test_sinks_unpatch_removes_the_bounded_cache_from_generate():
    model = sink_model("llama", num_sinks=2, window=6)
    assert "_prepare_cache_for_generation" in vars(model)
    hf_posenc.unpatch_model(model)
    assert "_prepare_cache_for_generation" not in vars(model)
    with torch.no_grad():
        out = model.generate(random_ids(1, 4), max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
                             pad_token_id=0)
    assert type(out.past_key_values) is DynamicCache


@pytest.mark.parametrize("method,options", CASES)
@pytest.mark.parametrize("two_calls", [True, False])
def test_sdpa_on_near_and_far_parts_equals_the_scored_path(method, options, two_calls, monkeypatch):
    """Without attention weights to return, each query block is SDPA on the method's near and far parts (block_parts):
    on CPU kernel calls merged by logsumexp (NearFarAttention), elsewhere one call with both assignments side by
    side along the head dimension. Either way its logits and the model's gradients equal those of block_scores with an
    eager softmax, in float64, over several blocks, for a left-padded batch and a chunk after a cache."""
    if not two_calls:
        monkeypatch.setattr(near_far, "cpu_flash_applies", lambda query: False)
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options).double()
    padded, mask = left_pad([random_ids(1, 30, seed=3)[0], random_ids(1, 19, seed=4)[0]])
    ids = random_ids(2, 30)
    monkeypatch.setattr(geometry, "BLOCK_BYTES", 4 * 2 * 30 * 7)  # blocks of 7 rows, 3 (eager) or so

    def run():
        return padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 11)

    attention_module.last_paths.clear()
    parts = run()
    assert attention_module.last_paths["scored parts"] > 0
    monkeypatch.setattr(type(hf_posenc.get_positional_module(model)), "block_near", lambda self, *args: None)
    attention_module.last_paths.clear()
    scored = run()
    assert attention_module.last_paths["scored parts"] == 0 and len(parts) == len(scored) > 2
    for a, b in zip(parts, scored):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())  # block_scores are float32


def test_mask_segments_cut_a_parts_keys_where_the_kernel_needs_no_mask():
    """A part's keys: the columns every row allows (no mask), then the masked band, then the causal square (the
    kernel's flag); a mask with none of these shapes stays one masked segment."""
    rows, keys = 4, 11
    row, key = torch.arange(rows)[:, None] + keys - rows, torch.arange(keys)[None]
    near = ((key <= row) & (row - key < 6))[None, None]  # a window of 6: a band, then the causal square
    far = (row - key >= 6)[None, None]  # the keys past the window: all allowed, then a band
    causal = (key <= row)[None, None]
    cut = near_far.mask_segments
    assert cut(near) == [(slice(0, 7), "mask"), (slice(7, 11), near_far.CAUSAL)]
    assert cut(far) == [(slice(0, 2), None), (slice(2, 11), "mask")]
    assert cut(causal) == [(slice(0, 7), None), (slice(7, 11), near_far.CAUSAL)]
    assert cut(causal[..., 7:]) == [(slice(0, 4), near_far.CAUSAL)]
    padded = torch.cat((causal, causal.clone()))
    padded[1, ..., 0] = False  # a left-padded row: no column is allowed to every row of the batch
    assert cut(padded) == [(slice(0, 7), "mask"), (slice(7, 11), near_far.CAUSAL)]
    assert cut(near[..., :0]) == []


@pytest.mark.parametrize("method,options", [("sinks", {"num_sinks": 2, "window": 40}), ("rerope", {"window": 40}),
                                            ("self-extend", {"window": 6, "group": 2})])
def test_parts_run_unmasked_and_causal_segments_where_the_mask_allows(method, options, monkeypatch):
    """Each part's keys go to the kernel in segments (mask_segments): the keys every row allows with no mask, the
    diagonal square with the kernel's causal flag, the rest with the mask. Logits and gradients equal block_scores',
    in float64, for a left-padded batch (whose padded rows keep the mask) and a chunk after a cache."""
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options).double()
    padded, mask = left_pad([random_ids(1, 30, seed=3)[0], random_ids(1, 19, seed=4)[0]])
    ids = random_ids(2, 30)
    monkeypatch.setattr(geometry, "BLOCK_BYTES", 4 * 2 * 30 * 7)
    kinds, original = set(), near_far.mask_segments

    def mask_segments(allowed):
        segments = original(allowed)
        kinds.update(kind for _, kind in segments)
        return segments

    monkeypatch.setattr(near_far, "mask_segments", mask_segments)
    parts = padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 11)
    assert kinds == {None, "mask", near_far.CAUSAL}
    monkeypatch.setattr(type(hf_posenc.get_positional_module(model)), "block_near", lambda self, *args: None)
    scored = padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 11)
    for a, b in zip(parts, scored):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())  # block_scores are float32


@pytest.mark.parametrize("method,options", [("sinks", {"num_sinks": 2, "window": 40}), ("rerope", {"window": 40}),
                                            ("self-extend", {"window": 40, "group": 4}),
                                            ("rerope", {"window": 40, "log_scaling": True,
                                                        "original_max_position_embeddings": 8})])
def test_a_call_within_the_window_is_one_causal_kernel_call(method, options, monkeypatch):
    """A call with no cache before it and no padding whose every causal pair is within the window is ordinary RoPE
    attention: one causal SDPA call (`window_holds`). Its logits and gradients equal the per-block path's, in
    float64; positions that span the window (a PoSE-like jump) or a left-padded batch go per block."""
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options).double()
    ids = random_ids(2, 30)

    def run(position_ids=None):
        model.zero_grad()
        logits = model(ids, position_ids=position_ids).logits
        logits.sin().sum().backward()
        return [logits] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    attention_module.last_paths.clear()
    whole = run()
    assert attention_module.last_paths["scored causal"] > 0 and attention_module.last_paths["scored parts"] == 0
    jump = torch.cat((torch.arange(15), torch.arange(15) + 60))[None].expand(2, -1)
    attention_module.last_paths.clear()
    run(jump)
    assert attention_module.last_paths["scored causal"] == 0 and attention_module.last_paths["scored parts"] > 0
    monkeypatch.setattr(type(hf_posenc.get_positional_module(model)), "window_holds", lambda self, *args: False)
    attention_module.last_paths.clear()
    blocked = run()
    assert attention_module.last_paths["scored causal"] == 0 and len(whole) == len(blocked) > 2
    for a, b in zip(whole, blocked):
        assert max_diff(a, b) <= 1e-10 * max(1.0, b.abs().max())


@pytest.mark.parametrize("method,options", [("rerope", {"window": 10}), ("self-extend", {"window": 9, "group": 3}),
                                            ("sinks", {"num_sinks": 2, "window": 10})])
def test_far_keys_that_form_a_causal_triangle_are_one_kernel_call(method, options, monkeypatch):
    """With no padding and no cache longer than the window before the call, Self-Extend's and ReRoPE's far keys are
    one causal triangle, key j <= query i - window: one kernel call for the layer call (NearFarAttention's far_rows),
    merged with the per-block near calls. Its logits and gradients equal block_scores', in float64, for a whole
    sequence and for chunks after caches shorter and longer than the window (the latter per block), with a window that
    ends inside a block. Sinks' far keys (the sinks) are no triangle and go per block. (The fused CPU kernel, which
    serves a whole sequence's triangle under "auto", is held off: tests/test_fused_cpu.py has it.)"""
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options).double()
    without_kernel(monkeypatch, hf_posenc.get_positional_module(model), near_far=False)
    monkeypatch.setattr(geometry, "BLOCK_BYTES", 4 * 2 * 30 * 7)  # blocks of 7 rows
    ids = random_ids(2, 30)
    triangles = []

    def run():
        model.zero_grad()
        logits = []
        for splits in ((30,), (4, 30), (15, 30)):
            cache, start = DynamicCache(config=model.config), 0
            for stop in splits:
                attention_module.last_paths.clear()
                logits.append(model(ids[:, start:stop], past_key_values=cache, use_cache=True).logits)
                triangles.append(attention_module.last_paths["scored far triangle"])
                start = stop
        sum(chunk.sin().sum() for chunk in logits).backward()
        return logits + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    parts = run()
    layers = model.config.num_hidden_layers
    assert triangles == ([0] * 5 if method == "sinks" else [layers, 0, layers, layers, 0])  # 4 tokens: no far key
    monkeypatch.setattr(type(hf_posenc.get_positional_module(model)), "block_near", lambda self, *args: None)
    scored = run()
    for a, b in zip(parts, scored, strict=True):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())  # block_scores are float32


def test_near_far_plans_are_made_once_per_forward_and_keep_only_band_masks(monkeypatch):
    """Every layer of a forward attends with the same positions, mask and blocks: the first layer builds each block's
    masks and kernel calls (_near_far_plans), the other layers and the backward reuse them. Self-Extend's masked
    segments are bands (at most twice a block's rows wide) and are kept; a left-padded batch's masked segments span
    the keys, are not kept, and are built again in each layer's forward and backward."""
    model = hf_posenc.patch_model(tiny_model("llama"), "self-extend", window=6, group=2)
    monkeypatch.setattr(geometry, "BLOCK_BYTES", 4 * 2 * 30 * 7)
    built, plans_seen, block_rows = [], [], []
    near_far_masks, near_far_plans = near_far._near_far_masks, near_far._near_far_plans
    monkeypatch.setattr(near_far, "_near_far_masks",
                        lambda *a, **k: built.append(1) or near_far_masks(*a, **k))

    def plans_of(call, blocks, *args):
        block_rows.append(blocks[0][0].stop - blocks[0][0].start)
        plans_seen.append(near_far_plans(call, blocks, *args))
        return plans_seen[-1]

    monkeypatch.setattr(near_far, "_near_far_plans", plans_of)

    def train_step(*args, **kwargs):
        built.clear()
        plans_seen.clear()
        model(*args, **kwargs).logits.sum().backward()
        assert len(plans_seen) == model.config.num_hidden_layers >= 2
        assert all(plans is plans_seen[0] for plans in plans_seen)
        return plans_seen[0]

    plans, far_rows = train_step(random_ids(1, 30))
    assert far_rows == 6  # the far keys are one causal triangle: only the near calls are planned per block
    # once per block and once for the last row (_far_triangle_start), for every layer, forward and backward
    assert len(plans) > 2 and len(built) == len(plans) + 1
    kept = [arguments["attn_mask"] for calls in plans for *_, arguments in calls if "attn_mask" in arguments]
    assert kept and all(mask.shape[-1] <= 2 * block_rows[0] < 30 for mask in kept)
    padded, mask = left_pad([random_ids(1, 30, seed=3)[0], random_ids(1, 19, seed=4)[0]])
    plans, far_rows = train_step(padded, attention_mask=mask)
    assert far_rows is None and any(part == 1 for calls in plans for part, *_ in calls)
    wide = sum(arguments is None for calls in plans for *_, arguments in calls)
    assert wide and len(built) > len(plans) + 2 * model.config.num_hidden_layers


def held_for_backward(model, length: int) -> int:
    """Bytes that a training forward of `length` tokens leaves allocated (for its backward): what its ops allocated
    net of what they freed, by the profiler's count, so that tensors kept anywhere (closures too) count."""
    ids = random_ids(1, length)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profiler:
        hidden = model.model(ids).last_hidden_state
    held = sum(event.self_cpu_memory_usage for event in profiler.events())
    hidden.sum().backward()
    return held


@pytest.mark.parametrize("method,options", [CASES[0], CASES[2], CASES[4]])
@pytest.mark.parametrize("two_calls", [True, False])
def test_training_memory_of_the_near_far_parts_grows_linearly(method, options, two_calls, monkeypatch):
    """The parts' masks are rebuilt in the backward (a checkpoint off the CPU kernel), or kept only where they are
    bands (NearFarAttention's plans, at most twice a block's rows wide): what a training forward holds for the
    backward doubles with the length (with each block's masks kept, a byte or more per query-key pair, it grew 2.5x
    from 1024 to 2048 tokens on this model). The fused CPU kernel, held off here, keeps only its inputs, output and
    one logsumexp per row."""
    if not two_calls:
        monkeypatch.setattr(near_far, "cpu_flash_applies", lambda query: False)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)
    model = hf_posenc.patch_model(AutoModelForCausalLM.from_config(config), method, **options).train()
    without_kernel(monkeypatch, hf_posenc.get_positional_module(model), near_far=False)
    attention_module.last_paths.clear()
    short, long = held_for_backward(model, 1024), held_for_backward(model, 2048)
    assert attention_module.last_paths["scored parts"] == 2
    assert long < 2.2 * short, (short, long)
