"""Weights on first start: the fetch child the supervisor runs before vLLM.

Owns deciding whether ``engine.model`` must be downloaded (a hub id the HF cache does
not hold), running ``python -m chandrad.fetch MODEL`` in its own session with the
engine's ``HF_*`` environment, reading its progress lines, and turning its end into a
:class:`Diagnosis`. The download itself is chandrad/fetch.py's (resumable); the state
machine is the supervisor's.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from chandrad import fetch, model_files
from chandrad.config import EngineConfig
from chandrad.engine.classify import Diagnosis, FailureClass
from chandrad.errors import ExitCode

_FETCH_ACTION = ("run `chandrad fetch-model --config <config>` as the daemon's user (or copy a "
                 "cache fetched elsewhere)")


def cache_dir(engine: EngineConfig, base_env: Mapping[str, str]) -> Path:
    """The HF cache the engine reads (its ``engine.env`` over the daemon's environment)."""
    return model_files.hub_cache_dir({**base_env, **engine.env})


def must_fetch(engine: EngineConfig, base_env: Mapping[str, str]) -> bool:
    """Whether ``engine.model`` is a hub id (``org/name``) the cache does not hold."""
    model = engine.model
    if Path(model).is_dir() or model.count("/") != 1 or model.startswith(("/", ".", "~")):
        return False
    return not model_files.is_available(model, cache_dir=cache_dir(engine, base_env))


def offline_not_cached(engine: EngineConfig, base_env: Mapping[str, str]) -> Diagnosis:
    """``engine.offline = true`` and the cache lacks the model: no restart can fix it."""
    return Diagnosis(
        cls=FailureClass.OTHER_FATAL,
        evidence=f"{engine.model!r} is not in the Hugging Face cache "
        f"({cache_dir(engine, base_env)}) and engine.offline = true forbids downloading it",
        numbers={}, action=_FETCH_ACTION, restartable=False, subclass="model_not_found")


@dataclass
class Progress:
    """Bytes of the model in the cache so far, of its total (0 until the child knows)."""

    done: int = 0
    total: int = 0


class FetchChild:
    """One run of the fetch child; :meth:`wait` gives its verdict (None: fetched)."""

    def __init__(self, engine: EngineConfig, base_env: Mapping[str, str]) -> None:
        self.model = engine.model
        self.env = {**base_env, **fetch.hub_environment({**base_env, **engine.env})}
        self.progress = Progress()
        self._proc: asyncio.subprocess.Process | None = None
        self._last_error = ""
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "chandrad.fetch", self.model, env=self.env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        self._reader = asyncio.create_task(self._read())

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        async for raw in self._proc.stdout:
            line = raw.decode("utf-8", "replace").strip()
            word, _, rest = line.partition(" ")
            if word == fetch.PROGRESS_LINE:
                done, _, total = rest.partition(" ")
                if done.isdigit() and total.isdigit():
                    self.progress = Progress(int(done), int(total))
            elif word == fetch.ERROR_LINE:
                self._last_error = rest
            elif line:
                self._last_error = self._last_error or line[-500:]  # a traceback's first line

    async def wait(self) -> tuple[int, Diagnosis | None]:
        """The child's exit status and, unless it fetched the model, the failure."""
        assert self._proc is not None
        code = await self._proc.wait()
        if self._reader is not None:
            await self._reader
        if code == 0:
            return code, None
        evidence = self._last_error or f"the fetch child exited {code}"
        if code == ExitCode.CONFIG:
            return code, Diagnosis(
                cls=FailureClass.OTHER_FATAL, evidence=evidence, numbers={},
                action="fix engine.model (the hub has no such repository, or this host has "
                "no access: HF_TOKEN in engine.env), then reload", restartable=False,
                subclass="model_not_found")
        return code, Diagnosis(
            cls=FailureClass.OTHER_FATAL, evidence=evidence,
            numbers={"done": float(self.progress.done), "total": float(self.progress.total)},
            action="retrying with backoff (the download resumes); check the network, the "
            "hub's reachability (HF_ENDPOINT) and the cache's free space, or " + _FETCH_ACTION,
            restartable=True, subclass="model_fetch_failed")

    async def stop(self) -> None:
        """Kill the child's session (a part file stays; the next fetch resumes it)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        await proc.wait()
        if self._reader is not None:
            await self._reader
