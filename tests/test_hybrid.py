"""Hybrid patches (engine/hybrid.py): a method on some layers only. The core contract (test_contract.py) for a few
hybrids on every tiny model type, the hybrid checked against an independent computation (each layer taken from a
model patched, or not, as a whole), and the refusals."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from transformers import DynamicCache, StaticCache

import hf_posenc
from hf_posenc.tools.finetune import enable_gradient_checkpointing
from helpers import (MODEL_TYPES, TOL, assert_same_fingerprint, count_hooks, decode_token_by_token, left_pad,
                     load_without_hf_posenc, max_diff, model_fingerprint, perturb_positional_state,
                     positions_from_mask)
from tiny_models import random_ids, tiny_model

# name -> parts, each (method, options, layers), patched in order (a second part is a second patch_model call)
HYBRIDS = {
    "nope@1": [("nope", {}, [1])],
    "alibi@1": [("alibi", {"trainable": True}, [1])],
    "fire@0+rope@1": [("fire", {}, [0]), ("rope", {}, [1])],
    "xpos@1": [("xpos", {}, [1])],
}
# GPT-2's positions are its input embedding, which a hybrid keeps: NoPE on some of its layers is refused (below)
CASES = [(name, model_type) for name in HYBRIDS for model_type in MODEL_TYPES
         if not (name == "nope@1" and model_type == "gpt2")]


def patch_hybrid(model, name: str):
    for method, options, layers in HYBRIDS[name]:
        hf_posenc.patch_model(model, method, layers=layers, **options)
    return model


def layer_list(model):
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h


# --- the hybrid against an independent computation -------------------------------------------------------------------
def assembled_logits(model_type: str, layer_methods: list[tuple[str, dict] | None], ids) -> torch.Tensor:
    """Logits of a 2-layer model whose layer i runs layer_methods[i] ((method, options), or None: native), computed
    without hybrids: layer 0's output is taken from a copy patched (or not) as a whole with layer 0's method, and fed
    to layer 1 of a copy patched as a whole with layer 1's method (its head computes the logits)."""
    def whole(entry):
        model = tiny_model(model_type)
        if entry is not None:
            hf_posenc.patch_model(model, entry[0], **entry[1])
        return model

    first, second = whole(layer_methods[0]), whole(layer_methods[1])
    captured = {}
    handle = layer_list(first)[0].register_forward_hook(lambda m, a, out: captured.update(out=out))
    with torch.no_grad():
        first(ids)
    handle.remove()
    layer_list(second)[0].register_forward_hook(lambda m, a, out: captured["out"])
    with torch.no_grad():
        return second(ids).logits


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@pytest.mark.parametrize("method,options", [("nope", {}), ("alibi", {}), ("fire", {}), ("kerple", {}),
                                            ("rope", {}), ("xpos", {})])
def test_layer_1_patched_equals_layer_0_native_and_layer_1_patched_by_hand(method, options, model_type):
    if (method, model_type) == ("nope", "gpt2"):
        with pytest.raises(hf_posenc.PosEncError, match="would change nothing"):
            hf_posenc.patch_model(tiny_model(model_type), method, layers=[1])
        return
    ids = random_ids(2, 11)
    model = hf_posenc.patch_model(tiny_model(model_type), method, layers=[1], **options)
    with torch.no_grad():
        hybrid = model(ids).logits
    expected = assembled_logits(model_type, [None, (method, options)], ids)
    assert max_diff(hybrid, expected) <= 1e-6
    with torch.no_grad():  # and it is not the native model (where the method differs from native)
        native = tiny_model(model_type)(ids).logits
    if not hf_posenc.registry.get_family(model.config).native_method == method:
        assert max_diff(hybrid, native) > 1e-6  # tiny random BLOOM: about 1e-5


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "bloom"])
def test_two_parts_equal_each_layer_patched_by_hand(model_type):
    """Two methods, one per layer (where a whole-model patch removes the native mechanism layer by layer, so each
    layer of the reference is exactly that layer of a whole-model patch)."""
    ids = random_ids(2, 11)
    model = patch_hybrid(tiny_model(model_type), "fire@0+rope@1")
    with torch.no_grad():
        hybrid = model(ids).logits
    assert max_diff(hybrid, assembled_logits(model_type, [("fire", {}), ("rope", {})], ids)) <= 1e-5


