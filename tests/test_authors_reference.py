"""Methods against float64 references written from their authors' released code (not from ours), on tiny inputs:
FoX's QK-norm and output gate (zhixuan-lin/forgetting-transformer), FoPE with and without the released code's
`fourier_ignore_zero` structure (the FoPE authors' Fourier-Position-Embedding, olmo/model.py), Self-Extend's
positions and attention (datamllab/LongLM). Our paths compute positions, gates and norms in float32, so the
comparisons are at float32 rounding (relative 1e-6, or the angle rounding at the positions used); integer positions
and 0/1 initial coefficients are compared exactly. docs/methods.md "Where we differ from the authors' code" lists
what these references leave as options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import hf_posenc
from hf_posenc import PosEncError
from hf_posenc.engine import attention as attention_module
from hf_posenc.engine.state import STATE_ATTR
from helpers import decode_token_by_token, max_diff
from tiny_models import random_ids, tiny_model


def relative_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return max_diff(got.double(), want) / max(1.0, want.abs().max().item())


def perturbed(module, scale: float = 0.3, seed: int = 5):
    """The module with every parameter moved off its initial value, so that each part acts."""
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    return module


# --- FoX: forgetting-transformer, src/forgetting_transformer/model/forgetting_transformer/ ------------------------------
def authors_group_rms_norm(x: torch.Tensor, weight: torch.Tensor, groups: int, eps: float = 1e-5) -> torch.Tensor:
    """layernorm.py group_norm_ref(is_rms_norm=True) at GroupNorm's default eps (the QK-norm passes none): x [..., H*D]
    split into `groups` heads, each divided by its RMS, times the per-channel weight [H*D]."""
    x = x.unflatten(-1, (groups, -1))
    rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + eps)
    return (x * rstd * weight.unflatten(-1, (groups, -1))).flatten(-2)


def authors_output_gate(o: torch.Tensor, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
    """modeling_forgetting_transformer.py with use_output_gate and ogate_act="sigmoid": glu_linear(ogate_proj(x), o,
    ...) computes sigmoid(ogate_proj(x)) * o before o_proj. o [B, T, H*D], x [B, T, hidden], W [H*D, hidden]."""
    return torch.sigmoid(x @ gate_weight.T) * o


def fox_module(**options):
    model = hf_posenc.patch_model(tiny_model("llama"), "fox", **options)
    return model, perturbed(hf_posenc.get_positional_module(model))


def test_fox_qk_norm_is_the_authors_group_rms_norm_with_its_eps():
    """Queries and keys of RMS about 3e-3, where eps 1e-5 and 1e-6 give norms 40% apart (main had 1e-6)."""
    _, module = fox_module(qk_norm=True)
    generator = torch.Generator().manual_seed(0)
    batch, length, heads, kv_heads, head_dim = 2, 5, 4, 2, 16
    query = 3e-3 * torch.randn(batch, heads, length, head_dim, generator=generator, dtype=torch.float64)
    key = 3e-3 * torch.randn(batch, kv_heads, length, head_dim, generator=generator, dtype=torch.float64)
    x = torch.randn(batch, length, 64, generator=generator, dtype=torch.float64)
    got_query, got_key, _ = module.prepare_heads(0, query, key, key, x)
    for got, tensor, weight, count in ((got_query, query, module.query_norm[0], heads),
                                       (got_key, key, module.key_norm[0], kv_heads)):
        flat = tensor.transpose(1, 2).flatten(-2)  # the authors' [B, T, H*D] layout
        want = authors_group_rms_norm(flat, weight.detach().double().flatten(), count)
        assert relative_diff(got, want.unflatten(-1, (count, head_dim)).transpose(1, 2)) <= 1e-6


def test_fox_authors_output_gate_is_sigmoid_with_normal_init():
    model, module = fox_module(output_gate=True, output_gate_form="authors")
    fresh = hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "fox", output_gate=True,
                                                                   output_gate_form="authors"))
    initial = fresh.output_gate_weight.detach()
    assert initial.abs().max() > 0 and abs(initial.std().item() - 0.02) <= 0.002  # their ogate_proj: N(0, 0.02^2)
    generator = torch.Generator().manual_seed(1)
    output = torch.randn(2, 4, 5, 16, generator=generator, dtype=torch.float64)
    x = torch.randn(2, 5, 64, generator=generator, dtype=torch.float64)
    got = module.finish_output(1, output, x)
    want = authors_output_gate(output.transpose(1, 2).flatten(-2), x, module.output_gate_weight[1].detach().double())
    assert relative_diff(got.transpose(1, 2).flatten(-2), want) <= 1e-6


def test_fox_identity_gate_stays_the_default_and_the_authors_gate_changes_a_native_model_at_init():
    ids = random_ids(1, 10)
    model = tiny_model("llama")
    with torch.no_grad():
        original = model(ids).logits
        identity = hf_posenc.patch_model(model, "fox", base="native", output_gate=True)
        assert hf_posenc.get_posenc_config(identity).output_gate_form == "identity"
        assert max_diff(identity(ids).logits, original) <= 1e-5
        authors = hf_posenc.patch_model(tiny_model("llama"), "fox", base="native", output_gate=True,
                                        output_gate_form="authors")
        assert max_diff(authors(ids).logits, original) > 1e-3  # about half of every output at init


def test_fox_output_gate_form_is_checked():
    with pytest.raises(PosEncError, match=r"FoxConfig.output_gate_form='sigmoid' is not one of the choices"):
        hf_posenc.patch_model(tiny_model("llama"), "fox", output_gate=True, output_gate_form="sigmoid")


# --- FoPE: Fourier-Position-Embedding, olmo/model.py (RotaryEmbedding.get_inv_freq, FourierEmbedding) ------------------
def authors_fope_frequencies(head_dim: int, theta: float, max_sequence_length: int, clamp_floor: bool,
                             ignore_zero: bool) -> torch.Tensor:
    """get_inv_freq: RoPE's frequencies; with rope_clamp_floor_freq and rope_clamp_floor_to_zero those below
    2 pi / max_sequence_length set to 0; with fourier_ignore_zero the zeros removed."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if clamp_floor:
        inv_freq[inv_freq < 2 * math.pi / max_sequence_length] = 0.0
    return inv_freq[inv_freq != 0.0] if ignore_zero else inv_freq


