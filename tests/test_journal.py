"""chandractl logs: our logger → a real journal file (systemd-journal-remote) → journalctl."""

from __future__ import annotations

import io
import json
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from chandrad.ctl.journal import (
    SD_MESSAGE_UNIT_RESTART_SCHEDULED,
    analyze,
    journalctl_argv,
    parse_entries,
    run_logs,
)
from chandrad.events import MESSAGE_IDS, Event
from chandrad.logs import configure_logging, get_logger

BASE = datetime(2026, 1, 5, 10, 0, tzinfo=UTC)
BOOT_ID = "0123456789abcdef0123456789abcdef"
LONG_EVIDENCE = "NCCL error: unhandled system error " + "x" * 5000


def _journal_remote() -> str:
    for candidate in (
        "/lib/systemd/systemd-journal-remote",
        "/usr/lib/systemd/systemd-journal-remote",
    ):
        if Path(candidate).exists():
            return candidate
    pytest.skip("systemd-journal-remote missing (apt-get install systemd-journal-remote)")


def _journalctl() -> None:
    if shutil.which("journalctl") is None:
        pytest.skip("journalctl missing (Debian package systemd)")


def _export_entry(payload: bytes, when: datetime) -> bytes:
    """One journal export-format entry: the native payload plus the trusted timestamp fields."""
    usec = int(when.timestamp() * 1_000_000)
    return f"__REALTIME_TIMESTAMP={usec}\n_BOOT_ID={BOOT_ID}\n".encode() + payload + b"\n"


def _emit_history(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple[bytes, datetime]]:
    """Log a day of daemon life through configure_logging('journal'); return the datagrams."""
    sock_path = tmp_path / "journal.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    sock.settimeout(0.05)
    monkeypatch.setenv("CHANDRAD_JOURNAL_SOCKET", str(sock_path))
    received: list[bytes] = []
    stop = threading.Event()

    def reader() -> None:  # plays journald
        while True:
            try:
                received.append(sock.recv(1 << 20))
            except TimeoutError:
                if stop.is_set():
                    return

    thread = threading.Thread(target=reader)
    thread.start()
    configure_logging("journal", "info", stream=io.StringIO())
    log = get_logger("chandrad.engine")
    times: list[datetime] = []

    def at(seconds: float) -> None:
        times.append(BASE + timedelta(seconds=seconds))

    at(0)
    log.info("daemon_state", old="starting", new="running", reason="started")
    mml = [32768, 24000, 20000, 18000]
    for i in range(3):
        t = 60 + 200 * i
        at(t)
        log.error(
            "engine_failure",
            evidence="ValueError: To serve at least one request with the model's max seq len",
            numbers={"L": mml[i], "N": mml[i + 1]},
            **{"class": "kv_cache_insufficient"},
        )
        at(t + 1)
        log.warning(
            "profile_change",
            old={"max_model_len": mml[i]},
            new={"max_model_len": mml[i + 1]},
            reason=f"vLLM estimated maximum model length {mml[i + 1]}",
            **{"class": "kv_cache_insufficient"},
        )
        at(t + 2)
        log.info("engine_restart", restarts=i + 1)
    at(700)
    log.info("engine_ready", seconds=81.5)
    for minute, pages in ((20, 10), (40, 20), (65, 30), (80, 30), (110, 60)):
        at(minute * 60)
        log.info(
            "job_done",
            job=minute,
            file=f"/srv/in/{minute}.pdf",
            pages=pages,
            seconds=9.5,
            state="done",
        )
    at(90 * 60)
    log.error(
        "job_failed",
        job=99,
        file="/srv/in/東京.pdf",
        code="encrypted_pdf",
        reason="password-protected PDF",
    )
    at(120 * 60)
    log.error("engine_failure", evidence=LONG_EVIDENCE, **{"class": "other_fatal"})
    at(120 * 60 + 5)
    log.info("engine_restart", restarts=4)
    stop.set()
    thread.join()
    sock.close()
    configure_logging("json", "info", stream=io.StringIO())
    assert len(received) == len(times)
    return list(zip(received, times, strict=True))


