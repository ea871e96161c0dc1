"""``hf-posenc lm-eval``: what a swap or an extension costs at short lengths, measured by lm-eval (EleutherAI's
lm-evaluation-harness, the ``lm-eval`` package) on the patched model object.

    hf-posenc lm-eval --model smollm2 --method none --method yarn:factor=4 --tasks hellaswag,arc_easy,wikitext
    hf-posenc lm-eval --model runs/kerple-ft --tasks cloze --data-dir ../shared/data --limit 100

The model is loaded and patched as in the other commands, then wrapped in lm-eval's ``HFLM`` (``pretrained=`` the
model object), so lm-eval scores exactly what hf_posenc computes. Standard tasks (hellaswag, arc_easy, wikitext, ...)
need their datasets from the Hugging Face Hub. Offline, ``--tasks cloze`` is a task built here from local text
(``build_cloze_task``): a passage, and four continuations of which one is the passage's real next sentence and the
others are sentences from elsewhere in the text; lm-eval scores it as multiple choice (``acc``, ``acc_norm``).
``--include-path DIR`` adds your own lm-eval task YAML files.

Outputs in ``--output-dir``: ``lm_eval.csv`` (model, task, metric, value, stderr), ``lm_eval.json`` (lm-eval's results
and the settings) and ``lm_eval.png`` (a bar per model and metric). Under ``accelerate launch`` the processes share
each task's requests (lm-eval's own data-parallel split, given the ranks here since lm-eval leaves a model object it
did not build to the caller) and lm-eval gathers the scores on the main process, which writes the outputs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
from pathlib import Path

from . import tables
from .models import SMOLLM2, load_model, loader, model_name
from .outputs import OVERWRITE_HELP, atomic_output_dir, check_output_dir_on_main, write_json
from .runtime import (DTYPES, MethodRequest, UNPATCHED, UsageError, accelerator_if_launched, add_model_arguments,
                      check_at_least, each_method, is_main, process_count, set_threads,
                      settings_of, versions)
from .text import DEFAULT_ENCODING, DataError, check_encoding, data_dir, read_text

CLOZE_TASK = "cloze"
CLOZE_CHOICES = 4


def sentences_of(text: str) -> list[str]:
    """The text's sentences in order, whitespace collapsed: split after ., ! or ? (and closing quotes) where the next
    sentence starts with a capital or an opening quote."""
    flat = " ".join(text.split())
    ends = r"(?:(?<=[.!?])|(?<=[.!?][\"'\u201d\u2019)]))"
    return [s for s in re.split(ends + r" (?=[\"\u201c\u2018A-Z])", flat) if s]


def cloze_documents(text: str, n_docs: int, context_sentences: int = 3, seed: int = 0,
                    max_words: int = 60) -> list[dict]:
    """``n_docs`` multiple-choice documents: ``context`` (``context_sentences`` consecutive sentences), ``choices``
    (the real next sentence and CLOZE_CHOICES - 1 sentences from elsewhere, in random order), ``label`` (the index of
    the real one). Every sentence used has 4 to ``max_words`` words."""
    sentences = sentences_of(text)
    usable = [4 <= len(s.split()) <= max_words for s in sentences]
    span = context_sentences + 1
    starts = [i for i in range(0, len(sentences) - span + 1, span) if all(usable[i : i + span])]
    if len(starts) < n_docs or sum(usable) < span * n_docs + CLOZE_CHOICES:
        raise DataError(f"the text has {len(starts)} runs of {span} usable sentences; {n_docs} cloze documents need "
                        f"{n_docs} (use more text or fewer documents)")
    rng = random.Random(seed)
    docs = []
    for start in sorted(rng.sample(starts, n_docs)):
        real = sentences[start + context_sentences]
        others = [i for i, ok in enumerate(usable) if ok and not start <= i < start + span]
        choices = [real] + [sentences[i] for i in rng.sample(others, CLOZE_CHOICES - 1)]
        rng.shuffle(choices)
        docs.append({"context": " ".join(sentences[start : start + context_sentences]), "choices": choices,
                     "label": choices.index(real)})
    return docs


def build_cloze_task(text: str, directory: Path, n_docs: int = 200, seed: int = 0, context_sentences: int = 3,
                     max_words: int = 60) -> Path:
    """Write the cloze task (its documents as JSON lines and its lm-eval YAML) into ``directory``; the folder to pass
    to lm-eval's ``TaskManager(include_path=...)``."""
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / "cloze.jsonl"
    docs = cloze_documents(text, n_docs, context_sentences, seed, max_words)
    data.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    # JSON is YAML: lm-eval reads this task definition like its own task files.
    task = {"task": CLOZE_TASK, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{context}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                            {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
            "metadata": {"version": 1.0}}
    (directory / "cloze.yaml").write_text(json.dumps(task, indent=2), encoding="utf-8")
    return directory


def check_cloze_fits(tokenizer, task_dir: Path, model, max_length: int | None) -> None:
    """Refuse, before lm-eval runs, a cloze choice longer than the input lm-eval allows (``max_length``, else the
    window in the model's config as lm-eval reads it): lm-eval would stop on an assertion of its own."""
    config = model.config
    allowed = max_length or getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if not allowed:
        return
    docs = [json.loads(line) for line in (task_dir / "cloze.jsonl").read_text(encoding="utf-8").splitlines()]
    longest = max(len(tokenizer(" " + choice)["input_ids"]) for doc in docs for choice in doc["choices"])
    if longest > allowed:
        raise UsageError(f"a cloze choice has {longest} tokens and lm-eval takes inputs of at most {allowed}; pass "
                         f"--max-length {longest * 4} or more (lm-eval cuts the context from the left)")


def task_manager(tasks: list[str], include_path: Path | None = None, defaults: bool = True):
    """lm-eval's ``TaskManager`` for these tasks, after checking that it knows each of them. ``defaults=False``
    indexes ``include_path`` alone: building lm-eval's index of its own 14k tasks takes 10-25 s on a CPU, which a run
    of only our cloze task does not need."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(include_path) if include_path else None,
                          include_defaults=defaults or include_path is None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UsageError(f"lm-eval knows no task {', '.join(map(repr, unknown))}; use lm-eval's task names "
                         f"(hellaswag, arc_easy, wikitext, ...), {CLOZE_TASK!r}, or your own YAML with --include-path")
    return manager


def evaluate_model(model, tokenizer, tasks: list[str], include_path: Path | None = None, limit: int | None = None,
                   num_fewshot: int | None = None, batch_size: int = 1, seed: int = 0,
                   max_length: int | None = None, accelerator=None, manager=None) -> dict:
    """lm-eval's ``simple_evaluate`` on this model object (patched or not): its ``results`` per task (on the main
    process; {} on the others). lm-eval cuts each input to ``max_length`` tokens from the left (default: the model's
    window from its config). With an ``accelerator`` of several processes, each scores its share of the requests.
    ``manager``: a ``task_manager(...)`` to reuse across models (else one is built for these tasks)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    if manager is None:
        manager = task_manager(tasks, include_path)
    device = str(next(model.parameters()).device)
    wrapped = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                   max_length=max_length)
    if process_count(accelerator) > 1:  # what HFLM sets itself when it builds the model under accelerate launch
        wrapped.accelerator = accelerator
        wrapped._rank, wrapped._world_size = accelerator.process_index, accelerator.num_processes
    out = simple_evaluate(model=wrapped, tasks=tasks, task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                          log_samples=False)
    return {} if out is None else out["results"]  # None on processes other than the main one


