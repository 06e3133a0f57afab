"""Exit codes and the typed error hierarchy of chandrad.

Leaf module: imports nothing from chandrad. Every error has a stable snake_case
``code`` (used on the control socket, in ``<name>.error.json`` and as a journal
field), a guidance ``message`` and the ``exit_code`` an entry point maps it to.
Only ``cli.py`` and ``ctl/main.py`` turn these into process exit statuses.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, ClassVar


class ExitCode(IntEnum):
    """Exit statuses of ``chandrad`` (README.md, Commands) and of its fetch child."""

    OK = 0
    BATCH_FAILED = 1  # ``chandrad batch``: some file failed (the summary says which and why)
    USAGE = 2
    # Engine gave up (only with engine.exit_on_fatal = true); ``fetch-model`` and the fetch
    # child (``python -m chandrad.fetch``): the hub could not serve the model, worth a retry.
    UNAVAILABLE = 69
    SOFTWARE = 70  # internal error
    # EX_CONFIG; the unit sets RestartPreventExitStatus=78. The fetch child: the hub has no
    # such repository, revision or file, or this host has no access (fatal: fix engine.model).
    CONFIG = 78
    INTERRUPTED = 130  # ``chandrad batch`` stopped by Ctrl-C (128 + SIGINT); a rerun resumes


class CtlExit(IntEnum):
    """Exit statuses of ``chandractl`` (LSB; README.md, Commands)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_RUNNING = 3
    UNKNOWN_OR_FORBIDDEN = 4


class ChandradError(Exception):
    """Base of every error chandrad raises on purpose."""

    code: ClassVar[str] = "internal_error"
    exit_code: ClassVar[ExitCode] = ExitCode.SOFTWARE

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """Serialise for the control socket or an ``error.json`` file."""
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = self.details
        return out