@pytest.fixture
def journal_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    remote = _journal_remote()
    _journalctl()
    history = _emit_history(monkeypatch, tmp_path)
    systemd_entries = [
        (
            b"SYSLOG_IDENTIFIER=systemd\nUNIT=chandrad.service\nPRIORITY=3\n"
            b"MESSAGE=chandrad.service: Watchdog timeout (limit 1min)!\n",
            BASE + timedelta(minutes=125),
        ),
        (
            b"SYSLOG_IDENTIFIER=systemd\nUNIT=chandrad.service\nPRIORITY=6\n"
            + f"MESSAGE_ID={SD_MESSAGE_UNIT_RESTART_SCHEDULED}\n".encode()
            + b"MESSAGE=chandrad.service: Scheduled restart job, restart counter is at 1.\n",
            BASE + timedelta(minutes=125, seconds=10),
        ),
        (
            b"SYSLOG_IDENTIFIER=sshd\nPRIORITY=6\nMESSAGE=Accepted publickey for root\n",
            BASE + timedelta(minutes=30),
        ),
    ]
    export = b"".join(
        _export_entry(p, t) for p, t in sorted(history + systemd_entries, key=lambda x: x[1])
    )
    out = tmp_path / "remote.journal"
    res = subprocess.run([remote, "-o", str(out), "-"], input=export, capture_output=True)
    assert res.returncode == 0, res.stderr
    yield out


def _report(journal: Path, since: str | None = None) -> dict[str, Any]:
    buf = io.StringIO()
    assert run_logs(since=since, unit="chandrad", file=journal, as_json=True, out=buf) == 0
    report: dict[str, Any] = json.loads(buf.getvalue())
    return report


def test_report_from_real_journal_file(journal_file: Path) -> None:
    """Failures, profile changes, restarts, failed files, pages/hour come back via journalctl."""
    report = _report(journal_file)
    assert report["v"] == 1
    assert report["entries"] == 19  # the sshd entry and systemd's own are not chandrad's
    assert report["failures"] == {"kv_cache_insufficient": 3, "other_fatal": 1}
    assert report["failures_by_hour"] == {
        "2026-01-05T10:00Z": {"kv_cache_insufficient": 3},
        "2026-01-05T12:00Z": {"other_fatal": 1},
    }
    assert [c["new"]["max_model_len"] for c in report["profile_changes"]] == [24000, 20000, 18000]
    assert report["profile_changes"][0]["reason"] == "vLLM estimated maximum model length 24000"
    assert report["restarts"] == 4
    assert report["daemon_restarts"] == 1 and report["watchdog_timeouts"] == 1
    assert report["engine_ready_seconds"] == [81.5]
    assert report["failed_files"] == [
        {
            "time": "2026-01-05T11:30:00Z",
            "job": 99,
            "file": "/srv/in/東京.pdf",
            "code": "encrypted_pdf",
            "reason": "password-protected PDF",
        }
    ]
    assert report["pages_per_hour"] == {
        "2026-01-05T10:00Z": {"pages": 30, "files": 2, "pages_per_min": 0.5},
        "2026-01-05T11:00Z": {"pages": 120, "files": 3, "pages_per_min": 2.0},
    }


def test_recommendations_name_the_settled_profile(journal_file: Path) -> None:
    """The downshift is summarised as the config line that would skip it at boot."""
    recs = _report(journal_file)["recommendations"]
    assert recs[0] == (
        "3 kv_cache_insufficient at max_model_len 32768 → settled on 18000; "
        "set [engine.memory] max_model_len = 18000 in the config to skip the downshift at boot"
    )
    joined = "\n".join(recs)
    assert "1 other_fatal: not a memory problem" in joined and "NCCL error" in joined
    assert "systemd restarted chandrad 1 times (1 watchdog timeouts)" in joined
    assert "1 file(s) failed with encrypted_pdf (e.g. /srv/in/東京.pdf)" in joined


def test_since_is_applied_by_journalctl(journal_file: Path) -> None:
    """--since reaches journalctl: only the later hours are analysed."""
    report = _report(journal_file, since="2026-01-05 11:00:00 UTC")
    assert report["failures"] == {"other_fatal": 1}
    assert report["profile_changes"] == []
    assert list(report["pages_per_hour"]) == ["2026-01-05T11:00Z"]


