"""CoPE's Triton kernel (engine/kernels/triton/cope_attention.py) through Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 where torch sees no GPU): the output and the gradients w.r.t. queries,
keys, values and the position embeddings against the paper's formula in float64, in float64, float32 and float16,
with positions clamped at max_pos and not, GQA and packed documents; and on the "triton" path, tiny patched LLaMA
and GPT-2 models whose logits and parameter gradients equal the blocked path's, the kernel serving every layer of a
causal or packed batch, the blocked path a left-padded one, a decoding step after a cache and the calls the kernel
does not take (bfloat16 on the CPU, eager attention, a native bias); the kernel check's gradient probe refusing a
kernel whose position embeddings' gradient is wrong."""

import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("triton")

import hf_posenc  # noqa: E402
from hf_posenc import attention  # noqa: E402
from hf_posenc.engine.kernels import by_method  # noqa: E402
from hf_posenc.engine.kernels.check import KernelCheckWarning  # noqa: E402
from hf_posenc.engine.kernels.triton.cope_attention import cope_attention  # noqa: E402
from helpers import left_pad  # noqa: E402
from tiny_models import random_ids, tiny_model  # noqa: E402


def paper_reference(query, key, value, embeddings, scaling, max_pos, documents):
    """Golovneva et al. 2024, eq. 3-5, in float64: g_ij = sigmoid(q_i . k_j) (here scaled as the logits are),
    p_ij = sum_{k=j..i} g_ik, clamped at max_pos, e[p] = (p - floor p) e[ceil p] + (1 - p + floor p) e[floor p],
    a_ij = softmax_j(z_ij + q_i . e[p_ij]) over the keys j <= i of query i's document (`documents` [B, T] ids)."""
    groups = query.shape[1] // key.shape[1]
    query, embeddings = query.double(), embeddings.double()
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    length = query.shape[2]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    allowed = (causal[None] & (documents[:, :, None] == documents[:, None, :]))[:, None]  # [B, 1, T, T]
    logits = scaling * query @ key.transpose(2, 3)
    gates = torch.sigmoid(logits) * allowed
    positions = torch.stack([gates[..., j:].sum(-1) for j in range(length)], -1).clamp(max=max_pos)
    low, high = positions.floor().long(), positions.ceil().long()
    fraction = (positions - low)[..., None]
    table = embeddings.T  # [max_pos + 1, D]
    interpolated = fraction * table[high] + (1 - fraction) * table[low]  # [B, H, T, T, D]
    logits = logits + (query[:, :, :, None, :] * interpolated).sum(-1)
    weights = logits.masked_fill(~allowed, float("-inf")).softmax(-1)
    return weights @ value, bool((positions == max_pos).any())


# (batch, heads, key heads, tokens, head dim, max_pos, documents' lengths per row or None)
CASES = {
    "one token": (1, 2, 1, 1, 16, 3, None),
    "7 tokens, gqa, clamped": (2, 2, 1, 7, 16, 2, None),
    "64 tokens, never clamped": (1, 2, 2, 64, 32, 64, None),
    "100 tokens, gqa, clamped": (1, 2, 1, 100, 16, 5, None),
    "packed, gqa, clamped": (2, 2, 1, 40, 32, 4, (13, 16, 11)),
}
CLAMPED = {"one token": False, "7 tokens, gqa, clamped": True, "64 tokens, never clamped": False,
           "100 tokens, gqa, clamped": True, "packed, gqa, clamped": True}
# Outputs within these, gradients within twice. float64: observed <= 2e-14; float32: 3e-6, as a plain float32
# computation of the formula (2e-5 for the one token's gradients that are zero in exact arithmetic, against 1% of the
# largest); float16: the inputs and outputs rounded to float16, observed <= 1.7e-3.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3}


