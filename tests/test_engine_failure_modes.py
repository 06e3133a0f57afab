"""vLLM's real failure modes on the real daemon: a hung engine whose ``/health``
still says 200, and an engine that exits 0 by itself.

The engine is the stand-in process (tests/standin_engine.py as ``engine.python``), in the
modes taken from vLLM's tracker: ``hang_after`` (vllm-project/vllm#39863, #7633: requests
accepted and never answered, the scheduler's gauges "Running: 0, Waiting: N", the token
counters still) and ``exit_after`` (#48966: the API server shuts down normally, status 0,
when its EngineCore died). ``generations`` makes only the first engine misbehave.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, drop
from standin_engine import events, write_standin

from chandrad.config import REFUSED_ENGINE_ENV, EngineConfig, parse_config
from chandrad.engine.client import ENGINE_SERIES, parse_metrics
from chandrad.engine.command import engine_env
from chandrad.engine.profile import MemoryProfile
from chandrad.engine.progress import PROGRESS_SERIES, ProgressWatch
from chandrad.errors import ConfigError

PROGRESS_TIMEOUT = 5.0
PDF = "digital_us-appeals-opinion_17p.pdf"  # 17 pages: many requests at the engine at once
IMAGE = "image_numeric-table-scan.tif"


def _engine_tables(python: Path, port: int, memory: str = "",
                   downshift: str = "backoff = [0.2, 1.0]") -> str:
    return (f'[engine]\nmodel = "{python.parent}"\npython = "{python}"\nport = {port}\n'
            f"startup_timeout = 30\nstop_timeout = 5\nstable_seconds = 0.5\n"
            f"progress_timeout = {PROGRESS_TIMEOUT}\n\n[engine.memory]\n{memory}\n"
            f"[engine.downshift]\n{downshift}\n")


@pytest.fixture
def make_daemon(tmp_path: Path, free_port: Callable[[], int]
                ) -> Iterator[Callable[..., tuple[Daemon, Path]]]:
    made: list[Daemon] = []

    def make(scenario: dict[str, Any], **kwargs: str) -> tuple[Daemon, Path]:
        folder = tmp_path / "engine"
        python = write_standin(folder, scenario)
        d = Daemon(tmp_path / "d", _engine_tables(python, free_port(), **kwargs))
        made.append(d)
        d.start()
        d.wait_engine_ready(60)
        return d, folder

    yield make
    for d in made:
        d.cleanup(grace=30)


def _spawns(folder: Path) -> list[dict[str, Any]]:
    return [e for e in events(folder) if e["what"] == "spawn"]


def _chats(folder: Path) -> list[dict[str, Any]]:
    return [e for e in events(folder) if e["what"] == "chat"]


def _charged(d: Daemon) -> list[tuple[str, int, int]]:
    """Pages charged more than the one attempt that answered them."""
    with d.db() as db:
        rows = db.execute("SELECT j.path, p.page_index, p.attempts FROM pages p "
                          "JOIN jobs j ON j.id = p.job_id WHERE p.attempts > 1").fetchall()
    return [(str(path), int(i), int(n)) for path, i, n in rows]


def test_hung_engine_with_health_200_is_restarted_and_its_pages_redone_uncharged(
        make_daemon: Callable[..., tuple[Daemon, Path]], corpus_dir: Path) -> None:
    """The first engine answers 3 requests, then holds every later one while /health
    says 200. Within progress_timeout + 15 s it is failed as engine_hung (status and
    journal show how long, how many requests, the counters), restarted, and every page
    is done by the second engine without an attempt charged."""
    d, folder = make_daemon({"generations": [{"hang_after": 3}, {}]})
    drop(corpus_dir / "good" / PDF, d.inbox)
    drop(corpus_dir / "good" / IMAGE, d.inbox)
    d.wait_for("the engine holds requests", lambda: len(_chats(folder)) > 3, 60)
    hung_at = _chats(folder)[3]["t"]  # the first request the hung core took
    d.wait_for("a second engine", lambda: len(_spawns(folder)) >= 2, PROGRESS_TIMEOUT + 30)
    restarted_after = _spawns(folder)[1]["t"] - hung_at
    assert restarted_after <= PROGRESS_TIMEOUT + 15, restarted_after
    jobs = d.wait_jobs_final([PDF, IMAGE], 120)
    assert {j["state"] for j in jobs.values()} == {"done"}, jobs
    assert _charged(d) == []
    engine = d.ctl_json("status")["engine"]
    failure = engine["last_failure"]
    assert failure["class"] == "engine_hung", failure
    assert "no progress for" in failure["evidence"] and "in flight" in failure["evidence"]
    assert "generation_tokens_total stuck at 30" in failure["evidence"], failure
    assert failure["numbers"]["in_flight"] >= 1 and failure["numbers"]["stalled_s"] >= 5
    assert engine["restarts"] == 1 and engine["state"] == "ready", engine
    log = d.log_path.read_text()
    assert '"engine_failure"' in log and "engine_hung" in log
    print(f"\nhung engine restarted {restarted_after:.1f}s after it took its first "
          f"unanswered request (progress_timeout {PROGRESS_TIMEOUT:g}s)")


def test_sigterm_does_not_wait_on_a_hung_engine_past_its_deadline(
        make_daemon: Callable[..., tuple[Daemon, Path]], corpus_dir: Path) -> None:
    """SIGTERM while the engine hangs with pages in flight: the drain ends when the hang
    is found (not at the drain's 65 s deadline), the daemon exits 0 and the pages it cut
    off are pending for the next start, none failed."""
    d, folder = make_daemon({"hang_after": 2})
    drop(corpus_dir / "good" / PDF, d.inbox)
    d.wait_for("the engine holds requests", lambda: len(_chats(folder)) > 2, 60)
    t0 = time.monotonic()
    assert d.proc is not None
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(60) == 0, d.tail()
    took = time.monotonic() - t0
    assert took <= PROGRESS_TIMEOUT + 15, took
    with d.db() as db:
        states = dict(db.execute("SELECT state, count(*) FROM pages GROUP BY state").fetchall())
    assert states.get("failed", 0) == 0 and states.get("in_flight", 0) == 0, states
    # the 2 answered are done; a restarted engine may answer a few more before the stop
    assert states.get("done", 0) >= 2 and sum(states.values()) == 17, states
    print(f"\nSIGTERM with a hung engine: stopped in {took:.1f}s")


def test_engine_exit_0_is_a_failure_with_evidence_and_the_work_is_done(
        make_daemon: Callable[..., tuple[Daemon, Path]], corpus_dir: Path) -> None:
    """The first engine shuts down with status 0 after 3 answers, as vLLM's API server does
    when its core died: class engine_exited, evidence "exited with status 0", restarted,
    every page done."""
    d, folder = make_daemon({"generations": [{"exit_after": 3}, {}]})
    drop(corpus_dir / "good" / PDF, d.inbox)
    jobs = d.wait_jobs_final([PDF], 120)
    assert jobs[PDF]["state"] == "done", jobs
    assert len(_spawns(folder)) == 2
    engine = d.ctl_json("status")["engine"]
    failure = engine["last_failure"]
    assert failure["class"] == "engine_exited", failure
    assert failure["evidence"].startswith("exited with status 0 without being asked to stop")
    assert "Finished server process" in failure["evidence"]
    assert failure["action"] != "nothing to do"
    assert engine["restarts"] == 1


def test_an_engine_that_keeps_exiting_0_after_stable_ends_fatal(
        make_daemon: Callable[..., tuple[Daemon, Path]], corpus_dir: Path) -> None:
    """Every engine serves past stable_seconds, then exits 0. Becoming stable used to
    empty the restart budget, so this looped forever as "nothing to do"; the failures of
    an engine that had been ready now stay in the window: the third ends fatal, and status
    says why without contradicting itself."""
    # one sequence (3 requests in flight), a second a page: each engine answers 2 or 3
    d, folder = make_daemon({"exit_after": 2, "delay_s": 1.0}, memory="max_num_seqs = 1",
                            downshift="backoff = [0.2, 1.0]\nmax_restarts = 2")
    drop(corpus_dir / "good" / PDF, d.inbox)
    d.wait_for("the engine fatal", lambda: d.engine_state() == "fatal", 90)
    assert len(_spawns(folder)) == 3
    status = d.ctl_json("status")["engine"]
    assert "3 failures within" in status["fatal_reason"], status
    assert "after the engine was ready" in status["fatal_reason"], status
    assert status["last_failure"]["class"] == "engine_exited", status
    shown = d.ctl("status").stdout
    assert "nothing to do" not in shown and "restart with backoff" not in shown, shown
    assert "none until an operator acts" in shown, shown
    assert "engine_exited" in shown and "fatal" in shown, shown


# ------------------------------------------------------------------ the parts alone


def test_progress_watch_judges_only_requests_that_wait() -> None:
    watch = ProgressWatch(timeout=10)
    counters = {"vllm:generation_tokens_total": 5.0}
    assert watch.observe(0, in_flight=0, answered=0, metrics=counters) is None
    assert watch.observe(100, in_flight=3, answered=0, metrics=counters) is None  # owes now
    assert watch.observe(109, in_flight=3, answered=0, metrics=counters) is None
    # tokens generated: progress, though nothing was answered
    moving = {"vllm:generation_tokens_total": 6.0}
    assert watch.observe(109.5, in_flight=3, answered=0, metrics=moving) is None
    assert watch.observe(119, in_flight=3, answered=0, metrics=moving) is None
    stall = watch.observe(120, in_flight=3, answered=0, metrics=moving)
    assert stall is not None and stall.seconds == pytest.approx(10.5)
    assert "generation_tokens_total stuck at 6" in stall.evidence()
    # an answer is progress; an idle engine owes nothing
    assert watch.observe(121, in_flight=3, answered=1, metrics=moving) is None
    assert watch.observe(500, in_flight=0, answered=1, metrics=moving) is None
    assert watch.stalled_for(500) == 0


def test_progress_watch_with_timeout_0_measures_but_never_judges() -> None:
    watch = ProgressWatch(timeout=0)
    still = {"vllm:generation_tokens_total": 5.0}
    assert watch.observe(0, in_flight=2, answered=0, metrics=still) is None
    assert watch.observe(10_000, in_flight=2, answered=0, metrics=still) is None
    assert watch.stalled_for(10_000) == 10_000


def test_keep_alive_on_engine_death_never_reaches_the_engine() -> None:
    """vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH keeps its API server up after the core
    died, hiding the failure: dropped from the daemon's environment, refused in
    engine.env (exit 78 naming the key)."""
    env = engine_env(EngineConfig(), MemoryProfile(),
                     {"PATH": "/usr/bin", "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"})
    assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH" not in env and env["PATH"] == "/usr/bin"
    assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH" in REFUSED_ENGINE_ENV
    with pytest.raises(ConfigError) as refused:
        parse_config('[engine.env]\nVLLM_KEEP_ALIVE_ON_ENGINE_DEATH = "1"\n',
                     Path("/etc/chandrad/chandrad.toml"))
    problems = refused.value.problems
    assert [p.key for p in problems] == ["engine.env"], problems
    assert "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH" in problems[0].message
    assert refused.value.exit_code == 78


def test_progress_counters_are_read_from_vllms_own_metrics_page() -> None:
    """vLLM 0.32's real /metrics page (busy, the CPU engine): the supervisor's scrape
    carries both progress counters, summed over their labels."""
    page = (Path(__file__).parent / "fixtures" / "vllm_cpu_metrics_busy.txt").read_text()
    scraped = parse_metrics(page, ENGINE_SERIES)
    assert scraped["vllm:prompt_tokens_total"] == 9536.0
    assert scraped["vllm:generation_tokens_total"] == 97.0
    assert set(PROGRESS_SERIES) <= set(scraped)
