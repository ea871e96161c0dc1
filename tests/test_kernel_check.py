"""The flex and flash attention paths, and the rule that no compiled or external kernel serves numbers that were not
checked on the machine it runs on (hf_posenc/engine/kernels/check.py): stand-in kernels that are wrong (perturbed, NaN,
raising, wrong gradients) are refused with one warning and the blocked path's numbers are served; a right one is
checked once per kind."""

from __future__ import annotations

import math
import sys
import types
import warnings

import pytest
import torch
from transformers import DynamicCache

import hf_posenc
from hf_posenc import attention
from hf_posenc.engine.attention import bias_path
from hf_posenc.engine.attention.call import AttentionCall
from hf_posenc.engine.attention.table_attention import FUSED_KERNEL
from hf_posenc.engine.kernels import check as kernel_check
from hf_posenc.engine.kernels.check import KernelCall, KernelCheckWarning, table_attention_reference
from helpers import decode_token_by_token, left_pad, max_diff
from tiny_models import random_ids, tiny_model


@pytest.fixture(autouse=True)
def fresh_verdicts():
    """Verdicts last for the process: every test starts and ends without any."""
    attention.reset_kernel_status()
    attention.last_paths.clear()
    yield
    attention.reset_kernel_status()


def path_verdicts():
    """kernel_status() but for the fused CPU table backward's check, which the blocked path's training takes on its
    own (table_attention.py) beside the path a test checks."""
    return [verdict for verdict in attention.kernel_status() if verdict.kernel != FUSED_KERNEL]


def kernel_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, KernelCheckWarning)]


def counting(function):
    """`function` with the query shapes of its calls listed in `.calls` (its first argument the queries, or an
    AttentionCall)."""
    def counted(*args, **kwargs):
        query = args[0] if args else kwargs["query"]
        query = query.query if isinstance(query, AttentionCall) else query
        counted.calls.append(tuple(query.shape))
        return function(*args, **kwargs)
    counted.calls = []
    return counted


def counting_blocked():
    return counting(bias_path.blocked_attention)


def perturbed(*args, **kwargs):
    return table_attention_reference(*args, **kwargs) + 2e-3


def nan_in_second_sequence(*args, **kwargs):  # what compiled flex did on this project's CPU
    output = table_attention_reference(*args, **kwargs).clone()
    output[1:] = math.nan
    return output


def raising(*args, **kwargs):
    raise RuntimeError("C++ compile error\nin the generated kernel")


