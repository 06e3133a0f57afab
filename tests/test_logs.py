"""Logging configuration: native journal datagrams on a test-bound socket, JSON lines, console."""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from chandrad.errors import ConfigError
from chandrad.events import MESSAGE_IDS, Event
from chandrad.logs import configure_logging, get_logger, resolve_format

SPEC_EVENTS = {
    "daemon_state",
    "engine_state",
    "engine_line",
    "engine_failure",
    "profile_change",
    "engine_restart",
    "engine_ready",
    "job_accepted",
    "job_done",
    "job_failed",
    "page_failed",
    "config_reloaded",
    "control_request",
}


def parse_native(data: bytes) -> dict[str, list[str]]:
    """Decode a native journal protocol payload (independent of the encoder under test)."""
    fields: dict[str, list[str]] = {}
    i = 0
    while i < len(data):
        nl = data.index(b"\n", i)
        line = data[i:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            i = nl + 1
        else:
            key = line
            (size,) = struct.unpack("<Q", data[nl + 1 : nl + 9])
            value = data[nl + 9 : nl + 9 + size]
            assert data[nl + 9 + size : nl + 10 + size] == b"\n"
            i = nl + 10 + size
        fields.setdefault(key.decode("ascii"), []).append(value.decode("utf-8"))
    return fields


@pytest.fixture
def journal_sock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "journal.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2.0)
    monkeypatch.setenv("CHANDRAD_JOURNAL_SOCKET", str(path))
    yield sock
    sock.close()


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    yield
    configure_logging("json", "info", stream=io.StringIO())


def _one(fields: dict[str, list[str]], key: str) -> str:
    assert len(fields[key]) == 1, fields[key]
    return fields[key][0]


def test_message_ids_cover_spec_events_and_are_128_bit() -> None:
    """Every SPEC event has a distinct lowercase 128-bit MESSAGE_ID."""
    assert set(MESSAGE_IDS) >= SPEC_EVENTS
    assert all(re.fullmatch(r"[0-9a-f]{32}", v) for v in MESSAGE_IDS.values())
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)


_LOG_METHODS = {"debug", "info", "warning", "error", "critical", "exception", "msg"}
PACKAGE = Path(__file__).resolve().parents[1] / "chandrad"


