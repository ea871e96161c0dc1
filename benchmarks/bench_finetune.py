"""Fine-tune throughput: tokens/s and peak memory of `hf-posenc finetune`'s own training step (forward, loss over
every position, backward, gradient clipping, AdamW) on SmolLM2-135M's shapes (LLaMA: hidden 576, 9 heads, 3 KV
heads, MLP 1536, vocabulary 49152, tied embeddings; random weights, since speed does not depend on them), for native
RoPE and every method, with and without gradient checkpointing, as ratios to native in the same run. Prints a table
and writes bench_finetune.json and bench_finetune.png to --output-dir.

    .venv/bin/python benchmarks/bench_finetune.py --lengths 512,2048,4096 --layers 30 --output-dir runs/bench_finetune

--layers 30 is the real depth; fewer layers keep the same per-layer work at a fraction of the time (the ratios to
native change little, since every layer is the same). Times are taken first for every case with the allocator as
users have it; peak memory afterwards, as in bench_attention.py (on CUDA the allocator's own peak counter does not
change the timing, so the peak is read in the timing pass, over one more step). A case that fails (a method that
cannot run at this length or precision on this machine) gets a row with its error and the run goes on.

--compile BACKEND adds, for every case, the same step with the prepared model under torch.compile (what
`accelerate launch --dynamo_backend BACKEND` runs; --compile-mode reduce-overhead for CUDA graphs, --compile-fullgraph
for one graph), beside the uncompiled row: `x uncompiled` is its tokens/s over the same method's uncompiled row. The
fine-tune checks the compiled step against the uncompiled model in the warm-up (finetune.checked_compiled_loss); a
row whose compiled step was refused there says so and times the uncompiled model.

--attention-path PATH runs the methods under hf_posenc's attention path PATH (`compiled`: the content methods'
blocks under torch.compile, checked first; docs/attention-paths.md); the JSON's `attention_path` says which.

--paired keeps native's model of each setting and runs one of its steps just before each timed step of every method:
`x native` is then the median over the timed steps of native's time over the method's, so a machine whose load
changes during the run (other jobs on a shared CPU) moves both sides of each ratio alike. Native's model is held
beside each method's (twice the weights and optimizer state in memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import _fix_mmap_threshold, device_name, peak_mib, synchronize  # noqa: E402

from hf_posenc import available_methods  # noqa: E402
from hf_posenc.tools.machine import machine_description, machine_header  # noqa: E402
from hf_posenc.engine.attention import (ATTENTION_PATHS, KernelCheckWarning, attention_path,  # noqa: E402
                                       get_attention_path, last_paths)  # noqa: E402

LENGTHS = [512, 2048, 4096]
# What the contract suite needs to patch a method with no options of its own (RoPE scalings need a factor, ...).
OPTIONS = {"alibi": "alibi:trainable=true", "linear": "linear:factor=2", "ntk": "ntk:factor=4",
           "dynamic": "dynamic:factor=4", "yarn": "yarn:factor=4", "dynamic-yarn": "dynamic-yarn:factor=4",
           "llama3": "llama3:factor=8", "self-extend": "self-extend:window=256,group=4",
           "rerope": "rerope:window=256"}
SKIP = {"rope-2d": "takes 2-D position_ids", "longrope": "needs per-frequency factors for the model",
        "rope": "SmolLM2's own mechanism: the native row"}


def default_methods() -> list[str]:
    return [OPTIONS.get(name, name) for name in available_methods() if name not in SKIP]


@dataclass
class Row:
    method: str
    length: int
    checkpointing: bool
    step_s: float
    tokens_per_s: float
    peak_mib: float = float("nan")
    throughput_ratio: float = 1.0  # tokens/s over native's (same length and checkpointing)
    peak_ratio: float = float("nan")
    error: str = ""  # why this case has no figures (the exception it raised)
    # attention calls per path over the timed steps (attention.last_paths: "blocked", "flex", "causal", ...), and the
    # kernel checks that refused a kernel on this device (KernelCheckWarning), so a slow or large row says which
    # path it took
    paths: dict = field(default_factory=dict)
    refused: list = field(default_factory=list)
    compiled: str = ""  # "" uncompiled, else "BACKEND[:MODE][:fullgraph]"
    compiled_step: dict | None = None  # the fine-tune's check of the compiled step (served or not, both losses)
    compile_speedup: float = float("nan")  # tokens/s over the same method's uncompiled row
    # --paired: native's step time over this case's, one per timed step, each native step run just before this
    # case's; throughput_ratio is their median (a load that changes over the run moves both alike)
    pair_ratios: list = field(default_factory=list)
    attention_path: str = "auto"  # hf_posenc.attention.set_attention_path for the methods' rows (--attention-path)


def smollm2_shaped(layers: int, max_length: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max(8192, max_length),
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
                         rms_norm_eps=1e-5)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()


def training(model, length: int, checkpointing: bool, steps: int, mixed_precision: str = "no", compiled: str = ""):
    """The fine-tune's training objects (finetune.prepare_training) over random blocks, and its step function;
    `compiled` ("BACKEND[:MODE][:fullgraph]"): the prepared model under torch.compile, as accelerate wraps it."""
    from accelerate import Accelerator

    from hf_posenc.tools import finetune

    args = finetune.settings(max_length=length, batch_size=1, max_steps=steps + 1, gradient_checkpointing=checkpointing,
                             no_memory_check=True, lr=1e-5)
    blocks = torch.randint(0, model.config.vocab_size, (steps + 1, length), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(length).expand_as(blocks)  # one document per block: positions 0..L-1
    data = finetune.TrainingData([], blocks.numel(), blocks, blocks[:0], positions, positions[:0])
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=mixed_precision)
    prepared = finetune.prepare_training(args, accelerator, model, data)
    if compiled:
        backend, *rest = compiled.split(":")
        mode = next((part for part in rest if part != "fullgraph"), None)
        prepared.model = torch.compile(prepared.model, backend=backend, mode=mode, fullgraph="fullgraph" in rest)
    prepared.model.train()
    device = prepared.accelerator.device

    def step_and_wait(step):
        finetune.training_step(args, prepared, blocks[step % len(blocks)][None].to(device), step)
        synchronize(device)

    step_and_wait.device = device
    step_and_wait.prepared = prepared
    return step_and_wait


def run_benchmark(lengths=LENGTHS, methods=None, layers: int = 30, steps: int = 2, checkpointing=(False, True),
                  threads: int | None = None, memory: bool = True, progress: bool = True,
                  mixed_precision: str = "no", on_row=None, compile_with: str = "", paired: bool = False,
                  path: str = "auto") -> list[Row]:
    """Time every case, then (with ``memory``) measure its peak; ``on_row(rows)`` after every measurement (a run
    cut short keeps what it measured). ``paired``: native's model of the same setting is kept, and each timed step of
    a method follows one of native's (see Row.pair_ratios). ``path``: the attention path the methods run under
    (hf_posenc.attention.set_attention_path; native RoPE does not take it)."""
    with attention_path(path):
        return _run_benchmark(lengths, methods, layers, steps, checkpointing, threads, memory, progress,
                              mixed_precision, on_row, compile_with, paired)


def _run_benchmark(lengths, methods, layers, steps, checkpointing, threads, memory, progress, mixed_precision, on_row,
                   compile_with, paired) -> list[Row]:
    from hf_posenc.tools.progress import progress as progress_bar

    from hf_posenc.tools.runtime import MethodRequest

    if threads:
        torch.set_num_threads(threads)
    methods = list(methods or default_methods())
    requests = {spec: MethodRequest.parse(spec) for spec in methods}
    for request in requests.values():
        request.check()
    jobs = [(length, gc, method, compiled) for length in lengths for gc in checkpointing
            for method in ["native", *methods] for compiled in ["", *([compile_with] if compile_with else [])]]

    def build(length, gc, method, compiled=""):
        _release_memory()
        torch._dynamo.reset()
        model = smollm2_shaped(layers, length)
        if method != "native":
            requests[method].apply(model)
        return training(model, length, gc, steps, mixed_precision, compiled)

    rows, native, uncompiled = [], {}, {}
    native_steps = {}  # --paired: native's step of each setting, kept while that setting's methods run

    def timed(step, index):
        start = time.perf_counter()
        step(index)
        return time.perf_counter() - start

    for length, gc, method, compiled in progress_bar(jobs, enabled=progress, desc="bench_finetune: time"):
        beside = native_steps.get((length, gc, compiled)) if method != "native" else None
        try:
            if method == "native" and paired:  # a new setting: the previous settings' native models go
                for key in [key for key in native_steps if key[:2] != (length, gc)]:
                    del native_steps[key]
            step = build(length, gc, method, compiled)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", KernelCheckWarning)
                step(0)  # warm-up (and compilation, where a path compiles)
            last_paths.clear()
            times, pair_ratios = [], []
            for index in range(1, steps + 1):
                if beside is not None:
                    paths = last_paths.copy()
                    native_seconds = timed(beside, index)
                    last_paths.clear()
                    last_paths.update(paths)
                times.append(timed(step, index))
                if beside is not None:
                    pair_ratios.append(native_seconds / times[-1])
            seconds = statistics.median(times)
            row = Row(method, length, gc, seconds, length / seconds, paths=dict(last_paths),
                      refused=[str(w.message)[:300] for w in caught if issubclass(w.category, KernelCheckWarning)],
                      compiled=compiled, compiled_step=step.prepared.compiled_step, pair_ratios=pair_ratios)
            if method == "native" and paired:
                native_steps[length, gc, compiled] = step
            if memory and step.device.type == "cuda":
                row.peak_mib = peak_mib(lambda: step(steps + 1), step.device)
        except Exception as error:  # noqa: BLE001 (the row records it; native's failure ends the run)
            if method == "native":
                raise
            traceback.print_exc()  # the row keeps the message; where it came from goes to stderr
            row = Row(method, length, gc, float("nan"), float("nan"), error=f"{type(error).__name__}: {error}"[:500],
                      compiled=compiled)
        step = None
        native.setdefault((length, gc, compiled), row)
        uncompiled.setdefault((length, gc, method), row)
        row.throughput_ratio = (statistics.median(row.pair_ratios) if row.pair_ratios
                                else row.tokens_per_s / native[length, gc, compiled].tokens_per_s)
        row.peak_ratio = row.peak_mib / native[length, gc, compiled].peak_mib
        row.compile_speedup = row.tokens_per_s / uncompiled[length, gc, method].tokens_per_s
        row.attention_path = get_attention_path()
        rows.append(row)
        if on_row:
            on_row(rows)
    native_steps.clear()
    if memory and not torch.cuda.is_available():
        _fix_mmap_threshold()
        for row in progress_bar(rows, enabled=progress, desc="bench_finetune: memory"):
            if row.error:
                continue
            step = build(row.length, row.checkpointing, row.method, row.compiled)
            step(0)  # optimizer state allocated, as in the timed steps
            row.peak_mib = peak_mib(lambda: step(1), step.device)
            row.peak_ratio = row.peak_mib / native[row.length, row.checkpointing, row.compiled].peak_mib
            step = None
            if on_row:
                on_row(rows)
    return rows


def _release_memory() -> None:
    """Free the previous case's model and optimizer before building the next (their cycles, and CUDA's cache)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def paths_cell(row: Row) -> str:
    """"blocked 60, flex 30", and "(a kernel refused)" where a kernel check refused one during the warm-up."""
    served = ", ".join(f"{path} {count}" for path, count in sorted(row.paths.items())) or "-"
    return served + (" (a kernel refused)" if row.refused else "")


