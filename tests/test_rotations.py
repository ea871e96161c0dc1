"""Learned and generalised rotations (issue 13): ComRoPE (AP, LD), LieRE, FoPE, 2-D RoPE and TAPE. Each is checked against
an independent float64 computation of its paper's formula, for its relativity property, and for init="rope"
reproducing the model's own RoPE (on GPT-2 and BLOOM: the `rope` patch)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_posenc
from helpers import decode_token_by_token, left_pad, max_diff
from hf_posenc.methods.block_rotation import block_exponentials
from tiny_models import random_ids, tiny_model

ROPE_LIKE = [("comrope-ap", {}), ("comrope-ap", {"block_size": 2}), ("comrope-ld", {"block_size": 8}),
             ("liere", {}), ("fope", {"clip_floor": False}), ("rope-2d", {}),
             ("comrope-ap", {"per_head": True}), ("liere", {"block_size": 8, "per_head": True}),
             ("fope", {"clip_floor": False, "per_head": True}), ("rope-2d", {"per_head": True}),
             ("rope-2d", {"per_layer": True}), ("rope-2d", {"per_layer": True, "per_head": True}), ("tape", {})]


def method_on(model_type: str, method: str, **options):
    """A tiny model patched with `method`, and the module of the method."""
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    return model, hf_posenc.get_positional_module(model)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gpt2", "bloom"])
@pytest.mark.parametrize("method,options", ROPE_LIKE)
def test_init_rope_reproduces_the_models_rope(method, options, model_type):
    model = tiny_model(model_type)
    if model_type in ("gpt2", "bloom"):
        hf_posenc.patch_model(model, "rope")  # no RoPE of their own: the `rope` patch is the reference
    ids = random_ids(2, 20)
    with torch.no_grad():
        reference = model(ids).logits
        hf_posenc.patch_model(model, method, **options)
        assert max_diff(model(ids).logits, reference) <= 1e-5


def test_trainable_parameters_are_named_under_posenc():
    for method, options in ROPE_LIKE:
        model, module = method_on("llama", method, **options)
        names = [name for name, p in model.named_parameters() if any(p is q for q in module.parameters())]
        assert names and all(".posenc." in f".{name}" for name in names), (method, names)


# --- ComRoPE and LieRE: exp(p A) by blocks ---------------------------------------------------------------------------
def reference_rotation(generators: np.ndarray, position: float, dim: int) -> np.ndarray:
    """The [dim, dim] rotation exp(p A) in the half-split layout, in float64 by eigendecomposition (A is normal)."""
    block = generators.shape[-1]
    full = np.zeros((dim, dim))
    for index, matrix in enumerate(generators):
        full[index * block:(index + 1) * block, index * block:(index + 1) * block] = matrix
    values, vectors = np.linalg.eig(position * full)
    exponential = (vectors @ np.diag(np.exp(values)) @ np.linalg.inv(vectors)).real
    # pair-neighbour layout (k, k + d/2 adjacent) -> half-split layout
    order = np.stack((np.arange(dim // 2), np.arange(dim // 2) + dim // 2), axis=-1).reshape(-1)
    permutation = np.zeros((dim, dim))
    permutation[order, np.arange(dim)] = 1.0
    return permutation @ exponential @ permutation.T


@pytest.mark.parametrize("method,options", [("comrope-ap", {"block_size": 4}), ("comrope-ld", {"block_size": 2}),
                                            ("liere", {})])
def test_block_rotations_match_a_float64_reference(method, options):
    torch.manual_seed(3)
    _, module = method_on("llama", method, init="random", init_std=0.3, **options)
    query = torch.randn(1, 2, 5, 16)
    positions = torch.tensor([[0, 1, 7, 20, 33]])
    rotated = module.rotate_heads(query, module.rotation(positions)).detach()
    generators = module.generators().detach().double().numpy()
    for slot, position in enumerate(positions[0].tolist()):
        expected = query[0, :, slot].double().numpy() @ reference_rotation(generators, position, 16).T
        # float32 matrix_exp of angles p ||A|| up to ~30 here: a few float32 ulps times that
        assert np.abs(rotated[0, :, slot].double().numpy() - expected).max() <= 5e-5


@pytest.mark.parametrize("method", ["comrope-ap", "comrope-ld"])
def test_comrope_is_relative(method):
    torch.manual_seed(4)
    _, module = method_on("llama", method, init="random", init_std=0.2)
    positions = torch.tensor([[0, 3, 11, 40]])
    rotations = module.rotation(positions)[0]  # [4, blocks, b, b]
    differences = module.rotation(torch.tensor([[3 - 0, 40 - 11, 11 - 40]]))[0]
    # R(x)^T R(y) = R(y - x)
    for (x, y), expected in zip([(0, 1), (2, 3), (3, 2)], differences):
        assert max_diff(rotations[x].transpose(-1, -2) @ rotations[y], expected) <= 1e-5
    # q_i . k_j depends on j - i alone: shifting every position changes no score
    query, key = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    scores = []
    for shift in (0, 57):
        q, k = module.rotate_query_key(query, key, positions + shift, positions + shift, 0)
        scores.append(q @ k.transpose(-1, -2))
    assert max_diff(*scores) <= 1e-4


def test_liere_relativity_deviation():
    """One position axis (a causal LM's): exp(p A) is exactly relative, and float32 matrix_exp stays within 2e-4 of it
    up to distance 4096 for a random dense generator. Two axes with generic (non-commuting) generators, as in the
    paper's images: R(x)^T R(y) differs from R(y - x) by O(1); the figures are in docs/methods.md."""
    torch.manual_seed(5)
    _, module = method_on("llama", "liere", init="random", init_std=0.02)
    pairs = torch.tensor([[0, 1], [100, 4096], [4000, 17]])
    x, y = module.rotation(pairs[:, :1].T)[0], module.rotation(pairs[:, 1:].T)[0]
    relative = module.rotation((pairs[:, 1:] - pairs[:, :1]).T)[0]
    one_axis = max_diff(x.transpose(-1, -2) @ y, relative)
    assert one_axis <= 2e-4
    generators = torch.stack([module.generators(), module.generators().roll(1, dims=-1).tril(-1)])
    generators = generators - generators.transpose(-1, -2)  # two generic skew-symmetric generators
    def exp_of(point):
        return torch.linalg.matrix_exp(point[0] * generators[0] + point[1] * generators[1])
    a, b = torch.tensor([3.0, 5.0]), torch.tensor([10.0, -2.0])
    two_axes = max_diff(exp_of(a).transpose(-1, -2) @ exp_of(b), exp_of(b - a))
    assert two_axes > 1e-2


def test_block_size_must_divide_the_rotary_dimension():
    with pytest.raises(hf_posenc.PosEncError, match="block_size=6"):
        method_on("llama", "comrope-ap", block_size=6)
    with pytest.raises(hf_posenc.PosEncError, match="block_size"):
        hf_posenc.ComRopeApConfig(block_size=3)
    with pytest.raises(hf_posenc.PosEncError, match="init"):
        hf_posenc.LiereConfig(init="xavier")


def test_closed_form_two_by_two_is_exp_to_float32_precision():
    """The closed form (cos, sin of the angle) keeps float32 precision at large angles, where float32 matrix_exp
    drifts (at angle 210 here)."""
    generators = torch.tensor([[[0.0, -0.7], [0.7, 0.0]], [[0.0, 0.05], [-0.05, 0.0]]])
    positions = torch.tensor([[0, 5, 300]])
    exact = torch.linalg.matrix_exp(positions[..., None, None, None].double() * generators.double())
    assert max_diff(block_exponentials(generators, positions), exact) <= 1e-5


# --- FoPE ----------------------------------------------------------------------------------------------------------
def test_fope_matches_a_float64_reference_and_clips_the_floor():
    torch.manual_seed(6)
    _, module = method_on("llama", "fope", init="random", sigma=0.3)  # window 64: floor 2 pi / 64
    positions = torch.tensor([[0, 9, 63, 200]])
    cos, sin = (part.detach() for part in module.cos_sin(positions))
    theta, dim, window = 10000.0, 16, 64
    freqs = theta ** (-np.arange(0, dim, 2) / dim)
    freqs = np.where(freqs < 2 * math.pi / window, 0.0, freqs)
    assert (freqs == 0).sum() >= 1
    angles = positions[0].numpy()[:, None] * freqs
    expected_cos = np.cos(angles) @ module.cos_coefficients.detach().double().numpy()
    expected_sin = np.sin(angles) @ module.sin_coefficients.detach().double().numpy()
    # float32 angles up to 200 (rounding ~1e-5) mixed over 8 coefficients
    assert np.abs(cos[0, :, :8].double().numpy() - expected_cos).max() <= 1e-4
    assert np.abs(sin[0, :, 8:].double().numpy() - expected_sin).max() <= 1e-4


def test_fope_with_clipping_differs_from_rope():
    model = tiny_model("llama")
    ids = random_ids(1, 30)
    with torch.no_grad():
        reference = model(ids).logits
        hf_posenc.patch_model(model, "fope")  # clip_floor=True: the lowest frequencies become 0
        assert max_diff(model(ids).logits, reference) > 1e-4


# --- 2-D RoPE -------------------------------------------------------------------------------------------------------
def grid(rows: int, columns: int, origin=(0, 0)) -> torch.Tensor:
    """[1, rows * columns, 2] (row, column) of a patch grid read row by row."""
    r, c = torch.meshgrid(torch.arange(rows) + origin[0], torch.arange(columns) + origin[1], indexing="ij")
    return torch.stack((r.flatten(), c.flatten()), dim=-1)[None]


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
@pytest.mark.parametrize("variant", ["mixed", "axial"])
def test_rope_2d_on_a_patch_grid_is_translation_invariant(model_type, variant):
    model, _ = method_on(model_type, "rope-2d", variant=variant, init="random")
    # BLOOM's causal-LM class drops position_ids: 2-D positions reach it through its base model only.
    run = model.transformer if model_type == "bloom" else model
    ids = random_ids(1, 12)
    with torch.no_grad():
        here = run(ids, position_ids=grid(3, 4)).last_hidden_state if model_type == "bloom" else \
            run(ids, position_ids=grid(3, 4)).logits
        shifted = run(ids, position_ids=grid(3, 4, origin=(5, 9)))
        transposed = run(ids, position_ids=grid(3, 4).flip(-1))
    shifted = shifted.last_hidden_state if model_type == "bloom" else shifted.logits
    transposed = transposed.last_hidden_state if model_type == "bloom" else transposed.logits
    assert max_diff(here, shifted) <= 1e-5
    assert max_diff(here, transposed) > 1e-4  # the axes are told apart (positions move tiny BLOOM's states ~1e-3)


def test_rope_2d_cached_decoding_padding_and_gradients_on_a_grid():
    model, module = method_on("llama", "rope-2d", init="random")
    ids, positions = random_ids(2, 12), grid(3, 4).expand(2, -1, -1)
    with torch.no_grad():
        full = model(ids, position_ids=positions).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, i:i + 1], position_ids=positions[:, i:i + 1], past_key_values=cache,
                       use_cache=True).logits for i in range(12)]
        assert max_diff(full, torch.cat(steps, dim=1)) <= 1e-4
        padded, mask = left_pad([ids[0], ids[1, :8]])
        padded_positions = torch.cat((torch.zeros(1, 4, 2, dtype=torch.long), positions[1:, :8]), dim=1)
        batch = model(padded, attention_mask=mask, position_ids=torch.cat((positions[:1], padded_positions))).logits
        alone = model(ids[1:, :8], position_ids=positions[1:, :8]).logits
        assert max_diff(batch[1, 4:], alone[0]) <= 1e-4
    model.train()
    model(ids, position_ids=positions, labels=ids).loss.backward()
    assert module.row_rates.grad.abs().sum() > 0 and module.column_rates.grad.abs().sum() > 0


