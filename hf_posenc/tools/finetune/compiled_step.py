"""The first step of a compiled model (accelerate's ``--dynamo_backend``) under ``hf-posenc finetune``: checked
against the uncompiled model on the same batch before the compiled graph trains."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from ..runtime import uncompiled
from .loss import step_loss
from .prepare import Training


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
    from ...engine.content import compile_refusal
    from ...methods.base import ContentMethod
    from ...patching import get_positional_module

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
