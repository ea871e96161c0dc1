"""What ``hf-posenc finetune`` writes at its end, atomically, into ``--output-dir``: the model (LoRA merged, or the
adapter alone), its tokenizer, ``training_args.json`` (``run_summary``) and the loss log."""

from __future__ import annotations

import argparse
import csv
import hashlib
import time
from pathlib import Path
from typing import Any

from ..outputs import raise_on_every_process, write_json, write_or_rescue
from ..runtime import MethodRequest, settings_of, versions
from .checkpoints import Progress, latest_checkpoint
from .data import TrainingData
from ..estimates import parameter_count
from .prepare import Training, engine_of
from ..sharding import whole_parameter


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
        "deepspeed_zero_stage": accelerator.state.deepspeed_plugin.zero_stage
        if accelerator.distributed_type.name == "DEEPSPEED" else None,
        "engine": engine_of(accelerator),  # as estimates.ENGINES names it: none, ddp, zero2, zero3, fsdp2, fsdp1
        "mixed_precision_used": accelerator.mixed_precision,
        "warmup_steps_used": training.warmup_steps,
        "document_restarts_used": training.restarts,
        "compiled_step": training.compiled_step,
        "distillation": None if training.teacher is None else {
            "teacher": args.distill_from, "mode": training.teacher.mode, "teacher_window": training.teacher.window,
            "temperature": args.distill_temperature, "alpha": args.distill_alpha},
        "attention_transfer": None if not args.transfer_steps else {
            "steps": args.transfer_steps, "end_to_end_steps": args.max_steps - args.transfer_steps,
            "loss": "relative MSE of each changed layer's attention output, averaged",
            "blocks_cut_to_teacher_window": training.teacher.window},
        "bias_fit": None if not args.fit_bias_steps else {
            "steps": args.fit_bias_steps, "blocks": args.fit_bias_blocks, "lr": args.fit_bias_lr,
            "length": args.fit_bias_length or args.max_length, "queries": args.fit_bias_queries,
            "kl_before": None if training.bias_fit is None else training.bias_fit.kl_before,
            "kl_after": None if training.bias_fit is None else training.bias_fit.kl_after,
            "loss": "KL of each changed layer's attention weights to the teacher's, on the teacher's inputs"},
        "teacher_samples": None if training.teacher_samples is None else {
            "blocks": int(training.teacher_samples.blocks.shape[0]),
            "tokens": int(training.teacher_samples.blocks.numel()), "temperature": args.teacher_sample_temperature,
            "top_k": args.teacher_sample_top_k, "batch": args.teacher_sample_batch,
            "seconds": training.teacher_samples.seconds,
            "read_from": training.teacher_samples.read_from,
            "sampling": "generate from the end-of-text token, which is suppressed after it (top_k 0: every token)"},
        "effective_batch_blocks": args.batch_size * args.gradient_accumulation_steps * world,
        "tokens_per_step": tokens_per_step,
        "steps_done": progress.step,
        "trainable_parameters": sum(parameter_count(p) for p in training.trainable),
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


def write_loss_log(directory: Path, log: list[dict]) -> None:
    write_json(directory / "loss_log.json", log)
    keys = ["step", "loss", "eval_loss", "lr", "tokens", "seconds"]
    with open(directory / "loss_log.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(log)


def weights_digest(model) -> str:
    """SHA-256 of every trainable parameter's bytes (to check that all processes hold the same weights); under
    ZeRO-3 of the gathered parameters, so every process must call it."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if p.requires_grad:
            with whole_parameter(p):
                digest.update(name.encode())
                digest.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
