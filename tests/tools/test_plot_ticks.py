"""The commands' log-scale plots label their ticks in plain numbers (38, 24), not "3.8 x 10^1" (issue 57, item 2):
read back from the figure objects the commands save."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from hf_posenc.tools import tables

PLAIN = re.compile(r"^\d+(\.\d+)?$")


def _labels(ax) -> list[str]:
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.get_yticklabels(which="both") if t.get_text()]


def _check_plain(labels: list[str]) -> None:
    assert len(labels) >= 3, labels  # a few labelled values, not one or none
    for label in labels:
        assert "times" not in label and "10^" not in label and PLAIN.match(label), labels


@pytest.mark.parametrize("rows", [
    {"smollm2": {256: 38.0, 512: 30.0, 1024: 24.0}},  # within one decade: was "3.8 x 10^1"-style labels
    {"smollm2": {256: 24.0, 512: 25.0}, "smollm2 + kerple": {256: 180.0, 512: 1900.0}},  # two decades
], ids=["narrow", "wide"])
def test_perplexity_plot_has_plain_tick_labels(rows):
    fig = tables.perplexity_figure([256, 512, 1024], {"text": (rows, {}), "other": (rows, {})})
    for ax in fig.axes:
        labels = _labels(ax)
        _check_plain(labels)
        low, high = ax.get_ylim()
        assert all(low <= float(label) <= high for label in labels)
    values = [v for row in rows.values() for v in row.values()]
    low, high = fig.axes[0].get_ylim()
    assert low <= min(values) and max(values) <= high  # every point still in view
    assert [t.get_text() for t in fig.axes[0].get_xticklabels(which="both") if t.get_text()] == ["256", "512",
                                                                                                 "1024"]


def test_demo_bar_plot_on_a_log_scale_has_plain_tick_labels():
    results = [SimpleNamespace(method=m, perplexity=p) for m, p in (("none", 24.0), ("alibi", 900.0), ("nope", 31.0))]
    fig = tables.demo_perplexity_figure(results, "demo")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    _check_plain(_labels(ax))


def test_a_view_narrower_than_the_round_values_still_gets_three_plain_labels():
    fig = tables.perplexity_figure([256, 512], {"text": ({"smollm2": {256: 15.2, 512: 16.5}}, {})})
    _check_plain(_labels(fig.axes[0]))


def test_main_job_writes_its_table_and_a_plot_with_plain_tick_labels(tmp_path, monkeypatch):
    """main_job.write_outputs (its csv, json and png) and the printed table, from two texts' runs; the plot's figure
    read back before it is saved."""
    import argparse
    import csv

    from hf_posenc.tools import eval_ppl, main_job

    def run_of(values: dict[str, tuple[float, float]]) -> eval_ppl.EvalRun:
        run = eval_ppl.EvalRun(settings={})
        for label, ppls in values.items():
            for length, ppl in zip((256, 512), ppls):
                run.results.append(eval_ppl.LengthResult("smollm2", label, length, ppl, 1.0, 10, 1, 1, length, 0.1,
                                                         label=label))
        return run

    runs = {"book": run_of({"smollm2": (38.0, 30.0), "smollm2 + kerple": (40.0, 24.0)}),
            "wiki": run_of({"smollm2": (16.5, 15.2), "smollm2 + kerple": (17.0, 16.0)})}
    figures = []
    drawn = tables.perplexity_figure
    monkeypatch.setattr(tables, "perplexity_figure", lambda *a, **k: figures.append(drawn(*a, **k)) or figures[-1])
    summary = dict.fromkeys(("first_loss", "final_loss", "loss_first_quarter", "loss_last_quarter", "steps_done",
                             "tokens_per_step", "posenc_config", "seconds", "data"))
    main_job.write_outputs(tmp_path, runs, argparse.Namespace(lengths=[256, 512]), summary, {"total": 1.0}, 2.0)
    assert (tmp_path / "main_job.png").is_file() and (tmp_path / "main_job.json").is_file()
    with open(tmp_path / "main_job.csv", newline="") as f:
        assert [row[:2] for row in csv.reader(f)][1:] == [["book", "smollm2"], ["book", "smollm2 + kerple"],
                                                          ["wiki", "smollm2"], ["wiki", "smollm2 + kerple"]]
    (fig,) = figures
    for ax in fig.axes:
        _check_plain(_labels(ax))
