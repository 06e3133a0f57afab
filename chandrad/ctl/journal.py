"""``chandractl logs``: read chandrad's journal back and say what happened and what to change.

Owns the analysis of the structured entries that ``chandrad.logs`` writes
(docs/operations.md, Journal): it runs the real ``journalctl -o json`` (``-u UNIT`` or
``--file F``), keeps the entries with ``SYSLOG_IDENTIFIER=chandrad`` plus systemd's own
messages about the unit, and reports engine failures by class over time, profile changes
with their reasons, restarts, failed files, pages per hour and recommendations — as text or
as the versioned JSON object ``{"v": 1, ...}``. Engine events carry ``CHANDRA_ENGINE`` (the
replica id, engine/replicas.py); one without it (a single-engine daemon from before
replicas) counts as engine ``"0"``. ``"engines"`` sums failures, restarts and the last
failure per engine; the text report prints that summary only when the journal holds more
than one engine, so a single-engine report reads as it always did.

chandrad writes the same events in three shapes, all read here: native journal fields
(``log_format = "journal"``); JSON lines on stderr that journald stores as ``MESSAGE``
(``log_format = "json"`` under systemd, and the journal handler's fallback when
journald's socket is gone); and a plain JSON-lines file (``--file`` on a file that is not
a journal, e.g. ``chandrad run 2>>chandrad.log``). A line that cannot be read (cut off
by a kill, or split by journald's ``LineMax``) is skipped and counted, never fatal.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from chandrad import errors
from chandrad.engine.classify import FailureClass
from chandrad.errors import CtlExit
from chandrad.events import Event
from chandrad.logs import journal_fields

#: systemd's "Automatic restarting of a unit has been scheduled" (systemd.catalog).
SD_MESSAGE_UNIT_RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"

IDENTIFIER = "chandrad"

#: The first bytes of every journal file (systemd's journal-def.h ``HEADER_SIGNATURE``).
JOURNAL_MAGIC = b"LPKSHHRH"

#: Where a learned knob goes in the config (everything else: ``[engine.memory]``).
_KNOB_SECTION = {"max_pixels": "[ocr]", "max_output_tokens": "[ocr]"}

#: Events of an engine's supervisor that the per-engine summary counts; an entry of one
#: of these without ``CHANDRA_ENGINE`` is engine :data:`DEFAULT_ENGINE`'s.
_ENGINE_EVENTS = frozenset(
    {Event.ENGINE_FAILURE, Event.PROFILE_CHANGE, Event.ENGINE_RESTART, Event.ENGINE_READY}
)
DEFAULT_ENGINE = "0"
_EVIDENCE_CHARS = 160

_FILE_ADVICE = {
    errors.EncryptedInput.code: "remove the password and drop the file again",
    errors.DecompressionBomb.code: "the image is larger than the pixel limit allows; rescale it",
    errors.TooManyPages.code: "split the document or raise [ocr] max_pages",
    errors.EmptyInput.code: "the file has no pages",
    errors.UnsupportedFormat.code: "only PDFs and images are accepted",
    errors.InputError.code: "the file cannot be parsed; re-export or re-scan it",
    errors.InternalError.code: "a chandrad bug: keep the journal and report it",
}


@dataclass(frozen=True)
class Entry:
    """One journal entry: its time and its fields as text."""

    time: datetime
    fields: dict[str, str]

    def get(self, key: str) -> str:
        return self.fields.get(key, "")

    def value(self, key: str) -> Any:
        """A ``CHANDRA_*`` field with its JSON encoding undone (strings stay strings)."""
        raw = self.fields.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw


def unit_name(unit: str) -> str:
    return unit if "." in unit else f"{unit}.service"


def journalctl_argv(*, since: str | None, unit: str, file: Path | None) -> list[str]:
    """The journalctl command line that reads chandrad's entries."""
    argv = ["journalctl", "-o", "json", "--all", "--no-pager", "-q"]
    if since:
        argv += ["--since", since]
    if file is not None:
        # A journal file may hold a whole host: keep ours and systemd's about our unit.
        argv += [
            "--file",
            str(file),
            f"SYSLOG_IDENTIFIER={IDENTIFIER}",
            "+",
            f"UNIT={unit_name(unit)}",
        ]
    else:
        argv += ["-u", unit_name(unit)]
    return argv


