"""Structured logging: structlog for chandrad and the stdlib loggers, rendered for journald or JSON.

Owns the one logging configuration of the daemon (docs/systemd.md, Logs): structlog is the API
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
* ``console``: structlog's readable console lines, without the engine's access-log lines
  for requests that succeeded (``GET /health`` every few seconds, ``/metrics``, one
  ``POST`` per page: :class:`QuietAccessLog`); journal and json keep every line.
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
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from chandrad.errors import ConfigError, ConfigProblem
from chandrad.events import MESSAGE_IDS, Event

DEFAULT_JOURNAL_SOCKET = "/run/systemd/journal/socket"
JOURNAL_SOCKET_ENV = "CHANDRAD_JOURNAL_SOCKET"
SYSLOG_IDENTIFIER = "chandrad"


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

#: A uvicorn access-log line as vLLM prints it, e.g.
#: ``(APIServer pid=7) INFO:     127.0.0.1:40894 - "GET /health HTTP/1.1" 200 OK``.
_ACCESS_LINE = re.compile(r' - "[A-Z]+ \S* HTTP/[0-9.]+" [23][0-9][0-9]\b')


class QuietAccessLog(logging.Filter):
    """Drops ``engine_line`` records that are access-log lines of successful requests.

    On a terminal they are nearly all there is (a health poll every 5 s, a scrape, a
    request per page); a failed request (4xx, 5xx) still shows.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        event = record.msg
        if isinstance(event, dict) and event.get("event") == Event.ENGINE_LINE:
            return not _ACCESS_LINE.search(str(event.get("line", "")))
        return True


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
        handler.addFilter(QuietAccessLog())
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
