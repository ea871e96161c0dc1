"""Perplexity of a causal LM over windows of a fixed length: the one measurement behind ``eval-ppl``, the main job
and the demo.

The protocol is the sliding window of jquesnelle/yarn ``eval/perplexity.py``. At each length L, windows of L tokens
start every ``stride`` tokens of each document (only full windows, so every score is taken at the stated length).
The first window of a document scores all its tokens but the first; each later window scores only the tokens past
the previous one (its last ``stride``), so every token is scored once and, after the first window, with at least
L - stride tokens of context. ``stride == L`` gives non-overlapping windows, each scoring all its tokens but the
first. Documents shorter than L are skipped. NLL is computed in fp32 from the logits (not from the model's loss),
and summed in window order, so the result is the same for any batch size and process count.

    from hf_posenc.tools.perplexity import perplexity_at_length
    result = perplexity_at_length(model, token_docs, length=1024, stride=256, max_windows=4)
    result.ppl, result.n_scored_tokens          # also unpacks: ppl, nll_sum, n_scored, n_windows = result
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # annotations only; torch is imported where it is used, so that --help stays fast
    import torch

from .runtime import gather_in_order, process_count

# Rows of logits turned into log-probabilities at once; bounds the fp32 copy at long windows.
LOGIT_ROWS_PER_CHUNK = 1024


class Perplexity(NamedTuple):
    ppl: float | None  # None when no document holds a full window
    nll_sum: float
    n_scored_tokens: int
    n_windows: int


class Window(NamedTuple):
    document: int
    start: int
    n_scored: int  # the last n_scored tokens of the window are scored


def check_protocol(length: int, stride: int, max_windows: int | None) -> None:
    if length < 2:
        raise ValueError(f"the length must be at least 2 tokens, got {length}")
    if not 1 <= stride <= length:
        raise ValueError(f"the stride must be in [1, length={length}], got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1, got {max_windows}")


def window_starts(n_tokens: int, length: int, stride: int, max_windows: int | None = None) -> list[int]:
    """Start offsets of the full windows of ``length`` that fit in ``n_tokens`` (none when fewer tokens)."""
    starts = list(range(0, n_tokens - length + 1, stride))
    return starts if max_windows is None else starts[:max_windows]


def window_plan(doc_lengths: list[int], length: int, stride: int, max_windows: int | None = None) -> list[Window]:
    """Every window at ``length``, documents in order (see the module docstring for what each one scores)."""
    return [Window(d, start, length - 1 if (i == 0 or stride == length) else stride)
            for d, n in enumerate(doc_lengths)
            for i, start in enumerate(window_starts(n, length, stride, max_windows))]


def windows_nll(model, windows: torch.LongTensor, n_scored: list[int]) -> list[float]:
    """Summed NLL (fp32) of the last ``n_scored[b]`` tokens of each window ``b`` of a [B, L] batch, each given the
    tokens before it (one forward)."""
    import torch
    import torch.nn.functional as F

    length = windows.shape[1]
    n_keep = max(n_scored) + 1  # the logits at positions -n-1 .. -2 predict the last n tokens
    logits = model(input_ids=windows, **_forward_kwargs(model, n_keep, length)).logits
    sums = []
    for b, n in enumerate(n_scored):
        rows, targets = logits[b, -n - 1 : -1], windows[b, -n:]
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        for lo in range(0, n, LOGIT_ROWS_PER_CHUNK):
            chunk = slice(lo, lo + LOGIT_ROWS_PER_CHUNK)
            total += F.cross_entropy(rows[chunk].float(), targets[chunk], reduction="sum")
        sums.append(float(total))
    return sums


def _forward_kwargs(model, n_keep: int, length: int) -> dict:
    """Ask for only the logits we score, and no KV cache, where the model supports it."""
    params = inspect.signature(model.forward).parameters
    kwargs = {}
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if "logits_to_keep" in params and n_keep < length:
        kwargs["logits_to_keep"] = n_keep
    return kwargs


def perplexity_at_length(model, token_docs: list[torch.LongTensor], length: int, stride: int,
                         max_windows: int | None = None, batch_size: int = 1, accelerator=None,
                         progress: bool = True, desc: str = "", bar=None) -> Perplexity:
    """Perplexity at one ``length`` over the 1-D token tensors ``token_docs``: ``(ppl, nll_sum, tokens scored,
    windows)``. With an ``accelerator`` of several processes, the windows are split across them (round robin) and
    the per-window NLLs gathered and summed in window order on every process, so the numbers equal a one-process
    run's. ``bar``: a stage's bar (``tools.progress``) that this length's windows advance, kept open for the next
    length; without it the length has its own."""
    import torch

    from .progress import progress as progress_bar

    check_protocol(length, stride, max_windows)
    plan = window_plan([ids.numel() for ids in token_docs], length, stride, max_windows)
    rank = accelerator.process_index if accelerator is not None else 0
    mine = list(range(rank, len(plan), process_count(accelerator)))
    device = next(model.parameters()).device
    local: list[tuple[int, float]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            own_bar = bar is None
            if own_bar:
                bar = progress_bar(total=len(mine), desc=desc or f"ppl@{length}", unit="win",
                                   enabled=progress and rank == 0)
            for lo in range(0, len(mine), batch_size):
                batch = [plan[i] for i in mine[lo : lo + batch_size]]
                windows = torch.stack([token_docs[w.document][w.start : w.start + length] for w in batch])
                nlls = windows_nll(model, windows.to(device), [w.n_scored for w in batch])
                local.extend(zip(mine[lo : lo + batch_size], nlls))
                bar.update(len(batch))
            if own_bar:
                bar.close()
    finally:
        model.train(was_training)
    nlls = gather_in_order(local, accelerator)
    if len(nlls) != len(plan):
        raise RuntimeError(f"gathered {len(nlls)} window results, expected {len(plan)}")
    nll_sum = 0.0
    for nll in nlls:  # fixed order: the same float sum whatever the process count
        nll_sum += nll
    n_scored = sum(w.n_scored for w in plan)
    return Perplexity(math.exp(nll_sum / n_scored) if n_scored else None, nll_sum, n_scored, len(plan))
