"""The watched folders as the daemon runs them: the one ``FolderWatcher`` in force, its
supervised task, and the hand-off of each settled file to the pipeline.

A reload that changes ``[[watch]]`` replaces the watcher (:meth:`Watching.restart`); a
drain or the shutdown stops it. A settled file is handed over only while the daemon
accepts files (running, paused, reloading).
"""

from __future__ import annotations

import asyncio

from chandrad.config import Config
from chandrad.daemon.lifecycle import Lifecycle
from chandrad.daemon.wiring import describe_item
from chandrad.pipeline import Pipeline
from chandrad.states import DaemonState
from chandrad.tasks import TaskSupervisor
from chandrad.watch import FolderWatcher, SettledFile

#: The states in which a settled file is handed to the pipeline.
_ACCEPTING = (DaemonState.RUNNING, DaemonState.PAUSED, DaemonState.RELOADING)
#: The watcher's task under the daemon's ``TaskSupervisor``.
TASK = "watcher"


class Watching:
    """Owns the watcher in force (``watcher``, replaced by :meth:`restart`)."""

    def __init__(self, lifecycle: Lifecycle, tasks: TaskSupervisor, pipeline: Pipeline) -> None:
        self._lifecycle = lifecycle
        self._tasks = tasks
        self._pipeline = pipeline
        self.watcher: FolderWatcher | None = None

    async def start(self, config: Config) -> None:
        """Arm a watcher over ``config``'s folders; :meth:`supervise` runs it."""
        self.watcher = FolderWatcher(config.watch, self._on_settled,
                                     loop=asyncio.get_running_loop())
        await self.watcher.start()

    def supervise(self) -> None:
        """Run the watcher as a supervised task (a file that crashes it is quarantined)."""
        assert self.watcher is not None
        self._tasks.start(TASK, self.watcher.run, quarantine=self._pipeline.quarantine,
                          describe=describe_item)

    def stop(self) -> None:
        """Stop watching (drain, shutdown, or before a reload replaces the watcher)."""
        if self.watcher is not None:
            self._tasks.let_finish(TASK)
            self.watcher.stop()

    async def restart(self, config: Config) -> None:
        """A reload changed ``[[watch]]``: a new watcher over the new folders."""
        if self.watcher is None:
            return
        self.stop()
        await self.start(config)
        self.supervise()

    async def rescan(self) -> int:
        """Look at every watched folder again; the number of candidates found."""
        assert self.watcher is not None
        return await self.watcher.rescan()

    def _on_settled(self, settled: SettledFile) -> None:
        if self._lifecycle.state in _ACCEPTING:
            self._pipeline.submit(settled.watch_index, settled.root, settled.path,
                                  settled.size, settled.mtime)
