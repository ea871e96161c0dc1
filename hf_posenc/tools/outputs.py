"""Output folders: every command writes a run into a staging folder and moves it into ``--output-dir`` only when the
run succeeds, listing what it wrote in a manifest there; it never removes anything it did not write."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from .runtime import UsageError

MANIFEST = "hf_posenc_output.json"  # marks a folder as our output and lists what we wrote there
_STAGING = ".hf_posenc-staging-"
_REPLACED = ".hf_posenc-replaced-"
OVERWRITE_HELP = ("write into an --output-dir that holds other files (not an earlier output of this command): "
                  "same-named files are replaced, nothing else in it is removed")


def output_path(path: str | os.PathLike) -> Path:
    """``path`` absolute and normalised ('.' is the current folder, '~' expanded); symbolic links are kept."""
    return Path(os.path.abspath(os.path.expanduser(path)))


def read_manifest(folder: Path) -> dict | None:
    """The manifest an earlier run of ours left in ``folder`` ({"command": ..., "entries": [...], ...}), or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not (isinstance(manifest, dict) and manifest.get("written_by") == "hf_posenc"
            and isinstance(manifest.get("entries"), list)):
        return None
    # Plain names only: an edited manifest must never make us remove anything outside the folder.
    manifest["entries"] = [name for name in manifest["entries"] if isinstance(name, str)
                           and name not in ("", ".", "..", MANIFEST) and "/" not in name and os.sep not in name]
    return manifest


def our_entries(folder: Path, command: str) -> list[str] | None:
    """The entries an earlier run of ``command`` wrote in ``folder``, or None when it holds no output of it."""
    manifest = read_manifest(folder)
    return manifest["entries"] if manifest is not None and manifest.get("command") == command else None


def check_output_dir(output_dir: str | os.PathLike, command: str, overwrite: bool = False) -> None:
    """Refuse, before any work, an ``--output-dir`` that is a file, or a folder that holds files and is not an
    earlier output of ``command`` (unless ``overwrite``). Evaluating a fine-tuned model into its own folder, for
    example, is refused: the evaluation would otherwise be mixed into the model's folder."""
    folder = output_path(output_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output-dir {folder} is a file, not a folder; choose another --output-dir")
    if overwrite or not folder.is_dir() or our_entries(folder, command) is not None:
        return
    foreign = sorted(p.name for p in folder.iterdir() if not p.name.startswith(_STAGING))
    if not foreign:
        return
    manifest = read_manifest(folder)
    listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    holds = (f"the output of hf-posenc {manifest.get('command')}" if manifest is not None
             else f"files that hf-posenc {command} did not write ({listed})")
    raise UsageError(f"--output-dir {folder} holds {holds}; choose a new or empty folder, or pass --overwrite to write "
                     "into it (same-named files are replaced, nothing else is removed)")


def check_output_dir_on_main(accelerator, output_dir: str | os.PathLike, command: str,
                             overwrite: bool = False) -> None:
    """``check_output_dir`` decided by the main process (the one that writes) and raised on every process, so
    that all of them stop together instead of the others waiting for a main process that has gone."""
    refusal = None
    if accelerator is None or accelerator.is_main_process:
        try:
            check_output_dir(output_dir, command, overwrite)
        except (UsageError, OSError) as error:  # OSError: e.g. a folder we may not read
            refusal = str(error)
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        refusal = broadcast_object_list([refusal])[0]
    if refusal:
        raise UsageError(refusal)


@contextlib.contextmanager
def atomic_output_dir(output_dir: str | os.PathLike, command: str, overwrite: bool = False, enabled: bool = True,
                      checked: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder to write a run of ``command`` into. On success its entries move into
    ``output_dir`` and are listed in the folder's manifest (``hf_posenc_output.json``); they replace the entries
    that the previous run of the same command listed there, and nothing else in the folder is touched (other runs,
    a --checkpoint-dir inside it, the user's files). On failure the staging folder is removed and ``output_dir``
    stays as it was, so it never holds a half-written run. A folder that is not empty and not an output of
    ``command`` is refused unless ``overwrite`` (``checked``: the caller ran ``check_output_dir`` before a run that
    may have put its own things there since, such as checkpoints). ``enabled=False`` (the processes other than the
    main one) writes nowhere and yields ``output_dir``."""
    final = output_path(output_dir)
    if not enabled:
        yield final
        return
    if not checked:
        check_output_dir(final, command, overwrite)
    if final.is_dir():  # staged inside it: the same file system, so entries move by rename
        staging = Path(tempfile.mkdtemp(prefix=_STAGING, dir=final))
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    staging.chmod(0o755)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        _move_into_place(staging, final, command, overwrite)
    except OSError as error:
        raise UsageError(f"could not move the run into --output-dir {final} ({error}); its files are in "
                         f"{staging}") from None


def _move_into_place(staging: Path, final: Path, command: str, overwrite: bool) -> None:
    entries = sorted(p.name for p in staging.iterdir())
    if not final.exists():  # the usual first run: one rename publishes the whole folder
        _write_manifest(staging, command, entries)
        os.replace(staging, final)
        return
    previous = our_entries(final, command) or []
    clashes = [name for name in entries if os.path.lexists(final / name) and name not in previous]
    if clashes and not overwrite:
        raise UsageError(f"--output-dir {final}: {', '.join(clashes[:3])} appeared there during the run and was not "
                         f"written by it; the run's files are in {staging} (move them, or run with --overwrite)")
    # Listed first: whatever an interruption leaves, every entry of ours stays listed and the folder stays ours.
    _write_manifest(final, command, sorted(set(previous) | set(entries)))
    replaced = Path(tempfile.mkdtemp(prefix=_REPLACED, dir=final))
    for name in set(previous) | set(entries):
        if os.path.lexists(final / name):
            os.replace(final / name, replaced / name)
    for name in entries:
        os.replace(staging / name, final / name)
    _write_manifest(final, command, entries)
    shutil.rmtree(replaced, ignore_errors=True)
    staging.rmdir()


def _write_manifest(folder: Path, command: str, entries: list[str]) -> None:
    from hf_posenc import __version__

    manifest = {"written_by": "hf_posenc", "command": command, "version": __version__,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "entries": entries}
    partial = folder / f".{MANIFEST}.partial"
    write_json(partial, manifest)
    os.replace(partial, folder / MANIFEST)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n", encoding="utf-8")


def _json_default(obj: Any) -> Any:
    import torch

    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return repr(obj)
