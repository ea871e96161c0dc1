"""The options of ``hf-posenc finetune`` (``build_parser``), its settings as a namespace (``settings``), and the
checks that refuse nonsense settings before anything runs (``check_args``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...errors import PosEncError
from ..models import SMOLLM2
from ..outputs import OVERWRITE_HELP
from ..runtime import (DTYPES, UNPATCHED, DefaultsHelpFormatter, MethodRequest, UsageError, check_at_least,
                       check_number, parse_options, settings_from)
from ..text import add_text_arguments, check_encoding

DESCRIPTION = "fine-tune a model after swapping or extending its positional mechanism, with accelerate"


TRAIN_ONLY = ("positional", "all", "lora", "qk", "qkvo")
SAVE_FORMS = ("merged", "adapter")
# transformers schedulers that need nothing beyond warm-up and total steps
LR_SCHEDULERS = ("cosine", "linear", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc finetune", description=DESCRIPTION,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--model", default=SMOLLM2,
                   help="local checkpoint, Hub id, .gguf file, or 'smollm2' (the bundled SmolLM2-135M-Instruct, "
                        "de-quantised from Q4_1)")
    p.add_argument("--tokenizer", default=None, help="tokenizer to use instead of the model's own")
    p.add_argument("--method", default=None,
                   help="positional method to patch in before training, NAME[:KEY=VALUE,...] (default: none, train "
                        "the model as loaded)")
    p.add_argument("--method-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of --method, value parsed as JSON when it can be (factor=4, slopes=\"geometric\"); "
                        "repeatable")
    p.add_argument("--train-only", choices=TRAIN_ONLY, default="all",
                   help="what trains: the patch's own parameters, the whole model, LoRA (+ the positional ones), or "
                        "the positional parameters and the attention's query and key projections (qk; a fused "
                        "query-key-value projection, GPT-2's or BLOOM's, trains whole) or all its projections (qkvo)")
    p.add_argument("--lora-r", type=int, default=8, help="LoRA rank")
    p.add_argument("--lora-alpha", type=int, default=16, help="LoRA scaling numerator (the update is alpha / r)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on LoRA's input")
    p.add_argument("--save", choices=SAVE_FORMS, default="merged",
                   help="with --train-only lora: 'merged' writes the whole model with LoRA merged in; 'adapter' "
                        "writes only the PEFT adapter, with the patch and its positional weights (reload with "
                        "hf_posenc.from_pretrained(dir) or hf_posenc.load_adapter(dir, base_model=...))")
    add_text_arguments(p, split="train")
    p.add_argument("--max-length", type=int, default=512, help="training context, tokens per block")
    p.add_argument("--max-steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", "--learning-rate", type=float, default=5e-5, help="peak learning rate (AdamW)")
    p.add_argument("--positional-lr", type=float, default=None,
                   help="learning rate of the positional parameters (default: --lr)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's weight decay")
    p.add_argument("--lr-scheduler", default="cosine", choices=LR_SCHEDULERS,
                   help="learning-rate schedule (transformers.get_scheduler)")
    p.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (default: 10%% of --max-steps)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--batch-size", type=int, default=1, help="blocks per process and micro-step")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in the backward (less memory, more time)")
    p.add_argument("--attention-path", default="auto",
                   help="hf_posenc's attention path while training: auto, blocked, flex, flash, or compiled "
                        "(CoPE's, stick-breaking's and the other content methods' per-block chains under "
                        "torch.compile, checked against the eager blocks first; docs/attention-paths.md)")
    p.add_argument("--mixed-precision", choices=("no", "fp16", "bf16"), default=None,
                   help="default: accelerate's config (no)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data order, new parameters, PoSE and dropout")
    p.add_argument("--eval-blocks", type=int, default=0,
                   help="blocks held out from the end of the packed text for periodic evaluation (0: none)")
    p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="resumable checkpoint every N steps (0: none)")
    p.add_argument("--save-total-limit", type=int, default=2, help="checkpoints kept (oldest removed)")
    p.add_argument("--checkpoint-dir", type=Path, default=None, help="default: <output-dir>-checkpoints")
    p.add_argument("--resume-from", default=None, help="a checkpoint folder, or 'latest' in --checkpoint-dir")
    p.add_argument("--output-dir", type=Path, default=Path("runs/finetune"),
                   help="where the trained model goes, written at the end")
    p.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    p.add_argument("--report-to", default="none",
                   help="accelerate trackers (tensorboard, wandb, ...; 'all' = every installed one)")
    p.add_argument("--logging-dir", type=Path, default=None,
                   help="where trackers write, live during training (default: <output-dir>-logs)")
    p.add_argument("--log-every", type=int, default=1, help="log the loss every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype the weights are loaded in")
    p.add_argument("--no-memory-check", action="store_true",
                   help="train even where the estimated memory exceeds what is free")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("positions and distillation (docs/finetuning-and-evaluation.md)")
    g.add_argument("--document-restarts", action=argparse.BooleanOptionalAction, default=True,
                   help="position ids restart at each document of a packed block, and attention does not cross "
                        "documents (families whose forward takes no position_ids, BLOOM, train as packed); off "
                        "under --pose-target-length")
    g.add_argument("--pose-target-length", type=int, default=None,
                   help="PoSE: position ids of each --max-length window split into chunks with random skips that "
                        "cover this many positions (Zhu et al. 2023; default: off)")
    g.add_argument("--pose-chunks", type=int, default=2, help="PoSE chunks per window (the paper uses 2)")
    g.add_argument("--distill-from", default=None,
                   help="'original' (the model before the patch) or a checkpoint PATH: train to match its next-token "
                        "distributions (KL at --distill-temperature, mixed with the LM loss by --distill-alpha)")
    g.add_argument("--distill-temperature", type=float, default=1.0, help="temperature of the KL term")
    g.add_argument("--distill-alpha", type=float, default=0.5,
                   help="weight of the KL term (1: KL only, 0: LM loss only)")
    g.add_argument("--transfer-steps", type=int, default=0,
                   help="attention transfer first (LoLCATs): the first N of --max-steps train each patched attention "
                        "layer to give the --distill-from teacher's attention output on the teacher's own input to "
                        "that layer (relative MSE, averaged over the changed layers), the rest distil end to end; "
                        "blocks are cut to the teacher's window for it. Needs --distill-from and --train-only "
                        "positional, qk, qkvo or lora")
    g.add_argument("--fit-bias-steps", type=int, default=0,
                   help="before training, N Adam steps that fit the patch's bias parameters alone to the "
                        "--distill-from teacher's attention weights, layer by layer on the teacher's own inputs "
                        "(KL over the first --fit-bias-blocks training blocks): a start near the original for "
                        "t5:per_layer=true, fire, kerple, sandwich or trainable alibi. Needs --distill-from")
    g.add_argument("--fit-bias-blocks", type=int, default=4,
                   help="blocks the bias fit reads (memory: 8 x blocks x heads x queries x length bytes per layer)")
    g.add_argument("--fit-bias-length", type=int, default=None,
                   help="tokens per block of the bias fit, a multiple of --max-length (consecutive training blocks "
                        "joined: the text is packed without gaps); default --max-length")
    g.add_argument("--fit-bias-queries", type=int, default=None,
                   help="the fit reads the last N queries of each block, those that see the most keys (default all)")
    g.add_argument("--fit-bias-lr", type=float, default=0.05, help="Adam's learning rate in the bias fit")
    g.add_argument("--teacher-samples", type=int, default=0,
                   help="before training, N blocks of --max-length tokens sampled from the --distill-from teacher "
                        "(from its end-of-text token, in batches seeded from --seed) join the "
                        "training blocks: text the original wrote, which carries its distribution past the "
                        "training text's words (teacher_samples.py)")
    g.add_argument("--teacher-sample-temperature", type=float, default=1.0,
                   help="sampling temperature of --teacher-samples")
    g.add_argument("--teacher-sample-batch", type=int, default=32,
                   help="rows per generate call of --teacher-samples (each batch seeded on its own: the blocks "
                        "depend on it)")
    g.add_argument("--teacher-sample-top-k", type=int, default=0,
                   help="--teacher-samples draw from the K likeliest tokens at each step (0: from all, the teacher's "
                        "own distribution; generate's usual default is 50)")
    g.add_argument("--teacher-samples-file", type=Path, default=None,
                   help="keeps the --teacher-samples (token ids and the settings that drew them): read where it "
                        "exists with the same settings, else written after sampling; a resumed run reads it "
                        "instead of sampling again")
    return p


def settings(**overrides) -> argparse.Namespace:
    """The settings of a fine-tune: the command's defaults with ``overrides`` (e.g. ``method="kerple"``,
    ``text_file=[path]``, ``max_steps=60``), for ``run_finetune``."""
    return settings_from(build_parser(), **overrides)


def check_bias_fit(args: argparse.Namespace) -> None:
    """--fit-bias-steps: a stage before training, towards a teacher's attention."""
    check_number("--fit-bias-steps", args.fit_bias_steps, 0)
    check_number("--fit-bias-blocks", args.fit_bias_blocks, 1)
    check_number("--fit-bias-lr", args.fit_bias_lr, 0, above=True)
    if args.fit_bias_length is not None and (args.fit_bias_length < args.max_length or
                                             args.fit_bias_length % args.max_length):
        raise UsageError(f"--fit-bias-length {args.fit_bias_length} must be a multiple of --max-length "
                         f"{args.max_length}: its blocks are consecutive training blocks joined")
    if args.fit_bias_queries is not None:
        check_number("--fit-bias-queries", args.fit_bias_queries, 1)
    if args.fit_bias_steps and args.distill_from is None:
        raise PosEncError(f"--fit-bias-steps {args.fit_bias_steps} fits the bias to a teacher's attention: add "
                          "--distill-from original (or a checkpoint folder)")


