"""Every link from one of the repository's Markdown files to another reaches a file that exists and,
where it names a heading (`#anchor`), a heading that file has, under the anchor GitHub gives it."""
from __future__ import annotations

import functools
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt
from mdit_py_plugins.anchors import anchors_plugin

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "benchmarks").glob("*.md")])
PARSER = MarkdownIt().use(anchors_plugin, min_level=1, max_level=6)


def parse(path: Path) -> list:
    return PARSER.parse(path.read_text())


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    return frozenset(token.attrs["id"] for token in parse(path) if token.type == "heading_open")


def local_links(path: Path) -> list[str]:
    """The hrefs of the file's links that stay in the repository (no scheme, no host)."""
    hrefs = [child.attrs["href"] for token in parse(path) if token.type == "inline"
             for child in token.children or [] if child.type == "link_open"]
    return [href for href in hrefs if not (parts := urlsplit(href)).scheme and not parts.netloc]


def test_the_anchors_are_githubs() -> None:
    """A heading's anchor as GitHub writes it: lower case, punctuation and symbols dropped, spaces
    turned into hyphens; the links below are only checked if this holds."""
    doc = PARSER.parse("## 4. On an H100\n\n### A 1.7B Q4_K_M file (issue 38, AVX-512)\n\n## `bench serve` × 2\n")
    assert [t.attrs["id"] for t in doc if t.type == "heading_open"] == [
        "4-on-an-h100", "a-17b-q4_k_m-file-issue-38-avx-512", "bench-serve--2"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_between_the_docs_reaches_its_file_and_heading(doc: Path) -> None:
    broken = []
    for href in local_links(doc):
        parts = urlsplit(href)
        target_path, anchor = parts.path, unquote(parts.fragment)
        target = (doc.parent / target_path).resolve() if target_path else doc
        if not target.exists():
            broken.append(f"{href}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{href}: no heading #{anchor} in {target.relative_to(ROOT)}")
    assert not broken, broken
