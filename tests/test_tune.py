"""``chandrad tune``: the search's step policy (pure), the learned profile it leaves (a real
store and the daemon's own ProfileKeeper), and the command run end to end on the stand-in
engine (tests/standin_engine.py: one process, vLLM's messages; each page takes ``delay_s``
whatever else runs, so pages at once scale until vLLM's Mamba-cache refusal)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import structlog
from daemon_harness import config_toml, table
from pg_server import PgServer
from standin_engine import write_standin
from waiting import wait_until

from chandrad import tune_run
from chandrad.config import EngineConfig, OcrConfig, load_config
from chandrad.daemon.wiring import NvmlProbe, plan_engines
from chandrad.engine.keeper import TUNED_MARK, ProfileKeeper
from chandrad.engine.profile import MemoryProfile
from chandrad.errors import ExitCode
from chandrad.store import Store
from chandrad.store.postgres import PgStore
from chandrad.tune import EngineStep, Measure, TunePolicy, table_rows

REPO = Path(__file__).resolve().parents[1]
START = MemoryProfile(gpu_memory_utilization=None, max_num_seqs=2, max_num_batched_tokens=2048,
                      max_model_len=4096)


def _measure(seqs: int, per_s: float, tokens: int = 2048) -> Measure:
    return Measure(seqs, tokens, pages=int(per_s * 10), seconds=10.0)


# ------------------------------------------------------------------ the step policy
def test_pages_at_once_rise_until_the_gain_is_small_then_batched_tokens() -> None:
    """One start measures 2, 4, 8 at once (started with max_num_seqs 8); 8 gains < 5 % over
    4, so the phase ends there and the next start doubles max_num_batched_tokens at 4;
    that gaining nothing ends the search, keeping 4 at once and the starting tokens."""
    policy = TunePolicy(START)
    step = policy.next_step()
    assert step == EngineStep(START.with_changes(max_num_seqs=8), (2, 4, 8))
    assert policy.record(_measure(2, 1.0)) and policy.record(_measure(4, 1.9))
    assert not policy.record(_measure(8, 1.95))
    assert policy.phase == "tokens"
    step = policy.next_step()
    assert step == EngineStep(START.with_changes(max_num_seqs=4, max_num_batched_tokens=4096),
                              (4,))
    assert not policy.record(_measure(4, 1.96, tokens=4096))
    assert policy.next_step() is None and "4096 gained under 5%" in policy.ended
    assert policy.best_profile() == START.with_changes(max_num_seqs=4)


def test_still_rising_at_the_top_goes_on_above_it() -> None:
    """The top level of the first start is the best: the next start covers 16..64. A dip
    at a middle level (within the host's noise) ends nothing."""
    policy = TunePolicy(START)
    assert policy.next_step() is not None
    assert [policy.record(_measure(seqs, rate))
            for seqs, rate in ((2, 1.0), (4, 0.9), (8, 4.0))] == [True, True, False]
    step = policy.next_step()
    assert step is not None and step.levels == (16, 32, 64)
    assert step.profile.max_num_seqs == 64


def test_a_start_that_runs_out_of_memory_is_the_edge() -> None:
    """A start at 64 fails for KV cache: the next start stays below it (16, 32); one that
    names its Mamba blocks (20) sets the edge at once: 16 is the last level tried."""
    policy = TunePolicy(START)
    policy.next_step()
    for seqs, rate in ((2, 1.0), (4, 2.0), (8, 4.0)):
        policy.record(_measure(seqs, rate))
    first = policy.next_step()
    assert first is not None
    policy.failed(first, "kv_cache_insufficient")
    again = policy.next_step()
    assert again is not None and again.levels == (16, 32)
    policy.failed(again, "mamba_cache_insufficient", {"mamba_cache_blocks": 20.0})
    last = policy.next_step()
    assert last is not None and last.levels == (16,) and last.profile.max_num_seqs == 16
    assert [r["note"] for r in table_rows(policy)][-2:] == [
        "over the edge: kv_cache_insufficient", "over the edge: mamba_cache_insufficient"]


def test_the_start_failing_or_a_failure_not_for_memory_ends_the_search() -> None:
    """The starting profile itself does not start: nothing to keep; an engine failure that
    is not about memory is not a tuning question: the search ends, the best so far kept."""
    policy = TunePolicy(START.with_changes(max_num_seqs=None))
    step = policy.next_step()
    assert step is not None and step.levels == (1, 2, 4)
    policy.failed(step, "cuda_oom_load")
    for levels in ((1, 2), (1,)):
        step = policy.next_step()
        assert step is not None and step.levels == levels
        policy.failed(step, "cuda_oom_load")
    assert policy.next_step() is None and policy.best is None
    assert "starting profile does not start" in policy.ended

    policy = TunePolicy(START)
    step = policy.next_step()
    assert step is not None
    policy.record(_measure(2, 1.0))
    policy.failed(step, "other_fatal")
    assert policy.next_step() is None and policy.best_profile() == START
    assert table_rows(policy)[0]["note"] == "best (the start)"


def test_batched_tokens_over_the_edge_keep_the_best() -> None:
    policy = TunePolicy(START)
    policy.next_step()
    for seqs, rate in ((2, 1.0), (4, 1.01), (8, 1.02)):
        policy.record(_measure(seqs, rate))
    step = policy.next_step()
    assert step is not None and step.profile.max_num_batched_tokens == 4096
    assert step.profile.max_num_seqs == 2  # 4 and 8 gained under 5 %: 2 stays the best
    policy.failed(step, "cuda_oom_runtime")
    assert policy.next_step() is None and policy.best_profile() == START
    assert "4096 over the edge" in policy.ended


# ------------------------------------------------------------------ the learned profile
def test_the_daemon_adopts_a_tuned_profile_without_stepping_back_to_the_config(
        tmp_path: Path) -> None:
    """A profile saved by tune (marked) is the daemon's start, with no upshift "back" to
    the slower configured profile, and stays marked when the daemon saves it as stable."""
    engine, ocr = EngineConfig(model="some/model"), OcrConfig()
    store = Store.open(tmp_path)
    try:
        keeper = ProfileKeeper(engine, ocr, gpu=NvmlProbe(), store=store, cpus="",
                               log=structlog.get_logger())
        tuned = keeper.policy.configured.with_changes(max_num_seqs=64)
        key = keeper.key(engine, ocr)
        store.save_learned_profile(key, {**tuned.to_dict(), TUNED_MARK: True})
        again = ProfileKeeper(engine, ocr, gpu=NvmlProbe(), store=store, cpus="",
                              log=structlog.get_logger())
        assert again.policy.profile == tuned and again.policy.source == "tuned"
        assert again.policy.steps_down == []
        again.stable(engine, ocr)
        assert store.load_learned_profile(key) == {**tuned.to_dict(), TUNED_MARK: True}
    finally:
        store.close()


def test_synthetic_calibration_pages_render(tmp_path: Path) -> None:
    """Without --files: pages of printed text, rendered as the daemon renders pages."""
    paths = tune_run.calibration_files(None, tmp_path)
    cfg = load_config_text(tmp_path, "")
    pages = tune_run.render_pages(paths, cfg, cfg.ocr.max_pixels)
    assert len(pages) == tune_run.SYNTHETIC_PAGES
    assert all(p.png.startswith(b"\x89PNG") and p.width * p.height > 10**6 for p in pages)


def test_every_request_is_a_page_the_engine_has_not_seen(tmp_path: Path) -> None:
    """Page variants: the calibration pages in turn, each marked with its request number in
    its top-left pixels, so no two requests share a page (vLLM's caches would skip the
    prefill of a repeated one); the rest of the page is untouched."""
    import io

    from PIL import Image, ImageChops

    cfg = load_config_text(tmp_path, "")
    paths = tune_run.calibration_files(None, tmp_path)[:2]
    pages = tune_run.render_pages(paths, cfg, cfg.ocr.max_pixels)
    variants = tune_run.PageVariants(pages)
    sent = [variants.next() for _ in range(6)]
    assert len({p.png for p in sent}) == 6
    assert [p.index for p in sent] == [0, 0, 0, 0, 0, 0] and \
        [(p.width, p.height) for p in sent] == [(pages[i % 2].width, pages[i % 2].height)
                                                for i in range(6)]
    with Image.open(io.BytesIO(sent[5].png)) as a, Image.open(io.BytesIO(pages[1].png)) as b:
        box = ImageChops.difference(a.convert("L"), b.convert("L")).getbbox()
    assert box is not None and box[1] == 0 and box[3] == 1 and box[2] <= 24


def load_config_text(root: Path, engine: str) -> Any:
    path = root / "chandrad.toml"
    (root / "in").mkdir(exist_ok=True)
    path.write_text(config_toml(state_dir=root / "state", watch={"input": root / "in"},
                                engine=engine), encoding="utf-8")
    return load_config(path)


# ------------------------------------------------------------------ end to end (stand-in)
BLOCKS = 6


def _standin_config(tmp_path: Path, port: int, delay_s: float = 0.1,
                    cpu_affinity: tuple[str, ...] = ()) -> Path:
    """``cpu_affinity``: one engine per CPU list (replicas on the CPU)."""
    python = write_standin(tmp_path / "engine", {"mamba_cache_blocks": BLOCKS,
                                                 "delay_s": delay_s})
    keys: dict[str, Any] = {"model": python.parent, "python": python, "port": port,
                            "startup_timeout": 30, "stop_timeout": 5}
    if cpu_affinity:
        keys["cpu_affinity"] = list(cpu_affinity)
    engine = table("engine", keys) + table("engine.memory", {"max_num_seqs": 1})
    load_config_text(tmp_path, engine)
    return tmp_path / "chandrad.toml"


def _one_page(folder: Path) -> str:
    """A calibration folder of one small synthetic page (the stand-in reads no image)."""
    folder.mkdir()
    tune_run.synthetic_page(folder / "page.png", 0)
    return str(folder)


def _tune(config: Path, *args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "CHANDRAD_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.Popen([sys.executable, "-m", "chandrad", "tune", "--config", str(config),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _learned(state: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(f"file:{state / 'chandrad.sqlite3'}?mode=ro", uri=True) as db:
        return [json.loads(p) for (p,) in
                db.execute("SELECT profile_json FROM learned_profiles").fetchall()]


def test_tune_raises_pages_at_once_to_the_memory_edge_and_keeps_the_fastest(
        tmp_path: Path, free_port: Callable[[], int]) -> None:
    """From max_num_seqs 1: the first start measures 1, 2, 4 at once; the next (8..32,
    started at 32) is refused by the Mamba cache, which names 6 blocks: that is the edge,
    so the search moves to batched tokens at 4 at once (the stand-in is no faster for
    them). 4 at once is kept, marked, as the learned profile; the table says before and
    after."""
    # 0.3 s a page: a level of 12-16 pages lasts seconds, so the 2x of 4 at once over 2 is
    # not lost in a loaded host's scheduling hiccups (at 0.1 s a level was ~0.4 s, and a
    # CI run at load 9 measured 4 at once under 5 % above 2).
    config = _standin_config(tmp_path, free_port(), delay_s=0.3)
    done = _tune(config, "--minutes", "3", "--files", _one_page(tmp_path / "files"))
    out, _ = done.communicate(timeout=180)
    assert done.returncode == 0, out
    [learned] = _learned(tmp_path / "state")
    assert learned["max_num_seqs"] == 4 and learned[TUNED_MARK] is True, learned
    assert "over the edge: mamba_cache_insufficient" in out, out
    assert "best (kept)" in out and "before: " in out and "; after: " in out, out
    assert "engine starting: max_num_seqs 4, max_num_batched_tokens 4096" in out, out


def test_tune_refuses_while_the_daemon_holds_the_store_and_ctrl_c_keeps_the_best(
        tmp_path: Path, free_port: Callable[[], int]) -> None:
    """The store's lock held (as a running daemon holds it): exit 78 naming the state dir,
    nothing started. Then Ctrl-C after the first levels: exit 130, the best so far kept."""
    config = _standin_config(tmp_path, free_port(), delay_s=0.3)
    held = Store.open(tmp_path / "state")
    try:
        refused = _tune(config)
        out, _ = refused.communicate(timeout=60)
    finally:
        held.close()
    assert refused.returncode == ExitCode.CONFIG, out
    assert "daemon.state_dir" in out, out
    run = _tune(config, "--minutes", "3", "--files", _one_page(tmp_path / "files"))
    lines: list[str] = []
    assert run.stdout is not None

    def measured_two() -> bool:
        line = run.stdout.readline() if run.stdout is not None else ""
        lines.append(line)
        return sum(" at once, " in x for x in lines) >= 2

    wait_until(measured_two, 60, "two levels measured", every=0.0)
    run.send_signal(signal.SIGINT)
    rest, _ = run.communicate(timeout=60)
    out = "".join(lines) + rest
    assert run.returncode == ExitCode.INTERRUPTED, out
    assert "ended: interrupted" in out, out
    [learned] = _learned(tmp_path / "state")  # 2 at once, or 4 if that level beat the signal
    assert learned["max_num_seqs"] in (2, 4) and learned[TUNED_MARK] is True, learned
    assert "after: " in out and f"(max_num_seqs {learned['max_num_seqs']}," in out, out


# ------------------------------------------------------------------ a shared store (PostgreSQL)
def _on_shared_store(config: Path, url: str, host: str) -> None:
    text = config.read_text(encoding="utf-8")
    keys = f'store = "{url}"\nhost_id = "{host}"\nlease_s = 3\n'
    config.write_text(text.replace("[daemon]\n", "[daemon]\n" + keys, 1), encoding="utf-8")


def test_tune_on_a_shared_store_keeps_the_profile_under_this_hosts_id(
        tmp_path: Path, free_port: Callable[[], int], pg_server: PgServer) -> None:
    """With ``daemon.store`` a PostgreSQL URL, tune saves the learned profile under this
    host's id, where this host's daemon loads it (as tuned) and no other host does; while
    a live process beats as this host (its daemon), tune refuses: exit 78 naming
    ``daemon.host_id``."""
    url = pg_server.new_database()
    config = _standin_config(tmp_path, free_port(), delay_s=0.02)
    _on_shared_store(config, url, "gpu-1")
    daemon = PgStore.open(url, "gpu-1", lease_s=3.0)  # this host's daemon, running
    try:
        refused = _tune(config, "--max-starts", "1")
        out, _ = refused.communicate(timeout=60)
    finally:
        daemon.close()
    assert refused.returncode == ExitCode.CONFIG and "daemon.host_id" in out, out
    done = _tune(config, "--minutes", "3", "--max-starts", "1", "--files",
                 _one_page(tmp_path / "files"))
    out, _ = done.communicate(timeout=180)
    assert done.returncode == 0, out
    cfg = load_config(config)
    engine = plan_engines(cfg)[0].engine
    for host, tuned in (("gpu-1", True), ("gpu-2", False)):
        store = PgStore.open(url, host, lease_s=3.0)
        try:
            keeper = ProfileKeeper(engine, cfg.ocr, gpu=NvmlProbe(), store=store, cpus="",
                                   log=structlog.get_logger())
            assert (keeper.policy.source == "tuned") is tuned, (host, keeper.policy.source)
        finally:
            store.close()
    with psycopg.connect(url) as conn:
        [(key,)] = conn.execute("SELECT key FROM learned_profiles").fetchall()
    assert key.startswith("gpu-1/") and "kept as the learned profile of" in out, (key, out)


# ------------------------------------------------------------------ replicas
def test_tune_keeps_the_profile_for_every_alike_replica(
        tmp_path: Path, free_port: Callable[[], int]) -> None:
    """Two replicas pinned to one CPU each are alike: tune measures engine 0 and saves the
    best under each replica's own key (its CPU list is part of it), so that each replica
    of the daemon starts from it, marked tuned."""
    config = _standin_config(tmp_path, free_port(), delay_s=0.02, cpu_affinity=("0", "1"))
    done = _tune(config, "--minutes", "3", "--max-starts", "1", "--files",
                 _one_page(tmp_path / "files"))
    out, _ = done.communicate(timeout=180)
    assert done.returncode == 0, out
    cfg = load_config(config)
    specs = plan_engines(cfg)
    assert [s.cpus for s in specs] == ["0", "1"]
    store = Store.open(cfg.daemon.state_dir)
    try:
        keepers = [ProfileKeeper(s.engine, cfg.ocr, gpu=NvmlProbe(), store=store, cpus=s.cpus,
                                 log=structlog.get_logger()) for s in specs]
        assert [k.policy.source for k in keepers] == ["tuned", "tuned"]
        assert keepers[0].policy.profile == keepers[1].policy.profile
        keys = {k.key(s.engine, cfg.ocr) for k, s in zip(keepers, specs, strict=True)}
        assert len(keys) == 2
    finally:
        store.close()
    assert len(_learned(tmp_path / "state")) == 2
    assert "and, alike, of the 1 other replica(s)" in out, out


def test_tune_refuses_replicas_unlike_engine_0_before_any_start(
        tmp_path: Path, free_port: Callable[[], int]) -> None:
    """A replica on two CPUs beside engine 0 on one: engine 0's best says nothing of it,
    so tune refuses (78, the key and the difference named) and starts no engine."""
    config = _standin_config(tmp_path, free_port(), cpu_affinity=("0", "0-1"))
    done = _tune(config, "--minutes", "3", "--files", _one_page(tmp_path / "files"))
    out, _ = done.communicate(timeout=120)
    assert done.returncode == ExitCode.CONFIG, out
    assert "engine.cpu_affinity: chandrad tune measures engine 0" in out, out
    assert "engine 1 is not like engine 0 (engine.cpu_affinity: 2 CPUs vs 1 CPUs" in out, out
    assert "engine starting" not in out and _learned(tmp_path / "state") == [], out
