"""``hf-posenc report``: the results of several runs in one Markdown page with tables and plots, the thing users paste
into a model card.

    hf-posenc report runs/eval-ppl runs/passkey runs/niah runs/lm-eval --output-dir runs/report
    hf-posenc publish CHECKPOINT --repo-id me/model --evaluation runs/report/report.md   # (or make_model_card)

Each RUN_DIR is the ``--output-dir`` of an ``eval-ppl``, ``main-job``, ``passkey``, ``niah`` or ``lm-eval`` run (the
command is read from the folder's ``hf_posenc_output.json``). The page has a section per run: what was run (model,
methods, the main settings), its table and its plot. ``--output-dir`` receives ``report.md`` and the plots beside it
(``<run>-<plot>.png``), so the folder can be uploaded as it is. Several runs of ``passkey``, ``niah`` or ``lm-eval``
(say the original model, an extension and a fine-tuned swap, run apart) also get one section comparing every model of
them in one table and one plot (``combined-<plot>.png``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import tables
from .outputs import MANIFEST, OVERWRITE_HELP, atomic_output_dir, check_output_dir, read_manifest
from .runtime import UsageError

# What each command leaves in its output folder: its JSON results and its plot.
RESULT_FILES = {"eval-ppl": ("perplexity.json", "perplexity.png"), "main-job": ("main_job.json", "main_job.png"),
                "passkey": ("passkey.json", "passkey.png"), "niah": ("niah.json", "niah.png"),
                "lm-eval": ("lm_eval.json", "lm_eval.png")}
SETTINGS_SHOWN = ("model", "method", "lengths", "depths", "trials", "keys", "key_digits", "needles", "distractors",
                  "tasks", "limit", "num_fewshot", "max_windows", "stride", "text_file", "swap", "extension",
                  "train_steps", "train_length", "num_processes")


def read_run(folder: Path) -> tuple[str, dict]:
    """The command that wrote ``folder`` and its JSON results; a clear error for anything else."""
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder; give the --output-dir folders of earlier runs")
    manifest = read_manifest(folder)
    if manifest is None:
        raise UsageError(f"{folder} holds no {MANIFEST}: it is not the output of an hf-posenc run")
    command = manifest.get("command")
    if command not in RESULT_FILES:
        raise UsageError(f"{folder} is the output of {command!r}, which has no results to report; give runs of "
                         f"{', '.join(RESULT_FILES)}")
    results = folder / RESULT_FILES[command][0]
    try:
        return command, json.loads(results.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{results} cannot be read ({exc}); run the command again") from None


def _settings_line(settings: dict) -> str:
    shown = {k: settings[k] for k in SETTINGS_SHOWN if settings.get(k) not in (None, [], "")}
    return "; ".join(f"{k.replace('_', '-')}: {v if not isinstance(v, list) else ', '.join(map(str, v))}"
                     for k, v in shown.items())


def run_section(command: str, data: dict) -> str:
    """The Markdown table of one run's results."""
    settings = data.get("settings", {})
    if command == "eval-ppl":
        return _perplexity_markdown(data["table"])
    if command == "main-job":
        return "\n\n".join(f"Perplexity on {text}:\n\n" + _perplexity_markdown(run["table"])
                            for text, run in data["perplexity"].items())
    if command == "passkey":
        table = {(r["model"], r["length"], r["depth"]): (r["accuracy"], r["trials"]) for r in data["accuracy"]}
        return tables.passkey_markdown(table, settings["lengths"], settings["depths"])
    if command == "niah":
        table = {(r["model"], r["length"], r["depth"]): r for r in data["scores"]}
        return ("Exact-match accuracy (mean log-probability per answer token):\n\n"
                + tables.retrieval_markdown(table, settings["lengths"], settings["depths"]))
    return tables.metric_markdown(data["rows"])  # lm-eval


def _perplexity_markdown(table: dict) -> str:
    """The table of an eval-ppl JSON (row label -> length as text -> perplexity)."""
    lengths = sorted({int(n) for row in table.values() for n in row})
    return tables.perplexity_markdown({label: {int(n): v for n, v in row.items()} for label, row in table.items()},
                                      lengths)


TITLES = {"eval-ppl": "Perplexity vs context length", "main-job": "Main job: perplexity vs context length",
          "passkey": "Passkey retrieval", "niah": "Needle in a haystack", "lm-eval": "Short-context tasks (lm-eval)"}


def _numbers(values) -> list:
    return sorted({float(v) if not float(v).is_integer() else int(v) for v in values})


