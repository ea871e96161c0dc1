"""Every relative link in README.md and docs/*.md reaches a file of the repository, and every #anchor a heading of
the page it names, with headings turned into anchors as GitHub does. Pages and headings change (benchmarks.md keeps
only current figures); a link left behind would otherwise rot silently."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        base = anchor(line.lstrip("#"))
        count = seen.get(base, 0)
        found.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return found


def links(page: Path):
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if not re.match(r"^[a-z]+:", target):  # http:, https:, mailto: are not checked (no network)
            yield target


def test_the_anchor_rule_matches_github():
    assert anchor(" On an H200 (CUDA), 2026-11-27: content blocks, Sandwich's peak") == \
        "on-an-h200-cuda-2026-11-27-content-blocks-sandwichs-peak"
    assert anchor(" The last 4 layers, distilled: within 10 % on both texts") == \
        "the-last-4-layers-distilled-within-10--on-both-texts"  # the dropped '%' leaves two spaces, two hyphens
    assert anchor(" A compiled fine-tune step (`torch.compile`, CPU)") == "a-compiled-fine-tune-step-torchcompile-cpu"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_reaches_a_file_and_a_heading(page):
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file}")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no heading with the anchor #{fragment} in {file.name}")
    assert not broken, f"{page.name} has broken links:\n" + "\n".join(broken)


MENTION = re.compile(r"docs/figures/[\w\-./]+")


def test_every_figure_file_is_shown_or_named_by_a_page():
    """docs/figures holds what the pages show: each file there is linked from a page, sits beside a linked file of the
    same name (the JSON of a plotted PNG), or lies under a path a page names (`docs/figures/run/`). Runs that the
    pages no longer cite leave with their text; git keeps both."""
    linked, named = set(), set()
    for page in PAGES:
        text = page.read_text()
        for target in links(page):
            path = (page.parent / target.partition("#")[0]).resolve()
            linked.add(path)
            if path.is_dir():
                named.add(f"{path}/")
        named.update(str(REPO / m.rstrip(".,)")) for m in MENTION.findall(text))
    stems = {path.with_suffix("") for path in linked}
    unreferenced = [
        str(file.relative_to(REPO)) for file in sorted((REPO / "docs" / "figures").rglob("*")) if file.is_file()
        and file not in linked and file.with_suffix("") not in stems and not any(str(file).startswith(n) for n in named)]
    assert not unreferenced, "files no page links or names (git rm them, or link them):\n" + "\n".join(unreferenced)


# Dates of upstream code a page cites (not of our runs): LongLM's self-extend fix, in methods.md and rope-extension.md.
UPSTREAM_DATES = {"2024-05-23"}


def commit_hashes_and_dates(text: str) -> tuple[list[str], list[str]]:
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    dates = [d for d in re.findall(r"\b20\d\d-\d\d-\d\d\b", text) if d not in UPSTREAM_DATES]
    return hashes, dates


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_is_a_reference_not_a_notebook(page):
    """The pages say what the code is, not when it was run (issue 52): no commit hashes or dates of runs; the runs
    behind earlier figures are in git."""
    hashes, dates = commit_hashes_and_dates(page.read_text())
    assert not hashes and not dates, f"{page.name}: commit hashes {hashes[:5]}, dates {dates[:5]}"


def test_the_benchmarks_page_is_short():
    """docs/benchmarks.md keeps one current table per benchmark (issue 52), short enough to read."""
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert len(text.splitlines()) <= 400, "docs/benchmarks.md over 400 lines: keep the current figures only"
