"""Structured logging: structlog for chandrad and the stdlib loggers, rendered for journald or JSON.

Owns the one logging configuration of the daemon (SPEC §7): structlog is the API
(:func:`get_logger`), stdlib loggers (watchdog, httpx, vLLM client code) go through the
same processors, and one handler renders every record as

* ``journal``: native journald entries sent as ``AF_UNIX`` datagrams to
  ``/run/systemd/journal/socket`` (``$CHANDRAD_JOURNAL_SOCKET`` overrides it) with
  ``MESSAGE``, ``PRIORITY``, ``SYSLOG_IDENTIFIER=chandrad``, ``MESSAGE_ID`` per event
  (:data:`MESSAGE_IDS`), ``CHANDRA_EVENT``, ``CODE_FILE/LINE/FUNC`` and every other event
  key as ``CHANDRA_<KEY>`` (non-strings JSON-encoded). An entry too large for one
  datagram goes as a sealed memfd, as the native protocol prescribes; if journald cannot
  be reached the record is written as a JSON line to the stream instead;
* ``json``: one JSON object per line;
* ``console``: structlog's readable console lines.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
import sys
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from chandrad.errors import ConfigError, ConfigProblem

DEFAULT_JOURNAL_SOCKET = "/run/systemd/journal/socket"
JOURNAL_SOCKET_ENV = "CHANDRAD_JOURNAL_SOCKET"
SYSLOG_IDENTIFIER = "chandrad"


class Event(StrEnum):
    """The name of every event that carries a ``MESSAGE_ID``: emitters, :data:`MESSAGE_IDS`
    and the journal analysis (``chandrad.ctl.journal``) all spell it from here."""

    DAEMON_STATE = "daemon_state"
    ENGINE_STATE = "engine_state"
    ENGINE_LINE = "engine_line"
    ENGINE_FAILURE = "engine_failure"
    PROFILE_CHANGE = "profile_change"
    ENGINE_RESTART = "engine_restart"
    ENGINE_READY = "engine_ready"
    JOB_ACCEPTED = "job_accepted"
    JOB_DONE = "job_done"
    JOB_FAILED = "job_failed"
    PAGE_FAILED = "page_failed"
    CONFIG_RELOADED = "config_reloaded"
    CONTROL_REQUEST = "control_request"
    DAEMON_STARTED = "daemon_started"
    DAEMON_STOPPED = "daemon_stopped"
    ENGINE_SPAWNED = "engine_spawned"
    ENGINE_STABLE = "engine_stable"
    ENGINE_ORPHANS = "engine_orphans"
    ENGINE_GPU_MEMORY_HELD = "engine_gpu_memory_held"
    CONFIG_RELOAD_REFUSED = "config_reload_refused"
    JOB_CRASHED = "job_crashed"
    ENGINE_FATAL = "engine_fatal"
    TASK_CRASHED = "task_crashed"
    JOB_HELD = "job_held"
    FILE_QUARANTINED = "file_quarantined"


#: One fixed 128-bit id per event (``journalctl MESSAGE_ID=…``); docs/systemd.md's table is
#: checked against it (tests/test_docs.py). Generated once with uuid4; never change a
#: published id.
MESSAGE_IDS: dict[Event, str] = {
    Event.DAEMON_STATE: "df9ad874d619487987c9e8daebba71cd",
    Event.ENGINE_STATE: "8dbd9f6794ee422a8d6ef1c48537db3f",
    Event.ENGINE_LINE: "a4d56d5b777f404ca4d49ad1a3ac85a1",
    Event.ENGINE_FAILURE: "b687e9e3669b41af92644a3b6920ea3e",
    Event.PROFILE_CHANGE: "ea9b6a12aaf6443f8625b375db71eb61",
    Event.ENGINE_RESTART: "9456121b54e04492ab4796ea1b39ad4a",
    Event.ENGINE_READY: "83eb47f4c5544c7da572d28b4309c70e",
    Event.JOB_ACCEPTED: "b7dfcf5327be4d20aea1766796aa84c1",
    Event.JOB_DONE: "67592c22ab6e45d0ac403a85164909d3",
    Event.JOB_FAILED: "1adbc297b6ad4e178edc11948753201f",
    Event.PAGE_FAILED: "44f39e903fe747b38f45b7dbb9dc2757",
    Event.CONFIG_RELOADED: "43350eda2eb44fea87ff141768ae76ed",
    Event.CONTROL_REQUEST: "dc62fc0e273c4ef2945240efab104123",
    # Further events the daemon emits today (not named in SPEC §7, still worth filtering on).
    Event.DAEMON_STARTED: "cdba0b4a869f4b1a835c6d887c5fec1c",
    Event.DAEMON_STOPPED: "8dd71c6216bc4a0298623c8e9b56ace0",
    Event.ENGINE_SPAWNED: "f47cc2ced58e42638241461eab7c8859",
    Event.ENGINE_STABLE: "d452699136fd4e3fb01cd4026a9f9311",
    Event.ENGINE_ORPHANS: "f627226426f74d928110119d5b7d9817",
    Event.ENGINE_GPU_MEMORY_HELD: "a5da8ab6f05a439b9f83083e55dd7597",
    Event.CONFIG_RELOAD_REFUSED: "c6169f124ade47a89d4a4f2d52dde5bb",
    Event.JOB_CRASHED: "544a9b308fa04f22980b4ccd38e6f9a3",
    Event.ENGINE_FATAL: "0d89ab15d1054f90bab0aa0c780bf13c",
    Event.TASK_CRASHED: "e6102e2a9ac14c43b132a453b3f8f774",
    Event.JOB_HELD: "5ab98aa6b1f14341a950822e80f2d5b7",
    Event.FILE_QUARANTINED: "b28f3e87a020478b949d42dec33881a0",
}

#: syslog priorities (``PRIORITY=``) of structlog/stdlib level names.
PRIORITIES: dict[str, int] = {
    "critical": 2,
    "exception": 3,
    "error": 3,
    "warning": 4,
    "warn": 4,
    "info": 6,
    "debug": 7,
    "notset": 7,
}

#: Event keys with a fixed journal field name instead of ``CHANDRA_<KEY>``.
_FIELD_ALIASES: dict[str, str] = {
    "job": "CHANDRA_JOB",
    "job_id": "CHANDRA_JOB",
    "class": "CHANDRA_CLASS",
    "failure_class": "CHANDRA_CLASS",
}
_CALLSITE_KEYS = ("pathname", "lineno", "func_name")
_EVENT_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_NOT_FIELD_CHAR = re.compile(r"[^A-Z0-9_]")
_MESSAGE_VALUE_CHARS = 160
#: Third-party loggers that are chatty at INFO (httpx logs every request).
_NOISY_LOGGERS = ("httpx", "httpcore", "watchdog", "urllib3", "asyncio", "filelock")

_MARK = "_chandrad_handler"


def field_name(key: str) -> str:
    """The journal field for an event key: ``CHANDRA_<KEY>`` in ``[A-Z0-9_]``, ≤ 64 chars."""
    if key in _FIELD_ALIASES:
        return _FIELD_ALIASES[key]
    return ("CHANDRA_" + _NOT_FIELD_CHAR.sub("_", key.upper()))[:64]


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"))


def _short(value: Any) -> str:
    text = " ".join(_as_text(value).split())
    if len(text) > _MESSAGE_VALUE_CHARS:
        text = text[: _MESSAGE_VALUE_CHARS - 1] + "…"
    return f'"{text}"' if " " in text else text


def journal_fields(event_dict: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Map one rendered event dict to native journal ``(FIELD, value)`` pairs."""
    ed = dict(event_dict)
    event = _as_text(ed.pop("event", ""))
    level = _as_text(ed.pop("level", "info")).lower()
    ed.pop("timestamp", None)  # journald stamps every entry itself
    exception = ed.pop("exception", None)
    pathname, lineno, func = (ed.pop(k, None) for k in _CALLSITE_KEYS)
    is_event = bool(_EVENT_NAME.match(event))
    if event == Event.ENGINE_LINE:
        ed.setdefault("source", "vllm")

    if event == Event.ENGINE_LINE and "line" in ed:
        message = f"{ed['source']}: {_as_text(ed['line'])}"
    else:
        extras = " ".join(f"{k}={_short(v)}" for k, v in ed.items() if k != "logger")
        message = f"{event} {extras}".strip()
    if exception:
        message = f"{message}\n{exception}"

    fields: list[tuple[str, str]] = [
        ("MESSAGE", message),
        ("PRIORITY", str(PRIORITIES.get(level, 6))),
        ("SYSLOG_IDENTIFIER", SYSLOG_IDENTIFIER),
    ]
    if event in MESSAGE_IDS:
        fields.append(("MESSAGE_ID", MESSAGE_IDS[Event(event)]))
    if is_event:
        fields.append(("CHANDRA_EVENT", event))
    if pathname is not None:
        fields.append(("CODE_FILE", _as_text(pathname)))
    if lineno is not None:
        fields.append(("CODE_LINE", _as_text(lineno)))
    if func is not None:
        fields.append(("CODE_FUNC", _as_text(func)))
    if exception:
        fields.append(("CHANDRA_EXCEPTION", _as_text(exception)))
    for key, value in ed.items():
        fields.append((field_name(key), _as_text(value)))
    return fields


