"""Output folders: every command writes a run into a staging folder and moves it into ``--output-dir`` only when the
run succeeds, listing what it wrote in a manifest there; it never removes anything it did not write. Staging folders
carry a marker (who made them, from which process), so that a later run removes those a killed run left behind."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from .runtime import UsageError

MANIFEST = "hf_posenc_output.json"  # marks a folder as our output and lists what we wrote there
_STAGING = ".hf_posenc-staging-"
_REPLACED = ".hf_posenc-replaced-"
_BESIDE = ".{name}.tmp-"  # a staging folder beside --output-dir, when that does not exist yet
_WORK_MARKER = ".hf_posenc-work.json"  # in every folder of ours that is work in progress (staging, replaced)
PARTIAL = ".hf_posenc-partial-"  # the temporary names of files and checkpoints being written
OVERWRITE_HELP = ("write into an --output-dir that holds other files (not an earlier output of this command): "
                  "same-named files are replaced, nothing else in it is removed")


CHECKPOINTS_SUFFIX = "-checkpoints"  # finetune's resumable checkpoints: <output-dir>-checkpoints by default


def beside(output_dir: Path, suffix: str) -> Path:
    """The folder named `output_dir` + `suffix` beside it (finetune's default checkpoint and log folders)."""
    return output_dir.with_name(output_dir.name + suffix) if output_dir.name else output_dir / suffix.lstrip("-")


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
    check_writable(folder, "--output-dir")
    if overwrite or not folder.is_dir() or our_entries(folder, command) is not None:
        remove_leftovers(folder)
        return
    foreign = sorted(p.name for p in folder.iterdir() if not _is_work_name(p.name))
    if not foreign:
        remove_leftovers(folder)
        return
    manifest = read_manifest(folder)
    listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    holds = (f"the output of hf-posenc {manifest.get('command')}" if manifest is not None
             else f"files that hf-posenc {command} did not write ({listed})")
    raise UsageError(f"--output-dir {folder} holds {holds}; choose a new or empty folder, or pass --overwrite to write "
                     "into it (same-named files are replaced, nothing else is removed)")


def check_writable(folder: Path, option: str) -> None:
    """Refuse, before any work, a ``folder`` that cannot be made and written (read-only, under a file, not ours to
    write): a probe file in it, or in its nearest existing parent, where the run's staging folder will go."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{option} {folder} lies under {existing}, which is a file, not a folder; choose another "
                         f"{option}")
    try:
        handle, probe = tempfile.mkstemp(prefix=f"{PARTIAL}probe-", dir=existing)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise UsageError(f"{option} {folder} cannot be written ({error.strerror or error} in {existing}); make it "
                         f"writable or choose another {option}") from None


def check_output_dir_on_main(accelerator, output_dir: str | os.PathLike, command: str,
                             overwrite: bool = False, also_writable: dict[str, Path] | None = None) -> None:
    """``check_output_dir`` decided by the main process (the one that writes) and raised on every process, so
    that all of them stop together instead of the others waiting for a main process that has gone.
    ``also_writable``: other folders the run will write ({option: folder}), checked with it."""
    refusal = None
    if accelerator is None or accelerator.is_main_process:
        try:
            check_output_dir(output_dir, command, overwrite)
            for option, folder in (also_writable or {}).items():
                check_writable(output_path(folder), option)
        except (UsageError, OSError) as error:  # OSError: e.g. a folder we may not read
            refusal = str(error)
    raise_on_every_process(accelerator, refusal)


def raise_on_every_process(accelerator, failure: str | None) -> None:
    """Raise ``failure`` (decided by the main process; None: none) as a UsageError on every process."""
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        failure = broadcast_object_list([failure])[0]
    if failure:
        raise UsageError(failure)


# --- left-overs of a killed run -------------------------------------------------------------------------------
def _is_work_name(name: str) -> bool:
    return name.startswith((_STAGING, _REPLACED)) or PARTIAL in name


def make_work_dir(parent: Path, prefix: str, command: str) -> Path:
    """A new folder in ``parent`` for work in progress, marked as ours and as this process's."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    folder.chmod(0o755)
    mark_work_dir(folder, command)
    return folder


def mark_work_dir(folder: Path, command: str) -> None:
    write_json(folder / _WORK_MARKER, {"written_by": "hf_posenc", "command": command, "pid": os.getpid(),
                                       "host": socket.gethostname()})


def unmark_work_dir(folder: Path) -> None:
    (folder / _WORK_MARKER).unlink(missing_ok=True)


def _abandoned(folder: Path) -> bool:
    """Whether ``folder`` is work in progress of ours whose process has gone (killed): its marker names a process of
    this machine that no longer runs. One of another machine, or of a live run, is left alone."""
    try:
        marker = json.loads((folder / _WORK_MARKER).read_text(encoding="utf-8"))
        ours = marker.get("written_by") == "hf_posenc" and marker.get("host") == socket.gethostname()
        pid = int(marker["pid"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if not ours or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except OSError:  # it exists, under another user
        pass
    return False


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove what killed runs of ours left in and beside ``folder``: staging and replaced folders marked as ours by
    a process that has gone (``.hf_posenc-staging-*`` inside, ``.NAME.tmp-*`` beside), and half-written files of ours
    where the folder's manifest says we wrote. Returns what was removed; nothing else is touched."""
    beside = _BESIDE.format(name=folder.name)
    candidates = [p for p in folder.parent.iterdir() if p.name.startswith(beside)] if folder.parent.is_dir() else []
    stale_files = []
    if folder.is_dir():
        candidates += [p for p in folder.iterdir() if _is_work_name(p.name)]
        if read_manifest(folder) is not None:
            stale_files = [p for p in candidates if p.is_file() and PARTIAL in p.name]
    removed = stale_files + [p for p in candidates if p.is_dir() and _abandoned(p)]
    for path in removed:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return removed


@contextlib.contextmanager
def atomic_output_dir(output_dir: str | os.PathLike, command: str, overwrite: bool = False, enabled: bool = True,
                      checked: bool = False) -> Iterator[Path]:
    """Yield a new staging folder (empty but for the hidden marker that makes it ours) to write a run of
    ``command`` into. On success its entries move into
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
        staging = make_work_dir(final, _STAGING, command)
    else:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = make_work_dir(final.parent, _BESIDE.format(name=final.name), command)
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
    entries = sorted(p.name for p in staging.iterdir() if p.name != _WORK_MARKER)
    if not final.exists():  # the usual first run: one rename publishes the whole folder
        _write_manifest(staging, command, entries)
        unmark_work_dir(staging)
        os.replace(staging, final)
        return
    previous = our_entries(final, command) or []
    clashes = [name for name in entries if os.path.lexists(final / name) and name not in previous]
    if clashes and not overwrite:
        raise UsageError(f"--output-dir {final}: {', '.join(clashes[:3])} appeared there during the run and was not "
                         f"written by it; the run's files are in {staging} (move them, or run with --overwrite)")
    # Listed first: whatever an interruption leaves, every entry of ours stays listed and the folder stays ours.
    _write_manifest(final, command, sorted(set(previous) | set(entries)))
    replaced = make_work_dir(final, _REPLACED, command)
    for name in set(previous) | set(entries):
        if os.path.lexists(final / name):
            os.replace(final / name, replaced / name)
    for name in entries:
        os.replace(staging / name, final / name)
    _write_manifest(final, command, entries)
    shutil.rmtree(replaced, ignore_errors=True)
    unmark_work_dir(staging)
    staging.rmdir()


def _write_manifest(folder: Path, command: str, entries: list[str]) -> None:
    from hf_posenc import __version__

    manifest = {"written_by": "hf_posenc", "command": command, "version": __version__,
                "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "entries": entries}
    write_json(folder / MANIFEST, manifest)


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON in ``path``, atomically: a reader (a resumed run, a kill during the write) sees the old file
    or the whole new one, never a truncated one."""
    write_text_atomic(path, json.dumps(data, indent=2, default=_json_default) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, flush it to the disk, and rename it over ``path``."""
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}{PARTIAL}", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(partial, 0o644)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the system allows opening a folder)."""
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)


# --- a finished run's files -----------------------------------------------------------------------------------
def write_or_rescue(output_dir: str | os.PathLike, command: str, overwrite: bool, write: Callable[[Path], None],
                    what: str, if_lost: str = "") -> str | None:
    """Write a finished run into ``output_dir`` (checked before the run) with ``write(folder)``; when the write
    fails (a full disk, a folder gone read-only), write it again into a new folder under the temporary folder
    ($TMPDIR), so that hours of training are not lost. Returns None, or the one line that says what failed and where
    ``what`` (e.g. "the trained model") is instead; ``if_lost`` is added when the second write fails too."""
    final = output_path(output_dir)
    try:
        with atomic_output_dir(final, command, overwrite, checked=True) as out:
            write(out)
        return None
    except ValueError as error:  # a refusal (ours, a library's): no disk problem, so no copy; the caller passes it on
        return str(error)
    except Exception as error:  # OSError, SafetensorError, torch's "[enforce fail at inline_container.cc]" ...
        reason = error_text(error)
    rescue = None
    try:
        rescue = Path(tempfile.mkdtemp(prefix=f"hf_posenc-{command}-rescued-"))
        write(rescue)
    except Exception as error:
        if rescue is not None:
            shutil.rmtree(rescue, ignore_errors=True)
        return (f"could not write --output-dir {final} ({reason}), nor a copy in {tempfile.gettempdir()} "
                f"({error_text(error)}); {if_lost or what + ' is lost'}")
    return (f"could not write --output-dir {final} ({reason}); {what} is in {rescue} instead (move it where you "
            "want it; set TMPDIR to choose where such a copy goes)")


def error_text(error: BaseException, limit: int = 300) -> str:
    """What went wrong, in one line: "No space left on device: PATH", or the error's type and first line."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f": {error.filename}" if error.filename else "")
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__


def _json_default(obj: Any) -> Any:
    import torch

    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.dtype):
        return str(obj).replace("torch.", "")
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return repr(obj)
