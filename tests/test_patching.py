"""The public entry points and registries: patching keeps the attention backend, replaces a previous patch rather
than stacking, fails atomically and refuses bad input naming the problem; methods and families are registered and
dispatched on model_type; patched models copy and compile. (The contract every method keeps on every model type is
test_contract.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_posenc
from hf_posenc import PosEncError
from helpers import TOL, assert_same_fingerprint, decode_token_by_token, max_diff, model_fingerprint
from tiny_models import FAMILIES, random_ids, tiny_model

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


# registries ---------------------------------------------------------------------------------------------------
def test_available_methods_is_sorted_and_complete():
    names = hf_posenc.available_methods()
    assert names == sorted(names)
    assert set(names) >= {"nope", "alibi", "fire", "t5", "kerple", "sandwich", "sinusoidal", "learned", "rope", "xpos",
                          "linear", "ntk", "dynamic", "yarn", "dynamic-yarn", "llama3", "longrope"}


def test_every_method_config_is_exported_by_the_package():
    for name in hf_posenc.available_methods():
        config_class = hf_posenc.get_method(name).config_class
        assert getattr(hf_posenc, config_class.__name__) is config_class and config_class.__name__ in hf_posenc.__all__


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


def test_replacing_a_patch_with_trained_positional_weights_warns(tmp_path):
    """patch_model on a model whose positional weights were trained (or loaded) says that they are discarded;
    replacing an untouched patch, or unpatching first, is silent (issue 19, item 1)."""
    import warnings

    from helpers import perturb_positional_state

    model = hf_posenc.patch_model(tiny_model("llama"), "kerple")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_posenc.patch_model(model, "kerple", variant="power")  # initial values only: nothing is lost
    perturb_positional_state(model)  # as training would
    with pytest.warns(UserWarning, match="'kerple' patch with 'yarn': its trained positional weights"):
        hf_posenc.patch_model(model, "yarn", factor=4.0)
    model = hf_posenc.patch_model(tiny_model("llama"), "kerple")
    perturb_positional_state(model)
    model.save_pretrained(tmp_path)
    loaded = hf_posenc.from_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="discarded"):
        hf_posenc.patch_model(loaded, "alibi")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf_posenc.patch_model(hf_posenc.unpatch_model(loaded), "alibi")


# --- a patched model cast (or moved) before unpatch or save (issue 51, point 5) -------------------------------------
def tensors(model) -> dict:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


@pytest.mark.parametrize("model_type, method, options", [
    ("gpt2", "alibi", {}),  # wpe taken out
    ("gpt2", "learned", {}),  # wpe's place taken by the method
    ("llama", "alibi", {}),  # rotary_emb (inv_freq) taken out
    ("llama", "yarn", {"factor": 2.0}),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_unpatch_after_a_cast_gives_the_never_patched_model_cast_the_same_way(model_type, method, options, dtype):
    """The modules a patch took out of the model follow the cast: unpatched GPT-2 crashed ('mixed dtype') with a
    float32 wpe among bf16 weights, unpatched LLaMA kept a float32 inv_freq and was 2e-3 off."""
    ids = random_ids(2, 9)
    never_patched = tiny_model(model_type).to(dtype)
    model = hf_posenc.patch_model(tiny_model(model_type), method, **options).to(dtype)
    hf_posenc.unpatch_model(model)
    expected, restored = tensors(never_patched), tensors(model)
    assert restored.keys() == expected.keys()
    for name, tensor in expected.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    assert not any("_apply" in module.__dict__ for module in model.modules())  # the patch's conversion hook is gone
    with torch.no_grad():
        assert torch.equal(model(ids).logits, never_patched(ids).logits)


def test_unpatch_after_a_move_puts_the_taken_out_modules_on_the_new_device():
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi").to("meta")
    hf_posenc.unpatch_model(model)
    assert {tensor.device.type for tensor in tensors(model).values()} == {"meta"}


@pytest.mark.parametrize("model_type, method", [("gpt2", "alibi"), ("gpt2", "rope"), ("llama", "kerple")])
def test_a_patched_model_saved_after_a_cast_has_one_dtype(tmp_path, model_type, method):
    """save_pretrained writes the original architecture: GPT-2's wpe, out of the module tree while patched, was saved
    as float32 beside bf16 weights."""
    from safetensors import safe_open

    model = hf_posenc.patch_model(tiny_model(model_type), method).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "saved")
    with safe_open(tmp_path / "saved" / "model.safetensors", framework="pt") as handle:
        assert {key: handle.get_tensor(key).dtype for key in handle.keys()} == dict.fromkeys(handle.keys(),
                                                                                              torch.bfloat16)
    ids = random_ids(2, 9)
    with torch.no_grad():
        assert torch.equal(hf_posenc.from_pretrained(tmp_path / "saved", dtype=torch.bfloat16)(ids).logits,
                           model(ids).logits)
