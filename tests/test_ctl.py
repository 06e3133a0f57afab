"""``chandractl`` end to end: the real entry point in a subprocess against a real server.

Permission tiers use a second real uid (``nobody``) through ``setpriv``; they need root
(as in CI) and a venv that ``nobody`` can execute — the repository and the interpreter
are world-readable here; the fixture checks and skips with the reason otherwise. The
socket lives in a 0755 directory of ours because pytest's tmp dirs are 0700.
"""

from __future__ import annotations

import grp
import io
import json
import os
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_harness import ServerThread
from waiting import exited, holds_for, wait_until

from chandrad import config as config_module
from chandrad.ctl import client
from chandrad.ctl.client import resolve_socket
from chandrad.ctl.render import render


def ctl(sock: Path | None, *argv: str, user: list[str] | None = None,
        env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``python -m chandrad.ctl.main`` as a real process."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("CHANDRAD_") and k != "RUNTIME_DIRECTORY"}
    base.update(env or {})
    socket_opt = ["--socket", str(sock)] if sock else []
    cmd = [*(user or []), sys.executable, "-m", "chandrad.ctl.main", *socket_opt, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, env=base, cwd="/",
                          timeout=timeout, check=False)


@pytest.fixture
def public_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="chandrad-ctl-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(public_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(public_dir / "control.sock") as st:
        yield st


@pytest.fixture
def temp_group() -> Iterator[grp.struct_group]:
    """A fresh group with ``nobody`` as a member; removed afterwards."""
    name = f"chandrad-t{os.getpid() % 100000}"
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    try:
        subprocess.run(["gpasswd", "-a", "nobody", name], check=True, capture_output=True)
        yield grp.getgrnam(name)
    finally:
        subprocess.run(["groupdel", name], check=False, capture_output=True)


# ------------------------------------------------------------------ commands


def test_every_daemon_command_reaches_the_daemon(server: ServerThread) -> None:
    """Each subcommand exits 0 and calls the matching DaemonControl method with its args."""
    steps = [
        (["status"], ("status", {})),
        (["queue", "--state", "failed"], ("queue", {"state": "failed", "limit": 1000})),
        (["gpu"], ("gpu", {})),
        (["version"], ("version", {})),
        (["pause"], ("pause", {})),
        (["resume"], ("resume", {})),
        (["retry", "2"], ("retry", {"job_id": 2, "all_failed": False})),
        (["retry", "--failed"], ("retry", {"job_id": None, "all_failed": True})),
        (["cancel", "3"], ("cancel", {"job_id": 3})),
        (["reload"], ("reload", {"wait": False})),
        (["engine", "restart"], ("engine_restart", {})),
        (["rescan"], ("rescan", {})),
        (["drain"], ("drain", {"wait": False})),
    ]
    for argv, call in steps:
        before = len(server.daemon.calls)
        proc = ctl(server.path, *argv)
        assert proc.returncode == 0, (argv, proc.stderr)
        assert server.daemon.calls[before:][-1] == call, argv
    assert server.daemon.jobs[3]["state"] == "cancelled"
    assert server.daemon.state == "draining"


def test_status_json_is_the_versioned_result(server: ServerThread) -> None:
    """``status --json`` prints the result object alone, with v and the documented keys."""
    proc = ctl(server.path, "status", "--json")
    assert proc.returncode == 0
    doc = json.loads(proc.stdout)
    assert doc["v"] == 1
    assert set(doc["daemon"]) >= {"state", "pid", "uptime_s"}
    assert set(doc["engine"]) >= {"state", "pid", "restarts", "profile", "last_failure"}
    assert set(doc["queue"]) == {"pending", "active", "done", "failed"}
    assert doc["engine"]["state"] == "backoff"
    assert "ok" not in doc and "result" not in doc


def test_status_plain_text_when_not_a_tty(server: ServerThread) -> None:
    """Piped ``status`` is plain aligned text with the states, failure and GPU memory."""
    proc = ctl(server.path, "status")
    assert proc.returncode == 0
    out = proc.stdout
    assert "\x1b[" not in out, "no terminal escapes in a pipe"
    for fragment in ("running", "backoff", "restarts 2", "cuda_oom_load", "enforce_eager",
                     "pending 1", "12.5 (1m)", "71.0 / 140.0 GiB", "VLLM::EngineCore 70.0 GiB"):
        assert fragment in out, fragment
    # Read under protocol.FailureStatus' one spelling (at_wall), not guessed: a date, not "-".
    assert re.search(r"last failure +cuda_oom_load at \d{4}-\d\d-\d\d ", out), out


def test_rich_table_keeps_brackets_literal(server: ServerThread) -> None:
    """On a TTY, rich draws the queue and a file name with [brackets] is not eaten as markup."""
    proc = ctl(server.path, "queue", "--json")
    buf = io.StringIO()
    render("queue", json.loads(proc.stdout), buf, tty=True)
    out = buf.getvalue()
    assert "c [draft].png" in out
    assert "corrupt_input" in out  # rich may fold the rest at 80 columns
    assert "┃" in out or "│" in out, "rich table borders"


def test_queue_filter_and_version_json(server: ServerThread) -> None:
    """``queue --state`` filters on the daemon side; ``version --json`` has client and daemon."""
    jobs = json.loads(ctl(server.path, "queue", "--state", "failed", "--json").stdout)["jobs"]
    assert [j["id"] for j in jobs] == [2]
    version = json.loads(ctl(server.path, "version", "--json").stdout)
    assert version["v"] == 1 and version["protocol"] == 1
    assert version["client"] == version["daemon"] == "0.1.0"


def test_reload_wait_blocks_until_the_daemon_answers(server: ServerThread) -> None:
    """``reload --wait`` has no client timeout: it returns when the daemon finishes."""
    proc = subprocess.Popen([sys.executable, "-m", "chandrad.ctl.main", "--socket",
                             str(server.path), "reload", "--wait", "--json"],
                            stdout=subprocess.PIPE, text=True, cwd="/")
    wait_until(lambda: ("reload", {"wait": True}) in server.daemon.calls, 15, "reload called",
               every=0.05, gone=exited(proc))
    holds_for(lambda: proc.poll() is None, 0.3, "chandractl still waiting for the daemon",
              every=0.05)
    server.release()
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0
    assert json.loads(out) == {"v": 1, "reloaded": True, "engine_restarted": False}


# ------------------------------------------------------------------ exit codes


def test_not_found_exits_4_and_invalid_state_exits_1(server: ServerThread) -> None:
    """LSB: unknown job is 4, a refused state change is 1, with the daemon's message."""
    proc = ctl(server.path, "retry", "999")
    assert proc.returncode == 4 and "not_found: no job 999" in proc.stderr
    proc = ctl(server.path, "resume")
    assert proc.returncode == 1 and "invalid_state" in proc.stderr


def test_no_daemon_exits_3_with_a_hint(public_dir: Path) -> None:
    """No socket, or a dead socket node, is exit 3 with how to start chandrad."""
    proc = ctl(public_dir / "missing.sock", "status")
    assert proc.returncode == 3
    assert "systemctl start chandrad" in proc.stderr and "chandrad run" in proc.stderr
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(public_dir / "dead.sock"))
    dead.close()
    proc = ctl(public_dir / "dead.sock", "pause")
    assert proc.returncode == 3 and "is chandrad running?" in proc.stderr


