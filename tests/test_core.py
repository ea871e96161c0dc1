"""The correctness suite of the core issue: every method on every family, fp32 unless said."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc import PosEncError
from tiny_models import CONFIGS, FAMILIES, random_ids, tiny_model

BASIC_METHODS = ["alibi", "learned", "nope", "rope", "sinusoidal"]
RELATIVE_METHODS = ["fire", "t5", "kerple", "sandwich", "xpos"]  # issue 4
METHODS = BASIC_METHODS + RELATIVE_METHODS
MODEL_TYPES = list(CONFIGS)  # llama, mistral, qwen2, qwen3, gpt2, bloom
TOL = 1e-4


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def decode_token_by_token(model, ids, cache):
    steps = [model(ids[:, i:i + 1], past_key_values=cache, use_cache=True).logits for i in range(ids.shape[1])]
    return torch.cat(steps, dim=1)


def left_pad(sequences: list[torch.Tensor], pad_id: int = 0):
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, length - len(seq):] = seq
        mask[row, length - len(seq):] = 1
    return ids, mask


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def model_fingerprint(model):
    """Everything a patch could leave behind: modules, parameters, buffers, hooks, attention backend."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return (
        [(name, type(m).__name__) for name, m in model.named_modules()],
        {k: v.clone() for k, v in model.state_dict().items()},
        hooks,
        model.config._attn_implementation,
        model.config.to_json_string(),
    )


def assert_same_fingerprint(a, b):
    assert a[0] == b[0], "module tree changed"
    assert a[1].keys() == b[1].keys(), "state dict keys changed"
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1]), "weights changed"
    assert a[2:] == b[2:], "hooks, attention backend or config changed"


# 1. full forward == token-by-token decoding with DynamicCache and StaticCache ------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_full_forward_equals_cached_decoding(model_type, method):
    model = hf_posenc.patch_model(tiny_model(model_type), method)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        dynamic = decode_token_by_token(model, ids, DynamicCache(config=model.config))
        static = decode_token_by_token(model, ids, StaticCache(config=model.config, max_cache_len=20))
        # a prompt in one chunk, then decoding
        cache = DynamicCache(config=model.config)
        prefix = model(ids[:, :7], past_key_values=cache, use_cache=True).logits
        rest = decode_token_by_token(model, ids[:, 7:], cache)
    assert max_diff(full, dynamic) <= TOL
    assert max_diff(full, static) <= TOL
    assert max_diff(full, torch.cat([prefix, rest], dim=1)) <= TOL


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_eager_backend_is_kept_and_exact(model_type):
    model = tiny_model(model_type, attn_implementation="eager")
    hf_posenc.patch_model(model, "alibi")
    ids = random_ids(1, 10)
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        dynamic = decode_token_by_token(model, ids, DynamicCache(config=model.config))
    assert max_diff(out.logits, dynamic) <= TOL
    assert out.attentions[0].shape == (1, 4, 10, 10)  # the eager path still returns attention weights
    hf_posenc.unpatch_model(model)
    assert model.config._attn_implementation == "eager"


# 2. a left-padded batch == each sequence alone, forward and generate -------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_left_padded_batch_equals_sequences_alone(model_type, method):
    model = hf_posenc.patch_model(tiny_model(model_type), method)
    sequences = [random_ids(1, 9, seed=3)[0], random_ids(1, 5, seed=4)[0]]
    ids, mask = left_pad(sequences)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        for row, seq in enumerate(sequences):
            alone = model(seq[None]).logits[0]
            assert max_diff(batch[row, -len(seq):], alone) <= TOL

        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        for row, seq in enumerate(sequences):
            alone = model.generate(seq[None], attention_mask=torch.ones_like(seq[None]), max_new_tokens=6,
                                   do_sample=False, output_scores=True, return_dict_in_generate=True,
                                   pad_token_id=0)
            assert torch.equal(generated.sequences[row, ids.shape[1]:], alone.sequences[0, len(seq):])
            for step_batch, step_alone in zip(generated.scores, alone.scores):
                assert max_diff(step_batch[row], step_alone[0]) <= TOL


