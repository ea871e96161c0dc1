"""Content-dependent attention (methods/base.py ContentMethod): each method against an independent, materialised
float64 computation of its formula from the layer's own inputs and projections (captured with hooks on a tiny LLaMA
whose RoPE the method removed), base="native" reproducing the original model, the options under the contract's
cached-decoding and padding checks, and refusals. The contract suite (test_contract.py) covers every family with the
defaults."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc.methods.base import unmasked_columns
from helpers import (TOL, count_hooks, decode_token_by_token, left_pad, max_diff,
                     padded_and_cached_outputs_and_gradients, positions_from_mask, without_kernel)
from tiny_models import FAMILIES, random_ids, tiny_model


# --- capturing one layer's inputs, projections and attention output --------------------------------------------------
def budget_module(budget: str):
    """The module of engine/attention/ that reads a block budget: the content path its own, block_rows the others."""
    from hf_posenc.engine.attention import content_path, geometry

    return content_path if budget.startswith("CONTENT") else geometry


def capture_llama_layers(model, ids, attention_mask=None):
    """Per layer of a LLaMA model: x (attention input), q, k, v ([B, heads, L, D], float64, GQA expanded) and the
    attention output before o_proj [B, L, H*D], from a forward with hooks (no rotation: base="none" removed RoPE)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    captured, handles = [], []
    for layer in model.model.layers:
        record = {}
        attention = layer.self_attn

        def keep(name, record=record):
            return lambda module, args, output: record.__setitem__(name, output)

        handles += [attention.register_forward_pre_hook(
                        lambda m, a, k, record=record: record.__setitem__("x", k.get("hidden_states", a[0] if a else None)),
                        with_kwargs=True),
                    attention.q_proj.register_forward_hook(keep("q")), attention.k_proj.register_forward_hook(keep("k")),
                    attention.v_proj.register_forward_hook(keep("v")),
                    attention.o_proj.register_forward_pre_hook(lambda m, a, record=record: record.__setitem__("out", a[0]))]
        captured.append(record)
    with torch.no_grad():
        model(ids, attention_mask=attention_mask)
    for handle in handles:
        handle.remove()
    for record in captured:
        batch, length = record["x"].shape[:2]
        for name, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensor = record[name].double().view(batch, length, count, head_dim).transpose(1, 2)
            record[name] = tensor.repeat_interleave(heads // count, dim=1) if count != heads else tensor
        record["x"] = record["x"].double()
        record["out"] = record["out"].double()
    return captured


def causal_softmax(logits: torch.Tensor) -> torch.Tensor:
    length = logits.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# --- FoX ------------------------------------------------------------------------------------------------------------
def fox_reference(module, layer: int, record: dict) -> torch.Tensor:
    """Forgetting attention in float64, materialised: D_ij = sum_{l=j+1..i} log sigmoid(w . x_l + b), summed
    term by term (not as a difference of cumulative sums), plus the FoX-Pro parts the config enables."""
    config = module.config
    x, q, k, v = record["x"], record["q"], record["k"], record["v"]
    batch, heads, length, head_dim = q.shape
    log_f = F.logsigmoid(x @ module.gate_weight[layer].double().T + module.gate_bias[layer].double())  # [B, L, H]
    if module.gate_scale is not None:
        log_f = log_f * module.gate_scale[layer].double()
    decay = torch.zeros(batch, heads, length, length, dtype=torch.float64)
    for i in range(length):
        for j in range(i):
            decay[:, :, i, j] = log_f[:, j + 1:i + 1].sum(1)
    groups = heads // module.num_kv_heads
    for name in ("key", "value"):  # FoX-Pro's token shift, per key-value head, before the QK-norm
        if getattr(config, f"{name}_shift"):
            amount = torch.sigmoid(x @ getattr(module, f"{name}_shift_weight")[layer].double().T)  # [B, L, H_kv]
            amount = amount.transpose(1, 2).repeat_interleave(groups, dim=1)[..., None]
            tensor = {"key": k, "value": v}[name]
            shifted = torch.zeros_like(tensor)
            for t in range(length):
                shifted[:, :, t] = (1 - amount[:, :, t]) * tensor[:, :, t] + (
                    amount[:, :, t] * tensor[:, :, t - 1] if t > 0 else 0.0)
            k, v = (shifted, v) if name == "key" else (k, shifted)
    if config.qk_norm:
        q = rms(q, module.query_norm[layer].double().repeat_interleave(1, 0)[None, :, None], eps=1e-5)
        kv_norm = module.key_norm[layer].double()
        k = rms(k, kv_norm.repeat_interleave(heads // kv_norm.shape[0], 0)[None, :, None], eps=1e-5)
    logits = q @ k.transpose(-1, -2) / math.sqrt(head_dim) + decay
    out = causal_softmax(logits) @ v
    if config.output_norm:
        out = rms(out, module.output_norm_weight[layer].double()[None, :, None])
    out = out.transpose(1, 2).reshape(batch, length, heads * head_dim)
    if config.output_gate:
        factor = 2 if config.output_gate_form == "identity" else 1
        out = out * factor * torch.sigmoid(x @ module.output_gate_weight[layer].double().T)
    return out


@pytest.mark.parametrize("options", [{}, {"gate_init": "decay-time", "qk_norm": True, "output_norm": True,
                                          "output_gate": True},
                                     {"key_shift": True}, {"value_shift": True},
                                     {"qk_norm": True, "output_norm": True, "output_gate": True, "key_shift": True,
                                      "value_shift": True}])
def test_fox_matches_a_float64_reference(options):
    model = hf_posenc.patch_model(tiny_model("llama"), "fox", **options)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():  # off their initial values, so that every part acts
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(5)))
    ids = random_ids(2, 10)
    for layer, record in enumerate(capture_llama_layers(model, ids)):
        assert max_diff(record["out"], fox_reference(module, layer, record)) <= 1e-5


def test_fox_decay_time_init_gives_those_decay_times():
    model = hf_posenc.patch_model(tiny_model("llama"), "fox", gate_init="decay-time", decay_time=[2.0, 200.0])
    gate = torch.sigmoid(hf_posenc.get_positional_module(model).gate_bias.detach().double())
    times = -1 / torch.log(gate)
    expected = torch.logspace(math.log10(2.0), math.log10(200.0), 4, dtype=torch.float64)
    assert torch.allclose(times, expected.expand_as(times), rtol=1e-4)


# --- DroPE ----------------------------------------------------------------------------------------------------------
def drope_reference(module, layer: int, record: dict) -> torch.Tensor:
    """DroPE's qk_norm_nope attention in float64 (SakanaAI/DroPE custom_models/attention.py): nn.RMSNorm over each
    token's whole query projection (all heads) and whole key projection, no rotation, logits softmax_scale * q . k."""
    config = module.config
    q, k, v = record["q"], record["k"], record["v"]  # GQA expanded: each key head repeated for its group
    batch, heads, length, head_dim = q.shape
    if config.qk_norm:
        def norm(x, weight):
            flat = x.transpose(1, 2).reshape(batch, length, -1)
            return (flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + config.norm_eps)
                    * weight).view(batch, length, heads, head_dim).transpose(1, 2)

        kv_heads = module.key_norm.shape[1] // head_dim
        key_weight = module.key_norm[layer].double().view(kv_heads, head_dim).repeat_interleave(heads // kv_heads, 0)
        # the RMS of the expanded keys equals that of the key heads: each is repeated the same number of times
        q, k = norm(q, module.query_norm[layer].double()), norm(k, key_weight.reshape(-1))
    scale = config.softmax_scale if config.softmax_scale is not None else head_dim ** -0.5
    out = causal_softmax(scale * q @ k.transpose(-1, -2)) @ v
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


@pytest.mark.parametrize("options", [{}, {"softmax_scale": 0.4}, {"qk_norm": False, "softmax_scale": 0.1},
                                     {"norm_eps": 1e-2}])
def test_drope_matches_a_float64_reference(options):
    model = hf_posenc.patch_model(tiny_model("llama"), "drope", **options)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():  # off their initial ones, so that the norms' weights act
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(5)))
    ids = random_ids(2, 10)
    for layer, record in enumerate(capture_llama_layers(model, ids)):
        assert max_diff(record["out"], drope_reference(module, layer, record)) <= 1e-5


