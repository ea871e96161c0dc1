"""The output folder of every command (hf_posenc.tools.outputs.atomic_output_dir): never replaced wholesale; an earlier
output of the same command is recognised by its manifest and only what that manifest lists is replaced; a folder
holding anything else is refused unless --overwrite, and even then nothing we did not write is removed."""

from __future__ import annotations

import json
import os

import pytest
from tool_helpers import BOOK, DATA, assert_refused, launch, run_cli, save_tiny_model, snapshot

from hf_posenc.tools.outputs import MANIFEST, atomic_output_dir
from hf_posenc.tools.runtime import UsageError

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _write(folder, **files):
    for name, text in files.items():
        (folder / name).write_text(text)


def test_a_run_replaces_only_what_the_previous_run_of_its_command_listed(tmp_path):
    out = tmp_path / "out"
    with atomic_output_dir(out, "eval-ppl") as staging:
        _write(staging, a="1", b="1")
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["command"] == "eval-ppl" and manifest["entries"] == ["a", "b"]
    (out / "notes.txt").write_text("mine")
    with atomic_output_dir(out, "eval-ppl") as staging:  # our own earlier output: no overwrite needed
        _write(staging, a="2", c="2")
    assert sorted(os.listdir(out)) == sorted(["a", "c", MANIFEST, "notes.txt"])  # stale b gone, notes kept
    assert (out / "a").read_text() == "2" and (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / MANIFEST).read_text())["entries"] == ["a", "c"]

    before = snapshot(out)
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_output_dir(out, "eval-ppl") as staging:
            _write(staging, a="3")
            raise RuntimeError("killed")
    assert snapshot(out) == before and sorted(os.listdir(out)) == sorted(["a", "c", MANIFEST, "notes.txt"])


def test_refusals_and_overwrite(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("keep")
    with pytest.raises(UsageError, match="is a file, not a folder"):
        with atomic_output_dir(a_file, "passkey"):
            pass
    model_dir = tmp_path / "ft"
    with atomic_output_dir(model_dir, "finetune") as staging:
        _write(staging, **{"model.safetensors": "weights", "config.json": "{}"})
    before = snapshot(model_dir)
    # evaluating a fine-tuned model into its own folder: refused, the model untouched
    with pytest.raises(UsageError, match="holds the output of hf-posenc finetune; .* --overwrite"):
        with atomic_output_dir(model_dir, "eval-ppl"):
            pass
    assert snapshot(model_dir) == before
    # --overwrite writes beside the model; later runs of either command never remove the other's files
    with atomic_output_dir(model_dir, "eval-ppl", overwrite=True) as staging:
        _write(staging, **{"perplexity.csv": "1", "config.json": "replaced"})
    assert (model_dir / "model.safetensors").read_text() == "weights"
    assert (model_dir / "config.json").read_text() == "replaced"  # same name: replaced, as --overwrite says
    with atomic_output_dir(model_dir, "eval-ppl") as staging:  # config.json is the evaluation's own file now
        _write(staging, **{"perplexity.csv": "2"})
    assert sorted(os.listdir(model_dir)) == sorted(["model.safetensors", "perplexity.csv", MANIFEST])


def test_an_edited_manifest_cannot_reach_outside_the_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "outside.txt").write_text("keep")
    (out / MANIFEST).write_text(json.dumps({"written_by": "hf_posenc", "command": "passkey",
                                            "entries": ["..", ".", "../outside.txt", str(tmp_path), "x"]}))
    (out / "x").write_text("old")
    with atomic_output_dir(out, "passkey") as staging:
        _write(staging, y="new")
    assert (tmp_path / "outside.txt").read_text() == "keep"
    assert sorted(os.listdir(out)) == sorted([MANIFEST, "y"])


def _finetune(tiny):
    return ["--model", str(tiny), "--text-file", str(BOOK), "--max-length", "64", "--max-steps", "1", "--no-progress"]


def _eval_ppl(tiny):
    return ["--model", str(tiny), "--lengths", "32", "--text-file", str(BOOK), "--max-windows", "1", "--no-progress"]


