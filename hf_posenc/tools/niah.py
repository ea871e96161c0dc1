"""``hf-posenc niah``: needle in a haystack over real text, scored by exact match and by the answer's log-probability.

    hf-posenc niah --model smollm2 --method none --method yarn:factor=4 --lengths 2048,4096,8192 \\
        --depths 0,0.25,0.5,0.75,1 --trials 3 --data-dir ../shared/data

The haystack is real text: slices of the books in ``--data-dir`` (``pg*.txt``, three Project Gutenberg books in the
shared folder) or of ``--haystack-file`` files. A needle is a fact in the form RULER (Hsieh et al. 2024) uses,
``The special magic number for <key> is <7 digits>.``, inserted on its own line at a depth of the haystack (0 = right
after the task line, 1 = right before the question). The prompt ends with the question ``... The special magic number
for <key> mentioned in the provided text is`` and is exactly ``length`` tokens long.

- ``--needles K``: K facts with different keys, the first at the stated depth and the others spread evenly between
  it and the end; each is asked in turn (one prompt per question, the same haystack), and a trial scores the
  fraction retrieved (multi-key NIAH).
- ``--distractors D``: D more facts with other keys at random depths, never asked.

Scores per (length, depth): ``exact`` (the first number of the greedy answer is the value) and ``logprob`` (the mean
log-probability per token of the value after the prompt, which still moves when a small model never answers
exactly). Outputs in ``--output-dir``: ``niah.csv``, ``niah.json`` (every question, the settings) and ``niah.png``
(heat-maps of exact-match accuracy and of the log-probability per length and depth, one column per model).
Several processes with ``accelerate launch -m hf_posenc niah ...`` split the questions; the result is the same.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import tables
from .estimates import check_memory, estimate_forward_bytes
from .models import SMOLLM2, load_model, loader, model_name
from .outputs import OVERWRITE_HELP, atomic_output_dir, check_output_dir_on_main, write_json
from .runtime import (DTYPES, MethodRequest, UNPATCHED, UsageError, accelerator_if_launched, add_model_arguments,
                      check_at_least, each_method, greedy_answers, is_main, parse_numbers, process_count, set_threads,
                      settings_of, versions)
from .text import DEFAULT_ENCODING, DataError, check_encoding, data_dir, read_text

TASK = ("Some special magic numbers are hidden within the following text. Make sure to memorize them. "
        "I will quiz you about the numbers afterwards.")
# Keys of the facts: distinct single words, so every fact and question differs from the others only in its key.
KEYS = ("amsterdam", "bangkok", "cairo", "dublin", "havana", "istanbul", "jakarta", "kyoto", "lagos", "lima",
        "madrid", "nairobi", "oslo", "prague", "quito", "riga", "santiago", "sydney", "tallinn", "toronto",
        "vienna", "warsaw", "yerevan", "zagreb")


def fact(key: str, value: int) -> str:
    return f"The special magic number for {key} is {value}."


def question(key: str) -> str:
    return (f"What is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")


@dataclass(frozen=True)
class Needle:
    key: str
    value: int
    depth: float  # where in the haystack, 0..1


@dataclass
class Question:
    """One prompt and its scores."""
    model: str
    method: str
    length: int
    depth: float  # the depth of the trial (of its first needle)
    trial: int
    key: str
    value: int
    needle_depth: float  # the depth of the needle asked
    answer: str
    exact: bool
    logprob: float  # mean log-probability per token of " <value>" after the prompt
    replaced: str = ""  # the patch of a patched checkpoint that the method replaced (tables.row_label)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def plan_needles(depth: float, needles: int, distractors: int, rng: random.Random) -> tuple[list[Needle], list[Needle]]:
    """The asked needles (the first at ``depth``, the rest evenly between it and 1) and the distractors (random
    depths), with distinct keys and 7-digit values."""
    keys = rng.sample(KEYS, needles + distractors)
    depths = [depth + (1.0 - depth) * i / needles for i in range(needles)]
    asked = [Needle(k, rng.randint(1_000_000, 9_999_999), d) for k, d in zip(keys, depths)]
    others = [Needle(k, rng.randint(1_000_000, 9_999_999), rng.random()) for k in keys[needles:]]
    return asked, others


def build_prompt(tokenizer, length: int, haystack_ids: list[int], needles: list[Needle], asked: Needle,
                 start: int = 0) -> list[int]:
    """Token ids of a prompt of exactly ``length`` tokens: the task line, ``haystack_ids[start:]`` cut to fit with
    each needle's fact on its own line at its depth, and the question about ``asked``."""
    head = _ids(tokenizer, TASK + "\n")
    tail = _ids(tokenizer, "\n" + question(asked.key))
    facts = [(n.depth, _ids(tokenizer, "\n" + fact(n.key, n.value) + "\n")) for n in needles]
    n_filler = length - len(head) - len(tail) - sum(len(ids) for _, ids in facts)
    if n_filler < 0:
        raise UsageError(f"a needle-in-a-haystack prompt with {len(needles)} fact(s) needs at least "
                         f"{length - n_filler} tokens; length {length} is too short")
    if len(haystack_ids) - start < n_filler:
        raise DataError(f"the haystack text has {len(haystack_ids)} tokens; length {length} needs {n_filler} "
                        "(give more or longer --haystack-file texts)")
    filler = haystack_ids[start : start + n_filler]
    body, cut = [], 0
    for depth, ids in sorted(facts, key=lambda item: item[0]):
        at = round(depth * n_filler)
        body += filler[cut:at] + ids
        cut = at
    return head + body + filler[cut:] + tail