def encode_native(fields: list[tuple[str, str]]) -> bytes:
    """Native protocol payload: ``KEY=value\\n``; multi-line: ``KEY\\n<le64 len><bytes>\\n``.

    This is also the body of one entry in the journal *export* format.
    """
    out = bytearray()
    for key, value in fields:
        data = value.encode("utf-8", "backslashreplace")
        if b"\n" in data:
            out += key.encode("ascii") + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode("ascii") + b"=" + data + b"\n"
    return bytes(out)


class JournalSender:
    """Sends native-protocol payloads to journald; a too-large one as a sealed memfd."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock: socket.socket | None = None

    def send(self, payload: bytes) -> None:
        """Send one entry. Raises ``OSError`` when journald cannot be reached."""
        if self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.settimeout(5.0)
        try:
            self._sock.sendto(payload, self.path)
        except OSError as exc:
            if exc.errno not in (errno.EMSGSIZE, errno.ENOBUFS):
                self.close()
                raise
            self._send_memfd(self._sock, payload)

    def _send_memfd(self, sock: socket.socket, payload: bytes) -> None:
        fd = os.memfd_create("chandrad-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
            sock.sendmsg([], rights, 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class JournalHandler(logging.Handler):
    """A logging handler whose formatter yields a JSON event dict, sent as a journal entry."""

    def __init__(self, sender: JournalSender, fallback: TextIO) -> None:
        super().__init__()
        self.sender = sender
        self.fallback = fallback

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            payload = encode_native(journal_fields(json.loads(line)))
        except Exception:
            self.handleError(record)
            return
        try:
            self.sender.send(payload)
        except OSError:
            # No journald (or it is wedged): keep the record, as a JSON line on stderr,
            # which systemd also routes to the journal.
            self.fallback.write(line + "\n")
            self.fallback.flush()

    def close(self) -> None:
        self.sender.close()
        super().close()


def _shared_processors() -> list[Processor]:
    return [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.CallsiteParameterAdder(
            [
                structlog.processors.CallsiteParameter.PATHNAME,
                structlog.processors.CallsiteParameter.LINENO,
                structlog.processors.CallsiteParameter.FUNC_NAME,
            ]
        ),
    ]


def _drop_callsite(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    for key in _CALLSITE_KEYS:
        event_dict.pop(key, None)
    return event_dict


def _json_renderer() -> Processor:
    return structlog.processors.JSONRenderer(ensure_ascii=False, default=str)


def resolve_format(fmt: str, stream: TextIO) -> str:
    """``auto``: ``journal`` if ``$JOURNAL_STREAM`` is this stream, console on a TTY, else json."""
    if fmt != "auto":
        return fmt
    if _is_journal_stream(stream):
        return "journal"
    return "console" if stream.isatty() else "json"


def _is_journal_stream(stream: TextIO) -> bool:
    raw = os.environ.get("JOURNAL_STREAM", "")
    dev, _, ino = raw.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(dev) and st.st_ino == int(ino)


def configure_logging(
    fmt: str = "auto", level: str = "info", *, stream: TextIO | None = None
) -> None:
    """Configure structlog and the stdlib root logger; safe to call again (reload).

    ``fmt``: ``auto|journal|json|console``; ``level``: ``debug|info|warning|error``.
    ``stream`` (default ``sys.stderr``) receives json/console lines and the journal fallback.
    """
    problems: list[ConfigProblem] = []
    if fmt not in ("auto", "journal", "json", "console"):
        problems.append(ConfigProblem("daemon.log_format", f"unknown log format {fmt!r}"))
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        problems.append(ConfigProblem("daemon.log_level", f"unknown log level {level!r}"))
    if problems:
        raise ConfigError(problems)
    assert isinstance(numeric, int)

    out = stream if stream is not None else sys.stderr
    shared = _shared_processors()
    resolved = resolve_format(fmt, out)
    final: list[Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    handler: logging.Handler
    if resolved == "journal":
        path = os.environ.get(JOURNAL_SOCKET_ENV) or DEFAULT_JOURNAL_SOCKET
        handler = JournalHandler(JournalSender(path), out)
        final += [structlog.processors.format_exc_info, _json_renderer()]
    elif resolved == "json":
        handler = logging.StreamHandler(out)
        final += [structlog.processors.format_exc_info, _json_renderer()]
    else:
        handler = logging.StreamHandler(out)
        final += [_drop_callsite, structlog.dev.ConsoleRenderer(colors=out.isatty())]
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=final, foreign_pre_chain=shared)
    )
    setattr(handler, _MARK, True)

    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(max(numeric, logging.WARNING))
    logging.captureWarnings(True)

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger named ``name`` (default: the root ``chandrad`` logger)."""
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name or "chandrad")
    return logger
