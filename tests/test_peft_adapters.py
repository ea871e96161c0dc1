"""PEFT adapters of a patched model carry the patch and its trained positional weights (checkpoints/adapters.py)."""

import json

import pytest
import torch
from helpers import (assert_same_fingerprint, count_hooks, max_diff, model_fingerprint, patch_for_contract,
                     perturb_positional_state)
from tiny_models import random_ids, tiny_model

import hf_posenc

peft = pytest.importorskip("peft")


def trained_adapter(tmp_path):
    """A tiny LLaMA patched with KERPLE, LoRA r=4 on q/v, its LoRA and KERPLE weights moved off their initial
    values (as training would), saved with hf_posenc.save_adapter."""
    model = hf_posenc.patch_model(tiny_model("llama"), "kerple")
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                            init_lora_weights=False))
    perturb_positional_state(model)
    ids = random_ids(2, 9)
    with torch.no_grad():
        logits = peft_model(ids).logits
    hf_posenc.save_adapter(peft_model, tmp_path / "adapter")
    return tmp_path / "adapter", ids, logits, hf_posenc.get_positional_module(model).state_dict()


def test_save_adapter_writes_the_patch_and_positional_weights(tmp_path):
    from safetensors import safe_open

    directory, _, _, positional = trained_adapter(tmp_path)
    metadata = json.loads((directory / "posenc_config.json").read_text())
    assert metadata["method"] == "kerple" and metadata["adapter"] is True
    with safe_open(directory / "adapter_model.safetensors", framework="pt") as handle:
        for name, value in positional.items():
            assert torch.equal(handle.get_tensor(f"base_model.model.model.posenc.{name}"), value)
        assert any("lora_A" in key for key in handle.keys())


def test_hf_posenc_from_pretrained_restores_base_patch_and_adapter(tmp_path):
    directory, ids, logits, _ = trained_adapter(tmp_path)
    base = tiny_model("llama")  # unpatched: the patch comes from the adapter folder
    loaded = hf_posenc.load_adapter(directory, base_model=base)
    assert isinstance(loaded, peft.PeftModel)
    assert hf_posenc.get_posenc_config(loaded.get_base_model()).method == "kerple"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_from_pretrained_on_an_adapter_folder_loads_the_recorded_base(tmp_path):
    base_dir = tmp_path / "base"
    tiny_model("llama").save_pretrained(base_dir)
    model = hf_posenc.patch_model(hf_posenc.from_pretrained(base_dir), "kerple")
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    perturb_positional_state(model)
    ids = random_ids(1, 7)
    with torch.no_grad():
        expected = peft_model(ids).logits
    hf_posenc.save_adapter(peft_model, tmp_path / "adapter")
    loaded = hf_posenc.from_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


def test_peft_own_loader_on_a_patched_base_restores_positional_weights(tmp_path):
    directory, ids, logits, _ = trained_adapter(tmp_path)
    base = hf_posenc.patch_model(tiny_model("llama"), "kerple")  # fresh, untrained KERPLE
    loaded = peft.PeftModel.from_pretrained(base, directory)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_adapter_on_a_base_patched_another_way_is_refused(tmp_path):
    directory, *_ = trained_adapter(tmp_path)
    with pytest.raises(hf_posenc.PosEncError, match="trained on"):
        hf_posenc.load_adapter(directory, base_model=hf_posenc.patch_model(tiny_model("llama"), "alibi"))


def test_save_adapter_refuses_an_unpatched_base(tmp_path):
    peft_model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with pytest.raises(hf_posenc.PosEncError, match="not patched"):
        hf_posenc.save_adapter(peft_model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()


LORA_TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "bloom": ["query_key_value"]}


def assert_positional_weights_saved(directory, positional: dict, initial: dict, prefix: str):
    from safetensors import safe_open

    with safe_open(directory / "adapter_model.safetensors", framework="pt") as handle:
        for name, value in positional.items():
            saved = handle.get_tensor(f"{prefix}.{name}")
            assert torch.equal(saved, value) and not torch.equal(saved, initial[name])


