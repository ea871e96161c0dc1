"""What ``hf-posenc finetune`` builds before its loop: the accelerator (and its trackers), what trains
(``--train-only``: the positional parameters, all, or LoRA), the optimizer, the transformers schedule and the data
loaders, prepared by accelerate (``Training``); and their release at the end."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...registry import get_family
from ..estimates import check_memory, estimate_training_bytes, parameter_count
from ..runtime import UsageError
from .data import TrainingData

if TYPE_CHECKING:
    import torch


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
    teacher: Any = None  # teacher.Teacher under --distill-from
    restarts: bool = False  # position ids restart at each document (--document-restarts, where the model takes them)
    compiled_step: dict | None = None  # the check of a compiled step (accelerate's --dynamo_backend), once made
    bias_fit: Any = None  # bias_fit.BiasFit under --fit-bias-steps (None when resumed: the checkpoint holds it)
    teacher_samples: Any = None  # teacher_samples.TeacherSamples under --teacher-samples


def make_accelerator(args: argparse.Namespace, trackers: list[str], logging_dir: Path):
    """accelerate's Accelerator for the run (mixed precision, accumulation, trackers, seedable data order); a launch
    configuration naming an engine that cannot run on this machine is refused in one line."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                                  InitProcessGroupKwargs, ProjectConfiguration)

    deepspeed = check_engine_can_run()
    cuda = torch.cuda.is_available()
    # DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) needs cpu=False, and then the gloo process group: without it
    # accelerate counts one process and its batch-size check fails ("2 != 2 * 1 * 2"; measured in issue 54).
    handlers = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and not cuda else None
    try:
        accelerator = Accelerator(
            mixed_precision=args.mixed_precision, log_with=trackers or None, kwargs_handlers=handlers,
            # A plugin, not gradient_accumulation_steps=: accelerate lets the launch config's value (a DeepSpeed
            # yaml's) override that argument, and --gradient-accumulation-steps is what the run counts by.
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=args.gradient_accumulation_steps),
            deepspeed_plugin=deepspeed_plugin(args) if deepspeed else None, cpu=not cuda and not deepspeed,
            # One schedule step per optimizer step (training_step steps it): accelerate's default steps it once
            # per process, which ran the schedule N times too fast on N processes (issue 54).
            step_scheduler_with_optimizer=False,
            project_config=ProjectConfiguration(project_dir=str(logging_dir), logging_dir=str(logging_dir))
            if trackers else None,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    except RuntimeError as error:
        if "no available devices" not in str(error):
            raise
        # accelerate's FSDP and DeepSpeed plugins need an accelerator: they refuse CPU-only machines.
        raise UsageError(NEEDS_GPUS.format(error)) from None
    if deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
        # Never a silent fall-back: accelerate runs plain DDP (or one process each) where DeepSpeed did not start.
        raise UsageError(f"this accelerate configuration asks for DeepSpeed, but accelerate started "
                         f"{accelerator.distributed_type.value}; {USE_INSTEAD}")
    return accelerator


def deepspeed_plugin(args: argparse.Namespace):
    """accelerate's DeepSpeedPlugin from the launch configuration (ZeRO stage, offload, a DeepSpeed config file),
    with the fine-tune's own --gradient-accumulation-steps and --max-grad-norm (DeepSpeed clips by its config, not
    by accelerator.clip_grad_norm_), and ZeRO-3's parameters gathered at the save, which writes whole weights. A
    DeepSpeed config file that sets any of these otherwise is refused (``"auto"`` takes the fine-tune's)."""
    from accelerate.utils import DeepSpeedPlugin

    wanted = {"gradient_accumulation_steps": ("--gradient-accumulation-steps", args.gradient_accumulation_steps),
              "gradient_clipping": ("--max-grad-norm", args.max_grad_norm)}
    plugin = DeepSpeedPlugin(gradient_accumulation_steps=args.gradient_accumulation_steps,
                             gradient_clipping=args.max_grad_norm, zero3_save_16bit_model=True)
    config = plugin.deepspeed_config
    for key, (option, value) in wanted.items():
        if config.get(key, value) != value:
            raise UsageError(f"the DeepSpeed config file sets {key} {config[key]}, and {option} is {value:g}: "
                             f"make them equal, or write \"auto\" there")
    if plugin.zero_stage == 3 and args.train_only == "lora":
        # Measured: the merge (and save_adapter) read ZeRO-3's empty local parameters and saved 0-element weights.
        raise UsageError("--train-only lora under DeepSpeed ZeRO-3: merging or saving the adapter needs whole "
                         "weights, which ZeRO-3 partitions; use scripts/accelerate_configs/deepspeed_zero2.yaml, "
                         "or --train-only all")
    held_apart = args.distill_from is not None and (args.distill_from != "original" or args.train_only == "all")
    if plugin.zero_stage == 3 and held_apart:
        # Measured: a frozen copy's forward read its empty partitioned weights ("'weight' must be 2-D").
        raise UsageError(f"--distill-from {args.distill_from} with --train-only {args.train_only} under DeepSpeed "
                         "ZeRO-3: the teacher is a model of its own, which ZeRO-3 partitions but no engine gathers; "
                         "use scripts/accelerate_configs/deepspeed_zero2.yaml, or --distill-from original with "
                         "--train-only positional (the teacher is then the model's own unpatched view)")
    if plugin.zero_stage == 3 and config["zero_optimization"].get(GATHER_ON_SAVE) is False:
        raise UsageError(f"the DeepSpeed config file sets zero_optimization.{GATHER_ON_SAVE} false: the fine-tune "
                         "saves whole weights at its end under ZeRO-3; set it true (or \"auto\")")
    return plugin