def _field_text(value: Any) -> str:
    """journalctl's JSON: a string, bytes as a number array, an array if repeated, null if huge."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        if value and all(isinstance(v, int) for v in value):
            return bytes(value).decode("utf-8", "replace")
        return _field_text(value[-1]) if value else ""
    return str(value)


@dataclass
class Entries:
    """Parsed entries, oldest first, and how many lines could not be read."""

    entries: list[Entry]
    unreadable: int = 0


def _event_fields(event: Any) -> dict[str, str] | None:
    """The journal fields of one JSON-line event (as ``log_format = "journal"`` sends them)."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return None
    return dict(journal_fields(event))


def _event_time(event: dict[str, Any]) -> datetime | None:
    stamp = event.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        t = datetime.fromisoformat(stamp)
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def parse_entries(lines: str) -> Entries:
    """Entries from ``journalctl -o json`` output, oldest first.

    An entry of ours whose ``MESSAGE`` is a JSON event (stderr in ``json`` format) gets
    that event's fields, as if it had been sent natively. A line that is not JSON, or a
    ``MESSAGE`` that looks like a JSON event but is cut off, counts as unreadable.
    """
    result = Entries([])
    for line in lines.splitlines():
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError:
            result.unreadable += 1
            continue
        if not isinstance(raw, dict):
            result.unreadable += 1
            continue
        fields = {k: _field_text(v) for k, v in raw.items()}
        stamp = fields.get("__REALTIME_TIMESTAMP", "")
        when = datetime.fromtimestamp(int(stamp) / 1e6 if stamp.isdigit() else 0, UTC)
        message = fields.get("MESSAGE", "")
        if (fields.get("SYSLOG_IDENTIFIER") == IDENTIFIER and "CHANDRA_EVENT" not in fields
                and message.startswith("{")):
            try:
                event = json.loads(message)
            except ValueError:
                result.unreadable += 1
                continue
            lifted = _event_fields(event)
            if lifted is not None:
                fields.update(lifted)
                when = _event_time(event) or when
        result.entries.append(Entry(when, fields))
    result.entries.sort(key=lambda e: e.time)
    return result


def parse_json_lines(text: str, *, since: datetime | None = None) -> Entries:
    """Entries from a JSON-lines log file (``log_format = "json"`` written to a file).

    Lines that are not JSON events (a cut-off last line, a stray warning) are counted as
    unreadable; events older than ``since`` are left out.
    """
    result = Entries([])
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            result.unreadable += 1
            continue
        fields = _event_fields(event)
        when = _event_time(event) if isinstance(event, dict) else None
        if fields is None or when is None:
            result.unreadable += 1
            continue
        if since is not None and when < since:
            continue
        result.entries.append(Entry(when, fields))
    result.entries.sort(key=lambda e: e.time)
    return result


def is_journal_file(path: Path) -> bool:
    """Whether ``path`` is a journal file (else it is read as JSON lines)."""
    with open(path, "rb") as f:
        return f.read(len(JOURNAL_MAGIC)) == JOURNAL_MAGIC


def engine_of(entry: Entry) -> str:
    """The engine an entry is about: its ``CHANDRA_ENGINE``, else engine ``"0"``."""
    return entry.get("CHANDRA_ENGINE") or DEFAULT_ENGINE


def _engine_key(engine_id: str) -> tuple[int, str]:
    """Engines in numeric order ("2" before "10"), named ones after."""
    return (int(engine_id), "") if engine_id.isdigit() else (1 << 62, engine_id)


def _short(evidence: str) -> str:
    return " ".join(evidence.split())[:_EVIDENCE_CHARS]


