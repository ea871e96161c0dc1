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


def test_card_of_a_bundled_smollm2_checkpoint_names_its_base_and_license(tmp_path):
    """A checkpoint made from the bundled model (tools.models.load_smollm2 records its base) names
    HuggingFaceTB/SmolLM2-135M-Instruct with its license and says that the weights are de-quantised from Q4_1; the
    record survives a reload (issue 19, item 9)."""
    from hf_posenc.checkpoints.saving import BASE_MODEL_ATTR
    from hf_posenc.tools.models import SMOLLM2_BASE

    model = tiny_model("llama")
    setattr(model, BASE_MODEL_ATTR, dict(SMOLLM2_BASE))  # as load_smollm2 does
    hf_posenc.patch_model(model, "kerple").save_pretrained(tmp_path / "ckpt")
    hf_posenc.from_pretrained(tmp_path / "ckpt").save_pretrained(tmp_path / "again")
    card = hf_posenc.make_model_card(tmp_path / "again", repo_id="acme/smollm2-kerple")
    data = ModelCard(str(card)).data
    assert data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and data.license == "apache-2.0"
    assert "SmolLM2-135M-Instruct de-quantised from Q4_1" in card.text


def test_recipe_of_a_finetune_run_shows_what_a_reader_needs(tmp_path):
    """hf-posenc finetune's training_args.json (about 60 entries) becomes a short recipe: no local paths, process
    details or digests (issue 19, item 9)."""
    model = hf_posenc.patch_model(tiny_model("llama"), "kerple")
    model.save_pretrained(tmp_path)
    summary = {"command": "finetune", "model": "/home/me/.cache/smollm2", "method": "kerple", "train_only": "all",
               "lora_r": 8, "text_file": ["/home/me/data/pg1342.txt"], "text_fraction": "0:0.8", "max_length": 512,
               "lr": 1e-4, "output_dir": "/home/me/runs/kerple-ft", "distributed_type": "DistributedType.NO",
               "weights_sha256_per_process": ["9f2c..."], "steps_done": 60, "final_loss": 3.1,
               "versions": {"torch": "2.13.0"}, "checkpoint_dir": None, "seed": 0}
    (tmp_path / "training_args.json").write_text(json.dumps(summary))
    text = hf_posenc.make_model_card(tmp_path, repo_id="acme/x").text
    recipe = text[text.index("## Fine-tuning recipe"):]
    assert "| text | `pg1342.txt (fraction 0:0.8)` |" in recipe and "| lr | `0.0001` |" in recipe
    assert "| steps_done | `60` |" in recipe and "| method | `kerple` |" in recipe
    for hidden in ("/home/me", "DistributedType", "sha256", "lora_r", "versions", "checkpoint_dir"):
        assert hidden not in recipe
