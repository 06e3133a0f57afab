"""``chandractl status --cluster``: the hosts sharing one PostgreSQL queue, from the store.

Reads ``daemon.store`` from the config (``--config``, else ``$CHANDRAD_CONFIG``, else
``/etc/chandrad/chandrad.toml``) and asks the database, not a daemon: it answers while
hosts are down, which is when it is wanted. Per host: up, silent (no heartbeat within its
lease: dead, stalled or cut off; the others take its jobs) or stopped; its jobs running
and waiting, pages in flight and done in the last minute (of its jobs and those it helps
with), pages it holds of other hosts' jobs (helping), leases expired.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TextIO

from chandrad.config import load_config
from chandrad.ctl.client import DEFAULT_CONFIG
from chandrad.errors import ChandradError
from chandrad.store.postgres import cluster_status

COLUMNS = (("host", "host"), ("state", "state"), ("seen_s_ago", "seen s ago"),
           ("jobs_running", "running"), ("jobs_waiting", "waiting"),
           ("pages_in_flight", "in flight"), ("pages_done_1m", "pages/min"),
           ("pages_helping", "helping"), ("leases_expired", "expired"))


def run_cluster(config: Path | None, as_json: bool, out: TextIO) -> int:
    """Print the cluster's hosts; returns 0, or raises ChandradError (not PostgreSQL, or
    the server cannot be reached)."""
    path = config or Path(os.environ.get("CHANDRAD_CONFIG") or DEFAULT_CONFIG)
    cfg = load_config(path)
    if not cfg.daemon.store_url:
        raise ChandradError(f"{path}: daemon.store is not a postgresql:// URL; a host on "
                            "its own SQLite store has no cluster (chandractl status)")
    result = cluster_status(cfg.daemon.store_url)
    if as_json:
        out.write(json.dumps(result, indent=2) + "\n")
        return 0
    out.write(render(result))
    return 0


def render(result: dict[str, Any]) -> str:
    """The hosts as a plain table, then the queue."""
    rows = [[str(h[key]) for key, _ in COLUMNS] for h in result["hosts"]]
    heads = [title for _, title in COLUMNS]
    widths = [max(len(c) for c in col) for col in zip(heads, *rows, strict=False)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (heads, *rows)]
    jobs = ", ".join(f"{state} {n}" for state, n in sorted(result["jobs"].items()))
    lines.append(f"store {result['store']}: jobs {jobs or 'none'}; "
                 f"{result['jobs_unclaimed']} open job(s) no live host holds")
    return "\n".join(lines) + "\n"
