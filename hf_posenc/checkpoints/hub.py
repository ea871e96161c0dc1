"""Publishing patched checkpoints to the Hugging Face Hub (through huggingface_hub).

`push_to_hub(model_or_dir, repo_id)` assembles the folder to upload in a temporary directory (the local
checkpoint is only read, never changed): weights and configs, posenc_config.json, the model card
(README.md), the evaluation plot, and the standalone code when asked. With `dry_run=DIR` it writes exactly
that folder to DIR and uploads nothing.

`publish_saved` is the library's part of a patched model's `save_pretrained(standalone=True, push_to_hub=True)`
(see checkpoints/saving.py).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..engine.install import applied_patch
from ..errors import PosEncError
from .metadata import POSENC_CONFIG_NAME, read_metadata


def check_repo_id(repo_id: Any) -> str:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PosEncError(f"Malformed repo id {repo_id!r}: {error} Use 'namespace/name'.") from None
    if repo_id.count("/") != 1:
        raise PosEncError(f"Malformed repo id {repo_id!r}: use 'namespace/name' (your user name or an organisation).")
    return repo_id


def publish_saved(directory, metadata: dict[str, Any], *, standalone: bool, upload: bool, token: str | None = None,
                  check: bool = False, **push_options) -> None:
    """After a patched model's save_pretrained has written `directory`: add the standalone code, and upload it to the
    Hub repo `repo_id` (default: the directory's name) with the other push options. check=True, before it writes:
    only refuse standalone code that cannot be made (a user's method defined in __main__, ...)."""
    from .export import standalone_files, write_standalone_code

    if check:
        if standalone:
            standalone_files(metadata)
        return
    if standalone:
        write_standalone_code(None, directory, metadata)
    if upload:
        repo_id = push_options.pop("repo_id", None) or Path(directory).name
        push_to_hub(directory, repo_id, token=token, **push_options)


def report_images(evaluation: Any) -> list[Path]:
    """The images that the Markdown page ``evaluation`` (an ``hf-posenc report`` page) shows by a plain file name, the
    files beside it: the card nests the page, so they go into the uploaded folder with it."""
    if not isinstance(evaluation, (str, os.PathLike)) or Path(evaluation).suffix != ".md" \
            or not Path(evaluation).is_file():
        return []
    page = Path(evaluation)
    names = re.findall(r"!\[[^\]]*\]\(([^)\s/\\]+)\)", page.read_text(encoding="utf-8"))
    return [page.parent / name for name in dict.fromkeys(names) if (page.parent / name).is_file()]


def build_upload_folder(model_or_dir: Any, folder, *, repo_id: str | None = None, standalone: bool = False,
                        model_card: bool = True, plot: str | os.PathLike | None = None, **card_options) -> list[str]:
    """Write into `folder` (new or empty) what push_to_hub uploads; returns its file names, sorted."""
    from .export import write_standalone_code
    from .model_card import make_model_card

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):
        raise PosEncError(f"{folder} is not empty; give a new or empty directory.")
    folder.mkdir(parents=True, exist_ok=True)
    if isinstance(model_or_dir, (str, os.PathLike)):
        source = Path(model_or_dir)
        if not (source / POSENC_CONFIG_NAME).is_file():
            raise PosEncError(f"{source} is not an hf_posenc checkpoint (no {POSENC_CONFIG_NAME}); save a patched "
                              "model with save_pretrained first.")
        shutil.copytree(source, folder, dirs_exist_ok=True)
        if standalone and not (folder / "modeling_posenc.py").is_file():
            write_standalone_code(None, folder, read_metadata(folder / POSENC_CONFIG_NAME))
    else:
        if applied_patch(model_or_dir) is None:
            raise PosEncError("push_to_hub needs a model patched by hf_posenc, or a saved checkpoint directory.")
        model_or_dir.save_pretrained(folder, standalone=standalone)
    if plot is not None:
        if not Path(plot).is_file():
            raise PosEncError(f"Plot {plot} does not exist.")
        shutil.copy(plot, folder / Path(plot).name)
    if model_card:
        for image in report_images(card_options.get("evaluation")):  # an hf-posenc report's plots, beside its page
            if not (folder / image.name).exists():  # never over a file of the checkpoint
                shutil.copy(image, folder / image.name)
        card = make_model_card(folder, repo_id=repo_id, plot=plot, **card_options)
        card.save(folder / "README.md")
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def push_to_hub(model_or_dir: Any, repo_id: str, *, token: str | None = None, private: bool | None = None,
                revision: str | None = None, commit_message: str | None = None, create_pr: bool = False,
                standalone: bool = False, model_card: bool = True, plot: str | os.PathLike | None = None,
                dry_run: str | os.PathLike | None = None, endpoint: str | None = None, **card_options):
    """Upload a patched model or a saved hf_posenc checkpoint to the Hub repo `repo_id` ('namespace/name').

    The repo is created if needed (`private` applies then); `revision` names a branch, created from main if
    missing. The token is `token`, else huggingface_hub's usual sources (HF_TOKEN, `hf auth login`). The
    endpoint is `endpoint`, else $HF_ENDPOINT, else huggingface_hub's default. `card_options` go to
    make_model_card (base_model, license, evaluation, finetune_settings, ...).

    dry_run=DIR writes the folder that would be uploaded to DIR and returns its file names; otherwise returns
    huggingface_hub's CommitInfo.
    """
    check_repo_id(repo_id)
    if dry_run is not None:
        return build_upload_folder(model_or_dir, dry_run, repo_id=repo_id, standalone=standalone,
                                   model_card=model_card, plot=plot, **card_options)
    from huggingface_hub import HfApi, constants, get_token

    if constants.is_offline_mode():
        raise PosEncError("huggingface_hub is in offline mode (HF_HUB_OFFLINE is set): unset it to upload.")
    token = token or get_token()
    if not token:
        raise PosEncError("No Hugging Face token: pass token=..., set HF_TOKEN, or run `hf auth login`.")
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory(prefix="hf_posenc_upload_") as folder:
        build_upload_folder(model_or_dir, folder, repo_id=repo_id, standalone=standalone, model_card=model_card,
                            plot=plot, **card_options)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if revision not in (None, "main"):
                api.create_branch(repo_id, branch=revision, exist_ok=True)
            return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, create_pr=create_pr,
                                     commit_message=commit_message or "Upload model patched with hf_posenc")
        except Exception as error:  # noqa: BLE001  (network and HTTP errors come in many types)
            raise PosEncError(_explain(error, endpoint, repo_id)) from error


def _explain(error: Exception, endpoint: str, repo_id: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        if status in (401, 403):
            return (f"The Hub at {endpoint} refused the token for {repo_id} (HTTP {status}): check that it is valid "
                    "and has write access.")
        return f"Upload of {repo_id} to {endpoint} failed (HTTP {status}): {_one_line(error)}"
    return f"Cannot upload {repo_id} to {endpoint} ({type(error).__name__}: {_one_line(error)}). Is the network up?"


def _one_line(error: Exception) -> str:
    """The error's message on one line (a command prints one ``error:`` line): httpx puts "For more information
    check: <an MDN page on the status>" on a line of its own, and huggingface_hub adds the server's message on
    others."""
    lines = [line.strip() for line in str(error).splitlines()]
    return " ".join(line for line in lines if line and not line.startswith("For more information check:"))