def authors_step_eye(input_dim: int, output_dim: int) -> torch.Tensor:
    """FourierEmbedding.get_step_eye: 1 at (i * step, i), step = ceil(input_dim / output_dim)."""
    eye = torch.zeros(input_dim, output_dim, dtype=torch.float64)
    step = math.ceil(input_dim / output_dim)
    for i in range(output_dim):
        if i * step < input_dim:
            eye[i * step, i] = 1.0
    return eye


def authors_fope_rotate(t: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, cos_coef: torch.Tensor,
                        sin_coef: torch.Tensor, ignore_zero: bool) -> torch.Tensor:
    """FourierEmbedding.apply_rotary_pos_emb: the series of sin and cos over the input frequencies, padded with 1 up
    to head_dim // 2 with fourier_ignore_zero, concatenated twice, t * cos + rotate_half(t) * sin. t [B, h, T, D],
    coefficients [h or 1, input_dim, output_dim]."""
    head_dim = t.shape[-1]
    angles = positions.double()[:, None] * inv_freq  # [T, input_dim]
    fourier_sin = torch.einsum("tD,hDd->htd", angles.sin(), sin_coef)
    fourier_cos = torch.einsum("tD,hDd->htd", angles.cos(), cos_coef)
    if ignore_zero:
        fourier_sin = F.pad(fourier_sin, (0, head_dim // 2 - fourier_sin.shape[-1]), value=1)
        fourier_cos = F.pad(fourier_cos, (0, head_dim // 2 - fourier_cos.shape[-1]), value=1)
    fourier_sin, fourier_cos = torch.cat((fourier_sin, fourier_sin), -1), torch.cat((fourier_cos, fourier_cos), -1)
    x1, x2 = t.unflatten(-1, (2, head_dim // 2)).unbind(-2)
    return t * fourier_cos + torch.cat((-x2, x1), dim=-1) * fourier_sin


FOPE_CASES = [  # tiny LLaMA: head dim 16, window 64, theta 10000 (3 of 8 frequencies above the floor 2 pi / 64)
    {"ignore_zero_frequencies": True},                                   # inputs 3, planes 3 of 8, 5 padded with 1
    {"ignore_zero_frequencies": True, "clip_floor": False},              # inputs 8, planes 4: step 2
    {"ignore_zero_frequencies": True, "per_head": True},                 # coefficients per key-value head
    {"ignore_zero_frequencies": False},                                  # the paper's text: d/2 x d/2, no padding
    {"ignore_zero_frequencies": False, "clip_floor": False, "per_head": True},
]


@pytest.mark.parametrize("options", FOPE_CASES)
def test_fope_rotation_is_the_authors(options):
    model, module = (lambda m: (m, hf_posenc.get_positional_module(m)))(
        hf_posenc.patch_model(tiny_model("llama"), "fope", init="random", sigma=0.3, **options))
    ignore_zero, clamp = options["ignore_zero_frequencies"], options.get("clip_floor", True)
    inv_freq = authors_fope_frequencies(16, 10000.0, 64, clamp, ignore_zero)
    output_dim = min(len(inv_freq), 16 // 4) if ignore_zero else 8
    coefficients = [module.cos_coefficients.detach().double(), module.sin_coefficients.detach().double()]
    assert coefficients[0].shape[-2:] == (len(inv_freq), output_dim)
    coefficients = [c if c.dim() == 3 else c[None] for c in coefficients]
    positions = torch.tensor([0, 1, 5, 17, 40, 63])
    x = torch.randn(1, 4, len(positions), 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # Our per-head coefficients are per key-value head: query heads 2h and 2h + 1 share key head h's.
    cos_coef, sin_coef = (c.repeat_interleave(4 // c.shape[0], 0) if c.shape[0] > 1 else c for c in coefficients)
    want = authors_fope_rotate(x, positions, inv_freq, cos_coef, sin_coef, ignore_zero)
    got = module.rotate_heads(x, module.rotation(positions[None]))
    assert max_diff(got, want) <= 2e-5 * want.abs().max()  # float32 angles up to 63 rad (rounding ~4e-6)


@pytest.mark.parametrize("clip_floor,inputs,planes", [(True, 3, 3), (False, 8, 4)])
def test_fope_ignore_zero_init_is_the_authors_step_identity(clip_floor, inputs, planes):
    model = hf_posenc.patch_model(tiny_model("llama"), "fope", ignore_zero_frequencies=True, clip_floor=clip_floor)
    module = hf_posenc.get_positional_module(model)
    for coefficients in (module.cos_coefficients, module.sin_coefficients):
        assert torch.equal(coefficients.detach().double(), authors_step_eye(inputs, planes))


def test_fope_ignore_zero_decodes_as_a_full_forward():
    model = hf_posenc.patch_model(tiny_model("llama"), "fope", init="random", sigma=0.3, ignore_zero_frequencies=True,
                                  per_head=True)
    ids = random_ids(2, 12)
    with torch.no_grad():
        assert max_diff(model(ids).logits, decode_token_by_token(model, ids, DynamicCache(config=model.config))) <= 1e-4


def test_fope_ignore_zero_refuses_when_no_frequency_is_left():
    with pytest.raises(PosEncError, match=r"ignore_zero_frequencies=True has no plane to give a series"):
        hf_posenc.patch_model(tiny_model("llama"), "fope", ignore_zero_frequencies=True, window=1)


# --- Self-Extend: datamllab/LongLM, self_extend_patch/Llama_4_40.py self_extend_forward ---------------------------------
def longlm_group_positions(query_position, key_position, group_size_1: int, group_size_2: int):
    """The grouped positions as the fixed line has them (group size G = group_size_1, neighbour window W =
    group_size_2): no shift while every query is inside the window, else q // G + W - W // G; keys k // G."""
    re_group_size_2 = 0 if query_position.max() < group_size_2 else group_size_2
    group_query_position = query_position // group_size_1 + re_group_size_2 - re_group_size_2 // group_size_1
    return group_query_position, key_position // group_size_1


def longlm_rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """transformers' LLaMA apply_rotary_pos_emb (half-split rotate_half) with RoPE's cos/sin, in float64."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = positions.double()[..., None] * inv_freq
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    x1, x2 = x[..., :dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


def longlm_self_extend_attention(query, key, value, group_size_1: int, group_size_2: int, scaling: float):
    """self_extend_forward's prefill (q_len == kv_seq_len, positions 0..L-1): neighbour and group scores, each plus
    the causal mask, the neighbour mask tril(ones) minus tril(ones(L - W, L - W)) at rows W.., columns ..-W, one
    softmax."""
    length = query.shape[2]
    position = torch.arange(length)
    group_query_position, group_key_position = longlm_group_positions(position, position, group_size_1, group_size_2)
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1).double(), value.repeat_interleave(groups, 1).double()
    query = query.double()
    neighbor = longlm_rotate(query, position) @ longlm_rotate(key, position).transpose(2, 3) * scaling
    group = longlm_rotate(query, group_query_position) @ longlm_rotate(key, group_key_position).transpose(2, 3) * scaling
    causal = torch.zeros(length, length, dtype=torch.float64).masked_fill(
        ~torch.ones(length, length, dtype=torch.bool).tril(), -math.inf)  # added to both, as attention_mask is
    neighbor, group = neighbor + causal, group + causal
    neighbor_mask = torch.ones(length, length).tril()
    if length - group_size_2 > 0:
        neighbor_mask[group_size_2:, :-group_size_2] -= torch.ones(length - group_size_2, length - group_size_2).tril()
    weights = torch.where(neighbor_mask.bool(), neighbor, group)
    return (weights.softmax(-1) @ value).transpose(1, 2)


def test_self_extend_positions_are_longlms():
    model = hf_posenc.patch_model(tiny_model("llama"), "self-extend", window=12, group=4)
    module = hf_posenc.get_positional_module(model)
    positions = torch.arange(200)[None]
    group_query, group_key = longlm_group_positions(positions, positions, 4, 12)
    assert torch.equal(module.far_query_positions(positions), group_query)
    assert torch.equal(module.far_key_positions(positions), group_key)


@pytest.mark.parametrize("window,group", [(8, 4), (12, 3), (6, 6)])
def test_self_extend_attention_is_longlms(window, group):
    model = hf_posenc.patch_model(tiny_model("llama"), "self-extend", window=window, group=group)
    layer = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    length = 30
    query = torch.randn(2, 4, length, 16, generator=generator)
    key, value = torch.randn(2, 2, length, 16, generator=generator), torch.randn(2, 2, length, 16, generator=generator)
    getattr(layer, STATE_ATTR).update(torch.arange(length)[None].expand(2, -1), 0, None)
    with torch.no_grad():
        output, _ = attention_module.posenc_attention(layer, query, key, value, None, scaling=0.25)
    assert max_diff(output, longlm_self_extend_attention(query, key, value, group, window, 0.25)) <= 1e-5


def test_self_extend_refuses_a_window_that_is_not_a_multiple_of_the_group():
    """LongLM's prefill computes W - W / G (Llama.py), its decoding and its fixed line W - W // G: they differ by
    the fraction, 0.5 for W = 6, G = 4, shifting every grouped query position by half a position."""
    model = tiny_model("llama")
    with pytest.raises(PosEncError, match=r"SelfExtendConfig.window=6 is not a multiple of group=4; pass a multiple "
                                          r"of it, e.g. 4"):
        hf_posenc.patch_model(model, "self-extend", window=6, group=4)
    assert hf_posenc.get_posenc_config(model) is None


def test_self_extend_default_window_is_a_quarter_rounded_down_to_a_multiple_of_the_group():
    model = hf_posenc.patch_model(tiny_model("llama"), "self-extend", original_max_position_embeddings=100)
    module = hf_posenc.get_positional_module(model)
    assert module.window == 24  # 100 // 4 = 25, down to a multiple of group 8
    positions = torch.arange(100)[None]
    assert torch.equal(module.far_query_positions(positions), longlm_group_positions(positions, positions, 8, 24)[0])
