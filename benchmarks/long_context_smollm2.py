"""Training-free context extension on a real model: SmolLM2-135M (trained window 8192) past its window.

Three parts, each a sub-command writing into --output-dir (files are rewritten after every method, so a run cut short
still leaves the methods it finished):

  ppl      perplexity vs context length (eval-ppl's protocol, non-overlapping windows, --max-windows per length) on
           held-out text (default: the last 20 % of Pride and Prejudice in ../shared/data), one row per method, all
           from one run -> perplexity.{json,csv,png}
  passkey  passkey retrieval (hf-posenc passkey's prompt, greedy) at --lengths -> passkey.{json,csv,png}
  merge-ppl  one table and plot from the perplexity.json of several ppl runs (--from DIR, repeatable)
  timing   prefill of an L-token prompt and --new-tokens greedy decode steps with a KV cache, per method beside
           native RoPE in the same run (methods interleaved per length) -> timing.{json,csv,png}

Methods (default): the model as loaded ("none"), yarn and dynamic NTK at factor 2 (16k / 8k), self-extend,
rerope and sinks at their defaults. Every part uses the library's own functions (tools.eval_ppl.run_eval,
tools.passkey.run_trials, tools.models.load_model).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/long_context_smollm2.py ppl \\
        --lengths 12288,16384,4096 --max-windows 1 --output-dir docs/figures/long_context_smollm2
    ... passkey --lengths 16384 --depths 0.5 --trials 1
    ... timing --lengths 2048,4096,8192 --new-tokens 16

On CPU one 16k forward of SmolLM2 takes minutes (plain-matmul methods longer than SDPA); see docs/rope-extension.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import device_name, synchronize  # noqa: E402

from hf_posenc.engine.cache_names import forward_cache_keyword  # noqa: E402
from hf_posenc.tools import eval_ppl, passkey, tables  # noqa: E402
from hf_posenc.tools.models import load_model, model_name  # noqa: E402
from hf_posenc.tools.outputs import write_json  # noqa: E402
from hf_posenc.tools.runtime import MethodRequest, versions  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
DEFAULT_TEXT = str(DATA / "pg1342-pride-and-prejudice.txt")
DEFAULT_METHODS = ("none", "yarn:factor=2", "dynamic:factor=2", "self-extend", "rerope", "sinks")


def _methods(args) -> list[str]:
    return list(args.method or DEFAULT_METHODS)


# --- perplexity -----------------------------------------------------------------------------------------------
def run_ppl(model: str, methods, lengths, output_dir, text_file: str = DEFAULT_TEXT, text_fraction: str = "0.8:1",
            max_windows: int = 1, progress: bool = True, device: str = "cpu") -> eval_ppl.EvalRun:
    """eval-ppl's run, one (length, method) at a time in the order given (lengths outer, so a run cut short has every
    method at the first lengths), the outputs rewritten after each. ``device="cuda"`` evaluates on the GPU (one
    process, through the accelerator eval-ppl takes under ``accelerate launch``), in float32 as on the CPU."""
    accelerator = None
    if torch.device(device).type != "cpu":
        from accelerate import Accelerator

        accelerator = Accelerator()
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    whole, seconds = None, {}
    for length in lengths:
        for method in methods:
            args = eval_ppl.settings(model=[model], method=[method], lengths=[length], non_overlapping=True,
                                     max_windows=max_windows, text_file=[text_file], text_fraction=text_fraction,
                                     no_progress=not progress)
            started = time.perf_counter()
            got = eval_ppl.run_eval(args, accelerator)
            if whole is None:
                whole = got
            else:
                whole.extend(got)
            seconds[f"{method} @{length}"] = time.perf_counter() - started
            whole.settings.update(lengths=sorted({r.length for r in whole.results}), seconds=seconds,
                                  methods=list(dict.fromkeys(r.method for r in whole.results)),
                                  torch_threads=torch.get_num_threads(), device=device_name(device))
            whole.settings.pop("method", None)
            eval_ppl.write_outputs(out, whole, whole.settings["lengths"],
                                   title=f"{model_name(model)}: perplexity vs length (held-out text)")
            print(f"[ppl] {method} @{length} done in {seconds[f'{method} @{length}']:.0f} s; wrote {out}/perplexity.*",
                  flush=True)
    print(tables.perplexity_markdown(whole.table(), whole.settings["lengths"]))
    return whole


def merge_ppl(directories, output_dir, title: str = "") -> eval_ppl.EvalRun:
    """One perplexity table and plot from the perplexity.json of several runs of the same text and protocol (e.g. two
    processes, each given some of the methods)."""
    whole = None
    for directory in directories:
        data = json.loads((Path(directory) / "perplexity.json").read_text())
        run = eval_ppl.EvalRun(settings=data["settings"], training_lengths=data["training_lengths"],
                               results=[eval_ppl.LengthResult(**r) for r in data["results"]])
        if whole is None:
            whole = run
        else:
            whole.extend(run)
            whole.settings["seconds"] = {**whole.settings.get("seconds", {}), **run.settings.get("seconds", {})}
    whole.settings.update(lengths=sorted({r.length for r in whole.results}), merged_from=[str(d) for d in directories],
                          methods=list(dict.fromkeys(r.method for r in whole.results)))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    eval_ppl.write_outputs(out, whole, whole.settings["lengths"], title=title)
    print(tables.perplexity_markdown(whole.table(), whole.settings["lengths"]))
    return whole


# --- passkey --------------------------------------------------------------------------------------------------
def run_passkey(model: str, methods, lengths, depths, trials: int, output_dir, max_new_tokens: int = 8,
                seed: int = 0, progress: bool = True, device: str = "cpu") -> dict:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    net, tokenizer = load_model(model, verbose=progress)
    net.to(device)
    passkey.check_prompts_fit(tokenizer, list(lengths), None, 1, 5)
    name = model_name(model)
    all_trials, seconds = [], {}
    for method in methods:
        request = MethodRequest.parse(method)
        request.apply(net)
        started = time.perf_counter()
        got = passkey.run_trials(net, tokenizer, name, request.label, list(lengths), list(depths), trials, seed, None,
                                 max_new_tokens, progress=progress)
        seconds[method] = time.perf_counter() - started
        request.remove(net)
        all_trials.extend(got)
        settings = {"model": model, "methods": list(methods), "lengths": list(lengths), "depths": list(depths),
                    "trials": trials, "max_new_tokens": max_new_tokens, "seed": seed, "seconds_per_method": seconds,
                    "torch_threads": torch.get_num_threads(), "device": device_name(device), "versions": versions()}
        table = passkey.write_outputs(out, all_trials, settings, list(lengths), list(depths))
        answers = ", ".join(repr(t.answer) for t in got)
        print(f"[passkey] {method}: {sum(t.correct for t in got)}/{len(got)} correct ({answers}) in "
              f"{seconds[method]:.0f} s", flush=True)
    print(tables.passkey_markdown(table, list(lengths), list(depths)))
    return table


# --- prefill and decode time ----------------------------------------------------------------------------------
@torch.inference_mode()
def time_one(net, ids: torch.LongTensor, new_tokens: int, cache) -> tuple[float, float]:
    """(prefill seconds, seconds per decode step): greedy decoding of ``new_tokens`` tokens after the prompt (device
    work waited for before each clock reading)."""
    cached = {forward_cache_keyword(net): cache}
    synchronize(ids.device)
    started = time.perf_counter()
    logits = net(input_ids=ids, **cached, use_cache=True, logits_to_keep=1).logits
    synchronize(ids.device)
    prefill = time.perf_counter() - started
    token = logits[:, -1:].argmax(-1)
    started = time.perf_counter()
    for _ in range(new_tokens):
        token = net(input_ids=token, **cached, use_cache=True).logits[:, -1:].argmax(-1)
    synchronize(ids.device)
    return prefill, (time.perf_counter() - started) / max(new_tokens, 1)


def _cache(net, request: MethodRequest):
    from transformers import DynamicCache

    import hf_posenc

    if request.name == "sinks":
        return hf_posenc.sink_cache(net)  # what generate uses for a sinks model
    return DynamicCache(config=net.config)


def run_timing(model: str, methods, lengths, new_tokens: int, output_dir, text_file: str = DEFAULT_TEXT,
               progress: bool = True, device: str = "cpu", warmup: bool = False) -> dict:
    """Per length, every method in turn (native first), so load changes on a shared machine hit them alike.
    ``warmup``: one untimed run of each case first (on a GPU the first call of a shape pays for kernel selection)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    net, tokenizer = load_model(model, verbose=progress)
    net.to(device)
    text = Path(text_file).read_text(encoding="utf-8")
    stream = tokenizer(text[: max(lengths) * 8], verbose=False)["input_ids"]
    if len(stream) < max(lengths):
        raise SystemExit(f"{text_file} has {len(stream)} tokens, fewer than the longest length {max(lengths)}")
    methods = ["none", *[m for m in methods if m != "none"]]
    rows: list[dict] = []
    for length in lengths:
        ids = torch.tensor([stream[:length]], device=device)
        for method in methods:
            request = MethodRequest.parse(method)
            request.apply(net)
            if warmup:
                time_one(net, ids, min(new_tokens, 2), _cache(net, request))
            prefill, decode = time_one(net, ids, new_tokens, _cache(net, request))
            request.remove(net)
            rows.append({"method": method, "length": length, "prefill_s": prefill, "decode_ms_per_token": decode * 1e3})
            if progress:
                print(f"[timing] {method:<20} {length:>6}: prefill {prefill:7.2f} s, decode {decode * 1e3:8.1f} "
                      f"ms/token", flush=True)
            _write_timing(out, rows, {"model": model, "methods": methods, "lengths": list(lengths),
                                      "new_tokens": new_tokens, "torch_threads": torch.get_num_threads(),
                                      "machine": machine_description(),
                                      "device": device_name(device), "warmup": warmup,
                                      "versions": versions()})
    return _write_timing(out, rows, None)


