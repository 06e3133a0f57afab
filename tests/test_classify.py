"""Tests for the failure classifier (chandrad.engine.classify) and ``chandractl diagnose``.

Inputs are real text: labelled excerpts from issue threads, vLLM's own message templates,
issue-thread logs, messages provoked on an H200, and CPU-engine logs captured here.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from chandrad.ctl.diagnose import run_diagnose
from chandrad.engine.classify import FailureClass, LineScanner, classify

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
OWN = FIXTURES / "classify"


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


#: Labelled excerpts from public issue threads (provenance: tests/fixtures/README.md). Read at
#: collection: a missing file is a collection error, never an empty parametrize list.
SHARED = _jsonl(FIXTURES / "vllm_logs_sample.jsonl")
CASES = _jsonl(OWN / "cases.jsonl")
H200 = json.loads((OWN / "h200_manifest.json").read_text())


def _label(label: str) -> FailureClass:
    return FailureClass.NONE if label == "ready" else FailureClass(label)


@pytest.mark.parametrize("case", SHARED, ids=[c["id"] for c in SHARED])
def test_shared_labelled_excerpts(case: dict[str, Any]) -> None:
    """Every labelled real excerpt in fixtures/vllm_logs_sample.jsonl classifies to its label."""
    d = classify(case["text"])
    assert d.cls is _label(case["label"]), d
    assert (d.evidence == "") == (d.cls is FailureClass.NONE)


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_own_cases(case: dict[str, Any]) -> None:
    """Template and issue-thread cases: class, subclass, restartability and figures."""
    d = classify(
        case["text"], exit_code=case.get("exit_code"), was_ready=case.get("was_ready", False)
    )
    assert d.cls is FailureClass(case["label"]), d
    if "subclass" in case:
        assert d.subclass == case["subclass"]
    if "restartable" in case:
        assert d.restartable is case["restartable"]
    for key, value in case.get("numbers", {}).items():
        assert d.numbers[key] == pytest.approx(value, abs=1e-3), key
    assert d.action
    assert (d.evidence == "") == (d.cls is FailureClass.NONE)


@pytest.mark.parametrize("name", sorted(H200), ids=sorted(H200))
def test_h200_captured_messages(name: str) -> None:
    """Messages provoked on a real H200 classify as their scenario says."""
    d = classify((OWN / name).read_text())
    assert d.cls is FailureClass(H200[name]["label"]), d


def test_h200_fragmentation_figures() -> None:
    """The H200 fragmentation OOM yields U=69.5 GiB unallocated against R=768 MiB requested."""
    d = classify((OWN / "h200_frag.txt").read_text())
    assert d.numbers["reserved_unallocated_gib"] == pytest.approx(69.5)
    assert d.numbers["requested_gib"] == pytest.approx(0.75)
    assert d.numbers["total_gib"] == pytest.approx(139.8)
    assert d.numbers["free_gib"] == pytest.approx(293.12 / 1024, abs=1e-4)


def test_expandable_hint_alone_is_not_fragmentation() -> None:
    """A GPU-full OOM carries the expandable_segments hint but U=0, so it is not fragmentation."""
    text = (OWN / "h200_full.txt").read_text()
    assert "expandable_segments" in text
    d = classify(text)
    assert d.cls is FailureClass.CUDA_OOM_LOAD
    assert d.numbers["reserved_unallocated_gib"] == 0.0
    assert d.numbers["allocated_gib"] == pytest.approx(139.0)


def _with_figures(requested: str, unallocated: str) -> str:
    text = (OWN / "h200_frag.txt").read_text()
    return text.replace("Tried to allocate 768.00 MiB", f"Tried to allocate {requested}").replace(
        "and 69.50 GiB is reserved", f"and {unallocated} is reserved"
    )


@pytest.mark.parametrize(
    ("requested", "unallocated", "expected"),
    [
        ("100.00 MiB", "255.00 MiB", FailureClass.CUDA_OOM_LOAD),  # U >= R but below 256 MiB
        ("100.00 MiB", "256.00 MiB", FailureClass.FRAGMENTATION),  # U >= R and U >= 256 MiB
        ("600.00 MiB", "512.00 MiB", FailureClass.CUDA_OOM_LOAD),  # U < R and U < 1 GiB
        ("4.00 GiB", "1.00 GiB", FailureClass.FRAGMENTATION),  # U >= 1 GiB regardless of R
        ("4.00 GiB", "1048576.00 KiB", FailureClass.FRAGMENTATION),  # same in KiB
        ("300 bytes", "268435456 bytes", FailureClass.FRAGMENTATION),  # bytes: 256 MiB
    ],
)
def test_fragmentation_thresholds(requested: str, unallocated: str, expected: FailureClass) -> None:
    """Fragmentation (docs/operations.md, Failure classes): U >= R and U >= 256 MiB, or
    U >= 1 GiB, in any unit."""
    assert classify(_with_figures(requested, unallocated)).cls is expected


def test_oom_after_ready_is_runtime_but_fragmentation_stays() -> None:
    """was_ready turns a plain OOM into cuda_oom_runtime; a fragmentation OOM stays one."""
    full = (OWN / "h200_full.txt").read_text()
    assert classify(full, was_ready=True).cls is FailureClass.CUDA_OOM_RUNTIME
    frag = (OWN / "h200_frag.txt").read_text()
    assert classify(frag, was_ready=True).cls is FailureClass.FRAGMENTATION


def test_nccl_wrapped_oom_is_an_oom_class() -> None:
    """NCCL's 'Failed to CUDA calloc' (captured on the H200) is a device OOM, not other_fatal."""
    text = (OWN / "h200_nccl.txt").read_text()
    d = classify(text)
    assert (d.cls, d.subclass) == (FailureClass.CUDA_OOM_LOAD, "nccl_oom")
    assert classify(text, was_ready=True).cls is FailureClass.CUDA_OOM_RUNTIME


