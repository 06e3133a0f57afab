"""From the config to the daemon's concrete parts, and the config errors that name the key.

What ``Daemon`` start-up builds that can fail on the config (the store, the watched folders,
the engine plan) raises ``ConfigError`` with the key, file and line here; the GPU probe the
supervisors share; the names of each engine's task and session file; the ``/metrics``
listener (an address this host can never listen on is a config error; a port another
process holds is waited for, shown in ``status``, and does not stop the daemon).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import structlog

from chandrad import gpu as nvml
from chandrad import names, outputs
from chandrad.config import Config, key_line
from chandrad.engine.profile import GpuFacts
from chandrad.engine.replicas import GpuSlot, ReplicaSpec, plan_replicas
from chandrad.errors import (
    ConfigError,
    ConfigProblem,
    HostIdInUse,
    MetricsListenFailed,
    StateDirInUse,
    StoreUnreachable,
)
from chandrad.metrics import Metrics, MetricsServer, parse_listen
from chandrad.pipeline import Settled
from chandrad.store import Store, StoreBackend
from chandrad.systemd import Notifier
from chandrad.watch import folder_problems

log = structlog.get_logger("chandrad.daemon")


def key_line_of(cfg: Config, dotted: str) -> int | None:
    """The line of ``dotted`` in ``cfg``'s file, for a problem found after loading it."""
    try:
        return key_line(cfg.path.read_text(encoding="utf-8"), dotted)
    except OSError:
        return None


class NvmlProbe:
    """``chandrad.gpu`` shaped as the supervisor's ``GpuProbe``."""

    def facts(self, gpus: str) -> GpuFacts | None:
        smallest = nvml.sizing_gpu(nvml.read_gpus(), gpus)
        if smallest is None:
            return None
        return GpuFacts(total_gib=smallest.memory_total / 2**30,
                        free_gib=smallest.memory_free / 2**30)

    def identity(self, gpus: str) -> tuple[str, int]:
        chosen = nvml.select(nvml.read_gpus(), gpus)
        return (chosen[0].name if chosen else "cpu"), len(chosen)

    def memory_held_by(self, pids: set[int]) -> dict[int, int]:
        return nvml.pids_holding_memory(pids)


def plan_engines(cfg: Config) -> list[ReplicaSpec]:
    """The engines ``cfg`` asks for on this host's GPUs (NVML); a plan the GPUs cannot
    carry is a config error naming the key, file and line."""
    selected = nvml.select(nvml.read_gpus(), cfg.engine.gpus) if cfg.engine.supervised else []
    slots = [GpuSlot(g.index, g.uuid, g.memory_total) for g in selected]
    try:
        return plan_replicas(cfg.engine, slots)
    except ConfigError as exc:
        raise ConfigError([dataclasses.replace(p, file=str(cfg.path),
                                               line=key_line_of(cfg, p.key))
                           for p in exc.problems]) from None


def engine_name(engine_id: str) -> str:
    """An engine's name for its supervisor task and its session file: ``engine`` (engine 0,
    the only one unless replicas say more), ``engine-1``, …"""
    return "engine" if engine_id == "0" else f"engine-{engine_id}"


#: Seconds between two tries to reach a PostgreSQL store at start.
STORE_RETRY_S = 2.0


async def open_store_waiting(cfg: Config, notifier: Notifier) -> StoreBackend:
    """:func:`open_store`, waiting for a PostgreSQL server that cannot be reached: tried
    again every ``STORE_RETRY_S``, the journal saying why once and ``STATUS=`` all along
    (systemd's start timeout extended meanwhile)."""
    said = False
    while True:
        try:
            return open_store(cfg)
        except StoreUnreachable as exc:
            if not said:
                log.error("store_unreachable", store=exc.details.get("path"),
                          reason=exc.message, retry_every_s=STORE_RETRY_S)
                said = True
            notifier.status(f"waiting for the store: {exc.message}")
            notifier.extend_timeout(STORE_RETRY_S * 3)
            await asyncio.sleep(STORE_RETRY_S)


def open_store(cfg: Config) -> StoreBackend:
    """The store ``daemon.store`` names: PostgreSQL (raises StoreUnreachable while the
    server cannot be reached), or SQLite in ``daemon.state_dir`` (or the directory
    ``daemon.store`` names). For SQLite another live daemon there, or a directory that
    cannot be used, is a config error on that key; a damaged store raises StoreDamaged
    (exit 78, the file and the way out named); the check's cost is logged."""
    if cfg.daemon.store_url:
        # Only here: psycopg costs ~0.12 s of import, which a SQLite host never pays.
        from chandrad.store.postgres import PgStore

        host = cfg.daemon.host_id or socket.gethostname()
        try:
            pg = PgStore.open(cfg.daemon.store_url, host, cfg.daemon.lease_s)
        except HostIdInUse as exc:
            raise ConfigError([ConfigProblem("daemon.host_id", exc.message, str(cfg.path),
                                             key_line_of(cfg, "daemon.host_id"),
                                             exc.code)]) from None
        # Every journal line of a host sharing the queue names it (CHANDRA_HOST_ID): the
        # tasks started from here on inherit the context.
        structlog.contextvars.bind_contextvars(host_id=host)
        log.info("store_opened", store=pg.location, host=host, lease_s=pg.lease_s,
                 pages_released=pg.recovered.pages_released)
        return pg
    key = "daemon.store" if cfg.daemon.sqlite_dir else "daemon.state_dir"
    state_dir = cfg.daemon.sqlite_dir or cfg.daemon.state_dir
    try:
        store = Store.open(state_dir)
        # A store too large to check within its budget is opened anyway: say so louder.
        (log.info if store.check_complete else log.warning)(
            "store_checked", path=str(store.path), seconds=round(store.check_s, 3),
            complete=store.check_complete)
        return store
    except StateDirInUse as exc:
        message, code = exc.message, exc.code
    except OSError as exc:
        message = f"cannot open the store in {state_dir}: {exc.strerror or exc}"
        code = "config_state_dir"
    raise ConfigError([ConfigProblem(key, message, str(cfg.path), key_line_of(cfg, key),
                                     code)])