def test_usage_errors_exit_2() -> None:
    """A missing subcommand or a bad argument is a usage error (2)."""
    assert ctl(None, "retry").returncode == 2
    assert ctl(None, "cancel", "notanumber").returncode == 2
    assert ctl(None, "frobnicate").returncode == 2


# ------------------------------------------------------------------ socket path


def test_socket_from_environment_and_config(server: ServerThread, public_dir: Path) -> None:
    """Without --socket: $CHANDRAD_SOCKET, else the config's control.socket."""
    proc = ctl(None, "status", "--json", env={"CHANDRAD_SOCKET": str(server.path)})
    assert proc.returncode == 0
    config = public_dir / "chandrad.toml"
    config.write_text(f'[control]\nsocket = "{server.path}"\n')
    proc = ctl(None, "status", "--json", env={"CHANDRAD_CONFIG": str(config)})
    assert proc.returncode == 0, proc.stderr


def test_resolve_socket_order(tmp_path: Path) -> None:
    """--socket beats the environment, which beats RUNTIME_DIRECTORY, config and default."""
    config = tmp_path / "c.toml"
    config.write_text('[control]\nsocket = "/srv/c.sock"\n')
    env = {"CHANDRAD_SOCKET": "/a.sock", "RUNTIME_DIRECTORY": "/run/x",
           "CHANDRAD_CONFIG": str(config)}
    assert resolve_socket("/opt.sock", env) == Path("/opt.sock")
    assert resolve_socket(None, env) == Path("/a.sock")
    del env["CHANDRAD_SOCKET"]
    assert resolve_socket(None, env) == Path("/run/x/control.sock")
    del env["RUNTIME_DIRECTORY"]
    assert resolve_socket(None, env) == Path("/srv/c.sock")
    config.write_text("[control]\nsocket = 7\n")  # broken config: fall back to the default
    assert resolve_socket(None, env) == Path("/run/chandrad/control.sock")
    assert resolve_socket(None, {"CHANDRAD_CONFIG": str(tmp_path / "none.toml")}) == Path(
        "/run/chandrad/control.sock")
    # The client keeps its own copies of these defaults to start fast; they must agree.
    assert client.DEFAULT_CONFIG == config_module.DEFAULT_CONFIG_PATH
    assert config_module.ControlConfig().socket == client.DEFAULT_SOCKET


