"""The daemon layer: the one place that wires concrete services and adapters together.

``Daemon`` (``daemon/core``) is one running chandrad; ``run`` is ``chandrad run``'s entry.
The package's modules, each with one owner: ``core`` (wiring, the ``DaemonState`` machine,
the main loop), ``queue`` (the one command queue), ``wiring`` (config → parts), ``report``
(status line and replies), ``controls`` (``DaemonControl``), ``reload``, ``shutdown``.
"""

from __future__ import annotations

from chandrad.daemon.core import Daemon, run
from chandrad.daemon.wiring import NvmlProbe, plan_engines

__all__ = ["Daemon", "NvmlProbe", "plan_engines", "run"]
