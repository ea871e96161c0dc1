"""Position ids for fine-tuning: PoSE skips and document restarts (used by ``hf-posenc finetune``).

- ``pose_position_ids``: PoSE (positional skip-wise training; Zhu et al. 2023, "PoSE: Efficient Context Window
  Extension of LLMs via Positional Skip-wise Training", ICLR 2024). A window of w tokens is cut into N chunks
  (random lengths, each >= 1); chunk i keeps consecutive ids shifted by a skip u_i, with u_1 = 0 and
  u_i ~ U{u_{i-1}, ..., L - w} (the paper's sampling), so the ids rise from 0 and reach at most L - 1: over many
  windows every relative distance and absolute position below the target length L is trained, with windows of w
  tokens. The paper's reference code uses N = 2, with the first chunk's length ~ U{1, ..., ceil(w / 2)}; the text
  of our windows stays contiguous (only the ids skip).
- ``pack_documents``: documents packed into blocks as ``pack_blocks`` does (the separator after each document), and
  position ids that restart at 0 at each document's first token and at each block's first token, so a fine-tune
  never teaches positions across unrelated documents. Passed with no attention mask and use_cache=False (with a
  cache transformers does not look for packing), transformers reads ids that restart as packed sequences and masks
  attention across them too (LLaMA family and GPT-2; see docs/finetuning-and-evaluation.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def pose_position_ids(length: int, target_length: int, chunks: int = 2, generator: "torch.Generator | None" = None
                      ) -> "torch.LongTensor":
    """PoSE position ids [length] for a window of `length` tokens covering `target_length` positions."""
    import torch

    if not 1 <= chunks <= length:
        raise ValueError(f"PoSE needs 1 to {length} chunks for a window of {length} tokens, got {chunks}")
    if target_length < length:
        raise ValueError(f"the PoSE target length ({target_length}) must be at least the window ({length})")

    def uniform(low: int, high: int) -> int:  # an integer in [low, high]
        return low + int(torch.randint(high - low + 1, (1,), generator=generator))

    if chunks == 2:
        cuts = [uniform(1, (length + 1) // 2)]  # the reference code's first chunk
    else:
        cuts = sorted(torch.randperm(length - 1, generator=generator)[:chunks - 1].add(1).tolist())
    room = target_length - length
    positions = torch.arange(length)
    skip = 0
    for cut in cuts:
        skip = uniform(skip, room)
        positions[cut:] = torch.arange(cut, length) + skip
    return positions


def pose_chunks(position_ids: "torch.LongTensor") -> list[tuple[int, int]]:
    """(start index, end index) of the runs of consecutive ids in a 1-D id tensor."""
    breaks = [0, *((position_ids[1:] - position_ids[:-1]) != 1).nonzero().flatten().add(1).tolist(),
              position_ids.numel()]
    return [(a, b) for a, b in zip(breaks, breaks[1:]) if b > a]


def pack_documents(token_docs: list["torch.LongTensor"], block_size: int, separator: int | None
                   ) -> tuple["torch.LongTensor", "torch.LongTensor"]:
    """(blocks [n, block_size], position ids [n, block_size]): the blocks of ``text.pack_blocks`` and ids that
    restart at 0 at each document (the separator ends the document before it) and at each block."""
    import torch

    pieces, starts = [], []
    for i, ids in enumerate(token_docs):
        starts.append(sum(p.numel() for p in pieces))
        pieces.append(ids)
        if i < len(token_docs) - 1 and separator is not None:
            pieces.append(torch.tensor([separator], dtype=torch.long))
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    n_blocks = stream.numel() // block_size
    blocks = stream[: n_blocks * block_size].view(n_blocks, block_size)
    first = torch.zeros(stream.numel(), dtype=torch.bool)
    first[[s for s in starts if s < stream.numel()]] = True
    first = first[: n_blocks * block_size].view(n_blocks, block_size).clone()
    first[:, 0] = True
    index = torch.arange(block_size).expand(n_blocks, -1)
    last_start = torch.where(first, index, torch.zeros_like(index)).cummax(-1).values
    return blocks, index - last_start