GATHER_ON_SAVE = "stage3_gather_16bit_weights_on_model_save"


USE_INSTEAD = ("launch with scripts/accelerate_configs/ddp.yaml (several processes, GPUs or CPUs) or "
               "cpu_single.yaml")
NEEDS_GPUS = "this accelerate configuration needs GPUs ({}); on a CPU-only machine " + USE_INSTEAD


def check_engine_can_run() -> bool:
    """Whether the launch asks for DeepSpeed (accelerate's launcher says so in the environment); refuses (UsageError)
    a DeepSpeed or FSDP launch that cannot run here, before any work. Told by the launcher's environment, not by the
    plugins' errors: accelerate 1.16 refuses FSDP on the CPU with another message ("sync_module_states=True is not
    supported on cpu") than 1.15 did ("no available devices"), and turns DeepSpeed on the CPU into DDP silently."""
    import torch
    from accelerate import utils
    from accelerate.utils.environment import parse_flag_from_env

    cuda = torch.cuda.is_available()
    if parse_flag_from_env("ACCELERATE_USE_FSDP") and not cuda:
        raise UsageError(NEEDS_GPUS.format("FSDP, and torch sees no CUDA device"))
    if not parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return False
    if not utils.is_deepspeed_available():
        raise UsageError(f"this accelerate configuration runs DeepSpeed, which is not installed: pip install "
                         f"deepspeed, or {USE_INSTEAD}")
    if not cuda and os.environ.get("DS_ACCELERATOR", "").lower() != "cpu":
        raise UsageError(f"this accelerate configuration runs DeepSpeed, and torch sees no CUDA device: set "
                         f"DS_ACCELERATOR=cpu for DeepSpeed's CPU accelerator, or {USE_INSTEAD}")
    return True


def trackers_for(report_to: str, logging_dir: Path) -> list[str]:
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
    elif train_only in ("qk", "qkvo"):
        chosen = positional_ids | {id(p) for p in projection_parameters(model, outputs_too=train_only == "qkvo")}
        for p in model.parameters():
            p.requires_grad_(id(p) in chosen)
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


def projection_parameters(model, outputs_too: bool) -> list[torch.nn.Parameter]:
    """The attention projections' parameters of every layer: those making queries and keys (a fused query-key-value
    projection whole, values too), and with `outputs_too` the value and output projections as well."""
    family = get_family(model.config)
    projections = family.attention_projections if outputs_too else \
        [name for name in family.attention_projections[:-1] if name != "v_proj"]  # the last is the output's
    return [p for attention in family.attention_modules(model) for name in projections
            for p in getattr(attention, name).parameters()]


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
        needed = estimate_training_bytes(model, args.max_length, args.batch_size,
                                         sum(parameter_count(p) for p in trainable), args.gradient_checkpointing,
                                         teacher, engine=engine_of(accelerator).replace("fsdp1", "fsdp2"),
                                         processes=accelerator.num_processes)
        if accelerator.device.type == "cpu":  # the processes on this machine share its memory
            needed *= int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
        check_memory(needed, f"training on {args.batch_size} x {args.max_length} tokens")
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


def engine_of(accelerator) -> str:
    """The engine the run has, in estimates.ENGINES' names (ZeRO-1 and 0 keep whole gradients, counted as DDP), or
    fsdp1."""
    kind = accelerator.distributed_type.name
    if kind == "DEEPSPEED":
        stage = accelerator.state.deepspeed_plugin.zero_stage
        return f"zero{stage}" if stage in (2, 3) else "ddp"
    # FSDP version 1 (accelerate's default where a config has no fsdp_version: 2) is recorded as such; under
    # FULL_SHARD it holds what FSDP2 holds, and is estimated as fsdp2
    if kind == "FSDP":
        return "fsdp2" if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2 else "fsdp1"
    return "none" if kind == "NO" else "ddp"


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