@pytest.mark.parametrize("model_type", FAMILIES)
def test_drope_without_its_options_is_nope_exactly(model_type):
    ids = random_ids(2, 12)
    with torch.no_grad():
        nope = hf_posenc.patch_model(tiny_model(model_type), "nope")(ids).logits
        drope = hf_posenc.patch_model(tiny_model(model_type), "drope", qk_norm=False)(ids).logits
        normed = hf_posenc.patch_model(tiny_model(model_type), "drope")(ids).logits
    if model_type == "bloom":  # NoPE keeps BLOOM's own eager attention (zero ALiBi); the patched path runs SDPA
        assert max_diff(nope, drope) <= 1e-6
    else:
        assert torch.equal(nope, drope)
    assert max_diff(nope, normed) > 1e-3  # the norms are no identity: the options act


# --- what every content method keeps ---------------------------------------------------------------------------------
NATIVE_CASES = [("fox", {"base": "native"}), ("fox", {"base": "native", "output_gate": True}),
                ("cope", {"base": "native"}), ("transformer-xl", {"base": "native"}),
                ("cape", {"base": "native"}), ("cape", {"base": "native", "bias": "fire"})]
OPTION_CASES = [("stick-breaking", {"attend_current": True}), ("stick-breaking", {"base": "native"}),
                ("fox", {"gate_init": "decay-time", "qk_norm": True, "output_norm": True, "output_gate": True}),
                ("fox", {"base": "native", "gate_bias": -1.0, "output_gate": True}),
                ("fox", {}),  # the contract suite patches fox with its token shifts on (helpers.CONTRACT)
                ("fox", {"qk_norm": True, "output_norm": True, "output_gate": True, "key_shift": True,
                         "value_shift": True}),
                ("fox", {"base": "native", "value_shift": True}),
                ("cope", {"max_pos": 3}), ("cope", {"base": "native"}),
                ("transformer-xl", {"base": "native", "relative_dim": 6}),
                ("cape", {"bias": "fire", "mlp_width": 8}), ("cape", {"base": "native", "bias": "t5"}),
                ("tape", {"init": "random", "gate_input": "mlp_output"}),  # the authors' gate input
                ("drope", {"softmax_scale": 0.3}), ("drope", {"qk_norm": False, "softmax_scale": 2.0})]
