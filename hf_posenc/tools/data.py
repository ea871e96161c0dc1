"""Text for fine-tuning and evaluation: local files (globs) or a Hub dataset, tokenised and packed.

A *document* is one file (a book; WikiText is treated as one stream) or one row of a dataset.
``fraction=(lo, hi)`` keeps the part of every document between those fractions of its length, cut at
a paragraph or line boundary (``hf_posenc.text.split_text``), so "first 80 % for training, last
20 % for evaluation" is ``(0, 0.8)`` and ``(0.8, 1)``, and the two never overlap.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .text import DEFAULT_ENCODING, DataError, read_text, split_text


@dataclass
class Document:
    name: str
    text: str


def expand_text_files(patterns: list[str]) -> list[Path]:
    """Paths matching each pattern (a file or a glob), in order, without duplicates."""
    paths: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = sorted(Path(p) for p in glob.glob(expanded, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"--text-file {pattern!r}: the pattern matches no file")
        else:
            path = Path(expanded)
            if path.is_dir():
                raise DataError(f"--text-file {pattern!r} is a folder, not a text file; pass a glob such as "
                                f"'{pattern.rstrip('/')}/*.txt'")
            if not path.is_file():
                raise DataError(f"--text-file {pattern!r}: no such file")
            matches = [path]
        for path in matches:
            if path not in paths:
                paths.append(path)
    return paths


def parse_fraction(value: str | tuple[float, float] | None) -> tuple[float, float]:
    """'0:0.8' -> (0.0, 0.8); None -> (0, 1)."""
    if value is None:
        return (0.0, 1.0)
    if isinstance(value, tuple):
        lo, hi = value
    else:
        try:
            lo_s, hi_s = str(value).split(":")
            lo, hi = float(lo_s or 0.0), float(hi_s or 1.0)
        except ValueError:
            raise DataError(f"text fraction {value!r} must look like 'START:END', e.g. '0:0.8' or '0.8:1'") from None
    if not 0.0 <= lo < hi <= 1.0:
        raise DataError(f"text fraction {value!r}: need 0 <= START < END <= 1")
    return (float(lo), float(hi))


def slice_fraction(text: str, fraction: tuple[float, float]) -> str:
    """The part of ``text`` between the two fractions of its length, cut at paragraph/line boundaries."""
    lo, hi = fraction
    lo_cut = len(split_text(text, lo)[0]) if lo > 0.0 else 0
    hi_cut = len(split_text(text, hi)[0]) if hi < 1.0 else len(text)
    return text[lo_cut:hi_cut]


def load_documents(
    text_files: list[str] | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    fraction: str | tuple[float, float] | None = None,
    start_text: str | None = None,
    max_documents: int | None = None,
    encoding: str = DEFAULT_ENCODING,
) -> list[Document]:
    """Documents from text files (globs allowed, read in ``encoding``) and/or a ``datasets`` dataset (Hub id or
    local)."""
    frac = parse_fraction(fraction)
    docs: list[Document] = []
    if text_files:
        for path in expand_text_files(text_files):
            text = read_text(path, encoding)
            if start_text:
                offset = text.find(start_text)
                text = text[offset:] if offset >= 0 else text
            docs.append(Document(path.name, text))
    if dataset:
        import datasets

        try:
            ds = datasets.load_dataset(dataset, dataset_config, split=split)
        except Exception as exc:  # datasets raises many types; keep the message, make it ours
            raise DataError(f"--dataset {dataset!r} (config {dataset_config!r}, split {split!r}) could not be "
                            f"loaded: {type(exc).__name__}: {exc}") from None
        if text_column not in ds.column_names:
            raise DataError(f"--text-column {text_column!r} is not a column of {dataset!r}; "
                            f"columns: {', '.join(ds.column_names)}")
        for i, row in enumerate(ds):
            if max_documents is not None and len(docs) >= max_documents:
                break
            text = row[text_column]
            if isinstance(text, str) and text.strip():
                docs.append(Document(f"{dataset}[{i}]", text))
    if not text_files and not dataset:
        raise DataError("no text given: pass --text-file PATH (globs allowed) or --dataset NAME")
    if frac != (0.0, 1.0):
        docs = [Document(d.name, slice_fraction(d.text, frac)) for d in docs]
    if not any(d.text.strip() for d in docs):
        names = ", ".join(d.name for d in docs[:3]) + (", ..." if len(docs) > 3 else "")
        raise DataError(f"the text is empty (no non-blank document in {names or 'the input'}); give text to read")
    docs = [d for d in docs if d.text.strip()]
    if max_documents is not None:
        docs = docs[:max_documents]
    return docs


def tokenize_documents(tokenizer, docs: list[Document], max_tokens: int | None = None) -> list[torch.LongTensor]:
    """Each document as a 1-D LongTensor of token ids (no special tokens beyond the tokenizer's own)."""
    out = []
    for doc in docs:
        text = doc.text
        if max_tokens is not None:
            # Tokenising a whole book to keep its first few thousand tokens is slow; ~4 chars per token, x2 margin.
            text = text[: max_tokens * 8]
        ids = tokenizer(text, verbose=False)["input_ids"]
        if max_tokens is not None:
            ids = ids[:max_tokens]
        out.append(torch.tensor(ids, dtype=torch.long))
    return out


def pack_blocks(token_docs: list[torch.LongTensor], block_size: int, separator: int | None) -> torch.LongTensor:
    """Concatenate documents (with ``separator`` between them, if given) and cut into full blocks
    [n_blocks, block_size]; the remainder is dropped."""
    pieces = []
    for i, ids in enumerate(token_docs):
        if i and separator is not None:
            pieces.append(torch.tensor([separator], dtype=torch.long))
        pieces.append(ids)
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    n_blocks = stream.numel() // block_size
    return stream[: n_blocks * block_size].view(n_blocks, block_size)
