"""Human output of ``chandractl``: rich tables on a terminal, plain aligned text otherwise.

Owns turning a reply's ``result`` into readable text. Every view is first built as a
list of :class:`Block` (a key/value list or a table), then written either with rich
(imported only here, only on a TTY) or as plain text that survives pipes and logs.
``--json`` output does not come through here. Each key is read under the one spelling
that ``chandrad.protocol`` gives it (``StatusReply``, ``GpuReply``); an older or newer daemon
that lacks a key shows ``-`` there.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from chandrad.states import ENGINE_FATAL_HINT

GIB = 1024**3
Row = tuple[str, ...]


@dataclass
class Block:
    """A titled key/value list (``headers`` empty) or a table."""

    title: str
    rows: list[Row] = field(default_factory=list)
    headers: tuple[str, ...] = ()


def duration(seconds: Any) -> str:
    """``3725`` → ``1h 2m 5s``; ``None`` → ``-``."""
    if not isinstance(seconds, (int, float)):
        return "-"
    s = int(seconds)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    parts = [f"{days}d"] if days else []
    if days or hours:
        parts.append(f"{hours}h")
    if days or hours or minutes:
        parts.append(f"{minutes}m")
    if not days:
        parts.append(f"{s}s")
    return " ".join(parts)


def gib(value: Any) -> str:
    return f"{value / GIB:.1f}" if isinstance(value, (int, float)) else "?"


def when(epoch: Any) -> str:
    if not isinstance(epoch, (int, float)) or epoch < 1e9:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _profile(profile: Any) -> str:
    if not isinstance(profile, dict):
        return text(profile)
    set_knobs = [f"{k}={text(v)}" for k, v in profile.items() if v not in (None, False, 0, 0.0)]
    return " ".join(set_knobs) or "vLLM defaults"


def _changes(changes: Any) -> str:
    if not isinstance(changes, dict):
        return text(changes)
    out = []
    for knob, diff in changes.items():
        if isinstance(diff, dict):
            out.append(f"{knob} {text(diff.get('old'))}→{text(diff.get('new'))}")
        else:
            out.append(f"{knob} {text(diff)}")
    return ", ".join(out)


# ----------------------------------------------------------------- views

#: What ``status`` says an operator must do about a ``fatal`` engine (it waits for them).
FATAL_ACTION = f"none until an operator acts: {ENGINE_FATAL_HINT}"


def status_blocks(r: dict[str, Any]) -> list[Block]:
    daemon = r.get("daemon") or {}
    engine = r.get("engine") or {}
    queue = r.get("queue") or {}
    rate = r.get("throughput") or {}
    summary = Block("chandrad", [
        ("daemon", f"{text(daemon.get('state'))}  pid {text(daemon.get('pid'))}  "
                   f"up {duration(daemon.get('uptime_s'))}"),
        ("engine", f"{text(engine.get('state'))}  pid {text(engine.get('pid'))}  "
                   f"restarts {text(engine.get('restarts'))}"),
        ("profile", _profile(engine.get("profile"))),
    ])
    store = daemon.get("store") or {}
    if isinstance(store, dict) and store.get("error"):  # full, or its server unreachable
        summary.rows.insert(1, ("store", text(store.get("error"))))
    fetch = engine.get("fetch")
    if isinstance(fetch, dict):
        done, total = fetch.get("done") or 0, fetch.get("total") or 0
        share = f" ({100 * done / total:.0f}%)" if total else ""
        summary.rows.append(("fetch", f"{text(fetch.get('model'))}: {done}/{total} bytes"
                                      f"{share}"))
    failure = engine.get("last_failure")
    # A fatal engine is not restarted, whatever its last failure's remedy said.
    fatal = engine.get("state") == "fatal"
    if isinstance(failure, dict):
        summary.rows.append(("last failure", f"{text(failure.get('class'))} at "
                             f"{when(failure.get('at_wall'))}"))
        summary.rows.append(("evidence", text(failure.get("evidence"))))
        if fatal:
            summary.rows.append(("action", FATAL_ACTION))
        elif failure.get("action"):
            summary.rows.append(("action", text(failure.get("action"))))
    else:
        summary.rows.append(("last failure", "none recorded" if fatal else "none"))
        if fatal:
            summary.rows.append(("action", FATAL_ACTION))
    if engine.get("fatal_reason"):
        summary.rows.append(("fatal", text(engine.get("fatal_reason"))))
    summary.rows.append(("queue", "  ".join(
        f"{k} {text(queue.get(k, 0))}" for k in ("pending", "active", "held", "done", "failed")
        if k != "held" or queue.get(k))))
    upcoming = [j for j in r.get("next_jobs") or [] if isinstance(j, dict)]
    if upcoming:
        summary.rows.append(("next", "  ".join(
            f"#{text(j.get('id'))} {text(j.get('file'))} ({text(j.get('queue_position'))} ahead)"
            for j in upcoming)))
    hooks = (r.get("api") or {}).get("webhooks") or {}
    if hooks:
        summary.rows.append(("webhooks", "  ".join(
            f"{k} {text(hooks.get(k, 0))}" for k in ("pending", "delivered", "undeliverable"))))
        for gone in (hooks.get("given_up") or [])[:3]:
            if isinstance(gone, dict):
                summary.rows.append((f"webhook job {text(gone.get('job'))}",
                                     f"undeliverable after {text(gone.get('attempts'))} "
                                     f"attempts: {text(gone.get('error'))}"))
    held = r.get("held") or {}
    for job in (held.get("jobs") or [])[:10]:
        if isinstance(job, dict):
            summary.rows.append((f"held job {text(job.get('id'))}",
                                 f"{text(job.get('reason'))}: {text(job.get('message'))} "
                                 f"({text(job.get('file'))})"))
    summary.rows.append(("pages/min", f"{text(rate.get('pages_per_min_1m'))} (1m)  "
                                      f"{text(rate.get('pages_per_min_15m'))} (15m)"))
    blocks: list[Block] = [summary]
    changes = engine.get("profile_changes") or []
    if changes:
        change_rows: list[Row] = [
            (when(c.get("at")), text(c.get("class")), text(c.get("reason")),
             _changes(c.get("changes")))
            for c in changes if isinstance(c, dict)
        ]
        blocks.append(Block("profile changes", change_rows, ("at", "class", "reason", "changes")))
    blocks.extend(engine_blocks(r))
    blocks.extend(task_blocks(r))
    blocks.extend(gpu_blocks({"gpus": r.get("gpus") or [], "engines": r.get("engines") or []}))
    return blocks


def _engine_place(e: dict[str, Any]) -> str:
    """Where an engine runs: its GPUs, its CPU list, or (remote) its URL."""
    if not e.get("supervised", True):
        return text(e.get("url"))
    parts = []
    if e.get("gpus"):
        parts.append("gpu " + ",".join(str(g)[:12] for g in e["gpus"]))
    if e.get("cpus"):
        parts.append(f"cpu {text(e.get('cpus'))}")
    parts.append(text(e.get("url")))
    return "  ".join(parts)


def engine_blocks(r: dict[str, Any]) -> list[Block]:
    """Every engine, when there is more than one."""
    engines = [e for e in r.get("engines") or [] if isinstance(e, dict)]
    if len(engines) < 2:
        return []
    rows: list[Row] = [
        (text(e.get("id")), text(e.get("state")), text(e.get("pid")), _engine_place(e),
         text(e.get("restarts")), text(e.get("in_flight")), text(e.get("pages_per_min")),
         _profile(e.get("profile")))
        for e in engines]
    return [Block("engines", rows, ("id", "state", "pid", "where", "restarts", "in flight",
                                    "pages/min", "profile"))]


def task_blocks(r: dict[str, Any]) -> list[Block]:
    """The daemon's supervised tasks: one line when all run clean, a table otherwise."""
    tasks = [t for t in r.get("tasks") or [] if isinstance(t, dict)]
    degraded = (r.get("daemon") or {}).get("degraded") or []
    if not tasks:
        return []
    if not degraded:
        return [Block("tasks", [("tasks", f"all {len(tasks)} running")])]
    rows: list[Row] = [
        (text(t.get("name")), text(t.get("state")), text(t.get("restarts")),
         text(t.get("last_error")), text(t.get("last_item")))
        for t in tasks if t.get("name") in degraded
    ]
    return [Block(f"DEGRADED tasks: {', '.join(map(str, degraded))}", rows,
                  ("task", "state", "restarts", "last error", "item"))]