@pytest.mark.parametrize("method", ["alibi", "rope", "learned"])
def test_generate_with_static_cache_matches_dynamic(method):
    model = hf_posenc.patch_model(tiny_model("llama"), method)
    ids = random_ids(1, 6)
    kwargs = dict(max_new_tokens=8, do_sample=False, output_scores=True, return_dict_in_generate=True,
                  pad_token_id=0)
    dynamic = model.generate(ids, **kwargs)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(dynamic.sequences, static.sequences)
    assert max(max_diff(a, b) for a, b in zip(dynamic.scores, static.scores)) <= TOL


# 3. unpatch restores the original exactly ------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_unpatch_restores_bit_identical_logits(model_type, method):
    model = tiny_model(model_type)
    ids = random_ids(2, 10)
    with torch.no_grad():
        original = model(ids).logits
    before = model_fingerprint(model)
    hf_posenc.patch_model(model, method)
    other = "alibi" if method != "alibi" else "rope"
    hf_posenc.patch_model(model, other)  # replaces, does not stack
    assert isinstance(hf_posenc.get_posenc_config(model), type(hf_posenc.get_method(other).config_class()))
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    hf_posenc.patch_model(model, other)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    hf_posenc.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original)
    assert_same_fingerprint(before, model_fingerprint(model))
    assert hf_posenc.get_posenc_config(model) is None


def test_repatching_replaces_the_previous_patch():
    model = tiny_model("llama")
    ids = random_ids(1, 8)
    hf_posenc.patch_model(model, "alibi")
    with torch.no_grad():
        alibi_once = model(ids).logits
    hf_posenc.patch_model(model, "sinusoidal")
    hf_posenc.patch_model(model, "alibi")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, alibi_once)
    assert len(model.model._forward_pre_hooks) == 1


# 4. gradients reach every trainable positional parameter -----------------------------------------------------
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("method,options", [("alibi", {"trainable": True}), ("learned", {}), ("fire", {}),
                                            ("fire", {"init": "random"}), ("t5", {}), ("t5", {"per_layer": True}),
                                            ("kerple", {}), ("kerple", {"variant": "power"})])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_gradients_reach_positional_parameters(model_type, method, options, checkpointing):
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = random_ids(2, 10)
    model(ids, labels=ids).loss.backward()
    params = dict(hf_posenc.get_positional_module(model).named_parameters())
    assert params, "the method should have trainable parameters"
    for name, param in params.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    # the positional parameters are part of the model, so optimisers and state dicts see them
    assert all(any(p is q for q in model.parameters()) for p in params.values())


@pytest.mark.parametrize("method", ["nope", "rope", "sinusoidal", "alibi", "sandwich", "xpos"])
def test_parameter_free_methods_add_no_trainable_parameters(method):
    model = tiny_model("llama")
    count = sum(p.numel() for p in model.parameters())
    hf_posenc.patch_model(model, method)
    assert sum(p.numel() for p in model.parameters()) == count


# 5. low precision; GPT-2 past n_positions ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", FAMILIES)
def test_low_precision_forward_is_finite(model_type, method, dtype):
    model = tiny_model(model_type).to(dtype)
    hf_posenc.patch_model(model, method)
    ids = random_ids(2, 16)
    ids_padded, mask = left_pad([ids[0], ids[1, :9]])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
        assert torch.isfinite(model(ids_padded, attention_mask=mask).logits[mask.bool()]).all()


def test_bf16_model_keeps_float32_bias():
    model = tiny_model("llama").to(torch.bfloat16)
    hf_posenc.patch_model(model, "alibi")
    method = hf_posenc.get_positional_module(model)
    positions = torch.tensor([[1000]])
    bias = method.bias(0, positions, torch.tensor([[0, 999]]))
    assert bias.dtype == torch.float32
    assert bias[0, 0, 0, 1].item() == pytest.approx(-method.head_slopes(torch.device("cpu"))[0].item())


@pytest.mark.parametrize("method", ["alibi", "nope", "rope", "sinusoidal"] + RELATIVE_METHODS)
def test_gpt2_runs_past_n_positions_with_methods_defined_at_any_length(method):
    # FIRE's threshold defaults to n_positions (32): past it, the per-query normaliser path is exercised too.
    model = hf_posenc.patch_model(tiny_model("gpt2"), method)
    length = model.config.n_positions + 16
    ids = random_ids(1, length)
    with torch.no_grad():
        full = model(ids).logits
        cached = decode_token_by_token(model, ids, DynamicCache(config=model.config))
    assert full.shape[1] == length and torch.isfinite(full).all()
    assert max_diff(full, cached) <= TOL