def combined_section(command: str, runs: list[tuple[str, dict]], output: Path) -> str:
    """One table and one plot of every model in several runs of the same command (passkey, niah or lm-eval), over
    the union of their lengths and depths ("-" where no run measured a cell). Runs of one model at other lengths (or
    tasks) share its row; a row whose cells another run measured too gets the run's name."""
    key = {"passkey": "accuracy", "niah": "scores", "lm-eval": "rows"}[command]
    cell = (lambda r: (r["task"], r["metric"])) if command == "lm-eval" else (lambda r: (r["length"], r["depth"]))
    measured: dict[str, set] = {}  # row label -> cells of the runs seen so far
    rows = []
    for name, data in runs:
        mine: dict[str, set] = {}
        for r in data[key]:
            mine.setdefault(r["model"], set()).add(cell(r))
        renamed = {label: f"{label} ({name})" if cells & measured.get(label, set()) else label
                   for label, cells in mine.items()}
        for label, cells in mine.items():
            measured.setdefault(renamed[label], set()).update(cells)
        rows += [{**r, "model": renamed[r["model"]]} for r in data[key]]
    if command == "lm-eval":
        tables.metric_bars(output / "combined-lm_eval.png", rows)
        return tables.metric_markdown(rows) + "\n\n![lm-eval, every run](combined-lm_eval.png)"
    lengths = _numbers(r["length"] for r in rows)
    depths = _numbers(r["depth"] for r in rows)
    if command == "passkey":
        table = {(r["model"], r["length"], r["depth"]): (r["accuracy"], r["trials"]) for r in rows}
        tables.passkey_heatmap(output / "combined-passkey.png", table, lengths, depths)
        return tables.passkey_markdown(table, lengths, depths) + "\n\n![passkey, every run](combined-passkey.png)"
    table = {(r["model"], r["length"], r["depth"]): r for r in rows}
    tables.retrieval_heatmaps(output / "combined-niah.png", table, lengths, depths, "needle depth")
    return ("Exact-match accuracy (mean log-probability per answer token):\n\n"
            + tables.retrieval_markdown(table, lengths, depths) + "\n\n![needle in a haystack, every run]"
            "(combined-niah.png)")


def build_report(run_dirs: list[Path], output: Path, title: str = "Evaluation") -> str:
    """Write the plots of ``run_dirs`` into ``output`` and return the page (written by the caller). Several runs of
    passkey, niah or lm-eval also get a section comparing them all in one table and plot."""
    sections = [f"# {title}"]
    names: set[str] = set()
    by_command: dict[str, list[tuple[str, dict]]] = {}
    for folder in run_dirs:
        command, data = read_run(folder)
        name = folder.resolve().name
        while name in names:  # two runs with the same folder name
            name += "-2"
        names.add(name)
        by_command.setdefault(command, []).append((name, data))
        section = [f"## {TITLES[command]} ({name})"]
        settings_line = _settings_line(data.get("settings", {}))
        if settings_line:
            section.append(f"`hf-posenc {command}`: {settings_line}.")
        section.append(run_section(command, data))
        plot = folder / RESULT_FILES[command][1]
        if plot.is_file():
            copied = f"{name}-{plot.name}"
            (output / copied).write_bytes(plot.read_bytes())
            section.append(f"![{TITLES[command]}]({copied})")
        sections.append("\n\n".join(section))
    for command, runs in by_command.items():
        if command in ("passkey", "niah", "lm-eval") and len(runs) > 1:
            sections.append(f"## {TITLES[command]}: every run ({', '.join(name for name, _ in runs)})\n\n"
                            + combined_section(command, runs, output))
    return "\n\n".join(sections) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc report",
                                description="several runs' results in one Markdown page with tables and plots",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=Path,
                   help="output folders of eval-ppl, main-job, passkey, niah, lm-eval")
    p.add_argument("--title", default="Evaluation", help="the page's title")
    p.add_argument("--output-dir", type=Path, default=Path("runs/report"),
                   help="where report.md and its plots go")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    return p


def run(args: argparse.Namespace) -> None:
    for folder in args.run_dirs:  # every run readable before anything is written
        read_run(folder)
    check_output_dir(args.output_dir, "report", args.overwrite)
    with atomic_output_dir(args.output_dir, "report", args.overwrite) as out:
        page = build_report(args.run_dirs, out, args.title)
        (out / "report.md").write_text(page, encoding="utf-8")
    print(page)
    print(f"wrote {args.output_dir}/report.md and its plots")