def compiled_cell(row: Row) -> str:
    """"-" uncompiled; else the compile setting, and "(refused: uncompiled)" where the fine-tune's check refused it."""
    if not row.compiled:
        return "-"
    refused = row.compiled_step is not None and not row.compiled_step.get("served")
    return row.compiled + (" (refused: uncompiled)" if refused else "")


def format_table(rows: list[Row]) -> str:
    compiling = any(r.compiled for r in rows)
    extra = " compiled | x uncompiled |" if compiling else ""
    lines = ["| method | L | checkpointing |" + extra + " step s | tokens/s | x native | peak MiB | x native | "
             "attention calls |", "| --- " * (9 + 2 * compiling) + "|"]
    for r in rows:
        head = f"| {r.method} | {r.length} | {'yes' if r.checkpointing else 'no'} |"
        if compiling:
            head += f" {compiled_cell(r)} | {r.compile_speedup:.2f} |"
        if r.error:
            lines.append(f"{head} failed: {r.error} |")
            continue
        lines.append(f"{head} {r.step_s:.2f} | {r.tokens_per_s:.0f} | {r.throughput_ratio:.2f} | {r.peak_mib:.0f} | "
                     f"{r.peak_ratio:.2f} | {paths_cell(r)} |")
    return "\n".join(lines)