def _ratios(rows: list[dict]) -> list[dict]:
    native = {r["length"]: r for r in rows if r["method"] == "none"}
    for r in rows:
        base = native.get(r["length"])
        r["prefill_ratio"] = r["prefill_s"] / base["prefill_s"] if base else None
        r["decode_ratio"] = r["decode_ms_per_token"] / base["decode_ms_per_token"] if base else None
    return rows


def _write_timing(out: Path, rows: list[dict], settings: dict | None) -> dict:
    rows = _ratios(rows)
    path = out / "timing.json"
    if settings is None:
        settings = json.loads(path.read_text())["settings"]
    data = {"settings": settings, "rows": rows}
    write_json(path, data)
    header = ["method", "length", "prefill_s", "prefill_ratio", "decode_ms_per_token", "decode_ratio"]
    lines = [",".join(header)] + [",".join("" if r[k] is None else (f"{r[k]:.4g}" if isinstance(r[k], float)
                                                                     else str(r[k])) for k in header) for r in rows]
    (out / "timing.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _plot_timing(out / "timing.png", rows)
    return data


def _plot_timing(path: Path, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in ((axes[0], "prefill_ratio", "prefill time / native RoPE"),
                           (axes[1], "decode_ratio", "decode time per token / native RoPE")):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = [(r["length"], r[key]) for r in rows if r["method"] == method and r[key] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command line ---------------------------------------------------------------------------------------------
def _numbers(text: str, kind=int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("part", choices=("ppl", "passkey", "timing", "merge-ppl"))
    p.add_argument("--from", dest="sources", action="append", default=None,
                   help="merge-ppl: an --output-dir of a ppl run; repeatable")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--method", action="append", default=None, help=f"repeatable (default: {', '.join(DEFAULT_METHODS)})")
    p.add_argument("--lengths", default=None,
                   help="ppl: 12288,16384,4096 (in this order); passkey: 16384; timing: 2048,4096,8192 (defaults)")
    p.add_argument("--max-windows", type=int, default=1, help="ppl: windows per length (default 1)")
    p.add_argument("--text-file", default=DEFAULT_TEXT)
    p.add_argument("--text-fraction", default="0.8:1", help="ppl: the held-out part of the text (default 0.8:1)")
    p.add_argument("--depths", default="0.5", help="passkey depths (default 0.5)")
    p.add_argument("--trials", type=int, default=1, help="passkey trials per depth (default 1)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="passkey answer tokens (default 8)")
    p.add_argument("--new-tokens", type=int, default=16, help="timing: decode steps (default 16)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output-dir", type=Path, default=Path("runs/long_context_smollm2"))
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: float32 either way")
    p.add_argument("--warmup", action="store_true", help="timing: one untimed run of each case first")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    methods, progress = _methods(args), not args.no_progress
    print(machine_header(), flush=True)
    if args.part == "ppl":
        run_ppl(args.model, methods, _numbers(args.lengths or "12288,16384,4096"), args.output_dir, args.text_file,
                args.text_fraction, args.max_windows, progress, args.device)
    elif args.part == "merge-ppl":
        merge_ppl(args.sources or [], args.output_dir, "SmolLM2-135M: perplexity vs length (held-out text)")
    elif args.part == "passkey":
        run_passkey(args.model, methods, _numbers(args.lengths or "16384"), _numbers(args.depths, float), args.trials,
                    args.output_dir, args.max_new_tokens, progress=progress, device=args.device)
    else:
        run_timing(args.model, methods, _numbers(args.lengths or "2048,4096,8192"), args.new_tokens, args.output_dir,
                   args.text_file, progress, args.device, args.warmup)


if __name__ == "__main__":
    sys.exit(main())
