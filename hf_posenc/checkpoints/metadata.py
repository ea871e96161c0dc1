"""posenc_config.json, the file beside config.json that describes a checkpoint's positional patch: its name, its
format version, reading it (with the checks every reader needs) and writing it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import PosEncError
from ..version import __version__

POSENC_CONFIG_NAME = "posenc_config.json"
FORMAT_VERSION = 1


def write_metadata(directory, metadata: dict[str, Any]) -> Path:
    path = Path(directory) / POSENC_CONFIG_NAME
    path.write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def read_metadata(path) -> dict[str, Any]:
    try:
        metadata = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
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