def reads_past_the_keys(query, key, value, table, offset, valid, scaling):
    """Right, but it also reads the 16 elements after the keys' last one (what compiled flex did on this project's
    CPU): its numbers depend on what lies there, here zeros while the storage ends with the keys."""
    storage = key.untyped_storage()
    everything = key.new_empty(0).set_(storage, 0, (storage.nbytes() // key.element_size(),))
    end = key.storage_offset() + 1 + sum((size - 1) * stride for size, stride in zip(key.shape, key.stride()))
    beyond = everything[end:end + 16]
    return table_attention_reference(query, key, value, table, offset, valid, scaling) + 0.0 * beyond.sum()


def logits(model, *inputs, path, **kwargs):
    with torch.no_grad(), attention.attention_path(path):
        return [model(ids, **kwargs).logits for ids in inputs]


# stand-in kernels through the real flex dispatch (flex on CPU, no gradients) -------------------------------------
@pytest.mark.parametrize("wrong,failure", [
    (perturbed, "an error of 0.0"), (nan_in_second_sequence, "NaN or Inf where the reference is finite"),
    (raising, "it raised RuntimeError: C++ compile error"),
    (reads_past_the_keys, "NaN or Inf where the reference is finite (on NaN-fenced copies of its inputs)")])
def test_a_wrong_kernel_is_refused_with_one_warning_and_blocked_serves(wrong, failure, monkeypatch):
    model = hf_posenc.patch_model(tiny_model("llama"), "t5")
    ids = random_ids(2, 20)
    expected = logits(model, ids, ids[:1], path="blocked")
    stand_in = counting(wrong)
    monkeypatch.setattr(bias_path, "_flex_kernel", stand_in)
    attention.last_paths.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = logits(model, ids, ids, ids[:1], path="flex")
    messages = kernel_warnings(caught)
    assert len(messages) == 1
    for part in ("flex attention kernel", "on cpu", f"torch {torch.__version__}", failure,
                 "The blocked path serves every flex call on cpu for the rest of this process"):
        assert part in messages[0]
    # the checking call only (on NaN-fenced copies of the inputs, then on the inputs); refused from then on
    assert stand_in.calls == [(2, 4, 20, 16)] * (1 if wrong is raising else 2)
    assert attention.last_paths == {"blocked": 2 * 3}
    for got, want in zip(served, [expected[0], expected[0], expected[1]]):
        assert torch.equal(got, want)
    [verdict] = attention.kernel_status()
    assert (verdict.kernel, verdict.device, verdict.passed) == ("flex", "cpu", False) and failure in verdict.detail
    assert verdict.kind == ("torch.float32", (2, 4, 20, 16), (2, 2, 20, 16), 0, "no mask", "no grad")


def test_a_right_kernel_is_checked_once_per_kind_then_serves_unchecked(monkeypatch):
    model = hf_posenc.patch_model(tiny_model("llama"), "t5")
    ids = random_ids(2, 20)
    padded, mask = left_pad([ids[0], ids[1, :13]])
    stand_in = counting(table_attention_reference)
    references = counting_blocked()
    monkeypatch.setattr(bias_path, "_flex_kernel", stand_in)
    monkeypatch.setattr(bias_path, "blocked_attention", references)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = logits(model, ids, path="flex")[0]
        assert len(attention.kernel_status()) == 1 and attention.last_paths == {"flex": 2}
        again = logits(model, ids, path="flex")[0]
        assert len(attention.kernel_status()) == 1 and len(references.calls) == 1  # same kind: no check
        logits(model, ids[:1], path="flex")  # another batch size
        logits(model, padded, path="flex", attention_mask=mask)  # a padding mask
        cache = DynamicCache(config=model.config)
        with torch.no_grad(), attention.attention_path("flex"):
            model(ids[:, :12], past_key_values=cache, use_cache=True)
            model(ids[:, 12:], past_key_values=cache, use_cache=True)  # a chunk after the cache: 8 queries, 20 keys
    kinds = [verdict.kind for verdict in attention.kernel_status()]
    assert all(verdict.passed for verdict in attention.kernel_status()) and kernel_warnings(caught) == []
    assert [kind[1:5] for kind in kinds] == [
        ((2, 4, 20, 16), (2, 2, 20, 16), 0, "no mask"), ((1, 4, 20, 16), (1, 2, 20, 16), 0, "no mask"),
        ((2, 4, 20, 16), (2, 2, 20, 16), 0, "mask"), ((2, 4, 12, 16), (2, 2, 12, 16), 0, "no mask"),
        ((2, 4, 8, 16), (2, 2, 20, 16), 12, "mask")]  # transformers gives a chunk its causal mask
    # one check per kind (in layer 0; layer 1 is the same kind), on all rows
    assert references.calls == [(2, 4, 20, 16), (1, 4, 20, 16), (2, 4, 20, 16), (2, 4, 12, 16), (2, 4, 8, 16)]
    assert attention.last_paths == {"flex": 2 * 6} and len(stand_in.calls) == 2 * 6 + 5  # + 5 fenced runs
    assert torch.equal(first, again)
    assert max_diff(first, logits(model, ids, path="blocked")[0]) <= 1e-5


def test_a_long_call_is_checked_on_its_first_and_last_rows(monkeypatch):
    """Past CHECK_ROWS queries the reference runs on the first and the last CHECK_ROWS/2 rows only; a kernel wrong
    in the last row of the second sequence is caught there."""
    def wrong_at_the_end(*args, **kwargs):
        output = table_attention_reference(*args, **kwargs).clone()
        output[1, -1] += 1.0
        return output

    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    ids = random_ids(2, 300)
    references = counting_blocked()
    monkeypatch.setattr(bias_path, "blocked_attention", references)
    monkeypatch.setattr(bias_path, "_flex_kernel", wrong_at_the_end)
    with pytest.warns(KernelCheckWarning, match="an error of"):
        served = logits(model, ids, path="flex")[0]
    assert references.calls[:2] == [(2, 4, 64, 16), (2, 4, 64, 16)]  # the check: 2 x 64 rows of 300
    assert references.calls[2:] == [(2, 4, 300, 16)] * 2  # then the blocked path serves both layers
    assert torch.equal(served, logits(model, ids, path="blocked")[0])


@pytest.mark.parametrize("kernel", ["flex", "flash"])
def test_gradients_are_checked_on_a_probe_and_a_wrong_backward_is_refused(kernel, monkeypatch):
    """flex's backward (CUDA only in torch 2.13) and flash-attn's are checked once per gradient kind, on at most 2
    sequences x 64 queries and keys, against a float64 reference: w.r.t. queries, keys, values and (flex) the
    table. Stand-ins run here on CPU: right in value and gradients, or right in value with halved gradients."""
    if kernel == "flex":
        monkeypatch.setattr(bias_path, "FLEX_BACKWARD_DEVICES", ("cuda", "cpu"))
        right = table_attention_reference

        def halved(query, key, value, table, offset, valid, scaling):  # same values, half the table's gradient
            return table_attention_reference(query, key, value, (table + table.detach()) / 2, offset, valid, scaling)

        install, method, wrong_input = (lambda k: monkeypatch.setattr(bias_path, "_flex_kernel", k)), "t5", "table"
    else:
        monkeypatch.setattr(bias_path, "_flash_device", lambda query: True)
        right = fake_flash_attn_func

        def halved(q, k, v, softmax_scale, causal, alibi_slopes):  # same values, half the values' gradient
            return fake_flash_attn_func(q, k, (v + v.detach()) / 2, softmax_scale, causal, alibi_slopes)

        def install(function):
            monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=function))

        method, wrong_input = "alibi", "value"
    model = hf_posenc.patch_model(tiny_model("llama"), method)
    ids = random_ids(2, 20)

    def gradients(path):
        model.zero_grad(set_to_none=True)
        with attention.attention_path(path):
            model(ids, labels=ids).loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    expected = gradients("blocked")
    install(right)
    attention.last_paths.clear()
    for got, want in zip(gradients(kernel), expected):
        assert max_diff(got, want) <= 1e-5 * max(1.0, want.abs().max().item())
    assert [(v.kind[0], v.passed) for v in path_verdicts()] == [("torch.float32", True), ("gradients", True)]
    assert attention.last_paths == {kernel: 2}

    attention.reset_kernel_status()
    install(halved)
    attention.last_paths.clear()
    with pytest.warns(KernelCheckWarning, match=f"gradients w.r.t. {wrong_input}: an error of 0.5"):
        served = gradients(kernel)
    assert [(v.kind[0], v.passed) for v in path_verdicts()] == [("torch.float32", True), ("gradients", False)]
    assert attention.last_paths == {"blocked": 2}
    assert all(torch.equal(got, want) for got, want in zip(served, expected))


