"""``hf-posenc finetune``: fine-tune a model after swapping or extending its positional mechanism, with accelerate.

    hf-posenc finetune --model smollm2 --method alibi --train-only all \\
        --text-file ../shared/data/pg1342-pride-and-prejudice.txt --text-fraction 0:0.8 \\
        --max-length 512 --max-steps 200 --output-dir runs/alibi-ft
    accelerate launch --config_file scripts/accelerate_configs/ddp.yaml -m hf_posenc finetune ...

Distribution (DDP, FSDP, DeepSpeed), mixed precision and gradient accumulation come from accelerate. The text is
packed into blocks of ``--max-length`` tokens (documents joined by the EOS token). ``--train-only``: ``positional``
(only the patch's own parameters: trainable ALiBi slopes, FIRE, T5, KERPLE, learned tables...), ``all`` (the whole
model), ``lora`` (PEFT LoRA on the attention projections, plus the positional parameters; merged into the weights
when saved, or ``--save adapter``: the PEFT adapter alone, carrying the patch and its positional weights).

The output folder is written only at the end, atomically: the patched model (``save_pretrained``; reload with
``hf_posenc.from_pretrained(dir)``), its tokenizer, ``training_args.json`` (every setting and what the run saw),
``loss_log.csv`` / ``loss_log.json``. Resumable checkpoints (``--save-every``) go to ``--checkpoint-dir`` (default
``<output-dir>-checkpoints``), which survives a failed run; ``--resume-from`` takes one of them or ``latest``
(the newest complete one; see train_checkpoints.py). Where the output folder cannot be written at the end (a full
disk), the run goes into a new folder under $TMPDIR instead, and the one error line says where.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only; torch is imported where it is used, so that --help stays fast
    import torch

from .estimates import check_memory, estimate_training_bytes
from ..registry import get_family
from .models import SMOLLM2, load_model
from .outputs import (OVERWRITE_HELP, check_output_dir_on_main, output_path, raise_on_every_process, remove_leftovers,
                      write_json, write_or_rescue)
from .runtime import (DTYPES, UNPATCHED, MethodRequest, UsageError, check_at_least, check_number, parse_options,
                      set_threads, settings_from, settings_of, uncompiled, versions)
from .text import DataError, add_text_arguments, check_encoding, documents_of, pack_blocks, tokenize_documents
from .train_checkpoints import STATE_FILE, IncompleteCheckpoint, latest_checkpoint, read_state, save_checkpoint
from .training_positions import pack_documents

TRAIN_ONLY = ("positional", "all", "lora")
SAVE_FORMS = ("merged", "adapter")
# What a resumed run must share with the run that saved the checkpoint: the model, what trains, the data, the schedule.
# (--method is compared as the method and options it resolves to, whichever way it was spelled.)
RESUME_SETTINGS = ("model", "dtype", "train_only", "lora_r", "lora_alpha", "lora_dropout", "text_file", "encoding",
                   "dataset", "dataset_config", "split", "text_column", "text_fraction", "start_text", "max_length",
                   "batch_size", "gradient_accumulation_steps", "eval_blocks", "seed", "max_steps", "lr",
                   "positional_lr", "weight_decay", "lr_scheduler", "warmup_steps", "pose_target_length",
                   "pose_chunks", "document_restarts", "distill_from", "distill_temperature", "distill_alpha")
# transformers schedulers that need nothing beyond warm-up and total steps
LR_SCHEDULERS = ("cosine", "linear", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


class NonFiniteLoss(UsageError):
    """Training diverged (a NaN or infinite loss, or weights): the run stops and saves nothing."""


# --- settings -------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-posenc finetune", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=SMOLLM2,
                   help="local checkpoint, Hub id, .gguf file, or 'smollm2' (the bundled SmolLM2-135M-Instruct, "
                        "de-quantised from Q4_1; default)")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--method", default=None,
                   help="positional method to patch in before training, NAME[:KEY=VALUE,...] (default: none, train "
                        "the model as loaded)")
    p.add_argument("--method-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of --method, value parsed as JSON when it can be (factor=4, slopes=\"geometric\"); "
                        "repeatable")
    p.add_argument("--train-only", choices=TRAIN_ONLY, default="all")
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--lora-alpha", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.0)
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
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--lr-scheduler", default="cosine", choices=LR_SCHEDULERS,
                   help="transformers learning-rate schedule (default cosine)")
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 10%% of --max-steps")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off; default 1)")
    p.add_argument("--batch-size", type=int, default=1, help="blocks per process and micro-step")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--attention-path", default="auto",
                   help="hf_posenc's attention path while training: auto (default), blocked, flex, flash, or compiled "
                        "(CoPE's, stick-breaking's and the other content methods' per-block chains under "
                        "torch.compile, checked against the eager blocks first; docs/attention-paths.md)")
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
    g = p.add_argument_group("positions and distillation (docs/finetuning-and-evaluation.md)")
    g.add_argument("--document-restarts", action=argparse.BooleanOptionalAction, default=True,
                   help="position ids restart at each document of a packed block, and attention does not cross "
                        "documents (default on; families whose forward takes no position_ids, BLOOM, train as "
                        "packed); off under --pose-target-length")
    g.add_argument("--pose-target-length", type=int, default=None,
                   help="PoSE: position ids of each --max-length window split into chunks with random skips that "
                        "cover this many positions (Zhu et al. 2023); default: off")
    g.add_argument("--pose-chunks", type=int, default=2, help="PoSE chunks per window (default 2, as the paper)")
    g.add_argument("--distill-from", default=None,
                   help="'original' (the model before the patch) or a checkpoint PATH: train to match its next-token "
                        "distributions (KL at --distill-temperature, mixed with the LM loss by --distill-alpha)")
    g.add_argument("--distill-temperature", type=float, default=1.0)
    g.add_argument("--distill-alpha", type=float, default=0.5,
                   help="weight of the KL term (1: KL only, 0: LM loss only; default 0.5)")
    return p


def settings(**overrides) -> argparse.Namespace:
    """The settings of a fine-tune: the command's defaults with ``overrides`` (e.g. ``method="kerple"``,
    ``text_file=[path]``, ``max_steps=60``), for ``run_finetune``."""
    return settings_from(build_parser(), **overrides)


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


# --- trainable parameters -------------------------------------------------------------------------------------
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
        config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                            target_modules=lora_targets(model), bias="none", task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        for p in positional:  # PEFT froze everything that is not LoRA; the positional parameters train too
            p.requires_grad_(True)
    return model, positional_ids


def lora_targets(model) -> list[str]:
    """Full names of the attention projections LoRA wraps. A projection that carries a hook of the positional
    patch (RoPE on GPT-2 / BLOOM rotates the fused qkv output in a forward hook) is left out: PEFT would add its
    update after the hook, unrotated."""
    modules = dict(model.named_modules())
    names, hooked = [], []
    for name in get_family(model.config).lora_target_modules(model):
        module = modules[name]
        (hooked if module._forward_hooks or module._forward_pre_hooks else names).append(name)
    if hooked:
        print(f"LoRA leaves out {len(hooked)} projection(s) that the positional patch hooks "
              f"(e.g. {hooked[0]}); they stay frozen", file=sys.stderr)
    if not names:
        raise UsageError("--train-only lora: no attention projection of this model can take LoRA "
                         f"(hooked by the patch: {len(hooked)})")
    return names


def weights_digest(model) -> str:
    """SHA-256 of every trainable parameter's bytes (to check that all processes hold the same weights)."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            digest.update(name.encode())
            digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --- the run, step by step ------------------------------------------------------------------------------------