@pytest.mark.parametrize("model_type, method, prefix", [
    ("llama", "kerple", "base_model.model.model.posenc"),
    ("gpt2", "learned", "base_model.model.transformer.wpe"),  # GPT-2's learned table stands in wpe
    ("bloom", "fire", "base_model.model.transformer.posenc"),
])
def test_peft_own_save_pretrained_carries_the_positional_weights_listed_in_modules_to_save(
        tmp_path, model_type, method, prefix):
    """PEFT's own API, no hf_posenc call but the config's modules_to_save: PeftModel.save_pretrained writes the
    trained positional weights and PeftModel.from_pretrained on a base patched the same way restores them."""
    model = hf_posenc.patch_model(tiny_model(model_type), method)
    initial = {key: value.clone() for key, value in hf_posenc.get_positional_module(model).state_dict().items()}
    modules = hf_posenc.peft_modules_to_save(model)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=LORA_TARGETS[model_type],
                                                            init_lora_weights=False, modules_to_save=modules))
    perturb_positional_state(model)  # the module PEFT trains: its copy in modules_to_save
    ids = random_ids(2, 9)
    with torch.no_grad():
        logits = peft_model(ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    assert_positional_weights_saved(tmp_path / "adapter", hf_posenc.get_positional_module(model).state_dict(),
                                    initial, prefix)
    loaded = peft.PeftModel.from_pretrained(hf_posenc.patch_model(tiny_model(model_type), method),
                                            tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)


def test_modules_to_save_train_a_copy_that_the_patch_computes_with(tmp_path):
    """PEFT trains a copy of a module in modules_to_save: the patch computes with the copy while the adapter is
    active, with the original when it is disabled, and with the trained copy after merge_and_unload (whose
    save_pretrained and reload keep it)."""
    model = hf_posenc.patch_model(tiny_model("llama"), "t5")
    ids = random_ids(2, 9)
    with torch.no_grad():
        untouched = model(ids).logits
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"],
                                                            modules_to_save=hf_posenc.peft_modules_to_save(model)))
    trained = hf_posenc.get_positional_module(model)
    assert trained is not peft_model.base_model.model.model.posenc.original_module
    assert all(p.requires_grad for p in trained.parameters())
    perturb_positional_state(model)
    with torch.no_grad():
        active = peft_model(ids).logits
        with peft_model.disable_adapter():
            assert torch.equal(peft_model(ids).logits, untouched)
    assert not torch.equal(active, untouched)
    merged = peft_model.merge_and_unload()
    assert hf_posenc.get_positional_module(merged) is trained
    with torch.no_grad():
        assert torch.equal(merged(ids).logits, active)
    merged.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.equal(hf_posenc.from_pretrained(tmp_path / "merged")(ids).logits, active)


def test_patched_after_get_peft_model_saves_merged_under_the_architectures_names(tmp_path):
    """LoRA first, then the patch (or the patch put back under LoRA, as finetune's teacher does each step): the save
    hook's original state is read from a tree of PEFT layers. Merged, the model saves under the architecture's names
    and reloads equal (it was saved as q_proj.base_layer / lora_A / lora_B, read back as random projections);
    unmerged, save_pretrained refuses and writes nothing."""
    from safetensors.torch import load_file

    peft_model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                           init_lora_weights=False))
    hf_posenc.patch_model(peft_model.get_base_model(), "alibi")
    with pytest.raises(hf_posenc.PosEncError, match=r"PEFT adapter layers not merged \(model.layers.0.self_attn.q_proj"):
        peft_model.get_base_model().save_pretrained(tmp_path / "unmerged")
    assert not (tmp_path / "unmerged").exists()
    ids = random_ids(2, 9)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert not [key for key in saved if "lora" in key or "base_layer" in key]
    reloaded, info = hf_posenc.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, merged(ids).logits)


