"""Fine-tune a model after swapping or extending its positional mechanism, with accelerate.

    accelerate launch scripts/finetune.py --model smollm2 --method alibi --train-only all \\
        --text-file ../shared/data/pg1342-pride-and-prejudice.txt --text-fraction 0:0.8 \\
        --max-length 512 --max-steps 200 --output-dir runs/alibi-ft
    accelerate launch --config_file scripts/accelerate_configs/ddp.yaml scripts/finetune.py ...

Distribution (DDP, FSDP, DeepSpeed), mixed precision and gradient accumulation come from accelerate. The text is
packed into blocks of ``--max-length`` tokens (documents joined by the EOS token). ``--train-only``: ``positional``
(only the patch's own parameters: trainable ALiBi slopes, FIRE, T5, KERPLE, learned tables...), ``all`` (the whole
model), ``lora`` (PEFT LoRA on the attention projections, plus the positional parameters; merged into the weights
when saved).

The output folder is written only at the end, atomically: the patched model (``save_pretrained``; reload with
``hf_posenc.from_pretrained(dir)``), its tokenizer, ``training_args.json`` (every setting and what the run saw),
``loss_log.csv`` / ``loss_log.json``. Resumable checkpoints (``--save-every``) go to ``--checkpoint-dir`` (default
``<output-dir>-checkpoints``), which survives a failed run; ``--resume-from`` takes one of them or ``latest``.
Tracker logs (``--report-to tensorboard`` etc.) are written live to ``--logging-dir`` (default ``<output-dir>-logs``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .data import DataError, load_documents, pack_blocks, tokenize_documents
from .runtime import (DTYPES, OVERWRITE_HELP, MethodSpec, UsageError, atomic_output_dir, check_memory, check_number,
                      check_output_dir_on_main, estimate_training_bytes, load_model, output_path, parse_options,
                      run_command, set_threads, versions, write_json)
from .text import check_encoding

TRAIN_ONLY = ("positional", "all", "lora")
LORA_TARGETS = {  # attention projections per family (PEFT target_modules regex, matched on the full name)
    "gpt2": r".*\.attn\.(c_attn|c_proj)",
    "bloom": r".*\.self_attention\.(query_key_value|dense)",
}
LLAMA_LORA_TARGETS = r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)"
STATE_FILE = "trainer_state.json"
# transformers schedulers that need nothing beyond warm-up and total steps
LR_SCHEDULERS = ("cosine", "linear", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


class NonFiniteLoss(UsageError):
    """Training diverged (a NaN or infinite loss, or weights): the run stops and saves nothing."""


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    from .eval_ppl import add_text_arguments

    p = parser or argparse.ArgumentParser(prog="hf-posenc finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2",
                   help="local checkpoint, Hub id, .gguf file, or 'smollm2' (the bundled SmolLM2-135M; default)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--method", default=None, help="positional method to patch in before training (default: none, "
                                                  "train the model as loaded)")
    p.add_argument("--method-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of --method, value parsed as JSON when it can be (factor=4, slopes=\"geometric\"); "
                        "repeatable")
    p.add_argument("--train-only", choices=TRAIN_ONLY, default="all")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.0)
    add_text_arguments(p, split="train")
    p.add_argument("--max-length", type=int, default=512, help="training context, tokens per block")
    p.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--positional-lr", type=float, default=None,
                   help="learning rate of the positional parameters (default: --lr)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-scheduler", default="cosine", choices=LR_SCHEDULERS,
                   help="transformers learning-rate schedule (default cosine)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --max-steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off; default 1)")
    p.add_argument("--batch-size", type=int, default=1, help="blocks per process and micro-step")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default=None,
                   help="default: accelerate's config (no)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-blocks", type=int, default=0,
                   help="blocks held out from the end of the packed text for periodic evaluation (default 0: none)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="resumable checkpoint every N steps (0: none)")
    p.add_argument("--save-total-limit", type=int, default=2, help="checkpoints kept (oldest removed)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: <output-dir>-checkpoints")
    p.add_argument("--resume-from", default=None, help="a checkpoint folder, or 'latest' in --checkpoint-dir")
    p.add_argument("--output-dir", type=Path, default=Path("runs/finetune"))
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--report-to", default="none",
                   help="accelerate trackers (tensorboard, wandb, ...; 'all' = every installed one; default none)")
    p.add_argument("--logging-dir", type=Path, default=None,
                   help="where trackers write, live during training (default: <output-dir>-logs)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--no-memory-check", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p


def check_args(args: argparse.Namespace) -> MethodSpec | None:
    """Refuse nonsense settings before anything runs; returns the method to patch in (None: none)."""
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "lora_r", "lora_alpha", "log_every",
                 "save_total_limit", "threads"):
        check_number(_flag(name), getattr(args, name), 1)
    for name in ("eval_blocks", "eval_every", "save_every", "weight_decay"):
        check_number(_flag(name), getattr(args, name), 0)
    check_number("--max-length", args.max_length, 2)
    check_number("--seed", args.seed, 0, maximum=2**32 - 1)
    # AdamW adds lr / (1 - beta1) = 10 lr to the weights in its first step (and multiplies them by 1 - lr * weight
    # decay): a number the weights' dtype cannot hold stops it with an overflow error, so it is refused here.
    largest = torch.finfo(DTYPES[args.dtype]).max / 10
    for option, lr in (("--lr", args.lr), ("--positional-lr", args.positional_lr)):
        check_number(option, lr, 0, above=True, maximum=largest, hint=f"AdamW's first step is 10 x {option}, "
                     f"which {args.dtype} weights must hold")
        if lr is not None and args.weight_decay * lr > largest:
            raise UsageError(f"--weight-decay {args.weight_decay:g} x {option} {lr:g} overflows {args.dtype} weights")
    check_number("--max-grad-norm", args.max_grad_norm, 0, hint="0 turns clipping off")
    check_number("--warmup-steps", args.warmup_steps, 0, maximum=args.max_steps,
                 hint="warm-up is part of --max-steps")
    if not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora-dropout must be in [0, 1), got {args.lora_dropout:g}")
    if args.lr_scheduler not in LR_SCHEDULERS:
        raise UsageError(f"--lr-scheduler {args.lr_scheduler!r}: choose one of {', '.join(LR_SCHEDULERS)}")
    check_encoding(args.encoding)
    options = parse_options(args.method_option)
    if options and not args.method:
        raise UsageError("--method-option needs --method")
    if not args.method or args.method == "none":
        return None
    spec = MethodSpec(args.method.lower(), options)
    spec.check()
    return spec


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# --- trainable parameters ----------------------------------------------------------------------------------
def positional_parameters(model) -> list[torch.nn.Parameter]:
    from hf_posenc import get_positional_module

    module = get_positional_module(model)
    return [] if module is None else list(module.parameters())


def select_trainable(model, train_only: str, args: argparse.Namespace):
    """Set ``requires_grad`` per ``--train-only``; returns (model, positional parameter ids). For ``lora`` the
    model comes back wrapped in a PEFT model."""
    positional = positional_parameters(model)
    positional_ids = {id(p) for p in positional}
    if train_only == "positional":
        if not positional:
            raise UsageError("--train-only positional: this patch has no trainable parameters (only trainable "
                             "methods have them, e.g. alibi with trainable=true, fire, t5, kerple, learned); "
                             "use --train-only all or lora")
        for p in model.parameters():
            p.requires_grad_(id(p) in positional_ids)
    elif train_only == "all":
        for p in model.parameters():
            p.requires_grad_(True)
    else:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise UsageError("--train-only lora needs PEFT: pip install peft") from None
        target = lora_targets(model)
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=target, bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        for p in positional:  # PEFT froze everything that is not LoRA; the positional parameters train too
            p.requires_grad_(True)
    return model, positional_ids


def lora_targets(model) -> list[str]:
    """Full names of the attention projections LoRA wraps. A projection that carries a hook of the positional
    patch (RoPE on GPT-2 / BLOOM rotates the fused qkv output in a forward hook) is left out: PEFT would add its
    update after the hook, unrotated."""
    import re

    pattern = re.compile(LORA_TARGETS.get(model.config.model_type, LLAMA_LORA_TARGETS) + "$")
    names, hooked = [], []
    for name, module in model.named_modules():
        if pattern.match(name):
            (hooked if module._forward_hooks or module._forward_pre_hooks else names).append(name)
    if hooked:
        print(f"LoRA leaves out {len(hooked)} projection(s) that the positional patch hooks "
              f"(e.g. {hooked[0]}); they stay frozen", file=sys.stderr)
    if not names:
        raise UsageError("--train-only lora: no attention projection of this model can take LoRA "
                         f"(pattern {pattern.pattern}; hooked by the patch: {len(hooked)})")
    return names


def weights_digest(model) -> str:
    """SHA-256 of every trainable parameter's bytes (to check that all processes hold the same weights)."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- the run -----------------------------------------------------------------------------------------------
