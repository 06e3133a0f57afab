"""``python -m chandrad`` and the ``chandrad`` script (pyproject's entry point).

``chandrad run`` holds SIGHUP, SIGTERM and SIGINT before anything else is imported
(``chandrad/early.py``): importing the CLI and the daemon takes a few hundred
milliseconds, and a signal with its default action then would kill the daemon.
"""

from __future__ import annotations

import importlib
import sys

from chandrad import early


def main() -> int:
    """The process entry: hold the signals for ``run``, then the CLI."""
    if sys.argv[1:2] == ["run"]:
        early.HELD.hold()
    cli = importlib.import_module("chandrad.cli")  # after the hold: its imports take time
    return int(cli.main())


if __name__ == "__main__":
    raise SystemExit(main())
