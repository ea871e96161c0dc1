"""The perplexity engine (hf_posenc.tools.perplexity) on one token stream, against a hand computation of the
protocol."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_posenc.tools.perplexity import perplexity_at_length

VOCAB = 64


@pytest.fixture(scope="module")
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tokens() -> torch.LongTensor:
    return torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(1))


def perplexity(model, tokens, window, max_windows=None, stride=None):
    """The engine on one stream, non-overlapping windows unless ``stride`` is given."""
    return perplexity_at_length(model, [tokens], window, stride or window, max_windows, progress=False)


def hand_nll(model, tokens, window, stride, max_windows=None):
    """Sum of -log p over each token, scored once, as the protocol describes in prose."""
    scored_positions: list[int] = []
    total = 0.0
    start, n_windows = 0, 0
    with torch.no_grad():
        while start + window <= len(tokens) and (max_windows is None or n_windows < max_windows):
            ids = tokens[start : start + window]
            logp = torch.log_softmax(model(ids[None]).logits[0].double(), dim=-1)
            first = 1 if (n_windows == 0 or stride == window) else window - stride
            for j in range(first, window):
                total -= logp[j - 1, ids[j]].item()
                scored_positions.append(start + j)
            start += stride
            n_windows += 1
    return total, scored_positions, n_windows


@pytest.mark.parametrize(
    "window, stride, max_windows",
    [(16, None, None), (16, 16, 3), (20, 7, None), (20, 7, 4), (10, 1, None), (100, None, None)],
)
def test_matches_hand_computation(tiny_llama, tokens, window, stride, max_windows):
    result = perplexity(tiny_llama, tokens, window, max_windows, stride)
    total, positions, n_windows = hand_nll(tiny_llama, tokens, window, stride or window, max_windows)

    assert result.n_windows == n_windows
    assert result.n_scored_tokens == len(positions)
    assert result.nll_sum == pytest.approx(total, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(total / len(positions)), rel=1e-5)


def test_sliding_window_scores_each_token_once(tiny_llama, tokens):
    window, stride = 20, 7
    result = perplexity(tiny_llama, tokens, window, stride=stride)
    _, positions, n_windows = hand_nll(tiny_llama, tokens, window, stride)

    assert len(positions) == len(set(positions))
    last_end = (n_windows - 1) * stride + window
    assert sorted(positions) == list(range(1, last_end))  # every token but the first
    assert result.n_windows == 1 + (len(tokens) - window) // stride
    assert result.n_scored_tokens == (window - 1) + (result.n_windows - 1) * stride


def test_non_overlapping_counts(tiny_llama, tokens):
    result = perplexity(tiny_llama, tokens, 16)
    assert result.n_windows == 100 // 16
    assert result.n_scored_tokens == 6 * 15


def test_a_document_shorter_than_the_length_is_skipped(tiny_llama, tokens):
    """Only full windows are scored: 100 tokens hold no window of 128, and no document, no perplexity."""
    assert perplexity(tiny_llama, tokens, 128) == (None, 0.0, 0, 0)
    both = perplexity_at_length(tiny_llama, [tokens[:50], tokens], 64, 64, progress=False)
    assert both.n_windows == 1 and both.n_scored_tokens == 63


@pytest.mark.parametrize("length, stride, max_windows, message", [
    (16, 0, None, "the stride must be in"), (16, 17, None, "the stride must be in"),
    (1, 1, None, "at least 2 tokens"), (16, 16, 0, "max_windows must be at least 1")])
def test_bad_protocol(tiny_llama, tokens, length, stride, max_windows, message):
    with pytest.raises(ValueError, match=message):
        perplexity_at_length(tiny_llama, [tokens], length, stride, max_windows, progress=False)


def test_result_unpacks_as_the_public_tuple(tiny_llama, tokens):
    """``hf_posenc.evaluate.perplexity_at_length`` (the public contract) is this engine; its result is the
    (ppl, nll_sum, tokens scored, windows) tuple, with names."""
    from hf_posenc import evaluate

    assert evaluate.perplexity_at_length is perplexity_at_length
    result = perplexity(tiny_llama, tokens, 16)
    ppl, nll_sum, n_scored, n_windows = result
    assert (ppl, nll_sum, n_scored, n_windows) == (result.ppl, result.nll_sum, result.n_scored_tokens,
                                                   result.n_windows)


def test_training_mode_restored(tiny_llama, tokens):
    tiny_llama.train()
    try:
        perplexity(tiny_llama, tokens, 16, max_windows=1)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()