def _latest_checkpoint(directory: Path) -> Path | None:
    steps = sorted((int(p.name.split("-")[1]), p) for p in directory.glob("step-*")
                   if p.name.split("-")[1].isdigit() and (p / STATE_FILE).is_file()) if directory.is_dir() else []
    return steps[-1][1] if steps else None


def run_finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``finetune`` does; returns the run summary (also written as ``training_args.json``)."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, gather_object, set_seed
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    spec = check_args(args)
    start_time = time.perf_counter()
    output_dir = output_path(args.output_dir)
    # Not inside --output-dir: that folder is written atomically at the end, and the logs are wanted while training.
    logging_dir = args.logging_dir or _beside(output_dir, "-logs")
    trackers = _trackers(args.report_to, logging_dir)
    try:
        accelerator = Accelerator(
            mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.gradient_accumulation_steps,
            cpu=not torch.cuda.is_available(), log_with=trackers or None,
            project_config=ProjectConfiguration(project_dir=str(logging_dir), logging_dir=str(logging_dir))
            if trackers else None,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    except RuntimeError as error:
        if "no available devices" not in str(error):
            raise
        # accelerate's FSDP and DeepSpeed plugins need an accelerator: they refuse CPU-only machines.
        raise UsageError(f"this accelerate configuration needs GPUs ({error}); on a CPU-only machine launch with "
                         "scripts/accelerate_configs/ddp.yaml (several CPU processes) or cpu_single.yaml") from None
    main_process = accelerator.is_main_process
    world = accelerator.num_processes
    check_output_dir_on_main(accelerator, output_dir, "finetune", args.overwrite)
    set_seed(args.seed)
    checkpoint_dir = args.checkpoint_dir or _beside(output_dir, "-checkpoints")
    resume = None
    if args.resume_from:
        resume = _latest_checkpoint(checkpoint_dir) if args.resume_from == "latest" else Path(args.resume_from)
        if resume is None or not (resume / STATE_FILE).is_file():
            raise UsageError(f"--resume-from {args.resume_from}: no checkpoint there "
                             f"(looked for {STATE_FILE} in {resume or checkpoint_dir})")

    # Text first: a missing or too-short corpus fails before the model is loaded.
    docs = load_documents(args.text_file, args.dataset, args.dataset_config, args.split, args.text_column,
                          args.text_fraction, args.start_text, encoding=args.encoding)
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], tokenizer=args.tokenizer,
                                  verbose=main_process and not args.no_progress)
    token_docs = tokenize_documents(tokenizer, docs)
    blocks = pack_blocks(token_docs, args.max_length, tokenizer.eos_token_id)
    n_tokens = sum(int(t.numel()) for t in token_docs)
    needed_blocks = args.batch_size * world + args.eval_blocks
    if blocks.shape[0] < needed_blocks:
        raise DataError(
            f"the training text has {n_tokens} tokens ({len(docs)} document(s)); blocks of {args.max_length} tokens for "
            f"batch {args.batch_size} x {world} process(es)" + (f" + {args.eval_blocks} eval blocks" if args.eval_blocks
                                                                else "")
            + f" need at least {needed_blocks * args.max_length} tokens")
    eval_blocks = blocks[blocks.shape[0] - args.eval_blocks:] if args.eval_blocks else blocks[:0]
    train_blocks = blocks[: blocks.shape[0] - args.eval_blocks]

    if spec is not None:
        torch.manual_seed(args.seed)  # methods with randomly initialised parameters start the same everywhere
        spec.apply(model)
    from hf_posenc import get_posenc_config

    posenc = get_posenc_config(model)
    model, positional_ids = select_trainable(model, args.train_only, args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    if not args.no_memory_check:
        check_memory(estimate_training_bytes(model, args.max_length, args.batch_size, n_trainable,
                                             args.gradient_checkpointing),
                     f"training on {args.batch_size} x {args.max_length} tokens")
    if args.gradient_checkpointing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.config.use_cache = False
    positional_lr = args.positional_lr or args.lr
    groups = [{"params": [p for p in trainable if id(p) not in positional_ids], "lr": args.lr},
              {"params": [p for p in trainable if id(p) in positional_ids], "lr": positional_lr}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, weight_decay=args.weight_decay)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(0, round(0.1 * args.max_steps))
    scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=warmup,
                              num_training_steps=args.max_steps)
    generator = torch.Generator().manual_seed(args.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(train_blocks), batch_size=args.batch_size,
                                         shuffle=True, drop_last=True, generator=generator)
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(eval_blocks), batch_size=args.batch_size)
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, loader, eval_loader,
                                                                           scheduler)
    if trackers:
        accelerator.init_trackers("hf_posenc_finetune", config=_flat_config(args))

    step, epoch, skip, log = 0, 0, 0, []
    if resume is not None:
        accelerator.load_state(str(resume))
        state = json.loads((resume / STATE_FILE).read_text())
        step, epoch, skip, log = state["step"], state["epoch"], state["batches_in_epoch"], state["log"]
        if main_process:
            print(f"resumed from {resume} at step {step}", flush=True)
    if len(loader) == 0:
        raise DataError("no full training batch per process; add text or lower --batch-size / --max-length")

    bar = tqdm(total=args.max_steps, initial=step, desc="finetune", unit="step",
               disable=args.no_progress or not main_process)
    model.train()
    window_loss, window_count = 0.0, 0
    done = step >= args.max_steps
    while not done:
        loader.set_epoch(epoch)
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch_index, (batch,) in enumerate(batches, start=skip):
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                # The mean over processes: every process sees the same number, so a divergence stops all together.
                mean_loss = accelerator.gather(loss.detach().float()[None]).mean().item()
                if not math.isfinite(mean_loss):
                    raise NonFiniteLoss(f"the training loss is {mean_loss} at step {step + 1}; " + _diverged(args))
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm:
                    accelerator.clip_grad_norm_(trainable, args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            window_loss += mean_loss
            window_count += 1
            if not accelerator.sync_gradients:
                continue
            step += 1
            bar.update(1)
            if step % args.log_every == 0 or step == args.max_steps:
                entry = {"step": step, "loss": window_loss / window_count, "lr": scheduler.get_last_lr()[0],
                         "tokens": step * args.batch_size * args.gradient_accumulation_steps * world * args.max_length,
                         "seconds": round(time.perf_counter() - start_time, 2)}
                window_loss, window_count = 0.0, 0
                if args.eval_blocks and args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
                    entry["eval_loss"] = evaluate_loss(model, eval_loader, accelerator)
                    model.train()
                log.append(entry)
                bar.set_postfix(loss=f"{entry['loss']:.3f}")
                if trackers:
                    accelerator.log({k: v for k, v in entry.items() if k != "step"}, step=step)
            if args.save_every and step % args.save_every == 0 and step < args.max_steps:
                save_checkpoint(accelerator, checkpoint_dir, step, epoch, batch_index + 1, log, args.save_total_limit)
            if step >= args.max_steps:
                done = True
                break
        epoch, skip = epoch + 1, 0
    bar.close()
    if not weights_are_finite(model, accelerator):  # the last update comes after the last loss checked
        raise NonFiniteLoss(f"the update of step {step} left weights that are not finite; " + _diverged(args))

    unwrapped = accelerator.unwrap_model(model)
    digests = gather_object([weights_digest(unwrapped)])
    if args.train_only == "lora":
        unwrapped = unwrapped.merge_and_unload()
    summary = {
        "command": "finetune",
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
        "method_options": spec.options if spec else {},
        "posenc_config": posenc.to_dict() if posenc is not None else None,
        "num_processes": world,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision_used": accelerator.mixed_precision,
        "warmup_steps_used": warmup,
        "effective_batch_blocks": args.batch_size * args.gradient_accumulation_steps * world,
        "tokens_per_step": args.batch_size * args.gradient_accumulation_steps * world * args.max_length,
        "steps_done": step,
        "trainable_parameters": n_trainable,
        "data": {"documents": [d.name for d in docs], "tokens": n_tokens, "train_blocks": int(train_blocks.shape[0]),
                 "eval_blocks": int(eval_blocks.shape[0]), "text_fraction": args.text_fraction},
        "first_loss": log[0]["loss"] if log else None,
        "final_loss": log[-1]["loss"] if log else None,
        "final_eval_loss": next((e["eval_loss"] for e in reversed(log) if "eval_loss" in e), None),
        "weights_sha256_per_process": digests,
        "seconds": round(time.perf_counter() - start_time, 2),
        "versions": versions(),
    }
    state_dict = None
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED") and args.train_only != "lora":
        state_dict = accelerator.get_state_dict(model)  # a collective: every process takes part
    # checked at the start: a --checkpoint-dir or --logging-dir inside --output-dir may have appeared since
    with atomic_output_dir(output_dir, "finetune", args.overwrite, enabled=main_process, checked=True) as out:
        if main_process:
            unwrapped.save_pretrained(out, state_dict=state_dict)
            tokenizer.save_pretrained(out)
            if posenc is not None and not (out / "posenc_config.json").is_file():
                write_json(out / "posenc_config.json", posenc.to_dict())  # a save_pretrained without the hook
            write_json(out / "training_args.json", summary)
            write_loss_log(out, log)
    accelerator.wait_for_everyone()
    if trackers:
        accelerator.end_training()
    return summary


def _beside(output_dir: Path, suffix: str) -> Path:
    return output_dir.with_name(output_dir.name + suffix) if output_dir.name else output_dir / suffix.lstrip("-")


def _diverged(args: argparse.Namespace) -> str:
    return (f"training stopped and nothing was saved to --output-dir {args.output_dir}; lower --lr (now {args.lr:g})"
            + (" or --positional-lr" if args.positional_lr else "")
            + (", turn --max-grad-norm on" if not args.max_grad_norm else "")
            + (", or use --mixed-precision bf16" if args.mixed_precision == "fp16" else ""))


def weights_are_finite(model, accelerator) -> bool:
    """Whether every trainable parameter holds finite values, on every process (one pass over the weights)."""
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)
    return bool(accelerator.gather(torch.tensor([int(finite)], device=accelerator.device)).all())


