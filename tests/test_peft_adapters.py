"""PEFT adapters of a patched model carry the patch and its trained positional weights (checkpoints/adapters.py)."""

import json

import pytest
import torch
from helpers import perturb_positional_state
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
