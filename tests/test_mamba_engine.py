"""Chandra 2's hybrid cache on the real daemon: vLLM refuses ``max_num_seqs``
above its pool of Mamba-state blocks, and the ladder sets it to the number vLLM names.

The engine is the stand-in process (tests/standin_engine.py as ``engine.python``) with
``mamba_cache_blocks``: without ``--max-num-seqs`` it asks for vLLM's default (1024 on an
H100) and fails with vLLM's own ValueError, "EngineCore failed to start." and the API
server's "Engine core initialization failed" below it, exit 1, as vLLM >= 0.19 does.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon
from standin_engine import MAX_NUM_SEQS, events, write_standin

BLOCKS = 600


def _engine_tables(python: Path, port: int) -> str:
    return (f'[engine]\nmodel = "{python.parent}"\npython = "{python}"\nport = {port}\n'
            "startup_timeout = 30\nstop_timeout = 5\nstable_seconds = 0.5\n\n"
            "[engine.downshift]\nbackoff = [0.2, 1.0]\n")


def _max_num_seqs(spawn: dict[str, Any]) -> int:
    """What the engine was started with (vLLM's default when the flag is absent)."""
    argv: list[str] = spawn["argv"]
    if "--max-num-seqs" not in argv:
        return MAX_NUM_SEQS
    return int(argv[argv.index("--max-num-seqs") + 1])


@pytest.fixture
def daemon(tmp_path: Path, free_port: Callable[[], int]) -> Iterator[tuple[Daemon, Path]]:
    folder = tmp_path / "engine"
    python = write_standin(folder, {"mamba_cache_blocks": BLOCKS})
    d = Daemon(tmp_path / "d", _engine_tables(python, free_port()))
    try:
        yield d, folder
    finally:
        d.cleanup(grace=30)


def test_mamba_limit_ready_after_exactly_one_failed_start_and_learned(
        daemon: tuple[Daemon, Path]) -> None:
    """vLLM's default 1024 sequences > 600 Mamba blocks: the first start fails with
    mamba_cache_insufficient (its ValueError the evidence, both numbers parsed), the second
    starts with max_num_seqs 600 and is ready; the learned profile keeps 600, so the next
    daemon starts there at once."""
    d, folder = daemon
    d.start()
    d.wait_engine_ready(60)
    spawns = [e for e in events(folder) if e["what"] == "spawn"]
    assert [_max_num_seqs(s) for s in spawns] == [MAX_NUM_SEQS, BLOCKS], spawns
    engine = d.ctl_json("status")["engine"]
    assert engine["restarts"] == 1 and engine["state"] == "ready", engine
    failure = engine["last_failure"]
    assert failure["class"] == "mamba_cache_insufficient", failure
    assert "exceeds available Mamba cache blocks (600)" in failure["evidence"], failure
    assert failure["numbers"] == {"max_num_seqs": MAX_NUM_SEQS, "mamba_cache_blocks": BLOCKS}
    assert engine["profile"]["max_num_seqs"] == BLOCKS
    [change] = engine["profile_changes"]
    assert change["changes"] == {"max_num_seqs": {"old": None, "new": BLOCKS}}, change

    def learned() -> list[dict[str, Any]]:
        with d.db() as db:
            return [json.loads(p) for (p,) in
                    db.execute("SELECT profile_json FROM learned_profiles").fetchall()]

    d.wait_for("the profile learned", lambda: learned(), 30)
    assert [p["max_num_seqs"] for p in learned()] == [BLOCKS]

    assert d.stop() == 0
    d.start()
    d.wait_engine_ready(60)
    spawns = [e for e in events(folder) if e["what"] == "spawn"]
    assert [_max_num_seqs(s) for s in spawns[2:]] == [BLOCKS], spawns
    engine = d.ctl_json("status")["engine"]
    assert (engine["profile_source"], engine["restarts"]) == ("learned", 0), engine
