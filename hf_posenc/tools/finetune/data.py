"""The training text of ``hf-posenc finetune``: packed into blocks of ``--max-length`` tokens (documents joined by
the EOS token), the last ``--eval-blocks`` held out, with position ids that restart at each document."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..runtime import UsageError
from ..text import DataError, pack_blocks, tokenize_documents
from .positions import pack_documents

if TYPE_CHECKING:
    import torch


@dataclass
class TrainingData:
    documents: list[str]
    n_tokens: int
    train_blocks: torch.LongTensor  # [n, max_length]
    eval_blocks: torch.LongTensor
    train_positions: torch.LongTensor | None = None  # [n, max_length]: restarting at each document
    eval_positions: torch.LongTensor | None = None
    sample_blocks: int = 0  # the last of train_blocks that --teacher-samples added (not the text's)


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


def position_options(args: argparse.Namespace, model) -> bool:
    """Whether position ids restart at each document; PoSE needs a model whose forward takes position_ids."""
    from hf_posenc.engine.state import forward_parameter_names

    takes_positions = "position_ids" in forward_parameter_names(model.base_model)
    if args.pose_target_length is not None and not takes_positions:
        raise UsageError(f"--pose-target-length: {model.config.model_type} models take no position_ids (their "
                         "positions come from the attention mask), so PoSE cannot give them skipped positions")
    return bool(args.document_restarts and takes_positions and args.pose_target_length is None)


def with_samples(data: TrainingData, blocks: torch.LongTensor) -> TrainingData:
    """`data` with `blocks` (each one document, positions 0..L-1) after its training blocks: the loader shuffles
    them in, and the first blocks (those the bias fit reads) stay the text's."""
    import torch

    positions = torch.arange(blocks.shape[1]).expand_as(blocks)
    return TrainingData(data.documents, data.n_tokens, torch.cat([data.train_blocks, blocks]), data.eval_blocks,
                        torch.cat([data.train_positions, positions]), data.eval_positions,
                        data.sample_blocks + blocks.shape[0])