def test_rope_2d_refuses_1d_positions_and_1d_methods_refuse_2d_positions():
    model, _ = method_on("llama", "rope-2d")
    with pytest.raises(hf_posenc.PosEncError, match=r"pass position_ids of shape \[B, 6, 2\]"):
        model(random_ids(1, 6), position_ids=torch.arange(6)[None])
    rope_model = hf_posenc.patch_model(tiny_model("gpt2"), "comrope-ap")
    with pytest.raises(hf_posenc.PosEncError, match=r"pass position_ids of shape \[B, 6\]"):
        rope_model(random_ids(1, 6), position_ids=grid(2, 3))


# --- one rotation per forward ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [("comrope-ap", {"block_size": 4}), ("liere", {}),
                                            ("dynamic", {"factor": 2.0})])
def test_rotations_are_computed_once_per_forward_and_shared_by_the_layers(method, options, monkeypatch):
    """Methods that rotate inside the attention path (matrix exponentials for ComRoPE/LieRE, the length-dependent
    cos/sin of the dynamic scalings) compute each rotation once per forward, not once per layer: a full forward makes
    one (queries and keys have the same positions), a decoding step two (the new queries, the whole key cache), for
    the tiny model's 2 layers; the logits equal those of computing them in every layer."""
    extra = {} if method == "dynamic" else {"init": "random", "init_std": 0.2}
    model, module = method_on("llama", method, **options, **extra)
    ids = random_ids(2, 12)
    calls = []
    rotation = module.rotation
    monkeypatch.setattr(module, "rotation", lambda *args, **kwargs: calls.append(1) or rotation(*args, **kwargs))
    with torch.no_grad():
        full = model(ids).logits
        assert len(calls) == 1
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        calls.clear()
        step = model(ids[:, 8:9], past_key_values=cache, use_cache=True).logits
        assert len(calls) == 2
        # per layer, as before: every layer computes its own rotations (in a decoding step the queries' and the
        # keys' are two objects, so the block rotations rotate them in two products, not one: equal up to the
        # products' rounding; in the prefill the keys, at the queries' positions, take the queries' rotation)
        monkeypatch.setattr(hf_posenc.engine.state.PositionState, "rotation_of",
                            lambda state, positions, layer_idx=0: state.method.rotation(positions, state.forward.seq_len))
        assert max_diff(model(ids).logits, full) <= 1e-5
        calls.clear()
        cache = DynamicCache(config=model.config)
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        assert max_diff(model(ids[:, 8:9], past_key_values=cache, use_cache=True).logits, step) <= 1e-5
        assert len(calls) == 1 + 2 * 1 + 1 + 2 * 2  # queries once, then per layer: prefill 1, step 2


