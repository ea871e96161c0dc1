"""``hf-posenc finetune``: fine-tune a model after swapping or extending its positional mechanism, with accelerate.

    hf-posenc finetune --model smollm2 --method alibi --train-only all \\
        --text-file ../shared/data/pg1342-pride-and-prejudice.txt --text-fraction 0:0.8 \\
        --max-length 512 --max-steps 200 --output-dir runs/alibi-ft
    accelerate launch --config_file scripts/accelerate_configs/ddp.yaml -m hf_posenc finetune ...

Distribution (DDP, FSDP, DeepSpeed), mixed precision and gradient accumulation come from accelerate. The text is
packed into blocks of ``--max-length`` tokens (documents joined by the EOS token). ``--train-only``: ``positional``
(only the patch's own parameters: trainable ALiBi slopes, FIRE, T5, KERPLE, learned tables...), ``all`` (the whole
model), ``lora`` (PEFT LoRA on the attention projections, plus the positional parameters; merged into the weights
when saved, or ``--save adapter``: the PEFT adapter alone, carrying the patch and its positional weights), ``qk`` /
``qkvo`` (the positional parameters and the attention's query and key, or all, projections). ``--transfer-steps N``
with ``--distill-from``: attention transfer layer by layer for the first N steps, then end-to-end distillation.

The output folder is written only at the end, atomically: the patched model (``save_pretrained``; reload with
``hf_posenc.from_pretrained(dir)``), its tokenizer, ``training_args.json`` (every setting and what the run saw),
``loss_log.csv`` / ``loss_log.json``. Resumable checkpoints (``--save-every``) go to ``--checkpoint-dir`` (default
``<output-dir>-checkpoints``), which survives a failed run; ``--resume-from`` takes one of them or ``latest``
(the newest complete one; see checkpoints.py). Where the output folder cannot be written at the end (a full
disk), the run goes into a new folder under $TMPDIR instead, and the one error line says where.
Tracker logs (``--report-to tensorboard`` etc.) are written live to ``--logging-dir`` (default ``<output-dir>-logs``).

The parts, one module each: ``arguments`` (options and their checks), ``data`` (the packed text), ``positions``
(PoSE ids, document restarts), ``teacher`` (distillation), ``teacher_samples`` (text the teacher writes),
``attention_transfer`` (the per-layer loss), ``prepare`` (accelerator, what trains, optimizer, schedule, loaders),
``loss``, ``loop`` (the training loop), ``compiled_step`` (the check of a compiled step), ``checkpoints``
(resumable checkpoints and resuming) and ``saving`` (the output folder); ``tools/sharding`` (the FSDP2 units
of a patched model, a ZeRO-3 parameter read whole) serves the memory estimate too. ``run_finetune`` below puts
them together.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ..models import load_model
from ..outputs import CHECKPOINTS_SUFFIX, beside, check_output_dir_on_main, output_path, remove_leftovers
from ..runtime import DTYPES, set_threads
from ..text import documents_of
from .arguments import LR_SCHEDULERS, SAVE_FORMS, TRAIN_ONLY, build_parser, check_args, settings
from .checkpoints import Progress, resume_point, resume_progress, resume_settings
from .compiled_step import COMPILED_STEP_TOLERANCE, checked_compiled_loss, compile_error_text
from .data import TrainingData, position_options, training_data, with_samples
from .loop import NonFiniteLoss, train, training_step
from .loss import evaluate_loss, model_inputs, step_loss
from .prepare import (Training, enable_gradient_checkpointing, lora_targets, make_accelerator, prepare_training,
                      release_prepared, select_trainable, trackers_for)
from .saving import run_summary, save_output, weights_digest, write_loss_log
from ..sharding import fsdp_wrap_units
from .teacher import make_teacher
from .teacher_samples import teacher_samples

__all__ = ["COMPILED_STEP_TOLERANCE", "LR_SCHEDULERS", "NonFiniteLoss", "Progress", "SAVE_FORMS", "TRAIN_ONLY",
           "Training", "TrainingData", "build_parser", "check_args", "checked_compiled_loss", "compile_error_text",
           "documents_of", "enable_gradient_checkpointing", "evaluate_loss", "fsdp_wrap_units", "lora_targets",
           "model_inputs", "position_options", "prepare_training", "release_prepared", "run", "run_finetune", "select_trainable",
           "settings", "step_loss", "training_data", "training_step", "weights_digest", "write_loss_log"]


def run_finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``finetune`` does, from its settings (``settings(...)`` or parsed options); returns the run
    summary (also written as ``training_args.json``)."""
    import torch
    from accelerate.utils import set_seed

    request = check_args(args)
    started = time.perf_counter()
    output_dir = output_path(args.output_dir)
    # Not inside --output-dir: that folder is written atomically at the end, and the logs are wanted while training.
    logging_dir = args.logging_dir or beside(output_dir, "-logs")
    trackers = trackers_for(args.report_to, logging_dir)
    accelerator = make_accelerator(args, trackers, logging_dir)
    checkpoint_dir = output_path(args.checkpoint_dir or beside(output_dir, CHECKPOINTS_SUFFIX))
    # Before any training: a folder that cannot be written would otherwise fail the run at its end, or at a save.
    check_output_dir_on_main(accelerator, output_dir, "finetune", args.overwrite,
                             also_writable={"--checkpoint-dir": checkpoint_dir} if args.save_every else None)
    if accelerator.is_main_process:
        remove_leftovers(checkpoint_dir)  # a killed run's partial checkpoints
    set_seed(args.seed)
    run_settings = resume_settings(args, request)
    resume = resume_point(args, checkpoint_dir, run_settings, accelerator.is_main_process)

    docs = documents_of(args)  # text first: a missing or too-short corpus fails before the model is loaded
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], tokenizer=args.tokenizer,
                                  verbose=accelerator.is_main_process and not args.no_progress)
    data = training_data(args, tokenizer, docs, accelerator.num_processes)
    restarts = position_options(args, model)
    teacher = make_teacher(args, model)
    samples = teacher_samples(args, accelerator, model, teacher, tokenizer,
                              say=print if accelerator.is_main_process else None)
    if samples is not None:
        data = with_samples(data, samples.blocks)
    if request is not None:
        torch.manual_seed(args.seed)  # methods with randomly initialised parameters start the same everywhere
        request.apply(model)
    from hf_posenc import get_posenc_config, get_positional_module

    if restarts and getattr(get_positional_module(model), "position_axes", 1) > 1:
        # A method over 2-D coordinates (rope-2d) refuses 1-D position ids: its documents are read as one grid row.
        restarts = False

    posenc = get_posenc_config(model)
    bias_fit = fit_bias(args, accelerator, model, teacher, data) if resume is None else None
    training = prepare_training(args, accelerator, model, data, teacher)
    training.bias_fit = bias_fit
    training.teacher_samples = samples
    training.teacher = teacher.to(accelerator.device) if teacher is not None else None
    training.restarts = restarts
    if trackers:
        accelerator.init_trackers("hf_posenc_finetune", config=_flat_config(args))
    progress = resume_progress(accelerator, resume)
    from hf_posenc.engine.attention import attention_path

    try:
        with attention_path(args.attention_path):
            train(args, training, progress, checkpoint_dir, started, bool(trackers), run_settings)
        summary = run_summary(args, training, progress, request, posenc, data, started)
        save_output(args, training, tokenizer, posenc, summary, progress.log, checkpoint_dir)
    finally:  # a run stopped by a raise (a diverging loss, an interrupt) too
        release_prepared(training)
        # It also destroys the process group, without which a rank can abort at exit under DDP.
        accelerator.end_training()
    return summary