def check_teacher_samples(args: argparse.Namespace) -> None:
    """--teacher-samples: blocks a teacher writes before training."""
    check_number("--teacher-samples", args.teacher_samples, 0)
    check_number("--teacher-sample-temperature", args.teacher_sample_temperature, 0, above=True)
    check_number("--teacher-sample-top-k", args.teacher_sample_top_k, 0, hint="0 draws from every token")
    check_number("--teacher-sample-batch", args.teacher_sample_batch, 1)
    if args.teacher_samples and args.distill_from is None:
        raise PosEncError(f"--teacher-samples {args.teacher_samples} samples text from a teacher: add "
                          "--distill-from original (or a checkpoint folder)")
    if args.teacher_samples_file is not None:
        if not args.teacher_samples:
            raise UsageError("--teacher-samples-file keeps the blocks of --teacher-samples: add --teacher-samples N")
        if args.teacher_samples_file.is_dir():
            raise UsageError(f"--teacher-samples-file {args.teacher_samples_file} is a folder; give a file path "
                             "(e.g. runs/teacher-samples.pt)")


def check_transfer(args: argparse.Namespace) -> None:
    """--transfer-steps: a stage of --max-steps, with a teacher, training the attention alone."""
    check_number("--transfer-steps", args.transfer_steps, 0, maximum=args.max_steps,
                 hint="the transfer stage is part of --max-steps")
    if not args.transfer_steps:
        return
    if args.distill_from is None:
        raise PosEncError(f"--transfer-steps {args.transfer_steps} trains each layer towards a teacher's attention: "
                          "add --distill-from original (or a checkpoint folder)")
    if args.train_only == "all":
        raise PosEncError("--transfer-steps trains the attention alone, and --train-only all would leave the rest "
                          "of the model without gradients (and DDP waiting for them): use --train-only positional, "
                          "qk, qkvo or lora")