# --- the core contract, for hybrids ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,model_type", CASES)
def test_full_forward_equals_cached_decoding(name, model_type):
    model = patch_hybrid(tiny_model(model_type), name)
    ids = random_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        dynamic = decode_token_by_token(model, ids, DynamicCache(config=model.config))
        static = decode_token_by_token(model, ids, StaticCache(config=model.config, max_cache_len=20))
        cache = DynamicCache(config=model.config)
        prefix = model(ids[:, :7], past_key_values=cache, use_cache=True).logits
        rest = decode_token_by_token(model, ids[:, 7:], cache)
    assert max_diff(full, dynamic) <= TOL
    assert max_diff(full, static) <= TOL
    assert max_diff(full, torch.cat([prefix, rest], dim=1)) <= TOL


@pytest.mark.parametrize("name,model_type", CASES)
def test_left_padded_batch_equals_sequences_alone(name, model_type):
    model = patch_hybrid(tiny_model(model_type), name)
    sequences = [random_ids(1, 9, seed=3)[0], random_ids(1, 5, seed=4)[0]]
    ids, mask = left_pad(sequences)
    generate = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
                    pad_token_id=0)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits
        generated = model.generate(ids, attention_mask=mask, **generate)
        for row, seq in enumerate(sequences):
            assert max_diff(batch[row, -len(seq):], model(seq[None]).logits[0]) <= TOL
            alone = model.generate(seq[None], attention_mask=torch.ones_like(seq[None]), **generate)
            assert torch.equal(generated.sequences[row, ids.shape[1]:], alone.sequences[0, len(seq):])
            for step_batch, step_alone in zip(generated.scores, alone.scores):
                assert max_diff(step_batch[row], step_alone[0]) <= TOL


@pytest.mark.parametrize("name,model_type", CASES)
def test_unpatch_restores_bit_identical_logits(name, model_type):
    model = tiny_model(model_type)
    ids = random_ids(2, 10)
    with torch.no_grad():
        original = model(ids).logits
    before = model_fingerprint(model)
    patch_hybrid(model, name)
    hf_posenc.patch_model(model, "alibi")  # a whole-model patch replaces the hybrid
    assert isinstance(hf_posenc.get_posenc_config(model), hf_posenc.AlibiConfig)
    patch_hybrid(model, name)
    hooks = count_hooks(model)
    hf_posenc.unpatch_model(model)
    patch_hybrid(model, name)
    assert count_hooks(model) == hooks
    hf_posenc.unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original)
    assert_same_fingerprint(before, model_fingerprint(model))
    assert hf_posenc.get_posenc_config(model) is None


@pytest.mark.parametrize("name,model_type", CASES)
def test_gradients_reach_the_model_and_the_parts_parameters(name, model_type):
    ids = random_ids(2, 10)
    for checkpointing in (False, True):
        model = patch_hybrid(tiny_model(model_type), name)
        if checkpointing:
            enable_gradient_checkpointing(model)
        model.train()
        model(ids, labels=ids).loss.backward()
        projections = dict(model.named_modules())
        for module_name in hf_posenc.registry.get_family(model.config).lora_target_modules(model):
            grad = projections[module_name].weight.grad
            assert grad is not None and grad.abs().sum() > 0, (checkpointing, module_name)
        for param_name, param in hf_posenc.get_positional_module(model).named_parameters():
            assert "parts." in param_name
            if param.requires_grad:
                assert param.grad is not None and param.grad.abs().sum() > 0, (checkpointing, param_name)


@pytest.fixture(scope="module")
def hybrid_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-checkpoints")
    ids = random_ids(2, 9)
    saved = {}
    for name, model_type in CASES:
        model = patch_hybrid(tiny_model(model_type), name)
        perturb_positional_state(model)
        with torch.no_grad():
            logits = model(ids).logits
        directory = root / f"{model_type}-{name.replace('@', '_').replace('+', '_')}"
        model.save_pretrained(directory, standalone=True)
        torch.save({"ids": ids, "logits": logits}, directory / "reference.pt")
        saved[name, model_type] = (directory, ids, logits, hf_posenc.get_posenc_config(model))
    return saved