def case_inputs(batch, heads, key_heads, length, dim, max_pos, lengths, seed=0):
    generator = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    tensors = [make(batch, heads, length, dim), make(batch, key_heads, length, dim),
               make(batch, key_heads, length, dim), 0.5 * make(dim, max_pos + 1)]
    documents = torch.zeros(batch, length, dtype=torch.long)
    cu_seqlens = None
    if lengths is not None:
        assert sum(lengths) == length
        documents[:] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        row_starts = torch.cumsum(torch.tensor((0, *lengths[:-1])), 0)
        cu_seqlens = torch.cat([row_starts + row * length for row in range(batch)] + [torch.tensor([batch * length])])
    return tensors, documents, cu_seqlens


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_kernel_and_gradients_match_the_paper(dtype, case, device):
    batch, heads, key_heads, length, dim, max_pos, lengths = CASES[case]
    tensors, documents, cu_seqlens = case_inputs(*CASES[case])
    scaling = dim**-0.5
    weight = torch.randn(batch, heads, length, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # The embeddings in float32 under half-precision inputs, as a model's kept in float32 would be.
    kernel_dtypes = [dtype] * 3 + [torch.float64 if dtype == torch.float64 else torch.float32]
    leaves = [t.to(d).to(device).requires_grad_(True) for t, d in zip(tensors, kernel_dtypes)]
    output = cope_attention(*leaves, scaling, max_pos, None if cu_seqlens is None else cu_seqlens.to(device))
    assert output.dtype == dtype and output.shape == (batch, heads, length, dim)
    grads = torch.autograd.grad((output.double() * weight.to(device)).sum(), leaves)
    references = [t.clone().requires_grad_(True) for t in tensors]
    want, clamped = paper_reference(*references, scaling, max_pos, documents)
    want_grads = torch.autograd.grad((want * weight).sum(), references)
    assert clamped == CLAMPED[case]
    got = output.double().cpu()
    assert torch.isfinite(got).all()
    error = ((got - want).abs().max() / want.abs().max()).item()
    assert error < TOLERANCE[dtype], f"output: {error:.3g}"
    # A gradient that is zero in exact arithmetic (one token: the output is its value, whatever q, k and e) counts
    # against 1% of the largest one, as kernels/check.py does.
    largest = max(float(g.abs().max()) for g in want_grads)
    for name, grad, want_grad, leaf in zip(("query", "key", "value", "embeddings"), grads, want_grads, leaves):
        assert grad.dtype == leaf.dtype
        scale = max(float(want_grad.abs().max()), 1e-2 * largest)
        error = (grad.double().cpu() - want_grad).abs().max().item() / scale
        assert error < 2 * TOLERANCE[dtype], f"gradient w.r.t. {name}: {error:.3g}"


@pytest.fixture
def fresh_checks():
    attention.reset_kernel_status()
    yield
    attention.reset_kernel_status()


def _patched(family, device, max_pos, dtype=torch.float32):
    model = hf_posenc.patch_model(tiny_model(family).to(dtype), "cope", max_pos=max_pos).to(device).eval()
    with torch.no_grad():  # off their zero init, so that the position term counts in the forward
        embeddings = hf_posenc.get_positional_module(model).position_embeddings
        embeddings.copy_(0.5 * torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(2)))
    return model


def _outputs_and_gradients(model, path, **inputs):
    model.zero_grad()
    inputs = {name: tensor.to(model.device) for name, tensor in inputs.items()}
    attention.last_paths.clear()
    with attention.attention_path(path):
        logits = model(**inputs, use_cache=False).logits  # no cache: transformers reads packed position ids
    keep = inputs["attention_mask"].bool() if "attention_mask" in inputs else torch.ones(logits.shape[:2], dtype=bool,
                                                                                         device=logits.device)
    (logits[keep] * torch.linspace(-1, 1, logits.shape[-1], device=logits.device)).sum().backward()
    grads = {name: p.grad.cpu() for name, p in model.named_parameters() if p.grad is not None}
    return logits[keep].detach().cpu(), grads, attention.last_paths["triton"]


def _assert_paths_agree(model, triton_calls, **inputs):
    blocked, blocked_grads, blocked_calls = _outputs_and_gradients(model, "blocked", **inputs)
    served, served_grads, served_calls = _outputs_and_gradients(model, "triton", **inputs)
    assert blocked_calls == 0 and served_calls == triton_calls
    assert (served - blocked).abs().max() <= 1e-4 * blocked.abs().max()
    assert served_grads.keys() == blocked_grads.keys()
    assert any("position_embeddings" in name for name in blocked_grads)
    largest = max(grad.abs().max() for grad in blocked_grads.values())
    for name, grad in blocked_grads.items():
        assert (served_grads[name] - grad).abs().max() <= 1e-4 * max(grad.abs().max(), 1e-2 * largest), name


MODEL_CASES = {
    "llama, causal, clamped": ("llama", 3, dict(input_ids=random_ids(2, 40))),
    "llama, causal, max_pos 64": ("llama", 64, dict(input_ids=random_ids(2, 40))),
    "llama, packed": ("llama", 3, dict(input_ids=random_ids(1, 40),
                                       position_ids=torch.cat([torch.arange(14), torch.arange(19),
                                                               torch.arange(7)])[None])),
    "gpt2, causal": ("gpt2", 3, dict(input_ids=random_ids(2, 24))),
}


@pytest.mark.parametrize("case", MODEL_CASES)
def test_triton_path_equals_blocked(case, device, fresh_checks):
    """Every layer served by the kernel, each check passed (outputs and gradients, the position embeddings')."""
    family, max_pos, inputs = MODEL_CASES[case]
    model = _patched(family, device, max_pos)
    _assert_paths_agree(model, model.config.num_hidden_layers, **inputs)
    verdicts = attention.kernel_status()
    assert verdicts and all(v.passed and v.kernel == "triton (cope)" for v in verdicts)
    kinds = [v.kind for v in verdicts]
    assert any(kind[0] == "gradients" for kind in kinds)
    assert any(("packed" if "packed" in case else "causal") in kind for kind in kinds)