@pytest.mark.parametrize("method,options", [("liere", {}), ("liere", {"per_head": True}),
                                            ("comrope-ap", {"block_size": 4}),
                                            ("comrope-ld", {"block_size": 2, "per_head": True})])
def test_queries_and_keys_at_the_same_positions_are_rotated_in_one_product(method, options, monkeypatch):
    """A full forward rotates queries and keys (GQA: 4 query heads, 2 key heads) in one product per position, each
    key head beside its query group so that per-head generators still meet their own heads."""
    model, module = method_on("llama", method, init="random", init_std=0.2, **options)
    generator = torch.Generator().manual_seed(0)
    query, key = torch.randn(2, 4, 7, 16, generator=generator), torch.randn(2, 2, 7, 16, generator=generator)
    rotation = module.rotation(torch.arange(3, 10)[None])
    rotated_query, rotated_key = module.rotate_together(query, key, rotation)
    assert max_diff(rotated_query, module.rotate_heads(query, rotation)) <= 1e-6
    assert max_diff(rotated_key, module.rotate_heads(key, rotation)) <= 1e-6
    calls = []
    together = type(module).rotate_together
    monkeypatch.setattr(type(module), "rotate_together", lambda *args: calls.append(1) or together(*args))
    with torch.no_grad():
        model(random_ids(2, 12))
    assert len(calls) == model.config.num_hidden_layers


