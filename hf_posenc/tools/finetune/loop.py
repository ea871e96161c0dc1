"""The training loop of ``hf-posenc finetune``: micro-steps under accelerate's gradient accumulation, the loss
checked at each (a NaN stops every process together), logged, and resumable checkpoints saved on the way."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..runtime import UsageError, uncompiled
from ..text import DataError
from .checkpoints import Progress, save_checkpoint
from .compiled_step import checked_compiled_loss
from .loss import evaluate_loss, step_loss
from .prepare import Training

if TYPE_CHECKING:
    import torch


class NonFiniteLoss(UsageError):
    """Training diverged (a NaN or infinite loss, or weights): the run stops and saves nothing."""


def train(args: argparse.Namespace, training: Training, progress: Progress, checkpoint_dir: Path, started: float,
          log_to_trackers: bool, run_settings: dict[str, Any]) -> None:
    """The training loop, from ``progress`` to ``--max-steps``: the loss (the mean over processes) is checked at
    every micro-step, logged every ``--log-every`` steps, and resumable checkpoints saved every ``--save-every``."""
    from ..progress import progress as progress_bar

    accelerator, model, loader = training.accelerator, training.model, training.loader
    if len(loader) == 0:
        raise DataError("no full training batch per process; add text or lower --batch-size / --max-length")
    bar = progress_bar(total=args.max_steps, initial=progress.step, desc="finetune", unit="step",
                       enabled=not args.no_progress and accelerator.is_main_process)
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
        if accelerator.sync_gradients and not accelerator.optimizer_step_was_skipped:
            training.scheduler.step()  # once per optimizer step (make_accelerator: step_scheduler_with_optimizer)
        training.optimizer.zero_grad()
    return mean_loss


def log_entry(args: argparse.Namespace, training: Training, step: int, loss: float, started: float) -> dict:
    world = training.accelerator.num_processes
    entry = {"step": step, "loss": loss, "lr": training.scheduler.get_last_lr()[0],
             "tokens": step * args.batch_size * args.gradient_accumulation_steps * world * args.max_length,
             "seconds": round(time.perf_counter() - started, 2),
             "stage": "transfer" if step <= args.transfer_steps else "end-to-end"}
    if args.eval_blocks and args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
        entry["eval_loss"] = evaluate_loss(training.model, training.eval_loader, training.accelerator,
                                           training.restarts)
        training.model.train()
    return entry


def weights_are_finite(model, accelerator) -> bool:
    """Whether every trainable parameter holds finite values, on every process (one pass over the weights)."""
    import torch

    # ZeRO-3 leaves each process its part of a parameter (ds_tensor); each part checked is every value checked
    finite = all(bool(torch.isfinite(getattr(p, "ds_tensor", p)).all()) for p in model.parameters() if p.requires_grad)
    return bool(accelerator.gather(torch.tensor([int(finite)], device=accelerator.device)).all())


def _diverged(args: argparse.Namespace) -> str:
    return (f"training stopped and nothing was saved to --output-dir {args.output_dir}; lower --lr (now {args.lr:g})"
            + (" or --positional-lr" if args.positional_lr else "")
            + (", turn --max-grad-norm on" if not args.max_grad_norm else "")
            + (", or use --mixed-precision bf16" if args.mixed_precision == "fp16" else ""))