def test_reset_forgets_refusals(monkeypatch):
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    monkeypatch.setattr(bias_path, "_flex_kernel", raising)
    with pytest.warns(KernelCheckWarning):
        logits(model, random_ids(1, 10), path="flex")
    monkeypatch.setattr(bias_path, "_flex_kernel", table_attention_reference)
    logits(model, random_ids(1, 10), path="flex")
    assert attention.last_paths == {"blocked": 4}
    attention.reset_kernel_status()
    assert attention.kernel_status() == []
    logits(model, random_ids(1, 10), path="flex")
    assert attention.last_paths == {"blocked": 4, "flex": 2}


def test_any_kernel_plugs_in_through_a_kernel_call():
    """The comparison rules, for a kernel of any kind: rows that attend to nothing and reference values that are not
    finite are not compared; the tolerance fits the dtype."""
    torch.manual_seed(0)
    reference = torch.randn(2, 10, 4, 8)
    reference[0, :3] = 1 / 3  # padding queries: undefined (uniform in the blocked path)
    defined = torch.ones(2, 10, dtype=torch.bool)
    defined[0, :3] = False

    def call(output, kind, reference=reference):
        return KernelCall("future-triton", torch.device("cpu"), kind, function=lambda x: output, inputs={"x": reference},
                          reference=lambda rows: reference[:, rows], defined=lambda: defined)

    padded_zero = reference.clone()
    padded_zero[0, :3] = 0.0
    assert kernel_check.serve(call(padded_zero, ("padding rows",))) is padded_zero
    infinite = reference.clone()
    infinite[1, 5] = math.inf
    assert kernel_check.serve(call(reference, ("reference not finite",), infinite)) is reference
    off = (reference * (1 + 5e-3)).bfloat16()
    assert kernel_check.serve(call(off, ("bf16",), reference.bfloat16())) is off
    with pytest.warns(KernelCheckWarning, match="float32 tolerance 1e-04"):
        assert kernel_check.serve(call(reference * (1 + 5e-3), ("float32",))) is None
    assert kernel_check.serve(call(reference, ("another kind",))) is None  # refused on this device
    assert [v.passed for v in attention.kernel_status()] == [True, True, True, False]


