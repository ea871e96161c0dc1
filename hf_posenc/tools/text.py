"""Text for fine-tuning and evaluation: reading files, the shared text folder, documents from files (globs) or a
``datasets`` dataset, tokenised and packed into blocks.

A *document* is one file (a book; WikiText is treated as one stream) or one row of a dataset. ``fraction=(lo, hi)``
keeps the part of every document between those fractions of its length, cut at a paragraph or line boundary
(``split_text``), so "first 80 % for training, last 20 % for evaluation" is ``(0, 0.8)`` and ``(0.8, 1)``, and the
two never overlap.
"""

from __future__ import annotations

import argparse
import codecs
import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only; torch is imported where it is used, so that --help stays fast
    import torch

from .runtime import UsageError

DATA_ENV = "HF_POSENC_DATA"
DEFAULT_ENCODING = "utf-8"


class DataError(UsageError):
    """Bad or insufficient input text; the message says what was found and what was needed."""


def data_dir(option: str | os.PathLike | None = None) -> Path:
    """The folder of the shared text files: ``--data-dir`` when given, else ``$HF_POSENC_DATA``. The library does
    not guess where it lies; ``bash scripts/main.sh`` sets the variable to ``../shared/data`` beside the checkout."""
    chosen = option or os.environ.get(DATA_ENV)
    if not chosen:
        raise DataError(f"no text folder given: pass --data-dir DIR or set {DATA_ENV}=DIR (the folder that holds the "
                        "shared text files; bash scripts/main.sh sets it to ../shared/data beside the checkout)")
    path = Path(chosen).expanduser()
    if not path.is_dir():
        given = f"--data-dir {chosen}" if option else f"{DATA_ENV}={chosen}"
        raise DataError(f"{given} is not a folder; give the folder that holds the shared text files")
    return path


def check_encoding(encoding: str) -> str:
    """``encoding`` if Python knows it, else a DataError naming it."""
    try:
        codecs.lookup(encoding)
    except LookupError:
        raise DataError(f"--encoding {encoding!r} is not an encoding Python knows (e.g. utf-8, cp1252, "
                        "latin-1)") from None
    return encoding


def read_text(path: str | os.PathLike, encoding: str = DEFAULT_ENCODING) -> str:
    """Read a text file with ``\\n`` line ends (WikiText ships with CRLF). UTF-8 by default, a leading byte-order
    mark dropped; a file that does not decode is a DataError naming the file, the byte and the fix."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a text file; pass the files in it (a glob such as "
                        f"'{path}/*.txt' where the option takes one)")
    if not path.is_file():
        raise FileNotFoundError(f"Text file not found: {path} (the commands find the shared text folder through "
                                f"--data-dir or ${DATA_ENV})")
    data = path.read_bytes()
    is_utf8 = codecs.lookup(check_encoding(encoding)).name == "utf-8"
    try:
        text = data.decode("utf-8-sig" if is_utf8 else encoding)
    except LookupError as exc:  # a codec that is not bytes-to-text, such as rot13
        raise DataError(f"--encoding {encoding!r}: {exc}") from None
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"{path} is not valid {encoding} text ({exc.reason}: byte {data[exc.start]:#04x} at offset "
                        f"{exc.start}, line {line}); pass --encoding with the file's encoding, e.g. --encoding cp1252 "
                        "or --encoding latin-1") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def split_text(text: str, train_fraction: float = 0.8) -> tuple[str, str]:
    """Split into ``(train, heldout)`` at a paragraph or line boundary near the fraction.

    The cut goes at the closest blank line within 5 % of the text length of the target,
    else the closest line end, else exactly at the target. ``train + heldout == text``.
    """
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
    target = round(len(text) * train_fraction)
    slack = max(1, len(text) // 20)
    for separator in ("\n\n", "\n"):
        cut = _nearest_boundary(text, separator, target, slack)
        if cut is not None:
            return text[:cut], text[cut:]
    return text[:target], text[target:]


def _nearest_boundary(text: str, separator: str, target: int, slack: int) -> int | None:
    """Index just after the ``separator`` occurrence nearest ``target``, within ``slack``."""
    before = text.rfind(separator, max(0, target - slack - len(separator)), target)
    after = text.find(separator, target, target + slack)
    cuts = [i + len(separator) for i in (before, after) if i != -1]
    # A cut at either end would leave one side empty.
    cuts = [c for c in cuts if 0 < c < len(text) and abs(c - target) <= slack]
    return min(cuts, key=lambda c: abs(c - target)) if cuts else None


@dataclass
class Document:
    name: str
    text: str


def expand_text_files(patterns: list[str | os.PathLike]) -> list[Path]:
    """Paths matching each pattern (a file or a glob), in order, without duplicates."""
    paths: list[Path] = []
    for pattern in map(os.fspath, patterns):
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
            if start_text:  # text that does not occur is refused, as the demo's --start-text (it was ignored)
                offset = text.find(start_text)
                if offset < 0:
                    raise DataError(f"--start-text {start_text!r} does not occur in {path}; give text that does, or "
                                    "leave --start-text out to start each file at its beginning")
                text = text[offset:]
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
    import torch

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
    import torch

    pieces = []
    for i, ids in enumerate(token_docs):
        if i and separator is not None:
            pieces.append(torch.tensor([separator], dtype=torch.long))
        pieces.append(ids)
    stream = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)
    n_blocks = stream.numel() // block_size
    return stream[: n_blocks * block_size].view(n_blocks, block_size)


def add_text_arguments(parser: argparse.ArgumentParser, split: str = "test") -> None:
    """The options that choose the text of ``load_documents`` (shared by finetune and eval-ppl)."""
    g = parser.add_argument_group("text")
    g.add_argument("--text-file", action="append", default=None, help="text file or glob; repeatable")
    g.add_argument("--encoding", default=DEFAULT_ENCODING,
                   help="encoding of the text files (a file that does not decode is refused, naming the byte; e.g. "
                        "cp1252 or latin-1 for older files)")
    g.add_argument("--dataset", default=None, help="a datasets name or path (Hub, offline cache, or local)")
    g.add_argument("--dataset-config", default=None, help="the dataset's configuration name, where it has several")
    g.add_argument("--split", default=split, help="dataset split")
    g.add_argument("--text-column", default="text", help="the dataset's column that holds the text")
    g.add_argument("--text-fraction", default=None,
                   help="part of every document to use, START:END fractions, e.g. 0:0.8 or 0.8:1 (default: all)")
    g.add_argument("--start-text", default=None, help="start each text file at the first occurrence of this string")


def documents_of(args: argparse.Namespace) -> list["Document"]:
    """``load_documents`` with the options of ``add_text_arguments``."""
    return load_documents(args.text_file, args.dataset, args.dataset_config, args.split, args.text_column,
                          args.text_fraction, args.start_text, encoding=args.encoding)