@pytest.mark.parametrize("name,model_type", CASES)
def test_save_and_from_pretrained_give_identical_logits(hybrid_checkpoints, name, model_type):
    directory, ids, logits, config = hybrid_checkpoints[name, model_type]
    metadata = json.loads((directory / "posenc_config.json").read_text())
    assert metadata["method"] == "hybrid"
    expected = ["native", "native"]
    for method, _, layers in HYBRIDS[name]:
        for index in layers:
            expected[index] = method
    assert metadata["layer_methods"] == expected  # the checkpoint records which layer has what
    model = hf_posenc.from_pretrained(directory)
    assert hf_posenc.get_posenc_config(model) == config
    with torch.no_grad():
        assert torch.equal(model(ids).logits, logits)


def test_standalone_checkpoints_load_without_hf_posenc(hybrid_checkpoints, tmp_path):
    directories = [entry[0] for entry in hybrid_checkpoints.values()]
    results = load_without_hf_posenc(directories, tmp_path)
    for directory in directories:
        module, diff = results[str(directory)]
        assert module.startswith("transformers_modules."), module
        assert diff <= 1e-6, directory


# --- layers, stacking and refusals ----------------------------------------------------------------------------------
def test_layer_patterns():
    from hf_posenc.engine.hybrid import parse_layers

    assert parse_layers("every:4", 12) == [3, 7, 11]
    assert parse_layers("first:2", 5) == [0, 1]
    assert parse_layers("last:2", 5) == [3, 4]
    assert parse_layers(range(1, 3), 5) == [1, 2]
    assert parse_layers(2, 5) == [2]
    for bad in ("every:0", "each:2", [], [5], [1, 1], [0.5], True, "every:9"):
        with pytest.raises(hf_posenc.PosEncError, match="layers=.*pass a list of layer indices"):
            parse_layers(bad, 5 if bad != "every:9" else 4)


@pytest.mark.parametrize("method", ["learned", "sinusoidal"])
def test_absolute_methods_are_refused_per_layer(method):
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(hf_posenc.PosEncError, match="input of the first layer.*no layers="):
        hf_posenc.patch_model(model, method, layers=[1])
    assert_same_fingerprint(before, model_fingerprint(model))


@pytest.mark.parametrize("method", ["fox", "stick-breaking", "cope", "transformer-xl", "cape", "drope"])
def test_content_methods_are_refused_per_layer(method):
    """Their per-token state is installed for the whole model; a hybrid of them used to compute NoPE on its layers."""
    model = tiny_model("llama")
    before = model_fingerprint(model)
    with pytest.raises(hf_posenc.PosEncError, match="content-dependent.*no layers="):
        hf_posenc.patch_model(model, method, layers=[1])
    assert_same_fingerprint(before, model_fingerprint(model))


def test_other_refusals_leave_the_model_as_it_was():
    model = hf_posenc.patch_model(tiny_model("gpt2"), "alibi", layers=[0])
    before = model_fingerprint(model)
    with pytest.raises(hf_posenc.PosEncError, match="Layers \\[0\\] of this hybrid already run"):
        hf_posenc.patch_model(model, "nope", layers=[0, 1])
    with pytest.raises(hf_posenc.PosEncError, match="builds on|no rotary embedding"):
        hf_posenc.patch_model(model, "yarn", layers=[1], factor=2.0)
    with pytest.raises(hf_posenc.PosEncError, match="layers=7 .*this model has 2 layers"):
        hf_posenc.patch_model(model, "nope", layers=7)
    assert_same_fingerprint(before, model_fingerprint(model))
    with pytest.raises(hf_posenc.PosEncError, match="exact_cache"):
        hf_posenc.patch_model(tiny_model("llama"), "dynamic", layers=[1], factor=2.0, exact_cache=True)
    with pytest.raises(hf_posenc.PosEncError, match="Layer 1 is given both"):
        hf_posenc.HybridConfig(parts=[{"method": "nope", "layers": [1]}, {"method": "alibi", "layers": [1]}])


