"""Progress in a saved log (stdout and stderr not a terminal): plain lines, no carriage-return redraws, one bar per
stage at a sane rate (issue 57: every evaluation window drew and cleared its own bar, hundreds of half-lines)."""

from __future__ import annotations

import io
import re

import pytest

from hf_posenc.tools.progress import LOG_INTERVAL_SECONDS, progress
from tool_helpers import BOOK, run_cli, save_tiny_model

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _progress_lines(text: str, desc: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(f"{desc}: ")]


def test_a_pipe_gets_a_line_per_interval_not_a_redraw_per_update():
    """1,000 updates over 100 simulated seconds: the first line, one per 30 s and the last; never a "\\r"."""
    now = [0.0]
    out = io.StringIO()
    bar = progress(total=1000, desc="stage", unit="win", file=out, clock=lambda: now[0])
    for _ in range(1000):
        now[0] += 0.1
        bar.update(1)
    bar.close()
    bar.close()  # a second close adds nothing
    text = out.getvalue()
    assert "\r" not in text
    lines = _progress_lines(text, "stage")
    assert len(lines) == 2 + int(100 / LOG_INTERVAL_SECONDS)
    assert lines[0] == "stage: 0/1000 win, 0 s" and lines[-1] == "stage: 1000/1000 win, 100 s"


def test_eval_ppl_to_a_log_has_one_bar_per_model_across_its_lengths(tiny_dir, tmp_path, capfd):
    argv = ["--model", str(tiny_dir), "--method", "none", "--method", "alibi", "--lengths", "16,32,64",
            "--max-windows", "3", "--text-file", str(BOOK), "--output-dir", str(tmp_path / "out")]
    assert run_cli("eval-ppl", argv) == 0
    captured = capfd.readouterr()
    log = captured.out + captured.err
    assert "\r" not in log
    for label in ("tiny-llama", "tiny-llama + alibi"):  # 9 windows each: its start and its end, not a bar a length
        assert _progress_lines(captured.err, label) == [f"{label}: 0/9 win, 0 s", f"{label}: 9/9 win, 0 s"]
    assert len(re.findall(r"tokens: ppl", captured.out)) == 6  # the lines that matter, each whole


def test_finetune_to_a_log_has_no_redraws(tiny_dir, tmp_path, capfd):
    argv = ["--model", str(tiny_dir), "--method", "alibi", "--text-file", str(BOOK), "--max-length", "64",
            "--max-steps", "5", "--output-dir", str(tmp_path / "ft")]
    assert run_cli("finetune", argv) == 0
    captured = capfd.readouterr()
    assert "\r" not in captured.out + captured.err
    lines = _progress_lines(captured.err, "finetune")
    assert lines[0].startswith("finetune: 0/5 step") and lines[-1].startswith("finetune: 5/5 step")
    assert len(lines) <= 3  # the start, the end, and at most one line per 30 s of a run of seconds
