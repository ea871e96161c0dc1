"""Short fine-tune evidence for the learned rotations (issue 13), on CPU in a few minutes: a tiny LLaMA-style model
(bytes as tokens, 2 layers, hidden 128, trained window 128 bytes) is first trained from scratch with its own RoPE, then
fine-tuned from that same base with each method (RoPE itself continued, ALiBi, ComRoPE-AP/LD, LieRE, FoPE, 2-D RoPE on
the 1 x L grid, TAPE), the same steps, data and seed; perplexity vs length on held-out text (another book) for every
fine-tuned model in one run. Everything goes through the library's own tools (tools/finetune.run_finetune,
tools/eval_ppl.run_eval), so this is also what `hf-posenc finetune` / `hf-posenc eval-ppl` do.

    nice -n 10 .venv/bin/python benchmarks/finetune_rotations.py --output-dir runs/finetune_rotations \
        --figure docs/figures/finetune_rotations

Writes <figure>.csv (a row per model, a column per length) and <figure>.png, and the runs under --output-dir.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from hf_posenc.tools.machine import machine_description, machine_header

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
TRAIN_TEXT = "pg1342-pride-and-prejudice.txt"
EVAL_TEXT = "pg84-frankenstein.txt"
# method spec (hf-posenc's NAME[:KEY=VALUE,...]) -> the row name of its fine-tuned model
METHODS = {
    "none": "rope",  # the base model's own RoPE, fine-tuned as long as the others
    "alibi": "alibi",
    "comrope-ap:block_size=4": "comrope-ap",
    "comrope-ld:block_size=8": "comrope-ld",
    "liere:block_size=8": "liere",
    "fope": "fope",
    "rope-2d": "rope-2d",
    "tape": "tape",  # init="rope": starts as the base model's RoPE, its updates at zero
}


def tiny_base(directory: Path, window: int, seed: int) -> Path:
    """A randomly initialised tiny LLaMA over bytes (ByT5's tokenizer: 259 ids, no vocabulary file, so the output
    layer costs nothing on CPU), saved as a checkpoint the tools load."""
    from transformers import AutoModelForCausalLM, ByT5Tokenizer, LlamaConfig

    tokenizer = ByT5Tokenizer(extra_ids=0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=window,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def main(argv=None):
    from hf_posenc.tools import eval_ppl, finetune

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/finetune_rotations"))
    parser.add_argument("--figure", type=Path, default=Path("docs/figures/finetune_rotations"))
    parser.add_argument("--window", type=int, default=128, help="training length (the base model's window)")
    parser.add_argument("--base-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=80, help="fine-tuning steps per method")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lengths", default="64,128,256,512,1024")
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.output_dir
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    started = time.perf_counter()
    common = dict(text_file=[str(DATA / TRAIN_TEXT)], text_fraction="0:0.9", max_length=args.window,
                  batch_size=args.batch_size, threads=args.threads, no_progress=True, no_memory_check=True,
                  log_every=50, seed=0)
    base = tiny_base(out / "init", args.window, seed=0)
    summary = {"base": finetune.run_finetune(finetune.settings(
        model=str(base), max_steps=args.base_steps, lr=2e-3, output_dir=out / "base", **common))}
    print(f"base trained: {time.perf_counter() - started:.0f} s", flush=True)
    models = []
    for spec in args.methods.split(","):
        name = METHODS.get(spec, spec.split(":")[0])
        directory = out / name
        summary[name] = finetune.run_finetune(finetune.settings(
            model=str(out / "base"), method=spec, max_steps=args.steps, lr=5e-4, positional_lr=5e-3,
            output_dir=directory, **common))
        models.append(str(directory))
        print(f"{name} fine-tuned: {time.perf_counter() - started:.0f} s", flush=True)
    lengths = [int(n) for n in args.lengths.split(",")]
    run = eval_ppl.run_eval(eval_ppl.settings(
        model=models, lengths=lengths, text_file=[str(DATA / EVAL_TEXT)], non_overlapping=True,
        max_windows=args.max_windows, threads=args.threads, no_progress=True, no_memory_check=True,
        training_length=args.window))
    eval_ppl.write_outputs(out, run, lengths, title=f"tiny LLaMA (window {args.window}), fine-tuned "
                                                    f"{args.steps} steps per method")
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(out / "perplexity.csv", args.figure.with_suffix(".csv"))
    shutil.copy(out / "perplexity.png", args.figure.with_suffix(".png"))
    losses = {name: {k: s.get(k) for k in ("final_loss", "final_eval_loss", "seconds") if k in s}
              for name, s in summary.items()}
    print(machine_header())
    (out / "summary.json").write_text(json.dumps({"losses": losses, "seconds": time.perf_counter() - started,
                                                  "machine": machine_description(),
                                                  "settings": vars(args)}, indent=2, default=str))
    print(json.dumps(losses, indent=2, default=str))
    print(f"total: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
