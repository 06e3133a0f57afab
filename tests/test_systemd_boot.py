"""chandrad installed by ``scripts/install.sh`` and run by a real systemd as PID 1.

A Debian 12 (bookworm) minbase root filesystem, debootstrapped once and kept as a tarball
in ``$CHANDRAD_CI_CACHE`` (default ``/var/cache/chandrad-ci``, outside the clone, so a
second run on the same machine starts from it), is unpacked fresh and booted with
``systemd-nspawn -b --register=no --keep-unit`` (this host has no D-Bus); commands run in
it through ``nsenter``. The checkout is bound read-only at ``/src/chandrad``; pip inside
installs from a wheelhouse built here with ``pip wheel`` (same cache), offline
(``PIP_NO_INDEX``), so the test is repeatable. The container shares the host's network:
the stand-in engine runs here on loopback and is the config's ``engine.url``.

Then an operator's checks, in order, one test (a boot is the expensive part): install as
the README says, ``systemctl start`` → active once READY=1; three corpus files dropped
into the example config's own inbox reach its output and ``done/``; a member of
``chandrad-ctl`` reads ``status``, a non-member gets exit 4 with the hint, the member's
``pause`` is refused; a valid reload applies, an invalid one keeps the old config with
``reload failed`` in ``StatusText``; SIGSTOP past ``WatchdogSec=`` → restarted;
``systemctl stop`` → ``Result=success`` with no "Killing process" line; ``systemd-analyze
security`` ≤ 2.0; an unknown key → exit 78 and no restart loop; a re-run of install.sh
keeps the config; ``--uninstall`` keeps the data.

Skipped, with the reason, only when not root or when nspawn cannot boot here.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from standin_engine import StandinServer

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("CHANDRAD_CI_CACHE", "/var/cache/chandrad-ci"))
SUITE = "bookworm"
#: What the container needs besides minbase: systemd as init, Python with venv (pip comes
#: from ensurepip), CA certificates. No D-Bus: systemctl talks to the private socket.
PACKAGES = ("systemd", "systemd-sysv", "python3", "python3-venv", "ca-certificates")
CORPUS = ROOT / "tests" / "corpus" / "good"
#: Three small corpus files (a PDF, a PNG, a JPEG).
DROPS = ("digital_sf424-federal-form.pdf", "image_hi-devanagari.png",
         "image_brochure-colour-300dpi_linn.jpg")
CONFIG = "/etc/chandrad/chandrad.toml"
#: Debian 12's Python: the wheelhouse holds what installs on it (soupsieve >= 2.11 needs
#: 3.11.5; pip on a Debian 12 server picks an older one itself, from PyPI).
DEBIAN_PYTHON = "3.11.2"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

pytestmark = pytest.mark.skipif(os.geteuid() != 0,
                                reason="needs root: debootstrap and systemd-nspawn")


def _log(message: str) -> None:
    print(f"[boot {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def debian_mirror() -> str:
    """The Debian mirror apt uses on this host (deb822 or one-line sources)."""
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        text = path.read_text() if path.is_file() else ""
        for match in re.finditer(r"(?m)^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text):
            uri = match.group(1)
            if "security" not in uri:
                return uri
    return "http://deb.debian.org/debian"


def rootfs_tarball() -> Path:
    """The cached bookworm minbase tarball, debootstrapped on first use."""
    mirror = debian_mirror()
    key = hashlib.sha256(f"{SUITE} {mirror} {' '.join(PACKAGES)}".encode()).hexdigest()[:10]
    tarball = CACHE / f"{SUITE}-minbase-{key}.tar"
    if tarball.exists():
        return tarball
    for tool in ("debootstrap", "systemd-nspawn"):
        assert shutil.which(tool), f"{tool} missing: scripts/setup.sh installs it"
    CACHE.mkdir(parents=True, exist_ok=True)
    work = CACHE / f"rootfs-{key}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    started = time.monotonic()
    got = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                          SUITE, str(work), mirror], capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    subprocess.run(["tar", "-C", str(work), "-cf", f"{tarball}.tmp", "."], check=True)
    os.replace(f"{tarball}.tmp", tarball)
    shutil.rmtree(work, ignore_errors=True)
    _log(f"debootstrap {SUITE} from {mirror}: {time.monotonic() - started:.0f} s")
    return tarball


def wheelhouse() -> Path:
    """chandrad's dependencies (and its build backend) as wheels for Debian 12's Python,
    fetched with the host's pip configuration; keyed by pyproject.toml, so built once
    per change. ``pip wheel`` builds what only comes as an sdist; ``pip
    download --python-version`` then adds the versions that Python needs."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [*pyproject["build-system"]["requires"], "wheel",
              *pyproject["project"]["dependencies"]]
    key = hashlib.sha256("\n".join([DEBIAN_PYTHON, *wanted]).encode()).hexdigest()[:10]
    house = CACHE / f"wheels-{key}"
    if (house / ".complete").exists():
        return house
    house.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    got = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir",
                          str(house), *wanted], capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--dest",
                          str(house), "--find-links", str(house), "--only-binary=:all:",
                          "--python-version", DEBIAN_PYTHON, *wanted],
                         capture_output=True, text=True, timeout=900)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    (house / ".complete").write_text("")
    _log(f"wheelhouse {house}: {time.monotonic() - started:.0f} s")
    return house


