"""The supervisor's policy, unit-tested without processes: the restart budget and backoff
(engine/budget.py), the profile policy (engine/policy.py: ladder memory, upshift probe,
revert and pin), and the verdict on a kill without a kernel OOM kill (engine/generation.py).

The pure parts are checked directly; the rest on the real supervisor driving the
stand-in engine *process* (tests/standin_engine.py), which fails with vLLM's real
messages or serves /health on its port: a second each, no vLLM.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from standin_engine import write_standin
from test_supervision import GpuStandIn, engine_config, spawns, supervise
from waiting import wait_until_async as wait_for

from chandrad.config import DownshiftConfig, OcrConfig
from chandrad.engine.budget import RestartBudget
from chandrad.engine.classify import Diagnosis, FailureClass
from chandrad.engine.policy import ProfilePolicy
from chandrad.engine.profile import MemoryProfile
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.states import EngineState

OCR = OcrConfig()


def _kv_failure() -> Diagnosis:
    return Diagnosis(cls=FailureClass.KV_CACHE_INSUFFICIENT, evidence="No available memory "
                     "for the cache blocks", numbers={}, action="", restartable=True)


# ------------------------------------------------------------------ pure


def test_budget_backoff_doubles_to_its_cap_and_the_window_forgets() -> None:
    budget = RestartBudget(DownshiftConfig(backoff_initial=1.0, backoff_max=5.0,
                                           max_restarts=3, window=100.0))
    delays = []
    for t in (0.0, 1.0, 2.0):
        assert budget.charge(t) == ""
        delays.append(budget.next_backoff())
    assert delays == [1.0, 2.0, 4.0]
    assert "4 failures within 100s (max_restarts=3)" in budget.charge(3.0)
    # 200 s later the old failures have left the window: one failure, the first delay.
    assert budget.charge(203.0) == ""
    assert budget.next_backoff() == 1.0
    assert budget.restarts == 4
    budget.clear()
    assert budget.failures_in_window == 0 and budget.restarts == 4


def test_policy_upshift_probe_reverts_and_pins_or_is_kept() -> None:
    configured = MemoryProfile(gpu_memory_utilization=0.9)
    down = MemoryProfile(gpu_memory_utilization=0.86)
    ds = DownshiftConfig(upshift_after=10.0)
    policy = ProfilePolicy(configured, ds)
    policy.adopt_learned(down)
    assert (policy.source, policy.steps_down) == ("learned", [configured])
    assert not policy.wants_upshift(9.0, backlog=True)
    assert not policy.wants_upshift(11.0, backlog=False)
    assert policy.wants_upshift(11.0, backlog=True)
    change = policy.begin_upshift()
    assert change is not None and change.changes == {"gpu_memory_utilization": (0.86, 0.9)}
    assert policy.profile == configured and policy.source == "upshift"
    outcome = policy.after_failure(_kv_failure(), max_pixels=1, max_output_tokens=1, gpu=None)
    assert outcome.change is not None and "reverted and pinned" in outcome.change.reason
    assert policy.profile == down and policy.upshift_pinned
    assert not policy.wants_upshift(1e9, backlog=True)

    kept = ProfilePolicy(configured, ds)
    kept.adopt_learned(down)
    kept.begin_upshift()
    assert kept.stable() is True and kept.profile == configured
    assert kept.stable() is False


# ------------------------------------------------------------------ on the stand-in process


def test_restart_budget_spent_goes_fatal_after_growing_backoffs(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """A failure the ladder may not change (downshift disabled): the same profile is
    restarted max_restarts times, each after a longer backoff, then fatal."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"kv_needs_eager": True})
    cfg = engine_config(python, free_port())
    cfg = replace(cfg, downshift=DownshiftConfig(enabled=False, backoff_initial=0.2,
                                                 backoff_max=0.8, max_restarts=3))
    sup = EngineSupervisor(cfg, OCR, gpu=GpuStandIn())

    async def body(sup: EngineSupervisor) -> None:
        await wait_for(lambda: sup.state is EngineState.FATAL, 60, "fatal")

    supervise(sup, body)
    starts = [s["t"] for s in spawns(folder)]
    assert len(starts) == 4, starts
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    # Each spawn waited at least its backoff: 0.2, 0.4, 0.8 s (lower bounds only: a busy
    # machine adds time; the exact delays are checked on the budget itself above).
    assert all(g >= d for g, d in zip(gaps, (0.2, 0.4, 0.8), strict=True)), gaps
    assert "4 failures within" in sup.fatal_reason and "max_restarts=3" in sup.fatal_reason
    assert sup.restarts == 3
    assert sup.profile == sup.configured_profile and sup.profile_changes == []


def test_kill_without_kernel_oom_restarts_same_profile(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """kill -9 of a ready engine with no OOM kill recorded by the kernel is `killed`
    (other_fatal): restarted with the same profile, no downshift, one restart."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {})
    sup = EngineSupervisor(engine_config(python, free_port()), OCR, gpu=GpuStandIn())

    async def body(sup: EngineSupervisor) -> None:
        await wait_for(lambda: sup.state is EngineState.READY, 30, "ready")
        first = sup.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: sup.state is EngineState.READY and sup.pid != first, 30,
                       "ready again")

    supervise(sup, body)
    assert sup.last_failure is not None
    assert (str(sup.last_failure.cls), sup.last_failure.subclass) == ("other_fatal", "killed")
    # The stand-in prints nothing when killed: the evidence is the exit status itself.
    assert sup.last_failure.evidence == "killed by SIGKILL (the kernel recorded no OOM kill)"
    assert sup.restarts == 1 and sup.profile_changes == []
    assert len(spawns(folder)) == 2


def test_failed_upshift_probe_reverts_and_pins(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """0.9 does not fit (89 % free) → 0.86, ready, stable; with a backlog the probe goes
    back up to 0.9, fails again, reverts to 0.86 and stays pinned there."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"free_fraction": 0.89})
    cfg = engine_config(python, free_port())
    cfg = replace(cfg, memory=replace(cfg.memory, gpu_memory_utilization=0.9),
                  downshift=replace(cfg.downshift, upshift_after=0.5))
    gpu = GpuStandIn(total_gib=79.19, free_gib=70.48, name="NVIDIA H100 80GB HBM3", count=1)
    sup = EngineSupervisor(cfg, OCR, gpu=gpu, backlog=lambda: True)

    async def body(sup: EngineSupervisor) -> None:
        await wait_for(lambda: sup.upshift_pinned and sup.state is EngineState.READY, 60,
                       "pinned and ready")

    supervise(sup, body)
    assert [s["util"] for s in spawns(folder)] == [0.9, 0.86, 0.9, 0.86]
    assert [c.failure for c in sup.profile_changes] == [
        "gpu_memory_utilization_too_high", "upshift", "gpu_memory_utilization_too_high"]
    assert sup.profile.gpu_memory_utilization == 0.86
