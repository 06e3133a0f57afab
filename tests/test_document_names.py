"""One name per document across ``done/`` and ``output/``, on the real daemon
with the stand-in engine.

It used to be two clash rules: ``report.pdf`` and ``report.png`` went to ``output/report/``
and ``output/report (1)/`` while ``done/`` kept ``report.png``; a second ``report.pdf``
became ``done/report (1).pdf`` with its outputs in ``output/report (2)/``; identical bytes
dropped as ``memo.jpg`` and ``memo.jpeg`` shared one output folder whose source named only
one. Now the output folder and the done name carry the same `` (n)``
(``outputs.document_slot``).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import CORPUS_DIR
from daemon_harness import Daemon, drop
from standin_engine import StandinServer

PDF_A = CORPUS_DIR / "good" / "scan_book-page_c02-22.pdf"
PDF_B = CORPUS_DIR / "good" / "scan_skewed_linn.pdf"
PNG = CORPUS_DIR / "good" / "image_hi-devanagari.png"
JPG = CORPUS_DIR / "good" / "image_us-senate-document-1870s.jpg"

#: (source file, name dropped as, the one name it must end with in done/ and output/)
DROPS = [
    (PDF_A, "report.pdf", "report"),
    (PNG, "report.png", "report (1)"),
    (PDF_B, "report.pdf", "report (2)"),
    (JPG, "memo.jpg", "memo"),
    (JPG, "memo.jpeg", "memo (1)"),
]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    engine = StandinServer(tmp_path / "engine").start()
    d = Daemon(tmp_path / "d", f'[engine]\nurl = "{engine.url}"\nserved_model_name = "chandra"\n')
    try:
        d.start()
        d.wait_answering(60)
        yield d
    finally:
        d.cleanup(grace=30)
        engine.stop()


def _finished(daemon: Daemon, count: int) -> bool:
    """Whether ``count`` jobs are final."""
    final = [j for j in daemon.jobs() if j["state"] in ("done", "partial", "failed")]
    return len(final) == count


def test_done_and_output_share_one_name_per_document(daemon: Daemon) -> None:
    """Each document is dropped once the one before is finished (the names depend on the
    order): its input in done/ and its output folder have the same name, which
    ``chandractl queue`` shows, and the output folder's metadata names that input."""
    for count, (source, name, _) in enumerate(DROPS, start=1):
        drop(source, daemon.inbox, name)
        daemon.wait_for(f"{name} finished", functools.partial(_finished, daemon, count), 120)
    jobs = sorted(daemon.jobs(), key=lambda j: j["id"])
    assert [j["state"] for j in jobs] == ["done"] * len(DROPS), jobs
    seen = []
    for job, (_, name, expected) in zip(jobs, DROPS, strict=True):
        final, out = Path(job["final_path"]), Path(job["output_dir"])
        assert (final.parent, out.parent) == (daemon.done, daemon.output), job
        assert (final.stem, out.name) == (expected, expected), job
        assert final.suffix == Path(name).suffix and final.is_file()
        metadata = json.loads((out / f"{Path(name).stem}_metadata.json").read_text())
        assert metadata["source"] == name and metadata["source_sha256"] == job["sha256"]
        seen.append(out)
    assert len(set(seen)) == len(DROPS)