def test_client_path_imports_stay_light(server: ServerThread) -> None:
    """``status --json`` loads none of the daemon's heavy libraries, nor rich."""
    code = (
        "import sys, io, contextlib\n"
        "from chandrad.ctl.main import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main(['--socket', {str(server.path)!r}, 'status', '--json'])\n"
        "heavy = ('structlog', 'watchdog', 'fitz', 'pymupdf', 'httpx', 'rich', 'PIL', 'vllm')\n"
        "print(rc, sorted(m for m in heavy if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd="/", check=False)
    assert proc.stdout.strip() == "0 []", proc.stderr


# ------------------------------------------------------------------ permissions


def test_outsider_is_forbidden_even_to_read(as_nobody: list[str], public_dir: Path) -> None:
    """On a world-writable socket, a uid outside the group gets ``forbidden`` (4) for all."""
    with ServerThread(public_dir / "c.sock", mode=0o666) as st:
        for argv in (["status"], ["pause"]):
            proc = ctl(st.path, *argv, user=as_nobody)
            assert proc.returncode == 4, proc.stderr
            assert "forbidden" in proc.stderr
        assert st.daemon.calls == []


def test_outsider_cannot_connect_to_0660_socket(as_nobody: list[str], public_dir: Path) -> None:
    """With the default mode the kernel refuses the connect: exit 4 with a group hint."""
    with ServerThread(public_dir / "c.sock") as st:
        proc = ctl(st.path, "status", user=as_nobody)
        assert proc.returncode == 4
        assert "permission denied" in proc.stderr and "group" in proc.stderr


@pytest.mark.parametrize("membership", ["supplementary", "primary"])
def test_group_member_may_read_not_write(
    as_nobody: list[str], public_dir: Path, temp_group: grp.struct_group, membership: str
) -> None:
    """A member of control.group reads status/queue but pause/cancel are forbidden (4)."""
    if membership == "supplementary":
        user = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--init-groups"]
    else:
        user = ["setpriv", "--reuid=nobody", f"--regid={temp_group.gr_gid}", "--clear-groups"]
    with ServerThread(public_dir / "c.sock", group=temp_group.gr_name) as st:
        assert os.stat(st.path).st_gid == temp_group.gr_gid
        assert ctl(st.path, "status", user=user).returncode == 0
        assert ctl(st.path, "queue", "--json", user=user).returncode == 0
        for argv in (["pause"], ["cancel", "1"]):
            proc = ctl(st.path, *argv, user=user)
            assert proc.returncode == 4 and "forbidden" in proc.stderr, proc.stderr
        assert [c[0] for c in st.daemon.calls] == ["status", "queue"]


@pytest.fixture
def memberless_group() -> Iterator[grp.struct_group]:
    """A fresh group with no members in the group database; removed afterwards."""
    name = f"chandrad-s{os.getpid() % 100000}"
    subprocess.run(["groupadd", name], check=True, capture_output=True)
    try:
        yield grp.getgrnam(name)
    finally:
        subprocess.run(["groupdel", name], check=False, capture_output=True)


def test_supplementary_group_of_the_process_may_read(
    as_nobody: list[str], public_dir: Path, memberless_group: grp.struct_group
) -> None:
    """A client holding the socket's group only as a process supplementary gid may read.

    That is a client unit with ``SupplementaryGroups=chandrad``: the group database does
    not list the user, but the process holds the gid (setgroups in the child), which is
    what let it open the 0660 node. ``SO_PEERGROUPS`` tells the server.
    """
    gid = memberless_group.gr_gid
    assert "nobody" not in memberless_group.gr_mem
    user = ["setpriv", "--reuid=nobody", "--regid=nogroup", f"--groups={gid}"]
    with ServerThread(public_dir / "c.sock", group=memberless_group.gr_name) as st:
        proc = ctl(st.path, "status", "--json", user=user)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["daemon"]["state"] == "running"
        proc = ctl(st.path, "pause", user=user)
        assert proc.returncode == 4 and "forbidden" in proc.stderr, proc.stderr
        assert [c[0] for c in st.daemon.calls] == ["status"]


def test_daemon_own_uid_may_write(as_nobody: list[str], public_dir: Path) -> None:
    """The daemon's own (non-root) uid has the write tier."""
    nobody_uid = pwd.getpwnam("nobody").pw_uid
    with ServerThread(public_dir / "c.sock", mode=0o666, owner_uid=nobody_uid) as st:
        proc = ctl(st.path, "pause", user=as_nobody)
        assert proc.returncode == 0, proc.stderr
        assert st.daemon.calls == [("pause", {})]


# ------------------------------------------------------------------ offline commands


def test_diagnose_works_without_a_daemon(public_dir: Path) -> None:
    """``diagnose FILE --json`` classifies log text with no daemon running."""
    pytest.importorskip("chandrad.ctl.diagnose", reason="chandrad.ctl.diagnose not written yet")
    log = public_dir / "vllm.log"
    log.write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. "
                   "GPU 0 has a total capacity of 79.25 GiB of which 1.20 GiB is free.\n")
    proc = ctl(public_dir / "missing.sock", "diagnose", str(log), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["class"] in ("cuda_oom_load", "cuda_oom_runtime")
