"""The daemon layer: the one place that wires concrete services and adapters together.

``Daemon`` (``daemon/core``) is one running chandrad; ``run`` is ``chandrad run``'s entry.
The package's modules, each with one owner: ``core`` (wiring, the main loop),
``lifecycle`` (the ``DaemonState`` machine, the config in force, the exit code), ``queue``
(the one command queue), ``wiring`` (config → parts), ``report`` (status line and
replies), ``watching`` (the watcher in force), ``controls`` (``DaemonControl``),
``reload``, ``shutdown``, ``door`` (the HTTP API's ``JobDoor``). ``core``'s ``Daemon``
builds the others' parts and gives each the collaborators it uses; none imports it back.
"""

from __future__ import annotations

from chandrad.daemon.core import Daemon, run
from chandrad.daemon.wiring import NvmlProbe, plan_engines

__all__ = ["Daemon", "NvmlProbe", "plan_engines", "run"]