def _passkey(tiny):
    return ["--model", str(tiny), "--lengths", "300", "--depths", "0", "--trials", "1", "--max-new-tokens", "2",
            "--no-progress"]


ARGUMENTS = {"finetune": _finetune, "eval-ppl": _eval_ppl, "passkey": _passkey,
             "main-job": lambda tiny: ["--quick", "--data-dir", str(DATA), "--no-progress"],
             "demo": lambda tiny: ["--quick", "--no-progress"]}


@pytest.mark.parametrize("command", ARGUMENTS)
def test_every_command_refuses_a_folder_it_did_not_write(command, tiny_dir, tmp_path, capsys, monkeypatch):
    """`--output-dir .` in a folder of other files (a home folder, a project): one line, exit 2, all of it kept.
    The check comes before any model is loaded (main-job and demo would load SmolLM2 otherwise)."""
    argv = ARGUMENTS[command]
    home = tmp_path / "home"
    (home / "other").mkdir(parents=True)
    _write(home, **{"notes.txt": "keep"})
    _write(home / "other", **{"x.txt": "keep"})
    before = snapshot(home)
    monkeypatch.chdir(home)
    monkeypatch.setenv("HOME", str(home))
    for output_dir in (".", str(home), "~"):
        assert_refused(run_cli(command, [*argv(tiny_dir), "--output-dir", output_dir]), capsys,
                       f"--output-dir {home} holds files that hf-posenc {command} did not write", home, before)
    assert_refused(run_cli(command, [*argv(tiny_dir), "--output-dir", "notes.txt"]), capsys, "is a file, not a folder",
                   home, before)


@pytest.mark.parametrize("command", ["finetune", "eval-ppl", "passkey"])
def test_overwrite_writes_beside_other_files_and_a_rerun_replaces_only_its_own(command, tiny_dir, tmp_path):
    argv = ARGUMENTS[command]
    runs = tmp_path / "runs"
    (runs / "other").mkdir(parents=True)
    _write(runs / "other", **{"x.txt": "keep"})
    assert run_cli(command, [*argv(tiny_dir), "--output-dir", str(runs), "--overwrite"]) == 0
    manifest = json.loads((runs / MANIFEST).read_text())
    assert manifest["command"] == command and "other" not in manifest["entries"]
    first = {name: (runs / name).stat().st_mtime_ns for name in manifest["entries"]}
    # our own output now: no --overwrite needed
    assert run_cli(command, [*argv(tiny_dir), "--output-dir", str(runs)]) == 0
    assert (runs / "other" / "x.txt").read_text() == "keep"
    assert json.loads((runs / MANIFEST).read_text())["entries"] == manifest["entries"]
    assert all((runs / name).stat().st_mtime_ns != first[name] for name in first)  # rewritten
    assert not [p for p in os.listdir(runs) if p.startswith(".")]  # no staging folder left behind