@dataclass
class TrainingData:
    documents: list[str]
    n_tokens: int
    train_blocks: torch.LongTensor  # [n, max_length]
    eval_blocks: torch.LongTensor
    train_positions: torch.LongTensor | None = None  # [n, max_length]: restarting at each document
    eval_positions: torch.LongTensor | None = None


@dataclass
class Progress:
    """Where training stands; saved with every resumable checkpoint."""
    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # batches of the current epoch already trained (skipped when resuming)
    log: list[dict] = field(default_factory=list)


@dataclass
class Training:
    """The prepared pieces of a run (after ``accelerator.prepare``)."""
    accelerator: Any
    model: Any
    trainable: list[torch.nn.Parameter]
    optimizer: Any
    scheduler: Any
    loader: Any
    eval_loader: Any
    warmup_steps: int
    teacher: Any = None  # distill.Teacher under --distill-from
    restarts: bool = False  # position ids restart at each document (--document-restarts, where the model takes them)
    compiled_step: dict | None = None  # the check of a compiled step (accelerate's --dynamo_backend), once made


def run_finetune(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``finetune`` does, from its settings (``settings(...)`` or parsed options); returns the run
    summary (also written as ``training_args.json``)."""
    import torch
    from accelerate.utils import set_seed

    request = check_args(args)
    started = time.perf_counter()
    output_dir = output_path(args.output_dir)
    # Not inside --output-dir: that folder is written atomically at the end, and the logs are wanted while training.
    logging_dir = args.logging_dir or _beside(output_dir, "-logs")
    trackers = _trackers(args.report_to, logging_dir)
    accelerator = make_accelerator(args, trackers, logging_dir)
    checkpoint_dir = output_path(args.checkpoint_dir or _beside(output_dir, "-checkpoints"))
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
    if request is not None:
        torch.manual_seed(args.seed)  # methods with randomly initialised parameters start the same everywhere
        request.apply(model)
    from hf_posenc import get_posenc_config, get_positional_module

    if restarts and getattr(get_positional_module(model), "position_axes", 1) > 1:
        # A method over 2-D coordinates (rope-2d) refuses 1-D position ids: its documents are read as one grid row.
        restarts = False

    posenc = get_posenc_config(model)
    training = prepare_training(args, accelerator, model, data, teacher)
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


def release_prepared(training: Training) -> None:
    """Drop the prepared objects (the DDP-wrapped model first of all) while the process group still exists.
    Otherwise DDP's reducer outlives the group, and when it goes (at return) it destroys the group holding the GIL,
    while gloo's worker thread may still be releasing a finished collective's tensors, which needs the GIL: a
    deadlock at exit (py-spy: ~ProcessGroupGloo under ~Reducer in the main thread, ~AsyncBarrierWork waiting for
    the GIL in runLoop). Seen in about one `accelerate launch --cpu` (mpirun) run in 10-25 on 2 busy cores. Dropped
    here, the group's last reference goes in `destroy_process_group`, which releases the GIL."""
    import gc

    training.model = training.optimizer = training.scheduler = None
    training.loader = training.eval_loader = training.teacher = None
    training.accelerator.free_memory()
    gc.collect()


def position_options(args: argparse.Namespace, model) -> bool:
    """Whether position ids restart at each document; PoSE needs a model whose forward takes position_ids."""
    from hf_posenc.engine.state import forward_parameter_names

    takes_positions = "position_ids" in forward_parameter_names(model.base_model)
    if args.pose_target_length is not None and not takes_positions:
        raise UsageError(f"--pose-target-length: {model.config.model_type} models take no position_ids (their "
                         "positions come from the attention mask), so PoSE cannot give them skipped positions")
    return bool(args.document_restarts and takes_positions and args.pose_target_length is None)


def make_teacher(args: argparse.Namespace, model):
    """The distillation teacher (see tools/distill.py), made before the patch is applied; None without
    --distill-from."""
    from .distill import Teacher

    if args.distill_from is None:
        return None
    if args.distill_from == "original":
        return Teacher.original(model, frozen_base=args.train_only != "all")
    return Teacher.loaded(args.distill_from, DTYPES[args.dtype])


def model_inputs(args: argparse.Namespace, training: Training, batch, positions, step: int) -> tuple[dict, dict]:
    """(the student's inputs, the teacher's) for a batch: PoSE position ids (with an all-ones attention mask, so that
    transformers does not read the skips as packed documents), or ids that restart at each document (with no mask,
    and no cache, so that transformers reads them as packed sequences and masks attention across documents), or
    neither."""
    import torch

    from .training_positions import pose_position_ids

    if args.pose_target_length is not None:
        generator = torch.Generator().manual_seed(
            args.seed * 1_000_003 + step * 1009 + training.accelerator.process_index)
        pose = torch.stack([pose_position_ids(batch.shape[1], args.pose_target_length, args.pose_chunks, generator)
                            for _ in range(batch.shape[0])]).to(batch.device)
        return ({"input_ids": batch, "position_ids": pose, "attention_mask": torch.ones_like(batch)},
                {"input_ids": batch})  # the teacher reads the text at its own, consecutive positions
    if training.restarts:
        inputs = {"input_ids": batch, "position_ids": positions, "use_cache": False}
        return inputs, inputs
    return {"input_ids": batch}, {"input_ids": batch}


def make_accelerator(args: argparse.Namespace, trackers: list[str], logging_dir: Path):
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration
    from accelerate.utils.environment import parse_flag_from_env

    needs_gpus = ("this accelerate configuration needs GPUs ({}); on a CPU-only machine launch with "
                  "scripts/accelerate_configs/ddp.yaml (several CPU processes) or cpu_single.yaml")
    # Told by the launcher's environment, not by the plugin's error: accelerate 1.16 refuses FSDP on the CPU with
    # another message ("sync_module_states=True is not supported on cpu") than 1.15 did ("no available devices").
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and not torch.cuda.is_available():
        raise UsageError(needs_gpus.format("FSDP, and torch sees no CUDA device"))
    try:
        return Accelerator(
            mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.gradient_accumulation_steps,
            cpu=not torch.cuda.is_available(), log_with=trackers or None,
            project_config=ProjectConfiguration(project_dir=str(logging_dir), logging_dir=str(logging_dir))
            if trackers else None,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    except RuntimeError as error:
        if "no available devices" not in str(error):
            raise
        # accelerate's FSDP and DeepSpeed plugins need an accelerator: they refuse CPU-only machines.
        raise UsageError(needs_gpus.format(error)) from None


def resume_settings(args: argparse.Namespace, request: MethodRequest | None) -> dict[str, Any]:
    """The settings a resumed run must share with the one that saved the checkpoint (RESUME_SETTINGS), as JSON."""
    settings = {name: getattr(args, name) for name in RESUME_SETTINGS}
    settings["method"] = None if request is None else request.settings()  # every option, defaults included
    return json.loads(json.dumps(settings, default=str))


def resume_point(args: argparse.Namespace, checkpoint_dir: Path, run_settings: dict[str, Any],
                 verbose: bool = True) -> Path | None:
    """The checkpoint ``--resume-from`` names (a folder, or ``latest`` in ``checkpoint_dir``: the newest complete
    one), or None; refused when it is not complete, or was saved with other settings (another --method would fail
    on loading, another --max-length would go on silently with other data)."""
    if not args.resume_from:
        return None
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if verbose else None
    resume = latest_checkpoint(checkpoint_dir, say) if args.resume_from == "latest" else Path(args.resume_from)
    if resume is None or not (resume / STATE_FILE).is_file():
        raise UsageError(f"--resume-from {args.resume_from}: no checkpoint there "
                         f"(looked for {STATE_FILE} in {resume or checkpoint_dir})")
    try:
        saved = read_state(resume).get("settings")
    except IncompleteCheckpoint as why:
        raise UsageError(f"--resume-from {resume} is not a complete checkpoint ({why}); resume from an earlier one, "
                         "or pass --resume-from latest to take the newest complete one") from None
    if saved is None:
        return resume  # written before the settings were recorded
    differ = [name for name in run_settings if saved.get(name) != run_settings[name]]
    if differ:
        shown = "; ".join(f"{_resume_option(name)} {_shown(saved.get(name))} there, {_shown(run_settings[name])} now"
                          for name in differ)
        raise UsageError(f"--resume-from {resume} was saved with other settings ({shown}); resume with the settings "
                         "it was saved with, or start a new run without --resume-from")
    return resume


def _resume_option(name: str) -> str:
    return "--method" if name == "method" else "--" + name.replace("_", "-")


def _shown(value: Any) -> str:
    if isinstance(value, dict) and "method" in value:  # a method's config
        options = {key: option for key, option in value.items() if key != "method"}
        return value["method"] + (f" {json.dumps(options)}" if options else "")
    return "unset" if value is None else str(value)


def training_data(args: argparse.Namespace, tokenizer, docs, world: int) -> TrainingData:
    """The text packed into blocks of ``--max-length`` tokens; the last ``--eval-blocks`` are held out."""
    token_docs = tokenize_documents(tokenizer, docs)
    blocks = pack_blocks(token_docs, args.max_length, tokenizer.eos_token_id)
    n_tokens = sum(int(t.numel()) for t in token_docs)
    needed_blocks = args.batch_size * world + args.eval_blocks
    if blocks.shape[0] < needed_blocks:
        held_out = f" + {args.eval_blocks} eval blocks" if args.eval_blocks else ""
        raise DataError(f"the training text has {n_tokens} tokens ({len(docs)} document(s)); blocks of "
                        f"{args.max_length} tokens for batch {args.batch_size} x {world} process(es){held_out} need "
                        f"at least {needed_blocks * args.max_length} tokens")
    n_train = blocks.shape[0] - args.eval_blocks
    _, positions = pack_documents(token_docs, args.max_length, tokenizer.eos_token_id)
    return TrainingData([d.name for d in docs], n_tokens, blocks[:n_train], blocks[n_train:], positions[:n_train],
                        positions[n_train:])


def enable_gradient_checkpointing(model):
    """Non-reentrant gradient checkpointing of every decoder layer of `model` (of a PEFT wrapper's base model, which
    it returns), through `activation_checkpointing_enable` where transformers has it: 5.23 deprecates
    `gradient_checkpointing_enable`, which warns on every call, for removal in v6."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    options = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    return base


def prepare_training(args: argparse.Namespace, accelerator, model, data: TrainingData, teacher=None) -> Training:
    """Choose what trains, check the memory it needs, and build the optimizer, schedule and data loaders."""
    import torch
    from transformers import get_scheduler

    model, positional_ids = select_trainable(model, args.train_only, args)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not args.no_memory_check:
        check_memory(estimate_training_bytes(model, args.max_length, args.batch_size,
                                             sum(p.numel() for p in trainable), args.gradient_checkpointing,
                                             teacher),
                     f"training on {args.batch_size} x {args.max_length} tokens")
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model).config.use_cache = False
    groups = [{"params": [p for p in trainable if id(p) not in positional_ids], "lr": args.lr},
              {"params": [p for p in trainable if id(p) in positional_ids], "lr": args.positional_lr or args.lr}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=args.lr, weight_decay=args.weight_decay)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(0, round(0.1 * args.max_steps))
    scheduler = get_scheduler(args.lr_scheduler, optimizer, num_warmup_steps=warmup,
                              num_training_steps=args.max_steps)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.train_blocks, data.train_positions),
                                         batch_size=args.batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    eval_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.eval_blocks, data.eval_positions),
                                              batch_size=args.batch_size)
    model, optimizer, loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, loader, eval_loader,
                                                                           scheduler)
    return Training(accelerator, model, trainable, optimizer, scheduler, loader, eval_loader, warmup)


def resume_progress(accelerator, resume: Path | None) -> Progress:
    if resume is None:
        return Progress()
    accelerator.load_state(str(resume))
    state = read_state(resume)
    if accelerator.is_main_process:
        print(f"resumed from {resume} at step {state['step']}", flush=True)
    return Progress(state["step"], state["epoch"], state["batches_in_epoch"], state["log"])


def train(args: argparse.Namespace, training: Training, progress: Progress, checkpoint_dir: Path, started: float,
          log_to_trackers: bool, run_settings: dict[str, Any]) -> None:
    """The training loop, from ``progress`` to ``--max-steps``: the loss (the mean over processes) is checked at
    every micro-step, logged every ``--log-every`` steps, and resumable checkpoints saved every ``--save-every``."""
    from tqdm.auto import tqdm

    accelerator, model, loader = training.accelerator, training.model, training.loader
    if len(loader) == 0:
        raise DataError("no full training batch per process; add text or lower --batch-size / --max-length")
    bar = tqdm(total=args.max_steps, initial=progress.step, desc="finetune", unit="step",
               disable=args.no_progress or not accelerator.is_main_process)
    model.train()
    window_loss, window_count = 0.0, 0
    while progress.step < args.max_steps:
        loader.set_epoch(progress.epoch)
        skip = progress.batches_in_epoch
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch_index, (batch, positions) in enumerate(batches, start=skip):
            window_loss += training_step(args, training, batch, progress.step, positions)
            window_count += 1
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            bar.update(1)
            if progress.step % args.log_every == 0 or progress.step == args.max_steps:
                entry = log_entry(args, training, progress.step, window_loss / window_count, started)
                window_loss, window_count = 0.0, 0
                progress.log.append(entry)
                bar.set_postfix(loss=f"{entry['loss']:.3f}")
                if log_to_trackers:
                    accelerator.log({k: v for k, v in entry.items() if k != "step"}, step=progress.step)
            if args.save_every and progress.step % args.save_every == 0 and progress.step < args.max_steps:
                progress.batches_in_epoch = batch_index + 1
                save_checkpoint(accelerator, checkpoint_dir, progress, args.save_total_limit, run_settings)
            if progress.step >= args.max_steps:
                break
        else:
            progress.epoch, progress.batches_in_epoch = progress.epoch + 1, 0
    bar.close()
    if not weights_are_finite(model, accelerator):  # the last update comes after the last loss checked
        raise NonFiniteLoss(f"the update of step {progress.step} left weights that are not finite; "
                            + _diverged(args))


def training_step(args: argparse.Namespace, training: Training, batch: torch.LongTensor, step: int,
                  positions: torch.LongTensor | None = None) -> float:
    """One micro-step (forward, backward, and the optimizer step when gradients are synchronised); returns the
    loss averaged over processes, the same number on every process, so a divergence stops all of them together."""
    accelerator, model = training.accelerator, training.model
    with accelerator.accumulate(model):
        if training.compiled_step is None and uncompiled(model) is not model:
            loss = checked_compiled_loss(args, training, batch, positions, step)
        else:
            loss = step_loss(args, training, batch, positions, step)
        mean_loss = accelerator.gather(loss.detach().float()[None]).mean().item()
        if not math.isfinite(mean_loss):
            raise NonFiniteLoss(f"the training loss is {mean_loss} at step {step + 1}; " + _diverged(args))
        accelerator.backward(loss)
        if accelerator.sync_gradients and args.max_grad_norm:
            accelerator.clip_grad_norm_(training.trainable, args.max_grad_norm)
        training.optimizer.step()
        training.scheduler.step()
        training.optimizer.zero_grad()
    return mean_loss


def step_loss(args: argparse.Namespace, training: Training, batch, positions, step: int, model=None):
    """The training loss of a batch: the LM loss, or under --distill-from the mix of KL to the teacher and LM loss.
    `model`: another view of the model being trained (the uncompiled one) instead of `training.model`."""
    from .distill import distillation_loss, mixed_loss

    model = training.model if model is None else model
    inputs, teacher_inputs = model_inputs(args, training, batch, positions, step)
    if training.teacher is None:
        return model(**inputs, labels=batch).loss
    teacher_logits = training.teacher.logits(model, **teacher_inputs)
    outputs = model(**inputs, labels=batch)
    kl = distillation_loss(outputs.logits, teacher_logits, args.distill_temperature)
    return mixed_loss(outputs.loss, kl, args.distill_alpha)


# How far the first loss of a compiled step may lie from the uncompiled model's, relative: a compiled graph adds in
# another order (float32: about 1e-6 here), and under autocast rounds its intermediates at other points.
COMPILED_STEP_TOLERANCE = {"no": 1e-3, "bf16": 3e-2, "fp16": 3e-2}


def checked_compiled_loss(args: argparse.Namespace, training: Training, batch, positions, step: int):
    """The first micro-step of a compiled model (accelerate's ``--dynamo_backend``), checked on this machine before
    the compiled graph trains: its loss against the uncompiled model's on the same batch (no compiled number counts
    unchecked; see engine/kernels/check.py). Where the model draws random numbers in training (dropout), the two are
    compared in eval mode instead. Where they differ beyond COMPILED_STEP_TOLERANCE on any process, or compiling
    fails (a method torch.compile cannot trace says so), the uncompiled model trains from this step on, with a
    warning. The verdict goes into ``training_args.json`` (``compiled_step``)."""
    import torch

    accelerator, compiled = training.accelerator, training.model
    eager = uncompiled(compiled)
    backend = str(getattr(accelerator.state.dynamo_plugin, "backend", "no")).split(".")[-1].lower()
    backend = "torch.compile" if backend == "no" else backend  # compiled by the caller, not by accelerate
    verdict: dict[str, Any] = {"backend": backend, "compared": "training step"}

    def compiled_loss():  # a compiler failure, or a method that refuses to be traced: a verdict, not a crash
        try:
            return step_loss(args, training, batch, positions, step)
        except Exception as error:
            verdict["error"] = compile_error_text(error, eager)
            return None

    # The uncompiled model first: state a method builds at its first forward is then built uncompiled, and a wrong
    # compiled graph cannot leave it behind for the uncompiled model to read.
    loss = checked = None
    with torch.no_grad():
        reference = _loss_twice(args, training, batch, positions, step, eager, accelerator.device)
        if reference is None:  # random in training: compare the deterministic eval-mode forwards
            verdict["compared"] = "eval mode (the model draws random numbers in training)"
            compiled.eval()
            try:
                reference = float(step_loss(args, training, batch, positions, step, model=eager))
                evaluated = compiled_loss()
                checked = None if evaluated is None else float(evaluated)
            finally:
                compiled.train()
    if "error" not in verdict:
        loss = compiled_loss()
        if loss is not None and checked is None:
            checked = float(loss.detach())
    verdict.update(compiled_loss=checked, uncompiled_loss=reference)
    tolerance = COMPILED_STEP_TOLERANCE.get(accelerator.mixed_precision, 3e-2)
    agrees = (checked is not None and math.isfinite(checked)
              and abs(checked - reference) <= tolerance * max(1.0, abs(reference)))
    agrees = bool(accelerator.gather(torch.tensor([int(agrees)], device=accelerator.device)).all())
    verdict["served"] = agrees
    training.compiled_step = verdict
    if agrees:
        if accelerator.is_main_process:
            print(f"compiled step ({backend}) checked: loss {checked:.6g}, uncompiled {reference:.6g}", flush=True)
        return loss
    if accelerator.is_main_process:
        why = verdict.get("error") or (f"its loss {checked} differs from the uncompiled model's {reference} on the "
                                       "same batch" if checked is not None else "it failed on another process")
        print(f"warning: the compiled training step ({backend}) is not used: {why}. Training goes on uncompiled; "
              "launch without --dynamo_backend to skip the attempt.", file=sys.stderr, flush=True)
    training.model = eager
    return step_loss(args, training, batch, positions, step)


def _loss_twice(args, training, batch, positions, step, model, device) -> float | None:
    """The loss of `model` on the batch, or None when two forwards under different seeds disagree (dropout)."""
    import torch

    losses = []
    for seed in (0, 1):
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            losses.append(float(step_loss(args, training, batch, positions, step, model=model)))
    return losses[0] if losses[0] == losses[1] else None


def compile_error_text(error: Exception, model) -> str:
    """`_first_lines(error)`, led by hf_posenc's reason where a content method refused to be traced: dynamo before
    torch 2.13 reports a refusal raised in traced code as "ObservedPosEncErrorError: raised exception
    UserDefinedExceptionObjectVariable(PosEncError)", without its message."""
    from ..engine.content import compile_refusal
    from ..methods.base import ContentMethod
    from ..patching import get_positional_module

    text = _first_lines(error)
    method = get_positional_module(model)
    if "PosEncError" in text and isinstance(method, ContentMethod):
        reason = compile_refusal(method.config.method)
        return text if reason in text else f"PosEncError: {reason} (dynamo: {text})"
    return text


def _first_lines(error: Exception, limit: int = 300) -> str:
    """The root cause of `error`, one line: dynamo wraps what the traced code raised (a method's refusal, a
    compiler's failure) in errors of its own, whose first lines say only that something was raised."""
    root, seen = error, 0
    while (root.__cause__ or root.__context__) is not None and seen < 20:
        root, seen = root.__cause__ or root.__context__, seen + 1
    text = " ".join(line.strip() for line in str(root).splitlines() if line.strip())
    return f"{type(root).__name__}: {text[:limit]}"


def log_entry(args: argparse.Namespace, training: Training, step: int, loss: float, started: float) -> dict:
    world = training.accelerator.num_processes
    entry = {"step": step, "loss": loss, "lr": training.scheduler.get_last_lr()[0],
             "tokens": step * args.batch_size * args.gradient_accumulation_steps * world * args.max_length,
             "seconds": round(time.perf_counter() - started, 2)}
    if args.eval_blocks and args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
        entry["eval_loss"] = evaluate_loss(training.model, training.eval_loader, training.accelerator,
                                           training.restarts)
        training.model.train()
    return entry


def run_summary(args: argparse.Namespace, training: Training, progress: Progress, request: MethodRequest | None,
                posenc, data: TrainingData, started: float) -> dict[str, Any]:
    """What ``training_args.json`` holds: every setting and what the run saw and did."""
    from accelerate.utils import gather_object

    accelerator, log = training.accelerator, progress.log
    world = accelerator.num_processes
    tokens_per_step = args.batch_size * args.gradient_accumulation_steps * world * args.max_length
    return {
        "command": "finetune",
        **settings_of(args),
        "method_options": request.options if request else {},
        "posenc_config": posenc.to_dict() if posenc is not None else None,
        "num_processes": world,
        "distributed_type": str(accelerator.distributed_type),
        "mixed_precision_used": accelerator.mixed_precision,
        "warmup_steps_used": training.warmup_steps,
        "document_restarts_used": training.restarts,
        "compiled_step": training.compiled_step,
        "distillation": None if training.teacher is None else {
            "teacher": args.distill_from, "mode": training.teacher.mode, "teacher_window": training.teacher.window,
            "temperature": args.distill_temperature, "alpha": args.distill_alpha},
        "effective_batch_blocks": args.batch_size * args.gradient_accumulation_steps * world,
        "tokens_per_step": tokens_per_step,
        "steps_done": progress.step,
        "trainable_parameters": sum(p.numel() for p in training.trainable),
        "data": {"documents": data.documents, "tokens": data.n_tokens, "train_blocks": int(data.train_blocks.shape[0]),
                 "eval_blocks": int(data.eval_blocks.shape[0]), "text_fraction": args.text_fraction},
        "first_loss": log[0]["loss"] if log else None,
        "final_loss": log[-1]["loss"] if log else None,
        "final_eval_loss": next((e["eval_loss"] for e in reversed(log) if "eval_loss" in e), None),
        "weights_sha256_per_process": gather_object(
            [weights_digest(accelerator.unwrap_model(training.model, keep_torch_compile=False))]),
        "seconds": round(time.perf_counter() - started, 2),
        "versions": versions(),
    }


def save_output(args: argparse.Namespace, training: Training, tokenizer, posenc, summary: dict,
                log: list[dict], checkpoint_dir: Path | None = None) -> None:
    """Write ``--output-dir`` (from the main process): the model (LoRA merged, or the adapter alone with
    ``--save adapter``), tokenizer, settings, loss log. Where that fails (a full disk) they go into a new folder
    under $TMPDIR, and every process stops with the one line that says where (outputs.write_or_rescue)."""
    from hf_posenc.checkpoints.saving import share_weight_files

    accelerator = training.accelerator
    unwrapped = accelerator.unwrap_model(training.model, keep_torch_compile=False)
    adapter_only = args.train_only == "lora" and args.save == "adapter"
    if args.train_only == "lora" and not adapter_only:
        unwrapped = unwrapped.merge_and_unload()
    state_dict = None
    if accelerator.distributed_type.name in ("FSDP", "DEEPSPEED") and args.train_only != "lora":
        state_dict = accelerator.get_state_dict(training.model)  # a collective: every process takes part

    def write(out: Path) -> None:
        if adapter_only and posenc is not None:
            from hf_posenc import save_adapter

            save_adapter(unwrapped, out)
        else:
            unwrapped.save_pretrained(out, state_dict=state_dict)
        share_weight_files(out)  # also for a model saved without hf_posenc's save_pretrained (no --method)
        tokenizer.save_pretrained(out)
        if posenc is not None and not (out / "posenc_config.json").is_file():
            write_json(out / "posenc_config.json", posenc.to_dict())  # a save_pretrained without the hook
        write_json(out / "training_args.json", summary)
        write_loss_log(out, log)

    failure = None
    if accelerator.is_main_process:
        newest = latest_checkpoint(checkpoint_dir) if checkpoint_dir is not None else None
        # checked at the start: a --checkpoint-dir or --logging-dir inside --output-dir may have appeared since
        failure = write_or_rescue(args.output_dir, "finetune", args.overwrite, write, "the trained model",
                                  if_lost=f"the newest checkpoint is {newest} (--resume-from latest)" if newest
                                  else "the trained weights are lost")
    raise_on_every_process(accelerator, failure)  # also the barrier that keeps the others until the files are written


def _beside(output_dir: Path, suffix: str) -> Path:
    return output_dir.with_name(output_dir.name + suffix) if output_dir.name else output_dir / suffix.lstrip("-")


def _diverged(args: argparse.Namespace) -> str:
    return (f"training stopped and nothing was saved to --output-dir {args.output_dir}; lower --lr (now {args.lr:g})"
            + (" or --positional-lr" if args.positional_lr else "")
            + (", turn --max-grad-norm on" if not args.max_grad_norm else "")
            + (", or use --mixed-precision bf16" if args.mixed_precision == "fp16" else ""))


def weights_are_finite(model, accelerator) -> bool:
    """Whether every trainable parameter holds finite values, on every process (one pass over the weights)."""
    import torch

    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters() if p.requires_grad)
    return bool(accelerator.gather(torch.tensor([int(finite)], device=accelerator.device)).all())


def evaluate_loss(model, loader, accelerator, restarts: bool = False) -> float:
    """Mean token loss over the held-out blocks (every process takes its share; gathered); LM loss at consecutive
    positions (restarting at each document with `restarts`), whatever PoSE or distillation the training used."""
    import torch

    model.eval()
    losses = []
    with torch.no_grad():
        for batch, positions in loader:
            inputs = ({"input_ids": batch, "position_ids": positions, "use_cache": False} if restarts
                      else {"input_ids": batch})
            losses.append(accelerator.gather_for_metrics(model(**inputs, labels=batch).loss.detach()[None]))
    return float(torch.cat(losses).float().mean()) if losses else float("nan")


def write_loss_log(directory: Path, log: list[dict]) -> None:
    write_json(directory / "loss_log.json", log)
    keys = ["step", "loss", "eval_loss", "lr", "tokens", "seconds"]
    with open(directory / "loss_log.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(log)


def _trackers(report_to: str, logging_dir: Path) -> list[str]:
    """The accelerate trackers asked for; a named one whose package is missing is an error, not a silent no-op."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS, filter_trackers, get_available_trackers

    if report_to in ("none", "", None):
        return []
    if report_to == "all":
        return filter_trackers("all", str(logging_dir))
    wanted = [t.strip() for t in report_to.split(",") if t.strip()]
    unknown = [t for t in wanted if t not in LOGGER_TYPE_TO_CLASS]
    if unknown:
        raise UsageError(f"--report-to {', '.join(unknown)}: unknown tracker; accelerate knows "
                         f"{', '.join(sorted(LOGGER_TYPE_TO_CLASS))}")
    # Checked here rather than by filter_trackers: that one logs the missing tracker through accelerate's logger,
    # which raises before an Accelerator exists.
    available = [str(t) for t in get_available_trackers()]
    missing = [t for t in wanted if t not in available]
    if missing:
        raise UsageError(f"--report-to {', '.join(missing)}: its package is not installed (pip install "
                         f"{' '.join(missing)}), or leave it out")
    return wanted


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