# Stick-breaking, and DroPE without its QK-norm, have no parameters.
GRADIENT_CASES = [case for case in OPTION_CASES if case[0] != "stick-breaking" and case[1].get("qk_norm", True)]


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("method,options", NATIVE_CASES)
def test_native_base_starts_from_the_original_logits(method, options, model_type):
    model = tiny_model(model_type)
    ids = random_ids(2, 12)
    with torch.no_grad():
        original = model(ids).logits
        hf_posenc.patch_model(model, method, **options)
        assert max_diff(model(ids).logits, original) <= 1e-5


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("method,options", OPTION_CASES)
def test_options_keep_cached_decoding_and_padding_exact(method, options, model_type):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    with torch.no_grad():  # off the initial values (a native gate scale of 0 would hide the gates)
        for param in hf_posenc.get_positional_module(model).parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    ids = random_ids(2, 12)
    sequences = [random_ids(1, 9, seed=3)[0], random_ids(1, 5, seed=4)[0]]
    padded, mask = left_pad(sequences)
    with torch.no_grad():
        full = model(ids).logits
        assert max_diff(full, decode_token_by_token(model, ids, DynamicCache(config=model.config))) <= TOL
        assert max_diff(full, decode_token_by_token(model, ids, StaticCache(config=model.config, max_cache_len=20))) <= TOL
        batch = model(padded, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        for row, seq in enumerate(sequences):
            assert max_diff(batch[row, -len(seq):], model(seq[None]).logits[0]) <= TOL


@pytest.mark.parametrize("method,options", GRADIENT_CASES)
def test_gradients_reach_every_option_parameter(method, options):
    model = hf_posenc.patch_model(tiny_model("llama"), method, **options)
    with torch.no_grad():
        for param in hf_posenc.get_positional_module(model).parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    model.train()
    ids = random_ids(2, 10)
    model(ids, labels=ids).loss.backward()
    for name, param in hf_posenc.get_positional_module(model).named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_a_cache_filled_without_the_state_is_refused():
    model = tiny_model("llama")
    ids = random_ids(1, 6)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    hf_posenc.patch_model(model, "fox")
    with pytest.raises(hf_posenc.PosEncError, match="start from an empty cache"):
        model(ids[:, -1:], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("method,options,message", [
    ("fox", {"base": "rope"}, "base"),
    ("fox", {"gate_init": "slow"}, "gate_init"),
    ("fox", {"decay_time": [100.0, 10.0]}, "decay_time"),
    ("fox", {"qk_norm": 1}, "qk_norm"),
    ("fox", {"key_shift": "yes"}, "key_shift"),
    ("stick-breaking", {"base": "rope"}, "base"),
    ("cope", {"max_pos": 0}, "max_pos"),
    ("transformer-xl", {"relative_dim": 5}, "relative_dim"),
    ("drope", {"base": "native"}, "drops"),
    ("drope", {"softmax_scale": 0.0}, "softmax_scale"),
    ("drope", {"qk_norm": "yes"}, "qk_norm"),
    ("cape", {"bias": "rope"}, "attention-bias method"),
    ("cape", {"bias": "fire", "bias_options": {"no_such_option": 1}}, "no_such_option"),
])
def test_bad_options_are_refused_and_the_model_left_untouched(method, options, message):
    model = tiny_model("llama")
    ids = random_ids(1, 6)
    with torch.no_grad():
        before = model(ids).logits
    with pytest.raises(hf_posenc.PosEncError, match=message):
        hf_posenc.patch_model(model, method, **options)
    assert hf_posenc.get_posenc_config(model) is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


# --- stick-breaking -------------------------------------------------------------------------------------------------
def stick_breaking_reference(module, layer: int, record: dict) -> torch.Tensor:
    """Stick-breaking attention in float64, materialised: A_ij = beta_ij * prod over the keys between (a product of
    probabilities, term by term), and the left-over 1 - sum_j A_ij on the query's own value."""
    q, k, v = record["q"], record["k"], record["v"]
    batch, heads, length, head_dim = q.shape
    beta = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(head_dim))
    weights = torch.zeros_like(beta)
    current = module.config.attend_current
    for i in range(length):
        for j in range(i + 1 if current else i):
            keep = torch.ones(batch, heads, dtype=torch.float64)
            for between in range(j + 1, i + 1 if current else i):
                keep = keep * (1 - beta[:, :, i, between])
            weights[:, :, i, j] = beta[:, :, i, j] * keep
    out = weights @ v + (1 - weights.sum(-1, keepdim=True)) * v
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


@pytest.mark.parametrize("attend_current", [False, True])
def test_stick_breaking_matches_a_float64_reference(attend_current):
    model = hf_posenc.patch_model(tiny_model("llama"), "stick-breaking", attend_current=attend_current)
    module = hf_posenc.get_positional_module(model)
    ids = random_ids(2, 10)
    for layer, record in enumerate(capture_llama_layers(model, ids)):
        assert max_diff(record["out"], stick_breaking_reference(module, layer, record)) <= 1e-5


@pytest.mark.parametrize("padded", [True, False])  # False: the first 4 columns need no mask (unmasked_columns)
@pytest.mark.parametrize("attend_current", [False, True])
def test_stick_breaking_weights_backward_equals_autograd_of_the_chain_in_float64(attend_current, padded, device):
    """Stick-breaking's block weights have a hand-written backward (StickBreakingWeights): its weights and the
    logits' gradient equal autograd's through the paper's chain in float64 (log-sigmoids, the reverse cumulative sum
    of log(1 - beta) shifted by one, the remainder on the row's own key), for a block of rows at the end of a causal
    square with a padded row, the own key breaking or not."""
    from hf_posenc.methods.stick_breaking import StickBreakingWeights

    generator = torch.Generator().manual_seed(7)
    logits = 3 * torch.randn(2, 3, 5, 9, dtype=torch.float64, generator=generator)
    allowed = torch.arange(9)[None, None, None, :] <= torch.arange(4, 9)[None, None, :, None]
    if padded:
        allowed = allowed & torch.tensor([[[[True] * 9]], [[[False] * 2 + [True] * 7]]])
    own = torch.arange(9)[None, :] == torch.arange(4, 9)[:, None]
    breaks = allowed if attend_current else allowed & ~own
    assert unmasked_columns(breaks) == (0 if padded else 4 + attend_current)
    upstream = torch.randn(2, 3, 5, 9, dtype=torch.float64, generator=generator)
    logits, breaks, own, upstream = (x.to(device) for x in (logits, breaks, own, upstream))

    def chain(logits, breaks, own):
        log_keep = F.logsigmoid(-logits).masked_fill(~breaks, 0.0)
        after = F.pad(log_keep.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
        weights = torch.exp(F.logsigmoid(logits) + after).masked_fill(~breaks, 0.0)
        return weights + torch.exp(log_keep.sum(-1, keepdim=True)) * own.to(weights.dtype)

    results = []
    for function, dtype in ((chain, torch.float64), (StickBreakingWeights.apply, torch.float32)):
        inputs = logits.detach().to(dtype).requires_grad_()
        weights = function(inputs, breaks, own)
        (weights * upstream.to(dtype)).sum().backward()
        results.append((weights, inputs.grad))
    for ours, reference in zip(*results[::-1]):
        assert max_diff(ours, reference) <= 1e-5 * max(1.0, reference.abs().max())


def test_stick_breaking_weights_sum_to_one_and_favour_recent_keys_in_eager_mode():
    model = hf_posenc.patch_model(tiny_model("llama", attn_implementation="eager"), "stick-breaking")
    with torch.no_grad():
        weights = model(random_ids(1, 12), output_attentions=True).attentions[0]
    assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-5)
    assert (weights >= 0).all() and (weights.triu(1) == 0).all()


# --- CoPE -----------------------------------------------------------------------------------------------------------
def cope_reference(module, layer: int, record: dict) -> torch.Tensor:
    """CoPE in float64, materialised: p_ij summed gate by gate, e[p] interpolated as a vector (not the scalars)."""
    q, k, v = record["q"], record["k"], record["v"]
    batch, heads, length, head_dim = q.shape
    embeddings = module.position_embeddings[layer].double().T  # [max_pos + 1, head_dim]
    z = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    gates = torch.sigmoid(z)
    logits = z.clone()
    for i in range(length):
        for j in range(i + 1):
            p = gates[:, :, i, j:i + 1].sum(-1).clamp(max=module.config.max_pos)  # [B, H]
            low, high = p.floor().long(), p.ceil().long()
            w = (p - p.floor())[..., None]
            e = embeddings[low] * (1 - w) + embeddings[high] * w  # [B, H, head_dim]
            logits[:, :, i, j] += (q[:, :, i] * e).sum(-1)
    out = causal_softmax(logits) @ v
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


@pytest.mark.parametrize("max_pos", [3, 64])  # 3: positions clamp within these 10 tokens
def test_cope_matches_a_float64_reference(max_pos):
    model = hf_posenc.patch_model(tiny_model("llama"), "cope", max_pos=max_pos)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        module.position_embeddings.normal_(0, 1.0, generator=torch.Generator().manual_seed(2))
    ids = random_ids(2, 10)
    for layer, record in enumerate(capture_llama_layers(model, ids)):
        assert max_diff(record["out"], cope_reference(module, layer, record)) <= 1e-5


@pytest.mark.parametrize("padded", [True, False])  # False: the first 5 columns need no mask (unmasked_columns)
@pytest.mark.parametrize("max_pos", [3, 64])
def test_cope_scores_backward_equals_autograd_of_the_chain_in_float64(max_pos, padded, device):
    """CoPE's block logits have a hand-written backward (ContextualScores): its logits and the gradients of the
    queries, keys and embeddings equal autograd's through the paper's chain in float64 (gates, reverse cumulative sum,
    clamp, the embeddings' scalars at floor p and ceil p interpolated), for a block of rows at the end of a causal
    square with a padded row, positions clamped (max_pos=3) and not."""
    from hf_posenc.methods.cope import ContextualScores

    generator = torch.Generator().manual_seed(5)
    query, key = (2 * torch.randn(2, 3, n, 8, dtype=torch.float64, generator=generator) for n in (5, 9))
    embeddings = torch.randn(8, max_pos + 1, dtype=torch.float64, generator=generator)
    allowed = torch.arange(9)[None, None, None, :] <= torch.arange(4, 9)[None, None, :, None]
    if padded:
        allowed = allowed & torch.tensor([[[[True] * 9]], [[[False] * 2 + [True] * 7]]])
    assert unmasked_columns(allowed) == (0 if padded else 5)
    upstream = torch.randn(2, 3, 5, 9, dtype=torch.float64, generator=generator) * allowed
    query, key, embeddings, allowed, upstream = (x.to(device) for x in (query, key, embeddings, allowed, upstream))
    scaling = 8 ** -0.5

    def chain(query, key, embeddings):
        logits = query @ key.transpose(2, 3) * scaling
        gates = torch.sigmoid(logits).masked_fill(~allowed, 0.0)
        positions = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=float(max_pos))
        integer = query @ embeddings
        weight = positions - positions.floor()
        below, above = (integer.gather(-1, index.long()) for index in (positions.floor(), positions.ceil()))
        return logits + below * (1 - weight) + above * weight

    results = []
    for function, dtype in ((chain, torch.float64), (lambda *heads: ContextualScores.apply(
            *heads, allowed, scaling, float(max_pos)), torch.float32)):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (query, key, embeddings)]
        scores = function(*inputs)
        (scores * upstream.to(dtype)).sum().backward()
        results.append([scores.masked_fill(~allowed, 0.0)] + [x.grad for x in inputs])
    for ours, reference in zip(results[1], results[0]):
        assert max_diff(ours, reference) <= 1e-5 * max(1.0, reference.abs().max())


