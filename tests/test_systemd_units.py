"""The shipped systemd files against the shipped config, ``check-config --unit``, and what
the daemon leaves for systemd at a stop or a refused reload.

The full proof is a boot under a real systemd (``test_systemd_boot.py``); these run in
seconds on any host: the unit, sysusers and tmpfiles files are read as systemd reads
them, the real ``chandrad check-config`` and ``chandrad run`` run as subprocesses.
"""

from __future__ import annotations

import grp
import os
import pwd
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from test_daemon_service import Datagrams, base_env, start, write_config

from chandrad.config import load_config
from chandrad.systemd import read_unit, unit_problems

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "chandrad.service"
EXAMPLE = ROOT / "etc" / "chandrad.toml"


def check_config(config: Path, unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chandrad", "check-config", "--config",
                           str(config), "--unit", str(unit)],
                          capture_output=True, text=True, timeout=120)


def test_example_config_folders_are_writable_and_created_under_the_unit() -> None:
    """Every folder the example config writes is inside the unit's ReadWritePaths= (or
    StateDirectory=), its mount is required, and tmpfiles creates each watch folder."""
    cfg = load_config(EXAMPLE)
    unit = read_unit(UNIT)
    assert unit.strict and unit.user == "chandrad"
    assert unit_problems(cfg, unit) == []
    created = {Path(line.split()[1]) for line in
               (ROOT / "systemd" / "chandrad.tmpfiles").read_text().splitlines()
               if line.startswith("d ")}
    for watch in cfg.watch:
        assert {watch.input, watch.output, watch.done, watch.failed} <= created
    mounts = [line.split("=", 1)[1].split() for line in UNIT.read_text().splitlines()
              if line.startswith("RequiresMountsFor=")]
    assert all(any(Path(m) in (w.input, *w.input.parents) for m in sum(mounts, []))
               for w in cfg.watch)


def test_sysusers_makes_the_daemon_a_member_of_the_control_group() -> None:
    """``[control] group = "chandrad-ctl"`` needs chandrad in chandrad-ctl (the socket's
    group is set with chown) and chown allowed by the unit's SystemCallFilter=."""
    lines = [line.split() for line in
             (ROOT / "systemd" / "chandrad.sysusers").read_text().splitlines()
             if line and not line.startswith("#")]
    assert ["m", "chandrad", "chandrad-ctl"] in [line[:3] for line in lines]
    assert read_unit(UNIT).chown_allowed


def test_check_config_names_what_the_unit_refuses(tmp_path: Path) -> None:
    """A folder outside ReadWritePaths= and a control group the unit's user is not in are
    exit 78 naming the key, when checked for the unit; the same config without --unit
    is fine (that is what the shipped pair hid)."""
    me = pwd.getpwuid(os.getuid()).pw_name
    foreign = next(g.gr_name for g in grp.getgrall()
                   if g.gr_gid not in os.getgrouplist(me, os.getgid()))
    srv = tmp_path / "srv"  # the unit's /srv/chandrad, here
    (srv / "inbox").mkdir(parents=True)
    unit = tmp_path / "chandrad.service"
    unit.write_text(UNIT.read_text().replace("User=chandrad", f"User={me}")
                    .replace("Group=chandrad", "Group=" + grp.getgrgid(os.getgid()).gr_name)
                    .replace("/srv/chandrad", str(srv)))
    config = tmp_path / "chandrad.toml"
    config.write_text(EXAMPLE.read_text()
                      .replace("/srv/chandrad/output", str(tmp_path / "output"))
                      .replace("/srv/chandrad", str(srv))
                      .replace('group = ""', f'group = "{foreign}"')
                      .replace('url = ""', 'url = "http://127.0.0.1:9"'))
    got = check_config(config, unit)
    assert got.returncode == 78, got.stdout + got.stderr
    assert "watch[0].output" in got.stderr and "ReadWritePaths=" in got.stderr
    assert "control.group" in got.stderr and "not a member" in got.stderr
    config.write_text(config.read_text().replace(f'group = "{foreign}"', 'group = ""')
                      .replace(str(tmp_path / "output"), str(srv / "output")))
    ok = check_config(config, unit)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "every folder is writable in its sandbox" in ok.stdout


def test_refused_reload_stays_in_systemd_status(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    """SIGHUP with a bad config: READY=1 with ``STATUS=reload failed: <key>…``, and the
    status keeps saying so (the main loop's updates too) until a reload applies."""
    notify = Datagrams(tmp_path / "notify.sock")
    config = write_config(tmp_path, f'url = "http://127.0.0.1:{free_port()}"',
                          tmp_path / "ctl.sock")
    good = config.read_text()
    env = base_env() | {"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}
    proc = start(config, env, tmp_path / "daemon.log")
    try:
        notify.wait_for(lambda m: b"READY=1" in m, 60)
        config.write_text(good.replace("[engine]", "[engine]\nbogus_key = 1"))
        proc.send_signal(signal.SIGHUP)
        refused = notify.wait_for(lambda m: b"READY=1" in m and b"reload failed" in m, 30)
        assert b"STATUS=reload failed: " in refused and b"engine.bogus_key" in refused
        (tmp_path / "inbox" / "note.txt").write_text("queue changes: a new status line")
        notify.pump(3.0)
        statuses = [m for m in notify.received if m.startswith(b"STATUS=")]
        assert statuses[-1].startswith(b"STATUS=reload failed: "), statuses[-3:]
        config.write_text(good)
        mark = len(notify.received)
        proc.send_signal(signal.SIGHUP)
        applied = notify.wait_for(
            lambda m: b"READY=1" in m and notify.received.index(m) >= mark, 30)
        assert b"reload failed" not in applied
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


RENDER_THEN_EXIT = """
import asyncio, os, sys
from pathlib import Path
from chandrad.render import RenderPool

async def main() -> None:
    pool = RenderPool(1)
    await pool.probe(Path(sys.argv[1]), 10)
    pool.close()

asyncio.run(main())
pid = os.getpid()
print(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
"""


def test_closed_render_pool_leaves_no_resource_tracker() -> None:
    """After the pool closes no child is left (multiprocessing's resource tracker was
    one: systemd SIGKILLed it at every stop)."""
    sample = ROOT / "tests" / "corpus" / "good" / "image_hi-devanagari.png"
    got = subprocess.run([sys.executable, "-c", RENDER_THEN_EXIT, str(sample)],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == "[]", got.stdout
    assert "leaked" not in got.stderr, got.stderr


def test_unit_reader_follows_systemd_list_semantics(tmp_path: Path) -> None:
    """Filter lines apply in order (a deny of @privileged takes chown away, a later
    @chown gives it back); an empty ReadWritePaths= resets the list; ProtectHome= hides
    /home from a watch there."""
    unit = tmp_path / "u.service"
    base = UNIT.read_text()
    unit.write_text(base.replace("SystemCallFilter=@chown\n", ""))
    assert not read_unit(unit).chown_allowed
    unit.write_text(base + "\n[Service]\nReadWritePaths=\nReadWritePaths=/data\n")
    sandbox = read_unit(unit)
    assert Path("/srv/chandrad") not in sandbox.writable
    assert Path("/data") in sandbox.writable and Path("/var/lib/chandrad") in sandbox.writable
    cfg = load_config(EXAMPLE)
    keys = {p.key for p in unit_problems(cfg, sandbox)}
    assert keys == {f"watch[0].{name}" for name in ("input", "output", "done", "failed")}
