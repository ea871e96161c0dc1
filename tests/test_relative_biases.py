"""FIRE, T5, KERPLE, Sandwich and xPos: what each computes, their options, gradients of their option variants.
(The contract suite runs them with default options on every model type: test_contract.py; the attention paths they
use: test_attention.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import hf_posenc
from hf_posenc.tools.finetune import enable_gradient_checkpointing
from hf_posenc import PosEncError
from helpers import (TOL, assert_same_fingerprint, decode_token_by_token, left_pad, max_diff, model_fingerprint,
                     positions_from_mask)
from tiny_models import FAMILIES, random_ids, tiny_model


# what each method computes ---------------------------------------------------------------------------------------
def module_of(method, model_type="llama", **options):
    return hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model(model_type), method, **options))


def test_t5_buckets_equal_transformers_t5():
    from transformers.models.t5.modeling_t5 import T5Attention

    from hf_posenc.methods.t5 import causal_buckets

    distance = torch.arange(0, 3000)
    for buckets, max_distance in [(32, 128), (16, 50), (8, 1000)]:
        expected = T5Attention._relative_position_bucket(-distance, bidirectional=False, num_buckets=buckets,
                                                          max_distance=max_distance)
        assert torch.equal(causal_buckets(distance.float(), buckets, max_distance), expected)


def test_t5_shared_or_per_layer_tables():
    shared, per_layer = module_of("t5"), module_of("t5", per_layer=True)
    assert shared.weight.shape == (1, 32, 4) and per_layer.weight.shape == (2, 32, 4)
    assert not torch.equal(per_layer.bias_table(0, 40), per_layer.bias_table(1, 40))
    assert torch.equal(shared.bias_table(0, 40), shared.bias_table(1, 40))
    assert module_of("t5", init="zeros").bias_table(0, 10).abs().max() == 0


def test_kerple_power_starts_as_alibi_and_log_matches_its_formula():
    from hf_posenc.methods.alibi import bloom_slopes

    power = module_of("kerple", variant="power")
    distance = torch.arange(0, 500).float()
    alibi = -bloom_slopes(4)[:, None] * distance
    assert max_diff(power.bias_table(0, 500), alibi) <= 1e-4 * 500
    log = module_of("kerple")
    r1, r2 = log.kernel_parameters()
    assert torch.allclose(r1, torch.ones(4)) and torch.allclose(r2, bloom_slopes(4), rtol=1e-5)
    assert torch.allclose(log.bias_table(0, 500), -torch.log1p(bloom_slopes(4)[:, None] * distance), atol=1e-5)
    # positivity holds whatever the raw parameters become
    with torch.no_grad():
        log.r1_raw.fill_(-30.0)
        power.r2_raw.fill_(30.0)
    assert (log.kernel_parameters()[0] > 0).all() and (power.kernel_parameters()[1] <= 2).all()


def test_kerple_uniform_init_is_random_default_is_deterministic():
    from hf_posenc.methods.kerple import Kerple, KerpleConfig
    from hf_posenc.model_info import ModelInfo

    info = ModelInfo("llama", 2, 4, 2, 16, 64, 64, None, "rope")
    torch.manual_seed(0)
    a, default_a = Kerple(KerpleConfig(init="uniform"), info), Kerple(KerpleConfig(), info)
    torch.manual_seed(1)
    b, default_b = Kerple(KerpleConfig(init="uniform"), info), Kerple(KerpleConfig(), info)
    assert not torch.equal(a.r1_raw, b.r1_raw)
    assert torch.equal(default_a.r1_raw, default_b.r1_raw) and torch.equal(default_a.r2_raw, default_b.r2_raw)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_uniform_init_draws_as_the_reference_code(variant):
    """chijames/KERPLE (megatron/mpu/layers.py) draws per head, in this order and in float32, bias_p = 2 * U(0, 1)
    and bias_a = U(0, 1), clamped at 0.01 where used; its log kernel is -bias_p * log(1 + bias_a * d) and its
    power kernel -bias_a * d ** bias_p (bias_p clamped at 2)."""
    from hf_posenc.methods.kerple import Kerple, KerpleConfig
    from hf_posenc.model_info import ModelInfo

    heads = 64  # enough draws that U(0, 1) and U(0, 2) cannot be confused by chance
    info = ModelInfo("llama", 2, heads, heads, 16, 1024, 64, None, "rope")
    torch.manual_seed(3)
    bias_p = (torch.rand(heads) * 2).clamp(min=0.01)
    bias_a = torch.rand(heads).clamp(min=0.01)
    torch.manual_seed(3)
    kerple = Kerple(KerpleConfig(variant=variant, init="uniform"), info)
    distance = torch.arange(200, dtype=torch.float64)[None]
    if variant == "log":
        reference = -bias_p.double()[:, None] * torch.log(1 + bias_a.double()[:, None] * distance)
    else:
        reference = -bias_a.double()[:, None] * distance ** bias_p.clamp(max=2).double()[:, None]
    table = kerple.bias_table(0, 200).double()
    assert max_diff(table, reference) <= 1e-5 * reference.abs().max().item()


def test_t5_default_init_is_t5s_own():
    """T5 initialises relative_attention_bias ~ N(0, initializer_factor * d_model ** -0.5), factor 1 (transformers'
    T5PreTrainedModel._init_weights), not N(0, 0.02). Checked against that formula draw for draw, and against the
    table transformers' own T5 initialises; an explicit init_std still wins."""
    from transformers import T5Config as HFT5Config, T5ForConditionalGeneration

    from hf_posenc.methods.t5 import T5Bias, T5Config
    from hf_posenc.model_info import ModelInfo

    d_model, heads, buckets = 512, 8, 4096
    info = ModelInfo("llama", 2, heads, heads, 64, d_model, 2048, None, "rope")
    torch.manual_seed(5)
    table = T5Bias(T5Config(num_buckets=buckets, max_distance=8192), info).weight[0]
    torch.manual_seed(5)
    assert torch.equal(table, torch.empty(buckets, heads).normal_(mean=0.0, std=1.0 * d_model ** -0.5))

    t5 = T5ForConditionalGeneration(HFT5Config(vocab_size=8, d_model=d_model, d_kv=8, d_ff=8, num_layers=1,
                                               num_heads=heads, relative_attention_num_buckets=buckets))
    theirs = t5.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.detach()
    for values in (table, theirs):  # 32768 draws: the sample std is within 2% of the true one
        assert values.std().item() == pytest.approx(d_model ** -0.5, rel=0.02)
    explicit = T5Bias(T5Config(num_buckets=buckets, max_distance=8192, init_std=0.02), info).weight
    assert explicit.std().item() == pytest.approx(0.02, rel=0.02)