def gpu_blocks(r: dict[str, Any]) -> list[Block]:
    gpus = r.get("gpus") or []
    if not gpus:
        note = text(r.get("error")) if r.get("error") else "none"
        return [Block("gpus", [("gpus", note)])]
    rows: list[Row] = []
    for g in gpus:
        if not isinstance(g, dict):
            continue
        used, total = g.get("memory_used"), g.get("memory_total")
        procs = []
        for p in g.get("processes") or []:
            if isinstance(p, dict):
                held = p.get("used_bytes")
                name = f" {p['name']}" if p.get("name") else ""
                procs.append(f"{text(p.get('pid'))}{name} {gib(held)} GiB")
        on = [text(e.get("id")) for e in r.get("engines") or []
              if isinstance(e, dict) and g.get("uuid") in (e.get("gpus") or [])]
        rows.append((text(g.get("index")), text(g.get("name")), ",".join(on) or "-",
                     f"{gib(used)} / {gib(total)} GiB", ", ".join(procs) or "-"))
    return [Block("gpus", rows, ("gpu", "name", "engine", "memory used / total",
                                 "processes"))]


def queue_blocks(r: dict[str, Any]) -> list[Block]:
    jobs = r.get("jobs") or []
    title = f"queue ({r['state']})" if r.get("state") else "queue"
    if not jobs:
        return [Block(title, [("jobs", "none")])]
    rows: list[Row] = []
    for j in jobs:
        if not isinstance(j, dict):
            continue
        pages = f"{text(j.get('pages_done', 0))}/{text(j.get('pages_total', '?'))}"
        state = text(j.get("state"))
        if j.get("queue_position") is not None:  # pending: the jobs that start before it
            state += f" ({text(j['queue_position'])} ahead)"
        rows.append((text(j.get("id")), state, pages,
                     text(j.get("attempts", 0)), text(j.get("path")), _job_error(j)))
    return [Block(title, rows, ("job", "state", "pages", "attempts", "file", "error"))]