# --- per-head parameters -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,options", [("comrope-ap", {"block_size": 4}), ("comrope-ld", {"block_size": 2}),
                                            ("liere", {})])
def test_per_head_block_rotations_match_a_float64_reference(method, options):
    """per_head=True: each key-value head rotates by exp(p A_g) with its own generator, and the query heads of its
    group (tiny LLaMA: 4 query heads, 2 key-value heads) by the same."""
    torch.manual_seed(7)
    _, module = method_on("llama", method, init="random", init_std=0.3, per_head=True, **options)
    generators = module.generators().detach().double().numpy()
    assert generators.shape[0] == 2 and np.abs(generators[0] - generators[1]).max() > 1e-2
    query = torch.randn(1, 4, 5, 16)
    positions = torch.tensor([[0, 1, 7, 20, 33]])
    rotated = module.rotate_heads(query, module.rotation(positions)).detach()
    keys = module.rotate_heads(query[:, ::2], module.rotation(positions)).detach()  # 2 heads: the kv heads
    for slot, position in enumerate(positions[0].tolist()):
        for head in range(4):
            expected = query[0, head, slot].double().numpy() @ reference_rotation(generators[head // 2], position,
                                                                                  16).T
            assert np.abs(rotated[0, head, slot].double().numpy() - expected).max() <= 5e-5
        for head in range(2):
            expected = query[0, 2 * head, slot].double().numpy() @ reference_rotation(generators[head], position,
                                                                                      16).T
            assert np.abs(keys[0, head, slot].double().numpy() - expected).max() <= 5e-5


def test_per_head_fope_matches_a_float64_reference_and_decodes_exactly():
    torch.manual_seed(8)
    model, module = method_on("llama", "fope", init="random", sigma=0.3, per_head=True)
    assert module.cos_coefficients.shape == (2, 8, 8) and module.rotates_in_attention
    positions = torch.tensor([[0, 9, 63, 200]])
    cos, sin = (part.detach() for part in module.cos_sin(positions))  # [1, 4, heads, 16]
    freqs = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    freqs = np.where(freqs < 2 * math.pi / 64, 0.0, freqs)
    angles = positions[0].numpy()[:, None] * freqs
    for head in range(2):
        expected_cos = np.cos(angles) @ module.cos_coefficients[head].detach().double().numpy()
        expected_sin = np.sin(angles) @ module.sin_coefficients[head].detach().double().numpy()
        assert np.abs(cos[0, :, head, :8].double().numpy() - expected_cos).max() <= 1e-4
        assert np.abs(sin[0, :, head, 8:].double().numpy() - expected_sin).max() <= 1e-4
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        assert max_diff(full, decode_token_by_token(model, ids, DynamicCache(config=model.config))) <= 1e-4


def test_per_head_rope_2d_matches_a_float64_reference_and_decodes_on_a_grid():
    """Mixed 2-D RoPE with per_head=True: angle_k = x wx_hk + y wy_hk per key-value head, rotated inside the attention
    path by the coordinates of the queries and of the cached keys (kept on the cache beside their positions)."""
    torch.manual_seed(9)
    model, module = method_on("llama", "rope-2d", init="random", per_head=True)
    assert module.column_rates.shape == (2, 8) and module.rotates_in_attention
    coordinates = torch.tensor([[[0, 0], [2, 5], [7, 1]]])
    cos, sin = module.cos_sin(coordinates)  # [1, 3, heads, 16]
    column, row = module.column_rates.detach().double().numpy(), module.row_rates.detach().double().numpy()
    for head in range(2):
        angles = coordinates[0, :, 1:].double().numpy() * column[head] + coordinates[0, :, :1].double().numpy() * \
            row[head]
        assert np.abs(cos[0, :, head, :8].detach().double().numpy() - np.cos(angles)).max() <= 1e-5
        assert np.abs(sin[0, :, head, 8:].detach().double().numpy() - np.sin(angles)).max() <= 1e-5
    ids, positions = random_ids(2, 12), grid(3, 4).expand(2, -1, -1)
    with torch.no_grad():
        full = model(ids, position_ids=positions).logits
        assert max_diff(full, model(ids, position_ids=positions + torch.tensor([4, 7])).logits) <= 1e-5
        assert max_diff(full, model(ids, position_ids=positions.flip(-1)).logits) > 1e-4
        for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=16)):
            steps = [model(ids[:, i:i + 1], position_ids=positions[:, i:i + 1], past_key_values=cache,
                           use_cache=True).logits for i in range(12)]
            assert max_diff(full, torch.cat(steps, dim=1)) <= 1e-4
    with pytest.raises(hf_posenc.PosEncError, match=r"Rope2dConfig.per_head=True has nothing to learn per head"):
        hf_posenc.Rope2dConfig(variant="axial", per_head=True)