def test_learned_table_refuses_positions_past_its_end():
    model = hf_posenc.patch_model(tiny_model("gpt2"), "learned")
    with pytest.raises(PosEncError, match=r"Position 32 is past the learned table \(max_positions=32\)"):
        model(random_ids(1, 33))
    hf_posenc.patch_model(model, "learned", max_positions=64)
    assert torch.isfinite(model(random_ids(1, 48)).logits).all()


# 6. ALiBi slopes and identity patches -------------------------------------------------------------------------
def test_alibi_slopes_equal_bloom_for_1_to_64_heads():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    from hf_posenc.methods.alibi import bloom_slopes

    for heads in range(1, 65):
        assert torch.equal(bloom_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu"))), heads


def test_geometric_and_explicit_slopes():
    from hf_posenc.methods.alibi import geometric_slopes

    assert torch.allclose(geometric_slopes(8), torch.tensor([2.0 ** -(k) for k in range(1, 9)]))
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", slopes=[0.5, 0.25, 0.125, 0.0625])
    assert torch.equal(hf_posenc.get_positional_module(model).head_slopes(torch.device("cpu")),
                       torch.tensor([0.5, 0.25, 0.125, 0.0625]))


@pytest.mark.parametrize("model_type,method,exact", [
    ("llama", "rope", True), ("mistral", "rope", True), ("qwen2", "rope", True), ("qwen3", "rope", True),
    ("gpt2", "learned", True),
    # BLOOM's own ALiBi adds slope * j; ours adds -slope * (i - j). They differ by a constant per query row,
    # which softmax removes, so the logits agree to float rounding rather than bit for bit.
    ("bloom", "alibi", False),
])
def test_native_method_is_an_identity(model_type, method, exact):
    model = tiny_model(model_type)
    ids = random_ids(2, 12)
    ids_padded, mask = left_pad([ids[0], ids[1, :7]])
    with torch.no_grad():
        original = model(ids).logits
        original_padded = model(ids_padded, attention_mask=mask).logits
        hf_posenc.patch_model(model, method)
        patched = model(ids).logits
        patched_padded = model(ids_padded, attention_mask=mask).logits
    if exact:
        assert torch.equal(original, patched)
    else:
        assert max_diff(original, patched) <= 1e-5
    assert max_diff(original_padded[mask.bool()], patched_padded[mask.bool()]) <= 1e-5


def test_rope_theta_option_changes_llama_and_gpt2():
    llama = tiny_model("llama")
    ids = random_ids(1, 20)
    with torch.no_grad():
        native = llama(ids).logits
        hf_posenc.patch_model(llama, "rope", theta=500.0)
        assert max_diff(llama(ids).logits, native) > 1e-3
        hf_posenc.patch_model(llama, "rope", theta=10000.0)  # the model's own theta: the identity again
        assert torch.equal(llama(ids).logits, native)
    gpt2 = hf_posenc.patch_model(tiny_model("gpt2"), "rope")
    assert hf_posenc.get_positional_module(gpt2).theta == 10000.0


# registries ---------------------------------------------------------------------------------------------------
def test_available_methods_is_sorted_and_complete():
    names = hf_posenc.available_methods()
    assert names == sorted(names)
    assert set(METHODS) <= set(names)


def test_get_posenc_config_returns_the_config():
    model = hf_posenc.patch_model(tiny_model("llama"), hf_posenc.AlibiConfig(slopes="geometric"))
    config = hf_posenc.get_posenc_config(model)
    assert config == hf_posenc.AlibiConfig(slopes="geometric")
    assert config.to_dict() == {"method": "alibi", "slopes": "geometric", "trainable": False}


def test_third_party_method_via_decorator():
    from dataclasses import dataclass

    from hf_posenc.registry import _METHODS

    @dataclass
    class WindowConfig(hf_posenc.PosEncConfig):
        window: int = 3

    @hf_posenc.register_method("test-window", WindowConfig)
    class Window(hf_posenc.AttentionBiasMethod):
        def bias(self, layer_idx, query_positions, key_positions):
            far = (query_positions[:, None, :, None] - key_positions[:, None, None, :]) >= self.config.window
            return torch.where(far, -1e4, 0.0).expand(-1, self.num_heads, -1, -1)

    try:
        assert "test-window" in hf_posenc.available_methods()
        model = hf_posenc.patch_model(tiny_model("gpt2"), "test-window", window=2)
        ids = random_ids(1, 10)
        with torch.no_grad():
            full = model(ids).logits
            cached = decode_token_by_token(model, ids, DynamicCache(config=model.config))
        assert max_diff(full, cached) <= TOL
        # a window of 1 lets each token see only itself, so its logits ignore all earlier tokens
        hf_posenc.patch_model(model, "test-window", window=1)
        with torch.no_grad():
            a = model(torch.tensor([[5, 6, 7]])).logits[0, -1]
            b = model(torch.tensor([[9, 3, 7]])).logits[0, -1]
        assert max_diff(a, b) <= 1e-5
    finally:
        del _METHODS["test-window"]


def test_families_dispatch_on_model_type_not_class():
    from hf_posenc.registry import get_family

    model = tiny_model("qwen3")
    assert get_family(model.config).name == "llama"
    model.config.model_type = "something-else"
    with pytest.raises(PosEncError, match="model_type 'something-else' is not supported"):
        hf_posenc.patch_model(model, "alibi")


# bad input ----------------------------------------------------------------------------------------------------
def test_unknown_method_names_the_available_ones():
    with pytest.raises(ValueError, match=r"Unknown positional method 'alibbi'\. Available methods: alibi, "):
        hf_posenc.patch_model(tiny_model("llama"), "alibbi")


def test_unsupported_model_names_the_families():
    from transformers import AutoModelForCausalLM, OPTConfig

    model = AutoModelForCausalLM.from_config(OPTConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                       ffn_dim=32, num_attention_heads=2))
    with pytest.raises(PosEncError, match=r"model_type 'opt' is not supported.*llama: llama, mistral, qwen2, qwen3"):
        hf_posenc.patch_model(model, "alibi")


