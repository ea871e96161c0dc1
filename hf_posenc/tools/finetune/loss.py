"""The losses of ``hf-posenc finetune``: the model's inputs for a batch (PoSE ids, document restarts), the training
loss (LM loss, or its mix with the KL to a teacher), and the held-out loss."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prepare import Training


def model_inputs(args: argparse.Namespace, training: Training, batch, positions, step: int) -> tuple[dict, dict]:
    """(the student's inputs, the teacher's) for a batch: PoSE position ids (with an all-ones attention mask, so that
    transformers does not read the skips as packed documents), or ids that restart at each document (with no mask,
    and no cache, so that transformers reads them as packed sequences and masks attention across documents), or
    neither."""
    import torch

    from .positions import pose_position_ids

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


def step_loss(args: argparse.Namespace, training: Training, batch, positions, step: int, model=None):
    """The training loss of a batch: the LM loss, or under --distill-from the mix of KL to the teacher and LM loss,
    or in the first --transfer-steps steps the attention-transfer loss (attention_transfer.py).
    `model`: another view of the model being trained (the uncompiled one) instead of `training.model`."""
    from .teacher import distillation_loss, mixed_loss

    model = training.model if model is None else model
    inputs, teacher_inputs = model_inputs(args, training, batch, positions, step)
    if step < args.transfer_steps:  # the student reads the text as the teacher does: its positions, its window
        from .attention_transfer import attention_transfer_loss

        return attention_transfer_loss(model, training.teacher, training.teacher.within_window(teacher_inputs))[0]
    if training.teacher is None:
        return model(**inputs, labels=batch).loss
    teacher_logits = training.teacher.logits(model, **teacher_inputs)
    outputs = model(**inputs, labels=batch)
    kl = distillation_loss(outputs.logits, teacher_logits, args.distill_temperature)
    return mixed_loss(outputs.loss, kl, args.distill_alpha)


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
