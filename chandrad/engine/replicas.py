"""Which engines to run: NVML's per-GPU facts + ``[engine]`` → one spec per engine.

Pure. The daemon asks NVML for the GPUs ``engine.gpus`` selects (``gpu.select``) and
passes them here; the answer is a list of :class:`ReplicaSpec`, each with the engine
config that replica runs (its own port, ``gpus`` = its GPUs by UUID, so that
``CUDA_VISIBLE_DEVICES`` pins it, and the tensor/data-parallel flags), its CPU list and
its URL. One :class:`~chandrad.engine.supervisor.EngineSupervisor` is made per spec.

* ``engine.url`` (one or a list): one remote engine per URL, never spawned.
* ``layout = "replicas"`` (default): GPUs in groups of ``tensor_parallel_size``, one
  engine per group (``replicas`` caps the count); without GPUs, ``replicas`` engines
  (default: one per ``cpu_affinity`` entry, else 1), replica i pinned to CPU list i.
* ``layout = "data_parallel"``: one engine over every selected GPU with
  ``--data-parallel-size`` = groups (one process tree, one failure domain).

A single engine on a host without GPUs keeps the configured engine exactly, so the
single-engine daemon of before (its port, its learned profiles) is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from chandrad.config import EngineConfig
from chandrad.errors import ConfigError, ConfigProblem


@dataclass(frozen=True)
class GpuSlot:
    """One GPU as NVML reports it (only what placing engines needs)."""

    index: int
    uuid: str
    memory_total: int  #: bytes


@dataclass(frozen=True)
class ReplicaSpec:
    """One engine to supervise (or, with ``engine.url``, to watch)."""

    id: str  #: "0", "1", … (the ``engine`` label of metrics and journal entries)
    engine: EngineConfig  #: the config this engine runs with (port, gpus, flags)
    gpus: tuple[str, ...] = ()  #: its GPUs' UUIDs (``CUDA_VISIBLE_DEVICES``)
    cpus: str = ""  #: its CPU list (taskset), "" = not pinned

    @property
    def url(self) -> str:
        return self.engine.base_url

    @property
    def supervised(self) -> bool:
        return self.engine.supervised


def _problem(key: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(f"engine.{key}", message, code="config_range")])


def _parallel_args(engine: EngineConfig, tp: int, dp: int) -> tuple[str, ...]:
    extra = list(engine.extra_args)
    if tp > 1:
        extra += ["--tensor-parallel-size", str(tp)]
    if dp > 1:
        extra += ["--data-parallel-size", str(dp)]
    return tuple(extra)


def plan_replicas(engine: EngineConfig, gpus: Sequence[GpuSlot]) -> list[ReplicaSpec]:
    """The engines to run for ``engine`` on a host whose selected GPUs are ``gpus``.

    Raises:
        ConfigError: the config asks for more than the GPUs allow (the key named).
    """
    if engine.urls:
        return [ReplicaSpec(str(i), replace(engine, url=url, urls=(url,)))
                for i, url in enumerate(engine.urls)]
    tp = engine.tensor_parallel_size
    ordered = sorted(gpus, key=lambda g: g.index)
    if ordered and len(ordered) < tp:
        raise _problem("tensor_parallel_size", f"tensor_parallel_size = {tp} needs {tp} GPUs; "
                       f"engine.gpus selects {len(ordered)}")
    groups = [tuple(g.uuid for g in ordered[i:i + tp])
              for i in range(0, len(ordered) - tp + 1, tp)] if ordered else []
    if engine.layout == "data_parallel":
        dp = len(groups) if groups else max(engine.replicas, 1)
        if engine.replicas and groups and engine.replicas > len(groups):
            raise _problem("replicas", f"data_parallel over {engine.replicas} ranks needs "
                           f"{engine.replicas * tp} GPUs; engine.gpus selects {len(ordered)}")
        if engine.replicas:
            dp = engine.replicas
        uuids = tuple(u for group in groups[:dp] for u in group)
        one = replace(engine, extra_args=_parallel_args(engine, tp, dp),
                      gpus=",".join(uuids) if uuids else engine.gpus)
        return [ReplicaSpec("0", one, uuids)]
    count = engine.replicas or len(groups) or len(engine.cpu_affinity) or 1
    if groups and count > len(groups):
        raise _problem("replicas", f"{count} replicas of {tp} GPU(s) each need {count * tp} "
                       f"GPUs; engine.gpus selects {len(ordered)}")
    if engine.cpu_affinity and count > len(engine.cpu_affinity):
        raise _problem("cpu_affinity", f"{len(engine.cpu_affinity)} CPU list(s) for "
                       f"{count} replicas: give one per replica")
    if count == 1 and not groups and not engine.cpu_affinity and tp == 1:
        return [ReplicaSpec("0", engine)]
    specs = []
    for i in range(count):
        uuids = groups[i] if groups else ()
        cpus = engine.cpu_affinity[i].replace(" ", "") if engine.cpu_affinity else ""
        specs.append(ReplicaSpec(
            str(i),
            replace(engine, port=engine.port + i, replicas=1,
                    gpus=",".join(uuids) if uuids else engine.gpus,
                    extra_args=_parallel_args(engine, tp, 1)),
            uuids, cpus))
    return specs