# --- Transformer-XL -------------------------------------------------------------------------------------------------
def transformer_xl_reference(module, layer: int, record: dict) -> torch.Tensor:
    """Transformer-XL's four terms (a) + (b) + (c) + (d) in float64, materialised pair by pair, R built here."""
    q, k, v = record["q"], record["k"], record["v"]
    batch, heads, length, head_dim = q.shape
    dim = module.relative_dim
    W = module.relative_projection[layer].double()  # [H, head_dim, dim]
    u, vb = module.content_bias[layer].double(), module.position_bias[layer].double()
    logits = torch.zeros(batch, heads, length, length, dtype=torch.float64)
    for i in range(length):
        for j in range(i + 1):
            t = float(i - j)
            R = torch.tensor([math.sin(t / 10000 ** (2 * n / dim)) for n in range(dim // 2)]
                             + [math.cos(t / 10000 ** (2 * n / dim)) for n in range(dim // 2)], dtype=torch.float64)
            WR = W @ R  # [H, head_dim]
            a = (q[:, :, i] * k[:, :, j]).sum(-1)
            b = (q[:, :, i] * WR).sum(-1)
            c = (u * k[:, :, j]).sum(-1)
            d = (vb * WR).sum(-1)
            logits[:, :, i, j] = (a + b + c + d) / math.sqrt(head_dim)
    out = causal_softmax(logits) @ v
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


@pytest.mark.parametrize("relative_dim", [None, 6])
def test_transformer_xl_matches_a_float64_reference(relative_dim):
    model = hf_posenc.patch_model(tiny_model("llama"), "transformer-xl", relative_dim=relative_dim)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in (module.content_bias, module.position_bias):
            param.normal_(0, 0.5, generator=torch.Generator().manual_seed(4))
    ids = random_ids(2, 10)
    for layer, record in enumerate(capture_llama_layers(model, ids)):
        assert max_diff(record["out"], transformer_xl_reference(module, layer, record)) <= 1e-5


def test_transformer_xl_with_far_apart_positions_uses_the_distances_that_occur():
    """Position ids with large gaps take the torch.unique branch; a cached continuation agrees with the full forward."""
    model = hf_posenc.patch_model(tiny_model("llama"), "transformer-xl")
    ids = random_ids(1, 8)
    positions = torch.tensor([[0, 1, 2, 500, 501, 9000, 9001, 9002]])
    with torch.no_grad():
        full = model(ids, position_ids=positions).logits
        cache = DynamicCache(config=model.config)
        first = model(ids[:, :5], position_ids=positions[:, :5], past_key_values=cache, use_cache=True).logits
        rest = model(ids[:, 5:], position_ids=positions[:, 5:], past_key_values=cache, use_cache=True).logits
    assert max_diff(full, torch.cat((first, rest), dim=1)) <= TOL


# --- CAPE -----------------------------------------------------------------------------------------------------------
def cape_reference(module, layer: int, record: dict) -> torch.Tensor:
    """CAPE in float64: the MLP applied to each pair's 2H features one pair at a time; B from the bias method's
    own materialised bias."""
    q, k, v = record["q"], record["k"], record["v"]
    batch, heads, length, head_dim = q.shape
    positions = torch.arange(length)[None]
    bias = module.bias_method.bias(layer, positions, positions).double().expand(batch, heads, length, length)
    z = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    W1, b1 = module.input_weight[layer].double(), module.input_bias[layer].double()
    W2, b2 = module.output_weight[layer].double(), module.output_bias[layer].double()
    logits = z.clone()
    for i in range(length):
        for j in range(i + 1):
            pair = torch.cat((z[:, :, i, j], bias[:, :, i, j]), dim=-1)  # [B, 2H]
            hidden = pair @ W1.T + b1
            hidden = F.gelu(hidden) if module.config.activation == "gelu" else F.leaky_relu(hidden, 0.01)
            correction = hidden @ W2.T + b2
            logits[:, :, i, j] += correction + (bias[:, :, i, j] if module.config.base == "none" else 0)
    out = causal_softmax(logits) @ v
    return out.transpose(1, 2).reshape(batch, length, heads * head_dim)


@pytest.mark.parametrize("bias, activation", [("alibi", "leaky_relu"), ("kerple", "leaky_relu"), ("fire", "gelu")])
def test_cape_matches_a_float64_reference(bias, activation):
    model = hf_posenc.patch_model(tiny_model("llama"), "cape", bias=bias, mlp_width=8, activation=activation)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in (module.input_bias, module.output_weight, module.output_bias):
            param.normal_(0, 0.5, generator=torch.Generator().manual_seed(6))
    ids = random_ids(2, 10)
    for layer, record in enumerate(capture_llama_layers(model, ids)):
        assert max_diff(record["out"], cape_reference(module, layer, record)) <= 1e-5


@pytest.mark.parametrize("method", ["fox"])  # the one method with carried per-token state
def test_beam_search_reorders_the_carried_state(method):
    """Beam search reorders the KV cache each step; each returned beam's score equals its log-probability under a
    full forward of its tokens only if the per-token state followed the reorder."""
    model = hf_posenc.patch_model(tiny_model("llama"), method)
    with torch.no_grad():
        for param in hf_posenc.get_positional_module(model).parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=torch.Generator().manual_seed(8)))
    prompt = random_ids(1, 6)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False,
                             length_penalty=0.0, early_stopping=True, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)
        for sequence, score in zip(out.sequences, out.sequences_scores):
            log_probs = torch.log_softmax(model(sequence[None]).logits[0, :-1].float(), dim=-1)
            generated = log_probs[5:].gather(-1, sequence[6:, None]).sum()
            assert abs(float(generated) - float(score)) <= 1e-4


@pytest.mark.parametrize("method", ["fox", "stick-breaking", "cope", "transformer-xl", "cape"])
def test_many_query_blocks_give_what_one_block_gives(method, monkeypatch):
    """The references above run one block; with CONTENT_BLOCK_BYTES shrunk each block holds a few rows (and sees only
    the keys causality allows it), for a prompt, a left-padded batch and a chunk after a cache."""
    from hf_posenc.engine import attention as engine
    from hf_posenc.engine.attention import content_path

    model = hf_posenc.patch_model(tiny_model("llama"), method)
    with torch.no_grad():
        for param in hf_posenc.get_positional_module(model).parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=torch.Generator().manual_seed(3)))
    ids = random_ids(2, 20)
    padded, mask = left_pad([random_ids(1, 20, seed=3)[0], random_ids(1, 13, seed=4)[0]])

    def run():
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(ids[:, :7], past_key_values=cache, use_cache=True)
            chunk = model(ids[:, 7:], past_key_values=cache, use_cache=True).logits
            # padding rows see no key at all: what they get depends on the block's width, and nothing reads it
            return model(ids).logits, model(padded, attention_mask=mask).logits[mask.bool()], chunk

    one = run()
    rows = 3
    cost = hf_posenc.get_positional_module(model).block_cost
    monkeypatch.setattr(content_path, "CONTENT_BLOCK_BYTES", int(4 * 2 * 4 * 20 * cost * rows))
    assert engine.block_rows(2, 4, 20, cost, budget=content_path.CONTENT_BLOCK_BYTES) == rows
    for a, b in zip(one, run()):
        assert max_diff(a, b) <= 1e-5