def _emitted_events(literals: list[str] | None = None) -> set[str]:
    """The event name of every ``log.<level>(EVENT, …)`` call in chandrad/: a string literal
    or an ``Event.NAME`` constant (``getattr(log, level)(…)`` included). ``literals`` collects
    ``file:line name`` of each one spelled as a string literal."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            is_log = (isinstance(func, ast.Attribute) and func.attr in _LOG_METHODS) or (
                isinstance(func, ast.Call) and isinstance(func.func, ast.Name)
                and func.func.id == "getattr")
            first = node.args[0]
            if not is_log:
                continue
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
                if literals is not None:
                    literals.append(f"{path.name}:{node.lineno} {first.value}")
            elif (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
                  and first.value.id == "Event"):
                names.add(Event[first.attr].value)
    return names


def test_every_message_id_event_is_emitted() -> None:
    """A MESSAGE_ID that no code path logs is a promise to operators that ``journalctl
    MESSAGE_ID=…`` can never keep (``control_request`` was documented, ``control_command``
    logged); every event with an id is emitted somewhere in chandrad/."""
    emitted = _emitted_events()
    assert {str(e) for e in MESSAGE_IDS} <= emitted, "ids never logged"
    assert "control_command" not in emitted and "engine_fatal" in emitted


def test_events_with_an_id_are_spelled_from_the_enum() -> None:
    """An event that has a MESSAGE_ID is logged as ``Event.NAME``, never as a string literal,
    so renaming it in one place cannot leave an emitter behind."""
    literals: list[str] = []
    _emitted_events(literals)
    ids = {str(e) for e in MESSAGE_IDS}
    assert [lit for lit in literals if lit.split(" ", 1)[1] in ids] == []


def test_journal_entry_fields(journal_sock: socket.socket) -> None:
    """A structlog event becomes MESSAGE/PRIORITY/IDs/CODE_*/CHANDRA_* fields."""
    configure_logging("journal", "info", stream=io.StringIO())
    get_logger("chandrad.test").warning(
        "job_failed", file="東京.pdf", code="encrypted_pdf", reason="password", job=42, pages=[1, 2]
    )
    f = parse_native(journal_sock.recv(65536))
    assert _one(f, "SYSLOG_IDENTIFIER") == "chandrad"
    assert _one(f, "PRIORITY") == "4"
    assert _one(f, "MESSAGE_ID") == MESSAGE_IDS[Event.JOB_FAILED]
    assert _one(f, "CHANDRA_EVENT") == "job_failed"
    assert _one(f, "CHANDRA_JOB") == "42"
    assert _one(f, "CHANDRA_FILE") == "東京.pdf"
    assert _one(f, "CHANDRA_CODE") == "encrypted_pdf"
    assert json.loads(_one(f, "CHANDRA_PAGES")) == [1, 2]
    assert _one(f, "CODE_FILE") == __file__
    assert _one(f, "CODE_FUNC") == "test_journal_entry_fields"
    assert int(_one(f, "CODE_LINE")) > 0
    assert _one(f, "MESSAGE").startswith("job_failed file=東京.pdf code=encrypted_pdf")
    assert not any(k.startswith("_") for k in f)


def test_engine_line_and_failure_class(journal_sock: socket.socket) -> None:
    """Engine lines carry CHANDRA_SOURCE=vllm; a failure's class is CHANDRA_CLASS."""
    configure_logging("journal", "info", stream=io.StringIO())
    log = get_logger("chandrad.engine")
    log.info("engine_line", stream="stderr", line="INFO Maximum concurrency for 4096 tokens: 2.5x")
    log.error(
        "engine_failure",
        evidence="No available memory for the cache blocks",
        numbers={"L": 32768, "N": 18000},
        **{"class": "kv_cache_insufficient"},
    )
    line = parse_native(journal_sock.recv(65536))
    assert _one(line, "CHANDRA_SOURCE") == "vllm"
    assert _one(line, "CHANDRA_STREAM") == "stderr"
    assert _one(line, "MESSAGE") == "vllm: INFO Maximum concurrency for 4096 tokens: 2.5x"
    failure = parse_native(journal_sock.recv(65536))
    assert _one(failure, "PRIORITY") == "3"
    assert _one(failure, "CHANDRA_CLASS") == "kv_cache_insufficient"
    assert json.loads(_one(failure, "CHANDRA_NUMBERS")) == {"L": 32768, "N": 18000}


def test_multiline_and_exception_use_length_prefixed_fields(journal_sock: socket.socket) -> None:
    """A traceback stays one entry: MESSAGE and CHANDRA_EXCEPTION carry the newlines."""
    configure_logging("journal", "info", stream=io.StringIO())
    try:
        raise RuntimeError("engine exploded")
    except RuntimeError:
        get_logger().exception("engine_failure", **{"class": "other_fatal"})
    raw = journal_sock.recv(65536)
    assert b"MESSAGE\n" in raw  # binary-safe form, not MESSAGE=
    f = parse_native(raw)
    assert "Traceback (most recent call last)" in _one(f, "CHANDRA_EXCEPTION")
    assert _one(f, "MESSAGE").endswith("RuntimeError: engine exploded")
    assert _one(f, "PRIORITY") == "3"


def test_stdlib_records_reach_the_journal(journal_sock: socket.socket) -> None:
    """A third-party stdlib logger's record is sent too, with its text as MESSAGE."""
    configure_logging("journal", "info", stream=io.StringIO())
    logging.getLogger("some.library").error("disk %s is full", "/srv")
    f = parse_native(journal_sock.recv(65536))
    assert _one(f, "MESSAGE") == "disk /srv is full"
    assert _one(f, "CHANDRA_LOGGER") == "some.library"
    assert "CHANDRA_EVENT" not in f and "MESSAGE_ID" not in f


