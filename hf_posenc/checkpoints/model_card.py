"""Model cards for patched checkpoints: Hub metadata plus what was changed, how to load it, how it was trained
and how it scored. The text comes from the Jinja template `model_cards/model_card.md.j2`; the card is a
`huggingface_hub.ModelCard`, and its metadata block is checked here (offline) before it is returned.

    card = hf_posenc.make_model_card("out/alibi", repo_id="me/smollm2-alibi",
                                     evaluation="runs/demo/results.csv", plot="runs/demo/perplexity.png")
    card.save("out/alibi/README.md")
"""

from __future__ import annotations

import csv
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..errors import PosEncError
from ..registry import get_method
from .metadata import POSENC_CONFIG_NAME, read_metadata

TEMPLATE_NAME = "model_card.md.j2"
TAGS = ("hf_posenc", "positional-encoding")
PIPELINE_TAGS = ("text-generation",)
# Names the fine-tuning script may save its settings under, inside the checkpoint directory.
FINETUNE_SETTINGS_NAMES = ("training_args.json", "finetune_settings.json", "training_settings.json")
_LICENSE = re.compile(r"^[a-z0-9][a-z0-9.\-]*$")


def template_path() -> Path:
    """model_cards/ of the source tree, else the copy installed under <prefix>/share/hf_posenc."""
    for candidate in (Path(__file__).resolve().parents[2] / "model_cards" / TEMPLATE_NAME,
                      Path(sys.prefix) / "share" / "hf_posenc" / "model_cards" / TEMPLATE_NAME):
        if candidate.is_file():
            return candidate
    raise PosEncError(f"Cannot find the model card template {TEMPLATE_NAME}; pass template=PATH.")


def is_repo_id(name: Any) -> bool:
    if not isinstance(name, str) or not name or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def base_model_license(base_model_card: Any) -> str | None:
    """The license of a base model's card (a ModelCard, a README.md path or a local model directory)."""
    if base_model_card is None:
        return None
    if not isinstance(base_model_card, ModelCard):
        path = Path(base_model_card)
        path = path / "README.md" if path.is_dir() else path
        if not path.is_file():
            return None
        base_model_card = ModelCard.load(path)
    return getattr(base_model_card.data, "license", None)


def _metadata_of(model_or_dir: Any) -> tuple[dict[str, Any], Path | None]:
    if isinstance(model_or_dir, (str, os.PathLike)):
        directory = Path(model_or_dir)
        return read_metadata(directory / POSENC_CONFIG_NAME), directory
    from ..engine.install import applied_patch
    from .saving import posenc_metadata

    applied = applied_patch(model_or_dir)
    if applied is None:
        raise PosEncError("make_model_card needs a model patched by hf_posenc, or a checkpoint directory.")
    return posenc_metadata(model_or_dir, applied.method), None


