"""`kill -9` of the real daemon at random points, N times in a row (seeded; the seed is
printed and ``CHANDRAD_FAULTS_SEED`` replays it; ``CHANDRAD_FAULTS_KILLS`` sets N, ≥ 20).

The kill lands anywhere: during start-up, intake and hashing, rendering, inference,
output writing, the move to done/. After each restart the store must still hold every
page committed before any kill with the same result (a changed ``finished_at`` = a page
done twice); at the end every input is in done/ with outputs of the right page count, or
in failed/ with its error.json. The engine is the stand-in engine process reached through
``engine.url`` (it outlives the daemon, as a remote engine would), so each restart costs
only the daemon's own start.
"""

from __future__ import annotations

import os
import random
import sqlite3
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from faults.faultkit import Daemon, RemoteEngine, audit, drop, record

FILES = [  # (corpus file, pages)
    ("good/digital_federal-register_15p.pdf", 15),
    ("good/scan_four-orientations_cardinal.pdf", 4),
    ("good/image_multipage-fax-g3_3p.tif", 3),
    ("good/scan_us-supreme-court-opinion.pdf", 2),
    ("good/image_hi-devanagari.png", 1),
    ("good/digital_sf424-federal-form.pdf", 1),
]


@pytest.fixture
def remote_engine(tmp_path: Path) -> Iterator[RemoteEngine]:
    engine = RemoteEngine(tmp_path / "engine", delay_s=0.3)
    try:
        yield engine
    finally:
        engine.close()


def test_daemon_sigkill_at_random_points(tmp_path: Path, corpus_dir: Path,
                                         remote_engine: RemoteEngine) -> None:
    seed = int(os.environ.get("CHANDRAD_FAULTS_SEED", random.randrange(1 << 30)))
    kills = max(20, int(os.environ.get("CHANDRAD_FAULTS_KILLS", "20")))
    print(f"\nseed={seed} kills={kills} (replay: CHANDRAD_FAULTS_SEED={seed})")
    rng = random.Random(seed)
    d = Daemon(tmp_path / "d", remote_engine.toml, settle=0.3)
    dropped: dict[str, int | None] = {}
    committed: dict[tuple[int, int], float] = {}
    answering: list[float] = []
    kill_at: list[float] = []
    phase = ""
    try:
        for n in range(kills):
            # Each round brings one more file, dropped just before or after the start.
            src, pages = FILES[n % len(FILES)]
            name = f"r{n:02d}-{Path(src).name}"
            if rng.random() < 0.5:
                drop(corpus_dir / src, d.inbox, name)
                d.start()
            else:
                d.start()
                drop(corpus_dir / src, d.inbox, name)
            dropped[name] = pages
            # A quarter of the kills land during start-up, a quarter at a random time once
            # it serves, half just after the k-th newly committed page (mid-batch, often
            # mid-output or mid-move when k reaches a file's last page).
            t0 = time.monotonic()
            dice = rng.random()
            if dice < 0.25:
                delay = rng.uniform(0.1, 2.0)
                phase = "start-up"
            else:
                d.wait_answering(60, every=0.1)
                answering.append(time.monotonic() - t0)
                delay = rng.uniform(0.1, 4.0) if dice < 0.5 else rng.uniform(0.0, 0.5)
                phase = "serving"
                remaining = sum(p or 0 for p in dropped.values()) - len(d.done_pages())
                if dice >= 0.5 and remaining > 0:
                    k = min(rng.randint(1, 6), remaining)
                    target = len(d.done_pages()) + k
                    phase = f"serving, {k} pages after restart"
                    try:
                        d.wait_for("pages committed", lambda t=target: len(d.done_pages())  # type: ignore[misc]
                                   >= t, 30, every=0.05)
                    except AssertionError:
                        phase += " (not reached in 30 s)"
                t0 = time.monotonic()
            kill_at.append(delay)
            while time.monotonic() - t0 < delay:
                time.sleep(0.02)
            before = d.done_pages()
            d.kill9()
            print(f"round {n}: kill -9 {delay:.2f}s into {phase}, {len(before)} pages "
                  "committed", flush=True)
            for key, at in before.items():
                committed.setdefault(key, at)
            if d.db_path.exists():  # a kill early in the first start-up precedes the store
                with sqlite3.connect(f"file:{d.db_path}?mode=ro", uri=True) as conn:
                    assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            after = d.done_pages()  # what the store says after the kill
            changed = [k for k, t in committed.items() if k in after and after[k] != t]
            assert not changed, f"round {n} (seed {seed}): committed pages changed {changed}"
        d.start()
        answering.append(d.wait_answering(60))
        d.wait_stored_final(dropped, 300)
        a = audit(d, dropped, committed)
        assert d.stop() == 0
    finally:
        d.cleanup()
    done_pages = sum(p or 0 for p in dropped.values())
    record(f"daemon SIGKILL at random points (N={kills}, seed {seed})",
           f"each restart: in-flight pages released, {len(committed)} committed pages kept "
           f"as they were, outputs rebuilt from the store; all {len(dropped)} files "
           f"({done_pages} pages) finished: {a.states}",
           lost=len(a.lost) + len(a.bad_outputs), twice=len(a.done_twice),
           serving_s=statistics.median(answering))
    a.assert_clean()
