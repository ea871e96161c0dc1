"""The resumable checkpoints of ``hf-posenc finetune`` (``--save-every``, ``--resume-from``).

Each is written into a partial folder (``.hf_posenc-partial-step-N``) and renamed to ``step-N`` only once complete,
so a kill while saving leaves no ``step-N`` behind. Its ``trainer_state.json``, written last and atomically, lists the
size of every file in it: ``--resume-from latest`` takes the newest checkpoint that is complete, saying which ones it
skipped (one cut short by an older version, or damaged since), and a named one that is not complete is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

from .outputs import PARTIAL, error_text, fsync_dir, mark_work_dir, unmark_work_dir, write_json
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


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """(step, folder) of the checkpoints in ``directory`` (ours: ``step-N`` folders holding STATE_FILE), oldest
    first, complete or not."""
    if not directory.is_dir():
        return []
    return sorted((int(p.name.split("-")[1]), p) for p in directory.glob("step-*")
                  if p.name.split("-")[1].isdigit() and (p / STATE_FILE).is_file())


def latest_checkpoint(directory: Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint in ``directory`` (None: none); ``say`` is told of each newer one skipped."""
    for _, folder in reversed(checkpoints(directory)):
        try:
            read_state(folder)
            return folder
        except IncompleteCheckpoint as why:
            if say is not None:
                say(f"note: --resume-from latest skips {folder}, which is not complete ({why}); trying the one "
                    "before it")
    return None


def save_checkpoint(accelerator, directory: Path, progress, limit: int, run_settings: dict[str, Any]) -> None:
    """A resumable checkpoint ``step-N`` of ``progress`` in ``directory`` (with the settings a resumed run must share);
    only the newest ``limit`` of ours are kept. One that cannot be written (a full disk) is left out with a one-line
    warning and training goes on: the run is not lost for it, and its end still saves the model or says where it
    went."""
    name = f"step-{progress.step}"
    partial = directory / f"{PARTIAL}{name}"
    main = accelerator.is_main_process
    problem = _attempt(lambda: _start(directory, partial)) if main else None
    failed = _anywhere(accelerator, problem)
    if not failed:
        problem = _attempt(lambda: accelerator.save_state(str(partial)))
        failed = _anywhere(accelerator, problem)
    if not failed and main:
        problem = _attempt(lambda: _finish(partial, directory / name, progress, run_settings))
        failed = problem is not None
    if main and failed:
        shutil.rmtree(partial, ignore_errors=True)
        kept = [folder.name for _, folder in checkpoints(directory)]
        print(f"warning: checkpoint {name} could not be saved in {directory} ({problem or 'on another process'}); "
              f"training goes on ({'the newest checkpoint is ' + kept[-1] if kept else 'no checkpoint to resume from'})",
              file=sys.stderr, flush=True)
    elif main:
        old = checkpoints(directory)
        for _, stale in old[: max(0, len(old) - limit)]:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()


def _attempt(action: Callable[[], Any]) -> str | None:
    try:
        action()
    except Exception as error:  # OSError, torch's "[enforce fail at inline_container.cc]", SafetensorError ...
        return error_text(error)
    return None


def _anywhere(accelerator, problem: str | None) -> bool:
    """Whether any process met a problem (every process learns it, so that all of them take the same path)."""
    if accelerator.num_processes == 1:
        return problem is not None
    import torch

    flag = torch.tensor([int(problem is not None)], device=accelerator.device)
    return bool(accelerator.gather(flag).any())


def _start(directory: Path, partial: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)  # a killed run's partial checkpoint of the same step
    partial.mkdir()
    mark_work_dir(partial, "finetune")


def _finish(partial: Path, final: Path, progress, run_settings: dict[str, Any]) -> None:
    """Flush the saved files to the disk, write the state that marks the checkpoint complete, and rename it into
    place (over an earlier run's checkpoint of the same step)."""
    unmark_work_dir(partial)
    files = {}
    for path in sorted(partial.rglob("*")):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
            files[path.relative_to(partial).as_posix()] = path.stat().st_size
    write_json(partial / STATE_FILE, {"step": progress.step, "epoch": progress.epoch,
                                      "batches_in_epoch": progress.batches_in_epoch, "log": progress.log,
                                      "settings": run_settings, "files": files})
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(final.parent)