def test_save_adapter_with_modules_to_save_loads_onto_an_unpatched_base(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "kerple")
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                                                            modules_to_save=hf_posenc.peft_modules_to_save(model)))
    perturb_positional_state(model)
    ids = random_ids(1, 7)
    with torch.no_grad():
        expected = peft_model(ids).logits
    hf_posenc.save_adapter(peft_model, tmp_path / "adapter")
    loaded = hf_posenc.load_adapter(tmp_path / "adapter", base_model=tiny_model("llama"))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, expected)


def test_peft_modules_to_save_lists_only_trainable_positional_modules():
    assert hf_posenc.peft_modules_to_save(hf_posenc.patch_model(tiny_model("llama"), "kerple")) == ["model.posenc"]
    assert hf_posenc.peft_modules_to_save(hf_posenc.patch_model(tiny_model("llama"), "alibi")) == []  # fixed slopes
    assert hf_posenc.peft_modules_to_save(hf_posenc.patch_model(tiny_model("llama"), "alibi", trainable=True)) == [
        "model.posenc"]
    with pytest.raises(hf_posenc.PosEncError, match="patched by hf_posenc"):
        hf_posenc.peft_modules_to_save(tiny_model("llama"))


# --- transformers' own PEFT integration: model.add_adapter / model.load_adapter -----------------------------------
def transformers_needs_a_newer_peft() -> bool:
    from packaging.version import Version
    from transformers.integrations import peft as transformers_peft

    needed = getattr(transformers_peft, "MIN_PEFT_VERSION", "0")
    return Version(peft.__version__) < Version(needed)


@pytest.mark.parametrize("model_type, method, with_modules_to_save", [
    ("llama", "kerple", False),
    ("llama", "kerple", True),
    ("gpt2", "alibi", False),
    ("bloom", "t5", False),
])
def test_transformers_add_adapter_and_load_adapter_on_a_patched_model(tmp_path, model_type, method,
                                                                     with_modules_to_save):
    """transformers' route: model.add_adapter(LoraConfig), LoRA (and positional) weights moved off their initial
    values as training would, model.save_pretrained writes the adapter (with the positional weights and
    posenc_config.json), and model.load_adapter on a base patched the same way gives identical logits."""
    model = hf_posenc.patch_model(tiny_model(model_type), method)
    modules = hf_posenc.peft_modules_to_save(model) if with_modules_to_save else None
    if transformers_needs_a_newer_peft():
        # transformers 5.24 asks for PEFT >= 0.22 in add_adapter, newer than any release on PyPI as of 2026-11-25:
        # its own refusal, on the patched model as on any; PEFT's own route (tests above) is what works then.
        with pytest.raises(ValueError, match="version of PEFT you are using is not compatible"):
            model.add_adapter(peft.LoraConfig(r=4, target_modules=LORA_TARGETS[model_type]))
        return
    model.add_adapter(peft.LoraConfig(r=4, target_modules=LORA_TARGETS[model_type], init_lora_weights=False,
                                      modules_to_save=modules))
    perturb_positional_state(model)
    ids = random_ids(2, 9)
    with torch.no_grad():
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "adapter")
    assert json.loads((tmp_path / "adapter" / "posenc_config.json").read_text())["adapter"] is True
    base = hf_posenc.patch_model(tiny_model(model_type), method)
    base.load_adapter(tmp_path / "adapter")
    assert hf_posenc.get_posenc_config(base).method == method
    with torch.no_grad():
        assert torch.equal(base(ids).logits, logits)
    loaded = hf_posenc.load_adapter(tmp_path / "adapter", base_model=tiny_model(model_type))  # onto an unpatched base
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
    with pytest.raises(hf_posenc.PosEncError, match="carries a PEFT adapter"):
        model.save_pretrained(tmp_path / "standalone", standalone=True)


# --- patching a PEFT model (issue 51, point 1): its transformers model is patched, exactly as before get_peft_model --
def lora_model(model, model_type: str, seed: int = 6):
    torch.manual_seed(seed)  # LoRA's matrices drawn the same whichever order the patch and the wrapper come in
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=LORA_TARGETS[model_type],
                                                      init_lora_weights=False))


