"""Test harness for the control socket: a recording DaemonControl and a server thread.

``RecordingDaemon`` stands in for ``daemon.Daemon`` at the ``interfaces.DaemonControl``
boundary (records calls, keeps a small job table, honours pause/resume/retry/cancel
rules, and can be made slow). ``ServerThread`` runs a real ``ControlServer`` on a real
Unix socket in its own event loop, so tests can drive it from subprocesses.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from chandrad.control.handlers import Handlers
from chandrad.control.server import ControlServer
from chandrad.errors import ControlError
from chandrad.protocol import GpuStatus


class RecordingDaemon:
    """A small in-memory daemon implementing ``interfaces.DaemonControl``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.state = "running"
        self.started = time.monotonic()
        self.jobs: dict[int, dict[str, Any]] = {
            1: {"id": 1, "path": "in/a.pdf", "state": "done", "pages_done": 3, "pages_total": 3,
                "attempts": 1, "error_code": None, "error_message": None},
            2: {"id": 2, "path": "in/b.pdf", "state": "failed", "pages_done": 1,
                "pages_total": 4, "attempts": 6, "error_code": "corrupt_input",
                "error_message": "xref broken"},
            3: {"id": 3, "path": "in/c [draft].png", "state": "pending", "pages_done": 0,
                "pages_total": 1, "attempts": 0, "error_code": None, "error_message": None},
        }
        self.release = asyncio.Event()  # set to let a waiting drain/reload return
        self.wait_seconds = 10.0
        self.crash_on: set[str] = set()

    def _record(self, name: str, **args: Any) -> None:
        self.calls.append((name, args))
        if name in self.crash_on:
            raise RuntimeError(f"{name} blew up")

    def status(self) -> dict[str, Any]:
        self._record("status")
        counts = {"pending": 0, "active": 0, "done": 0, "failed": 0}
        for job in self.jobs.values():
            key = {"running": "active", "partial": "done", "cancelled": "failed"}.get(
                job["state"], job["state"])
            counts[key] += 1
        return {
            "daemon": {"state": self.state, "pid": os.getpid(),
                       "uptime_s": round(time.monotonic() - self.started, 1)},
            "engine": {
                "state": "backoff", "pid": None, "restarts": 2,
                "profile": {"gpu_memory_utilization": 0.85, "max_num_seqs": 32,
                            "max_num_batched_tokens": 4096, "enforce_eager": True},
                "last_failure": {"class": "cuda_oom_load",
                                 "evidence": "torch.OutOfMemoryError: CUDA out of memory. "
                                             "Tried to allocate 2.00 GiB",
                                 "action": "enforce_eager", "at_wall": time.time() - 60},
                "profile_changes": [{"at": time.time() - 60, "reason": "cuda_oom_load",
                                     "class": "cuda_oom_load",
                                     "changes": {"enforce_eager": {"old": False, "new": True}}}],
            },
            "queue": counts,
            "throughput": {"pages_per_min_1m": 12.5, "pages_per_min_15m": 9.75},
            "gpus": self._gpus(),
        }

    @staticmethod
    def _gpus() -> list[GpuStatus]:
        # The shape of chandrad.gpu.gpu_summary()["gpus"] (bytes, plus rounded GiB).
        return [{"index": 0, "uuid": "GPU-0b1c", "name": "NVIDIA H200",
                 "memory_used": 71 * 1024**3, "memory_total": 140 * 1024**3,
                 "memory_free": 69 * 1024**3, "memory_used_gib": 71.0,
                 "memory_total_gib": 140.0, "memory_free_gib": 69.0,
                 "processes": [{"pid": 4242, "name": "VLLM::EngineCore",
                                "used_bytes": 70 * 1024**3}]}]

    def queue(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        self._record("queue", state=state, limit=limit)
        jobs = [j for j in self.jobs.values() if state is None or j["state"] == state]
        return jobs[:limit]

    def gpu(self) -> dict[str, Any]:
        self._record("gpu")
        return {"gpus": self._gpus()}

    def version(self) -> dict[str, Any]:
        self._record("version")
        return {"daemon": "0.1.0", "vllm": "0.32.0", "model": "tiny-idefics3"}

    async def pause(self) -> dict[str, Any]:
        self._record("pause")
        if self.state == "paused":
            raise ControlError("invalid_state", "already paused")
        self.state = "paused"
        return {"state": self.state, "message": "paused: in-flight pages will finish"}

    async def resume(self) -> dict[str, Any]:
        self._record("resume")
        if self.state != "paused":
            raise ControlError("invalid_state", f"not paused (daemon is {self.state})")
        self.state = "running"
        return {"state": self.state}

    async def _maybe_wait(self, wait: bool) -> None:
        if wait:
            await asyncio.wait_for(self.release.wait(), self.wait_seconds)

    async def drain(self, wait: bool = False) -> dict[str, Any]:
        self._record("drain", wait=wait)
        self.state = "draining"
        await self._maybe_wait(wait)
        if wait:
            self.state = "drained"
        return {"state": self.state}

    async def retry(self, job_id: int | None = None, all_failed: bool = False) -> dict[str, Any]:
        self._record("retry", job_id=job_id, all_failed=all_failed)
        if all_failed:
            ids = [j["id"] for j in self.jobs.values() if j["state"] == "failed"]
        elif job_id not in self.jobs:
            raise ControlError("not_found", f"no job {job_id}")
        elif self.jobs[job_id]["state"] != "failed":
            raise ControlError("invalid_state", f"job {job_id} is {self.jobs[job_id]['state']}")
        else:
            ids = [job_id]
        for i in ids:
            self.jobs[i]["state"] = "pending"
        return {"requeued": ids}

    async def cancel(self, job_id: int) -> dict[str, Any]:
        self._record("cancel", job_id=job_id)
        if job_id not in self.jobs:
            raise ControlError("not_found", f"no job {job_id}")
        self.jobs[job_id]["state"] = "cancelled"
        return {"cancelled": job_id}

    async def reload(self, wait: bool = False) -> dict[str, Any]:
        self._record("reload", wait=wait)
        await self._maybe_wait(wait)
        return {"reloaded": True, "engine_restarted": False}

    async def engine_restart(self, engine_id: str | None = None) -> dict[str, Any]:
        self._record("engine_restart", **({} if engine_id is None else {"engine": engine_id}))
        return {"message": "engine restarting with the current profile"}

    async def rescan(self) -> dict[str, Any]:
        self._record("rescan")
        return {"found": 0}


class ServerThread:
    """A ControlServer serving from its own thread and event loop."""

    def __init__(self, path: Path, daemon: RecordingDaemon | None = None, **server_kw: Any):
        self.path = path
        self.daemon = daemon or RecordingDaemon()
        self.server_kw = server_kw
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: ControlServer | None = None

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def start(self) -> ServerThread:
        self.thread.start()

        async def _start() -> None:
            # The Event must belong to the server's loop.
            self.daemon.release = asyncio.Event()
            self.server = ControlServer(self.path, Handlers(self.daemon), **self.server_kw)
            await self.server.start()

        try:
            self.call(_start())
        except BaseException:
            self.stop()
            raise
        return self

    def release(self) -> None:
        """Let waiting drain/reload calls return."""
        self.loop.call_soon_threadsafe(self.daemon.release.set)

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.close())
            self.server = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