def metric_rows(label: str, results: dict) -> list[dict]:
    """lm-eval's results as rows: model, task, metric, value, stderr."""
    rows = []
    for task, values in results.items():
        for key, value in values.items():
            metric, comma, _filter = key.partition(",")  # lm-eval's metric keys are "metric,filter"
            if not comma or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            stderr = values.get(f"{metric}_stderr,{_filter}")
            rows.append({"model": label, "task": task, "metric": metric, "value": float(value),
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else math.nan})
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc lm-eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--tasks", default=CLOZE_TASK, help="lm-eval task names, comma-separated")
    p.add_argument("--include-path", type=Path, default=None, help="a folder of your own lm-eval task YAML files")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    p.add_argument("--num-fewshot", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=1, help="lm-eval's batch size")
    p.add_argument("--max-length", type=int, default=None,
                   help="lm-eval cuts inputs to this many tokens (default: the model's window from its config)")
    p.add_argument("--cloze-file", default=None, help="text of the cloze task (default: the Frankenstein book of "
                                                      "--data-dir)")
    p.add_argument("--cloze-documents", type=int, default=200, help="passages of the cloze task")
    p.add_argument("--data-dir", default=None, help="the shared text folder (default: $HF_POSENC_DATA)")
    p.add_argument("--encoding", default=DEFAULT_ENCODING, help="encoding of --cloze-file")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the cloze passages and of lm-eval")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--output-dir", type=Path, default=Path("runs/lm-eval"), help="where the results go")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--threads", type=int, default=None)
    return p