@pytest.mark.parametrize("per_head", [False, True])
def test_per_layer_rope_2d_gives_each_layer_its_own_frequencies(per_head):
    """Mixed 2-D RoPE with per_layer=True (the paper's frequencies per layer): layer l turns by its own wx_l, wy_l
    (checked against float64 cos/sin), equal rates in every layer give the shared-rate model's logits, changing layer 1's
    alone changes them; on a grid it stays translation invariant, decodes exactly, and every layer's rates train."""
    torch.manual_seed(11)
    model, module = method_on("llama", "rope-2d", init="random", per_layer=True, per_head=per_head)
    assert module.column_rates.shape == ((2, 2, 8) if per_head else (2, 8)) and module.rotates_in_attention
    coordinates = torch.tensor([[[0, 0], [2, 5], [7, 1]]])
    for layer in range(2):
        cos, sin = module.layer_rotation(layer, coordinates)
        column, row = (rates[layer].detach().double().numpy() for rates in (module.column_rates, module.row_rates))
        angles = coordinates[0, :, 1:].double().numpy()[..., None, :] * column + \
            coordinates[0, :, :1].double().numpy()[..., None, :] * row if per_head else \
            coordinates[0, :, 1:].double().numpy() * column + coordinates[0, :, :1].double().numpy() * row
        assert np.abs(cos[0, ..., :8].detach().double().numpy() - np.cos(angles)).max() <= 1e-5
        assert np.abs(sin[0, ..., 8:].detach().double().numpy() - np.sin(angles)).max() <= 1e-5
    ids, positions = random_ids(2, 12), grid(3, 4).expand(2, -1, -1)
    shared, shared_module = method_on("llama", "rope-2d", init="random", per_head=per_head)
    with torch.no_grad():
        for rates, own in ((module.column_rates, shared_module.column_rates), (module.row_rates,
                                                                                  shared_module.row_rates)):
            rates[1] = rates[0]
            own.copy_(rates[0])
        full = model(ids, position_ids=positions).logits
        assert max_diff(full, shared(ids, position_ids=positions).logits) <= 1e-5
        module.column_rates[1] += 0.05
        full = model(ids, position_ids=positions).logits
        assert max_diff(full, shared(ids, position_ids=positions).logits) > 1e-4
        assert max_diff(full, model(ids, position_ids=positions + torch.tensor([4, 7])).logits) <= 1e-5
        for cache in (DynamicCache(config=model.config), StaticCache(config=model.config, max_cache_len=16)):
            steps = [model(ids[:, i:i + 1], position_ids=positions[:, i:i + 1], past_key_values=cache,
                           use_cache=True).logits for i in range(12)]
            assert max_diff(full, torch.cat(steps, dim=1)) <= 1e-4
    model.train()
    model(ids, position_ids=positions, labels=ids).loss.backward()
    for rates in (module.column_rates, module.row_rates):
        assert all(rates.grad[layer].abs().sum() > 0 for layer in range(2))
    with pytest.raises(hf_posenc.PosEncError, match=r"Rope2dConfig.per_layer=True has nothing to learn per layer"):
        hf_posenc.Rope2dConfig(variant="axial", per_layer=True)


