"""The API's secrets on disk: the tokens file and the webhook key, checked when the API
starts.

Tokens file: one token per line, ``NAME TOKEN`` or ``NAME TOKEN admin``; ``#`` starts a
comment. A file others may read (mode ``o+r``), an unreadable file, a malformed line or a
repeated name or token is a config error naming the key (exit 78). A request's bearer token
is compared with each known token in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hmac
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from chandrad.config import Config, key_line
from chandrad.errors import ConfigError, ConfigProblem

#: A token's name: what the store records as a job's owner.
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: Shortest token accepted: 16 characters (about 96 bits from a random base64 source).
MIN_TOKEN = 16


@dataclass(frozen=True)
class Caller:
    """Who a request's token says it is."""

    name: str
    admin: bool


class Tokens:
    """The known tokens, by value."""

    def __init__(self, entries: dict[str, Caller]) -> None:
        self._entries = entries

    def __len__(self) -> int:
        return len(self._entries)

    def caller(self, token: str) -> Caller | None:
        """The caller ``token`` names, compared in constant time per known token."""
        found = None
        raw = token.encode("utf-8", "surrogateescape")
        for known, caller in self._entries.items():
            if hmac.compare_digest(raw, known.encode()):
                found = caller
        return found


def _problem(cfg: Config, key: str, message: str) -> ConfigError:
    try:
        line = key_line(cfg.path.read_text(encoding="utf-8"), key)
    except OSError:
        line = None
    return ConfigError([ConfigProblem(key, message, str(cfg.path), line, "config_invalid")])


def _read_private(cfg: Config, key: str, path: Path) -> str:
    """The text of a secret file; refused when others may read it."""
    try:
        mode = path.stat().st_mode
        if mode & stat.S_IROTH:
            raise _problem(cfg, key, f"{path} is readable by others (mode "
                           f"{stat.S_IMODE(mode):04o}); chmod o-r it")
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _problem(cfg, key, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise _problem(cfg, key, f"{path} is not UTF-8 text") from None


def load_tokens(cfg: Config) -> Tokens:
    """``api.tokens_file`` read and checked (raises ConfigError naming the key)."""
    key = "api.tokens_file"
    path = cfg.api.tokens_file
    if path is None:
        raise _problem(cfg, key, "required when api.enabled: the file of API tokens")
    entries: dict[str, Caller] = {}
    names: set[str] = set()
    for lineno, raw in enumerate(_read_private(cfg, key, path).splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if (len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "admin")
                or not NAME.fullmatch(parts[0]) or len(parts[1]) < MIN_TOKEN):
            raise _problem(cfg, key, f"{path} line {lineno}: expected `NAME TOKEN` or `NAME "
                           f"TOKEN admin` (NAME of [A-Za-z0-9_.-], TOKEN of at least "
                           f"{MIN_TOKEN} characters)")
        name, token = parts[0], parts[1]
        if name in names or token in entries:
            raise _problem(cfg, key, f"{path} line {lineno}: name or token already given")
        names.add(name)
        entries[token] = Caller(name, len(parts) == 3)
    if not entries:
        raise _problem(cfg, key, f"{path} holds no token")
    return Tokens(entries)


def load_secret(cfg: Config) -> bytes | None:
    """``api.webhook_secret_file``'s key (surrounding whitespace stripped), None if unset."""
    key = "api.webhook_secret_file"
    path = cfg.api.webhook_secret_file
    if path is None:
        return None
    secret = _read_private(cfg, key, path).strip()
    if len(secret) < MIN_TOKEN:
        raise _problem(cfg, key, f"{path}: a key of at least {MIN_TOKEN} characters is needed")
    return secret.encode()