def test_a_second_part_keeps_the_trained_weights_of_the_first():
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", layers=[0], trainable=True)
    perturb_positional_state(model)
    trained = copy.deepcopy(hf_posenc.get_positional_module(model).parts[0].state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is discarded, so no warning
        hf_posenc.patch_model(model, "fire", layers=[1])
    hybrid = hf_posenc.get_positional_module(model)
    assert [part["method"] for part in hf_posenc.get_posenc_config(model).parts] == ["alibi", "fire"]
    assert all(torch.equal(hybrid.parts[0].state_dict()[k], v) for k, v in trained.items())
    assert hf_posenc.get_posenc_config(model).layer_methods(2) == ["alibi", "fire"]
    assert "hybrid" not in hf_posenc.available_methods()


def test_the_command_line_takes_layers_as_a_method_option():
    from hf_posenc.tools.runtime import MethodRequest

    request = MethodRequest.parse('nope:layers="every:2"')
    request.check()
    assert request.settings() == {"method": "nope", "layers": "every:2"}
    model = tiny_model("llama")
    request.apply(model)
    assert hf_posenc.get_posenc_config(model).layer_methods(2) == ["native", "nope"]
    with pytest.raises(hf_posenc.PosEncError, match="input of the first layer"):
        MethodRequest.parse("learned:layers=[1]").check()


def test_rest_names_the_layers_no_part_runs_yet():
    ids = random_ids(2, 11)
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", layers=[0], trainable=True)
    hf_posenc.patch_model(model, "fire", layers="rest")
    assert hf_posenc.get_posenc_config(model).layer_methods(2) == ["alibi", "fire"]
    explicit = hf_posenc.patch_model(tiny_model("llama"), "alibi", layers=[0], trainable=True)
    hf_posenc.patch_model(explicit, "fire", layers=[1])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, explicit(ids).logits)
    before = model_fingerprint(model)
    with pytest.raises(hf_posenc.PosEncError, match="'rest' names no layer: every layer"):
        hf_posenc.patch_model(model, "nope", layers="rest")
    assert_same_fingerprint(before, model_fingerprint(model))
    plain = tiny_model("llama")
    before = model_fingerprint(plain)
    with pytest.raises(hf_posenc.PosEncError, match="this model is not a hybrid: patch the first part"):
        hf_posenc.patch_model(plain, "nope", layers="rest")
    assert_same_fingerprint(before, model_fingerprint(plain))


def test_the_command_line_joins_the_parts_of_a_hybrid_with_plus():
    from hf_posenc.tools.runtime import MethodRequest, UsageError

    request = MethodRequest.parse("kerple:layers=every:2+yarn:factor=2,layers=rest")
    request.check()
    assert [part.name for part in request.parts] == ["kerple", "yarn"]
    assert request.settings()["parts"][1]["factor"] == 2 and request.settings()["parts"][1]["layers"] == "rest"
    model = tiny_model("llama")
    request.apply(model)
    assert hf_posenc.get_posenc_config(model).layer_methods(2) == ["yarn", "kerple"]
    request.remove(model)
    assert hf_posenc.get_posenc_config(model) is None
    with pytest.raises(UsageError, match="each part of a hybrid joined by '\\+' is a method with layers="):
        MethodRequest.parse("kerple:layers=[1]+yarn:factor=2")
    with pytest.raises(hf_posenc.PosEncError, match="input of the first layer"):
        MethodRequest.parse("kerple:layers=[1]+learned:layers=rest").check()
    model = tiny_model("llama")  # a part that fails on this model takes the earlier parts away with it
    before = model_fingerprint(model)
    with pytest.raises(hf_posenc.PosEncError, match="layers=7"):
        MethodRequest.parse("kerple:layers=[1]+nope:layers=7").apply(model)
    assert_same_fingerprint(before, model_fingerprint(model))
    assert hf_posenc.get_posenc_config(model) is None


