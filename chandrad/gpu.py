"""GPU telemetry through NVML (``nvidia-ml-py``, module ``pynvml``).

Owns every NVML call chandrad makes: per-GPU memory (v2 memory info, v1 fallback),
which processes hold memory, and the summaries ``chandractl gpu``/``status`` show.
Nothing here raises for a missing driver or library: that is "no GPU" (``[]`` /
``available: False`` with NVML's own error text). NVML is initialised per call and
shut down afterwards, never at import time.
"""

from __future__ import annotations

import types
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from chandrad.errors import NvmlUnavailable
from chandrad.protocol import GpuReply

GIB = 2**30


@dataclass(frozen=True)
class GpuProcess:
    """One process holding GPU memory; ``used_bytes`` is None where NVML cannot tell."""

    pid: int
    used_bytes: int | None
    name: str = ""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it (memory in bytes; ``memory_used`` excludes driver reserve)."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    processes: list[GpuProcess] = field(default_factory=list)


def _import_nvml() -> types.ModuleType:
    try:
        import pynvml
    except ImportError as exc:  # no nvidia-ml-py: same as "library not found"
        raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from exc
    module: types.ModuleType = pynvml
    return module


@contextmanager
def _nvml() -> Iterator[types.ModuleType]:
    nv = _import_nvml()
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise NvmlUnavailable(str(exc)) from exc
    try:
        yield nv
    finally:
        try:
            nv.nvmlShutdown()
        except nv.NVMLError:
            pass


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _memory(nv: types.ModuleType, handle: Any) -> tuple[int, int, int]:
    """(total, used, free) in bytes; v2 ``used`` leaves out the driver's reserve."""
    try:
        m = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
    except (nv.NVMLError, AttributeError, TypeError):
        m = nv.nvmlDeviceGetMemoryInfo(handle)
    return int(m.total), int(m.used), int(m.free)


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _processes(nv: types.ModuleType, handle: Any) -> list[GpuProcess]:
    used: dict[int, int | None] = {}
    for query in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        try:
            procs = getattr(nv, query)(handle)
        except nv.NVMLError:
            continue
        for p in procs:
            amount = p.usedGpuMemory
            if amount is not None and amount >= 2**63:  # NVML_VALUE_NOT_AVAILABLE
                amount = None
            prev = used.get(int(p.pid))
            used[int(p.pid)] = amount if prev is None else prev + (amount or 0)
    return [GpuProcess(pid, amount, _process_name(pid)) for pid, amount in sorted(used.items())]


def _read(nv: types.ModuleType) -> list[GpuInfo]:
    out = []
    for index in range(nv.nvmlDeviceGetCount()):
        # Enumerate by index once, then address the device by UUID (stable across
        # CUDA_VISIBLE_DEVICES and PCI reordering).
        uuid = _text(nv.nvmlDeviceGetUUID(nv.nvmlDeviceGetHandleByIndex(index)))
        handle = nv.nvmlDeviceGetHandleByUUID(uuid)
        total, used, free = _memory(nv, handle)
        out.append(
            GpuInfo(
                index=index,
                uuid=uuid,
                name=_text(nv.nvmlDeviceGetName(handle)),
                memory_total=total,
                memory_used=used,
                memory_free=free,
                processes=_processes(nv, handle),
            )
        )
    return out


def _read_or_error() -> tuple[list[GpuInfo], str, str]:
    """(gpus, driver version, error text)."""
    try:
        with _nvml() as nv:
            driver = _text(nv.nvmlSystemGetDriverVersion())
            return _read(nv), driver, ""
    except NvmlUnavailable as exc:
        return [], "", str(exc)
    except Exception as exc:  # NVMLError mid-read (GPU lost, ...): report, never raise
        return [], "", f"{type(exc).__name__}: {exc}"


def read_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees; ``[]`` when there is no driver, library or device."""
    return _read_or_error()[0]


def gpu_summary() -> GpuReply:
    """JSON-able view for ``chandractl gpu`` and ``status``."""
    gpus, driver, error = _read_or_error()
    return {
        "v": 1,
        "available": bool(gpus),
        "error": error or ("" if gpus else "NVML found no GPU"),
        "driver": driver,
        "gpus": [
            {
                "index": g.index, "uuid": g.uuid, "name": g.name,
                "memory_total": g.memory_total, "memory_used": g.memory_used,
                "memory_free": g.memory_free,
                "memory_total_gib": round(g.memory_total / GIB, 2),
                "memory_used_gib": round(g.memory_used / GIB, 2),
                "memory_free_gib": round(g.memory_free / GIB, 2),
                "processes": [{"pid": p.pid, "used_bytes": p.used_bytes, "name": p.name}
                              for p in g.processes],
            }
            for g in gpus
        ],
    }


def pids_holding_memory(pids: set[int]) -> dict[int, int]:
    """Of ``pids``, those NVML shows holding GPU memory: pid → bytes (0 where N/A).

    Used before an engine restart: the old processes must hold nothing.
    """
    held: dict[int, int] = {}
    for gpu in read_gpus():
        for p in gpu.processes:
            if p.pid in pids:
                held[p.pid] = held.get(p.pid, 0) + (p.used_bytes or 0)
    return held


def select(gpus: Sequence[GpuInfo], selector: str) -> list[GpuInfo]:
    """The GPUs ``engine.gpus`` selects: ``"all"``, or indices/UUIDs separated by commas.

    The one place that reads the selector for sizing: ``run`` (through the daemon's
    probe) and ``check-config`` (real or previewed GPUs) both come here.
    """
    if selector.strip().lower() == "all":
        return list(gpus)
    wanted = {part.strip() for part in selector.split(",") if part.strip()}
    return [g for g in gpus if g.uuid in wanted or str(g.index) in wanted]


def sizing_gpu(gpus: Sequence[GpuInfo], selector: str) -> GpuInfo | None:
    """The GPU ``"auto"`` sizes from: the smallest selected one; ``None`` without one."""
    chosen = select(gpus, selector)
    return min(chosen, key=lambda g: g.memory_total) if chosen else None


def preview_gpus(total_bytes: int, count: int = 1) -> list[GpuInfo]:
    """``count`` idle GPUs of ``total_bytes`` each, for ``check-config --gpu-memory``."""
    return [GpuInfo(index=i, uuid=f"GPU-preview-{i}", name="previewed GPU",
                    memory_total=total_bytes, memory_used=0, memory_free=total_bytes)
            for i in range(count)]


def total_memory_gib(uuids_or_indices: list[str] | None = None) -> float | None:
    """Total memory of the smallest selected GPU in GiB; ``None`` without a GPU.

    ``uuids_or_indices`` selects GPUs by UUID or index string (``engine.gpus``);
    ``None`` or empty means all of them.
    """
    chosen = sizing_gpu(read_gpus(), ",".join(uuids_or_indices) if uuids_or_indices else "all")
    return None if chosen is None else round(chosen.memory_total / GIB, 3)