@pytest.mark.parametrize("method, options", [("stick-breaking", {}), ("cope", {"max_pos": 4}), ("cape", {}),
                                             ("fox", {"base": "native", "key_shift": True})])
def test_recomputed_blocks_give_the_gradients_of_plain_autograd(method, options, monkeypatch, device):
    """Training through the blocked path recomputes each query block in the backward and adds its gradient into its
    slice of one buffer per tensor (RecomputedBlocks): the queries' (and their state's) by the block's rows, the keys',
    values' (and their state's) by its columns, the method's parameters summed over the blocks. Its logits and every
    parameter's gradient equal plain autograd's through the eager blocks (nothing recomputed), over blocks of 3 rows,
    a left-padded batch and a chunk after a cache, in a float64 model (the blocks' logits are float32). FoX is held
    on its generic blocks (its separable form off), so that its per-token state takes part, and stick-breaking's full
    batch on them too (its fused CPU kernel off)."""
    from hf_posenc.engine import attention as engine

    model = hf_posenc.patch_model(tiny_model("llama"), method, **options).double()
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    model.to(device)
    monkeypatch.setattr(type(module), "separable_terms", lambda self, query_state, key_state: None, raising=False)
    without_kernel(monkeypatch, module, causal=None)
    padded, mask = (x.to(device) for x in left_pad([random_ids(1, 20, seed=3)[0], random_ids(1, 13, seed=4)[0]]))
    ids = random_ids(2, 20).to(device)
    for budget in ("CONTENT_BLOCK_BYTES", "ACCELERATOR_BLOCK_BYTES"):  # the CPU's content blocks and a GPU's
        monkeypatch.setattr(budget_module(budget), budget, int(4 * 2 * 4 * 20 * module.block_cost * 3))

    engine.last_paths.clear()
    recomputed = padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 7)
    assert engine.last_paths["content recomputed"] == 3 * model.config.num_hidden_layers
    model.set_attn_implementation("eager")
    engine.last_paths.clear()
    plain = padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 7)
    assert engine.last_paths["content recomputed"] == 0 and engine.last_paths["content"] > 0
    assert len(recomputed) == len(plain) > 2 + len(list(module.parameters()))
    for a, b in zip(recomputed, plain):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())