def _job_error(job: dict[str, Any]) -> str:
    parts = [text(job[k]) for k in ("error_code", "error_message") if job.get(k)]
    return ": ".join(parts)


def version_blocks(r: dict[str, Any]) -> list[Block]:
    rows: list[Row] = [("chandractl", text(r.get("client"))), ("chandrad", text(r.get("daemon"))),
            ("protocol", text(r.get("protocol")))]
    rows += [(k, text(v)) for k, v in r.items()
             if k not in ("v", "client", "daemon", "protocol")]
    return [Block("version", rows)]


def action_blocks(cmd: str, r: dict[str, Any]) -> list[Block]:
    """A mutating command's reply: its message, else its fields."""
    if r.get("message"):
        return [Block(cmd, [(cmd, text(r["message"]))])]
    rows: list[Row] = [(k, text(v)) for k, v in r.items() if k != "v"]
    return [Block(cmd, rows or [(cmd, "ok")])]


VIEWS: dict[str, Callable[[dict[str, Any]], list[Block]]] = {
    "status": status_blocks,
    "queue": queue_blocks,
    "gpu": gpu_blocks,
    "version": version_blocks,
}


# ----------------------------------------------------------------- output


def render(cmd: str, result: dict[str, Any], out: TextIO, tty: bool | None = None) -> None:
    """Write ``result`` of ``cmd`` for a human: rich on a TTY, plain text otherwise."""
    view = VIEWS.get(cmd)
    blocks = view(result) if view else action_blocks(cmd, result)
    if tty is None:
        tty = out.isatty()
    if tty:
        _rich(blocks, out)
    else:
        out.write(plain(blocks))


def plain(blocks: Iterable[Block]) -> str:
    """Aligned text: ``key  value`` lines, or space-padded tables with a header row."""
    lines: list[str] = []
    for block in blocks:
        if block.headers:
            lines.append(f"{block.title}:")
            table = [block.headers, *block.rows]
            widths = [max(len(row[i]) for row in table) for i in range(len(block.headers))]
            for row in table:
                cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=True)]
                lines.append("  ".join(cells).rstrip())
        else:
            width = max((len(row[0]) for row in block.rows), default=0)
            lines.extend(f"{row[0].ljust(width)}  {row[1]}".rstrip() for row in block.rows)
        lines.append("")
    return "\n".join(lines[:-1]) + "\n" if lines else ""


def _rich(blocks: list[Block], out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(file=out, highlight=False)
    for block in blocks:
        if block.headers:
            table = Table(title=block.title, title_justify="left")
            for header in block.headers:
                table.add_column(header, overflow="fold")
            for row in block.rows:
                table.add_row(*(Text(cell) for cell in row))  # never parse "[...]" as markup
        else:
            table = Table.grid(padding=(0, 2))
            table.add_column(style="bold")
            table.add_column(overflow="fold")
            for row in block.rows:
                table.add_row(*(Text(cell) for cell in row))
        console.print(table)
