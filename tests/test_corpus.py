"""The test data kept in the repository matches what its manifests say about it.

``tests/corpus/MANIFEST.tsv`` lists every document with its sha256, its page count as the real
libraries read it (PyMuPDF, Pillow: not chandrad's own code), where it came from and its
licence; ``tests/fixtures/vllm_logs_sample.jsonl`` carries a source per excerpt. A file added,
changed or removed without its manifest row fails here.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pymupdf
import pytest
from conftest import CORPUS_DIR, REPO_ROOT, corpus_manifest
from PIL import Image

COLUMNS = ["file", "kind", "pages", "opens", "expect", "sha256", "source", "license",
           "attribution", "notes"]
KIND_TAGS = {"scan", "digital", "image", "multipage", "nonlatin"}
EXPECT = {"ok", "failed", "failed-or-ok"}
SOURCE = re.compile(r"^github\.com/[\w.-]+/[\w.-]+ @ [0-9a-f]{12} : \S+$")
ROWS = corpus_manifest()


def _library_pages(path: Path) -> tuple[str, str]:
    """``(pages, opens)`` as PyMuPDF (a ``%PDF`` header in the first KiB) or Pillow read it."""
    data = path.read_bytes()
    try:
        if b"%PDF" in data[:1024]:
            with pymupdf.open(path, filetype="pdf") as doc:  # type: ignore[no-untyped-call]
                opens = ("needs-password" if doc.needs_pass
                         else "repaired" if doc.is_repaired else "yes")
                return str(doc.page_count), opens
        with Image.open(path) as img:
            return str(getattr(img, "n_frames", 1)), "yes"
    except Exception as exc:  # the manifest records which one
        return "-", f"no ({type(exc).__name__})"


def test_manifest_lists_exactly_the_files_present() -> None:
    """Every file under good/ and bad/ has one row, and every row names a file that exists."""
    on_disk = sorted(str(p.relative_to(CORPUS_DIR)) for p in CORPUS_DIR.glob("*/*")
                     if p.is_file())
    listed = [row["file"] for row in ROWS]
    assert len(listed) == len(set(listed)), "duplicate rows"
    assert sorted(listed) == on_disk
    assert len(ROWS) == 40


def test_manifest_columns_are_complete() -> None:
    """The columns are as documented in tests/corpus/README.md, and none is left empty."""
    with (CORPUS_DIR / "MANIFEST.tsv").open(encoding="utf-8") as fh:
        assert fh.readline().rstrip("\n").split("\t") == COLUMNS
    for row in ROWS:
        assert None not in row, row  # no stray tab: a row has exactly the header's columns
        for column in COLUMNS:
            assert row[column].strip(), (row["file"], column)
        assert row["expect"] in EXPECT, row
        assert SOURCE.match(row["source"]), row["source"]
        tags = row["kind"].split(",")
        assert all(t in KIND_TAGS or t.startswith("broken:") for t in tags), row["kind"]
        assert row["file"].startswith("bad/") == tags[0].startswith("broken:"), row
        assert row["file"].startswith(("good/", "bad/"))
        if row["file"].startswith("good/"):
            assert row["expect"] == "ok", row


@pytest.mark.parametrize("row", ROWS, ids=[r["file"] for r in ROWS])
def test_file_matches_its_row(row: dict[str, str]) -> None:
    """sha256 of the bytes, and the page count and open status PyMuPDF/Pillow report."""
    path = CORPUS_DIR / row["file"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == row["sha256"]
    assert _library_pages(path) == (row["pages"], row["opens"])


def test_unknown_licences_are_explained_in_the_readme() -> None:
    """A row whose licence is unknown is named under "Points of doubt" in the README."""
    readme = (CORPUS_DIR / "README.md").read_text(encoding="utf-8")
    doubts = readme.split("### Points of doubt", 1)[1]
    unknown = [row["file"] for row in ROWS if row["license"].startswith("unknown")]
    assert unknown
    for name in unknown:
        assert f"`{name}`" in doubts, name


def test_log_excerpts_carry_their_source() -> None:
    """Each labelled vLLM excerpt has an id, a label, text and the public thread it came from."""
    path = REPO_ROOT / "tests" / "fixtures" / "vllm_logs_sample.jsonl"
    cases = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(cases) == 32
    assert len({c["id"] for c in cases}) == len(cases)
    for case in cases:
        assert case["label"] and case["text"], case["id"]
        assert re.match(r"^https://github\.com/[\w.-]+/[\w.-]+/(issues|pull)/\d+$",
                        case["source"]), case


#: How a path outside the checkout has been spelled: the machine's absolute tree, or the
#: folder that used to sit beside the repository (this file, which spells them, is skipped).
OUTSIDE = re.compile(r"/work/|\.\./shared|[\"']shared[\"']|shared/(corpus|fixtures)")


def test_no_code_names_a_path_outside_the_checkout() -> None:
    """Tests, bench, scripts, CI and the package read nothing outside the repository."""
    roots = ["chandrad", "tests", "bench", "scripts", ".ci"]
    files = [p for root in roots for p in (REPO_ROOT / root).rglob("*")
             if p.is_file() and (p.suffix in (".py", ".sh", ".toml") or root in ("scripts", ".ci"))
             and "fixtures" not in p.parts and "corpus" not in p.parts
             and p != Path(__file__).resolve()]
    assert len(files) > 40
    hits = [f"{p.relative_to(REPO_ROOT)}:{n}: {line.strip()}"
            for p in files for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if OUTSIDE.search(line)]
    assert hits == []