class ModelFetchFailed(ChandradError):
    """``chandrad fetch-model`` could not download the model (network, unknown id, access)."""

    code = "model_fetch_failed"
    exit_code = ExitCode.UNAVAILABLE


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config file, located as precisely as we can."""

    key: str
    message: str
    file: str = ""
    line: int | None = None
    code: str = "config_invalid"

    def __str__(self) -> str:
        where = self.file or "<config>"
        if self.line is not None:
            where = f"{where}:{self.line}"
        return f"{where}: {self.key}: {self.message}"


class ConfigError(ChandradError):
    """The configuration is invalid; carries every problem found, not only the first."""

    code = "config_invalid"
    exit_code = ExitCode.CONFIG

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__(
            "\n".join(str(p) for p in problems),
            problems=[p.__dict__ for p in problems],
        )


class MetricsListenFailed(ConfigError):
    """``metrics.listen`` names an address this host can never listen on: a name that does
    not resolve, an address that is not this host's, a port the daemon may not bind.

    A config error (exit 78, one line naming the key and the address). A port that another
    process holds is not one: the daemon serves without ``/metrics`` and binds once the
    port is free (``daemon/wiring.MetricsListener``).
    """

    code = "metrics_listen_failed"

    def __init__(self, listen: str, reason: str, file: str = "",
                 line: int | None = None) -> None:
        super().__init__([ConfigProblem("metrics.listen", f"cannot listen on {listen}: "
                                        f"{reason}", file=file, line=line, code=self.code)])


class StateDirInUse(ChandradError):
    """Another live chandrad holds the store's lock (an ``flock`` on the database file
    itself, so deleting ``chandrad.lock`` does not release it).

    Two daemons on one store would each take the other's in-flight pages back
    for recomputation (and kill the other's engine as stale), so the second refuses to
    start before it touches anything.
    """

    code = "state_dir_in_use"
    exit_code = ExitCode.CONFIG


class StoreDamaged(ChandradError):
    """The store (``<state_dir>/chandrad.sqlite3``) is damaged, or empty where it held jobs.

    The daemon refuses to start (exit 78: systemd does not restart it into the same
    damage); the message names the file and the way out (``chandrad store check``/
    ``repair``, or a fresh store that keeps ``done/``, ``failed/`` and ``output/``).
    """

    code = "store_damaged"
    exit_code = ExitCode.CONFIG


class StoreFull(ChandradError):
    """The store's filesystem refuses to grow the database (disk full, quota).

    An expected OS condition, like :class:`OutputUnwritable`: nothing is failed for it,
    files wait in the inbox and jobs where they are, and work resumes on its own once
    there is space again.
    """

    code = "store_full"
    #: What ``STATUS=``, ``status`` and the metrics call the condition (one place).
    title: ClassVar[str] = "store full"


class StoreUnreachable(StoreFull):
    """The store's server (PostgreSQL) cannot be reached: restarted, down, or the network.

    Handled as a full store is: nothing is failed for it, the work waits where the store
    has it, and every host carries on once it connects again. A command that needs the
    store at once (``chandrad store check``, ``tune``) exits 69: worth a retry.
    """

    code = "store_unreachable"
    title = "store unreachable"
    exit_code = ExitCode.UNAVAILABLE


class HostIdInUse(ChandradError):
    """Another live chandrad on the shared (PostgreSQL) store has this ``daemon.host_id``:
    the two would each take the other's jobs for their own and run them twice, so the
    second refuses to start."""

    code = "host_id_in_use"
    exit_code = ExitCode.CONFIG


class LeaseLost(ChandradError):
    """Another host took over a job this host was running (its lease expired: this host
    stalled or lost the store for longer than ``daemon.lease_s``). This host drops the job
    without touching its files; the new owner finishes it."""

    code = "lease_lost"


class PageTaken(LeaseLost):
    """A page is no longer this host's to work on (a shared store): a helping host holds
    it, or this host helped with it and its page lease expired (the job's owner took the
    page back). This host drops that page, stores nothing for it, and carries on with the
    rest of its work."""

    code = "page_lease_lost"


class EngineUnavailable(ChandradError):
    """The engine could not be reached or did not answer usefully (transport level)."""

    code = "engine_unavailable"

    @property
    def page_may_be_at_fault(self) -> bool:
        """The engine took the request and answered 5xx or timed out on it, so the page
        itself may be what fails; a refused or dropped connection is the engine's failure,
        and so is a router's or gateway's 5xx saying no engine could be reached."""
        if self.details.get("unreachable"):
            return False
        return "status" in self.details or bool(self.details.get("timed_out"))


class InputError(ChandradError):
    """A file cannot be processed; it goes to ``failed/`` with this code. Never exits."""

    code = "corrupt_input"


class EncryptedInput(InputError):
    code = "encrypted_pdf"


class DecompressionBomb(InputError):
    code = "decompression_bomb"


class TooManyPages(InputError):
    code = "too_many_pages"


class EmptyInput(InputError):
    code = "empty_input"


class UnsupportedFormat(InputError):
    code = "unsupported_format"


class RenderCrashed(InputError):
    """The render worker process died on this page (decoder crash, killed for memory)."""

    code = "render_crashed"


class RenderTimeout(InputError):
    """Rendering one page took longer than the render timeout."""

    code = "render_timeout"


class OutputError(ChandradError):
    """Writing outputs or moving the input failed."""

    code = "output_write_failed"


class OutputUnwritable(OutputError):
    """The output side refuses writes for now (disk full, quota, read-only, permission).

    An expected OS condition, not a defect: the job is held and retried, its input
    stays accepted, and it is logged as one warning line without a traceback.
    """

    code = "output_unwritable"
    ERRNOS: ClassVar[frozenset[int]] = frozenset(
        {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


class ControlErrorCode(StrEnum):
    """The ``code`` of an error reply on the control socket (docs/operations.md)."""

    BAD_REQUEST = "bad_request"
    TOO_LARGE = "too_large"
    TIMEOUT = "timeout"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_COMMAND = "unknown_command"
    FORBIDDEN = "forbidden"
    INVALID_STATE = "invalid_state"
    NOT_FOUND = "not_found"
    INTERNAL_ERROR = "internal_error"
    BUSY = "busy"
    #: The request needed the store (PostgreSQL) and it cannot be reached; the daemon
    #: carries on and connects again by itself.
    STORE_UNREACHABLE = "store_unreachable"


#: Every control error code as a plain string (what a reply carries).
CONTROL_ERROR_CODES: frozenset[str] = frozenset(c.value for c in ControlErrorCode)

#: Control error codes that chandractl maps to LSB exit 4 (unknown/forbidden).
CTL_EXIT4_CODES: frozenset[ControlErrorCode] = frozenset(
    {ControlErrorCode.FORBIDDEN, ControlErrorCode.UNKNOWN_COMMAND, ControlErrorCode.NOT_FOUND})


class ControlError(ChandradError):
    """An error answered on the control socket; ``code`` travels to the client.

    Raises ``ValueError`` for a code that is not a :class:`ControlErrorCode`: a reply never
    carries a code the client does not know.
    """

    code = "bad_request"

    def __init__(self, code: ControlErrorCode | str, message: str) -> None:
        super().__init__(message)
        try:
            self.error_code = ControlErrorCode(code)
        except ValueError:
            raise ValueError(f"unknown control error code {code!r}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.error_code.value, "message": self.message}


class ProtocolError(ControlError):
    """A control frame that cannot be honoured (chandrad/protocol.py).

    ``request_id`` is the id of the offending request when it could be read, so the
    error reply can still be matched by the client.
    """

    def __init__(self, code: ControlErrorCode | str, message: str,
                 request_id: str | int | None = None) -> None:
        super().__init__(code, message)
        self.request_id = request_id


class ControlSocketError(ChandradError):
    """The control socket cannot be set up (path, group or permissions).

    Exit 78 like a config error: a restart cannot fix it, the operator must
    (``control.socket``, ``control.group``, or the daemon already using it).
    """

    code = "control_socket_error"
    exit_code = ExitCode.CONFIG


class ControlSocketInUse(ControlSocketError):
    """Another live daemon answers on the socket path: refuse to steal it."""

    code = "control_socket_in_use"


class DaemonNotRunning(ChandradError):
    """``chandractl``: nothing listens on the socket (ENOENT, ECONNREFUSED): LSB exit 3."""

    code = "daemon_not_running"


class ControlAccessDenied(ChandradError):
    """``chandractl``: the socket exists but this user may not connect (EACCES/EPERM): exit 4."""

    code = "forbidden"


class ControlTransportError(ChandradError):
    """``chandractl``: the connection broke, timed out, or the daemon answered garbage: exit 1."""

    code = "control_transport"


class BatchInputError(ValueError):
    """A command-line input that cannot be part of a batch (missing, inside the output):
    ``chandrad batch`` exits 2 (usage)."""


class NvmlUnavailable(Exception):
    """NVML could not be loaded or initialised; the message is NVML's own text."""


class NoPagePixels(RuntimeError):
    """Post-processing needed the page's pixels but was sent only its size: a bug in
    ``PageImage.for_answer``, raised rather than written as a missing crop."""


#: A job the operator cancelled (``chandractl cancel``): the store's ``error_code`` and
#: ``error_message`` and its input's ``error.json`` say the same.
CANCELLED_CODE = "cancelled"
CANCELLED_MESSAGE = "cancelled by the operator"


class InternalError(ChandradError):
    """A broken invariant (for example an illegal state transition)."""

    code = "internal_error"
