"""What NVML showed while chandrad ran on one and on two real H200s (tests/fixtures/gpu/).

The captures come from the device machine (``tests/fixtures/gpu/capture_gpu_run.py``): the
real daemon supervising the GPU stand-in engine, which held real CUDA memory and ran out of
it on demand. These tests read them as an operator would: which pid holds memory on which
GPU, and whether it is the engine's; that an OOM was classified, downshifted and restarted
with no process of the old engine left holding memory; that nothing holds memory after the
stop. NVML's own answers are also replayed into ``chandrad.gpu`` through a stand-in
``pynvml`` (the protocol boundary, as in test_gpu.py): the mapping must give what
``chandractl gpu`` printed on the device.
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from chandrad.engine.classify import FailureClass, classify

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures" / "gpu"
ONE_GPU = json.loads((FIXTURES / "h200_1gpu_capture.json").read_text())
TWO_GPU = json.loads((FIXTURES / "h200_2gpu_capture.json").read_text())
MIB = 1 << 20


def _apps(capture: dict[str, Any]) -> list[dict[str, str]]:
    """``nvidia-smi --query-compute-apps`` CSV → rows (pid, process_name, memory, gpu_uuid)."""
    rows = list(csv.reader(io.StringIO(capture["nvidia_smi_compute_apps"].strip()),
                           skipinitialspace=True))
    header = [h.split(" [")[0] for h in rows[0]]
    return [dict(zip(header, row, strict=True)) for row in rows[1:] if row]


def _gpus(capture: dict[str, Any]) -> dict[str, int]:
    """``nvidia-smi --query-gpu`` CSV → uuid → memory.total in MiB."""
    rows = list(csv.reader(io.StringIO(capture["nvidia_smi_gpus"].strip()),
                           skipinitialspace=True))
    return {row[1]: int(row[3].split()[0]) for row in rows[1:] if row}


def _by_label(record: dict[str, Any], label: str) -> list[dict[str, Any]]:
    return [c for c in record["captures"] if c["label"] == label]


def _engine_tree(capture: dict[str, Any]) -> set[int]:
    return {p["pid"] for tree in capture["engine_processes"] for p in tree if "comm" in p}


def test_the_engine_core_holds_the_memory_budget_on_its_gpu() -> None:
    """Ready: one process holds memory, it is the engine's core (a child of the pid chandrad
    supervises), on the one GPU, about gpu_memory_utilization x total (plus its context)."""
    for label in ("ready", "ready_after_oom"):
        [capture] = _by_label(ONE_GPU, label)
        [app] = _apps(capture)
        leader = capture["engine"]["pid"]
        tree = capture["engine_processes"][0]
        core = next(p for p in tree if p.get("ppid") == leader)
        assert int(app["pid"]) == core["pid"] and core["comm"] == "VLLM::EngineCor"
        assert app["gpu_uuid"] in _gpus(capture)
        # vLLM (and the stand-in) size from what CUDA calls total: NVML's total less the
        # driver's reserve (memory v2), 143155 of nvidia-smi's 143771 MiB on an H200.
        [device] = capture["nvml"]
        total = (device["memory_v2"][0] - device["memory_v2"][3]) // MIB
        util = capture["engine"]["profile"]["gpu_memory_utilization"]
        used = int(app["used_gpu_memory"].split()[0])
        assert util * total <= used <= util * total + 512, (label, used, total)
        # chandrad.gpu on the device saw the same pid, bytes and name.
        [gpu] = capture["chandractl_gpu"]["gpus"]
        assert gpu["uuid"] == app["gpu_uuid"]
        [proc] = gpu["processes"]
        assert (proc["pid"], proc["name"]) == (core["pid"], "VLLM::EngineCor")
        assert proc["used_bytes"] // MIB == used


def test_oom_was_classified_downshifted_and_restarted_on_fresh_memory() -> None:
    [ready] = _by_label(ONE_GPU, "ready")
    [after] = _by_label(ONE_GPU, "ready_after_oom")
    before_pids, after_pids = _engine_tree(ready), _engine_tree(after)
    assert not before_pids & after_pids  # a new engine, not the old one
    failure = after["engine"]["last_failure"]
    assert failure["class"] == "cuda_oom_runtime"
    assert "torch.OutOfMemoryError: CUDA out of memory" in failure["evidence"]
    assert after["engine"]["restarts"] == 1
    old, new = ready["engine"]["profile"], after["engine"]["profile"]
    assert (old["max_num_seqs"], new["max_num_seqs"]) == (64, 32)
    assert new["max_num_batched_tokens"] < old["max_num_batched_tokens"]
    # Between the death and the new engine's load, NVML shows nobody holding memory: no
    # process of the old engine outlived it.
    for capture in _by_label(ONE_GPU, "during_oom"):
        assert not {int(a["pid"]) for a in _apps(capture)} & before_pids
        held = {p[0] for d in capture["nvml"] for p in d["compute"]}
        assert held <= _engine_tree(capture) and not held & before_pids
    assert ONE_GPU["pages_done"] == 12  # pages before and after the OOM all done


def test_the_captured_oom_text_is_classified_as_vllm_output() -> None:
    """The engine lines chandrad relayed, classified again from the log: a runtime OOM when
    the engine had been ready; a device OOM of some kind on the bare paste."""
    lines = [json.loads(line) for line in
             (FIXTURES / "h200_1gpu_daemon.log").read_text().splitlines()
             if line.startswith("{")]
    first_engine = [e["line"] for e in lines if e.get("event") == "engine_line"]
    died = next(i for i, line in enumerate(first_engine) if "EngineDeadError" in line)
    excerpt = first_engine[:died + 1]
    assert classify(excerpt, exit_code=1, was_ready=True).cls is FailureClass.CUDA_OOM_RUNTIME
    pasted = classify(excerpt, exit_code=1)
    assert pasted.cls in (FailureClass.CUDA_OOM_RUNTIME, FailureClass.CUDA_OOM_LOAD)
    assert pasted.numbers["requested_gib"] == pytest.approx(21.76, abs=0.01)


def test_nothing_holds_gpu_memory_after_the_stop() -> None:
    [stopped] = _by_label(ONE_GPU, "after_stop")
    assert ONE_GPU["daemon_exit"] == 0
    assert _apps(stopped) == []
    assert all(d["compute"] == [] and d["memory_v2"][1] == 0 for d in stopped["nvml"])
    assert all(g["processes"] == [] and g["memory_used"] == 0
               for g in stopped["pynvml"]["gpus"])


#: A stand-in ``pynvml`` that answers with what NVML answered on the device (one capture).
REPLAY = textwrap.dedent(
    """
    import json, os
    class NVMLError(Exception):
        pass
    nvmlMemory_v2 = 0x02000028
    DEVICES = json.loads(os.environ["NVML_REPLAY"])
    class _Mem:
        def __init__(self, values):
            self.total, self.used, self.free = values[:3]
    class _Proc:
        def __init__(self, pid, used):
            self.pid, self.usedGpuMemory = pid, used
    def nvmlInit(): pass
    def nvmlShutdown(): pass
    def nvmlSystemGetDriverVersion(): return "580.159.04"
    def nvmlDeviceGetCount(): return len(DEVICES)
    def nvmlDeviceGetHandleByIndex(i): return i
    def nvmlDeviceGetUUID(h): return DEVICES[h]["uuid"]
    def nvmlDeviceGetHandleByUUID(uuid): return [d["uuid"] for d in DEVICES].index(uuid)
    def nvmlDeviceGetName(h): return DEVICES[h]["name"]
    def nvmlDeviceGetMemoryInfo(h, version=None):
        d = DEVICES[h]
        return _Mem(d["memory_v2"] if version is not None else d["memory_v1"])
    def nvmlDeviceGetComputeRunningProcesses(h):
        return [_Proc(*p) for p in DEVICES[h]["compute"]]
    def nvmlDeviceGetGraphicsRunningProcesses(h):
        return [_Proc(*p) for p in DEVICES[h]["graphics"]]
    """
)


@pytest.mark.parametrize(("gpus", "label"), [(1, "ready"), (1, "ready_after_oom"),
                                             (2, "ready"), (2, "ready_after_oom")])
def test_chandrad_gpu_maps_nvml_as_on_the_device(tmp_path: Path, gpus: int, label: str) -> None:
    record = json.loads((FIXTURES / f"h200_{gpus}gpu_capture.json").read_text())
    [capture] = _by_label(record, label)
    (tmp_path / "pynvml.py").write_text(REPLAY)
    env = {**os.environ, "NVML_REPLAY": json.dumps(capture["nvml"]),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{HERE.parent}"}
    out = subprocess.run(
        [sys.executable, "-c", "import json; from chandrad import gpu; "
         "print(json.dumps(gpu.gpu_summary()))"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=True)
    here = json.loads(out.stdout)
    there = capture["chandractl_gpu"]
    for summary in (here, there):  # process names come from /proc of the machine that ran
        for g in summary["gpus"]:
            for p in g["processes"]:
                p.pop("name")
    assert here["gpus"] == there["gpus"]


# ------------------------------------------------------------------ two H200s, two replicas


def _holders(capture: dict[str, Any]) -> dict[str, set[int]]:
    """GPU uuid → pids holding memory on it, as NVML answered."""
    return {d["uuid"]: {p[0] for p in d["compute"]} for d in capture["nvml"]}


def _replica_trees(capture: dict[str, Any]) -> dict[str, set[int]]:
    """replica id → the pids of its process tree."""
    return {e["id"]: {p["pid"] for p in tree if "comm" in p}
            for e, tree in zip(capture["engines"], capture["engine_processes"], strict=True)}


def test_each_replica_holds_memory_on_its_own_card_only() -> None:
    """Both ready, and again after the OOM: each replica's processes see exactly its card
    (CUDA_VISIBLE_DEVICES = its GPU's UUID), NVML shows its core on that card and on no
    other, and chandractl gpu names the same card for it."""
    for label in ("ready", "ready_after_oom"):
        [capture] = _by_label(TWO_GPU, label)
        holders = _holders(capture)
        assert len(holders) == 2
        trees = _replica_trees(capture)
        gpu_of = {e["id"]: e["gpus"] for e in capture["chandractl_gpu"]["engines"]}
        for engine, tree in zip(capture["engines"], capture["engine_processes"], strict=True):
            [uuid] = engine["gpus"]
            assert gpu_of[engine["id"]] == [uuid]
            assert {p["CUDA_VISIBLE_DEVICES"] for p in tree if "comm" in p} == {uuid}
            on = {u for u, pids in holders.items() if pids & trees[engine["id"]]}
            assert on == {uuid}, (label, engine["id"], holders)
        assert {u for e in capture["engines"] for u in e["gpus"]} == set(holders)


def test_an_oom_on_replica_0_leaves_replica_1_serving_untouched() -> None:
    [ready] = _by_label(TWO_GPU, "ready")
    [after] = _by_label(TWO_GPU, "ready_after_oom")
    during = _by_label(TWO_GPU, "during_oom")
    r0, r1 = ready["engines"]
    uuid1 = r1["gpus"][0]
    [[core1, _]] = next(d["compute"] for d in ready["nvml"] if d["uuid"] == uuid1)
    # From the OOM request to replica 0 serving again: replica 1's pid, profile and NVML
    # entry (its core's pid and bytes) never change. (Its bytes grew by cuBLAS's workspace
    # at its first page, before the OOM: tests/fixtures/gpu/README.md.)
    window = [*during, after]
    held1 = next(d["compute"] for d in window[0]["nvml"] if d["uuid"] == uuid1)
    assert [pid for pid, _ in held1] == [core1]
    for capture in window:
        one = capture["engines"][1]
        assert (one["pid"], one["restarts"], one["last_failure"]) == (r1["pid"], 0, None)
        assert one["profile"] == r1["profile"]
        assert next(d["compute"] for d in capture["nvml"] if d["uuid"] == uuid1) == held1
    # Replica 0 alone: classified, downshifted, restarted (a new process tree).
    a0 = after["engines"][0]
    assert a0["pid"] != r0["pid"] and a0["restarts"] == 1
    assert a0["last_failure"]["class"] == "cuda_oom_runtime"
    assert "torch.OutOfMemoryError" in a0["last_failure"]["evidence"]
    assert (r0["profile"]["max_num_seqs"], a0["profile"]["max_num_seqs"]) == (64, 32)
    assert not _replica_trees(ready)["0"] & _replica_trees(after)["0"]
    # Pages kept flowing to replica 1 while replica 0 was down; replica 0 answered none.
    down = [c for c in during if c["engines"][0]["state"] != "ready"]
    assert down[-1]["engines"][1]["answered"] > down[0]["engines"][1]["answered"]
    assert down[-1]["engines"][0]["answered"] == down[0]["engines"][0]["answered"]
    assert down[-1]["pages_done"] == TWO_GPU["pages_done"] == 16


def test_nothing_of_either_replica_holds_memory_after_the_stop() -> None:
    [stopped] = _by_label(TWO_GPU, "after_stop")
    assert TWO_GPU["daemon_exit"] == 0 and _apps(stopped) == []
    assert len(stopped["nvml"]) == 2
    assert all(d["compute"] == [] and d["memory_v2"][1] == 0 for d in stopped["nvml"])