def test_a_left_padded_batch_goes_to_the_blocked_path(device, fresh_checks):
    padded, mask = left_pad([random_ids(1, 37, seed=3)[0], random_ids(1, 22, seed=4)[0]])
    _assert_paths_agree(_patched("llama", device, 3), 0, input_ids=padded, attention_mask=mask)
    assert attention.kernel_status() == []


def test_float64_is_served(device, fresh_checks):
    """Unlike fla's kernels, ours takes float64 (computed in float64; the blocked path computes CoPE's logits in
    float32, methods/cope.py ContextualScores: observed 2e-7 apart)."""
    model = _patched("llama", device, 3, torch.float64)
    ids = random_ids(2, 20).to(device)
    outputs = {}
    for path in ("blocked", "triton"):
        attention.last_paths.clear()
        with torch.no_grad(), attention.attention_path(path):
            outputs[path] = model(ids).logits
        assert attention.last_paths["triton"] == (model.config.num_hidden_layers if path == "triton" else 0)
    assert (outputs["triton"] - outputs["blocked"]).abs().max() <= 2e-6 * outputs["blocked"].abs().max()


def test_the_check_refuses_a_wrong_position_embeddings_gradient(device, fresh_checks, monkeypatch):
    """The kernel check's gradient probe compares the method's parameters' gradients too: a kernel that reads the
    position embeddings as constants (right outputs, no gradient to them) is refused, and the blocked path serves."""
    entry = by_method.KERNELS["cope"]

    def detached(method, layer_idx, query, key, value, gates, scaling, cu_seqlens):
        return cope_attention(query, key, value, method.position_embeddings[layer_idx].detach(), scaling,
                              method.config.max_pos, cu_seqlens)

    monkeypatch.setitem(by_method.KERNELS, "cope",
                        dataclasses.replace(entry, triton=dataclasses.replace(entry.triton, run=detached)))
    model = _patched("llama", device, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_paths_agree(model, 0, input_ids=random_ids(2, 24))
    assert any(issubclass(w.category, KernelCheckWarning) for w in caught)
    refused = [v for v in attention.kernel_status() if not v.passed]
    assert len(refused) == 1 and refused[0].kind[0] == "gradients"
    assert "position_embeddings" in refused[0].detail


CALLS_THE_KERNEL_DOES_NOT_TAKE = {
    "bfloat16 on the CPU": lambda: (tiny_model("llama").bfloat16(), {}),  # the interpreter's bf16 products are wrong
    "eager attention (weights asked for)": lambda: (tiny_model("llama", attn_implementation="eager"), {}),
    "BLOOM's ALiBi kept underneath (base=native)": lambda: (tiny_model("bloom"), {"base": "native"}),
}


@pytest.mark.parametrize("case", CALLS_THE_KERNEL_DOES_NOT_TAKE)
def test_calls_the_kernel_does_not_take_never_reach_it(case, monkeypatch, fresh_checks):
    """The blocked path serves them without trying the kernel (here it raises, which a check would record)."""
    model, options = CALLS_THE_KERNEL_DOES_NOT_TAKE[case]()
    model = hf_posenc.patch_model(model, "cope", **options)

    def untouchable(*args, **kwargs):
        raise AssertionError("the Triton kernel was called")

    entry = by_method.KERNELS["cope"]
    monkeypatch.setitem(by_method.KERNELS, "cope",
                        dataclasses.replace(entry, triton=dataclasses.replace(entry.triton, run=untouchable)))
    attention.last_paths.clear()
    with attention.attention_path("triton"):
        model(random_ids(2, 12)).logits.float().sum().backward()
    assert attention.last_paths["triton"] == 0 and attention.last_paths["content"] == model.config.num_hidden_layers
    assert attention.kernel_status() == []


def test_a_decoding_step_after_a_cache_goes_to_the_blocked_path(fresh_checks):
    model = _patched("llama", "cpu", 3)
    ids = random_ids(2, 20)
    outputs = {}
    for path in ("blocked", "triton"):
        with torch.no_grad(), attention.attention_path(path):
            cache = model(ids[:, :17], use_cache=True).past_key_values
            attention.last_paths.clear()
            outputs[path] = model(ids[:, 17:], past_key_values=cache, use_cache=True).logits
        assert attention.last_paths["triton"] == 0 and attention.last_paths["content"] == 2
    assert (outputs["triton"] - outputs["blocked"]).abs().max() <= 1e-5 * outputs["blocked"].abs().max()
