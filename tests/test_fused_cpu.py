"""Fused CPU kernels (engine/kernels/fused_cpu.py, cpu_kernels/*.cpp): stick-breaking's, CoPE's, the near/far
kernel's (Self-Extend, ReRoPE) and the plain causal one's (Transformer-XL, TAPE) forward and backward of a causal
square against autograd of the chains in float64 (stick-breaking's through the blocked path's StickBreakingWeights,
itself checked against the chain in test_content_methods.py; CoPE's, the merged near/far scores and the causal
softmax written out here, materialised), across tile edges and thread splits; float32 within rounding of float64 at
a length where stick-breaking's backward sums cancel; in a model, served under "auto" after the kernel check and
training like the blocked path (for Transformer-XL and TAPE: like SDPA on their padded kernel form); never where the
call is not a causal square; a build that fails is a refusal (one warning, the blocked path serves). The kernels are
compiled for real on the machine running the tests (about 40 s once; torch's extension cache keeps them)."""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_posenc
from hf_posenc import attention as engine
from hf_posenc.engine.kernels import fused_cpu
from hf_posenc.methods.stick_breaking import StickBreakingWeights
from helpers import left_pad, max_diff
from tiny_models import random_ids, tiny_model


@pytest.fixture
def fresh_checks():
    engine.reset_kernel_status()
    yield
    engine.reset_kernel_status()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def chain(query, key, value, scaling, attend_current):
    """The blocked path's weights on the whole [L, L] square (StickBreakingWeights, checked against autograd of the
    paper's chain in test_content_methods.py), applied to the values."""
    length = query.shape[-2]
    position = torch.arange(length)
    own = position[None, :] == position[:, None]
    breaks = position[None, :] <= position[:, None] if attend_current else position[None, :] < position[:, None]
    weights = StickBreakingWeights.apply(torch.matmul(query, key.transpose(-1, -2)) * scaling, breaks, own)
    return torch.matmul(weights, value)


def cope_chain(query, key, value, embeddings, scaling, max_pos):
    """CoPE's formula materialised, autograd throughout: gates, positions as the reverse cumulative sum clamped to
    max_pos, the embeddings' scalars interpolated between floor and ceiling, a causal softmax."""
    length = query.shape[-2]
    position = torch.arange(length)
    allowed = position[None, :] <= position[:, None]
    logits = torch.matmul(query, key.transpose(-1, -2)) * scaling
    positions = torch.sigmoid(logits).masked_fill(~allowed, 0.0).flip(-1).cumsum(-1).flip(-1).clamp(max=max_pos)
    floor = positions.detach().floor().long()
    integer = query @ embeddings
    rise = torch.nn.functional.pad(integer.diff(dim=-1), (0, 1))
    logits = logits + integer.gather(-1, floor) + (positions - floor) * rise.gather(-1, floor)
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1) @ value


def near_far_chain(near_query, near_key, value, far_query, far_key, far_from, scaling):
    """Self-Extend's and ReRoPE's merged scores materialised: the far pair's where key j <= i - far_from, the near
    pair's elsewhere, one causal softmax."""
    position = torch.arange(near_query.shape[-2])
    far = position[None, :] <= position[:, None] - far_from
    logits = torch.where(far, far_query @ far_key.transpose(-1, -2), near_query @ near_key.transpose(-1, -2))
    logits = (logits * scaling).masked_fill(position[None, :] > position[:, None], float("-inf"))
    return torch.softmax(logits, dim=-1) @ value


