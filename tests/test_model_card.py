"""Model cards: Hub metadata, method and options, fine-tuning recipe, evaluation table and plot; checked metadata."""

from __future__ import annotations

import json

import pytest
from huggingface_hub import ModelCard, ModelCardData

import hf_posenc
from hf_posenc import PosEncError
from hf_posenc.checkpoints.model_card import validate_card_metadata
from tiny_models import tiny_model


@pytest.fixture
def checkpoint(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "alibi", slopes="geometric")
    model.save_pretrained(tmp_path / "ckpt", base_model="acme/tiny-llama")
    (tmp_path / "ckpt" / "finetune_settings.json").write_text(json.dumps({"learning_rate": 2e-5, "steps": 500}))
    (tmp_path / "results.csv").write_text("method,perplexity,continuation,seconds\nnone,19.45,\"a | b\",11.8\n"
                                          "alibi,1155.6,\"x\",22.4\n")
    base = tmp_path / "base"
    base.mkdir()
    ModelCard.from_template(ModelCardData(license="mit"), template_str="---\n{{ card_data }}\n---\n# base\n").save(
        base / "README.md")
    return tmp_path


def test_card_from_a_checkpoint(checkpoint):
    card = hf_posenc.make_model_card(checkpoint / "ckpt", repo_id="acme/tiny-alibi", base_model_card=checkpoint / "base",
                                     evaluation=checkpoint / "results.csv", plot="perplexity.png")
    data = ModelCard(str(card)).data  # as the Hub parses it
    assert data.base_model == "acme/tiny-llama" and data.license == "mit"
    assert data.library_name == "transformers" and data.pipeline_tag == "text-generation"
    assert {"positional-encoding", "hf_posenc", "posenc-alibi"} <= set(data.tags)
    text = card.text
    assert "| slopes | `geometric` |" in text and "**alibi**" in text
    assert "| learning_rate | `2e-05` |" in text  # the fine-tuning run's saved settings
    assert "| method | perplexity | seconds |" in text and "| alibi | 1156 | 22.4 |" in text  # numeric columns only
    assert "![evaluation plot](perplexity.png)" in text
    assert 'hf_posenc.from_pretrained("acme/tiny-alibi")' in text and "trust_remote_code" not in text
    assert "**not** this model" in text  # plain transformers would silently drop ALiBi


def test_card_from_a_model_says_how_to_load_natively(tmp_path):
    model = hf_posenc.patch_model(tiny_model("llama"), "yarn", factor=2.0)
    card = hf_posenc.make_model_card(model, repo_id="acme/tiny-yarn", license="apache-2.0")
    assert "plain transformers loads it" in card.text and card.data.license == "apache-2.0"
    assert card.data.base_model is None  # built from a config: no Hub base model to name


def test_standalone_card_tags_custom_code(tmp_path):
    model = hf_posenc.patch_model(tiny_model("gpt2"), "nope")
    model.save_pretrained(tmp_path, standalone=True)
    card = hf_posenc.make_model_card(tmp_path, repo_id="acme/x")
    assert "custom_code" in card.data.tags and "trust_remote_code=True" in card.text


@pytest.mark.parametrize("field,value,message", [
    ("license", "Not A License!", "not a license identifier"),
    ("base_model", "/tmp/local/path", "not a Hub repo id"),
    ("pipeline_tag", "fill-mask", "pipeline_tag"),
    ("tags", ["has space"], "tags"),
])
def test_invalid_metadata_is_refused(field, value, message):
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=["ok"])
    setattr(data, field, value)
    card = ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n")
    with pytest.raises(PosEncError, match=message):
        validate_card_metadata(card)


def test_unpatched_model_is_refused():
    with pytest.raises(PosEncError, match="patched by hf_posenc"):
        hf_posenc.make_model_card(tiny_model("llama"))