# --- FoX-Pro's token shift -------------------------------------------------------------------------------------------
def test_fox_token_shift_is_not_the_identity_at_init():
    """Documented as such (a_t starts near 1/2): on top of the native RoPE, a value shift moves the logits at once."""
    model = tiny_model("llama")
    ids = random_ids(2, 10)
    with torch.no_grad():
        original = model(ids).logits
        hf_posenc.patch_model(model, "fox", base="native", value_shift=True)
        assert max_diff(model(ids).logits, original) > 1e-3


def test_fox_token_shift_ignores_the_padding_before_a_row():
    """The first real token of a left-padded row is shifted with zeros, as the first token of the sequence alone:
    whatever the padding tokens are."""
    model = hf_posenc.patch_model(tiny_model("llama"), "fox", key_shift=True, value_shift=True)
    sequence = random_ids(1, 6, seed=3)[0]
    mask = torch.tensor([[0, 0, 0] + [1] * 6])
    with torch.no_grad():
        alone = model(sequence[None]).logits[0]
        for pad in (0, 7):
            padded = torch.cat((torch.full((3,), pad), sequence))[None]
            logits = model(padded, attention_mask=mask, position_ids=positions_from_mask(mask)).logits[0, 3:]
            assert max_diff(logits, alone) <= TOL


def test_fox_token_shift_refuses_a_cache_that_dropped_a_predecessor():
    model = tiny_model("mistral")
    model.config.sliding_window = 4
    hf_posenc.patch_model(model, "fox", key_shift=True)
    ids = random_ids(1, 8)
    cache = DynamicCache(config=model.config)
    with torch.no_grad(), pytest.raises(hf_posenc.PosEncError, match="predecessor"):
        decode_token_by_token(model, ids, cache)


@pytest.mark.parametrize("options", [{}, {"base": "native", "qk_norm": True, "output_gate": True, "key_shift": True}])
@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_fox_kernel_path_equals_the_generic_path_in_float64(options, model_type, monkeypatch):
    """FoX's logits' bias c_i - c_j is a term per query minus one per key (separable_terms): SDPA's kernel per block
    with a custom backward (engine/attention/separable.py). Its logits and the gradients of every parameter equal the
    generic path's (content_scores, eager softmax) over several blocks, a left-padded batch and a chunk after a cache,
    in a float64 model, to the generic path's float32 logits' precision."""
    from hf_posenc.engine import attention as engine

    model = hf_posenc.patch_model(tiny_model(model_type), "fox", **options).double()
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    padded, mask = left_pad([random_ids(1, 20, seed=3)[0], random_ids(1, 13, seed=4)[0]])
    ids = random_ids(2, 20)
    for budget in ("BLOCK_BYTES", "CONTENT_BLOCK_BYTES"):  # the kernel's blocks and the generic path's
        monkeypatch.setattr(budget_module(budget), budget, 4 * 2 * 4 * 20 * 6)  # blocks of 6 rows

    def run():
        return padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 7)

    engine.last_paths.clear()
    fast = run()
    assert engine.last_paths["separable"] > 0
    monkeypatch.setattr(type(module), "separable_terms", lambda self, query_state, key_state: None, raising=False)
    engine.last_paths.clear()
    generic = run()
    assert engine.last_paths["separable"] == 0 and len(fast) == len(generic) > 2
    for a, b in zip(fast, generic):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())


@pytest.mark.parametrize("options", [{}, {"base": "native", "key_shift": True}])
def test_fox_one_causal_call_equals_the_generic_path_in_float64(options, monkeypatch):
    """Without padding or a cache, FoX's c_i - c_j rides in the heads (Q' = [Q, c / scale, 1], K' = [K, 1,
    -c / scale]) and one causal SDPA call serves the layer; its logits and every parameter's gradient equal the
    generic path's, with c large enough (gate bias -3: c falls by about 3 per token) that a term dropped or mis-scaled
    would show."""
    from hf_posenc.engine import attention as engine

    model = hf_posenc.patch_model(tiny_model("llama"), "fox", gate_bias=-3.0, **options).double()
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    ids = random_ids(2, 24)

    def run():
        model.zero_grad()
        logits = model(ids).logits
        logits.sin().sum().backward()
        return [logits] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    engine.last_paths.clear()
    fast = run()
    assert engine.last_paths["separable causal"] > 0 and engine.last_paths["content"] == engine.last_paths["separable"]
    monkeypatch.setattr(type(module), "separable_terms", lambda self, query_state, key_state: None, raising=False)
    engine.last_paths.clear()
    generic = run()
    assert engine.last_paths["separable causal"] == 0 and len(fast) == len(generic) > 2
    for a, b in zip(fast, generic):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())  # c is float32: c_i - c_j rounds in the generic path


KERNEL_CASES = [("transformer-xl", {}, "llama"), ("transformer-xl", {"relative_dim": 6}, "gpt2"),
                ("transformer-xl", {"base": "native"}, "llama"), ("tape", {"init": "random"}, "llama"),
                ("tape", {"init": "random", "base": "native"}, "gpt2")]


def _perturbed(method: str, options: dict, model_type: str):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options).double()
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    return model, module