def kernel_and_chain(method, attend_current, option, generator):
    """(fused kernel, reference chain, extra inputs) for one method's options (option: CoPE's max_pos, the near/far
    kernel's far_from)."""
    if method == "stick-breaking":
        return (lambda q, k, v: fused_cpu.stick_breaking_causal(q, k, v, 0.3, attend_current),
                lambda q, k, v: chain(q, k, v, 0.3, attend_current), ())
    if method == "near-far":
        far_pair = tuple(torch.randn(2, 3, 37, 16, dtype=torch.float64, generator=generator) for _ in range(2))
        return (lambda q, k, v, fq, fk: fused_cpu.near_far_causal(q, k, fq, fk, v, option, 0.3),
                lambda q, k, v, fq, fk: near_far_chain(q, k, v, fq, fk, option, 0.3), far_pair)
    embeddings = torch.randn(16, option + 1, dtype=torch.float64, generator=generator)
    return (lambda q, k, v, e: fused_cpu.cope_causal(q, k, v, e, 0.3, option),
            lambda q, k, v, e: cope_chain(q, k, v, e, 0.3, option), (embeddings,))


def outputs_and_gradients(function, inputs, upstream, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in inputs]
    output = function(*leaves)
    output.backward(upstream.to(dtype))
    return [output] + [leaf.grad for leaf in leaves]


KERNEL_CASES = [("stick-breaking", False, 0), ("stick-breaking", True, 0),
                ("cope", False, 3),  # most keys' positions clamped at max_pos: a window of a few keys per row
                ("cope", False, 12),  # windows across tile edges
                ("cope", False, 64),  # none clamped
                ("near-far", False, 1), ("near-far", False, 5), ("near-far", False, 20),  # far from ...
                ("near-far", False, 40)]  # no key far


@pytest.mark.parametrize("method, attend_current, option", KERNEL_CASES)
@pytest.mark.parametrize("thread_count", [1, 2])  # 2 threads, 3 heads: each head's query tiles in two runs
def test_kernel_equals_the_chain_in_float64(method, attend_current, option, thread_count, monkeypatch, threads):
    """Tiles of 8 rows and 16 keys over 37 tokens (partial tiles at both ends, rows whose keys start mid-tile, tiles
    wholly near, wholly far and crossed by the boundary), value width unlike the heads': output and the gradients of
    queries, keys, values (CoPE's embeddings, the far pair) equal autograd of the chain to float64 rounding."""
    monkeypatch.setattr(fused_cpu, "TILE_ROWS", 8)
    monkeypatch.setattr(fused_cpu, "TILE_KEYS", 16)
    threads(thread_count)
    generator = torch.Generator().manual_seed(3)
    query, key = (2 * torch.randn(2, 3, 37, 16, dtype=torch.float64, generator=generator) for _ in range(2))
    value = torch.randn(2, 3, 37, 5, dtype=torch.float64, generator=generator)
    upstream = torch.randn(2, 3, 37, 5, dtype=torch.float64, generator=generator)
    kernel, reference, extra = kernel_and_chain(method, attend_current, option, generator)
    fused = outputs_and_gradients(kernel, (query, key, value, *extra), upstream, torch.float64)
    expected = outputs_and_gradients(reference, (query, key, value, *extra), upstream, torch.float64)
    assert len(fused) == 4 + len(extra)
    for ours, theirs in zip(fused, expected):
        assert max_diff(ours, theirs) <= 1e-12 * max(theirs.abs().max(), 1e-300)  # the far pair's: 0 past 37


@pytest.mark.parametrize("value_width", [5, 40])  # Transformer-XL's form: wider queries and keys; TAPE's: values
@pytest.mark.parametrize("thread_count", [1, 2])
def test_causal_kernel_equals_softmax_attention_in_float64(value_width, thread_count, monkeypatch, threads):
    """The plain causal kernel (near_far.cpp with no far key) on heads of 16 and values of another width, tiles of
    8 x 16 over 37 tokens: output and gradients equal autograd of the materialised causal softmax to float64
    rounding."""
    monkeypatch.setattr(fused_cpu, "TILE_ROWS", 8)
    monkeypatch.setattr(fused_cpu, "TILE_KEYS", 16)
    threads(thread_count)
    generator = torch.Generator().manual_seed(4)
    query, key = (2 * torch.randn(2, 3, 37, 16, dtype=torch.float64, generator=generator) for _ in range(2))
    value, upstream = (torch.randn(2, 3, 37, value_width, dtype=torch.float64, generator=generator) for _ in range(2))
    hidden = ~torch.ones(37, 37, dtype=torch.bool).tril()

    def materialised(q, k, v):
        return torch.softmax((q @ k.transpose(-1, -2) * 0.3).masked_fill(hidden, float("-inf")), dim=-1) @ v

    fused = outputs_and_gradients(lambda q, k, v: fused_cpu.causal_attention(q, k, v, 0.3), (query, key, value),
                                  upstream, torch.float64)
    expected = outputs_and_gradients(materialised, (query, key, value), upstream, torch.float64)
    assert len(fused) == 4 and fused[0].shape == (2, 3, 37, value_width)
    for ours, theirs in zip(fused, expected):
        assert max_diff(ours, theirs) <= 1e-12 * theirs.abs().max()


