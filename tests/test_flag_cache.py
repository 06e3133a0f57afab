"""A clean flag-check verdict outlives the daemon (``engine/flagcache.py``).

Real daemons with the stand-in engine interpreter (it records each ``check-flags`` child
it answers); the installation identity is asked of the real interpreter behind it.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from standin_engine import events, write_standin
from test_daemon_service import wait_answering
from test_supervision import daemon_config, start_daemon, wait_engine

from chandrad.engine.flagcache import FlagVerdictCache, flag_cache_dir
from chandrad.errors import ExitCode


def checked(log: Path) -> list[dict[str, Any]]:
    """The ``engine_flags_checked`` events of the daemon log, oldest first."""
    found = []
    for line in log.read_text().splitlines():
        if '"engine_flags_checked"' in line:
            found.append(json.loads(line))
    return found


def run_until_ready(config: Path, root: Path, log: Path) -> None:
    """One daemon start: engine ready, then a clean stop."""
    proc = start_daemon(config, log)
    try:
        wait_answering(root / "ctl.sock", proc, log)
        wait_engine(root / "ctl.sock", proc, log, "ready")
    finally:
        if proc.poll() is None:
            proc.terminate()
        assert proc.wait(60) == 0, log.read_text()[-3000:]


def exits_with_config_error(config: Path, log: Path) -> None:
    """Start the daemon and see it exit 78 (a refused flag) within 90 s."""
    proc = start_daemon(config, log)
    try:
        assert proc.wait(90) == ExitCode.CONFIG, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_second_start_reuses_the_clean_verdict_without_a_child(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    folder = tmp_path / "engine"
    python = write_standin(folder, {"check_flags": ["ok", "bad_flag"]})
    config, log = daemon_config(tmp_path, python, free_port()), tmp_path / "daemon.log"
    run_until_ready(config, tmp_path, log)
    run_until_ready(config, tmp_path, log)
    assert [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"] == ["ok"]
    assert [(e["cached"], e["problems"]) for e in checked(log)] == [(False, []), (True, [])]
    stored = list(flag_cache_dir(tmp_path / "state", {}).glob("*.json"))
    assert len(stored) == 1, stored


def test_a_change_the_flags_do_not_show_reuses_the_verdict(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """The check sees only the flags: a restart after a change of engine keys that never
    reach the command line (here stop_timeout and stable_seconds) reuses the verdict; a
    changed flag (max_num_seqs) checks again."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"check_flags": ["ok", "bad_flag"]})
    port, log = free_port(), tmp_path / "daemon.log"
    config = daemon_config(tmp_path, python, port)
    run_until_ready(config, tmp_path, log)
    text = config.read_text()
    assert "stop_timeout = 5\n" in text and "stable_seconds = 0.5\n" in text
    config.write_text(text.replace("stop_timeout = 5\n", "stop_timeout = 7\n").replace(
        "stable_seconds = 0.5\n", "stable_seconds = 0.7\n"))
    run_until_ready(config, tmp_path, log)
    assert [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"] == ["ok"]
    assert [e["cached"] for e in checked(log)] == [False, True]
    config.write_text(config.read_text().replace(
        "[engine.downshift]", "[engine.memory]\nmax_num_seqs = 3\n\n[engine.downshift]"))
    exits_with_config_error(config, log)
    assert [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"] == [
        "ok", "bad_flag"]
    assert [e["cached"] for e in checked(log)] == [False, True, False]


def test_another_vllm_installation_reruns_the_check(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """The same ``engine.python`` path now finds another vLLM (a venv upgraded in place):
    the stored verdict is not for it."""
    folder = tmp_path / "engine"
    python = write_standin(folder, {"check_flags": ["ok", "ok"]})
    config, log = daemon_config(tmp_path, python, free_port()), tmp_path / "daemon.log"
    run_until_ready(config, tmp_path, log)
    site = tmp_path / "site"
    (site / "vllm" / "engine").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "engine" / "arg_utils.py").write_text("")
    (site / "vllm-99.0.dist-info").mkdir()
    (site / "vllm-99.0.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 99.0\n")
    wrapper = python.read_text().replace("exec ", f"PYTHONPATH={site}:$PYTHONPATH exec ", 1)
    python.write_text(wrapper)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    run_until_ready(config, tmp_path, log)
    assert [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"] == [
        "ok", "ok"]
    assert [e["cached"] for e in checked(log)] == [False, False]


def test_a_refused_flag_is_never_stored(tmp_path: Path, free_port: Callable[[], int]) -> None:
    folder = tmp_path / "engine"
    python = write_standin(folder, {"check_flags": ["bad_flag", "bad_flag"]})
    config = daemon_config(tmp_path, python, free_port(), 'extra_args = ["--no-such-flag"]')
    log = tmp_path / "daemon.log"
    for _ in range(2):
        exits_with_config_error(config, log)
    assert [e["behaviour"] for e in events(folder) if e["what"] == "check_flags"] == [
        "bad_flag", "bad_flag"]
    assert [e["cached"] for e in checked(log)] == [False, False]
    assert not list(flag_cache_dir(tmp_path / "state", {}).glob("*.json"))


def test_any_doubt_about_the_file_means_check_again(tmp_path: Path) -> None:
    cache = FlagVerdictCache(tmp_path / "c")
    key = {"flags": ["--model", "m"], "python": "/p"}
    assert not cache.is_clean(key)
    cache.remember_clean(key)
    assert cache.is_clean(key)
    assert not cache.is_clean({**key, "flags": ["--model", "n"]})
    (path,) = (tmp_path / "c").glob("*.json")
    path.write_text("{not json")
    assert not cache.is_clean(key)
    path.write_text(json.dumps({"verdict": "clean", "key": {**key, "python": "/q"}}))
    assert not cache.is_clean(key)  # a digest collision or a hand-edited file


def test_a_cache_that_cannot_be_written_is_not_fatal(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = FlagVerdictCache(blocker / "c")  # a directory under a plain file
    cache.remember_clean({"flags": []})
    assert not cache.is_clean({"flags": []})


def test_systemd_cache_directory_wins_over_the_state_dir() -> None:
    state = Path("/var/lib/chandrad")
    assert flag_cache_dir(state, {}) == state / "cache" / "flag-checks"
    assert flag_cache_dir(state, {"CACHE_DIRECTORY": "/var/cache/chandrad"}) == Path(
        "/var/cache/chandrad/flag-checks")