def test_nccl_error_without_oom_is_other_fatal() -> None:
    """An NCCL error that is not about memory is other_fatal/nccl."""
    text = (OWN / "h200_nccl.txt").read_text().replace("Failed to CUDA calloc async 608 bytes", "")
    d = classify(text)
    assert (d.cls, d.subclass) == (FailureClass.OTHER_FATAL, "nccl")


def test_sigkill_alone_is_host_oom_but_gpu_evidence_wins() -> None:
    """Exit -9/137 with nothing else is host_oom; with a CUDA OOM in the text it is the OOM."""
    ok_log = (FIXTURES / "vllm_cpu_startup_ok.log").read_text()
    assert classify(ok_log, exit_code=-9).cls is FailureClass.HOST_OOM
    assert classify(ok_log, exit_code=137).cls is FailureClass.HOST_OOM
    # No line says "Killed": the exit status is the evidence, never an empty string.
    assert classify(ok_log, exit_code=-9).evidence == "killed by SIGKILL"
    assert classify(ok_log, exit_code=137).evidence == "killed by SIGKILL"
    assert classify(ok_log, exit_code=0).cls is FailureClass.NONE
    oom = (OWN / "h200_full.txt").read_text()
    assert classify(oom, exit_code=-9).cls is FailureClass.CUDA_OOM_LOAD


def test_nonzero_exit_without_evidence_is_other_fatal() -> None:
    """A clean-looking log with exit status 1 is other_fatal/exited, restartable."""
    d = classify((FIXTURES / "vllm_cpu_startup_ok.log").read_text(), exit_code=1)
    assert (d.cls, d.subclass, d.restartable) == (FailureClass.OTHER_FATAL, "exited", True)
    assert d.evidence == "exited with status 1"