def patched(model, method: str, seed: int = 5):
    torch.manual_seed(seed)  # the method's initial weights, likewise
    return patch_for_contract(model, method)


def assert_patching_the_peft_model_is_patching_first(model_type: str, method: str):
    ids = random_ids(2, 9)
    patched_first = lora_model(patched(tiny_model(model_type), method), model_type)
    peft_model = lora_model(tiny_model(model_type), model_type)
    before = model_fingerprint(peft_model)
    with torch.no_grad():
        unpatched = peft_model(ids).logits
    assert patched(peft_model, method) is peft_model
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, patched_first(ids).logits)
    assert hf_posenc.get_posenc_config(peft_model) == hf_posenc.get_posenc_config(patched_first)
    assert hf_posenc.get_positional_module(peft_model) is hf_posenc.get_positional_module(
        peft_model.get_base_model())
    # frozen as get_peft_model freezes every weight but the adapter's
    assert {name: p.requires_grad for name, p in peft_model.named_parameters()} == {
        name: p.requires_grad for name, p in patched_first.named_parameters()}
    hf_posenc.unpatch_model(peft_model)
    assert hf_posenc.get_posenc_config(peft_model) is None
    assert_same_fingerprint(before, model_fingerprint(peft_model))
    with torch.no_grad():
        assert torch.equal(peft_model(ids).logits, unpatched)


@pytest.mark.parametrize("method", hf_posenc.available_methods())
def test_patching_a_peft_model_equals_patching_before_get_peft_model(method):
    """It used to change nothing (yarn, rope, nope: the patch went on PEFT's wrapper) or raise AttributeError."""
    assert_patching_the_peft_model_is_patching_first("llama", method)


@pytest.mark.parametrize("model_type, method", [("gpt2", "alibi"), ("gpt2", "rope"), ("gpt2", "yarn"),
                                                ("gpt2", "learned"), ("bloom", "kerple"), ("bloom", "rope"),
                                                ("bloom", "nope")])
def test_patching_a_gpt2_or_bloom_peft_model_equals_patching_first(model_type, method):
    assert_patching_the_peft_model_is_patching_first(model_type, method)


@pytest.mark.parametrize("model_type", ["gpt2", "bloom"])
def test_rope_on_a_fused_projection_rotates_lora_updates_too(model_type):
    """GPT-2's and BLOOM's rotary patches rotate the fused qkv projection's output. LoRA on that projection, added
    after the patch, wraps it: the rotation must take the wrapper's output (base + LoRA update), or merging the update
    into the weights moves the logits (0.10 on the tiny GPT-2 before the fix)."""
    ids = random_ids(2, 9)
    base = hf_posenc.patch_model(tiny_model(model_type), "rope")
    with torch.no_grad():
        patched_base = base(ids).logits
    peft_model = lora_model(base, model_type)
    with torch.no_grad():
        adapted = peft_model(ids).logits
        with peft_model.disable_adapter():
            assert torch.equal(peft_model(ids).logits, patched_base)
    assert max_diff(adapted, patched_base) > 1e-2  # the LoRA update counts
    merged = peft_model.merge_and_unload()
    with torch.no_grad():
        assert max_diff(merged(ids).logits, adapted) < 1e-5
    assert count_hooks(hf_posenc.unpatch_model(merged)) == 0


def test_a_peft_model_patched_after_get_peft_model_saves_and_loads_its_adapter(tmp_path):
    peft_model = lora_model(tiny_model("llama"), "llama")
    hf_posenc.patch_model(peft_model, "kerple")
    perturb_positional_state(peft_model)
    ids = random_ids(2, 9)
    with torch.no_grad():
        logits = peft_model(ids).logits
    hf_posenc.save_adapter(peft_model, tmp_path / "adapter")
    loaded = hf_posenc.load_adapter(tmp_path / "adapter", base_model=tiny_model("llama"))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, logits)