@dataclass
class Container:
    """A booted container: its root on the host, nspawn's process, PID 1's host pid."""

    root: Path
    nspawn: subprocess.Popen[bytes]
    leader: int

    def sh(self, command: str, *, timeout: float = 120,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``bash -c command`` inside every namespace of the container, as root."""
        pairs = [f"{k}={v}" for k, v in {"PATH": PATH, "LANG": "C.UTF-8", **(env or {})}.items()]
        return subprocess.run(["nsenter", "-t", str(self.leader), "-a", "/usr/bin/env", "-i",
                               *pairs, "bash", "-c", command],
                              capture_output=True, text=True, timeout=timeout)

    def ok(self, command: str, **kwargs: object) -> str:
        got = self.sh(command, **kwargs)  # type: ignore[arg-type]
        assert got.returncode == 0, f"{command}: rc {got.returncode}\n{got.stdout}\n{got.stderr}"
        return got.stdout

    def show(self, *props: str) -> dict[str, str]:
        out = self.ok(f"systemctl show chandrad -p {','.join(props)}")
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def _container_init(nspawn_pid: int) -> int | None:
    """The host pid of the container's PID 1: a descendant of nspawn that is pid 1 in
    its own namespace."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
        except OSError:
            continue
        nspid = re.search(r"^NSpid:\s+(.*)$", text, re.M)
        ppid = re.search(r"^PPid:\s+(\d+)$", text, re.M)
        if not nspid or not ppid or nspid.group(1).split()[-1] != "1":
            continue
        if len(nspid.group(1).split()) < 2:
            continue
        parent = int(ppid.group(1))
        for _ in range(4):
            if parent == nspawn_pid:
                return int(status.parent.name)
            try:
                parent = int(re.findall(r"^PPid:\s+(\d+)$",
                                        Path(f"/proc/{parent}/status").read_text(), re.M)[0])
            except (OSError, IndexError):
                break
    return None


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    if not shutil.which("systemd-nspawn"):
        pytest.fail("systemd-nspawn missing: scripts/setup.sh installs systemd-container")
    tarball = rootfs_tarball()
    wheels = wheelhouse()
    root = Path("/var/tmp") / f"chandrad-boot-{os.getpid()}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()
    subprocess.run(["tar", "-C", str(root), "-xf", str(tarball)], check=True)
    (root / "etc" / "hostname").write_text("chandrad-ci\n")
    log = tmp_path_factory.mktemp("nspawn") / "console.log"
    started = time.monotonic()
    with log.open("wb") as out:
        nspawn = subprocess.Popen(
            ["systemd-nspawn", "-D", str(root), "-b", "--register=no", "--keep-unit",
             "--console=pipe", f"--bind-ro={ROOT}:/src/chandrad", f"--bind-ro={wheels}:/wheels",
             "--machine=chandrad-ci"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    leader = None
    deadline = time.monotonic() + 60
    while leader is None and time.monotonic() < deadline and nspawn.poll() is None:
        time.sleep(0.2)
        leader = _container_init(nspawn.pid)
    box = Container(root, nspawn, leader or 0)
    try:
        booted = ""
        while leader and time.monotonic() < deadline:
            booted = box.sh("systemctl is-system-running", timeout=10).stdout.strip()
            if booted in ("running", "degraded"):
                break
            time.sleep(0.3)
        if booted not in ("running", "degraded"):
            pytest.skip(f"systemd-nspawn cannot boot {SUITE} here (state {booted!r}, nspawn "
                        f"exit {nspawn.poll()}): {log.read_text(errors='replace')[-1500:]}")
        _log(f"booted in {time.monotonic() - started:.1f} s ({booted})")
        yield box
    finally:
        if nspawn.poll() is None:
            os.kill(nspawn.pid, signal.SIGTERM)  # nspawn asks the container's systemd to halt
            try:
                nspawn.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(nspawn.pid, signal.SIGKILL)
                nspawn.wait(10)
        shutil.rmtree(root, ignore_errors=True)


def wait_for(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s: {what}"
        time.sleep(0.3)


def edit_config(box: Container, pattern: str, replacement: str) -> None:
    path = box.root / CONFIG.lstrip("/")
    text = path.read_text()
    new = re.sub(pattern, replacement, text, count=1, flags=re.M)
    assert new != text, pattern
    path.write_text(new)


def test_install_and_operate_under_systemd(container: Container, tmp_path: Path) -> None:
    box = container
    pip_env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "/wheels",
               "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    readme = (ROOT / "README.md").read_text()
    assert "sudo scripts/install.sh --engine none" in readme
    started = time.monotonic()
    out = box.ok("cd /src/chandrad && scripts/install.sh --engine none", env=pip_env, timeout=600)
    _log(f"install.sh --engine none (cold): {time.monotonic() - started:.1f} s\n{out}")
    assert (box.root / "usr/local/bin/chandrad").is_symlink()
    assert "chandrad-ctl" in box.ok("id -nG chandrad").split()

    engine = StandinServer(tmp_path / "engine").start()
    try:
        # The one edit the README asks for with --engine none, plus a group for the
        # control checks and short systemd timings (a drop-in, as an operator would).
        edit_config(box, r'^url = ""', f'url = "{engine.url}"')
        edit_config(box, r'^group = ""', 'group = "chandrad-ctl"')
        edit_config(box, r"^settle_seconds = 2.0", "settle_seconds = 0.5")
        edit_config(box, r"^render_workers = 0", "render_workers = 1")
        # The container shares the host's network: keep off a port the host may hold.
        edit_config(box, r'^listen = "127.0.0.1:9478"', 'listen = ""')
        dropin = box.root / "etc/systemd/system/chandrad.service.d/ci.conf"
        dropin.parent.mkdir(parents=True, exist_ok=True)
        dropin.write_text("[Service]\nWatchdogSec=4s\nRestartSec=1s\n")
        box.ok("systemctl daemon-reload")
        box.ok(f"chandrad check-config --config {CONFIG}")

        # start → active only after READY=1 (Type=notify)
        t0 = time.monotonic()
        box.ok("systemctl start chandrad", timeout=150)
        props = box.show("ActiveState", "SubState", "StatusText", "NRestarts")
        assert props["ActiveState"] == "active", props
        assert props["StatusText"].startswith("running"), props
        _log(f"systemctl start: {time.monotonic() - t0:.1f} s; {props['StatusText']}")

        # three corpus files through the example config's own inbox
        drop = box.root / "var/tmp/drop"
        drop.mkdir(parents=True)
        for name in DROPS:
            shutil.copy(CORPUS / name, drop / name)
        box.ok("chmod 0644 /var/tmp/drop/* && mv /var/tmp/drop/* /srv/chandrad/inbox/")
        srv = box.root / "srv/chandrad"
        t0 = time.monotonic()
        wait_for("three files done", lambda: all((srv / "done" / n).exists() for n in DROPS), 90)
        for name in DROPS:
            stem = Path(name).stem
            assert list((srv / "output").glob(f"**/{stem}/*.md")), (name, list(srv.rglob("*")))
        _log(f"three files processed in {time.monotonic() - t0:.1f} s")

        # control: a member reads status, a non-member gets 4 + hint, pause is refused
        box.ok("useradd -M -G chandrad-ctl alice && useradd -M bob")
        status = box.sh("runuser -u alice -- chandractl status")
        assert status.returncode == 0, status.stdout + status.stderr
        bob = box.sh("runuser -u bob -- chandractl status")
        assert bob.returncode == 4, bob.stdout + bob.stderr
        assert "chandrad-ctl" in bob.stderr, bob.stderr
        pause = box.sh("runuser -u alice -- chandractl pause")
        assert pause.returncode == 4, pause.stdout + pause.stderr

        # reload: a valid one applies, an invalid one keeps the old config and says so
        edit_config(box, r"^max_output_tokens = 12384", "max_output_tokens = 4096")
        box.ok("systemctl reload chandrad")
        wait_for("reloaded", lambda: "config_reloaded" in box.sh(
            "journalctl -u chandrad -o cat --no-pager | tail -20").stdout, 20)
        good = (box.root / CONFIG.lstrip("/")).read_text()
        (box.root / CONFIG.lstrip("/")).write_text(good.replace("[ocr]", "[ocr]\nbogus = 1"))
        box.ok("systemctl reload chandrad")
        wait_for("reload failed in StatusText",
                 lambda: box.show("StatusText")["StatusText"].startswith("reload failed"), 20)
        assert "ocr.bogus" in box.show("StatusText")["StatusText"]
        assert box.show("ActiveState")["ActiveState"] == "active"
        (box.root / CONFIG.lstrip("/")).write_text(good)
        box.ok("systemctl reload chandrad")
        wait_for("status line healthy again",
                 lambda: box.show("StatusText")["StatusText"].startswith("running"), 20)

        # SIGSTOP past WatchdogSec → watchdog abort → restarted
        pid = box.show("MainPID")["MainPID"]
        box.ok(f"kill -STOP {pid}")
        t0 = time.monotonic()
        wait_for("restarted by the watchdog", lambda: (
            lambda p: p["NRestarts"] == "1" and p["ActiveState"] == "active"
            and p["MainPID"] not in ("0", pid))(box.show("NRestarts", "ActiveState", "MainPID")),
            60)
        assert "watchdog" in box.sh("journalctl -u chandrad --no-pager | grep -i watchdog"
                                    ).stdout.lower()
        _log(f"watchdog restart after SIGSTOP: {time.monotonic() - t0:.1f} s")

        # stop: success, and systemd had nothing left to kill. One more file first, so that
        # this daemon has render workers (and had multiprocessing's resource tracker).
        shutil.copy(CORPUS / DROPS[1], drop / "again.png")
        box.ok("chmod 0644 /var/tmp/drop/* && mv /var/tmp/drop/* /srv/chandrad/inbox/")
        wait_for("again.png done", lambda: (srv / "done" / "again.png").exists(), 60)
        cursor = box.ok("journalctl -n0 --show-cursor --no-pager | tail -1").split("cursor: ")[-1]
        box.ok("systemctl stop chandrad", timeout=120)
        props = box.show("Result", "ActiveState")
        assert props == {"Result": "success", "ActiveState": "inactive"}, props
        stop_log = box.ok(f"journalctl --after-cursor='{cursor.strip()}' --no-pager")
        assert "Killing process" not in stop_log, stop_log

        # the sandbox's exposure
        security = box.ok("systemd-analyze security chandrad.service --no-pager")
        exposure = float(re.findall(r"Overall exposure level for chandrad.service: ([0-9.]+)",
                                    security)[0])
        _log(f"systemd-analyze security: {exposure}")
        assert exposure <= 2.0, security[-3000:]

        # an unknown key: exit 78 and no restart loop
        (box.root / CONFIG.lstrip("/")).write_text(good.replace("[daemon]", "[daemon]\nbogus = 1"))
        box.sh("systemctl start chandrad", timeout=60)
        wait_for("failed with 78", lambda: box.show("ActiveState")["ActiveState"] == "failed", 30)
        before = box.show("ExecMainStatus", "NRestarts")
        time.sleep(3)  # three times RestartSec=
        after = box.show("ExecMainStatus", "NRestarts", "ActiveState")
        assert after["ExecMainStatus"] == "78" and after["NRestarts"] == before["NRestarts"], after
        assert after["ActiveState"] == "failed", after
        (box.root / CONFIG.lstrip("/")).write_text(good)
    finally:
        engine.stop()

    # a re-run upgrades in place and keeps the config; --uninstall keeps the data
    t0 = time.monotonic()
    box.ok("cd /src/chandrad && scripts/install.sh --engine none", env=pip_env, timeout=600)
    _log(f"install.sh --engine none (warm re-run): {time.monotonic() - t0:.1f} s")
    assert "chandrad-ctl" in (box.root / CONFIG.lstrip("/")).read_text()
    box.ok("cd /src/chandrad && scripts/install.sh --uninstall")
    assert not (box.root / "opt/chandrad").exists()
    assert not (box.root / "usr/local/bin/chandrad").exists()
    assert (box.root / CONFIG.lstrip("/")).exists()
    assert list((box.root / "srv/chandrad/done").iterdir())
    assert (box.root / "var/lib/chandrad/chandrad.sqlite3").exists()