def evaluate_loss(model, loader, accelerator) -> float:
    """Mean token loss over the held-out blocks (every process takes its share; gathered)."""
    model.eval()
    losses = []
    with torch.no_grad():
        for (batch,) in loader:
            losses.append(accelerator.gather_for_metrics(model(input_ids=batch, labels=batch).loss.detach()[None]))
    return float(torch.cat(losses).float().mean()) if losses else float("nan")


def save_checkpoint(accelerator, directory: Path, step: int, epoch: int, batches_in_epoch: int, log, limit: int):
    path = directory / f"step-{step}"
    accelerator.save_state(str(path))
    if accelerator.is_main_process:
        (path / STATE_FILE).write_text(json.dumps({"step": step, "epoch": epoch, "batches_in_epoch": batches_in_epoch,
                                                   "log": log}, indent=2))
        old = sorted((int(p.name.split("-")[1]), p) for p in directory.glob("step-*")  # ours: they hold STATE_FILE
                     if p.name.split("-")[1].isdigit() and (p / STATE_FILE).is_file())
        for _, stale in old[: max(0, len(old) - limit)]:
            import shutil

            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()


def write_loss_log(directory: Path, log: list[dict]) -> None:
    write_json(directory / "loss_log.json", log)
    keys = ["step", "loss", "eval_loss", "lr", "tokens", "seconds"]
    with open(directory / "loss_log.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(log)


def _trackers(report_to: str, logging_dir: Path) -> list[str]:
    """The accelerate trackers asked for; a named one whose package is missing is an error, not a silent no-op."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, filter_trackers

    if report_to in ("none", "", None):
        return []
    if report_to == "all":
        return filter_trackers("all", str(logging_dir))
    wanted = [t.strip() for t in report_to.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in LOGGER_TYPE_TO_CLASS]
    if unknown:
        raise UsageError(f"--report-to {', '.join(unknown)}: unknown tracker; accelerate knows "
                         f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    available = [str(t) for t in filter_trackers(wanted, str(logging_dir))]
    missing = [t for t in wanted if t not in available]
    if missing:
        raise UsageError(f"--report-to {', '.join(missing)}: its package is not installed (pip install "
                         f"{' '.join(missing)}), or leave it out")
    return wanted


def _flat_config(args) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: _finetune_and_report(args))


def _finetune_and_report(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    summary = run_finetune(args)
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        losses = (f"; loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
                  if summary["final_loss"] is not None else "")
        print(f"trained {summary['steps_done']} steps in {summary['seconds']:.0f} s{losses}", flush=True)
        print(f"saved to {args.output_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
