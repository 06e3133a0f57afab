"""vLLM's parser's verdict on the engine flags, shared by the replicas of one config.

A check runs ``engine/command.py``'s validation in a child that imports vLLM (up to a
minute); a clean verdict is kept for the daemon's life and, with a
:class:`~chandrad.engine.flagcache.FlagVerdictCache`, on disk for the next daemon.
:func:`judge` splits what a check found into the parser's verdict on the config (a config
error: the daemon exits 78) and a check that could not run (an engine start failure,
retried with backoff).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from chandrad.config import EngineConfig
from chandrad.engine.classify import Diagnosis, FailureClass
from chandrad.engine.command import engine_flags, engine_python, validate_in_child
from chandrad.engine.flagcache import FlagVerdictCache, verdict_key
from chandrad.engine.profile import MemoryProfile
from chandrad.errors import ConfigProblem

#: Problem code of a flag check that could not run (child timed out, was killed, could not
#: import vLLM, or answered garbage). Only a verdict of vLLM's parser is a config error;
#: this is an engine start failure, retried with backoff.
FLAG_CHECK_FAILED_CODES = frozenset({"engine_vllm_missing"})


class FlagChecks:
    """vLLM's parser's verdict on the engine flags, one check per config for every replica.

    Replicas differ only in port, GPUs and CPU list, which the parser does not judge: N
    replicas starting at once share one child (on a small host N children importing vLLM
    at once could each exceed the check's deadline). Only a clean verdict is kept, here
    and, with ``cache``, on disk for the next daemon (``engine/flagcache.py``); a check
    with problems runs again next time."""

    def __init__(self, cache: FlagVerdictCache | None = None) -> None:
        self.cache = cache
        self._checks: dict[str, asyncio.Future[tuple[list[ConfigProblem], bool]]] = {}
        self._waiters: dict[str, int] = {}

    async def run(self, engine: EngineConfig,
                  profile: MemoryProfile) -> tuple[list[ConfigProblem], bool]:
        """The problems vLLM's parser finds, and whether a stored clean verdict answered."""
        judged = replace(engine, port=0, gpus="", cpu_affinity=())  # what the parser sees
        key = repr(judged)
        check = self._checks.get(key)
        if check is None:
            check = self._checks[key] = asyncio.ensure_future(
                self._check(key, judged, engine, profile))
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            problems, cached = await asyncio.shield(check)
        except BaseException:
            if self._waiters[key] == 1 and not check.done():
                check.cancel()  # the last one waiting was stopped: kill the child
            if self._waiters[key] == 1 or check.done():
                self._checks.pop(key, None)
            raise
        finally:
            self._waiters[key] -= 1
        if problems:
            self._checks.pop(key, None)
        return problems, cached

    async def _check(self, key: str, judged: EngineConfig, engine: EngineConfig,
                     profile: MemoryProfile) -> tuple[list[ConfigProblem], bool]:
        python = engine_python(engine)
        stored = None
        if self.cache is not None:
            flags = engine_flags(judged, profile)
            stored = await asyncio.to_thread(verdict_key, python, flags)
            if stored is not None and await asyncio.to_thread(self.cache.is_clean, stored):
                return [], True
        problems = await validate_in_child(engine, profile, engine.python or None)
        if not problems and self.cache is not None and stored is not None:
            await asyncio.to_thread(self.cache.remember_clean, stored)
        return problems, False


def judge(problems: list[ConfigProblem]) -> tuple[list[ConfigProblem], Diagnosis | None]:
    """A check's problems → vLLM's parser's verdict on the config (refused flags: a config
    error), and the engine start failure of a check that could not run (``None``: it ran)."""
    verdict = [p for p in problems if p.code not in FLAG_CHECK_FAILED_CODES]
    if verdict or not problems:
        return verdict, None
    return [], Diagnosis(
        cls=FailureClass.OTHER_FATAL, evidence="; ".join(p.message for p in problems),
        numbers={}, action="retry with backoff; if it persists, check engine.python "
        "(`chandrad check-config`)", restartable=True, subclass="flag_check_failed")