# flash-attn's contract, and real compiled flex -------------------------------------------------------------------
def fake_flash_attn_func(q, k, v, softmax_scale, causal, alibi_slopes):
    """flash-attn's documented semantics, in float64: layout [B, L, H, D]; causal aligned to the bottom right; ALiBi
    adds -slope * |i + kv - q - j| (so it takes positive slopes)."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    rows, keys = q.shape[2], k.shape[2]
    i = torch.arange(rows)[:, None] + keys - rows
    j = torch.arange(keys)[None]
    scores = q @ k.transpose(2, 3) * softmax_scale - alibi_slopes.double()[:, None, None] * (i - j).abs()
    if causal:
        scores = scores.masked_fill(j > i, -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2).float()


def test_flash_path_passes_flash_attn_what_it_expects(monkeypatch):
    """No GPU here: flash-attn is replaced by its documented semantics, and the CUDA/half check by True, so what is
    tested is our side of the contract (layout, scale, positive slopes, causal alignment, when it applies), and that
    decoding is checked once per size class of the keys, not at every step."""
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_func=fake_flash_attn_func))
    monkeypatch.setattr(bias_path, "_flash_device", lambda query: True)
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi")
    ids = random_ids(2, 20)
    with torch.no_grad(), attention.attention_path("blocked"):
        expected = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :12], past_key_values=cache, use_cache=True)
        expected_decoded = decode_token_by_token(model, ids[:, 12:], cache)
    attention.last_paths.clear()
    with torch.no_grad(), attention.attention_path("flash"):
        flash = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :12], past_key_values=cache, use_cache=True)
        decoded = decode_token_by_token(model, ids[:, 12:], cache)
        ids_padded, mask = left_pad([ids[0], ids[1, :13]])
        model(ids_padded, attention_mask=mask)  # padding: not for flash
    assert attention.last_paths == {"flash": 2 * (1 + 1 + 8), "blocked": 2}
    assert max_diff(flash, expected) <= 1e-5
    assert max_diff(decoded, expected_decoded) <= 1e-5
    checked = [(v.kind[4:8], v.passed) for v in attention.kernel_status()]
    assert checked == [(("square", 2, 5, 5), True), (("square", 2, 4, 4), True),  # prompts of 20 and 12
                       (("decoding", 2, 1, 4), True), (("decoding", 2, 1, 5), True)]  # 13-15 keys, 16-20 keys
    hf_posenc.patch_model(model, "alibi", trainable=True)  # learned slopes need gradients flash-attn does not give
    attention.last_paths.clear()
    with torch.no_grad(), attention.attention_path("flash"):
        model(ids)
    assert attention.last_paths == {"blocked": 2}


@pytest.mark.slow
def test_flex_attention_path_equals_blocked_forward_backward_and_decoding():
    """Real compiled flex_attention on this CPU (once per shape there, so slow). flex serves the no-grad prefills
    whose shape passed its check; decoding and training (flex has no backward on CPU) stay blocked. Where the check
    refuses compiled flex (torch 2.13 on an AMD EPYC CPU gave NaN for the second sequence at length 40), the blocked
    path serves the rest with one warning: the outputs equal blocked either way, and the verdicts say which served."""
    model = hf_posenc.patch_model(tiny_model("llama"), "t5")
    ids = random_ids(2, 40)
    ids_padded, mask = left_pad([ids[0], ids[1, :25]])

    def run():
        model.train(False)
        with torch.no_grad():
            logits = model(ids).logits
            padded = model(ids_padded, attention_mask=mask).logits
            cache = DynamicCache(config=model.config)
            model(ids[:, :30], past_key_values=cache, use_cache=True)
            decoded = decode_token_by_token(model, ids[:, 30:], cache)
        model.train(True)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        weight = hf_posenc.get_positional_module(model).weight
        return logits, padded, decoded, weight.grad.clone()

    blocked = run()
    attention.last_paths.clear()
    with warnings.catch_warnings(record=True) as caught, attention.attention_path("flex"):
        warnings.simplefilter("always")
        flex = run()
    verdicts = path_verdicts()
    passed = [v for v in verdicts if v.passed]
    refused = [v for v in verdicts if not v.passed]
    assert all(v.kernel == "flex" and v.device == "cpu" for v in verdicts)
    # three prefill kinds (forward, padded forward, prompt of 30); each passed one serves both layers
    if refused:  # nothing is checked after a refusal
        assert refused == verdicts[-1:] and len(verdicts) <= 3
    else:
        assert len(passed) == 3
    assert attention.last_paths["flex"] == 2 * len(passed)
    assert attention.last_paths["blocked"] == 2 * (3 + 10 + 1) - 2 * len(passed)
    assert len(kernel_warnings(caught)) == len(refused)
    if refused:
        assert f"torch {torch.__version__}" in kernel_warnings(caught)[0]
    assert max_diff(flex[0], blocked[0]) <= 1e-5
    assert max_diff(flex[1][mask.bool()], blocked[1][mask.bool()]) <= 1e-5
    assert max_diff(flex[2], blocked[2]) <= 1e-5
    assert max_diff(flex[3], blocked[3]) <= 1e-5 * blocked[3].abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flex_trains_a_learned_table_where_it_has_a_backward(dtype, device):
    """Real compiled flex on a training step of T5's learned table (GQA, 4 query and 2 key-value heads). Where flex
    has a backward (CUDA: `--device cuda`) it passes its check and serves every call, in bfloat16 too, and the
    gradients equal the blocked path's. (On an H100 and an H200 with torch 2.11, inductor's default tiles asked for
    more shared memory than there is once a table is captured, and the check refused flex in bfloat16:
    FLEX_CUDA_KERNEL_OPTIONS.) On the CPU flex has no backward: the blocked path serves, with no check and no
    warning."""
    ids = random_ids(2, 40).to(device)

    def step(path):
        model = hf_posenc.patch_model(tiny_model("llama"), "t5").to(device=device, dtype=dtype).train()
        attention.last_paths.clear()
        with attention.attention_path(path):
            model(ids, labels=ids).loss.backward()
        return dict(attention.last_paths), {name: p.grad.float() for name, p in model.named_parameters()}

    blocked_paths, expected = step("blocked")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths, served = step("flex")
    assert kernel_warnings(caught) == []
    assert blocked_paths == {"blocked": 2}
    assert paths == ({"flex": 2} if device.type in bias_path.FLEX_BACKWARD_DEVICES else {"blocked": 2})
    assert all(v.passed for v in attention.kernel_status())
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4  # two kernels' roundings, carried through the model
    for name, gradient in expected.items():
        assert max_diff(served[name], gradient) <= tolerance * max(1.0, gradient.abs().max().item()), name


def test_compiled_flex_calls_get_their_own_recompile_allowance(monkeypatch):
    """Past dynamo's recompile limit (8 by default) a compiled function runs uncompiled: flex_attention then
    materialises every score matrix (5x slower on an H200, and its backward raised at 16384 tokens). Each compiled
    flex call runs with the limit raised to FLEX_RECOMPILE_LIMIT, and the process-wide setting is left as it was.
    (The limit is set with dynamo's own `config.patch`: pytest's monkeypatch undoes it with a delattr, which hides
    the setting from every later torch.compile in the process.)"""
    config = torch._dynamo.config
    seen = []

    def compiled(query, key, value, **kwargs):
        seen.append(config.recompile_limit)
        return query

    monkeypatch.setitem(bias_path._compiled_flex, "cpu", compiled)
    query = torch.randn(1, 2, 8, 4)
    with config.patch(recompile_limit=1):
        out = bias_path._flex_kernel(query, query, query, torch.zeros(2, 8), 0, torch.ones(1, 8, dtype=torch.bool),
                                     0.5)
        assert out.shape == (1, 8, 2, 4)
        assert seen == [attention.FLEX_RECOMPILE_LIMIT] and config.recompile_limit == 1
    with config.patch(recompile_limit=4 * attention.FLEX_RECOMPILE_LIMIT):  # a user's higher limit stays
        bias_path._flex_kernel(query, query, query, torch.zeros(2, 8), 0, torch.ones(1, 8, dtype=torch.bool), 0.5)
        assert seen[-1] == 4 * attention.FLEX_RECOMPILE_LIMIT


def test_a_parameter_gradient_that_is_zero_in_exact_arithmetic_is_not_held_to_its_own_noise():
    """The gradient probe compares parameters' gradients too (GradientProbe.parameters). A parameter that adds the
    same value to every logit of a row (CAPE's output bias) has a gradient that is zero in exact arithmetic: each
    side's is rounding noise, as large as its own reference. Its error counts against the probe's largest gradient
    (GRADIENT_FLOOR of it: 1e-2 x 2e-4 of it in float32); a parameter whose gradient is wrong is still refused."""
    generator = torch.Generator().manual_seed(0)
    scores, value = torch.randn(2, 3, 16, 16, generator=generator), torch.randn(2, 3, 16, 8, generator=generator)
    shift = torch.randn(3, 1, 1, generator=generator).requires_grad_(True)

    def kernel(scores):
        return (scores + shift).softmax(-1) @ value

    def reference(scores):  # the same softmax in another order of operations: other rounding
        weights = (scores + shift - (scores + shift).amax(-1, keepdim=True)).exp()
        return (weights / weights.sum(-1, keepdim=True)) @ value

    probe = kernel_check.GradientProbe({"scores": scores}, kernel=kernel, reference=reference,
                                       parameters={"shift": shift})
    (noise,) = torch.autograd.grad(reference(scores.requires_grad_(True)).square().sum(), [shift])
    assert 0 < noise.abs().max() < 1e-4  # what it is: noise
    error, detail = kernel_check._gradient_error(probe, 2e-4)
    assert detail == "" and error <= 2e-4

    def wrong(scores):
        return kernel(scores) + ((shift - shift.detach()) * 1e-2).sum()

    error, detail = kernel_check._gradient_error(
        kernel_check.GradientProbe({"scores": scores}, kernel=wrong, reference=reference, parameters={"shift": shift}),
        2e-4)
    assert error > 2e-4 and detail.startswith("gradients w.r.t. shift")
