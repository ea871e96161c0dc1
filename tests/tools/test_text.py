"""Text for the tools (hf_posenc.tools.text): reading files, the shared text folder, documents, fractions, blocks."""

from __future__ import annotations

import pytest
import torch
from tool_helpers import BOOK

from hf_posenc.tools.text import (DATA_ENV, DataError, Document, data_dir, expand_text_files, load_documents,
                                  pack_blocks, parse_fraction, read_text, split_text, tokenize_documents)

needs_data = pytest.mark.skipif(not BOOK.is_file(), reason="../shared/data is not there")


def test_the_text_folder_is_the_option_else_the_environment(tmp_path, monkeypatch):
    """The library does not know where the checkout lies: --data-dir, else $HF_POSENC_DATA, else a one-line
    refusal naming both (scripts/main.sh sets the variable to ../shared/data beside the checkout)."""
    monkeypatch.delenv(DATA_ENV, raising=False)
    with pytest.raises(DataError, match=f"pass --data-dir DIR or set {DATA_ENV}=DIR"):
        data_dir(None)
    assert data_dir(tmp_path) == tmp_path
    monkeypatch.setenv(DATA_ENV, str(tmp_path))
    assert data_dir(None) == tmp_path
    (tmp_path / "other").mkdir()
    assert data_dir(tmp_path / "other") == tmp_path / "other"  # the option wins
    monkeypatch.setenv(DATA_ENV, str(tmp_path / "missing"))
    with pytest.raises(DataError, match=f"{DATA_ENV}={tmp_path / 'missing'} is not a folder"):
        data_dir(None)
    with pytest.raises(DataError, match="--data-dir .* is not a folder"):
        data_dir(tmp_path / "missing")


def test_tokenize_documents_truncates():
    class WordTokenizer:
        def __call__(self, text, verbose=True):
            return {"input_ids": [len(word) for word in text.split()]}

    [ids] = tokenize_documents(WordTokenizer(), [Document("d", "a bb ccc dddd")], max_tokens=3)
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


@needs_data
def test_text_loading_helpers(tmp_path):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "a.txt").write_text(BOOK.read_text(encoding="utf-8")[:5000], encoding="utf-8")
    docs = load_documents(dataset=str(tmp_path / "ds"), split="train", max_documents=7)  # a local `datasets` folder
    assert len(docs) == 7 and all(d.text.strip() for d in docs)
    with pytest.raises(DataError, match="columns: text"):
        load_documents(dataset=str(tmp_path / "ds"), split="train", text_column="body")
    # fractions cut every document at the same boundary: train + held-out == the whole, no overlap
    whole = load_documents([str(BOOK)])[0].text
    head = load_documents([str(BOOK)], fraction="0:0.8")[0].text
    tail = load_documents([str(BOOK)], fraction="0.8:1")[0].text
    assert head + tail == whole and 0.75 < len(head) / len(whole) < 0.85
    assert parse_fraction("0.8:") == (0.8, 1.0)
    assert [p.name for p in expand_text_files([str(BOOK.parent / "pg84-*.txt"), str(BOOK)])] == \
        ["pg84-frankenstein.README.txt", BOOK.name]  # sorted, without duplicates
    blocks = pack_blocks([torch.arange(5), torch.arange(7)], 4, separator=99)
    assert blocks.tolist() == [[0, 1, 2, 3], [4, 99, 0, 1], [2, 3, 4, 5]]


def test_text_files_may_be_paths(tmp_path):
    """A caller of load_documents from code may pass Path objects, in messages too."""
    (tmp_path / "a.txt").write_text("Some text.\n")
    assert [d.text for d in load_documents([tmp_path / "a.txt"])] == ["Some text.\n"]
    with pytest.raises(DataError, match=f"--text-file '{tmp_path}' is a folder"):
        expand_text_files([tmp_path])


def test_start_text_that_does_not_occur_is_refused_naming_the_file(tmp_path):
    """--start-text (finetune, eval-ppl) silently kept the whole file when the text was absent (issue 51, item 9)."""
    book = tmp_path / "book.txt"
    book.write_text("Front matter.\nChapter 1. It begins.\n", encoding="utf-8")
    (doc,) = load_documents([str(book)], start_text="Chapter 1")
    assert doc.text == "Chapter 1. It begins.\n"
    with pytest.raises(DataError, match=f"--start-text 'Chapter 9' does not occur in {book}"):
        load_documents([str(book)], start_text="Chapter 9")
