"""``python -m chandrad``: the same entry point as the ``chandrad`` script."""

from __future__ import annotations

from chandrad.cli import main

raise SystemExit(main())