def test_sandwich_default_dimension_is_the_head_dimension():
    """d' defaults to the head dimension (16 in the tiny models): the paper's bias p_i . p_j - d'/2 computed here
    from sinusoids of that dimension, ALiBi-like head scaling 8h/H."""
    sandwich = module_of("sandwich")
    assert sandwich.dim == 16
    d = 16
    positions = torch.arange(40).double()
    inv_freq = 10000.0 ** (-2.0 * torch.arange(1, d // 2 + 1, dtype=torch.float64) / d)
    emb = torch.cat([torch.sin(positions[:, None] * inv_freq), torch.cos(positions[:, None] * inv_freq)], -1)
    dot = emb[39] @ emb.T - d / 2
    expected = dot.flip(0)[None] / (8.0 * torch.arange(1, 5, dtype=torch.float64) / 4)[:, None]
    assert max_diff(sandwich.bias_table(0, 40), expected) <= 1e-5
    assert module_of("sandwich", dim=128).dim == 128


def test_sandwich_is_the_dot_product_of_sinusoids_with_head_scaling():
    sandwich = module_of("sandwich", dim=16)
    positions = torch.arange(40).double()
    inv_freq = 10000.0 ** (-2.0 * torch.arange(1, 9, dtype=torch.float64) / 16)
    emb = torch.cat([torch.sin(positions[:, None] * inv_freq), torch.cos(positions[:, None] * inv_freq)], -1)
    dot = emb[39] @ emb.T - 8  # p_i . p_j - d'/2 for i = 39, j = 0..39
    expected = dot.flip(0)[None] / (8.0 * torch.arange(1, 5, dtype=torch.float64) / 4)[:, None]
    assert max_diff(sandwich.bias_table(0, 40), expected) <= 1e-5
    assert sandwich.bias_table(0, 1).abs().max() == 0
    unscaled = module_of("sandwich", dim=16, head_scaling=False).bias_table(0, 40)
    assert torch.equal(unscaled[0], unscaled[3])


def test_xpos_scores_decay_with_distance_only():
    xpos = module_of("xpos")
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(i, j, centre_shift=0):
        qp, kp = torch.tensor([[i]]), torch.tensor([[j]])
        rq, rk = xpos.rotate_query_key(q, k, qp, kp, 0)
        return (rq * rk).sum().item()

    # relative: shifting both positions changes nothing
    assert score(10, 3) == pytest.approx(score(1010, 1003), rel=1e-4)
    # the explicit formula: rope(q, i) * zeta^(i/sb) . rope(k, j) * zeta^(-j/sb)
    from hf_posenc.methods.base import rotate

    zeta = (torch.arange(0, 16, 2) / 16 + 0.4) / 1.4
    zeta = torch.cat([zeta, zeta])
    cos_q, sin_q = xpos.cos_sin(torch.tensor([[50]]))
    cos_k, sin_k = xpos.cos_sin(torch.tensor([[10]]))
    expected = (rotate(q, cos_q[:, None], sin_q[:, None]) * zeta ** (50 / 512)
                * rotate(k, cos_k[:, None], sin_k[:, None]) * zeta ** (-10 / 512)).sum().item()
    assert score(50, 10) == pytest.approx(expected, rel=1e-4)


def test_xpos_factors_hold_across_the_whole_float32_spread():
    """float32 and bfloat16 queries may lie e^30 apart in factor (12,000 tokens at scale_base 512), fp16 only e^4. At
    that spread, scores near the diagonal equal those with each query as its own centre to float32's rounding:
    exponents taken in float32 were 5.5e-7 to 7.5e-7 off, in float64 at most 2.3e-7."""
    xpos = module_of("xpos")
    spread = xpos.max_query_spread(torch.float32)
    assert xpos.max_query_spread(torch.bfloat16) == spread > 12000 > 1700 > xpos.max_query_spread(torch.float16)
    dim = 2 * xpos._inv_freq.numel()
    i = torch.arange(5, int(spread) + 1)
    for d in (1, 2, 3, 5):  # all-ones vectors at distances below 1 radian: every pair's term is positive
        wide_q, wide_k = xpos.rotate_query_key(torch.ones(1, 1, len(i), dim), torch.ones(1, 1, len(i), dim),
                                               i[None], i[None] - d, 0)
        own_q, own_k = xpos.rotate_query_key(torch.ones(len(i), 1, 1, dim), torch.ones(len(i), 1, 1, dim),
                                             i[:, None], i[:, None] - d, 0)
        wide, own = (wide_q * wide_k).sum(-1).flatten(), (own_q * own_k).sum(-1).flatten()
        assert (wide.double() / own.double() - 1).abs().max() <= 3.5e-7


@pytest.mark.parametrize("scale_base,length,path", [(4.0, 64, "causal"), (4.0, 200, "blocked")])
def test_xpos_takes_one_causal_call_when_the_forward_fits_its_spread(scale_base, length, path):
    """A causal forward whose positions fit in the dtype's spread (here 96 tokens for float32) is rotated once and
    takes SDPA's causal kernel; a longer one is cut into query blocks. Both equal a float64 run, and the gradients
    too."""
    from hf_posenc.engine import attention as attention_module

    model = hf_posenc.patch_model(tiny_model("llama"), "xpos", scale_base=scale_base)
    ids = random_ids(1, length, seed=3)
    reference = model.double()(ids).logits
    model.float()
    attention_module.last_paths.clear()
    logits = model(ids).logits
    taken = {name for name, count in attention_module.last_paths.items() if count}
    assert taken == {path}
    assert max_diff(logits, reference) <= 1e-5
    logits.float().logsumexp(-1).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.double()(ids).logits.logsumexp(-1).sum().backward()
    for grad, parameter in zip(grads, model.parameters()):
        assert max_diff(grad, parameter.grad) <= 1e-4 * max(1.0, parameter.grad.abs().max().item())


@pytest.mark.parametrize("length,per_block", [(40, False), (200, True)])
def test_xpos_rotates_a_padded_batch_and_a_cached_prefill_once_when_they_fit_its_spread(monkeypatch, length,
                                                                                         per_block):
    """Not only a causal square: a left-padded batch and a prefill after a cache, on the blocked path in query blocks
    of 8 rows, are rotated once per layer when their queries fit the spread (96 tokens for float32 at scale_base 4),
    else once per block around its own centre. Both equal the float64 run and each sequence alone."""
    from hf_posenc.engine.attention import bias_path
    from hf_posenc.methods.xpos import Xpos

    monkeypatch.setattr(bias_path, "block_rows", lambda *args, **kwargs: 8)
    calls = []
    rotate = Xpos.rotate_query_key
    monkeypatch.setattr(Xpos, "rotate_query_key", lambda self, *args: calls.append(1) or rotate(self, *args))
    model = hf_posenc.patch_model(tiny_model("llama"), "xpos", scale_base=4.0)
    layers = model.config.num_hidden_layers
    ids, mask = left_pad([random_ids(1, length, seed=3)[0], random_ids(1, length - 15, seed=4)[0]])
    positions = positions_from_mask(mask)
    with torch.no_grad():
        reference = model.double()(ids, attention_mask=mask, position_ids=positions).logits
        model.float()
        calls.clear()
        padded = model(ids, attention_mask=mask, position_ids=positions).logits
        padded_calls = len(calls)
        alone = model(ids[1:, 15:]).logits
        cache = DynamicCache(config=model.config)
        model(ids[:1, :length // 2], past_key_values=cache, use_cache=True)
        calls.clear()
        rest = model(ids[:1, length // 2:], past_key_values=cache, use_cache=True).logits
        prefill_calls = len(calls)
    assert (padded_calls > layers, prefill_calls > layers) == (per_block, per_block and length // 2 > 96)
    assert padded_calls >= layers and prefill_calls >= layers
    assert max_diff(padded, reference) <= 1e-5
    assert max_diff(padded[1:, 15:], alone) <= 1e-5
    assert max_diff(rest, reference[:1, length // 2:]) <= 1e-5


def test_xpos_reads_its_spread_once_per_forward(monkeypatch):
    """Whether the queries fit xPos's spread is a tensor's value (on a GPU, reading it waits for the device): it is
    read by the first layer of a forward and reused by the others, and read again in the next forward, whose
    positions may differ. The logits are the same as when each layer reads it."""
    from hf_posenc.engine.attention import geometry

    reads = []
    within = geometry.within_spread
    monkeypatch.setattr(geometry, "within_spread", lambda *args: reads.append(1) or within(*args))
    model = hf_posenc.patch_model(tiny_model("llama"), "xpos", scale_base=4.0)
    assert model.config.num_hidden_layers > 1
    ids = random_ids(2, 40, seed=3)
    with torch.no_grad():
        first = model(ids).logits
        assert len(reads) == 1
        far = model(ids, position_ids=torch.arange(40).expand(2, -1) * 5).logits  # 195 apart: per block
        assert len(reads) > 1
        reads.clear()
        monkeypatch.setattr(hf_posenc.engine.state.CallPositions, "host_values",
                            property(lambda self: {}, lambda self, value: None), raising=False)
        again, far_again = model(ids).logits, model(ids, position_ids=torch.arange(40).expand(2, -1) * 5).logits
    assert len(reads) >= 2 * model.config.num_hidden_layers
    assert torch.equal(first, again) and torch.equal(far, far_again)


def test_xpos_blockwise_causal_attention_limits_the_context():
    model = hf_posenc.patch_model(tiny_model("llama"), "xpos", extrapolation="bca", window=4)
    a, b = random_ids(1, 14, seed=5), random_ids(1, 14, seed=6)
    b[:, 4:] = a[:, 4:]  # differ only in block 0, which the queries of block 3 (positions 12, 13) cannot see
    with torch.no_grad():
        la, lb = model(a).logits, model(b).logits
        cached = decode_token_by_token(model, a, DynamicCache(config=model.config))
    assert max_diff(la[:, 12:], lb[:, 12:]) <= 1e-5
    assert max_diff(la[:, 8:12], lb[:, 8:12]) > 1e-4  # block 2 still sees block 1 only, yet via layer 2 ...
    assert max_diff(la, cached) <= TOL


def test_fire_alibi_init_is_close_to_alibi():
    """How close FIRE's ALiBi init is: the attention a position prior alone gives (softmax of the bias row)."""
    from hf_posenc.methods.alibi import bloom_slopes
    from hf_posenc.methods.fire import Fire, FireConfig
    from hf_posenc.model_info import ModelInfo

    info = ModelInfo("llama", 1, 8, 8, 64, 512, 2048, None, "rope")
    fire = Fire(FireConfig(), info)
    distance = torch.arange(2048).float()
    table = fire.bias_table(0, 2048, 2047)
    alibi = -bloom_slopes(8)[:, None] * distance
    near = (table[:, :64] - alibi[:, :64]).abs().max().item()
    total_variation = 0.5 * (table.softmax(-1) - alibi.softmax(-1)).abs().sum(-1).max().item()
    assert near <= 0.35 and total_variation <= 0.05, (near, total_variation)
    # exact at the knots
    knots = torch.expm1(torch.arange(33).double() / 32 * math.log(2049)).float()
    at_knots = fire.distance_bias(0, knots)
    assert max_diff(at_knots, -bloom_slopes(8)[:, None] * knots) <= 1e-3 * knots.max()


def test_fire_past_the_threshold_normalises_by_the_query_position():
    fire = module_of("fire", threshold=8.0)
    query, key = torch.tensor([[20]]), torch.arange(21)[None]
    bias = fire.bias(0, query, key)
    def psi(x):  # c = 1
        return torch.log1p(torch.as_tensor(x, dtype=torch.float32))
    u = psi((20 - key).float()) / psi(20.0)
    assert max_diff(bias[0, :, 0], fire.mlp(0, u[0]).T) <= 1e-6
    assert fire.bias_table(0, 21, max_position=20) is None and fire.bias_table(0, 21, max_position=8) is not None
    # below the threshold the table and the direct formula agree
    query = torch.tensor([[7]])
    direct = fire.mlp(0, psi((7 - torch.arange(8)).float()) / psi(8.0)).T
    assert max_diff(fire.bias(0, query, torch.arange(8)[None])[0, :, 0], direct) <= 1e-6


def test_fire_reads_its_learned_threshold_again_after_each_update():
    """The threshold decides between the distance table and the per-query form as a Python float, read once per
    change of the parameter (an optimizer step, a load), not per layer: after a step that moves it, the decision
    follows."""
    fire = module_of("fire", threshold=8.0, learn_threshold=True)
    assert fire.bias_table(0, 21, max_position=20) is None
    optimizer = torch.optim.SGD([fire.log_threshold], lr=1.0)
    fire.log_threshold.grad = torch.full_like(fire.log_threshold, -math.log(32.0 / 8.0))
    optimizer.step()  # the threshold 8 -> 32
    assert fire.threshold_values()[0] == pytest.approx(32.0)
    assert fire.bias_table(0, 21, max_position=20) is not None
    with torch.no_grad():
        fire.log_threshold.copy_(torch.full_like(fire.log_threshold, math.log(4.0)))
    assert fire.bias_table(0, 21, max_position=8) is None
    fire.load_state_dict({**fire.state_dict(), "log_threshold": torch.full_like(fire.log_threshold, math.log(16.0))})
    assert fire.bias_table(0, 21, max_position=8) is not None and fire.bias_table(0, 21, max_position=20) is None


def test_fire_patched_under_inference_mode_runs():
    """Parameters made under torch.inference_mode have no version counter: the threshold is read all the same."""
    with torch.inference_mode():
        model = hf_posenc.patch_model(tiny_model("llama"), "fire", threshold=8.0)
        fire = hf_posenc.get_positional_module(model)
        assert fire.log_threshold.is_inference()
        assert fire.threshold_values()[0] == pytest.approx(8.0)
        assert torch.isfinite(model(random_ids(1, 20, seed=2)).logits).all()


def test_fire_piecewise_linear_form_equals_the_mlp_with_its_gradients():
    """Past the threshold the bias comes from the MLP's piecewise-linear form: same values and gradients, for a
    random init with rising, falling and flat (w1 = 0) units."""
    fire = module_of("fire", threshold=8.0, init="random")
    with torch.no_grad():
        fire.w1[0, 0] = 0.0
        fire.b1[0, 0] = 0.3  # a flat, always-active unit
        fire.w1[0, 1] = -abs(fire.w1[0, 1]) - 0.5  # a falling one
    query, key = torch.arange(9, 40)[None], torch.arange(40)[None]
    bias = fire.bias(0, query, key)
    distance = (query[:, :, None] - key[:, None, :]).clamp_min(0).float()
    u = fire.psi(0, distance) / fire.psi(0, torch.maximum(fire.threshold(0), query.float()))[:, :, None]
    expected = fire.mlp(0, u).permute(0, 3, 1, 2)
    causal = (key[:, None, :] <= query[:, :, None])[:, None].expand_as(bias)
    assert max_diff(bias[causal], expected[causal]) <= 1e-6
    params = [fire.w1, fire.b1, fire.w2, fire.b2, fire.log_c]
    got = torch.autograd.grad(bias[causal].square().sum(), params)
    want = torch.autograd.grad(expected[causal].square().sum(), params)
    for g, w in zip(got, want):
        assert max_diff(g, w) <= 1e-5 * max(1.0, w.abs().max().item())


@pytest.mark.parametrize("method,options,message", [
    ("fire", {"mlp_width": 0}, r"FireConfig.mlp_width=0"),
    ("fire", {"init": "zero"}, r"FireConfig.init='zero'"),
    ("fire", {"c": -1.0}, r"FireConfig.c=-1.0"),
    ("fire", {"threshold": 0.5}, r"FireConfig.threshold=0.5"),
    ("t5", {"num_buckets": 1}, r"T5Config.num_buckets=1"),
    ("t5", {"max_distance": 8}, r"T5Config.max_distance=8"),
    ("t5", {"per_layer": "yes"}, r"T5Config.per_layer='yes'"),
    ("kerple", {"variant": "cubic"}, r"KerpleConfig.variant='cubic'"),
    ("kerple", {"init": "random"}, r"KerpleConfig.init='random'"),
    ("sandwich", {"dim": 7}, r"SandwichConfig.dim=7"),
    ("xpos", {"scale_base": 0}, r"XposConfig.scale_base=0"),
    ("xpos", {"extrapolation": "window"}, r"XposConfig.extrapolation='window'"),
    ("xpos", {"window": -3}, r"XposConfig.window=-3"),
])
def test_bad_options_are_named(method, options, message):
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(PosEncError, match=message):
        hf_posenc.patch_model(model, method, **options)
    assert_same_fingerprint(before, model_fingerprint(model))


def test_configs_serialise():
    config = hf_posenc.FireConfig(mlp_width=16)
    assert config.to_dict()["method"] == "fire" and config.to_dict()["mlp_width"] == 16
    model = hf_posenc.patch_model(tiny_model("gpt2"), config)
    assert hf_posenc.get_posenc_config(model) is config


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("method,options", [("fire", {"init": "random"}), ("t5", {"per_layer": True}),
                                            ("kerple", {"variant": "power"})])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_gradients_reach_the_parameters_of_option_variants(model_type, method, options, checkpointing):
    """The contract suite covers the default options; these variants have parameters of other shapes or kinds."""
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    ids = random_ids(2, 10)
    model(ids, labels=ids).loss.backward()
    params = dict(hf_posenc.get_positional_module(model).named_parameters())
    assert params, "the method should have trainable parameters"
    for name, param in params.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
