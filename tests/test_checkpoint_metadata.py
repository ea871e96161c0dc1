"""Malformed checkpoint metadata (issue 51.11): each is a PosEncError naming the file and the field, from
hf_posenc.from_pretrained and from the standalone code alike, before transformers builds the model."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoModelForCausalLM

import hf_posenc
from hf_posenc import PosEncError
from tiny_models import tiny_model


def deeply_nested(directory):
    path = directory / "posenc_config.json"
    text = path.read_text()
    path.write_text(text.replace('"options": {', '"options": {"junk": ' + "[" * 100_000 + "]" * 100_000 + ", ", 1))


def edit_json(name, change):
    def edit(directory):
        path = directory / name
        content = json.loads(path.read_text())
        change(content)
        path.write_text(json.dumps(content))
    return edit


def made_a_directory(directory):
    (directory / "posenc_config.json").unlink()
    (directory / "posenc_config.json").mkdir()


CASES = {  # tampering -> what the refusal names
    "deeply-nested": (deeply_nested, ["posenc_config.json", "options.junk", "nested more than 32 levels"]),
    "junk-rope-type": (edit_json("posenc_config.json",
                                 lambda m: m["config_before_patch"]["rope_parameters"].update(rope_type="junk")),
                       ["posenc_config.json", "config_before_patch.rope_parameters.rope_type is 'junk'"]),
    "directory": (made_a_directory, ["posenc_config.json is not a file"]),
    "relabelled-metadata": (edit_json("posenc_config.json", lambda m: m["model"].update(model_type="gpt2")),
                            ["posenc_config.json", "model.model_type is 'gpt2'", "config.json says model_type "
                                                                                 "'llama'"]),
    "relabelled-config": (edit_json("config.json", lambda c: c.update(model_type="gpt2")),
                          ["posenc_config.json", "model.model_type is 'llama'", "config.json says model_type 'gpt2'"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A YaRN-patched LLaMA (config_before_patch records the original rope_parameters), with standalone code."""
    directory = tmp_path_factory.mktemp("yarn")
    hf_posenc.patch_model(tiny_model("llama"), "yarn", factor=2.0).save_pretrained(directory, standalone=True)
    return directory


@pytest.mark.parametrize("loader", ["from_pretrained", "standalone"])
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_metadata_is_refused_naming_the_file_and_field(saved, tmp_path, case, loader):
    tamper, expected = CASES[case]
    directory = tmp_path / case
    shutil.copytree(saved, directory)
    tamper(directory)
    # the standalone code raises its own copy of PosEncError (posenc_errors.py), a ValueError as ours is
    with pytest.raises(PosEncError if loader == "from_pretrained" else ValueError) as refused:
        if loader == "from_pretrained":
            hf_posenc.from_pretrained(directory)
        else:
            AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    assert type(refused.value).__name__ == "PosEncError"
    for part in expected:
        assert part in str(refused.value), str(refused.value)