def _iso(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def _hour(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:00Z")


def _toml(value: Any) -> str:
    """A config value as TOML; None (a knob left unset, vLLM's default) has no TOML form."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return str(value)


def analyze(entries: list[Entry], unit: str = "chandrad", *, unreadable: int = 0
            ) -> dict[str, Any]:
    """The ``chandractl logs --json`` report (``"v": 1``) for these entries."""
    ours = [e for e in entries if e.get("SYSLOG_IDENTIFIER") == IDENTIFIER]
    about_unit = [e for e in entries if e.get("UNIT") == unit_name(unit)]
    failures: Counter[str] = Counter()
    failures_by_hour: dict[str, Counter[str]] = defaultdict(Counter)
    last_evidence: dict[str, str] = {}
    profile_changes: list[dict[str, Any]] = []
    failed_files: list[dict[str, Any]] = []
    pages: dict[str, dict[str, int]] = defaultdict(lambda: {"pages": 0, "files": 0})
    restarts = 0
    ready_seconds: list[float] = []
    engines: dict[str, dict[str, Any]] = {}

    def engine(e: Entry) -> dict[str, Any]:
        return engines.setdefault(engine_of(e), {
            "failures": Counter(), "restarts": 0, "profile_changes": 0, "last_failure": None,
        })

    for e in ours:
        event = e.get("CHANDRA_EVENT")
        if e.get("CHANDRA_ENGINE") or event in _ENGINE_EVENTS:
            engine(e)  # an engine with no failure is listed too, with zeros
        if event == Event.ENGINE_FAILURE:
            cls = e.get("CHANDRA_CLASS") or "unknown"
            failures[cls] += 1
            failures_by_hour[_hour(e.time)][cls] += 1
            last_evidence[cls] = e.get("CHANDRA_EVIDENCE")
            engine(e)["failures"][cls] += 1
            engine(e)["last_failure"] = {
                "time": _iso(e.time), "class": cls, "evidence": _short(e.get("CHANDRA_EVIDENCE")),
            }
        elif event == Event.PROFILE_CHANGE:
            profile_changes.append(
                {
                    "time": _iso(e.time),
                    "engine": engine_of(e),
                    "class": e.get("CHANDRA_CLASS"),
                    "reason": e.get("CHANDRA_REASON"),
                    "old": e.value("CHANDRA_OLD"),
                    "new": e.value("CHANDRA_NEW"),
                }
            )
            engine(e)["profile_changes"] += 1
        elif event == Event.ENGINE_RESTART:
            restarts += 1
            engine(e)["restarts"] += 1
        elif event == Event.ENGINE_READY:
            seconds = e.value("CHANDRA_SECONDS")
            if isinstance(seconds, int | float):
                ready_seconds.append(float(seconds))
        elif event == Event.JOB_FAILED:
            failed_files.append(
                {
                    "time": _iso(e.time),
                    "job": e.value("CHANDRA_JOB"),
                    "file": e.get("CHANDRA_FILE"),
                    "code": e.get("CHANDRA_CODE"),
                    "reason": e.get("CHANDRA_REASON"),
                }
            )
        elif event == Event.JOB_DONE:
            n = e.value("CHANDRA_PAGES")
            bucket = pages[_hour(e.time)]
            bucket["pages"] += n if isinstance(n, int) else 0
            bucket["files"] += 1

    daemon_restarts = sum(
        1 for e in about_unit if e.get("MESSAGE_ID") == SD_MESSAGE_UNIT_RESTART_SCHEDULED
    )
    watchdog_timeouts = sum(1 for e in about_unit if "Watchdog timeout" in e.get("MESSAGE"))
    pages_per_hour = {
        hour: {**b, "pages_per_min": round(b["pages"] / 60, 2)} for hour, b in sorted(pages.items())
    }
    report: dict[str, Any] = {
        "v": 1,
        "entries": len(ours),
        "unreadable_lines": unreadable,
        "first": _iso(ours[0].time) if ours else None,
        "last": _iso(ours[-1].time) if ours else None,
        "failures": dict(failures.most_common()),
        "failures_by_hour": {h: dict(c) for h, c in sorted(failures_by_hour.items())},
        "engines": {
            i: {**engines[i], "failures": dict(engines[i]["failures"].most_common())}
            for i in sorted(engines, key=_engine_key)
        },
        "profile_changes": profile_changes,
        "restarts": restarts,
        "daemon_restarts": daemon_restarts,
        "watchdog_timeouts": watchdog_timeouts,
        "engine_ready_seconds": ready_seconds,
        "failed_files": failed_files,
        "pages_per_hour": pages_per_hour,
    }
    report["recommendations"] = _recommend(report, last_evidence)
    return report


def _settled(changes: list[dict[str, Any]]) -> dict[str, tuple[Any, Any]]:
    """``{knob: (first old, last new)}`` over all profile changes, for knobs that moved."""
    first: dict[str, Any] = {}
    last: dict[str, Any] = {}
    for change in changes:
        old, new = change.get("old"), change.get("new")
        if not (isinstance(old, dict) and isinstance(new, dict)):
            continue
        for knob, value in old.items():
            first.setdefault(knob, value)
        last.update(new)
    return {k: (first.get(k), v) for k, v in last.items() if first.get(k) != v}


def _profile_rec(changes: list[dict[str, Any]], failures: dict[str, int]) -> str | None:
    """The config lines that skip one engine's downshift at boot, or None if nothing moved."""
    settled = _settled(changes)
    if not settled:
        return None
    classes = Counter(c.get("class") or "unknown" for c in changes)
    cls = classes.most_common(1)[0][0]
    count = failures.get(cls, classes[cls])
    moves = "; ".join(
        f"{k} {_toml(o)} → settled on {_toml(n)}" for k, (o, n) in settled.items()
    )
    memory = [(k, n) for k, (_, n) in settled.items() if k != "expandable_segments"]
    sets: list[str] = []
    unset: list[str] = []
    for knob, new in memory:
        key = f"{_KNOB_SECTION.get(knob, '[engine.memory]')} {knob}"
        if new is None:
            unset.append(key)
        else:
            sets.append(f"{key} = {_toml(new)}")
    if settled.get("expandable_segments", (None, None))[1] is True:
        sets.append('[engine.env] PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True"')
    todo = []
    if sets:
        todo.append(f"set {', '.join(sets)}")
    if unset:
        todo.append(f"leave {', '.join(unset)} unset (remove the line)")
    return (f"{count} {cls} at {moves}; {' and '.join(todo)} in the config "
            "to skip the downshift at boot")


def _recommend(report: dict[str, Any], last_evidence: dict[str, str]) -> list[str]:
    recs: list[str] = []
    failures: dict[str, int] = report["failures"]
    changes: list[dict[str, Any]] = report["profile_changes"]
    if not report["entries"]:
        return [
            "no chandrad entries found: check --since and --unit, that the journal is "
            "persistent (/var/log/journal exists) and that you may read it (group "
            "systemd-journal or adm)"
        ]
    engines: dict[str, dict[str, Any]] = report["engines"]
    by_engine: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for change in changes:
        by_engine[change.get("engine") or DEFAULT_ENGINE].append(change)
    for engine_id in sorted(by_engine, key=_engine_key):
        rec = _profile_rec(by_engine[engine_id], engines.get(engine_id, {}).get("failures", {}))
        if rec:
            recs.append(f"engine {engine_id}: {rec}" if len(engines) > 1 else rec)

    def where(cls: str) -> str:
        """`` (engine 1)`` after a failure class when the journal holds several engines."""
        if len(engines) < 2:
            return ""
        ids = [i for i, e in engines.items() if e["failures"].get(cls)]
        return f" ({'engine' if len(ids) == 1 else 'engines'} {', '.join(ids)})"

    host_oom, other_fatal = FailureClass.HOST_OOM, FailureClass.OTHER_FATAL
    if failures.get(host_oom):
        recs.append(
            f"{failures[host_oom]} {host_oom}{where(host_oom)}: the kernel OOM killer "
            "stopped the engine (host RAM, not GPU); lower [engine.memory] "
            "mm_processor_cache_gb or [ocr] render_workers, or add RAM"
        )
    if failures.get(other_fatal):
        evidence = " ".join(last_evidence.get(other_fatal, "").split())[:160]
        recs.append(
            f"{failures[other_fatal]} {other_fatal}{where(other_fatal)}: not a memory "
            f"problem, lowering memory will not help; last evidence: {evidence!r}"
        )
    if report["restarts"] and not failures and not changes:
        recs.append(
            f"the engine restarted {report['restarts']} times without a classified failure; "
            "look for operator restarts or reloads that changed engine settings"
        )
    if report["daemon_restarts"] or report["watchdog_timeouts"]:
        recs.append(
            f"systemd restarted chandrad {report['daemon_restarts']} times "
            f"({report['watchdog_timeouts']} watchdog timeouts): read `journalctl -u "
            "chandrad -p warning` around those times"
        )
    codes = Counter(f["code"] or "unknown" for f in report["failed_files"])
    for code, n in codes.most_common():
        example = next(
            f["file"] for f in report["failed_files"] if (f["code"] or "unknown") == code
        )
        advice = _FILE_ADVICE.get(code, "see <name>.error.json beside the file")
        recs.append(
            f"{n} file(s) failed with {code} (e.g. {example}): {advice}; "
            "then `chandractl retry --failed`"
        )
    if report["unreadable_lines"]:
        recs.append(
            f"{report['unreadable_lines']} line(s) could not be read (cut off or not JSON) "
            "and were skipped"
        )
    if not [r for r in recs if "could not be read" not in r]:
        recs.append("no engine failures and no failed files: nothing to change")
    return recs


def render_text(report: dict[str, Any], out: TextIO) -> None:
    """The human-readable report."""
    w = out.write
    w(f"chandrad journal: {report['entries']} entries")
    if report["first"]:
        w(f", {report['first']} … {report['last']}")
    if report["unreadable_lines"]:
        w(f" ({report['unreadable_lines']} unreadable lines skipped)")
    w("\n\nEngine failures by class\n")
    if report["failures"]:
        classes = list(report["failures"])
        width = max(len(c) for c in classes)
        w(f"  {'hour':<18}" + "".join(f"{c:>{width + 2}}" for c in classes) + "\n")
        for hour, counts in report["failures_by_hour"].items():
            w(f"  {hour:<18}" + "".join(f"{counts.get(c, 0):>{width + 2}}" for c in classes) + "\n")
        w(f"  {'total':<18}" + "".join(f"{report['failures'][c]:>{width + 2}}" for c in classes))
        w("\n")
    else:
        w("  none\n")
    engines: dict[str, dict[str, Any]] = report["engines"]
    several = len(engines) > 1
    if several:
        w("\nEngine failures by engine\n")
        for engine_id, summary in engines.items():
            counts = ", ".join(f"{c} {n}" for c, n in summary["failures"].items()) or "none"
            w(f"  engine {engine_id}: {counts}; restarts {summary['restarts']}, "
              f"profile changes {summary['profile_changes']}")
            last = summary["last_failure"]
            if last:
                w(f"; last failure {last['time']} {last['class']}: {last['evidence']}")
            w("\n")
    w("\nProfile changes\n")
    for change in report["profile_changes"] or []:
        old, new = change["old"], change["new"]
        if isinstance(old, dict) and isinstance(new, dict):
            moved = ", ".join(f"{k} {_toml(old.get(k))} → {_toml(v)}" for k, v in new.items())
        else:
            moved = f"{old} → {new}"
        who = f"engine {change['engine']} " if several else ""
        w(f"  {change['time']}  {who}{change['class'] or '-'}: {moved}  ({change['reason']})\n")
    if not report["profile_changes"]:
        w("  none\n")
    w(
        f"\nRestarts: engine {report['restarts']}, daemon {report['daemon_restarts']} "
        f"(watchdog timeouts {report['watchdog_timeouts']})\n"
    )
    if report["engine_ready_seconds"]:
        secs = report["engine_ready_seconds"]
        w(f"Engine load: {len(secs)} times, last {secs[-1]:.0f} s, longest {max(secs):.0f} s\n")
    w("\nFailed files\n")
    for f in report["failed_files"]:
        w(f"  {f['time']}  {f['file']}  {f['code']}: {f['reason']}\n")
    if not report["failed_files"]:
        w("  none\n")
    w("\nThroughput by hour\n")
    for hour, b in report["pages_per_hour"].items():
        w(
            f"  {hour:<18} {b['pages']:>6} pages {b['files']:>5} files "
            f"{b['pages_per_min']:>8.2f} pages/min\n"
        )
    if not report["pages_per_hour"]:
        w("  no finished jobs\n")
    w("\nRecommendations\n")
    for rec in report["recommendations"]:
        w(f"  - {rec}\n")


def _since_time(since: str | None) -> datetime | None:
    """``--since`` for a JSON-lines file: an ISO time (journalctl's own words need a journal)."""
    if not since:
        return None
    try:
        t = datetime.fromisoformat(since)
    except ValueError:
        raise ValueError(
            f"--since {since!r}: with a JSON-lines file give an ISO time such as "
            "2026-01-05T11:00:00Z (journalctl's relative times work on journal files)"
        ) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def run_logs(*, since: str | None, unit: str, file: Path | None, as_json: bool, out: TextIO) -> int:
    """Run journalctl, analyse, print; returns a chandractl exit status."""
    argv = journalctl_argv(since=since, unit=unit, file=file)
    if file is not None and not file.exists():
        out.write(f"chandractl logs: {file}: no such journal file\n")
        return int(CtlExit.ERROR)
    try:
        journal = file is None or is_journal_file(file)
    except OSError as exc:
        out.write(f"chandractl logs: {file}: {exc.strerror}\n")
        return int(CtlExit.ERROR)
    if journal:
        exe = shutil.which(argv[0])
        if exe is None:
            out.write("chandractl logs: journalctl not found (install systemd)\n")
            return int(CtlExit.ERROR)
        proc = subprocess.run([exe, *argv[1:]], capture_output=True, text=True,
                              errors="replace")
        if proc.returncode != 0:
            message = proc.stderr.strip() or f"journalctl exited with status {proc.returncode}"
            out.write(f"chandractl logs: {message}\n")
            return int(CtlExit.ERROR)
        parsed = parse_entries(proc.stdout)
    else:
        assert file is not None
        try:
            start = _since_time(since)
        except ValueError as exc:
            out.write(f"chandractl logs: {exc}\n")
            return int(CtlExit.ERROR)
        parsed = parse_json_lines(file.read_text(encoding="utf-8", errors="replace"),
                                  since=start)
    report = analyze(parsed.entries, unit, unreadable=parsed.unreadable)
    if as_json:
        out.write(json.dumps(report, ensure_ascii=False, indent=2) + "\n")
    else:
        render_text(report, out)
    return int(CtlExit.OK)