@pytest.mark.parametrize(("line", "fatal"), [
    ("PermissionError: [Errno 13] Permission denied: "
     "'/models/chandra/model-00001-of-00004.safetensors'", True),
    ("PermissionError: [Errno 13] Permission denied: '/models/chandra/tokenizer_config.json'",
     True),
    ("FileNotFoundError: No such file or directory: /m/pytorch_model-00001-of-00002.bin", True),
    # Missing files that are not the model's: not a reason to stop restarting.
    ("FileNotFoundError: [Errno 2] No such file or directory: '/tmp/x.json'", False),
    ("OSError: [Errno 2] No such file or directory: "
     "'/var/cache/chandrad/vllm/torch_compile_cache/a/cache.bin'", False),
])
def test_unreadable_model_files_are_model_not_found(line: str, fatal: bool) -> None:
    """Model files the engine's user cannot open are fatal (a restart cannot fix them)."""
    d = classify(line, exit_code=1)
    assert (d.subclass == "model_not_found", d.restartable) == (fatal, not fatal), d


def test_illegal_memory_access_is_not_an_oom() -> None:
    """'illegal memory access' mentions memory but is other_fatal."""
    d = classify("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert (d.cls, d.subclass) == (FailureClass.OTHER_FATAL, "illegal_memory_access")


_MAMBA_CASES = {c["id"]: c for c in CASES if c["label"] == "mamba_cache_insufficient"}


@pytest.mark.parametrize(
    ("case_id", "evidence_start"),
    [
        ("mamba-tpl-engine-start", "ValueError: max_num_seqs (1024) exceeds"),
        ("mamba-tp-worker-quoted", "ValueError: max_num_seqs (256) exceeds"),
        ("mamba-executor-quote-only", "RuntimeError: Worker failed with error 'max_num_seqs"),
    ],
)
def test_mamba_limit_names_the_valueerror_not_the_runtimeerror(
    case_id: str, evidence_start: str
) -> None:
    """vLLM's Mamba-cache refusal is the evidence, not the "Engine core initialization
    failed" RuntimeError below it, with the requested and available figures and the
    Mamba remedy; LineScanner reports it at that line and finishes with it."""
    text = _MAMBA_CASES[case_id]["text"]
    d = classify(text, exit_code=1)
    assert d.cls is FailureClass.MAMBA_CACHE_INSUFFICIENT, d
    assert evidence_start in d.evidence, d
    assert set(d.numbers) == {"max_num_seqs", "mamba_cache_blocks"}
    assert d.numbers["max_num_seqs"] > d.numbers["mamba_cache_blocks"]
    assert "max_num_seqs" in d.action and d.restartable
    scanner = LineScanner()
    hits = [h for h in map(scanner.feed, text.splitlines()) if h is not None]
    assert [h.evidence for h in hits if h.cls is FailureClass.MAMBA_CACHE_INSUFFICIENT] == [
        d.evidence
    ]
    assert scanner.finish(exit_code=1, was_ready=False) == d


def _cpu_log_expectation(name: str) -> FailureClass | None:
    for key, cls in (
        ("kv", FailureClass.KV_CACHE_INSUFFICIENT),
        ("startup_ok", FailureClass.NONE),
        ("ready", FailureClass.NONE),
        ("sigterm", FailureClass.NONE),
        ("shutdown", FailureClass.NONE),
        ("model_not_found", FailureClass.OTHER_FATAL),
        ("bad_model", FailureClass.OTHER_FATAL),
        ("port", FailureClass.OTHER_FATAL),
    ):
        if key in name:
            return cls
    return None


CPU_LOGS = sorted(FIXTURES.glob("vllm_cpu_*.log"))


@pytest.mark.parametrize("path", CPU_LOGS, ids=[p.name for p in CPU_LOGS])
def test_real_cpu_engine_logs(path: Path) -> None:
    """Logs captured from the real vllm-cpu engine classify as their name says."""
    expected = _cpu_log_expectation(path.name)
    if expected is None:
        pytest.skip(f"no expectation known for {path.name}")
    d = classify(path.read_text(errors="replace"))
    assert d.cls is expected, d
    if "bad_model" in path.name:
        assert d.subclass == "model_not_found" and not d.restartable, d
    if expected is FailureClass.KV_CACHE_INSUFFICIENT and "estimated maximum" in path.read_text():
        assert d.numbers["estimated_max_model_len"] > 0


def test_line_scanner_reports_at_the_proving_line() -> None:
    """LineScanner stays quiet on benign lines and reports at the first proving line."""
    lines = (FIXTURES / "vllm_cpu_startup_ok.log").read_text().splitlines()
    oom = (OWN / "h200_frag.txt").read_text().splitlines()
    scanner = LineScanner()
    assert all(scanner.feed(line) is None for line in lines)
    results = [scanner.feed(line) for line in oom]
    hits = [(i, d) for i, d in enumerate(results) if d is not None]
    assert len(hits) == 1
    index, d = hits[0]
    assert oom[index].startswith("torch.OutOfMemoryError")
    assert d.cls is FailureClass.FRAGMENTATION
    assert scanner.finish(exit_code=1, was_ready=False).cls is FailureClass.FRAGMENTATION


def test_line_scanner_ready_and_bounded_tail() -> None:
    """After mark_ready an OOM is runtime; the tail keeps only max_lines lines."""
    scanner = LineScanner(max_lines=50)
    for line in (FIXTURES / "vllm_cpu_startup_ok.log").read_text().splitlines():
        scanner.feed(line)
    assert len(list(scanner.lines())) == 50
    scanner.mark_ready()
    d = scanner.feed((OWN / "h200_full.txt").read_text().splitlines()[-1])
    assert d is not None and d.cls is FailureClass.CUDA_OOM_RUNTIME
    assert scanner.finish(exit_code=None, was_ready=True).cls is FailureClass.CUDA_OOM_RUNTIME


def test_line_scanner_clean_run_finishes_none() -> None:
    """A real CPU engine that started and was stopped by SIGTERM finishes as none."""
    scanner = LineScanner()
    for name in ("vllm_cpu_startup_ok.log", "vllm_cpu_sigterm_shutdown.log"):
        for line in (FIXTURES / name).read_text().splitlines():
            assert scanner.feed(line) is None
    assert scanner.finish(exit_code=0, was_ready=True).cls is FailureClass.NONE


def test_classify_accepts_text_or_lines() -> None:
    """classify takes one text or a sequence of lines, with the same verdict."""
    text = (OWN / "h200_nccl.txt").read_text()
    assert classify(text) == classify(text.splitlines())


def test_diagnose_json_in_process() -> None:
    """run_diagnose --json prints the versioned document with class, evidence, action, numbers."""
    out = io.StringIO()
    assert run_diagnose(str(OWN / "h200_frag.txt"), True, out) == 0
    doc = json.loads(out.getvalue())
    assert doc["v"] == 1
    assert doc["class"] == "fragmentation"
    assert doc["evidence"].startswith("torch.OutOfMemoryError: CUDA out of memory.")
    assert doc["numbers"]["reserved_unallocated_gib"] == pytest.approx(69.5)
    assert "expandable_segments" in doc["action"]


def test_diagnose_human_and_missing_file() -> None:
    """The human block names class, evidence and action; an unreadable file returns 1."""
    out = io.StringIO()
    assert run_diagnose(str(OWN / "h200_load.txt"), False, out) == 0
    text = out.getvalue()
    assert "cuda_oom_load" in text and "evidence:" in text and "action:" in text
    assert run_diagnose(str(OWN / "does-not-exist.txt"), False, io.StringIO()) == 1


def test_diagnose_reads_stdin_in_a_subprocess() -> None:
    """`-` reads stdin; works in a fresh interpreter without a daemon."""
    sample = next(c for c in CASES if c["id"] == "kv-tpl-v1-estimated")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from chandrad.ctl.diagnose import run_diagnose; "
            "sys.exit(run_diagnose('-', True, sys.stdout))",
        ],
        input=sample["text"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=True,
    )
    doc = json.loads(proc.stdout)
    assert doc["class"] == "kv_cache_insufficient"
    assert doc["numbers"] == {
        "max_model_len": 32768,
        "needed_gib": 4,
        "available_gib": 1.25,
        "estimated_max_model_len": 10224,
    }
