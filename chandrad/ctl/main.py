"""``chandractl``: the operator's command line for a running chandrad (README.md, Commands).

Owns the argument parser, the mapping of subcommands to control commands, and the
one place where exceptions become LSB exit statuses (``errors.CtlExit``: 0 ok,
1 error, 3 daemon not running, 4 unknown/forbidden). Imports stay light so the
client starts fast: rich loads only to draw a table, ``logs``/``diagnose`` modules
only when asked for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from chandrad import PROTOCOL_VERSION, __version__
from chandrad.ctl.client import call, resolve_socket
from chandrad.errors import (
    CTL_EXIT4_CODES,
    ChandradError,
    ControlAccessDenied,
    ControlError,
    CtlExit,
    DaemonNotRunning,
)

#: Daemon commands whose reply may take as long as the work (no client timeout).
WAITING = ("drain", "reload")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chandractl", description="Control a running chandrad over its Unix socket."
    )
    parser.add_argument("--socket", metavar="PATH",
                        help="control socket (default: $CHANDRAD_SOCKET, "
                             "$RUNTIME_DIRECTORY/control.sock, the config's control.socket, "
                             "/run/chandrad/control.sock)")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="seconds to wait for a reply (default 30; none with --wait)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str, json_flag: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        if json_flag:
            p.add_argument("--json", action="store_true", help="print the versioned JSON result")
        return p

    status = command("status", "daemon, engine, queue, throughput, GPU and last failure")
    status.add_argument("--cluster", action="store_true",
                        help="the hosts sharing the PostgreSQL queue (daemon.store), read "
                             "from the database")
    status.add_argument("--config", type=Path, metavar="PATH",
                        help="with --cluster: the config naming daemon.store (default: "
                             "$CHANDRAD_CONFIG, /etc/chandrad/chandrad.toml)")
    command("queue", "jobs with state, pages, attempts and error").add_argument(
        "--state", choices=("pending", "running", "held", "done", "partial", "failed",
                            "cancelled"))
    command("pause", "stop dispatching new pages (in-flight pages finish)")
    command("resume", "dispatch pages again")
    command("drain", "finish accepted work, accept no new files").add_argument(
        "--wait", action="store_true", help="return only once drained")
    retry = command("retry", "requeue a failed, partial (its failed pages) or cancelled "
                    "job, or all failed jobs")
    target = retry.add_mutually_exclusive_group(required=True)
    target.add_argument("job", nargs="?", type=int, help="job id")
    target.add_argument("--failed", action="store_true",
                        help="every failed job (not partial ones)")
    command("cancel", "cancel a queued or running job").add_argument("job", type=int)
    command("reload", "re-read the config; restart the engine only if its settings changed"
            ).add_argument("--wait", action="store_true", help="return once reloaded")
    engine = command("engine", "engine commands", json_flag=False)
    engine_sub = engine.add_subparsers(dest="engine_command", required=True, metavar="ACTION")
    restart = engine_sub.add_parser("restart", help="restart an engine (default: every "
                                    "engine) with its current profile")
    restart.add_argument("--json", action="store_true")
    which = restart.add_mutually_exclusive_group()
    which.add_argument("id", nargs="?", metavar="ID", help="the engine id (chandractl status)")
    which.add_argument("--all", action="store_true", help="every engine (the default)")
    command("rescan", "rescan every watched folder now")
    command("gpu", "per-GPU memory and the processes holding it")
    top = command("top", "live view: engine, job progress, pages/min, recent failures "
                  "(q or Ctrl-C quits; plain lines when not on a terminal)", json_flag=False)
    top.add_argument("--interval", type=float, default=1.0, metavar="SECONDS",
                     help="seconds between refreshes (default 1)")
    top.add_argument("-n", "--iterations", type=int, metavar="N",
                     help="stop after N refreshes (default: until q or Ctrl-C)")
    command("version", "client, daemon and protocol versions")
    logs = command("logs", "journal analysis: failures, profile changes, restarts, advice")
    logs.add_argument("--since", metavar="T", help="journalctl --since value, e.g. '1 hour ago'")
    logs.add_argument("--unit", metavar="U", default="chandrad", help="systemd unit")
    logs.add_argument("--file", metavar="F", type=Path, help="read a journal file instead")
    diagnose = command("diagnose", "classify vLLM log text (a file, or - for stdin)")
    diagnose.add_argument("source", nargs="?", default="-", metavar="FILE|-")
    return parser


def _request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The control command and arguments for a parsed daemon subcommand."""
    cmd: str = args.command
    if cmd == "engine":
        return "engine_restart", {"engine": args.id} if args.id else {}
    if cmd == "queue":
        return cmd, {"state": args.state} if args.state else {}
    if cmd in WAITING:
        return cmd, {"wait": args.wait}
    if cmd == "retry":
        return cmd, {"failed": True} if args.failed else {"job": args.job}
    if cmd == "cancel":
        return cmd, {"job": args.job}
    return cmd, {}