def check_args(args: argparse.Namespace) -> list[str]:
    check_at_least(args, 1, "batch_size", "cloze_documents", "limit", "threads", "max_length")
    check_at_least(args, 0, "num_fewshot")
    check_encoding(args.encoding)
    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise UsageError("--tasks is empty; give lm-eval task names, e.g. --tasks cloze or --tasks hellaswag,arc_easy")
    if args.include_path is not None and not args.include_path.is_dir():
        raise UsageError(f"--include-path {args.include_path} is not a folder; give the folder of your task YAML files")
    return tasks


def cloze_text(args: argparse.Namespace) -> str:
    if args.cloze_file:
        return read_text(args.cloze_file, args.encoding)
    return read_text(data_dir(args.data_dir) / "pg84-frankenstein.txt", args.encoding)


def run_lm_eval(args: argparse.Namespace, work_dir: Path, accelerator=None) -> tuple[list[dict], dict]:
    """Every model x method through lm-eval; the rows and lm-eval's results per row label (on the main process)."""
    import torch

    tasks = check_args(args)
    requests = [MethodRequest.parse(m) for m in (args.method or [UNPATCHED])]
    for request in requests:
        request.check()
    include = args.include_path
    if CLOZE_TASK in tasks:
        include = build_cloze_task(cloze_text(args), work_dir / "tasks", args.cloze_documents, args.seed)
        if args.include_path is not None:  # lm-eval takes one folder: both task sets side by side
            for path in args.include_path.glob("*.y*ml"):
                (include / path.name).write_bytes(path.read_bytes())
    # one index of the tasks for every model and method, checked before any model loads; lm-eval's own tasks are
    # left out of it where only our cloze task is asked for (a user's --include-path may build on them)
    manager = task_manager(tasks, include, defaults=tasks != [CLOZE_TASK] or args.include_path is not None)
    device = accelerator.device if accelerator is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    rows, results = [], {}
    for model_spec in args.model or [SMOLLM2]:
        model, tokenizer = load_model(model_spec, dtype=DTYPES[args.dtype], tokenizer=args.tokenizer,
                                      verbose=is_main(accelerator))
        model.to(device)
        for request in requests:
            request.check_patchable(model)
        if CLOZE_TASK in tasks:
            check_cloze_fits(tokenizer, include, model, args.max_length)
        name = model_name(model_spec)
        load = loader(model_spec, DTYPES[args.dtype], args.tokenizer, device)
        for request, model, replaced in each_method(model, requests, load):
            label = tables.row_label(name, request.label, replaced or None)
            results[label] = evaluate_model(model, tokenizer, tasks, include, args.limit, args.num_fewshot,
                                            args.batch_size, args.seed, args.max_length, accelerator, manager)
            rows += metric_rows(label, results[label])
    return rows, results


def run(args: argparse.Namespace) -> None:
    import tempfile

    set_threads(args.threads)
    check_args(args)
    accelerator = accelerator_if_launched()
    main_process = is_main(accelerator)
    check_output_dir_on_main(accelerator, args.output_dir, "lm-eval", args.overwrite)
    with atomic_output_dir(args.output_dir, "lm-eval", args.overwrite, enabled=main_process) as out, \
            tempfile.TemporaryDirectory() as scratch:
        rows, results = run_lm_eval(args, out if main_process else Path(scratch), accelerator)
        if main_process:
            tables.write_rows_csv(out / "lm_eval.csv", rows, ["model", "task", "metric", "value", "stderr"])
            write_json(out / "lm_eval.json", {"settings": {**settings_of(args), "num_processes":
                                                           process_count(accelerator), "versions": versions()},
                                              "results": results, "rows": rows})
            tables.metric_bars(out / "lm_eval.png", rows)
    if accelerator is not None:
        accelerator.wait_for_everyone()
    if not main_process:
        return
    print()
    print(tables.metric_markdown(rows))
    print(f"wrote {args.output_dir}/lm_eval.csv, lm_eval.json, lm_eval.png")
