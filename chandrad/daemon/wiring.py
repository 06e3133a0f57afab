"""From the config to the daemon's concrete parts, and the config errors that name the key.

What ``Daemon`` start-up builds that can fail on the config (the store, the watched folders,
the engine plan) raises ``ConfigError`` with the key, file and line here; the GPU probe the
supervisors share; the names of each engine's task and session file; the ``/metrics``
listener, whose failure is shown in ``status`` but does not stop the daemon.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import structlog

from chandrad import gpu as nvml
from chandrad import names
from chandrad.config import Config, key_line
from chandrad.engine.profile import GpuFacts
from chandrad.engine.replicas import GpuSlot, ReplicaSpec, plan_replicas
from chandrad.errors import ConfigError, ConfigProblem, StateDirInUse
from chandrad.metrics import Metrics, MetricsServer, parse_listen
from chandrad.store import Store

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


def open_store(cfg: Config) -> Store:
    """The store in ``daemon.state_dir``; another live daemon there, or a directory that
    cannot be used, is a config error on that key."""
    try:
        return Store.open(cfg.daemon.state_dir)
    except StateDirInUse as exc:
        message, code = exc.message, exc.code
    except OSError as exc:
        message = f"cannot open the store in {cfg.daemon.state_dir}: {exc.strerror or exc}"
        code = "config_state_dir"
    raise ConfigError([ConfigProblem("daemon.state_dir", message, str(cfg.path),
                                     key_line_of(cfg, "daemon.state_dir"), code)])


def make_watch_folders(cfg: Config) -> None:
    """Create every watched folder; each one that cannot be is a problem on its key."""
    problems = []
    for i, w in enumerate(cfg.watch):
        for name in ("input", "output", "done", "failed"):
            folder = getattr(w, name)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                key = f"watch[{i}].{name}"
                problems.append(ConfigProblem(
                    key, f"cannot create {folder}: {exc.strerror or exc}", str(cfg.path),
                    key_line_of(cfg, key), "config_watch_folder"))
    if problems:
        raise ConfigError(problems)


def describe_item(item: Any) -> str:
    """A task's item for logs and status: a job, or a settled file ``(index, root, path…)``."""
    if isinstance(item, tuple) and len(item) >= 3:
        return names.display(item[2])
    job_id, path = getattr(item, "id", None), getattr(item, "abs_path", None)
    if job_id is not None and path is not None:
        return f"job {job_id} ({names.display(path)})"
    return names.text(repr(item))


class MetricsListener:
    """The ``/metrics`` listener, if ``metrics.listen`` asks for one.

    An address that cannot be bound is logged and shown in ``status`` but does not stop the
    daemon: OCR matters more than its dashboard, and Prometheus' own ``up`` alert reports
    the missing target.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.server: MetricsServer | None = None
        #: Why the listener is missing, for ``status`` ("" when none was refused).
        self.error = ""

    @property
    def address(self) -> str | None:
        return f"{self.server.host}:{self.server.port}" if self.server else None

    async def start(self, listen: str) -> None:
        if not listen:
            return
        host, port = parse_listen(listen)
        server = MetricsServer(self.metrics, host, port)
        try:
            await server.start()
        except OSError as exc:
            self.error = f"cannot listen on {listen}: {exc.strerror or exc}"
            log.error("metrics_listen_failed", listen=listen, error=exc.strerror or str(exc))
            return
        self.server = server

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