def first_number(answer: str) -> int | None:
    match = re.search(r"\d+", answer)
    return int(match.group()) if match else None


def answer_logprob(model, prompt, answer_ids: list[int]) -> float:
    """Mean log-probability per token of ``answer_ids`` following ``prompt`` ([1, L] on the model's device)."""
    import torch

    answer = torch.tensor([answer_ids], device=prompt.device)
    ids = torch.cat([prompt, answer], dim=1)
    logits = model(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[0, prompt.shape[1] - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(1, answer[0, :, None])
    return float(logprobs.mean())


def plan_trials(lengths: list[int], depths: list[float], trials: int, needles: int, distractors: int, seed: int,
                haystack_tokens: int) -> list[tuple]:
    """Every question as (length, depth, trial, needles in the prompt, the needle asked, haystack start). The same
    (length, depth, trial) gets the same needles and haystack for every model and method."""
    plan = []
    for length in lengths:
        for depth in depths:
            for t in range(trials):
                rng = random.Random(f"{seed}-{length}-{depth}-{t}")
                asked, others = plan_needles(depth, needles, distractors, rng)
                start = rng.randint(0, max(0, haystack_tokens - length))
                plan += [(length, depth, t, asked + others, needle, start) for needle in asked]
    return plan


def run_questions(model, tokenizer, label_model: str, label_method: str, plan: list[tuple],
                  haystack_ids: list[int], max_new_tokens: int = 12, accelerator=None,
                  progress: bool = True) -> list[Question]:
    """Every planned question, split across processes when ``accelerator`` has several, gathered in order."""

    def prompt_of(i: int) -> list[int]:
        length, _, _, needles, asked, start = plan[i]
        return build_prompt(tokenizer, length, haystack_ids, needles, asked, start)

    def score(i: int, ids, answer: str) -> Question:
        length, depth, t, _, asked, _ = plan[i]
        logprob = answer_logprob(model, ids, _ids(tokenizer, f" {asked.value}"))
        return Question(label_model, label_method, length, depth, t, asked.key, asked.value, asked.depth, answer,
                        first_number(answer) == asked.value, logprob)

    return greedy_answers(model, tokenizer, len(plan), prompt_of, score, max_new_tokens, accelerator,
                          f"niah {label_method}", progress)


def score_table(questions: list[Question]) -> dict[tuple[str, int, float], dict[str, float]]:
    """(row label, length, depth) -> exact-match accuracy, mean log-probability and number of questions."""
    cells: dict[tuple[str, int, float], list[Question]] = {}
    for q in questions:
        label = tables.row_label(q.model, q.method, q.replaced or None)
        cells.setdefault((label, q.length, q.depth), []).append(q)
    return {key: {"exact": sum(q.exact for q in qs) / len(qs), "logprob": sum(q.logprob for q in qs) / len(qs),
                  "questions": len(qs)} for key, qs in cells.items()}


def write_outputs(directory: Path, questions: list[Question], settings: dict, lengths: list[int],
                  depths: list[float]) -> dict:
    table = score_table(questions)
    rows = [{"model": k[0], "length": k[1], "depth": k[2], **v} for k, v in table.items()]
    tables.write_rows_csv(directory / "niah.csv", rows, ["model", "length", "depth", "exact", "logprob", "questions"])
    write_json(directory / "niah.json", {"settings": settings, "scores": rows,
                                         "questions": [asdict(q) for q in questions]})
    tables.retrieval_heatmaps(directory / "niah.png", table, lengths, depths, "needle depth")
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc niah", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_arguments(p)
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="depths of the (first) needle in [0, 1]")
    p.add_argument("--trials", type=int, default=3, help="trials per length and depth")
    p.add_argument("--needles", type=int, default=1, help="facts asked per trial (each its own question)")
    p.add_argument("--distractors", type=int, default=0, help="facts with other keys at random depths, never asked")
    p.add_argument("--haystack-file", action="append", default=None,
                   help="text for the haystack (repeatable); default: the pg*.txt books of --data-dir")
    p.add_argument("--data-dir", default=None, help="the shared text folder (default: $HF_POSENC_DATA)")
    p.add_argument("--encoding", default=DEFAULT_ENCODING, help="encoding of the haystack files")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the facts, their depths and the distractors")
    p.add_argument("--max-new-tokens", type=int, default=12, help="tokens generated for each answer")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--output-dir", type=Path, default=Path("runs/niah"), help="where the results go")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory-check", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(args: argparse.Namespace) -> tuple[list[int], list[float]]:
    """Refuse nonsense settings before any model is loaded; the lengths and depths."""
    check_at_least(args, 1, "trials", "needles", "max_new_tokens", "threads")
    check_at_least(args, 0, "distractors")
    check_encoding(args.encoding)
    lengths = parse_numbers(args.lengths, "--lengths", int)
    depths = parse_numbers(args.depths, "--depths")
    if not lengths or not depths:
        raise UsageError("need at least one length (--lengths) and one depth (--depths)")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise UsageError(f"--depths must lie in [0, 1], got {depths}")
    if args.needles + args.distractors > len(KEYS):
        raise UsageError(f"--needles + --distractors is {args.needles + args.distractors}; at most {len(KEYS)} "
                         "facts fit in one prompt (each needs its own key)")
    return lengths, depths


def haystack_text(args: argparse.Namespace) -> str:
    files = args.haystack_file or sorted(data_dir(args.data_dir).glob("pg*.txt"))
    if not files:
        raise DataError(f"no pg*.txt books in {data_dir(args.data_dir)}; pass --haystack-file FILE")
    return "\n\n".join(read_text(f, args.encoding) for f in files)


def run_niah(args: argparse.Namespace, accelerator=None) -> tuple[list[Question], dict, list[int], list[float]]:
    import torch

    lengths, depths = check_args(args)
    requests = [MethodRequest.parse(m) for m in (args.method or [UNPATCHED])]
    for request in requests:
        request.check()
    text = haystack_text(args)
    main_process = is_main(accelerator)
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    questions: list[Question] = []
    for model_spec in args.model or [SMOLLM2]:
        model, tokenizer = load_model(model_spec, dtype=DTYPES[args.dtype], tokenizer=args.tokenizer,
                                      verbose=main_process and not args.no_progress)
        model.to(device)
        haystack_ids = _ids(tokenizer, text[: max(lengths) * 40])
        plan = plan_trials(lengths, depths, args.trials, args.needles, args.distractors, args.seed, len(haystack_ids))
        for length, _, _, needles, asked, start in {p[0]: p for p in plan}.values():  # too-short input fails here
            build_prompt(tokenizer, length, haystack_ids, needles, asked, start)
        if not args.no_memory_check:
            check_memory(estimate_forward_bytes(model, max(lengths) + 16), f"a {max(lengths)}-token prompt")
        for request in requests:
            request.check_patchable(model)
        name = model_name(model_spec)
        load = loader(model_spec, DTYPES[args.dtype], args.tokenizer, device)
        for request, model, replaced in each_method(model, requests, load):
            started = time.perf_counter()
            got = run_questions(model, tokenizer, name, request.label, plan, haystack_ids, args.max_new_tokens,
                                accelerator, not args.no_progress)
            for q in got:
                q.replaced = replaced
            questions.extend(got)
            if main_process:
                print(f"  {tables.row_label(name, request.label, replaced or None)}: exact "
                      f"{sum(q.exact for q in got) / len(got):.0%}, mean log-prob "
                      f"{sum(q.logprob for q in got) / len(got):.2f} over {len(got)} questions "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    settings = {**settings_of(args), "lengths": lengths, "depths": depths,
                "prompt": {"task": TASK, "fact": fact("KEY", 1234567), "question": question("KEY")},
                "num_processes": process_count(accelerator), "versions": versions()}
    return questions, settings, lengths, depths


def run(args: argparse.Namespace) -> None:
    """The command: ask every question, write ``--output-dir`` (from the main process), print the table."""
    set_threads(args.threads)
    check_args(args)
    accelerator = accelerator_if_launched()
    main_process = is_main(accelerator)
    check_output_dir_on_main(accelerator, args.output_dir, "niah", args.overwrite)
    with atomic_output_dir(args.output_dir, "niah", args.overwrite, enabled=main_process) as out:
        questions, settings, lengths, depths = run_niah(args, accelerator)
        if main_process:
            table = write_outputs(out, questions, settings, lengths, depths)
    if main_process:
        print()
        print(tables.retrieval_markdown(table, lengths, depths))
        print(f"wrote {args.output_dir}/niah.csv, niah.json, niah.png")

