"""posenc_config.json, the file beside config.json that describes a checkpoint's positional patch: its name, its
format version, reading it (with the checks every reader needs) and writing it."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..errors import PosEncError
from ..version import __version__

POSENC_CONFIG_NAME = "posenc_config.json"
FORMAT_VERSION = 1
# hf_posenc writes a few levels of nesting (a hybrid's parts' options); a deeper file was edited, and Python's JSON
# parser would give a RecursionError past about 1000 levels.
MAX_NESTING = 32
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}:]')


def too_deep_field(text: str, limit: int = MAX_NESTING) -> str | None:
    """The field (dotted keys) of the first value nested deeper than `limit` in a JSON text, or None."""
    path: list[str | None] = []  # per open container: the key being read (objects) or None (arrays)
    last_string = None
    for token in _JSON_TOKENS.finditer(text):
        value = token.group()
        if value.startswith('"'):
            last_string = value[1:-1]
        elif value == ":" and path:
            path[-1] = last_string
        elif value in "[{":
            if len(path) >= limit:
                return ".".join(key for key in path if key is not None) or "(the top level)"
            path.append(None)
        elif path:
            path.pop()
    return None


def local_metadata_entry(name_or_path) -> None:
    """posenc_config.json in a local checkpoint directory when it is there but not a file (transformers' cached_file
    then answers "no such file", and the checkpoint would load unpatched); refused by the loaders."""
    entry = Path(name_or_path) / POSENC_CONFIG_NAME
    if os.path.isdir(name_or_path) and os.path.lexists(entry) and not entry.is_file():
        raise PosEncError(f"{entry} is not a file (a directory or a broken link): the checkpoint's positional patch "
                          "cannot be read. Restore the file, or save the model again with save_pretrained.")


def write_metadata(directory, metadata: dict[str, Any]) -> Path:
    path = Path(directory) / POSENC_CONFIG_NAME
    path.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_metadata(path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
        deep = too_deep_field(text)
        if deep is not None:
            raise PosEncError(f"{path}: the field {deep} is nested more than {MAX_NESTING} levels deep; hf_posenc "
                              "writes a few, so the file was edited or damaged. Save the model again with "
                              "save_pretrained.")
        metadata = json.loads(text)
    except (OSError, ValueError, RecursionError) as error:
        if isinstance(error, PosEncError):
            raise
        raise PosEncError(f"Cannot read {path}: {error}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != "hf_posenc":
        raise PosEncError(f"{path} is not an hf_posenc positional config (no \"format\": \"hf_posenc\").")
    version = metadata.get("format_version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise PosEncError(f"{path} has format_version {version!r}; this hf_posenc ({__version__}) reads the "
                          f"integer versions 1 to {FORMAT_VERSION}. Upgrade hf_posenc if the checkpoint is newer; "
                          "otherwise the file was edited: save the model again with save_pretrained.")
    for key, kind in (("method", str), ("options", dict), ("model", dict), ("positional_state", dict)):
        if not isinstance(metadata.get(key), kind):
            raise PosEncError(f"{path}: {key!r} is missing or not a {kind.__name__}.")
    return metadata