def test_encoder_decoder_and_non_causal_models_are_refused():
    from transformers import AutoModel, BertConfig, T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(PosEncError, match="encoder-decoder"):
        hf_posenc.patch_model(t5, "alibi")
    bert = AutoModel.from_config(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=32))
    with pytest.raises(PosEncError, match="decoder-only causal"):
        hf_posenc.patch_model(bert, "alibi")


@pytest.mark.parametrize("method,options,message", [
    ("alibi", {"slope": "bloom"}, r"Unknown option\(s\) 'slope' for method 'alibi'; its options are: slopes, trainable"),
    ("alibi", {"slopes": "cubic"}, r"slopes='cubic'"),
    ("alibi", {"slopes": [0.5, 0.25]}, r"has 2 values but the model has 4 attention heads"),
    ("alibi", {"trainable": "yes"}, r"trainable='yes'"),
    ("rope", {"theta": -1}, r"theta=-1"),
    ("learned", {"max_positions": 0}, r"max_positions=0"),
    ("learned", {"init": "native"}, r"needs a model with its own position table"),
    ("sinusoidal", {"scale": float("nan")}, r"scale=nan"),
    ("nope", {"anything": 1}, r"Unknown option\(s\) 'anything' for method 'nope'"),
])
def test_bad_options_are_named_and_leave_the_model_untouched(method, options, message):
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(PosEncError, match=message):
        hf_posenc.patch_model(model, method, **options)
    assert_same_fingerprint(before, model_fingerprint(model))


