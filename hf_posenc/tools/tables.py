"""Tables and plots of the commands' results: perplexity vs context length (eval-ppl, main-job), passkey accuracy,
and the demo's per-method perplexity. The commands compute; this module only formats and draws."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Iterable

from .runtime import UNPATCHED

PerplexityTable = dict[str, dict[int, float | None]]  # row label (model + method) -> length -> perplexity
AccuracyTable = dict[tuple[str, int, float], tuple[float, int]]  # (label, length, depth) -> (accuracy, trials)


def format_perplexity(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value < 1e5 else f"{value:.3g}"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# Tick values per decade, sparsest first: the first set that puts at least 3 ticks in view is labelled.
_LOG_TICK_SETS = ((1,), (1, 2, 5), (1, 2, 3, 5), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9),
                  (1, 1.2, 1.4, 1.6, 1.8, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 9))


def plain_number(value: float) -> str:
    """A tick label as a reader writes it: 38, 2048, 1.5 (matplotlib's log axes write 3.8 x 10^1)."""
    return f"{value:.0f}" if value >= 1000 or value == round(value) else f"{value:.4g}"


def plain_log_y_axis(ax) -> None:
    """The y axis of ``ax`` on a log scale, labelled in plain numbers at a few round values in view (at least 3: evenly
    spaced ones where the view is too narrow for the sets above), with unlabelled minor ticks between. Call it after
    the data is drawn."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    ax.set_yscale("log")
    low, high = sorted(ax.get_ylim())
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    for subs in _LOG_TICK_SETS:
        ticks = [s * 10.0 ** d for d in decades for s in subs if low <= s * 10.0 ** d <= high]
        if len(ticks) >= 3:
            break
    else:
        ticks = [v for v in MaxNLocator(nbins=4).tick_values(low, high) if low <= v <= high]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: plain_number(value)))
    ax.yaxis.set_minor_locator(LogLocator(base=10, subs="auto"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(low, high)


def row_label(model: str, method: str, replaced: str | None = None) -> str:
    """The row of a model evaluated with a method; ``replaced``: the (trained) patch of a patched checkpoint that the
    method replaced, so the row says that the checkpoint's own positional weights were not used."""
    if method == UNPATCHED:
        return model
    return f"{model} with its {replaced} replaced by {method}" if replaced else f"{model} + {method}"


# --- perplexity vs context length -----------------------------------------------------------------------------
def perplexity_markdown(table: PerplexityTable, lengths: list[int]) -> str:
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |",
             "| --- | " + " | ".join("---:" for _ in lengths) + " |"]
    for label, row in table.items():
        lines.append(f"| {label} | " + " | ".join(format_perplexity(row.get(n)) for n in lengths) + " |")
    return "\n".join(lines)


def write_perplexity_csv(path: Path, lengths: list[int], tables: dict[str | None, PerplexityTable]) -> None:
    """A row per model and a column per length (jquesnelle/yarn's layout). ``tables`` maps a text's name to its
    table; with one table under ``None`` there is no text column."""
    by_text = list(tables) != [None]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow((["text"] if by_text else []) + ["model", *lengths])
        for text, table in tables.items():
            for label, row in table.items():
                cells = ["" if row.get(n) is None else f"{row[n]:.4f}" for n in lengths]
                writer.writerow(([text] if by_text else []) + [label, *cells])