def test_message_ids_are_queryable_in_the_journal(journal_file: Path) -> None:
    """journalctl MESSAGE_ID=<job_done id> finds exactly the job_done entries."""
    res = subprocess.run(
        [
            "journalctl",
            "--file",
            str(journal_file),
            "-o",
            "json",
            f"MESSAGE_ID={MESSAGE_IDS[Event.JOB_DONE]}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(rows) == 5 and {r["CHANDRA_EVENT"] for r in rows} == {"job_done"}


def test_text_report_sections(journal_file: Path) -> None:
    """The text report shows each section and the recommendation."""
    buf = io.StringIO()
    assert run_logs(since=None, unit="chandrad", file=journal_file, as_json=False, out=buf) == 0
    text = buf.getvalue()
    for heading in (
        "Engine failures by class",
        "Profile changes",
        "Restarts: engine 4, daemon 1",
        "Failed files",
        "Throughput by hour",
        "Recommendations",
    ):
        assert heading in text
    assert "max_model_len 32768 → 24000" in text
    assert "2.00 pages/min" in text


def test_missing_journal_file_is_an_error(tmp_path: Path) -> None:
    """A --file that does not exist exits 1 with a message."""
    buf = io.StringIO()
    assert (
        run_logs(since=None, unit="chandrad", file=tmp_path / "nope.journal", as_json=True, out=buf)
        == 1
    )
    assert "no such journal file" in buf.getvalue()


def test_unit_mode_without_entries_explains_why() -> None:
    """Reading a unit with no entries (no journald here) recommends checking access/persistence."""
    _journalctl()
    buf = io.StringIO()
    rc = run_logs(since=None, unit="chandrad-test-absent", file=None, as_json=True, out=buf)
    if rc != 0:
        pytest.skip(f"journalctl cannot read the system journal here: {buf.getvalue().strip()}")
    report = json.loads(buf.getvalue())
    assert report["entries"] == 0
    assert report["recommendations"][0].startswith("no chandrad entries found")


def test_journalctl_argv_scopes_to_unit_or_file() -> None:
    """-u for the live journal; identifier + unit matches for a file."""
    assert journalctl_argv(since="-1h", unit="chandrad", file=None)[-4:] == [
        "--since",
        "-1h",
        "-u",
        "chandrad.service",
    ]
    argv = journalctl_argv(since=None, unit="chandrad", file=Path("/x.journal"))
    assert argv[-5:] == [
        "--file",
        "/x.journal",
        "SYSLOG_IDENTIFIER=chandrad",
        "+",
        "UNIT=chandrad.service",
    ]


# ------------------------------------------------ JSON lines, cut-off lines, unset knobs


def _write_journal(tmp_path: Path, entries: list[tuple[bytes, datetime]]) -> Path:
    """A real journal file from native payloads, written by systemd-journal-remote."""
    remote = _journal_remote()
    _journalctl()
    out = tmp_path / "remote.journal"
    export = b"".join(_export_entry(p, t) for p, t in sorted(entries, key=lambda x: x[1]))
    res = subprocess.run([remote, "-o", str(out), "-"], input=export, capture_output=True)
    assert res.returncode == 0, res.stderr
    return out


def _json_lines(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fmt: str) -> list[str]:
    """A downshift and a failed file, logged by our logger as JSON lines on its stream.

    ``fmt`` "json" is ``log_format = "json"``; "journal" with no journald listening is
    the journal handler's fallback to the stream.
    """
    monkeypatch.setenv("CHANDRAD_JOURNAL_SOCKET", str(tmp_path / "no-journald.sock"))
    stream = io.StringIO()
    configure_logging(fmt, "info", stream=stream)
    log = get_logger("chandrad.engine")
    try:
        log.error("engine_failure", evidence="ValueError: To serve at least one request",
                  numbers={"L": 32768, "N": 18000}, **{"class": "kv_cache_insufficient"})
        log.warning("profile_change", old={"max_model_len": None},
                    new={"max_model_len": 18000}, reason="vLLM estimated 18000",
                    **{"class": "kv_cache_insufficient"})
        log.info("engine_restart", restarts=1)
        log.error("job_failed", job=7, file="/srv/in/a.pdf", code="encrypted_pdf",
                  reason="password-protected PDF")
    finally:
        configure_logging("json", "info", stream=io.StringIO())
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and all(json.loads(x)["event"] for x in lines)
    return lines


@pytest.mark.parametrize("fmt", ["json", "journal"])
def test_json_lines_in_the_journal_are_analysed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fmt: str
) -> None:
    """JSON lines that journald stored from stderr count like native entries.

    A line cut by journald's LineMax (one more, half an event) is skipped and counted.
    """
    lines = _json_lines(monkeypatch, tmp_path, fmt)
    lines.insert(2, lines[0][: len(lines[0]) // 2])
    stream_entries = [
        (b"SYSLOG_IDENTIFIER=chandrad\n_TRANSPORT=stdout\nPRIORITY=6\n"
         + f"MESSAGE={line}\n".encode(), BASE + timedelta(seconds=i))
        for i, line in enumerate(lines)
    ]
    report = _report(_write_journal(tmp_path, stream_entries))
    assert report["entries"] == 4
    assert report["unreadable_lines"] == 1
    assert report["failures"] == {"kv_cache_insufficient": 1}
    assert report["restarts"] == 1
    assert [c["new"] for c in report["profile_changes"]] == [{"max_model_len": 18000}]
    assert report["failed_files"][0]["code"] == "encrypted_pdf"
    recs = "\n".join(report["recommendations"])
    assert "set [engine.memory] max_model_len = 18000" in recs
    assert "nothing to change" not in recs
    assert "1 line(s) could not be read" in recs


def test_json_lines_file_with_a_cut_off_last_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--file`` on a plain JSON-lines log whose writer was killed mid-line."""
    lines = _json_lines(monkeypatch, tmp_path, "json")
    log_file = tmp_path / "chandrad.log"
    log_file.write_text("\n".join(lines) + "\n" + lines[0][:40], encoding="utf-8")
    report = _report(log_file)
    assert report["entries"] == 4 and report["unreadable_lines"] == 1
    assert report["failures"] == {"kv_cache_insufficient": 1}
    buf = io.StringIO()
    assert run_logs(since="2000-01-01T00:00:00Z", unit="chandrad", file=log_file,
                    as_json=False, out=buf) == 0
    assert "1 unreadable lines skipped" in buf.getvalue()
    buf = io.StringIO()
    assert run_logs(since="1 hour ago", unit="chandrad", file=log_file, as_json=True,
                    out=buf) == 1
    assert "ISO time" in buf.getvalue()


def test_cut_off_journalctl_output_is_not_fatal(journal_file: Path) -> None:
    """Real ``journalctl -o json`` output cut in the middle of a line: the rest is analysed."""
    res = subprocess.run(["journalctl", "--file", str(journal_file), "-o", "json", "-q"],
                         capture_output=True, text=True, check=True)
    cut = res.stdout[: len(res.stdout) - 200]
    parsed = parse_entries(cut)
    assert parsed.unreadable == 1
    assert len(parsed.entries) == len(res.stdout.splitlines()) - 1
    report = analyze(parsed.entries, unreadable=parsed.unreadable)
    assert report["unreadable_lines"] == 1 and report["failures"]


def test_upshift_back_to_an_unset_knob_is_valid_advice(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A learned max_model_len probed back up to the configured (unset) one: no ``None``."""
    sock_path = tmp_path / "journal.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    monkeypatch.setenv("CHANDRAD_JOURNAL_SOCKET", str(sock_path))
    configure_logging("journal", "info", stream=io.StringIO())
    try:
        get_logger("chandrad.engine").warning(
            "profile_change", reason="stable for 600s with a backlog: probing one step back up",
            old={"max_model_len": 20000, "gpu_memory_utilization": 0.85},
            new={"max_model_len": None, "gpu_memory_utilization": 0.9},
            degraded=False, **{"class": "upshift"})
        payload = sock.recv(1 << 20)
    finally:
        configure_logging("json", "info", stream=io.StringIO())
        sock.close()
    journal = _write_journal(tmp_path, [(payload, BASE)])
    report = _report(journal)
    assert report["profile_changes"][0]["new"] == {"max_model_len": None,
                                                   "gpu_memory_utilization": 0.9}
    rec = report["recommendations"][0]
    assert "None" not in rec, rec
    assert rec == ("1 upshift at max_model_len 20000 → settled on unset; gpu_memory_utilization "
                   "0.85 → settled on 0.9; set [engine.memory] gpu_memory_utilization = 0.9 and "
                   "leave [engine.memory] max_model_len unset (remove the line) in the config "
                   "to skip the downshift at boot")
    buf = io.StringIO()
    assert run_logs(since=None, unit="chandrad", file=journal, as_json=False, out=buf) == 0
    assert "None" not in buf.getvalue() and "max_model_len 20000 → unset" in buf.getvalue()


# ------------------------------------------------ several engines (CHANDRA_ENGINE)


def _two_engine_journal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A real journal file of two replicas' supervisors, each logging with its engine bound.

    Engine 0 downshifts once on the KV cache and restarts; engine 1 is OOM-killed twice and
    restarts twice; the daemon's own events carry no engine.
    """
    sock_path = tmp_path / "journal.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(sock_path))
    monkeypatch.setenv("CHANDRAD_JOURNAL_SOCKET", str(sock_path))
    configure_logging("journal", "info", stream=io.StringIO())
    base = get_logger("chandrad.engine")
    e0, e1 = base.bind(engine="0"), base.bind(engine="1")
    entries: list[tuple[bytes, datetime]] = []
    steps: list[tuple[int, Callable[[], object]]] = [
        (0, lambda: base.info("daemon_state", old="starting", new="running",
                              reason="started")),
        (60, lambda: e0.error("engine_failure", evidence="ValueError: KV cache is short",
                              **{"class": "kv_cache_insufficient"})),
        (61, lambda: e0.warning("profile_change", old={"max_model_len": 32768},
                                new={"max_model_len": 24000}, reason="vLLM estimated 24000",
                                **{"class": "kv_cache_insufficient"})),
        (62, lambda: e0.info("engine_restart", restarts=1)),
        (300, lambda: e1.error("engine_failure", evidence="Killed process 4242 (python3)",
                               **{"class": "host_oom"})),
        (301, lambda: e1.info("engine_restart", restarts=1)),
        (900, lambda: e1.error("engine_failure", evidence="Killed process 4343 (python3)",
                               **{"class": "host_oom"})),
        (901, lambda: e1.info("engine_restart", restarts=2)),
        (960, lambda: e0.info("engine_ready", seconds=40.0)),
    ]
    try:
        for seconds, emit in steps:
            emit()
            entries.append((sock.recv(1 << 20), BASE + timedelta(seconds=seconds)))
    finally:
        configure_logging("json", "info", stream=io.StringIO())
        sock.close()
    return _write_journal(tmp_path, entries)


def test_failures_are_grouped_by_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two replicas in one journal: failures, restarts and the last failure per engine."""
    journal = _two_engine_journal(monkeypatch, tmp_path)
    report = _report(journal)
    assert report["failures"] == {"host_oom": 2, "kv_cache_insufficient": 1}
    assert report["restarts"] == 3
    assert report["engines"] == {
        "0": {
            "failures": {"kv_cache_insufficient": 1},
            "restarts": 1,
            "profile_changes": 1,
            "last_failure": {"time": "2026-01-05T10:01:00Z", "class": "kv_cache_insufficient",
                             "evidence": "ValueError: KV cache is short"},
        },
        "1": {
            "failures": {"host_oom": 2},
            "restarts": 2,
            "profile_changes": 0,
            "last_failure": {"time": "2026-01-05T10:15:00Z", "class": "host_oom",
                             "evidence": "Killed process 4343 (python3)"},
        },
    }
    assert report["profile_changes"][0]["engine"] == "0"
    recs = report["recommendations"]
    assert recs[0] == (
        "engine 0: 1 kv_cache_insufficient at max_model_len 32768 → settled on 24000; "
        "set [engine.memory] max_model_len = 24000 in the config to skip the downshift at boot"
    )
    assert recs[1].startswith("2 host_oom (engine 1): the kernel OOM killer")
    buf = io.StringIO()
    assert run_logs(since=None, unit="chandrad", file=journal, as_json=False, out=buf) == 0
    text = buf.getvalue()
    assert (
        "Engine failures by engine\n"
        "  engine 0: kv_cache_insufficient 1; restarts 1, profile changes 1; last failure "
        "2026-01-05T10:01:00Z kv_cache_insufficient: ValueError: KV cache is short\n"
        "  engine 1: host_oom 2; restarts 2, profile changes 0; last failure "
        "2026-01-05T10:15:00Z host_oom: Killed process 4343 (python3)\n"
    ) in text
    assert "2026-01-05T10:01:01Z  engine 0 kv_cache_insufficient: max_model_len 32768" in text


def test_one_engine_keeps_the_single_engine_report(journal_file: Path) -> None:
    """Entries without CHANDRA_ENGINE are engine "0"; one engine prints no per-engine section."""
    report = _report(journal_file)
    assert list(report["engines"]) == ["0"]
    assert report["engines"]["0"]["failures"] == report["failures"]
    assert report["engines"]["0"]["restarts"] == 4
    assert report["engines"]["0"]["last_failure"]["class"] == "other_fatal"
    buf = io.StringIO()
    assert run_logs(since=None, unit="chandrad", file=journal_file, as_json=False, out=buf) == 0
    assert "by engine" not in buf.getvalue() and "  engine 0" not in buf.getvalue()