# --- hybrids under torch.compile and on the flex path ---------------------------------------------------------------
@pytest.mark.parametrize("name,model_type", [("alibi@1", "llama"), ("fire@0+rope@1", "llama"), ("alibi@1", "gpt2")])
def test_a_compiled_hybrid_is_one_graph_with_the_eager_numbers(name, model_type):
    import torch._dynamo

    model = patch_hybrid(tiny_model(model_type), name)
    ids = random_ids(2, 8)
    with torch.no_grad():
        expected = model(ids).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        first, second = compiled(ids).logits, compiled(ids).logits
    assert max_diff(first, expected) < 1e-4 and max_diff(second, expected) < 1e-4


def test_the_flex_path_serves_only_the_patched_layers_of_a_hybrid(monkeypatch):
    """Layer 1 runs T5's table through the flex dispatch (a right stand-in kernel, as compiled flex is checked per
    machine); layer 0 stays native: one flex call per forward, and the numbers of the blocked path."""
    from hf_posenc import attention
    from hf_posenc.engine.attention import bias_path
    from hf_posenc.engine.kernels.check import table_attention_reference

    model = hf_posenc.patch_model(tiny_model("llama"), "t5", layers=[1])
    ids = random_ids(2, 20)
    calls = []

    def stand_in(*args, **kwargs):
        calls.append(1)
        return table_attention_reference(*args, **kwargs)

    attention.reset_kernel_status()
    try:
        with torch.no_grad(), attention.attention_path("blocked"):
            blocked = model(ids).logits
        monkeypatch.setattr(bias_path, "_flex_kernel", stand_in)
        attention.last_paths.clear()
        with torch.no_grad(), attention.attention_path("flex"):
            flex = model(ids).logits
        assert attention.last_paths == {"flex": 1} and calls  # layer 1 only
        assert all(verdict.passed for verdict in attention.kernel_status())
    finally:
        attention.reset_kernel_status()
    assert max_diff(flex, blocked) <= 1e-5
    with torch.no_grad():
        assert max_diff(blocked, assembled_logits("llama", [None, ("t5", {})], ids)) <= 1e-5


# --- a hybrid whose parts run every layer ---------------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "bloom"])
@pytest.mark.parametrize("method", ["alibi", "nope", "rope"])
def test_a_hybrid_over_every_layer_is_the_full_patch(model_type, method):
    """No layer is native, so nothing reads GPT-2's wpe: it goes as with the full patch (issue 51: alibi on layers
    [0, 1] of the 2-layer GPT-2 kept wpe and was 0.81 off the full patch; nope there was refused)."""
    ids = random_ids(2, 11)
    model = tiny_model(model_type)
    before = model_fingerprint(model)
    with torch.no_grad():
        native = model(ids).logits
    hf_posenc.patch_model(model, method, layers=[0, 1])
    full = hf_posenc.patch_model(tiny_model(model_type), method)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, full(ids).logits)
    hf_posenc.unpatch_model(model)
    assert_same_fingerprint(before, model_fingerprint(model))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, native)


def test_gpt2_parts_that_come_to_run_every_layer_drop_wpe_and_save_so(tmp_path):
    """The second part (layers="rest") completes the cover: the hybrid computes each layer as the model patched as a
    whole with that layer's method does, and saves and reloads so (wpe saved as it was, for the original
    architecture)."""
    ids = random_ids(2, 11)
    model = hf_posenc.patch_model(tiny_model("gpt2"), "alibi", layers=[0])
    assert isinstance(model.transformer.wpe, torch.nn.Embedding)  # layer 1 is native: it reads wpe
    hf_posenc.patch_model(model, "nope", layers="rest")
    assert not isinstance(model.transformer.wpe, torch.nn.Embedding)
    with torch.no_grad():
        hybrid = model(ids).logits
    assert max_diff(hybrid, assembled_logits("gpt2", [("alibi", {}), ("nope", {})], ids)) <= 1e-6
    model.save_pretrained(tmp_path / "saved")
    loaded = hf_posenc.from_pretrained(tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hybrid)
    assert torch.equal(hf_posenc.unpatch_model(loaded).transformer.wpe.weight, tiny_model("gpt2").transformer.wpe.weight)