@pytest.mark.parametrize("method,options,model_type", KERNEL_CASES)
def test_kernel_heads_path_equals_the_generic_path(method, options, model_type, monkeypatch):
    """Transformer-XL's logits as a dot product of augmented queries and keys, TAPE's of feature-turned ones
    (kernel_heads): one SDPA call per layer, TAPE's keys' features beside the values. Its logits and the gradients of
    every parameter equal the generic path's (content_scores, eager softmax, per-block checkpointing) over a
    left-padded batch (SDPA per block with a mask), a chunk after a cache and a full batch (one causal call), in a
    float64 model, to the float32 precision both compute in."""
    from hf_posenc.engine import attention as engine

    model, module = _perturbed(method, options, model_type)
    padded, mask = left_pad([random_ids(1, 20, seed=3)[0], random_ids(1, 13, seed=4)[0]])
    ids = random_ids(2, 20)
    for budget in ("BLOCK_BYTES", "CONTENT_BLOCK_BYTES"):  # the kernel's blocks and the generic path's
        monkeypatch.setattr(budget_module(budget), budget, 4 * 2 * 4 * 20 * 6)  # blocks of a few rows

    def run():
        logits = padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 7)
        full = model(ids).logits  # one causal call per layer, no mask
        return logits + [full]

    engine.last_paths.clear()
    fast = run()
    assert 0 < engine.last_paths["content kernel"] == engine.last_paths["content"]
    monkeypatch.setattr(type(module), "kernel_heads", lambda self, *arguments, **options: None)
    without_kernel(monkeypatch, module, heads=None)
    engine.last_paths.clear()
    generic = run()
    assert engine.last_paths["content kernel"] == 0 and len(fast) == len(generic) > 3
    for a, b in zip(fast, generic):
        assert max_diff(a, b) <= 1e-5 * max(1.0, b.abs().max())


@pytest.mark.parametrize("attention_mask", [False, True])
def test_transformer_xl_keeps_the_generic_path_where_positions_go_back(attention_mask, monkeypatch):
    """Position ids that restart among the attended keys (with a cache, which transformers does not read as packed
    documents) meet relative_distance's clamp at 0, which the kernel form does not reproduce: such a call takes the
    generic path (and gives what it gives). That is decided before any kernel call: with query blocks of 4 rows, the
    first block's keys are in order, and no kernel call is made for it either."""
    import torch.nn.functional as F

    from hf_posenc.engine import attention as engine

    model, module = _perturbed("transformer-xl", {}, "llama")
    ids = random_ids(1, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    mask = torch.tensor([[0] + [1] * 11]) if attention_mask else None  # (all ones would reach attention as None)
    kernel_calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: kernel_calls.append(1) or sdpa(*a, **k))
    for budget in ("BLOCK_BYTES", "CONTENT_BLOCK_BYTES"):
        monkeypatch.setattr(budget_module(budget), budget, 4 * 4 * 12)  # block_rows: 4 query rows of 12 keys
    engine.last_paths.clear()
    with torch.no_grad():
        logits = model(ids, position_ids=positions, attention_mask=mask).logits
        assert engine.last_paths["content kernel"] == 0 and engine.last_paths["content"] > 0
        assert kernel_calls == []
        monkeypatch.setattr(type(module), "kernel_heads", lambda self, *arguments, **options: None)
        generic = model(ids, position_ids=positions, attention_mask=mask).logits
    assert max_diff(logits, generic) == 0.0


def test_transformer_xl_kernel_form_serves_packed_documents(monkeypatch):
    """The fine-tune's document restarts (position ids restarting, no cache: transformers masks attention across
    documents): every attended key is then before its query, so the kernel form serves, and gives each document's
    logits alone."""
    from hf_posenc.engine import attention as engine

    model, module = _perturbed("transformer-xl", {}, "llama")
    ids = random_ids(1, 12)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]])
    engine.last_paths.clear()
    with torch.no_grad():
        packed = model(ids, position_ids=positions, use_cache=False).logits
        assert 0 < engine.last_paths["content kernel"] == engine.last_paths["content"]
        alone = torch.cat((model(ids[:, :6]).logits, model(ids[:, 6:]).logits), dim=1)
        monkeypatch.setattr(type(module), "kernel_heads", lambda self, *arguments, **options: None)
        generic = model(ids, position_ids=positions, use_cache=False).logits
    assert max_diff(packed, alone) <= 1e-5 and max_diff(packed, generic) <= 1e-5


def test_transformer_xl_kernel_form_at_16k_positions():
    """The kernel form's position logits against the per-block path's (sinusoid of the integer distance) for queries
    at positions near 16k and keys anywhere before: they differ by the per-block path's own float32 rounding of the
    angle t w (t up to 16k), not more. Figures: the largest difference and the logits' scale."""
    from hf_posenc.methods.base import relative_distance

    model, module = _perturbed("transformer-xl", {}, "llama")
    module = module.float()
    heads, head_dim = module.content_bias.shape[1:]
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, heads, 8, head_dim, generator=generator)
    key = torch.randn(1, heads, 64, head_dim, generator=generator)
    query_positions = torch.arange(16376, 16384)[None]
    key_positions = torch.cat((torch.arange(32), torch.arange(16352, 16384)))[None]
    with torch.no_grad():
        augmented_query, augmented_key = module.kernel_heads(0, query, key, None, None, query_positions, key_positions)
        kernel = augmented_query @ augmented_key.transpose(2, 3)
        content = (query + module.content_bias[0][None, :, None, :]) @ key.transpose(2, 3)
        distances = relative_distance(query_positions, key_positions).long()
        blocked = content + module.position_logits(query, 0, distances)
        exact = content.double() + exact_position_logits(module, query, distances)
    ordered = distances > 0  # pairs with the key after the query are clamped; the test keeps the ordered ones
    ordered |= key_positions[:, None, None, :] == query_positions[:, None, :, None]
    scale = exact.abs().max()
    # Measured (logits up to 27): kernel form - exact <= 4.4e-6; per-block path - exact <= 1.6e-3 at distances near
    # 16k, 3.5e-6 at small ones (float32 angles in the kernel form would give 1.9e-3 even at small distances).
    assert (kernel.double() - exact)[ordered.expand_as(kernel)].abs().max() <= 1e-6 * scale
    assert (kernel - blocked)[ordered.expand_as(kernel)].abs().max() <= 1e-4 * scale


def exact_position_logits(module, query, distances):
    """(q + v) . W_R R_t in float64 with the angles t w of the float32 frequencies computed in float64."""
    from hf_posenc.methods.transformer_xl import sinusoid_frequencies

    angles = distances.double()[..., None] * sinusoid_frequencies(module.relative_dim).double()
    table = torch.cat((angles.sin(), angles.cos()), dim=-1)  # [1, 1, r, k, R]
    coefficients = torch.einsum("bhqd,hdr->bhqr", (query + module.position_bias[0][None, :, None, :]).double(),
                                module.relative_projection[0].double())
    return (coefficients[:, :, :, None, :] * table).sum(-1)


MASKED_IN_PLACE = [name for name in hf_posenc.registry.available_methods()
                   if getattr(hf_posenc.registry.get_method(name).module_class, "scores_maskable_in_place", False)]


