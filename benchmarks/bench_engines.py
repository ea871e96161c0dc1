"""Distributed engines on the CPU: seconds per training step of a patched LLaMA under DDP, DeepSpeed ZeRO-2 and
ZeRO-3 (DeepSpeed's CPU accelerator) and torch's FSDP2 (``fully_shard`` along ``fsdp_wrap_units``), on 2 gloo
processes, as ratios to DDP in the same run. Prints a table and writes bench_engines.json and bench_engines.png to
--output-dir.

    .venv/bin/python benchmarks/bench_engines.py --output-dir runs/bench_engines

Every engine's model is built first, then the timed rounds interleave them (DDP, ZeRO-2, ZeRO-3, FSDP2, DDP, ...),
so a machine whose load changes moves every engine alike; `x DDP` is the median over the rounds of DDP's time over
the engine's (below 1: slower). A step is the forward, the backward (with the engine's gradient reduction) and
AdamW; each process runs its own --batch blocks of --length tokens. The estimated state per process (weights,
gradients, AdamW and what the engine gathers: tools/estimates.estimate_training_bytes) stands beside each row.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

from hf_posenc.tools.machine import machine_description, machine_header

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a spawned process finds this script by its name

ENGINES = ("ddp", "zero2", "zero3", "fsdp2")
TITLES = {"ddp": "DDP", "zero2": "ZeRO-2", "zero3": "ZeRO-3", "fsdp2": "FSDP2"}


def build_model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_posenc

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
                         num_key_value_heads=max(1, args.hidden // 192), max_position_embeddings=args.length)
    model = LlamaForCausalLM(config)
    torch.manual_seed(0)  # the method's own parameters start alike in every process
    return hf_posenc.patch_model(model, args.method).train()


def adamw_step(module):
    """A step of forward, backward and AdamW on `module` (DDP's wrapper, or a model sharded in place by FSDP2)."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step(ids):
        module(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return step


def prepared(engine: str, args, mesh):
    """(step function, model) for `engine`; the step runs forward, backward and AdamW on `ids`."""
    model = build_model(args)
    if engine == "ddp":
        return adamw_step(torch.nn.parallel.DistributedDataParallel(model)), model
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        from hf_posenc.tools.finetune import fsdp_wrap_units

        for unit in fsdp_wrap_units(model):
            fully_shard(unit, mesh=mesh)
        return adamw_step(model), model
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "zero_optimization": {"stage": int(engine[-1])}, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def step(ids):
        ds_engine.backward(ds_engine(input_ids=ids, labels=ids).loss)
        ds_engine.step()
    return step, model


def worker(rank: int, world: int, port: int, args, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), DS_ACCELERATOR="cpu")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    from hf_posenc.tools.estimates import engine_state_bytes

    engines = {}
    for engine in args.engines:
        engines[engine] = prepared(engine, args, mesh)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), generator=torch.Generator().manual_seed(rank))
    for step, _ in engines.values():  # warm-up: first-step allocations, DeepSpeed's buckets
        for _ in range(args.warmup):
            step(ids)
    times = {engine: [] for engine in engines}
    for _ in range(args.rounds):
        for engine, (step, _) in engines.items():
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.steps):
                step(ids)
            elapsed = torch.tensor([(time.perf_counter() - started) / args.steps])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when its slowest process does
            times[engine].append(elapsed.item())
    if rank == 0:
        reference = build_model(args)
        trainable = sum(p.numel() for p in reference.parameters())
        rows = []
        for engine, seconds in times.items():
            ratios = [d / s for d, s in zip(times["ddp"], seconds)] if "ddp" in times else None
            rows.append({"engine": engine, "seconds_per_step": statistics.median(seconds),
                         "x_ddp": statistics.median(ratios) if ratios else None, "rounds": seconds,
                         "estimated_state_mib_per_process":
                         engine_state_bytes(reference, trainable, engine, world) / 2**20})
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args) -> dict:
    import torch.multiprocessing as mp

    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows_file = args.output_dir / "bench_engines.rows.json"
    load_before = os.getloadavg()
    mp.spawn(worker, args=(args.processes, free_port(), args, str(rows_file)), nprocs=args.processes, join=True)
    rows = json.loads(rows_file.read_text())
    rows_file.unlink()
    parameters = sum(p.numel() for p in build_model(args).parameters())
    result = {"machine": machine_description(), "processes": args.processes, "threads_per_process": args.threads,
              "method": args.method, "parameters": parameters, "hidden": args.hidden, "layers": args.layers,
              "vocab": args.vocab, "length": args.length, "batch_per_process": args.batch, "steps": args.steps,
              "rounds": args.rounds, "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "torch": torch.__version__, "rows": rows}
    (args.output_dir / "bench_engines.json").write_text(json.dumps(result, indent=2))
    print(machine_header(result["machine"]))
    print(table(result))
    plot(result, args.output_dir / "bench_engines.png")
    return result


def table(result: dict) -> str:
    lines = [f"{result['method']} on a {result['parameters'] / 1e6:.1f}M-parameter LLaMA, {result['processes']} CPU "
             f"processes x {result['batch_per_process']} x {result['length']} tokens (load "
             f"{result['load_average_before'][0]:.1f} -> {result['load_average_after'][0]:.1f})",
             "| engine | s/step | x DDP | est. state MiB/process |", "| --- | --- | --- | --- |"]
    for row in result["rows"]:
        ratio = f"{row['x_ddp']:.2f}" if row["x_ddp"] is not None else "-"
        lines.append(f"| {TITLES[row['engine']]} | {row['seconds_per_step']:.3f} | {ratio} | "
                     f"{row['estimated_state_mib_per_process']:.0f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    bars = ax.bar([TITLES[r["engine"]] for r in rows], [r["seconds_per_step"] for r in rows], color="#4477aa")
    for bar, row in zip(bars, rows):
        if row["x_ddp"] is not None:
            ax.annotate(f"{row['x_ddp']:.2f}x DDP", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
    ax.set_ylim(0, 1.15 * max(r["seconds_per_step"] for r in rows))  # room for the labels
    ax.set_ylabel("seconds per step")
    ax.set_title(f"{result['processes']} CPU processes, {result['method']}, {result['length']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES), help="from " + ", ".join(ENGINES))
    parser.add_argument("--method", default="kerple", help="the positional method the model is patched with")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--length", type=int, default=256, help="tokens per block")
    parser.add_argument("--batch", type=int, default=2, help="blocks per process and step")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per engine")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/bench_engines"),
                        help="where bench_engines.json and .png are written")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        parser.error(f"--engines {','.join(unknown)}: choose from {', '.join(ENGINES)}")
    return run(args)


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