def plot_perplexity(path: Path, lengths: list[int],
                    panels: dict[str, tuple[PerplexityTable, dict[str, int | None]]], title: str = "") -> None:
    """Perplexity (log axis) vs length, a line per model and a star at the length it was trained at; a panel per
    entry of ``panels`` (panel title -> (table, training length per row label))."""
    plt = _pyplot()
    fig = perplexity_figure(lengths, panels, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def perplexity_figure(lengths: list[int], panels: dict[str, tuple[PerplexityTable, dict[str, int | None]]],
                      title: str = ""):
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(1.2 + 5.2 * len(panels), 4.2), squeeze=False)
    for ax, (panel_title, (table, trained_at)) in zip(axes[0], panels.items()):
        for label, row in table.items():
            xs = [n for n in lengths if row.get(n) is not None and math.isfinite(row[n])]
            ys = [row[n] for n in xs]
            trained = trained_at.get(label)
            (line,) = ax.plot(xs, ys, marker="o", markersize=3,
                              label=label + (f" (trained at {trained})" if trained else ""))
            if trained and xs and xs[0] <= trained <= xs[-1]:
                ax.plot([trained], [_interpolate_log_log(trained, xs, ys)], marker="*", markersize=13,
                        color=line.get_color(), markeredgecolor="black", linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(n) for n in lengths], fontsize=8)
        ax.xaxis.set_minor_formatter(_null_formatter())  # the lengths are the labels
        plain_log_y_axis(ax)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("perplexity, log scale (lower is better)")
        ax.set_title(panel_title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


# row label -> {"step": N, "tokens": tokens trained on by then, "run": its run's name, "checkpoint_dir": the run's}
TrainingPoints = dict[str, dict]


def _runs(points: TrainingPoints) -> dict[str, list[tuple[str, dict]]]:
    """The points grouped by run (its checkpoint folder), each run's fewest tokens first."""
    runs: dict[str, list[tuple[str, dict]]] = {}
    for label, point in points.items():
        runs.setdefault(point.get("checkpoint_dir", point.get("run", "")), []).append((label, point))
    return {key: sorted(members, key=lambda item: item[1]["tokens"]) for key, members in runs.items()}


def has_training_curve(points: TrainingPoints) -> bool:
    """Whether some run has two points or more (a curve to draw)."""
    return any(len(members) > 1 for members in _runs(points).values())


def write_training_curve_csv(path: Path, lengths: list[int], table: PerplexityTable, points: TrainingPoints) -> None:
    """A row per point of a training run (its checkpoints and its end), run by run, fewest tokens first: step, tokens
    trained on, and the perplexity at each length."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "model", "step", "tokens", *lengths])
        for members in _runs(points).values():
            for label, point in members:
                row = table.get(label, {})
                writer.writerow([point.get("run", ""), label, point["step"], point["tokens"],
                                 *("" if row.get(n) is None else f"{row[n]:.4f}" for n in lengths)])


def plot_training_curve(path: Path, lengths: list[int], table: PerplexityTable, points: TrainingPoints,
                        title: str = "") -> None:
    """Perplexity (log axis) against the tokens a run had trained on at each of its points, a line per run and
    length."""
    plt = _pyplot()
    fig = training_curve_figure(lengths, table, points, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def training_curve_figure(lengths: list[int], table: PerplexityTable, points: TrainingPoints, title: str = ""):
    plt = _pyplot()
    runs = [members for members in _runs(points).values() if len(members) > 1]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for members in runs:
        for n in lengths:
            xy = [(point["tokens"], table[label][n]) for label, point in members
                  if table.get(label, {}).get(n) is not None and math.isfinite(table[label][n])]
            if xy:
                name = f"{members[0][1].get('run', '')}, " if len(runs) > 1 else ""
                ax.plot(*zip(*xy), marker="o", markersize=4, label=f"{name}at {n} tokens of context")
    ax.set_xlabel("tokens trained on")
    ax.xaxis.set_major_formatter(_thousands_formatter())
    ax.set_ylabel("perplexity, log scale (lower is better)")
    plain_log_y_axis(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "perplexity along one training run", fontsize=9)
    fig.tight_layout()
    return fig


def _thousands_formatter():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda value, _: f"{value:,.0f}")


def _null_formatter():
    from matplotlib.ticker import NullFormatter

    return NullFormatter()


def _interpolate_log_log(x: float, xs: list[int], ys: list[float]) -> float:
    """The line's value at ``x`` as drawn on log-log axes: linear in log(x) and log(y) between the points around
    it."""
    log_xs, t = [math.log(v) for v in xs], math.log(x)
    for i in range(len(xs) - 1):
        if log_xs[i] <= t <= log_xs[i + 1]:
            w = 0.0 if log_xs[i + 1] == log_xs[i] else (t - log_xs[i]) / (log_xs[i + 1] - log_xs[i])
            return math.exp(math.log(ys[i]) + w * (math.log(ys[i + 1]) - math.log(ys[i])))
    return ys[-1]


# --- passkey --------------------------------------------------------------------------------------------------
def depth_markdown(table: dict, lengths: list[int], depths: list[float], cell) -> str:
    """A markdown row per model and length, a column per depth, `cell(value)` in each (a length a model was not run
    at, in a report of several runs, has no row)."""
    lines = ["| model | length | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in depths) + " |"]
    for label in dict.fromkeys(key[0] for key in table):
        for n in lengths:
            cells = [table.get((label, n, d)) for d in depths]
            if any(cells):
                lines.append(f"| {label} | {n} | " + " | ".join("-" if c is None else cell(c) for c in cells) + " |")
    return "\n".join(lines)


def passkey_markdown(table: AccuracyTable, lengths: list[int], depths: list[float]) -> str:
    return depth_markdown(table, lengths, depths, lambda c: f"{c[0]:.0%}")


def write_passkey_csv(path: Path, table: AccuracyTable) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "length", "depth", "accuracy", "trials"])
        for (label, length, depth), (accuracy, trials) in table.items():
            writer.writerow([label, length, depth, f"{accuracy:.4f}", trials])


def passkey_heatmap(path: Path, table: AccuracyTable, lengths: list[int], depths: list[float]) -> None:
    """Accuracy per prompt length (x) and passkey depth (y), one panel per model."""
    plt = _pyplot()
    labels = list(dict.fromkeys(key[0] for key in table))
    fig, axes = plt.subplots(1, len(labels), figsize=(1.2 + 0.9 * len(lengths) * len(labels) + 1.5 * len(labels),
                                                      0.5 * len(depths) + 1.8), squeeze=False)
    for ax, label in zip(axes[0], labels):
        grid = [[table.get((label, n, d), (float("nan"), 0))[0] for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_xlabel("prompt length (tokens)", fontsize=8)
        ax.set_ylabel("passkey depth", fontsize=8)
        ax.set_title(label, fontsize=8)
        for y, row in enumerate(grid):
            for x, value in enumerate(row):
                ax.text(x, y, "-" if math.isnan(value) else f"{value:.0%}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.03, label="accuracy")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# --- retrieval scored two ways (needle in a haystack) ---------------------------------------------------------
RetrievalTable = dict[tuple[str, int, float], dict[str, float]]  # (label, length, depth) -> exact, logprob, ...


def write_rows_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({k: f"{v:.4f}" if isinstance(v, float) else v for k, v in row.items()} for row in rows)


def retrieval_markdown(table: RetrievalTable, lengths: list[int], depths: list[float]) -> str:
    """Exact-match accuracy (mean log-probability of the answer) per length and depth."""
    return depth_markdown(table, lengths, depths, lambda c: f"{c['exact']:.0%} ({c['logprob']:.2f})")


def retrieval_heatmaps(path: Path, table: RetrievalTable, lengths: list[int], depths: list[float],
                       depth_label: str) -> None:
    """Per model a column of two heat-maps over length (x) and depth (y): exact-match accuracy, and the answer's
    mean log-probability per token (shared colour scale across models)."""
    plt = _pyplot()
    labels = list(dict.fromkeys(key[0] for key in table))
    logprobs = [cell["logprob"] for cell in table.values() if math.isfinite(cell["logprob"])] or [0.0]
    low, high = min(logprobs), max(max(logprobs), min(logprobs) + 1e-6)
    fig, axes = plt.subplots(2, len(labels), squeeze=False, layout="constrained",
                             figsize=(2 + (0.9 * len(lengths) + 2) * len(labels), 2 * (0.5 * len(depths) + 2)))
    for column, label in enumerate(labels):
        for row, (score, vmin, vmax, cmap, fmt) in enumerate((("exact", 0, 1, "RdYlGn", "{:.0%}"),
                                                             ("logprob", low, high, "viridis", "{:.2f}"))):
            ax = axes[row][column]
            grid = [[table.get((label, n, d), {}).get(score, float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(grid, vmin=vmin, vmax=vmax, cmap=cmap, aspect="auto")
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
            ax.set_xlabel("prompt length (tokens)", fontsize=8)
            if column == 0:
                ax.set_ylabel(depth_label, fontsize=8)
            ax.set_title(f"{label}: {'exact match' if score == 'exact' else 'answer log-prob / token'}", fontsize=8)
            for y, values in enumerate(grid):
                for x, value in enumerate(values):
                    ax.text(x, y, "-" if math.isnan(value) else fmt.format(value), ha="center", va="center",
                            fontsize=7)
            if column == len(labels) - 1:
                fig.colorbar(image, ax=axes[row].tolist(), fraction=0.03)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# --- metrics of several tasks (lm-eval) --------------------------------------------------------------------------
def metric_markdown(rows: list[dict]) -> str:
    """A row per task and metric, a column per model: ``value +- stderr``."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    cells = {(r["task"], r["metric"], r["model"]): r for r in rows}
    lines = ["| task | metric | " + " | ".join(models) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in models) + " |"]
    for task, metric in dict.fromkeys((r["task"], r["metric"]) for r in rows):
        values = []
        for model in models:
            r = cells.get((task, metric, model))
            values.append("-" if r is None else f"{r['value']:.4g}" + (
                f" \u00b1 {r['stderr']:.2g}" if math.isfinite(r.get("stderr", math.nan)) else ""))
        lines.append(f"| {task} | {metric} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def metric_bars(path: Path, rows: list[dict]) -> None:
    """A panel per task and metric, a bar per model with its standard error."""
    plt = _pyplot()
    panels = list(dict.fromkeys((r["task"], r["metric"]) for r in rows))
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(1 + 3.2 * max(1, len(panels)), 3.6), squeeze=False)
    for ax, (task, metric) in zip(axes[0], panels):
        chosen = [r for r in rows if (r["task"], r["metric"]) == (task, metric)]
        errors = [r["stderr"] if math.isfinite(r.get("stderr", math.nan)) else 0.0 for r in chosen]
        ax.bar(range(len(chosen)), [r["value"] for r in chosen], yerr=errors, capsize=3)
        ax.set_xticks(range(len(chosen)), [r["model"] for r in chosen], rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{task}: {metric}", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- the demo: one perplexity per method ----------------------------------------------------------------------
def demo_markdown(results: Iterable) -> str:
    """A row per method result (``method``, ``perplexity``, ``n_scored_tokens``, ``seconds``, ``continuation``,
    ``error``)."""
    lines = ["| method | perplexity | tokens scored | seconds | continuation |",
             "| --- | ---: | ---: | ---: | --- |"]
    for r in results:
        continuation = f"ERROR {r.error}" if r.error else repr(r.continuation)
        lines.append(f"| {r.method} | {format_perplexity(r.perplexity)} | {r.n_scored_tokens} | "
                     f"{r.seconds:.1f} | {_cell(continuation)} |")
    return "\n".join(lines)


def _cell(text: str, limit: int = 120) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def plot_demo_perplexity(path: Path, results: list, title: str, unpatched: str = "none") -> None:
    """A bar per method (the unpatched model in grey), log scale when the values span more than 20x."""
    plt = _pyplot()
    fig = demo_perplexity_figure(results, title, unpatched)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo_perplexity_figure(results: list, title: str, unpatched: str = "none"):
    plt = _pyplot()
    names = [r.method for r in results]
    values = [r.perplexity if r.perplexity is not None and math.isfinite(r.perplexity) else 0.0 for r in results]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 1.5), 4.0))
    bars = ax.bar(names, values, color=["tab:gray" if n == unpatched else "tab:blue" for n in names])
    finite = [v for v in values if v > 0]
    log_scale = finite and max(finite) / min(finite) > 20
    for bar, r in zip(bars, results):
        label = "error" if r.perplexity is None else format_perplexity(r.perplexity)
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, max(bar.get_height(), min(finite or [1]))),
                    ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=30)
    if log_scale:
        ax.set_ylim(min(finite) / 1.5, max(finite) * 1.5)
        plain_log_y_axis(ax)
    fig.tight_layout()
    return fig