def check_args(args: argparse.Namespace) -> MethodRequest | None:
    """Refuse nonsense settings before anything runs; returns the method to patch in (None: none)."""
    import torch

    check_at_least(args, 1, "max_steps", "batch_size", "gradient_accumulation_steps", "lora_r", "lora_alpha",
                   "log_every", "save_total_limit", "threads")
    check_at_least(args, 0, "eval_blocks", "eval_every", "save_every", "weight_decay")
    check_number("--max-length", args.max_length, 2)
    from hf_posenc.engine.attention import ATTENTION_PATHS

    if args.attention_path not in ATTENTION_PATHS:
        raise UsageError(f"--attention-path {args.attention_path!r} is unknown; use one of "
                         f"{', '.join(ATTENTION_PATHS)}")
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
    if args.save == "adapter" and args.train_only != "lora":
        raise UsageError(f"--save adapter needs --train-only lora (now {args.train_only}): only LoRA makes an "
                         "adapter; leave --save at merged")
    if args.lr_scheduler not in LR_SCHEDULERS:
        raise UsageError(f"--lr-scheduler {args.lr_scheduler!r}: choose one of {', '.join(LR_SCHEDULERS)}")
    if args.pose_target_length is not None and args.pose_target_length <= args.max_length:
        raise UsageError(f"--pose-target-length {args.pose_target_length} must be longer than --max-length "
                         f"{args.max_length}: PoSE covers a target length longer than its training windows")
    if not 1 <= args.pose_chunks <= args.max_length:
        raise UsageError(f"--pose-chunks must be from 1 to --max-length ({args.max_length}), got {args.pose_chunks}")
    check_number("--distill-temperature", args.distill_temperature, 0, above=True)
    check_number("--distill-alpha", args.distill_alpha, 0, maximum=1, hint="the KL's weight")
    if args.distill_from is not None and args.distill_from != "original" and not Path(args.distill_from).exists():
        raise UsageError(f"--distill-from {args.distill_from}: give 'original' (the model before the patch) or an "
                         "existing checkpoint folder")
    check_transfer(args)
    check_bias_fit(args)
    check_teacher_samples(args)
    check_encoding(args.encoding)
    extra_options = parse_options(args.method_option)
    if extra_options and not args.method:
        raise UsageError("--method-option needs --method")
    if not args.method or args.method.lower() == UNPATCHED:
        return None
    asked = MethodRequest.parse(args.method)
    if asked.parts and extra_options:
        raise UsageError(f"--method-option with a hybrid of several methods ({args.method}): write each option in "
                         "its part of --method (e.g. 'kerple:layers=every:2+yarn:factor=2,layers=rest')")
    request = asked if asked.parts else MethodRequest(asked.name, {**asked.options, **extra_options})
    request.check()
    return request
