"""Perplexity of a causal LM over fixed-length windows of one token stream.

Two protocols, chosen by ``stride``:

* ``stride == window`` (default): non-overlapping windows; every token of a window except
  its first is scored, with the preceding tokens of the same window as context.
* ``stride < window``: the sliding-window protocol of jquesnelle/yarn ``eval/perplexity.py``.
  Windows of ``window`` tokens start every ``stride`` tokens; the first window scores all
  its tokens but the first, each later one scores only its last ``stride`` tokens (the
  ones the previous window did not reach), so each token is scored exactly once and,
  after the first window, with at least ``window - stride`` tokens of context.

Only full windows are used, so every score is taken at the stated context length; tokens
after the last full window are not scored. NLL is computed here in fp32 from the logits
(not from the model's loss), so ``n_scored_tokens`` is exact.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

# Rows of logits turned into log-probabilities at once; bounds the fp32 copy at long windows.
_CHUNK = 1024


@dataclass
class PerplexityResult:
    ppl: float
    nll_sum: float
    n_scored_tokens: int
    n_windows: int
    window: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.n_scored_tokens


def tokenize_text(tokenizer, text: str, max_tokens: int | None = None) -> torch.LongTensor:
    """Token ids of ``text`` as a 1-D LongTensor (the tokenizer's own special tokens).

    ``verbose=False`` silences the "longer than the maximum sequence length" warning: a
    whole book is longer than any window by design.
    """
    ids = tokenizer(text, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)


def window_starts(n_tokens: int, window: int, stride: int, max_windows: int | None) -> list[int]:
    """Start offsets of the full windows that fit in ``n_tokens``."""
    if n_tokens < window:
        raise ValueError(
            f"perplexity at window {window} needs {window} tokens, found {n_tokens}"
        )
    starts = list(range(0, n_tokens - window + 1, stride))
    return starts if max_windows is None else starts[:max_windows]


def _forward_kwargs(model, n_keep: int, window: int) -> dict:
    """Ask for only the logits we score, and no KV cache, where the model supports it."""
    params = inspect.signature(model.forward).parameters
    kwargs = {}
    if "use_cache" in params:
        kwargs["use_cache"] = False
    if "logits_to_keep" in params and n_keep < window:
        kwargs["logits_to_keep"] = n_keep
    return kwargs


def _window_nll(model, ids: torch.LongTensor, n_scored: int) -> torch.Tensor:
    """Summed NLL (fp32) of the last ``n_scored`` tokens of ``ids`` given the ones before."""
    n_keep = n_scored + 1  # the logits at positions -n_scored-1 .. -2 predict the scored ones
    logits = model(input_ids=ids[None], **_forward_kwargs(model, n_keep, ids.numel())).logits[0]
    logits = logits[-n_keep:-1]
    targets = ids[-n_scored:]
    total = torch.zeros((), dtype=torch.float32, device=logits.device)
    for lo in range(0, n_scored, _CHUNK):
        chunk = logits[lo : lo + _CHUNK].float()
        total += F.cross_entropy(chunk, targets[lo : lo + _CHUNK], reduction="sum")
    return total


def perplexity(
    model,
    token_ids: torch.LongTensor,
    window: int,
    max_windows: int | None = None,
    stride: int | None = None,
    progress: bool = True,
) -> PerplexityResult:
    """Perplexity of ``model`` on the 1-D ``token_ids`` (see the module docstring)."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be at least 1, got {max_windows}")

    starts = window_starts(token_ids.numel(), window, stride, max_windows)
    device = next(model.parameters()).device
    token_ids = token_ids.to(device)

    was_training = model.training
    model.eval()
    nll_sum = 0.0
    n_scored_total = 0
    try:
        with torch.inference_mode():
            bar = tqdm(starts, desc=f"ppl@{window}", unit="win", disable=not progress, leave=False)
            for i, start in enumerate(bar):
                n_scored = window - 1 if (i == 0 or stride == window) else stride
                nll = _window_nll(model, token_ids[start : start + window], n_scored)
                nll_sum += float(nll)
                n_scored_total += n_scored
                bar.set_postfix(ppl=f"{math.exp(nll_sum / n_scored_total):.2f}")
    finally:
        model.train(was_training)

    return PerplexityResult(
        ppl=math.exp(nll_sum / n_scored_total),
        nll_sum=nll_sum,
        n_scored_tokens=n_scored_total,
        n_windows=len(starts),
        window=window,
        stride=stride,
    )