def save(rows: list[Row], output_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_finetune.json"}
    device = device_name("cuda" if torch.cuda.is_available() else "cpu")
    machine = machine_description()
    paths["json"].write_text(json.dumps([{**asdict(r), "device": device, "machine": machine} for r in rows], indent=2))
    if not plot:
        return paths
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    rows = [r for r in rows if not r.compiled]  # the plot: uncompiled ratios to native (the table has the rest)
    settings = sorted({(r.length, r.checkpointing) for r in rows})
    methods = list(dict.fromkeys(r.method for r in rows if r.method != "native"))
    figure, axis = plt.subplots(figsize=(max(8, 0.45 * len(methods) * len(settings)), 4.5))
    width = 0.8 / len(settings)
    for index, (length, gc) in enumerate(settings):
        ratios = {r.method: r.throughput_ratio for r in rows if (r.length, r.checkpointing) == (length, gc)}
        axis.bar([m + index * width for m in range(len(methods))], [ratios.get(m, float("nan")) for m in methods],
                 width, label=f"L={length}{', checkpointing' if gc else ''}")
    axis.axhline(1.0, color="k", linewidth=0.8)
    axis.axhline(0.9, color="k", linestyle="--", linewidth=0.8)
    axis.set_xticks([m + 0.4 - width / 2 for m in range(len(methods))], methods, rotation=60, ha="right")
    axis.set_ylabel("tokens/s / native RoPE")
    axis.set_title("fine-tune step throughput on SmolLM2-135M shapes")
    axis.legend(fontsize=8)
    figure.tight_layout()
    paths["png"] = out / "bench_finetune.png"
    figure.savefig(paths["png"], dpi=120)
    plt.close(figure)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated (default %(default)s)")
    parser.add_argument("--methods", default=None,
                        help="semicolon-separated methods with options (default: every method but "
                             f"{', '.join(SKIP)})")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30; default %(default)s)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per case, after one warm-up (median)")
    parser.add_argument("--checkpointing", default="no,yes", help="gradient checkpointing: no, yes or no,yes")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-memory", action="store_true", help="times only")
    parser.add_argument("--mixed-precision", default="no", choices=("no", "bf16", "fp16"),
                        help="accelerate's mixed precision (CUDA; default no: fp32)")
    parser.add_argument("--compile", default="", metavar="BACKEND",
                        help="also time each case under torch.compile with this backend (inductor, aot_eager, ...)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode (reduce-overhead: CUDA graphs)")
    parser.add_argument("--compile-fullgraph", action="store_true", help="one graph (a method that cannot be "
                        "traced as one is then refused by the fine-tune's check and timed uncompiled)")
    parser.add_argument("--paired", action="store_true", help="each timed step of a method follows one of native's "
                        "(kept in memory): the ratio is the median of those pairs' (for a machine whose load changes)")
    parser.add_argument("--attention-path", default="auto", choices=ATTENTION_PATHS,
                        help="hf_posenc's attention path for the methods (compiled: content methods' blocks under "
                             "torch.compile)")
    parser.add_argument("--output-dir", default="runs/bench_finetune")
    args = parser.parse_args()
    checkpointing = tuple({"no": False, "yes": True}[x.strip()] for x in args.checkpointing.split(","))
    compile_setting = ":".join([args.compile, *([args.compile_mode] if args.compile_mode else []),
                                *(["fullgraph"] if args.compile_fullgraph else [])]) if args.compile else ""
    rows = run_benchmark([int(x) for x in args.lengths.split(",")],
                         args.methods.split(";") if args.methods else None, args.layers, args.steps, checkpointing,
                         args.threads, not args.no_memory, mixed_precision=args.mixed_precision,
                         on_row=lambda so_far: save(so_far, args.output_dir, plot=False), compile_with=compile_setting,
                         paired=args.paired, path=args.attention_path)
    print(machine_header())
    print(format_table(rows))
    for kind, path in save(rows, args.output_dir).items():
        print(f"{kind}: {path}")


if __name__ == "__main__":
    main()
