"""Reading the shared evaluation text (never vendored into the repository)."""

from __future__ import annotations

import codecs
import os
from pathlib import Path

DATA_ENV = "HF_POSENC_DATA"
DEFAULT_ENCODING = "utf-8"


class DataError(ValueError):
    """Bad or insufficient input text; the message says what was found and what was needed."""


def _candidate_data_dirs() -> list[Path]:
    repo = Path(__file__).resolve().parents[2]
    return [repo.parent / "shared" / "data", Path.cwd() / "shared" / "data"]


def default_data_dir() -> Path:
    """``$HF_POSENC_DATA``, else ``<repo>/../shared/data``, else ``./shared/data``."""
    env = os.environ.get(DATA_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"{DATA_ENV}={env} is not a directory (unset it to use ../shared/data beside the repository)"
            )
        return path
    candidates = _candidate_data_dirs()
    for path in candidates:
        if path.is_dir():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise FileNotFoundError(
        f"No evaluation text found (tried {tried}). Set {DATA_ENV} to the folder that holds "
        "the shared text files, or pass a file path explicitly."
    )


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
        raise FileNotFoundError(
            f"Text file not found: {path}. The shared data folder is found through "
            f"{DATA_ENV} or at ../shared/data beside the repository."
        )
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