# --- TAPE: position features updated layer by layer -----------------------------------------------------------------
def tape_reference(model, module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a tiny LLaMA with TAPE, in float64 and complex arithmetic, written from the paper's formulas (the
    tape.py docstring) with the model's own modules, one row at a time: z = exp(i p w) at the first layer; q and k
    turned by z per plane; a = the attention average of the keys' z; u = z + A a; z' = u + D diag(silu(W x)) U u."""
    reference = __import__("copy").deepcopy(model).double()
    layers, config = reference.model.layers, reference.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim, group = config.hidden_size // heads, heads // config.num_key_value_heads
    half = dim // 2
    A, U, D, W = (getattr(module, name).detach().double() for name in
                  ("attention_mix", "feature_up", "feature_down", "content_gate"))
    frequencies = 10000.0 ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
    rows = []
    for row in ids:
        length = row.shape[0]
        hidden = reference.model.embed_tokens(row)
        z = torch.exp(1j * torch.arange(length, dtype=torch.float64)[:, None] * frequencies)  # [T, d/2]
        z = z.expand(kv_heads, -1, -1).clone()  # [H_kv, T, d/2]
        averaged = None
        for index, layer in enumerate(layers):
            x = layer.input_layernorm(hidden)
            if averaged is not None:
                u = z + torch.einsum("gh,htk->gtk", A[index].to(torch.complex128), averaged)
                gate = torch.nn.functional.silu(x @ W[index].T)  # [T, m]
                up = torch.einsum("mg,gtk->mtk", U[index].to(torch.complex128), u) * gate.T[..., None]
                z = u + torch.einsum("gm,mtk->gtk", D[index].to(torch.complex128), up)
            attention = layer.self_attn
            q = attention.q_proj(x).view(length, heads, dim)
            k = attention.k_proj(x).view(length, kv_heads, dim)
            v = attention.v_proj(x).view(length, kv_heads, dim)
            out, averaged = torch.zeros(length, heads, dim, dtype=torch.float64), []
            for h in range(heads):
                g = h // group
                Q = torch.complex(q[:, h, :half], q[:, h, half:]) * z[g]
                K = torch.complex(k[:, g, :half], k[:, g, half:]) * z[g]
                logits = (Q @ K.conj().T).real * dim ** -0.5
                logits = logits.masked_fill(torch.ones(length, length).triu(1).bool(), float("-inf"))
                weights = logits.softmax(-1)
                out[:, h] = weights @ v[:, g]
                averaged.append(weights.to(torch.complex128) @ z[g])
            averaged = torch.stack(averaged)
            hidden = hidden + attention.o_proj(out.reshape(length, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        rows.append(reference.lm_head(reference.model.norm(hidden)))
    return torch.stack(rows)


def test_tape_matches_a_float64_reference():
    model, module = method_on("llama", "tape", init="random", init_std=0.3)
    ids = random_ids(2, 14)
    with torch.no_grad():
        assert max_diff(model(ids).logits, tape_reference(model, module, ids).float()) <= 1e-4
        # the updates act: the same model with them at zero (RoPE) differs
        module.attention_mix.zero_()
        module.feature_up.zero_()
        rope = tiny_model("llama")(ids).logits
        assert max_diff(model(ids).logits, rope) <= 1e-5


def turned_features(module, turn):
    """Wrap the module's first-layer features: every token's z multiplied by turn(z) (complex, broadcast)."""
    original = module.initial_features

    def initial_features(positions, batch):
        features = original(positions, batch)
        real, imaginary = features.chunk(2, dim=-1)
        z = torch.complex(real.double(), imaginary.double()) * turn(real.shape)
        return torch.cat((z.real, z.imag), dim=-1).float()
    return initial_features


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
def test_tape_is_equivariant_under_rotations_of_the_position_features(model_type):
    """The paper's orthogonal equivariance, numerically: with random (non-zero) updates, turning every token's
    position features by one rotation per plane leaves the logits unchanged; a shift of all positions (such a rotation)
    too; a rotation that differs from token to token (no symmetry) changes them."""
    model, module = method_on(model_type, "tape", init="random", init_std=0.3)
    ids = random_ids(2, 12)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        logits = model(ids).logits
        plane = torch.exp(1j * 2 * math.pi * torch.rand(module.initial_features(torch.zeros(1, 1), 1).shape[-1] // 2,
                                                         generator=generator, dtype=torch.float64))
        module.initial_features = turned_features(module, lambda shape: plane)
        turned = model(ids).logits
        per_token = torch.exp(1j * 2 * math.pi * torch.rand(12, plane.shape[0], generator=generator,
                                                             dtype=torch.float64))
        module.initial_features = turned_features(module, lambda shape: per_token)
        broken = model(ids).logits
        del module.initial_features
        shifted = model(ids, position_ids=torch.arange(12)[None] + 101).logits
    assert max_diff(logits, turned) <= 1e-5
    assert max_diff(logits, shifted) <= 1e-5
    assert max_diff(logits, broken) > 1e-4  # (positions move tiny BLOOM's logits ~1e-3)


def test_tape_updates_commute_with_plane_rotations():
    """The update maps alone: update(z u, a u) = update(z, a) u for a unit complex u per plane, and the content
    update depends on the content (two inputs give two results)."""
    _, module = method_on("llama", "tape", init="random", init_std=0.3)
    generator = torch.Generator().manual_seed(5)
    previous, mixed = torch.randn(2, 2, 5, 16, generator=generator), torch.randn(2, 4, 5, 16, generator=generator)
    x, other = torch.randn(2, 5, 64, generator=generator), torch.randn(2, 5, 64, generator=generator)
    angle = 2 * math.pi * torch.rand(8, generator=generator)

    def turn(features):
        real, imaginary = features.chunk(2, dim=-1)
        return torch.cat((real * angle.cos() - imaginary * angle.sin(), real * angle.sin() + imaginary * angle.cos()),
                         dim=-1)
    with torch.no_grad():
        updated = module.update_features(1, x, previous, mixed)
        assert max_diff(module.update_features(1, x, turn(previous), turn(mixed)), turn(updated)) <= 1e-5
        assert max_diff(module.update_features(1, other, previous, mixed), updated) > 1e-4


def test_tape_decodes_exactly_and_trains_its_updates():
    model, module = method_on("qwen2", "tape", init="random", init_std=0.3)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        assert max_diff(full, decode_token_by_token(model, ids, DynamicCache(config=model.config))) <= 1e-4
        assert max_diff(full, decode_token_by_token(model, ids, StaticCache(config=model.config,
                                                                            max_cache_len=16))) <= 1e-4
    model.train()
    model(ids, labels=ids).loss.backward()
    for name, parameter in module.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name


def test_tape_refuses_native_base_on_rope_models():
    with pytest.raises(hf_posenc.PosEncError, match="base='none'"):
        hf_posenc.patch_model(tiny_model("llama"), "tape", base="native")
    model = hf_posenc.patch_model(tiny_model("gpt2"), "tape", base="native")  # learned positions kept underneath
    assert model(random_ids(1, 6)).logits.isfinite().all()


@pytest.mark.parametrize("positions", [[[0, 1, 5, 17, 100, 63, 2]],  # a table of every product (dense positions)
                                       [[3, -1, 0, 2], [-5, 4, 1, 0]],  # and of the negative ones (padding)
                                       [[300, 7]]])  # a product per position (few positions far apart)
def test_power_products_equal_matrix_exp_in_float64(positions):
    """exp(p A) for integer positions as products of exp(2^k A) over the bits of |p|: the values and the generator's
    gradient of matrix_exp per position, in float64, dense or block-diagonal, shared or per head."""
    from hf_posenc.methods.block_rotation import power_products

    torch.manual_seed(9)
    positions = torch.tensor(positions)
    for shape in [(1, 8, 8), (2, 3, 4, 4)]:
        upper = torch.randn(shape, dtype=torch.float64).triu(1) * 0.2
        generators = (upper - upper.transpose(-1, -2)).requires_grad_()  # skew: rotations, as the methods' are
        exact = torch.linalg.matrix_exp(positions[(...,) + (None,) * len(shape)].double() * generators)
        products = power_products(generators, positions)
        assert products.shape == exact.shape and max_diff(products, exact) <= 1e-12
        grad = torch.randn_like(exact)
        (expected,) = torch.autograd.grad(exact, generators, grad)
        (got,) = torch.autograd.grad(products, generators, grad)
        assert max_diff(got, expected) <= 1e-10 * expected.abs().max()


def test_power_table_and_bit_products_give_the_same_numbers():
    """The table (a full forward) and the product per position (decoding) multiply the same factors in the same
    order: a decoding step's rotation is the full forward's, bit for bit, in float32."""
    from hf_posenc.methods.block_rotation import bit_products, power_table

    upper = torch.randn(2, 8, 8).triu(1) * 0.3
    generators = upper - upper.transpose(-1, -2)
    factors = torch.linalg.matrix_exp(2.0 ** torch.arange(10)[:, None, None, None] * generators)
    distance = torch.arange(1000)[None]
    assert torch.equal(bit_products(factors, distance)[0], power_table(factors, 1000))
