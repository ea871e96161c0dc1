"""CAPE's Triton kernel (engine/kernels/triton/cape_attention.py) through Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where torch sees no GPU): the output and the gradients w.r.t. queries,
keys, values, the MLP's weights and biases and the bias table, in float64, float32 and float16, both activations,
base "none" and "native", GQA, against the paper's formula in float64 written here; and the "triton" path: a tiny
patched LLaMA trains as on the blocked path, every layer served by the kernel and every kernel check passed, while a
left-padded batch and packed documents go to the blocked path with its numbers."""

import pytest
import torch

pytest.importorskip("triton")

import hf_posenc  # noqa: E402
from hf_posenc import attention  # noqa: E402
from hf_posenc.engine.kernels.triton.cape_attention import cape_attention  # noqa: E402
from helpers import left_pad  # noqa: E402
from tiny_models import random_ids, tiny_model  # noqa: E402

SLOPE = 0.01


def reference(query, key, value, table, w1, b1, w2, b2, scaling, add_bias, activation):
    """CAPE (Zheng et al., NeurIPS 2024) in float64: x_ij = [z_ij^1..H, B_ij^1..H] with z = scaling q_i . k_j and
    B_ij = table[h, i - j], l = z + W2 act(W1 x + b1) + b2 (+ B for base "none"), causal softmax of l over v."""
    heads = query.shape[1]
    groups = heads // key.shape[1]
    q, k, v = query.double(), key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    length = q.shape[2]
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    z = scaling * q @ k.transpose(2, 3)
    bias = table.double()[:, (i - j).clamp(min=0)].expand_as(z)
    a = torch.einsum("wc,bcij->bwij", w1.double(), torch.cat((z, bias), 1)) + b1.double()[None, :, None, None]
    hidden = torch.where(a >= 0, a, SLOPE * a) if activation == "leaky_relu" else 0.5 * a * (1 + torch.erf(a / 2**0.5))
    logits = z + torch.einsum("hw,bwij->bhij", w2.double(), hidden) + b2.double()[None, :, None, None]
    if add_bias:
        logits = logits + bias
    return logits.masked_fill(j > i, float("-inf")).softmax(-1) @ v


NAMES = ("query", "key", "value", "table", "input_weight", "input_bias", "output_weight", "output_bias")
# Relative to the largest reference value, and for gradients to at least 1% of the largest gradient (the output
# bias's is zero in exact arithmetic: rounding noise on both sides), as kernels/check.py counts them. float16: its
# inputs rounded; observed 2-6e-4 for the output and the query, key and value gradients, float32-like for the MLP's.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 3e-3}
CASES = {  # dtype, activation, base "none" (the bias added), key-value heads of 3 query heads, MLP width, length
    "float64 leaky_relu none": (torch.float64, "leaky_relu", True, 3, 6, 40),
    "float64 gelu native": (torch.float64, "gelu", False, 3, 5, 40),
    "float32 gelu none gqa": (torch.float32, "gelu", True, 1, 8, 37),
    "float32 leaky_relu native": (torch.float32, "leaky_relu", False, 3, 4, 33),
    "float16 leaky_relu none": (torch.float16, "leaky_relu", True, 3, 6, 40),
    "float16 gelu native gqa": (torch.float16, "gelu", False, 1, 6, 24),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_and_gradients_match_the_formula(case, device):
    dtype, activation, add_bias, key_heads, width, length = CASES[case]
    heads, batch, dim = 3, 2, 16
    generator = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0):
        return torch.randn(*shape, generator=generator, dtype=torch.float64) * scale

    parameters = torch.float64 if dtype == torch.float64 else torch.float32
    tensors = [make(batch, heads, length, dim).to(dtype), make(batch, key_heads, length, dim).to(dtype),
               make(batch, key_heads, length, dim).to(dtype)]
    tensors += [make(heads, length, scale=0.5).to(parameters), make(width, 2 * heads, scale=0.5).to(parameters),
                make(width, scale=0.5).to(parameters), make(heads, width, scale=0.5).to(parameters),
                make(heads, scale=0.5).to(parameters)]
    weight = make(batch, heads, length, dim).to(dtype).double()  # the output's gradient, exact in the dtype
    results = []
    for function, cast, where in ((cape_attention, lambda t: t, device), (reference, lambda t: t.double(), "cpu")):
        leaves = [cast(t).to(where).requires_grad_(True) for t in tensors]
        output = function(*leaves, dim**-0.5, add_bias, activation)
        grads = torch.autograd.grad((output.double() * weight.to(where)).sum(), leaves)
        results.append((output.double().cpu(), [g.double().cpu() for g in grads]))
    (got, got_grads), (want, want_grads) = results
    assert got.dtype == torch.float64 and torch.isfinite(got).all()
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < TOLERANCE[dtype], f"output: {error:.3g}"
    largest = max(w.abs().max() for w in want_grads)
    for name, g, w in zip(NAMES, got_grads, want_grads):
        error = ((g - w).abs().max() / max(w.abs().max(), 1e-2 * largest)).item()
        assert error < 2 * TOLERANCE[dtype], f"gradient w.r.t. {name}: {error:.3g}"