def _run(args: argparse.Namespace, out: TextIO) -> int:
    if args.command == "logs":
        from chandrad.ctl.journal import run_logs

        return int(run_logs(since=args.since, unit=args.unit, file=args.file,
                            as_json=args.json, out=out))
    if args.command == "diagnose":
        from chandrad.ctl.diagnose import run_diagnose

        return int(run_diagnose(args.source, args.json, out))
    if args.command == "status" and args.cluster:
        from chandrad.ctl.cluster import run_cluster

        return run_cluster(args.config, args.json, out)
    if args.command == "top":
        from chandrad.ctl.top import run_top

        return run_top(resolve_socket(args.socket), max(0.1, args.interval), args.iterations,
                       out)
    cmd, cmd_args = _request(args)
    timeout = args.timeout
    if timeout is None:
        timeout = None if cmd_args.get("wait") else 30.0
    socket_path = resolve_socket(args.socket)
    if cmd_args.get("wait") and not args.json:
        from chandrad.ctl.top import wait_showing_progress

        result = wait_showing_progress(socket_path, cmd, cmd_args, timeout, out)
    else:
        result = call(socket_path, cmd, cmd_args, timeout=timeout)
    if cmd == "version":
        result["client"] = __version__
        result["client_protocol"] = PROTOCOL_VERSION
    if args.json:
        out.write(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    else:
        from chandrad.ctl.render import render

        render(cmd, result, out)
    return CtlExit.OK


def main(argv: list[str] | None = None) -> int:
    """Run ``chandractl``; return its exit status. The only exception → exit mapping."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0) if not isinstance(exc.code, str) else CtlExit.USAGE
    err = sys.stderr
    try:
        return int(_run(args, sys.stdout))
    except DaemonNotRunning as exc:
        err.write(f"chandractl: {exc.message}\n")
        return CtlExit.NOT_RUNNING
    except ControlAccessDenied as exc:
        err.write(f"chandractl: {exc.message}\n")
        return CtlExit.UNKNOWN_OR_FORBIDDEN
    except ControlError as exc:
        err.write(f"chandractl: {exc.error_code}: {exc.message}\n")
        if exc.error_code in CTL_EXIT4_CODES:
            return CtlExit.UNKNOWN_OR_FORBIDDEN
        return CtlExit.ERROR
    except ChandradError as exc:
        err.write(f"chandractl: {exc.message}\n")
        return CtlExit.ERROR
    except BrokenPipeError:
        # `chandractl queue | head`: the reader left. Point stdout at /dev/null so the
        # interpreter's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CtlExit.OK
    except KeyboardInterrupt:
        err.write("chandractl: interrupted\n")
        return CtlExit.ERROR
    except OSError as exc:
        err.write(f"chandractl: {exc}\n")
        return CtlExit.ERROR


if __name__ == "__main__":
    raise SystemExit(main())
