"""``hf-posenc passkey``: can the model repeat a 5-digit number hidden at some depth of a long prompt?

    hf-posenc passkey --model smollm2 --method none --method yarn:factor=4 --lengths 1024,4096 \\
        --depths 0,0.25,0.5,0.75,1 --trials 5

The prompt is the one of landmark attention (Mohtashami & Jaggi 2023) and jquesnelle/yarn ``eval/passkey.py``:
a task description, filler, ``The pass key is 12345. Remember it. 12345 is the pass key.`` at the given depth of
the filler, more filler, and ``What is the pass key? The pass key is``. The filler is the repeated "The grass
is green..." lines (default) or real text (``--filler-file``). Prompts are built in tokens, exactly ``length``
long. Decoding is greedy; a trial counts as correct when the first number in the answer is the passkey.

The hard variant (``--keys K``, ``--key-digits D``): K pass keys of D digits, each for its own door (``The pass key for
door 17 is ...``), the asked one at the stated depth and the others at random depths; the question asks for the
first door's key, so the model has to pick the right key among several rather than repeat the only number it saw.

Outputs in ``--output-dir``: ``passkey.csv`` (model, length, depth, accuracy, trials), ``passkey.json`` (every
trial, the settings) and ``passkey.png`` (a heat-map of accuracy per length and depth, one panel per model).
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
from .text import DEFAULT_ENCODING, DataError, check_encoding, read_text

TASK = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
        "I will quiz you about the important information there.")
GARBAGE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
QUESTION = "What is the pass key? The pass key is"


def info_line(passkey: int, door: int | None = None) -> str:
    if door is None:
        return f"The pass key is {passkey}. Remember it. {passkey} is the pass key."
    return f"The pass key for door {door} is {passkey}. Remember it. {passkey} is the pass key for door {door}."


def question(door: int | None = None) -> str:
    return QUESTION if door is None else f"What is the pass key for door {door}? The pass key for door {door} is"


@dataclass(frozen=True)
class Distractor:
    """Another door's pass key at a depth of the filler (the hard variant)."""
    door: int
    passkey: int
    depth: float


@dataclass
class Trial:
    model: str
    method: str
    length: int
    depth: float
    trial: int
    passkey: int
    answer: str
    correct: bool
    door: int | None = None  # the door asked about in the hard variant
    replaced: str = ""  # the patch of a patched checkpoint that the method replaced (tables.row_label)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]