def _value(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text.replace("|", "\\|")


def _demote_headings(markdown: str, levels: int = 2) -> str:
    return "\n".join("#" * levels + line if line.startswith("#") else line for line in markdown.splitlines())


def evaluation_table(path: Path, max_rows: int = 50) -> str:
    """A markdown table of an evaluation CSV (a row per model or method): the first column and every numeric one."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        return ""
    columns = list(rows[0])

    def numeric(column: str) -> bool:
        try:
            [float(row[column]) for row in rows if row[column] not in ("", None)]
            return True
        except (TypeError, ValueError):
            return False

    keep = [columns[0]] + [c for c in columns[1:] if numeric(c) and any(row[c] for row in rows)]

    def cell(value: str, column: str) -> str:
        if column != keep[0] and value not in ("", None):
            number = float(value)
            return f"{number:.4g}" if not number.is_integer() else str(int(number))
        return _value(value or "")

    lines = ["| " + " | ".join(keep) + " |", "| " + " | ".join("---" for _ in keep) + " |"]
    lines += ["| " + " | ".join(cell(row[c], c) for c in keep) + " |" for row in rows[:max_rows]]
    return "\n".join(lines)


def _finetune_settings(finetune_settings: Any, directory: Path | None) -> list[tuple[str, str]]:
    if finetune_settings is None and directory is not None:
        finetune_settings = next((directory / n for n in FINETUNE_SETTINGS_NAMES if (directory / n).is_file()), None)
    if finetune_settings is None:
        return []
    if not isinstance(finetune_settings, dict):
        try:
            finetune_settings = json.loads(Path(finetune_settings).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise PosEncError(f"Cannot read the fine-tuning settings {finetune_settings}: {error}") from None
    if finetune_settings.get("command") == "finetune":
        finetune_settings = recipe_of_finetune(finetune_settings)
    return [(str(k), _value(v)) for k, v in finetune_settings.items()]


# What a reader of the card needs from hf-posenc finetune's training_args.json (which holds about 60 entries: local
# paths, process details, digests, versions), in this order; entries that are unset are left out.
RECIPE_SETTINGS = ("method", "train_only", "lora_r", "lora_alpha", "lora_dropout", "text", "max_length", "steps_done",
                   "lr", "positional_lr", "lr_scheduler", "warmup_steps_used", "weight_decay", "max_grad_norm",
                   "effective_batch_blocks", "tokens_per_step", "num_processes", "mixed_precision_used", "dtype",
                   "seed", "first_loss", "final_loss", "final_eval_loss")


def recipe_of_finetune(summary: dict[str, Any]) -> dict[str, Any]:
    """The settings of an hf-posenc finetune run that say how the model was trained, without local paths."""
    recipe = dict(summary)
    recipe["method"] = summary.get("method") or "none (the model as loaded)"
    if summary.get("train_only") != "lora":
        recipe.update(lora_r=None, lora_alpha=None, lora_dropout=None)
    files = [Path(str(name)).name for name in summary.get("text_file") or []]
    source = ", ".join(files) or summary.get("dataset")
    if source:
        recipe["text"] = source + (f" (fraction {summary['text_fraction']})" if summary.get("text_fraction") else "")
    return {name: recipe[name] for name in RECIPE_SETTINGS if recipe.get(name) not in (None, "", [])}


def validate_card_metadata(card: ModelCard) -> None:
    """Offline checks of the metadata block (the Hub's own check, `card.validate()`, needs the network): it
    parses as YAML into ModelCardData, and the fields the Hub indexes have valid values."""
    data = ModelCard(str(card)).data  # re-parsed from the text, as the Hub will read it
    problems = []
    if data.base_model is not None and not all(is_repo_id(b) for b in
                                               ([data.base_model] if isinstance(data.base_model, str) else data.base_model)):
        problems.append(f"base_model {data.base_model!r} is not a Hub repo id")
    if data.license is not None and not (isinstance(data.license, str) and _LICENSE.match(data.license)):
        problems.append(f"license {data.license!r} is not a license identifier (e.g. 'apache-2.0', 'other')")
    if data.license == "other" and not getattr(data, "license_name", None):
        problems.append("license 'other' needs license_name")
    if not isinstance(data.tags, list) or not all(isinstance(t, str) and t and " " not in t for t in data.tags):
        problems.append(f"tags {data.tags!r} must be a list of strings without spaces")
    if data.pipeline_tag not in PIPELINE_TAGS:
        problems.append(f"pipeline_tag {data.pipeline_tag!r} should be one of {PIPELINE_TAGS}")
    if not data.library_name:
        problems.append("library_name is missing")
    if problems:
        raise PosEncError("Model card metadata is invalid: " + "; ".join(problems) + ".")


def make_model_card(model_or_dir: Any, *, repo_id: str | None = None, base_model: str | None = None,
                    license: str | None = None, base_model_card: Any = None, finetune_settings: Any = None,
                    evaluation: Any = None, plot: str | None = None, standalone: bool | None = None,
                    language: str | list[str] | None = None, tags: list[str] | tuple[str, ...] = (),
                    template: str | os.PathLike | None = None) -> ModelCard:
    """Fill the model card template for a patched model or a saved checkpoint directory.

    - base_model: a Hub repo id (default: the one in posenc_config.json, when it is a repo id).
    - license: default: the base model card's (`base_model_card`: a ModelCard, README.md or model directory), else
      the one posenc_config.json records for its base model (the bundled SmolLM2's apache-2.0).
    - finetune_settings: the fine-tuning script's saved settings (a dict or JSON file; default: the
      training_args.json or finetune_settings.json in the checkpoint directory). Those of hf-posenc finetune are
      cut to what a reader needs (RECIPE_SETTINGS); others are shown as they are.
    - evaluation: a CSV with a row per model/method (e.g. runs/demo/results.csv), the report.md of
      `hf-posenc report` (its headings nested under the card's), or a markdown string.
    - plot: the file name of an image in the uploaded folder (e.g. "perplexity.png").
    - standalone: whether the repository carries the trust_remote_code code (default: whether the directory
      does).
    """
    metadata, directory = _metadata_of(model_or_dir)
    base_model = base_model or metadata.get("base_model")
    if base_model is not None and not is_repo_id(base_model):
        base_model = None  # a local path means nothing on the Hub
    license = license or base_model_license(base_model_card) or metadata.get("base_model_license")
    if standalone is None:
        standalone = directory is not None and (directory / "modeling_posenc.py").is_file()
    method = metadata["method"]
    model = metadata["model"]
    card_data = ModelCardData(
        base_model=base_model, library_name="transformers", license=license, language=language,
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys([*TAGS, f"posenc-{method}", *tags, *(["custom_code"] if standalone else [])])),
    )
    if isinstance(evaluation, (str, os.PathLike)) and Path(evaluation).suffix == ".csv":
        evaluation = evaluation_table(Path(evaluation))
    elif isinstance(evaluation, (str, os.PathLike)) and Path(evaluation).suffix == ".md" and Path(evaluation).is_file():
        evaluation = _demote_headings(Path(evaluation).read_text(encoding="utf-8"))  # an hf-posenc report page
    weights = metadata["positional_state"]
    card = ModelCard.from_template(
        card_data, template_path=str(template or template_path()),
        model_name=(repo_id or "").split("/")[-1] or f"{model.get('model_type')} with {method}",
        repo_id=repo_id or "PATH_OR_REPO_ID", method=method, method_description=_description(method),
        base_model_note=metadata.get("base_model_note") if base_model == metadata.get("base_model") else None,
        hf_posenc_version=metadata.get("hf_posenc_version"),
        options=[(k, _value(v)) for k, v in sorted(metadata["options"].items())],
        applied_after=", ".join(f"`{step['method']}`" for step in metadata.get("applied_after") or []),
        architecture=model.get("architecture"), model_type=model.get("model_type"),
        num_layers=model.get("num_layers"), num_heads=model.get("num_heads"),
        positional_weights=", ".join(f"`{k}` {v['shape']}" for k, v in weights.items()) or "none (computed)",
        native=bool(metadata.get("native")), standalone=standalone,
        finetune=_finetune_settings(finetune_settings, directory), evaluation=evaluation or "",
        plot=Path(plot).name if plot else None,
    )
    validate_card_metadata(card)
    return card


def _description(method: str) -> str:
    """The first line of the method class's docstring, or of its module's."""
    try:
        cls = get_method(method).module_class
    except PosEncError:
        return method
    doc = cls.__doc__ or sys.modules[cls.__module__].__doc__ or method
    return doc.strip().splitlines()[0].rstrip(".")
