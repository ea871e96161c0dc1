"""The state file of a fine-tune's resumable checkpoint (``OUTPUT-checkpoints/step-N/trainer_state.json``), read
by ``finetune --resume-from`` (finetune/checkpoints.py, which writes it) and by the model loader (models.py), which
evaluates a checkpoint as its run stood."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .outputs import error_text
from .runtime import UsageError

STATE_FILE = "trainer_state.json"
_PROGRESS_KEYS = ("step", "epoch", "batches_in_epoch", "log")


class IncompleteCheckpoint(UsageError):
    """A checkpoint folder whose state file is missing or cut short, or whose files are not all there."""


def read_state(folder: Path) -> dict[str, Any]:
    """The saved state of the checkpoint ``folder`` (step, epoch, batches_in_epoch, log, settings), once it is known to
    be complete; IncompleteCheckpoint says what is wrong with it otherwise."""
    state_file = folder / STATE_FILE
    if not state_file.is_file():
        raise IncompleteCheckpoint(f"no {STATE_FILE} in {folder}")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise IncompleteCheckpoint(f"its {STATE_FILE} is cut short or unreadable ({error_text(error)})") from None
    if not isinstance(state, dict) or any(key not in state for key in _PROGRESS_KEYS):
        raise IncompleteCheckpoint(f"its {STATE_FILE} lacks the training progress ({', '.join(_PROGRESS_KEYS)})")
    for name, size in (state.get("files") or {}).items():  # checkpoints of older versions list none
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            found = f"has {path.stat().st_size} of its {size} bytes" if path.is_file() else "is missing"
            raise IncompleteCheckpoint(f"its {name} {found}")
    return state
