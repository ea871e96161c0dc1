"""``hf-posenc finetune --teacher-samples N``: text the teacher writes itself, added to the training blocks.

Distilling a full swap on one book moved held-out WikiText-2 half as far as the book (issue 55); blocks sampled from
the original at T = 1 beside the book moved it 9 % further at the same steps, where two more books moved it 2 %
(docs/finetuning-and-evaluation.md, the fitted-start table). On its own samples the teacher's distribution is the
one the model had, so the KL carries it whole rather than through one text's words (sequence-level distillation:
Kim & Rush 2016, "Sequence-Level Knowledge Distillation"; on-policy variants: Agarwal et al. 2024, GKD).

Each sample is one block of ``--max-length`` tokens: the tokenizer's end-of-text token, then ``max_length - 1``
tokens drawn by ``generate`` (KV cache, from every token unless ``--teacher-sample-top-k``, the end-of-text token
suppressed so that every row is one document of the block's full length). Rows are drawn in batches of
``--teacher-sample-batch`` (throughput grows with it: each decoding step reads every weight for a few rows), batch i
from the seed ``seed + i``, so the same seed and batch give the same blocks on any number of processes: each process
draws its share of the batches and all of them are gathered. ``--teacher-samples-file`` keeps them (token ids and the
settings that made them) for the next run and for ``--resume-from``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..runtime import UsageError

if TYPE_CHECKING:
    import torch

SAMPLE_BATCH = 32
FILE_VERSION = 1


@dataclass
class TeacherSamples:
    blocks: torch.LongTensor  # [n, max_length]
    settings: dict[str, Any]  # what made them (compared when a file is read again)
    seconds: float  # drawing them; 0 when read from a file
    read_from: str | None = None


def draw_samples(model, n: int, length: int, start_token: int, temperature: float, seed: int,
                 batches: list[int] | None = None, progress: Callable[[int], None] | None = None,
                 top_k: int = 0, batch_size: int = SAMPLE_BATCH) -> dict[int, torch.LongTensor]:
    """Rows sampled from `model`: {batch index: [rows, length]} for the batches of `batch_size` rows in `batches`
    (default all of ``ceil(n / batch_size)``), each from ``start_token`` and the seed ``seed + index``; the global
    RNG is left as it was. `progress(rows)` after each batch; `top_k` > 0 draws from the K likeliest tokens only."""
    import torch
    from transformers import GenerationConfig

    count = -(-n // batch_size)
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=top_k, top_p=1.0,
                              max_new_tokens=length - 1, min_new_tokens=length - 1, eos_token_id=start_token,
                              pad_token_id=start_token)
    device = next(model.parameters()).device
    drawn = {}
    was_training = model.training
    model.eval()
    try:
        for index in range(count) if batches is None else batches:
            rows = min(batch_size, n - index * batch_size)
            prompt = torch.full((rows, 1), start_token, dtype=torch.long, device=device)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(seed + index)
                out = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
            drawn[index] = out[:, :length].cpu()
            if progress is not None:
                progress(rows)
    finally:
        model.train(was_training)
    return drawn


def teacher_samples(args, accelerator, model, teacher, tokenizer, say: Callable[[str], None] | None = None
                    ) -> TeacherSamples | None:
    """--teacher-samples: the blocks the teacher writes (None without it), read from --teacher-samples-file where it
    holds them with the same settings, else drawn here (the batches split across the processes, gathered) and
    written there. Called before the patch is applied, so that the "unpatched view" teacher is the model itself."""
    import torch

    if not args.teacher_samples:
        return None
    wanted = {"version": FILE_VERSION, "teacher": str(args.distill_from), "model": str(args.model),
              "count": args.teacher_samples, "length": args.max_length,
              "temperature": args.teacher_sample_temperature, "top_k": args.teacher_sample_top_k,
              "batch": args.teacher_sample_batch, "seed": args.seed,
              "start_token": tokenizer.eos_token_id}
    path = Path(args.teacher_samples_file) if args.teacher_samples_file else None
    if path is not None and path.is_file():
        return read_samples(path, wanted)
    if tokenizer.eos_token_id is None:
        raise UsageError("--teacher-samples starts each sample from the tokenizer's end-of-text token, and this "
                         "tokenizer has none; pass --tokenizer with one")
    if teacher.window is not None and args.max_length > teacher.window:
        raise UsageError(f"--teacher-samples draws blocks of --max-length {args.max_length} tokens, longer than the "
                         f"teacher's window ({teacher.window}), where its text is not the original's; lower "
                         "--max-length or drop --teacher-samples")
    from accelerate.utils import gather_object

    from ..progress import progress as progress_bar
    from .prepare import engine_of

    started = time.perf_counter()
    rank, world = accelerator.process_index, accelerator.num_processes
    count = -(-args.teacher_samples // args.teacher_sample_batch)
    bar = progress_bar(total=args.teacher_samples, desc="teacher samples", unit="block",
                       enabled=accelerator.is_main_process and not args.no_progress)
    try:
        with teacher.generating(model) as writer:
            if engine_of(accelerator) in ("none", "ddp"):
                writer.to(accelerator.device)
            mine = draw_samples(writer, args.teacher_samples, args.max_length, tokenizer.eos_token_id,
                                args.teacher_sample_temperature, args.seed, list(range(rank, count, world)),
                                progress=lambda rows: bar.update(rows * world), top_k=args.teacher_sample_top_k,
                                batch_size=args.teacher_sample_batch)
    finally:
        bar.close()
    drawn = dict(gather_object(list(mine.items()))) if world > 1 else mine
    blocks = torch.cat([drawn[i] for i in range(count)])
    samples = TeacherSamples(blocks, wanted, time.perf_counter() - started)
    if say is not None:
        say(f"teacher samples: {blocks.shape[0]} x {args.max_length} tokens in {samples.seconds:.0f} s")
    if path is not None and accelerator.is_main_process:
        write_samples(path, samples)
    accelerator.wait_for_everyone()
    return samples


def write_samples(path: Path, samples: TeacherSamples) -> None:
    """The samples' token ids and settings, written atomically (a partial file is never read as samples)."""
    import os

    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    torch.save({"blocks": samples.blocks, "settings": samples.settings}, partial)
    os.replace(partial, path)


def read_samples(path: Path, wanted: dict[str, Any]) -> TeacherSamples:
    """Samples from a --teacher-samples-file, refused where they were made with other settings."""
    import torch

    try:
        saved = torch.load(path, weights_only=True)
        blocks, settings = saved["blocks"], saved["settings"]
    except Exception as error:  # not a file this option wrote: say so rather than train on it
        raise UsageError(f"--teacher-samples-file {path}: not a samples file written by --teacher-samples ({error}); "
                         "give a new path, or remove it to draw them again") from None
    differ = [f"{key} {settings.get(key)!r} (now {value!r})" for key, value in wanted.items()
              if settings.get(key) != value]
    if differ:
        raise UsageError(f"--teacher-samples-file {path} holds samples made with other settings: "
                         f"{'; '.join(differ)}; give another path, or remove it to draw them again")
    return TeacherSamples(blocks, settings, 0.0, read_from=str(path))