def turned_by_complex_product(x, features):
    """TAPE's turn written out: planes (x_k, x_{k+d/2}) as complex numbers times c + i s, the rest of x as it is."""
    c, s = features.repeat_interleave(x.shape[1] // features.shape[1], dim=1).chunk(2, dim=-1)
    half = c.shape[-1]
    planes = torch.complex(x[..., :half], x[..., half:2 * half]) * torch.complex(c, s)
    return torch.cat((planes.real, planes.imag, x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("heads, kv_heads, head_dim, feature_dim", [(6, 2, 10, 6), (3, 3, 8, 8)])
@pytest.mark.parametrize("thread_count", [1, 2])
def test_turn_kernel_equals_the_complex_product_in_float64(heads, kv_heads, head_dim, feature_dim, thread_count,
                                                           threads):
    """TAPE's fused turn (turn.cpp) on a strided x (a projection's [B, n, H, D] transposed, as attention gets it),
    with query heads sharing a key-value head's features and a partial rotary width: output and the gradients of x
    and the features (summed over a group's heads) equal autograd of the complex product in float64."""
    threads(thread_count)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(2, 300, heads, head_dim, dtype=torch.float64, generator=generator).transpose(1, 2)
    features = torch.randn(2, kv_heads, 300, feature_dim, dtype=torch.float64, generator=generator)
    upstream = torch.randn(2, heads, 300, head_dim, dtype=torch.float64, generator=generator)
    fused = outputs_and_gradients(fused_cpu.turn_by_features, (x, features), upstream, torch.float64)
    expected = outputs_and_gradients(turned_by_complex_product, (x, features), upstream, torch.float64)
    assert len(fused) == 3 and fused[0].shape == (2, heads, 300, head_dim)
    for ours, theirs in zip(fused, expected):
        assert max_diff(ours, theirs) <= 1e-13 * theirs.abs().max()


CAPE_ACTIVATIONS = {"leaky_relu": lambda x: torch.nn.functional.leaky_relu(x, 0.01),
                    "gelu": torch.nn.functional.gelu}


def cape_materialised(query, key, value, table, input_weight, input_bias, output_weight, output_bias, scaling,
                      add_bias, activation):
    """CAPE's logits written out on the whole square (methods/cape.py): the MLP across heads on [z, B] per pair, B
    the table at distance i - j, a causal softmax."""
    position = torch.arange(query.shape[-2])
    logits = query @ key.transpose(-1, -2) * scaling
    bias = table[:, (position[:, None] - position[None, :]).clamp_min(0)].expand_as(logits)
    pairs = torch.cat((logits, bias), dim=1).permute(0, 2, 3, 1)
    hidden = CAPE_ACTIVATIONS[activation](torch.nn.functional.linear(pairs, input_weight, input_bias))
    logits = logits + torch.nn.functional.linear(hidden, output_weight, output_bias).permute(0, 3, 1, 2)
    logits = logits + bias if add_bias else logits
    return torch.softmax(logits.masked_fill(position[None, :] > position[:, None], float("-inf")), dim=-1) @ value


def cape_kernel(*inputs, activation):
    return fused_cpu.cape_causal(*inputs, activation=activation, negative_slope=0.01)


@pytest.mark.parametrize("activation", ["leaky_relu", "gelu"])
@pytest.mark.parametrize("add_bias, table_grad", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("thread_count", [1, 2])
@pytest.mark.parametrize("rows, keys, length", [(8, 16, 37), (16, 96, 150)])
def test_cape_kernel_equals_the_mlp_in_float64(activation, add_bias, table_grad, thread_count, rows, keys, length,
                                               monkeypatch, threads):
    """CAPE's kernel (every head of a tile at once, the MLP per chunk of 32 pairs of a row) with tiles of 8 x 16 over
    37 tokens (every chunk past its tile's keys) and of 16 x 96 over 150 tokens (whole chunks, chunks past the
    diagonal, and a last key tile of 54), 3 heads and an MLP 7 wide: output and the gradients of queries, keys,
    values, the MLP's four parameters and (where it requires one) the bias table, summed along its diagonals, equal
    autograd of the materialised MLP to float64 rounding. The output bias b2 adds a constant to each row's logits,
    which the softmax cancels: its gradient is zero up to rounding in both. For either activation (LeakyReLU, the
    authors', and GELU); LeakyReLU's pre-activations cross zero throughout, so both sides of its kink are held."""
    monkeypatch.setattr(fused_cpu, "CAPE_TILE_ROWS", rows)
    monkeypatch.setattr(fused_cpu, "CAPE_TILE_KEYS", keys)
    threads(thread_count)
    generator = torch.Generator().manual_seed(8)

    def draw(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator)

    inputs = [draw(2, 3, length, 16), draw(2, 3, length, 16), draw(2, 3, length, 5), draw(3, length), draw(7, 6),
              draw(7), draw(3, 7), draw(3)]
    upstream = draw(2, 3, length, 5)
    results = []
    for function in (cape_kernel, cape_materialised):
        leaves = [x.clone().requires_grad_(index != 3 or table_grad) for index, x in enumerate(inputs)]
        output = function(*leaves, 0.3, add_bias, activation=activation)
        output.backward(upstream)
        results.append([output] + [leaf.grad for leaf in leaves])
    fused, expected = results
    assert (fused[4] is None) == (expected[4] is None) == (not table_grad)
    for index, (ours, theirs) in enumerate(zip(fused, expected)):
        if theirs is None:
            continue
        scale = max(theirs.abs().max(), 1.0) if index == 8 else theirs.abs().max()  # b2's: zero up to rounding
        assert max_diff(ours, theirs) <= 1e-12 * scale


def test_stick_breaking_kernel_in_float32_is_float64_within_rounding():
    """At 1500 tokens with the default tiles, float32 against the kernel's own float64: the backward's suffix sums
    cancel far left of the diagonal, which without their float64 sums and bound left dQ about 1e-4 off at 4096."""
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, 2, 1500, 32, dtype=torch.float64, generator=generator) for _ in range(3)]
    upstream = torch.randn(1, 2, 1500, 32, dtype=torch.float64, generator=generator)

    def kernel(q, k, v):
        return fused_cpu.stick_breaking_causal(q, k, v, 32 ** -0.5, False)

    single = outputs_and_gradients(kernel, inputs, upstream, torch.float32)
    double = outputs_and_gradients(kernel, inputs, upstream, torch.float64)
    for ours, theirs in zip(single, double):
        assert ours.dtype == torch.float32
        assert max_diff(ours, theirs) <= 1e-5 * theirs.abs().max()


@pytest.mark.parametrize("activation", ["leaky_relu", "gelu"])
def test_cape_kernel_in_float32_is_float64_within_rounding(activation):
    """CAPE's kernel in float32 (chunks of 8 pairs, one AVX2 vector; float64's are 4) with the default tiles over 300
    tokens (a last key tile of 44, so rows end in a part chunk) and an ALiBi-like table reaching -300, against its own
    float64 (which the test above checks against the materialised MLP): output and every gradient within float32
    rounding. b2's gradient is zero up to rounding (about 1e-5 here), so it is held to an absolute 1e-4.
    LeakyReLU's derivative jumps at zero (1 above, 0.01 below), and float32's rounding moves the pairs whose hidden
    input is within it of zero across (W1's gradient 2.4e-3 off float64 here, the materialised MLP's in float32 as
    much): there each gradient may be as far off as that float32 materialised MLP's, twice."""
    generator = torch.Generator().manual_seed(9)

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, dtype=torch.float64, generator=generator) * scale

    length = 300
    table = -torch.arange(length, dtype=torch.float64) * torch.linspace(0.05, 1.0, 4, dtype=torch.float64)[:, None]
    inputs = [draw(1, 4, length, 32), draw(1, 4, length, 32), draw(1, 4, length, 16), table, draw(16, 8, scale=0.3),
              draw(16, scale=0.1), draw(4, 16, scale=0.1), draw(4)]
    upstream = draw(1, 4, length, 16)

    def outputs_and_grads(function, dtype):
        leaves = [x.to(dtype).clone().requires_grad_() for x in inputs]
        output = function(*leaves, 32 ** -0.5, True, activation=activation)
        output.backward(upstream.to(dtype))
        return [output.detach()] + [leaf.grad for leaf in leaves]

    double, single = outputs_and_grads(cape_kernel, torch.float64), outputs_and_grads(cape_kernel, torch.float32)
    materialised = outputs_and_grads(cape_materialised, torch.float32) if activation == "leaky_relu" else None
    for index, (theirs, ours) in enumerate(zip(double, single)):
        assert ours.dtype == torch.float32
        bound = 1e-4 if index == 8 else 2e-5 * theirs.abs().max()  # b2's: float32 sums of 45000 pairs' dl near 0
        if materialised is not None:
            bound = max(bound, 2 * max_diff(materialised[index], theirs))
        assert max_diff(ours, theirs) <= bound


def train_step(model, ids, attention_mask=None):
    model.zero_grad()
    logits = model(ids, attention_mask=attention_mask).logits
    logits.sin().sum().backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


MODEL_CASES = [("stick-breaking", {}, "llama"), ("stick-breaking", {}, "gpt2"),
               ("stick-breaking", {"attend_current": True, "base": "native"}, "llama"),
               ("stick-breaking", {"attend_current": True, "base": "native"}, "gpt2"),
               ("cope", {"max_pos": 4}, "llama"), ("cope", {"max_pos": 4}, "gpt2"),
               ("cope", {"base": "native"}, "llama"), ("cope", {"base": "native"}, "gpt2"),
               ("self-extend", {"window": 6, "group": 2}, "llama"), ("self-extend", {"window": 6, "group": 3}, "qwen2"),
               ("rerope", {"window": 6}, "llama"),
               ("rerope", {"window": 5, "log_scaling": True, "original_max_position_embeddings": 8}, "qwen2"),
               ("transformer-xl", {}, "llama"), ("transformer-xl", {"relative_dim": 6}, "gpt2"),
               ("tape", {}, "llama"), ("tape", {"init": "random", "width": 3}, "gpt2"),
               ("cape", {}, "llama"), ("cape", {"base": "native", "mlp_width": 5}, "gpt2"),
               ("cape", {"activation": "gelu"}, "llama"),
               ("cape", {"bias": "t5", "bias_options": {"num_buckets": 8, "max_distance": 16}}, "llama"),
               ("cape", {"bias": "kerple"}, "qwen2")]
FUSED_PATH = {"stick-breaking": "fused content", "cope": "fused content", "self-extend": "fused near far",
              "rerope": "fused near far", "transformer-xl": "fused causal", "tape": "fused causal",
              "cape": "fused content"}
BLOCKED_PATH = {"stick-breaking": "content recomputed", "cope": "content recomputed", "self-extend": "scored parts",
                "rerope": "scored parts", "transformer-xl": "content kernel", "tape": "content kernel",
                "cape": "content recomputed"}
KERNEL_NAME = {"transformer-xl": "causal", "tape": "causal"}
# TAPE's feature updates with N(0, 1) weights grow the features layer by layer: both paths' float32 gradients are then
# about 5e-5 (relative) from float64's and 2e-5 from each other; at 0.2 both agree to float32 rounding.
PARAMETER_STD = {"tape": 0.2}


@pytest.mark.parametrize("method, options, model_type", MODEL_CASES)
def test_a_model_trains_on_the_fused_kernel_as_on_the_blocks(method, options, model_type, fresh_checks):
    """Under "auto" a full batch's layers are served by the fused kernel once it passed its check (forward and
    gradients), and the logits and every parameter's gradient (CoPE's embeddings, made non-zero, included) equal the
    blocked path's (for Self-Extend and ReRoPE, their near and far kernel calls); a left-padded batch is not a causal
    square, so the blocks serve it."""
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    with torch.no_grad():
        for parameter in hf_posenc.get_positional_module(model).parameters():
            parameter.normal_(std=PARAMETER_STD.get(method, 1.0), generator=torch.Generator().manual_seed(6))
    layers = model.config.num_hidden_layers
    ids = random_ids(2, 24)  # within tiny GPT-2's learned positions
    engine.last_paths.clear()
    fused = train_step(model, ids)
    assert engine.last_paths[FUSED_PATH[method]] == layers
    verdicts = [v for v in engine.kernel_status() if v.kernel == f"fused cpu ({KERNEL_NAME.get(method, method)})"]
    assert [v.passed for v in verdicts] == [True, True] and verdicts[1].kind[0] == "gradients"
    if method == "tape":  # its queries and keys turned by the fused turn (turn.cpp), checked for each heads' grouping
        turns = {v.kind: v.passed for v in engine.kernel_status() if v.kernel == "fused cpu (turn)"}
        heads = model.config.num_attention_heads
        group = heads // (getattr(model.config, "num_key_value_heads", None) or heads)
        assert turns == {("torch.float32", "grad", size): True for size in {1, group}} | {
            ("gradients", "torch.float32"): True}
    with engine.attention_path("blocked"):
        engine.last_paths.clear()
        blocked = train_step(model, ids)
        assert engine.last_paths[FUSED_PATH[method]] == 0
        assert engine.last_paths[BLOCKED_PATH[method]] == layers
    assert len(fused) == len(blocked) > 2
    for ours, theirs in zip(fused, blocked):
        assert max_diff(ours, theirs) <= 1e-5 * max(1.0, theirs.abs().max())
    padded, mask = left_pad([random_ids(1, 12, seed=3)[0], random_ids(1, 7, seed=4)[0]])
    engine.last_paths.clear()
    train_step(model, padded, mask)
    assert engine.last_paths[FUSED_PATH[method]] == 0 and engine.last_paths["content"] + engine.last_paths["scored"] \
        == layers


def test_cape_with_position_ids_that_jump_stays_blocked(fresh_checks):
    """CAPE's kernel reads its bias as a table of distances i - j: a call whose position ids are not consecutive (a
    gap) takes the blocked path, with the blocked path's numbers; consecutive ids that start later are served."""
    model = hf_posenc.patch_model(tiny_model("llama"), "cape")
    layers = model.config.num_hidden_layers
    ids = random_ids(1, 24)
    for positions, fused_calls in ((torch.cat((torch.arange(12), torch.arange(30, 42)))[None], 0),
                                   (torch.arange(5, 29)[None], layers)):
        engine.last_paths.clear()
        with torch.no_grad():
            served = model(ids, position_ids=positions).logits
        assert engine.last_paths["fused content"] == fused_calls and engine.last_paths["content"] == layers
        with torch.no_grad(), engine.attention_path("blocked"):
            blocked = model(ids, position_ids=positions).logits
        assert max_diff(served, blocked) <= (0 if fused_calls == 0 else 1e-5 * blocked.abs().max())


def test_a_failed_build_is_a_refusal_and_the_blocks_serve(monkeypatch, fresh_checks):
    """No compiler (or no ninja) on the machine: the build raises inside the kernel check, which warns once, naming
    the cause and the fix, and the blocked path serves that call and the ones after, with the blocked path's
    numbers."""
    import torch.utils.cpp_extension
    model = hf_posenc.patch_model(tiny_model("llama"), "stick-breaking")
    ids = random_ids(1, 24)
    with torch.no_grad(), engine.attention_path("blocked"):
        expected = model(ids).logits

    def no_compiler(**ignored):
        raise RuntimeError("Error building extension: c++: command not found\n(the compiler's output)")

    monkeypatch.setattr(fused_cpu, "_loaded", False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        engine.last_paths.clear()
        first, second = model(ids).logits, model(ids).logits
    refusals = [w for w in caught if issubclass(w.category, engine.KernelCheckWarning)]
    assert len(refusals) == 1 and "c++: command not found" in str(refusals[0].message)
    message = str(refusals[0].message)
    assert "install a C++ compiler" in message and "HF_POSENC_CPU_KERNELS=0" in message
    assert engine.last_paths["fused content"] == 0
    assert max_diff(first, expected) == 0 and max_diff(second, expected) == 0


def test_a_failed_build_warns_once_for_every_kernel_it_refuses(monkeypatch, fresh_checks):
    """TAPE's calls check two kernels (its turn and the causal kernel); with no compiler both checks fail on the same
    build, and the user reads that cause once. Both refusals are in kernel_status()."""
    import torch.utils.cpp_extension

    def no_compiler(**ignored):
        raise RuntimeError("Error building extension: c++: command not found")

    model = hf_posenc.patch_model(tiny_model("llama"), "tape", init="random")
    monkeypatch.setattr(fused_cpu, "_loaded", False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(random_ids(1, 24))
    refusals = [str(w.message) for w in caught if issubclass(w.category, engine.KernelCheckWarning)]
    assert len(refusals) == 1 and "c++: command not found" in refusals[0], refusals
    refused = {verdict.kernel for verdict in engine.kernel_status() if not verdict.passed}
    assert len(refused) == 2, engine.kernel_status()


def test_the_environment_turns_the_fused_kernels_off(monkeypatch, fresh_checks):
    monkeypatch.setenv("HF_POSENC_CPU_KERNELS", "0")
    model = hf_posenc.patch_model(tiny_model("llama"), "stick-breaking")
    engine.last_paths.clear()
    with torch.no_grad():
        model(random_ids(1, 24))
    assert engine.last_paths["fused content"] == 0 and engine.kernel_status() == []


@pytest.mark.parametrize("method, options", [("stick-breaking", {}), ("cope", {"max_pos": 4}),
                                             ("self-extend", {"window": 6, "group": 2}), ("transformer-xl", {}),
                                             ("tape", {"init": "random"}), ("cape", {"bias": "t5"})])
def test_the_kernels_train_under_gradient_checkpointing(method, options, fresh_checks):
    """Under the fine-tune's gradient checkpointing each layer's attention runs twice (forward, recomputation), both
    times on the fused kernel, with the blocked path's logits and gradients."""
    from hf_posenc.tools.finetune import enable_gradient_checkpointing

    model = hf_posenc.patch_model(tiny_model("llama"), method, **options).train()
    enable_gradient_checkpointing(model)
    ids = random_ids(2, 24)
    engine.last_paths.clear()
    fused = train_step(model, ids)
    assert engine.last_paths[FUSED_PATH[method]] == 2 * model.config.num_hidden_layers
    with engine.attention_path("blocked"):
        blocked = train_step(model, ids)
    assert len(fused) == len(blocked) > 2
    for ours, theirs in zip(fused, blocked):
        assert max_diff(ours, theirs) <= 1e-5 * max(1.0, theirs.abs().max())
