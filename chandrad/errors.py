"""Exit codes and the typed error hierarchy of chandrad.

Leaf module: imports nothing from chandrad. Every error has a stable snake_case
``code`` (used on the control socket, in ``<name>.error.json`` and as a journal
field), a guidance ``message`` and the ``exit_code`` an entry point maps it to.
Only ``cli.py`` and ``ctl/main.py`` turn these into process exit statuses.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar


class ExitCode(IntEnum):
    """Exit statuses of ``chandrad`` (SPEC §2)."""

    OK = 0
    BATCH_FAILED = 1  # ``chandrad batch``: some file failed (the summary says which and why)
    USAGE = 2
    UNAVAILABLE = 69  # engine gave up, only with engine.exit_on_fatal = true
    SOFTWARE = 70  # internal error
    CONFIG = 78  # EX_CONFIG; the unit sets RestartPreventExitStatus=78
    INTERRUPTED = 130  # ``chandrad batch`` stopped by Ctrl-C (128 + SIGINT); a rerun resumes


class CtlExit(IntEnum):
    """Exit statuses of ``chandractl`` (LSB, SPEC §2)."""

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


class ControlError(ChandradError):
    """An error answered on the control socket; ``code`` travels to the client."""

    code = "bad_request"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.error_code = code

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.error_code, "message": self.message}


CONTROL_ERROR_CODES: frozenset[str] = frozenset(
    {
        "bad_request",
        "too_large",
        "timeout",
        "unsupported_version",
        "unknown_command",
        "forbidden",
        "invalid_state",
        "not_found",
        "internal_error",
        "busy",
    }
)

#: Control error codes that chandractl maps to LSB exit 4 (unknown/forbidden).
CTL_EXIT4_CODES: frozenset[str] = frozenset({"forbidden", "unknown_command", "not_found"})


#: A job the operator cancelled (``chandractl cancel``): the store's ``error_code`` and
#: ``error_message`` and its input's ``error.json`` say the same.
CANCELLED_CODE = "cancelled"
CANCELLED_MESSAGE = "cancelled by the operator"


class InternalError(ChandradError):
    """A broken invariant (for example an illegal state transition)."""

    code = "internal_error"
