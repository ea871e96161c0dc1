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