@pytest.mark.parametrize("method", MASKED_IN_PLACE)
def test_scores_masked_in_place_train_like_scores_masked_in_a_copy(method, monkeypatch):
    """A method that declares `scores_maskable_in_place` has the attention path mask its logits in place: autograd
    must not have saved them (else the backward raises) and nothing else may read them. On the generic blocks (kernel
    forms off), a left-padded batch and a chunk after a cache give the same logits and gradients either way, bit for
    bit."""
    model = hf_posenc.patch_model(tiny_model("llama"), method).double()
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6)))
    monkeypatch.setattr(type(module), "separable_terms", lambda self, query_state, key_state: None, raising=False)
    monkeypatch.setattr(type(module), "kernel_heads", lambda self, *args, **options: None, raising=False)
    without_kernel(monkeypatch, module, heads=None)
    padded, mask = left_pad([random_ids(1, 20, seed=3)[0], random_ids(1, 13, seed=4)[0]])
    ids = random_ids(2, 20)
    results = {}
    for fresh in (True, False):
        monkeypatch.setattr(type(module), "scores_maskable_in_place", fresh)
        results[fresh] = padded_and_cached_outputs_and_gradients(model, padded, mask, ids, 7)
    assert len(results[True]) > 2 + len(list(module.parameters())) - 1
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


# --- TAPE's gate_input="mlp_output" (the authors' PELayer) ----------------------------------------------------------
MLP_PROJECTION = {"llama": "down_proj", "gpt2": "c_proj", "bloom": "dense_4h_to_h"}  # the MLP's last projection


def tape_reading_mlp_outputs(model_type: str, **options):
    model = hf_posenc.patch_model(tiny_model(model_type), "tape", init="random", init_std=0.3,
                                  gate_input="mlp_output", **options)
    module = hf_posenc.get_positional_module(model)
    with torch.no_grad():  # gates large enough that what they read moves the logits
        module.content_gate.normal_(0, 0.5, generator=torch.Generator().manual_seed(7))
        module.feature_down.normal_(0, 0.5, generator=torch.Generator().manual_seed(8))
    return model, module


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tape_mlp_output_gate_reads_the_previous_layers_mlp_output(model_type, monkeypatch):
    """Layer l's update reads layer l - 1's MLP output (caught here at the MLP's last projection, which is what the
    MLP returns in eval mode, but BLOOM's, which adds the residual to it); the logits differ from the default gate's.
    BLOOM's MLP runs on a zero residual for the capture, the residual added back: with the content update at zero,
    both gate inputs give the same logits bit for bit."""
    model, module = tape_reading_mlp_outputs(model_type)
    default = hf_posenc.patch_model(tiny_model(model_type), "tape", init="random", init_std=0.3)
    default.load_state_dict(model.state_dict())
    read, projected = {}, {}
    original = type(module).update_features
    monkeypatch.setattr(type(module), "update_features", lambda self, layer, x, previous, mixed: (
        read.__setitem__(layer, x), original(self, layer, x, previous, mixed))[1])
    layers = hf_posenc.registry.get_family(model.config).mlp_modules(model)
    handles = [getattr(mlp, MLP_PROJECTION[model_type]).register_forward_hook(
        lambda m, a, output, index=index: projected.__setitem__(index, output)) for index, mlp in enumerate(layers)]
    ids = random_ids(2, 12)
    with torch.no_grad():
        logits = model(ids).logits
        for handle in handles:
            handle.remove()
        assert set(read) == {1} and torch.equal(read[1], projected[0])
        assert max_diff(logits, default(ids).logits) > 1e-3
        for tape in (model, default):
            hf_posenc.get_positional_module(tape).feature_down.zero_()
        assert torch.equal(model(ids).logits, default(ids).logits)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tape_mlp_output_gate_decodes_pads_generates_and_saves_exactly(model_type, tmp_path):
    """The contract's checks for the option: a prompt then decoding equals the full forward; a left-padded batch
    (forward and generate) equals each row alone; save / from_pretrained gives identical logits and the option;
    unpatch leaves the model bit for bit as it was, no hook left."""
    original = tiny_model(model_type)
    ids = random_ids(2, 12)
    with torch.no_grad():
        original_logits = original(ids).logits
    hooks = count_hooks(original)
    model, _ = tape_reading_mlp_outputs(model_type)
    sequences = [random_ids(1, 9, seed=3)[0], random_ids(1, 5, seed=4)[0]]
    padded, mask = left_pad(sequences)
    generate = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0)
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        prefix = model(ids[:, :7], past_key_values=cache, use_cache=True).logits
        rest = decode_token_by_token(model, ids[:, 7:], cache)
        assert max_diff(full, torch.cat([prefix, rest], dim=1)) <= TOL
        generated = model.generate(padded, attention_mask=mask, **generate)
        for row, seq in enumerate(sequences):
            alone = model.generate(seq[None], attention_mask=torch.ones_like(seq[None]), **generate)
            assert torch.equal(generated.sequences[row, padded.shape[1]:], alone.sequences[0, len(seq):])
            for step_batch, step_alone in zip(generated.scores, alone.scores):
                assert max_diff(step_batch[row], step_alone[0]) <= TOL
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    assert hf_posenc.get_posenc_config(loaded).gate_input == "mlp_output"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, full)
    hf_posenc.patch_model(original, "tape", gate_input="mlp_output")
    hf_posenc.unpatch_model(original)
    assert count_hooks(original) == hooks
    with torch.no_grad():
        assert torch.equal(original(ids).logits, original_logits)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_tape_mlp_output_gate_gradients_are_the_same_under_gradient_checkpointing(use_reentrant):
    """Checkpointing recomputes each layer, MLP hooks included: every gradient equals the plain backward's, and the
    gate's weights get one (reentrant: the previous layer's MLP output crosses the checkpoint as a leaf whose
    gradient reaches the MLP, engine/content.py carried_mlp_output)."""
    ids = random_ids(2, 10)
    grads = []
    for checkpointing in (False, True):
        model, module = tape_reading_mlp_outputs("llama")
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model.train()
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
        assert module.content_gate.grad[1].abs().sum() > 0
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[0].items():
        assert max_diff(grad, grads[1][name]) <= 1e-6 * max(1.0, grad.abs().max()), name