def test_oversized_entry_goes_as_sealed_memfd(journal_sock: socket.socket) -> None:
    """An entry larger than a datagram is passed as a sealed memfd with an empty payload."""
    configure_logging("journal", "info", stream=io.StringIO())
    blob = "x" * 600_000
    get_logger().info("engine_failure", evidence=blob, **{"class": "other_fatal"})
    data, ancdata, _, _ = journal_sock.recvmsg(16, socket.CMSG_SPACE(4))
    assert data == b""
    (level, kind, raw_fd) = ancdata[0]
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    fd = int.from_bytes(raw_fd[:4], "little")
    try:
        size = os.fstat(fd).st_size
        f = parse_native(os.pread(fd, size, 0))
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"y", 0)  # sealed against writes
    finally:
        os.close(fd)
    assert _one(f, "CHANDRA_EVIDENCE") == blob


def test_unreachable_journal_falls_back_to_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a journald socket the record is written as a JSON line instead of lost."""
    monkeypatch.setenv("CHANDRAD_JOURNAL_SOCKET", str(tmp_path / "absent.sock"))
    out = io.StringIO()
    configure_logging("journal", "info", stream=out)
    get_logger().info("job_done", file="a.pdf", pages=2, seconds=1.0, state="done")
    record = json.loads(out.getvalue())
    assert record["event"] == "job_done" and record["pages"] == 2


def test_json_lines_and_level_filter() -> None:
    """JSON format writes one object per line and drops records under the level."""
    out = io.StringIO()
    configure_logging("json", "warning", stream=out)
    log = get_logger("chandrad.test")
    log.info("job_done", file="quiet.pdf")
    log.warning("job_failed", file="loud.pdf", code="corrupt_input")
    logging.getLogger("httpx").warning("HTTP 500")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["event"] for x in lines] == ["job_failed", "HTTP 500"]
    assert lines[0]["level"] == "warning" and lines[0]["timestamp"].endswith("Z")


def test_console_is_readable_without_callsite_noise() -> None:
    """Console lines show event and key=value pairs, not file paths."""
    out = io.StringIO()
    configure_logging("console", "info", stream=out)
    get_logger("chandrad.test").info("engine_ready", seconds=81.5)
    text = out.getvalue()
    assert "engine_ready" in text and "seconds=81.5" in text
    assert "pathname" not in text and "{" not in text


def test_console_leaves_out_successful_engine_access_lines() -> None:
    """On a terminal, vLLM's access-log lines of successful requests (the health poll every
    5 s, /metrics, a POST per page) are left out; a failed request and other engine lines
    show; JSON (and so the journal) keeps them all."""
    lines = [
        '(APIServer pid=7) INFO:     127.0.0.1:40894 - "GET /health HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:40900 - "GET /metrics HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:40902 - "POST /v1/chat/completions HTTP/1.1" 200 OK',
        'INFO:     127.0.0.1:40904 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Error',
        "INFO 12-05 22:01:02 [gpu_model_runner.py:1] Loading weights took 3.1 seconds",
    ]
    shown = {}
    for fmt in ("console", "json"):
        out = io.StringIO()
        configure_logging(fmt, "info", stream=out)
        log = get_logger("chandrad.engine")
        for line in lines:
            log.info(Event.ENGINE_LINE, source="vllm", stream="stderr", line=line)
        shown[fmt] = out.getvalue()
    assert "/health" not in shown["console"] and "/metrics" not in shown["console"]
    assert "200 OK" not in shown["console"]
    assert "500 Internal Error" in shown["console"] and "Loading weights" in shown["console"]
    assert len(shown["json"].splitlines()) == len(lines)


def test_auto_detects_journal_stream_tty_and_pipe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """auto picks journal when JOURNAL_STREAM is this fd, console on a pty, JSON otherwise."""
    target = tmp_path / "stderr.log"
    with target.open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        assert resolve_format("auto", stream) == "journal"
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino + 1}")
        assert resolve_format("auto", stream) == "json"
    primary, secondary = os.openpty()
    with os.fdopen(secondary, "w") as tty:
        assert resolve_format("auto", tty) == "console"
    os.close(primary)
    assert resolve_format("json", io.StringIO()) == "json"


def test_bad_format_or_level_is_a_config_error() -> None:
    """An unknown format or level raises ConfigError naming the key."""
    with pytest.raises(ConfigError) as err:
        configure_logging("xml", "loud", stream=io.StringIO())
    keys = {p.key for p in err.value.problems}
    assert keys == {"daemon.log_format", "daemon.log_level"}