def _perturbed(model, seed=0):
    """CAPE's MLP off its init (under base "native" its output layer starts at zero, so the first layer would take no
    gradient), the same on every path."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in hf_posenc.get_positional_module(model).named_parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model


def _outputs_and_gradients(model, path, **inputs):
    model.zero_grad()
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    with attention.attention_path(path):
        attention.last_paths.clear()
        logits = model(**inputs).logits
        keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones(
            logits.shape[:2], dtype=bool, device=logits.device)
        (logits[keep] * torch.linspace(-1, 1, logits.shape[-1], device=logits.device)).sum().backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return logits[keep].detach().cpu(), grads, attention.last_paths["triton"]


MODELS = {  # CAPE's options on a tiny LLaMA (4 query heads on 2 key-value heads, head size 16)
    "leaky_relu, base none, trainable ALiBi": dict(mlp_width=8, base="none", bias_options={"trainable": True}),
    "gelu, on RoPE (base native), KERPLE": dict(mlp_width=6, activation="gelu", base="native", bias="kerple"),
}


@pytest.fixture
def fresh_checks():
    attention.reset_kernel_status()
    yield
    attention.reset_kernel_status()


@pytest.mark.parametrize("options", MODELS)
def test_a_model_trains_on_the_kernel_as_on_the_blocks(options, device, fresh_checks):
    """Logits and every parameter's gradient (the MLP's and the bias method's among them) under "triton" equal the
    blocked path's, each layer served by the kernel, whose forward and gradient checks (the method's parameters
    included) passed; a left-padded batch and packed documents (position ids restarting) are the blocked path's."""
    model = _perturbed(hf_posenc.patch_model(tiny_model("llama"), "cape", **MODELS[options])).to(device)
    layers = model.config.num_hidden_layers
    padded, mask = left_pad([random_ids(1, 29, seed=3)[0], random_ids(1, 17, seed=4)[0]])
    packed = dict(input_ids=random_ids(1, 30), position_ids=torch.cat([torch.arange(18), torch.arange(12)])[None])
    for inputs, served in ((dict(input_ids=random_ids(2, 40)), layers),
                           (dict(input_ids=padded, attention_mask=mask), 0), (packed, 0)):
        blocked, blocked_grads, _ = _outputs_and_gradients(model, "blocked", **inputs)
        triton, triton_grads, triton_calls = _outputs_and_gradients(model, "triton", **inputs)
        assert triton_calls == served
        assert (triton - blocked).abs().max() <= 1e-5 * blocked.abs().max()
        assert blocked_grads.keys() == triton_grads.keys()
        assert any(name.endswith("bias_method.slopes") for name in blocked_grads) == ("trainable" in options)
        largest = max(grad.abs().max() for grad in blocked_grads.values())
        for name, grad in blocked_grads.items():
            assert (triton_grads[name] - grad).abs().max() <= 1e-4 * max(grad.abs().max(), 1e-2 * largest), name
    verdicts = [verdict for verdict in attention.kernel_status() if verdict.kernel == "triton (cape)"]
    assert verdicts and all(verdict.passed for verdict in verdicts), verdicts
    assert any(verdict.kind[0] == "gradients" for verdict in verdicts)


def test_the_kernel_check_compares_the_mlps_gradients(monkeypatch, device, fresh_checks):
    """The gradient probe of the "triton" path covers the method's parameters the kernel reads itself: a kernel that
    drops the output layer's gradient (its output unchanged) fails its check, with a warning, and the blocked path
    serves."""
    import dataclasses
    import warnings

    from hf_posenc.engine.kernels import by_method

    entry = by_method.KERNELS["cape"]

    def output_layer_detached(method, layer_idx, *arguments):
        weight = method.output_weight
        try:
            method.output_weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
            return entry.triton.run(method, layer_idx, *arguments)
        finally:
            method.output_weight = weight

    monkeypatch.setitem(by_method.KERNELS, "cape", dataclasses.replace(
        entry, triton=dataclasses.replace(entry.triton, run=output_layer_detached)))
    model = _perturbed(hf_posenc.patch_model(tiny_model("llama"), "cape", mlp_width=4)).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, triton_calls = _outputs_and_gradients(model, "triton", input_ids=random_ids(1, 20))
    assert triton_calls == 0
    failed = [verdict for verdict in attention.kernel_status() if not verdict.passed]
    assert len(failed) == 1 and failed[0].kind[0] == "gradients" and "output_weight" in failed[0].detail, failed
    assert any("triton (cape)" in str(warning.message) for warning in caught)


def test_a_half_precision_model_is_served_and_passes_its_checks(device):
    """Half precision through the kernel on the "triton" path, forward and gradient checks included: its logits are
    the blocked path's to the dtype's rounding. bfloat16 on a GPU only (the interpreter's bfloat16 products are
    wrong)."""
    for dtype in (torch.float16, torch.bfloat16) if device.type == "cuda" else (torch.float16,):
        attention.reset_kernel_status()
        model = _perturbed(hf_posenc.patch_model(tiny_model("llama"), "cape", mlp_width=8)).to(device, dtype)
        ids = random_ids(2, 40)
        blocked, _, _ = _outputs_and_gradients(model, "blocked", input_ids=ids)
        triton, _, triton_calls = _outputs_and_gradients(model, "triton", input_ids=ids)
        assert triton_calls == model.config.num_hidden_layers, dtype
        allowed = 1e-2 if dtype == torch.float16 else 5e-2
        assert (triton.float() - blocked.float()).abs().max() <= allowed * blocked.float().abs().max(), dtype
        verdicts = attention.kernel_status()
        assert {v.kind[0] for v in verdicts} == {"cape", "gradients"} and all(v.passed for v in verdicts), verdicts
    attention.reset_kernel_status()
