"""CI's short versions of ``bench/soak.py``: a page soak with the engine SIGKILLed at random,
and a file backlog while the engine restarts on a timer.

The full runs (≥ 2,000 pages on the real engine killed every 30-90 s; 10,000 files with a
restart every 60 s) are bench runs, not CI: ``bench/soak.py --help``. These run the same
code with the stand-in engine process reached through ``engine.url`` (``--engine remote``:
the soak kills and restarts it; no vLLM import, so no flag check that a busy shared
machine can stretch past its limit) and shorter intervals; ``bench/soak.py`` exits 1 if
any file is lost, any page is done twice or any output's page count differs from an
undisturbed run's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _soak(tmp_path: Path, *args: str) -> dict[str, object]:
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "soak.py"), "--engine", "remote",
         "--root", str(tmp_path / "soak"), "--out", str(out), "--timeout", "400", *args],
        capture_output=True, text=True, env=env, timeout=500)
    print(result.stdout[-3000:], result.stderr[-3000:])
    assert out.exists(), result.stderr[-3000:]
    summary: dict[str, object] = json.loads(out.read_text())
    assert result.returncode == 0, summary
    return summary


def test_soak_short_engine_sigkill(tmp_path: Path) -> None:
    summary = _soak(tmp_path, "--pages", "40", "--max-doc", "15", "--kill", "1", "4",
                    "--standin-delay", "0.3")
    assert summary["lost"] == 0 and summary["done_twice"] == 0
    assert summary["page_count_mismatch"] == 0
    assert isinstance(summary["faults"], int) and summary["faults"] >= 1, summary


def test_backlog_short_engine_restarts(tmp_path: Path) -> None:
    summary = _soak(tmp_path, "--backlog", "100", "--restart-every", "6", "8",
                    "--standin-delay", "0.05")
    assert summary["lost"] == 0 and summary["done_twice"] == 0
    assert isinstance(summary["faults"], int) and summary["faults"] >= 1, summary
