"""Tests for chandrad.gpu (NVML telemetry).

On this machine NVML is real and has no driver: the module must degrade to "no GPU"
with NVML's own error text. The GPU paths run against a stand-in ``pynvml`` module
(the protocol boundary: the same functions nvidia-ml-py exports), fed with figures
read from a real H200 (tests/fixtures/classify/h200_nvml_probe.txt), in a
subprocess so that the real module is never shadowed in this interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from chandrad import gpu

REPO = Path(__file__).resolve().parent.parent


def _real_nvml_error() -> str | None:
    """NVML's own error text on this machine, or None when NVML initialises."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return str(exc)
    pynvml.nvmlShutdown()
    return None


def test_no_driver_degrades_to_no_gpu() -> None:
    """Without a driver: [] GPUs, available False with NVML's error text, and no exception."""
    error = _real_nvml_error()
    if error is None:
        pytest.skip("this machine has a working NVML")
    assert gpu.read_gpus() == []
    summary = gpu.gpu_summary()
    assert summary["available"] is False
    assert summary["error"] == error
    assert summary["gpus"] == []
    json.dumps(summary)
    assert gpu.total_memory_gib() is None
    assert gpu.pids_holding_memory({os.getpid(), 1}) == {}


def test_import_does_not_touch_nvml() -> None:
    """Importing chandrad.gpu neither imports pynvml nor initialises NVML."""
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, chandrad.gpu; print('pynvml' in sys.modules)"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    assert proc.stdout.strip() == "False"


# Figures from the H200 probe: 8 GiB held by one process (pid 634).
FAKE_NVML = textwrap.dedent(
    """
    class NVMLError(Exception):
        pass

    class NVMLError_FunctionNotFound(NVMLError):
        pass

    nvmlMemory_v2 = 0x02000028
    CALLS = []
    MODE = {mode!r}
    _initialised = [False]

    class _Mem:
        def __init__(self, total, used, free):
            self.total, self.used, self.free = total, used, free

    class _Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used

    DEVICES = [
        ("GPU-62d09d35-0863-b71c-9334-59c9d0cdfd98", "NVIDIA H200", 150754820096,
         9142337536, 140967542784, [(634, 9133096960)], [(634, 2 * 2**20)]),
        ("GPU-00000000-0000-0000-0000-000000000002", "NVIDIA H200", 100 * 2**30,
         0, 100 * 2**30, [(777, None), (778, 2**64 - 1)], []),
    ]

    def nvmlInit():
        if MODE == "no_driver":
            raise NVMLError("Driver Not Loaded")
        _initialised[0] = True
        CALLS.append("init")

    def nvmlShutdown():
        _initialised[0] = False
        CALLS.append("shutdown")

    def _check():
        if not _initialised[0]:
            raise NVMLError("Uninitialized")

    def nvmlSystemGetDriverVersion():
        _check()
        return "580.159.04"

    def nvmlDeviceGetCount():
        _check()
        return len(DEVICES)

    def nvmlDeviceGetHandleByIndex(i):
        _check()
        return ("index", i)

    def nvmlDeviceGetUUID(handle):
        return DEVICES[handle[1]][0]

    def nvmlDeviceGetHandleByUUID(uuid):
        _check()
        CALLS.append("by_uuid")
        return ("uuid", [d[0] for d in DEVICES].index(uuid))

    def nvmlDeviceGetName(handle):
        return DEVICES[handle[1]][1].encode()

    def nvmlDeviceGetMemoryInfo(handle, version=None):
        d = DEVICES[handle[1]]
        if version is not None:
            if MODE == "v1_only":
                raise NVMLError_FunctionNotFound("Function Not Found")
            return _Mem(d[2], d[3], d[4])
        # v1 "used" includes the driver's reserve
        return _Mem(d[2], d[3] + 644939776, d[4])

    def nvmlDeviceGetComputeRunningProcesses(handle):
        return [_Proc(p, u) for p, u in DEVICES[handle[1]][5]]

    def nvmlDeviceGetGraphicsRunningProcesses(handle):
        if MODE == "v1_only":
            raise NVMLError("Not Supported")
        return [_Proc(p, u) for p, u in DEVICES[handle[1]][6]]
    """
)

PROBE = textwrap.dedent(
    """
    import json, pynvml
    from chandrad import gpu
    out = {
        "gpus": [
            {"index": g.index, "uuid": g.uuid, "name": g.name, "total": g.memory_total,
             "used": g.memory_used, "free": g.memory_free,
             "procs": [[p.pid, p.used_bytes] for p in g.processes]}
            for g in gpu.read_gpus()
        ],
        "summary": gpu.gpu_summary(),
        "held": gpu.pids_holding_memory({634, 777, 999}),
        "total_all": gpu.total_memory_gib(),
        "total_first": gpu.total_memory_gib(["GPU-62d09d35-0863-b71c-9334-59c9d0cdfd98"]),
        "total_by_index": gpu.total_memory_gib(["1"]),
        "calls": pynvml.CALLS,
    }
    print(json.dumps(out))
    """
)


def _run_with_fake(tmp_path: Path, mode: str) -> dict[str, Any]:
    (tmp_path / "pynvml.py").write_text(FAKE_NVML.format(mode=mode))
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
        check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_reads_memory_and_processes_by_uuid(tmp_path: Path) -> None:
    """v2 memory, compute+graphics processes summed per pid, devices addressed by UUID."""
    r = _run_with_fake(tmp_path, "normal")
    first, second = r["gpus"]
    assert first["uuid"] == "GPU-62d09d35-0863-b71c-9334-59c9d0cdfd98"
    assert first["name"] == "NVIDIA H200"
    assert (first["total"], first["used"], first["free"]) == (
        150754820096,
        9142337536,
        140967542784,
    )
    assert first["procs"] == [[634, 9133096960 + 2 * 2**20]]
    assert second["procs"] == [[777, None], [778, None]]  # N/A stays None, never a huge number
    inits = r["calls"].count("init")
    assert inits == r["calls"].count("shutdown") >= 1  # every read opens and closes NVML
    assert r["calls"].count("by_uuid") == 2 * inits


def test_summary_and_helpers_with_gpus(tmp_path: Path) -> None:
    """gpu_summary is JSON with available True; held pids and smallest selected GPU size."""
    r = _run_with_fake(tmp_path, "normal")
    s = r["summary"]
    assert s["available"] is True and s["error"] == "" and s["driver"] == "580.159.04"
    assert s["gpus"][0]["memory_total_gib"] == pytest.approx(140.4, abs=0.01)
    assert s["gpus"][0]["processes"][0]["pid"] == 634
    assert r["held"] == {"634": 9133096960 + 2 * 2**20, "777": 0}
    assert r["total_all"] == pytest.approx(100.0)
    assert r["total_first"] == pytest.approx(140.401, abs=1e-3)
    assert r["total_by_index"] == pytest.approx(100.0)


def test_v1_memory_fallback(tmp_path: Path) -> None:
    """Where the v2 memory query is missing, v1 is used (its 'used' includes the reserve)."""
    r = _run_with_fake(tmp_path, "v1_only")
    assert r["gpus"][0]["used"] == 9142337536 + 644939776
    assert r["gpus"][0]["procs"] == [[634, 9133096960]]


def test_driver_not_loaded(tmp_path: Path) -> None:
    """An NVML init failure is 'no GPU' with NVML's message, never an exception."""
    r = _run_with_fake(tmp_path, "no_driver")
    assert r["gpus"] == []
    assert r["summary"]["available"] is False
    assert r["summary"]["error"] == "Driver Not Loaded"
    assert r["held"] == {}
    assert r["total_all"] is None
