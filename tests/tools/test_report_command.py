"""hf-posenc report: runs of several commands in one Markdown page, with their plots, that a model card takes."""

from __future__ import annotations

import json

import pytest
from tool_helpers import BOOK, run_cli, save_tiny_model

import hf_posenc
from hf_posenc.tools import report

pytestmark = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    model = save_tiny_model(root / "tiny")
    common = ["--model", str(model), "--method", "none", "--method", "alibi", "--no-progress"]
    assert run_cli("eval-ppl", [*common, "--lengths", "32,64", "--text-file", str(BOOK), "--max-windows", "2",
                                "--output-dir", str(root / "ppl")]) == 0
    assert run_cli("passkey", [*common, "--lengths", "300", "--depths", "0,1", "--trials", "1", "--max-new-tokens",
                               "2", "--output-dir", str(root / "pk")]) == 0
    assert run_cli("niah", [*common, "--lengths", "500", "--depths", "0.5", "--trials", "1", "--max-new-tokens", "2",
                            "--haystack-file", str(BOOK), "--output-dir", str(root / "niah")]) == 0
    return root


def test_report_has_every_run_its_table_and_its_plot(runs, tmp_path):
    out = tmp_path / "report"
    assert run_cli("report", [str(runs / "ppl"), str(runs / "pk"), str(runs / "niah"), "--output-dir", str(out),
                              "--title", "tiny"]) == 0
    page = (out / "report.md").read_text()
    assert page.startswith("# tiny\n")
    for title, plot in (("Perplexity vs context length (ppl)", "ppl-perplexity.png"),
                        ("Passkey retrieval (pk)", "pk-passkey.png"), ("Needle in a haystack (niah)", "niah-niah.png")):
        assert f"## {title}" in page and f"]({plot})" in page
        assert (out / plot).read_bytes() == (runs / title.split("(")[1][:-1] / plot.split("-", 1)[1]).read_bytes()
    assert "| tiny | 32 | 64 |" not in page and "| model | 32 | 64 |" in page and "| tiny + alibi |" in page
    assert "| model | length | depth 0 | depth 1 |" in page and "| tiny + alibi | 300 |" in page
    assert "| model | length | depth 0.5 |" in page
    assert "`hf-posenc passkey`: model:" in page and "trials: 1" in page


def test_several_runs_of_a_command_are_compared_in_one_table_and_plot(runs, tmp_path):
    """Two passkey runs and two niah runs: a section with every model of both, '-' where no run measured a cell. The
    second niah run measures 'tiny' at another length: the same row. The second passkey run measures a cell of
    'tiny' again: its rows are told apart by the run's name."""
    extra = ["--model", str(runs / "tiny"), "--method", "none", "--trials", "1", "--max-new-tokens", "2",
             "--no-progress"]
    assert run_cli("passkey", [*extra, "--lengths", "300,400", "--depths", "0", "--output-dir",
                               str(tmp_path / "pk2")]) == 0
    assert run_cli("niah", [*extra, "--lengths", "600", "--depths", "0.5", "--haystack-file", str(BOOK),
                            "--output-dir", str(tmp_path / "niah2")]) == 0
    out = tmp_path / "report"
    assert run_cli("report", [str(runs / "pk"), str(tmp_path / "pk2"), str(runs / "niah"), str(tmp_path / "niah2"),
                              "--output-dir", str(out)]) == 0
    page = (out / "report.md").read_text()
    combined = page.split("## Passkey retrieval: every run (pk, pk2)")[1].split("## ")[0]
    pk = {r["model"]: r for r in json.loads((runs / "pk" / "passkey.json").read_text())["accuracy"]
          if r["length"] == 300 and r["depth"] == 0}
    assert f"| tiny | 300 | {pk['tiny']['accuracy']:.0%} |" in combined and "| tiny + alibi | 300 |" in combined
    assert "| tiny (pk2) | 300 | " in combined and "| tiny (pk2) | 400 | " in combined
    assert "| tiny | 400 |" not in combined and "| model | length | depth 0 | depth 1 |" in combined
    assert "| tiny + alibi | 400 |" not in combined and "](combined-passkey.png)" in combined
    assert "| tiny (pk2) | 300 | " + ("100%" if json.loads((tmp_path / "pk2" / "passkey.json").read_text())[
        "accuracy"][0]["accuracy"] else "0%") + " | - |" in combined  # depth 1 not measured by pk2
    combined = page.split("## Needle in a haystack: every run (niah, niah2)")[1]
    assert "| tiny | 600 | " in combined and "| tiny | 500 | " in combined and "(niah2)" not in combined
    assert "| tiny + alibi | 600 |" not in combined and "| tiny + alibi | 500 |" in combined
    for plot in ("combined-passkey.png", "combined-niah.png"):
        assert (out / plot).stat().st_size > 1000


def test_a_model_card_takes_the_report(runs, tmp_path):
    out = tmp_path / "report"
    assert run_cli("report", [str(runs / "pk"), "--output-dir", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    model = hf_posenc.patch_model(AutoModelForCausalLM.from_pretrained(runs / "tiny"), "alibi")
    card = str(hf_posenc.make_model_card(model, evaluation=out / "report.md"))
    assert "## Evaluation" in card and "### Evaluation" in card and "#### Passkey retrieval (pk)" in card
    assert "| tiny + alibi | 300 |" in card
    # published with the card, the report's plots go into the uploaded folder (the card shows them by file name)
    model.save_pretrained(tmp_path / "ckpt")
    files = hf_posenc.push_to_hub(tmp_path / "ckpt", "acme/tiny-alibi", dry_run=tmp_path / "upload",
                                  evaluation=out / "report.md")
    assert "pk-passkey.png" in files and "](pk-passkey.png)" in (tmp_path / "upload" / "README.md").read_text()


def test_bad_input_is_one_line(runs, tmp_path, capsys):
    out = tmp_path / "report"
    (tmp_path / "foreign").mkdir()
    for argv, message in (([str(tmp_path / "nowhere")], "is not a folder"),
                          ([str(tmp_path / "foreign")], "is not the output of an hf-posenc run"),
                          ([str(runs / "pk"), str(runs / "tiny")], "is not the output of an hf-posenc run")):
        assert run_cli("report", [*argv, "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err
        assert message in err.rstrip().splitlines()[-1] and "Traceback" not in err, err
        assert not out.exists()
    (runs / "pk" / "passkey.json").rename(runs / "pk" / "moved.json")
    try:
        assert run_cli("report", [str(runs / "pk"), "--output-dir", str(out)]) == 2
        assert "passkey.json cannot be read" in capsys.readouterr().err
    finally:
        (runs / "pk" / "moved.json").rename(runs / "pk" / "passkey.json")
    assert report.read_run(runs / "pk")[0] == "passkey"