def test_config_object_plus_options_is_refused():
    with pytest.raises(PosEncError, match="put them in the config"):
        hf_posenc.patch_model(tiny_model("llama"), hf_posenc.AlibiConfig(), trainable=True)


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("previous", [None, "sinusoidal"])
def test_a_patch_failing_half_way_leaves_the_model_as_it_was(model_type, previous, monkeypatch):
    model = tiny_model(model_type)
    ids = random_ids(1, 8)
    if previous:
        hf_posenc.patch_model(model, previous)
    with torch.no_grad():
        logits_before = model(ids).logits
    before = model_fingerprint(model)
    family = type(hf_posenc.registry.get_family(model.config))
    original_remove = family.remove_native

    failures = []

    def remove_then_fail(self, *args):
        original_remove(self, *args)  # the model is now half patched
        if not failures:  # fail once: putting the previous patch back must still work
            failures.append(1)
            raise RuntimeError("forced failure")

    monkeypatch.setattr(family, "remove_native", remove_then_fail)
    with pytest.raises(RuntimeError, match="forced failure"):
        hf_posenc.patch_model(model, "alibi")
    monkeypatch.undo()
    assert_same_fingerprint(before, model_fingerprint(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits_before)
    assert type(hf_posenc.get_posenc_config(model)).__name__ == ("SinusoidalConfig" if previous else "NoneType")


# torch.compile (slow: compiles for tens of seconds; still run in CI) ----------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("model_type,method", [("llama", "alibi"), ("gpt2", "rope"), ("bloom", "sinusoidal")])
def test_torch_compile(model_type, method):
    model = hf_posenc.patch_model(tiny_model(model_type), method)
    ids = random_ids(2, 12)
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model)
        assert max_diff(compiled(ids).logits, eager) <= TOL


@pytest.mark.parametrize("model_type", FAMILIES)
def test_a_deep_copy_carries_its_own_patch(model_type):
    import copy

    model = hf_posenc.patch_model(tiny_model(model_type), "learned", init="normal", init_std=0.5)
    ids = random_ids(1, 9)
    with torch.no_grad():
        patched = model(ids).logits
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, patched)
        hf_posenc.unpatch_model(twin)  # undoes the copy, not the original
        assert torch.equal(model(ids).logits, patched)
        assert hf_posenc.get_posenc_config(model) is not None
        assert max_diff(twin(ids).logits, patched) > 1e-4


# the method protocol ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,message", [
    ("def alibi_slope(self, device):\n        return None", r"Misspelt\.alibi_slope is not a capability hf_posenc "
                                                            r"reads; did you mean 'alibi_slopes'\?"),
    ("def bias_tabel(self, layer_idx, n, max_position=None, device=None):\n        return None",
     r"did you mean 'bias_table'\?"),
    ("block_costs = 2.0", r"did you mean 'block_cost'\?"),
    ("rotates_in_attention = True", r"Misspelt\.rotates_in_attention is a capability of RotaryMethod methods, and "
                                    r"Misspelt derives from AttentionBiasMethod"),
])
def test_a_misspelt_or_misplaced_capability_is_refused(body, message):
    namespace = {"hf_posenc": hf_posenc}
    source = f"class Misspelt(hf_posenc.AttentionBiasMethod):\n    {body}\n"
    with pytest.raises(PosEncError, match=message):
        exec(source, namespace)
    assert "Misspelt" not in namespace


def test_a_method_of_two_kinds_and_a_config_that_is_not_a_posenc_config_are_refused():
    with pytest.raises(PosEncError, match="derives from AttentionBiasMethod and RotaryMethod; a method acts in one"):
        class Both(hf_posenc.AttentionBiasMethod, hf_posenc.RotaryMethod):
            pass
    with pytest.raises(PosEncError, match="the config class must be a dataclass subclassing hf_posenc.PosEncConfig"):
        hf_posenc.register_method("not-a-config", dict, hf_posenc.methods.Alibi)
    assert "not-a-config" not in hf_posenc.available_methods()


def test_the_engine_reads_what_the_protocol_declares():
    """Every capability the built-in methods override is declared on their protocol class, and the ALiBi slopes
    reach flash-attn only when fixed (the capability replaces a read of config.trainable)."""
    from hf_posenc.methods.base import capabilities, kind_of

    for name in hf_posenc.available_methods():
        cls = hf_posenc.get_method(name).module_class
        assert {"builds_on", "is_native", "native_config_update", "block_cost"} <= capabilities(kind_of(cls))
    fixed = hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "alibi"))
    trained = hf_posenc.get_positional_module(hf_posenc.patch_model(tiny_model("llama"), "alibi", trainable=True))
    assert torch.equal(fixed.alibi_slopes(torch.device("cpu")), fixed.head_slopes(torch.device("cpu")))
    assert trained.alibi_slopes(torch.device("cpu")) is None
    assert torch.equal(trained.bias_table(0, 5), -trained.head_slopes(None)[:, None] * torch.arange(5.0))