def from_thread(loop: asyncio.AbstractEventLoop, call: Callable[[], None]) -> Callable[[], None]:
    """``call``, to be asked from any thread (a shared store's listener): it runs on
    ``loop``'s thread; asked once the loop is closed (the daemon stopped), nothing."""
    def call_soon() -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(call)
    return call_soon


def make_watch_folders(cfg: Config) -> None:
    """Check every watched folder, creating those that may be (``watch.folder_problems``);
    each problem names its key, file and line."""
    problems = watch_folder_problems(cfg, create=True)
    if problems:
        raise ConfigError(problems)


#: On a shared store another host may be writing a searchable PDF beside its output folder,
#: or a document's outputs, now: only temp files older than this are a dead daemon's (one
#: takes seconds to write).
SHARED_LEFTOVER_AGE_S = 3600.0


def remove_output_leftovers(cfg: Config) -> None:
    """The temp files a killed daemon left in the output folders (the searchable PDFs',
    those of outputs written atomically: ``outputs.remove_leftovers``), before any job
    writes; each removal is logged."""
    older_than = time.time() - SHARED_LEFTOVER_AGE_S if cfg.daemon.store_url else None
    for output in dict.fromkeys(w.output for w in cfg.watch):
        for path in outputs.remove_leftovers(output, older_than=older_than):
            log.info("output_leftover_removed", path=names.display(path),
                     reason="a temp file of an output write a killed daemon cut short")


def watch_folder_problems(cfg: Config, *, create: bool) -> list[ConfigProblem]:
    """``watch.folder_problems`` located in ``cfg``'s file."""
    return [dataclasses.replace(p, file=str(cfg.path), line=key_line_of(cfg, p.key))
            for p in folder_problems(cfg.watch, create=create)]


def describe_item(item: Any) -> str:
    """A task's item for logs and status: a job, or a settled file."""
    if isinstance(item, Settled):
        return names.display(item.path)
    job_id, path = getattr(item, "id", None), getattr(item, "abs_path", None)
    if job_id is not None and path is not None:
        return f"job {job_id} ({names.display(path)})"
    return names.text(repr(item))


#: Seconds between two tries to bind a ``metrics.listen`` port another process holds.
METRICS_RETRY_S = 5.0


def _bind_reason(exc: OSError) -> str:
    """Why a bind failed, without asyncio's restatement of the address."""
    if exc.errno == errno.EADDRINUSE:
        return "the port is in use by another process"
    if isinstance(exc, socket.gaierror) or not exc.errno:
        return exc.strerror or str(exc)
    return os.strerror(exc.errno)


def _may_pass(exc: OSError) -> bool:
    """A bind failure that can go away by itself: the port is held by another process, or
    the name could not be resolved for now (DNS not answering)."""
    return exc.errno == errno.EADDRINUSE or (isinstance(exc, socket.gaierror)
                                             and exc.errno == socket.EAI_AGAIN)


class MetricsListener:
    """The ``/metrics`` listener, if ``metrics.listen`` asks for one.

    At start, an address this host can never listen on (a name that does not resolve, an
    address not of this host, a port the daemon may not bind) raises
    :class:`MetricsListenFailed`: exit 78, the key and address named. A port that another
    process holds is an environment condition, not a config error: OCR matters more than
    its dashboard, so the daemon serves without ``/metrics``, says so (one error line,
    ``status``, ``STATUS=``) and :meth:`wait_for_port` binds once the port is free.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.server: MetricsServer | None = None
        self.listen = ""
        #: Why the listener is missing, for ``status`` ("" when it listens or is off).
        self.error = ""
        self._closed = False

    @property
    def address(self) -> str | None:
        return f"{self.server.host}:{self.server.port}" if self.server else None

    @property
    def waiting(self) -> bool:
        """``metrics.listen`` asks for a listener that could not be bound yet."""
        return bool(self.listen) and self.server is None and not self._closed

    async def start(self, cfg: Config) -> None:
        """Bind ``metrics.listen``; raises MetricsListenFailed on an address that cannot be."""
        listen = self.listen = cfg.metrics.listen
        if not listen:
            return
        try:
            await self._bind()
        except OSError as exc:
            if not _may_pass(exc):
                raise MetricsListenFailed(listen, _bind_reason(exc), str(cfg.path),
                                          key_line_of(cfg, "metrics.listen")) from None
            self.error = (f"metrics.listen {listen}: {_bind_reason(exc)}; /metrics is off, "
                          f"tried again every {METRICS_RETRY_S:g} s")
            log.error("metrics_listen_failed", key="metrics.listen", listen=listen,
                      error=_bind_reason(exc), retry_every_s=METRICS_RETRY_S)

    async def wait_for_port(self) -> None:
        """The supervised task while :attr:`waiting`: bind as soon as the port is free."""
        while self.waiting:
            await asyncio.sleep(METRICS_RETRY_S)
            if self._closed:
                return
            try:
                await self._bind()
            except OSError:
                continue
            self.error = ""

    async def _bind(self) -> None:
        host, port = parse_listen(self.listen)
        server = MetricsServer(self.metrics, host, port)
        await server.start()
        self.server = server

    async def close(self) -> None:
        self._closed = True
        if self.server is not None:
            await self.server.close()
