"""The resumable checkpoints of ``hf-posenc finetune`` (``--save-every``, ``--resume-from``).

Each is written into a partial folder (``.hf_posenc-partial-step-N``) and renamed to ``step-N`` only once complete,
so a kill while saving leaves no ``step-N`` behind. Its ``trainer_state.json``, written last and atomically, lists the
size of every file in it: ``--resume-from latest`` takes the newest checkpoint that is complete, saying which ones it
skipped (one cut short by an older version, or damaged since), and a named one that is not complete is refused.
What is in it (model, optimizer, schedule, RNG states) is accelerate's ``save_state`` / ``load_state``; the naming,
the staging and the limit are ours (see ``save_checkpoint``). ``--resume-from`` is refused where the checkpoint was
saved with other settings (``RESUME_SETTINGS``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..outputs import PARTIAL, error_text, fsync_dir, mark_work_dir, unmark_work_dir, write_json
from ..runtime import MethodRequest, UsageError
from ..training_state import STATE_FILE, IncompleteCheckpoint, read_state

# What a resumed run must share with the run that saved the checkpoint: the model, what trains, the data, the schedule.
# (--method is compared as the method and options it resolves to, whichever way it was spelled.)
RESUME_SETTINGS = ("model", "dtype", "train_only", "lora_r", "lora_alpha", "lora_dropout", "text_file", "encoding",
                   "dataset", "dataset_config", "split", "text_column", "text_fraction", "start_text", "max_length",
                   "batch_size", "gradient_accumulation_steps", "eval_blocks", "seed", "max_steps", "lr",
                   "positional_lr", "weight_decay", "lr_scheduler", "warmup_steps", "pose_target_length",
                   "pose_chunks", "document_restarts", "distill_from", "distill_temperature", "distill_alpha",
                   "transfer_steps", "fit_bias_steps", "fit_bias_blocks", "fit_bias_lr", "fit_bias_length",
                   "fit_bias_queries", "teacher_samples", "teacher_sample_temperature",
                   "teacher_sample_top_k", "teacher_sample_batch")


@dataclass
class Progress:
    """Where training stands; saved with every resumable checkpoint."""
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # batches of the current epoch already trained (skipped when resuming)
    log: list[dict] = field(default_factory=list)


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
    # Staging, naming and `limit` are ours, not ProjectConfiguration(total_limit=...): accelerate 1.16 saves
    # checkpoint_N in place and removes the oldest before the new one is written, and its load_state() takes the
    # highest number unchecked, so a kill or a full disk mid-save would leave an incomplete newest and one fewer.
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


def resume_settings(args: argparse.Namespace, request: MethodRequest | None) -> dict[str, Any]:
    """The settings a resumed run must share with the one that saved the checkpoint (RESUME_SETTINGS), as JSON."""
    settings = {name: getattr(args, name) for name in RESUME_SETTINGS}
    settings["method"] = None if request is None else request.settings()  # every option, defaults included
    return json.loads(json.dumps(settings, default=str))


def resume_point(args: argparse.Namespace, checkpoint_dir: Path, run_settings: dict[str, Any],
                 verbose: bool = True) -> Path | None:
    """The checkpoint ``--resume-from`` names (a folder, or ``latest`` in ``checkpoint_dir``: the newest complete
    one), or None; refused when it is not complete, or was saved with other settings (another --method would fail
    on loading, another --max-length would go on silently with other data)."""
    if not args.resume_from:
        return None
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if verbose else None
    resume = latest_checkpoint(checkpoint_dir, say) if args.resume_from == "latest" else Path(args.resume_from)
    if resume is None or not (resume / STATE_FILE).is_file():
        raise UsageError(f"--resume-from {args.resume_from}: no checkpoint there "
                         f"(looked for {STATE_FILE} in {resume or checkpoint_dir})")
    try:
        saved = read_state(resume).get("settings")
    except IncompleteCheckpoint as why:
        raise UsageError(f"--resume-from {resume} is not a complete checkpoint ({why}); resume from an earlier one, "
                         "or pass --resume-from latest to take the newest complete one") from None
    if saved is None:
        return resume  # written before the settings were recorded
    differ = [name for name in run_settings if saved.get(name) != run_settings[name]]
    if differ:
        shown = "; ".join(f"{_resume_option(name)} {_shown(saved.get(name))} there, {_shown(run_settings[name])} now"
                          for name in differ)
        raise UsageError(f"--resume-from {resume} was saved with other settings ({shown}); resume with the settings "
                         "it was saved with, or start a new run without --resume-from")
    return resume


def _resume_option(name: str) -> str:
    return "--method" if name == "method" else "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, dict) and "method" in value:  # a method's config
        options = {key: option for key, option in value.items() if key != "method"}
        return value["method"] + (f" {json.dumps(options)}" if options else "")
    return "unset" if value is None else str(value)


def resume_progress(accelerator, resume: Path | None) -> Progress:
    if resume is None:
        return Progress()
    accelerator.load_state(str(resume))
    state = read_state(resume)
    if accelerator.is_main_process:
        print(f"resumed from {resume} at step {state['step']}", flush=True)
    return Progress(state["step"], state["epoch"], state["batches_in_epoch"], state["log"])