def fit_bias(args: argparse.Namespace, accelerator, model, teacher, data):
    """--fit-bias-steps: the bias fitted to the teacher's attention before any training (bias_fit.py), on every
    process alike (the same blocks), before accelerate wraps the model; None without it. On the process's device
    where the engine keeps whole models there (none, DDP); a sharding engine's model stays where it was loaded."""
    if not args.fit_bias_steps:
        return None
    from ..progress import progress as progress_bar
    from ..text import DataError
    from .bias_fit import fit_positional_bias
    from .prepare import engine_of

    verbose = accelerator.is_main_process
    if engine_of(accelerator) in ("none", "ddp"):
        model.to(accelerator.device)
        teacher.to(accelerator.device)
    joined = (args.fit_bias_length or args.max_length) // args.max_length
    text_blocks = data.train_blocks[:data.train_blocks.shape[0] - data.sample_blocks]  # consecutive: the text's
    blocks = text_blocks[:args.fit_bias_blocks * joined]
    if blocks.shape[0] < joined:
        raise DataError(f"--fit-bias-length {args.fit_bias_length}: the training text has {text_blocks.shape[0]} "
                        f"blocks of {args.max_length} tokens, fewer than the {joined} one fit block joins; lower "
                        "--fit-bias-length or add text")
    blocks = blocks[:blocks.shape[0] // joined * joined].reshape(-1, joined * args.max_length)
    bar = progress_bar(total=args.fit_bias_steps, desc="fit bias", unit="step",
                       enabled=verbose and not args.no_progress)
    try:
        device = next(model.parameters()).device
        fit = fit_positional_bias(model, teacher, blocks.to(device), args.fit_bias_steps, args.fit_bias_lr,
                                  progress=lambda step: bar.update(1), queries=args.fit_bias_queries)
    finally:
        bar.close()
    if verbose:
        print(f"fit bias: KL to the teacher's attention {fit.kl_before:.4f} -> {fit.kl_after:.4f} in {fit.steps} "
              f"steps ({fit.seconds:.0f} s)", flush=True)
        if not fit.kl_after < fit.kl_before:  # every step rose above the start, which the fit kept
            print(f"warning: --fit-bias-steps {fit.steps} did not lower the KL from the method's start, so the bias "
                  "starts as it would without the fit; try more steps, another --fit-bias-lr (now "
                  f"{args.fit_bias_lr:g}), or a start nearer the original's attention (FIRE's ALiBi-like default "
                  "rose for its first steps on SmolLM2 where fire:init=random fell)", file=sys.stderr, flush=True)
    return fit


def _flat_config(args) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in vars(args).items()}


def run(args: argparse.Namespace) -> None:
    """The command: fine-tune, then say what happened (from the first process)."""
    set_threads(args.threads)
    summary = run_finetune(args)
    if int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))) == 0:
        losses = (f"; loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
                  if summary["final_loss"] is not None else "")
        print(f"trained {summary['steps_done']} steps in {summary['seconds']:.0f} s{losses}", flush=True)
        print(f"saved to {args.output_dir}", flush=True)