def build_prompt(tokenizer, length: int, depth: float, passkey: int, filler_ids: list[int] | None = None,
                 rng: random.Random | None = None, door: int | None = None,
                 distractors: tuple[Distractor, ...] = ()) -> list[int]:
    """Token ids of a prompt of exactly ``length`` tokens with the passkey line at ``depth`` (0 = right after
    the task description, 1 = right before the question) of the filler; with ``door``, the question asks for that
    door's key, and ``distractors`` are other doors' keys at their depths."""
    head = _ids(tokenizer, TASK + "\n")
    lines = [(depth, _ids(tokenizer, "\n" + info_line(passkey, door) + "\n"))]
    lines += [(d.depth, _ids(tokenizer, "\n" + info_line(d.passkey, d.door) + "\n")) for d in distractors]
    tail = _ids(tokenizer, "\n" + question(door))
    n_filler = length - len(head) - sum(len(ids) for _, ids in lines) - len(tail)
    if n_filler < 0:
        raise UsageError(f"a passkey prompt needs at least {length - n_filler} tokens; length {length} is too short")
    if filler_ids is None:
        unit = _ids(tokenizer, " " + GARBAGE)
        filler = (unit * (n_filler // max(len(unit), 1) + 1))[:n_filler]
    else:
        if len(filler_ids) < n_filler:
            raise DataError(f"the filler text has {len(filler_ids)} tokens; length {length} needs {n_filler}")
        start = (rng or random.Random(0)).randint(0, len(filler_ids) - n_filler)
        filler = filler_ids[start : start + n_filler]
    body, cut = [], 0
    for line_depth, ids in sorted(lines, key=lambda item: item[0]):
        at = round(line_depth * n_filler)
        body += filler[cut:at] + ids
        cut = at
    return head + body + filler[cut:] + tail


def plan_keys(rng: random.Random, keys: int, digits: int) -> tuple[int, int | None, tuple[Distractor, ...]]:
    """The asked passkey, its door (None for the single-key prompt) and the other doors' keys."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    passkey = rng.randint(low, high)
    if keys == 1:
        return passkey, None, ()
    doors = rng.sample(range(1, 100), keys)
    return passkey, doors[0], tuple(Distractor(d, rng.randint(low, high), rng.random()) for d in doors[1:])


def check_prompts_fit(tokenizer, lengths: list[int], filler_ids: list[int] | None, keys: int, digits: int) -> None:
    """Build the shortest and the longest prompt once, so that a length too short for the keys or a filler text too
    short for the length is refused before any model runs."""
    for length in (min(lengths), max(lengths)):
        rng = random.Random(0)
        passkey, door, distractors = plan_keys(rng, keys, digits)
        build_prompt(tokenizer, length, 0.5, passkey, filler_ids, rng, door, distractors)


def answer_is(answer: str, passkey: int) -> bool:
    match = re.search(r"\d+", answer)
    return match is not None and int(match.group()) == passkey


def run_trials(model, tokenizer, label_model: str, label_method: str, lengths: list[int], depths: list[float],
               trials: int, seed: int, filler_ids: list[int] | None, max_new_tokens: int = 10, accelerator=None,
               progress: bool = True, keys: int = 1, key_digits: int = 5) -> list[Trial]:
    """Every (length, depth, trial), split across processes when ``accelerator`` has several, gathered in order."""
    plan = []
    for length in lengths:
        for depth in depths:
            for t in range(trials):
                rng = random.Random(f"{seed}-{length}-{depth}-{t}")
                plan.append((length, depth, t, *plan_keys(rng, keys, key_digits), rng))

    def prompt_of(i: int) -> list[int]:
        length, depth, _, key, door, distractors, rng = plan[i]
        return build_prompt(tokenizer, length, depth, key, filler_ids, rng, door, distractors)

    def score(i: int, ids, answer: str) -> Trial:
        length, depth, t, key, door, _, _ = plan[i]
        return Trial(label_model, label_method, length, depth, t, key, answer, answer_is(answer, key), door)

    return greedy_answers(model, tokenizer, len(plan), prompt_of, score, max_new_tokens, accelerator,
                          f"passkey {label_method}", progress)


def accuracy_table(trials: list[Trial]) -> dict[tuple[str, int, float], tuple[float, int]]:
    counts: dict[tuple[str, int, float], list[int]] = {}
    for t in trials:
        key = (tables.row_label(t.model, t.method, t.replaced or None), t.length, t.depth)
        c = counts.setdefault(key, [0, 0])
        c[0] += int(t.correct)
        c[1] += 1
    return {k: (v[0] / v[1], v[1]) for k, v in counts.items()}


def write_outputs(directory: Path, trials: list[Trial], settings: dict, lengths: list[int],
                  depths: list[float]) -> dict:
    table = accuracy_table(trials)
    tables.write_passkey_csv(directory / "passkey.csv", table)
    write_json(directory / "passkey.json", {"settings": settings,
                                            "accuracy": [{"model": k[0], "length": k[1], "depth": k[2],
                                                          "accuracy": v[0], "trials": v[1]} for k, v in table.items()],
                                            "trials": [asdict(t) for t in trials]})
    tables.passkey_heatmap(directory / "passkey.png", table, lengths, depths)
    return table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc passkey", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens (default %(default)s)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey depths in [0, 1] (default %(default)s)")
    p.add_argument("--trials", type=int, default=5, help="trials per length and depth (default %(default)s)")
    p.add_argument("--keys", type=int, default=1,
                   help="pass keys in the prompt, each for its own door; one is asked (default %(default)s)")
    p.add_argument("--key-digits", type=int, default=5, help="digits of each pass key (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the pass keys and where they go")
    p.add_argument("--filler-file", default=None, help="real text as filler instead of the repeated grass/sky lines")
    p.add_argument("--encoding", default=DEFAULT_ENCODING, help="encoding of --filler-file")
    p.add_argument("--max-new-tokens", type=int, default=10, help="tokens generated for each answer")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--output-dir", type=Path, default=Path("runs/passkey"), help="where the results go")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-memory-check", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse nonsense settings before any model is loaded."""
    check_at_least(args, 1, "trials", "max_new_tokens", "threads", "keys", "key_digits")
    if args.keys > 98:
        raise UsageError(f"--keys is {args.keys}; at most 98 doors (1..99) fit in one prompt")
    if args.key_digits > 18:
        raise UsageError(f"--key-digits is {args.key_digits}; use at most 18")
    check_encoding(args.encoding)


def run_passkey(args: argparse.Namespace, accelerator=None) -> tuple[list[Trial], dict, list[int], list[float]]:
    import torch

    check_args(args)
    lengths = parse_numbers(args.lengths, "--lengths", int)
    depths = parse_numbers(args.depths, "--depths")
    if not lengths or not depths or args.trials < 1:
        raise UsageError("need at least one length, one depth and one trial")
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise UsageError(f"--depths must lie in [0, 1], got {depths}")
    requests = [MethodRequest.parse(m) for m in (args.method or [UNPATCHED])]
    for request in requests:
        request.check()
    filler_text = read_text(args.filler_file, args.encoding) if args.filler_file else None
    main_process = is_main(accelerator)
    device = accelerator.device if accelerator is not None else torch.device("cpu")
    trials: list[Trial] = []
    for model_spec in args.model or [SMOLLM2]:
        model, tokenizer = load_model(model_spec, dtype=DTYPES[args.dtype], tokenizer=args.tokenizer,
                                      verbose=main_process and not args.no_progress)
        model.to(device)
        filler_ids = None
        if filler_text is not None:
            filler_ids = _ids(tokenizer, filler_text[: max(lengths) * 12])
        check_prompts_fit(tokenizer, lengths, filler_ids, args.keys, args.key_digits)
        if not args.no_memory_check:
            check_memory(estimate_forward_bytes(model, max(lengths)), f"a {max(lengths)}-token prompt")
        for request in requests:
            request.check_patchable(model)
        name = model_name(model_spec)
        load = loader(model_spec, DTYPES[args.dtype], args.tokenizer, device)
        for request, model, replaced in each_method(model, requests, load):
            t0 = time.perf_counter()
            got = run_trials(model, tokenizer, name, request.label, lengths, depths, args.trials, args.seed, filler_ids,
                             args.max_new_tokens, accelerator, not args.no_progress, args.keys, args.key_digits)
            for trial in got:
                trial.replaced = replaced
            trials.extend(got)
            if main_process:
                acc = sum(t.correct for t in got) / len(got)
                print(f"  {tables.row_label(name, request.label, replaced or None)}: accuracy {acc:.0%} over "
                      f"{len(got)} trials ({time.perf_counter() - t0:.0f} s)", flush=True)
    settings = {**settings_of(args),
                "lengths": lengths, "depths": depths, "prompt": {"task": TASK, "garbage": GARBAGE,
                                                                  "question": QUESTION, "info": info_line(12345)},
                "num_processes": process_count(accelerator), "versions": versions()}
    return trials, settings, lengths, depths


def run(args: argparse.Namespace) -> None:
    """The command: run the trials, write ``--output-dir`` (from the main process), print the table."""
    set_threads(args.threads)
    check_args(args)
    accelerator = accelerator_if_launched()
    main_process = is_main(accelerator)
    check_output_dir_on_main(accelerator, args.output_dir, "passkey", args.overwrite)
    with atomic_output_dir(args.output_dir, "passkey", args.overwrite, enabled=main_process) as out:
        trials, settings, lengths, depths = run_passkey(args, accelerator)
        if main_process:
            table = write_outputs(out, trials, settings, lengths, depths)
    if main_process:
        print()
        print(tables.passkey_markdown(table, lengths, depths))
        print(f"wrote {args.output_dir}/passkey.csv, passkey.json, passkey.png")