def test_two_processes_refuse_together(tiny_dir, tmp_path):
    """The main process decides and every process stops (none waits for a main process that has gone)."""
    out = tmp_path / "mine"
    out.mkdir()
    _write(out, **{"notes.txt": "keep"})
    done = launch("finetune", [*_finetune(tiny_dir), "--output-dir", str(out), "--threads", "1"],
                  timeout=240)
    assert done.returncode != 0  # torchrun then prints its own ChildFailedError summary
    assert done.stderr.count(f"error: --output-dir {out} holds files that hf-posenc finetune did not write") == 2
    assert not [line for line in done.stderr.splitlines() if line.lstrip().startswith("File ") and "hf_posenc" in line]
    assert snapshot(out) == {"notes.txt": b"keep"}


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_work(tiny_dir, tmp_path, capsys, monkeypatch):
    """A path under a file was "File exists" after the whole run, and a read-only folder failed at the end too (the
    model lost; issue 51, item 6): both are refused before the model loads, one line, exit 2. Read-only is made by
    a probe that fails as on a read-only file system (the tests run as root, whom chmod does not stop)."""
    import errno

    from hf_posenc.tools import finetune, outputs

    monkeypatch.setattr(finetune, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    (tmp_path / "notes.txt").write_text("keep")
    before = snapshot(tmp_path)
    under_a_file = tmp_path / "notes.txt" / "run"
    for option in ("--output-dir", "--checkpoint-dir"):
        argv = [*_finetune(tiny_dir), "--save-every", "1", "--output-dir", str(tmp_path / "out"), option,
                str(under_a_file)]
        assert_refused(run_cli("finetune", argv), capsys,
                       f"{option} {under_a_file} lies under {tmp_path / 'notes.txt'}, which is a file, not a folder",
                       tmp_path, before)
    real_mkstemp = outputs.tempfile.mkstemp

    def read_only(*args, prefix="", dir=None, **kwargs):
        if prefix.startswith(outputs.PARTIAL + "probe") and str(dir) == str(tmp_path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))
        return real_mkstemp(*args, prefix=prefix, dir=dir, **kwargs)

    monkeypatch.setattr(outputs.tempfile, "mkstemp", read_only)
    for command in ("finetune", "eval-ppl", "passkey"):
        assert_refused(run_cli(command, [*ARGUMENTS[command](tiny_dir), "--output-dir", str(tmp_path / "new")]),
                       capsys, f"--output-dir {tmp_path / 'new'} cannot be written (Read-only file system in {tmp_path})",
                       tmp_path, before)


KILLED_RUN = """
import os, sys
from pathlib import Path
from hf_posenc.tools.outputs import atomic_output_dir
with atomic_output_dir(sys.argv[1], "eval-ppl") as staging:
    (Path(staging) / "perplexity.csv").write_text("half")
    os.kill(os.getpid(), 9)
"""


def test_a_later_run_removes_the_leftovers_of_a_killed_run_and_nothing_else(tmp_path):
    """kill -9 during a run leaves its staging folder: beside --output-dir (``.NAME.tmp-*``) on a first run, inside it
    (``.hf_posenc-staging-*``) on a later one. The next run removes those, which our marker says a process that has
    gone made, and a half-written file of ours where our manifest is; a folder of the same pattern that is not
    marked, or is a live run's, and the user's files stay (issue 51, item 8)."""
    import socket
    import subprocess
    import sys

    out = tmp_path / "out"

    def killed_run():
        done = subprocess.run([sys.executable, "-c", KILLED_RUN, str(out)], capture_output=True, text=True)
        assert done.returncode == -9, done.stderr

    killed_run()
    beside = [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    assert len(beside) == 1
    with atomic_output_dir(out, "eval-ppl") as staging:
        _write(staging, **{"perplexity.csv": "1"})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")]
    killed_run()
    inside = [p for p in out.iterdir() if p.name.startswith(".hf_posenc-staging-")]
    assert len(inside) == 1 and (inside[0] / "perplexity.csv").read_text() == "half"
    (out / ".hf_posenc_output.json.hf_posenc-partial-x1y2").write_text("{\"writ")  # a kill while writing it
    # not ours to remove: an unmarked folder of the pattern, a live run's staging, the user's files
    (tmp_path / ".out.tmp-unmarked").mkdir()
    (tmp_path / ".out.tmp-unmarked" / "x").write_text("keep")
    live = out / ".hf_posenc-staging-live"
    live.mkdir()
    (live / ".hf_posenc-work.json").write_text(json.dumps({"written_by": "hf_posenc", "command": "eval-ppl",
                                                             "pid": os.getppid(), "host": socket.gethostname()}))
    (out / "notes.txt").write_text("mine")
    with atomic_output_dir(out, "eval-ppl") as staging:
        _write(staging, **{"perplexity.csv": "2"})
    assert sorted(os.listdir(out)) == sorted([".hf_posenc-staging-live", MANIFEST, "notes.txt", "perplexity.csv"])
    assert (out / "perplexity.csv").read_text() == "2" and (live / ".hf_posenc-work.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")] == [".out.tmp-unmarked"]
