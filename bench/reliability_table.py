"""Write ``docs/reliability.md``'s results table from the fault suite's own run.

    CHANDRAD_FAULTS_RESULTS=/tmp/rows.jsonl .venv/bin/pytest tests/faults
    CHANDRAD_FAULTS_RESULTS=/tmp/rows.jsonl .venv/bin/python bench/soak.py ...
    .venv/bin/python bench/reliability_table.py /tmp/rows.jsonl [more.jsonl ...]

Each fault test (``tests/faults/faultkit.record``) and ``bench/soak.py`` append one JSON row
per fault: what was done, what chandrad did, files lost, pages done twice, time to serving
again. The newest row per fault and engine wins (the same fault on the stand-in and on
vLLM are two rows). Everything between the two marker lines of
``docs/reliability.md`` is replaced; the prose around them is kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import _proc

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "reliability.md"
BEGIN = "<!-- results table: written by bench/reliability_table.py, do not edit -->"
END = "<!-- end of results table -->"


def _cell(value: Any) -> str:
    text = "-" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict[str, Any]]) -> str:
    newest: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:  # files are read oldest first
        newest[(row["fault"], str(row.get("engine", "")))] = row
    lines = ["| fault | what chandrad did | files lost | pages done twice | "
             "serving again (s) | engine | test |",
             "|---|---|---|---|---|---|---|"]
    for row in newest.values():
        lines.append("| " + " | ".join(_cell(row.get(k)) for k in
                                        ("fault", "did", "lost", "twice", "serving_s",
                                         "engine", "test")) + " |")
    dates = sorted(str(r.get("at", "")) for r in newest.values())
    span = f"{dates[0]} … {dates[-1]}" if dates else "-"
    return "\n".join([BEGIN, f"Rows measured {span} (UTC).", "", *lines, END])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--doc", type=Path, default=DOC)
    args = p.parse_args(argv)
    rows = [_proc.portable(json.loads(line)) for path in args.results
            for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    doc = args.doc.read_text(encoding="utf-8")
    if BEGIN not in doc or END not in doc:
        print(f"{args.doc}: the marker lines are missing", file=sys.stderr)
        return 1
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    args.doc.write_text(head + table(rows) + tail, encoding="utf-8")
    print(f"{args.doc}: {len({(r['fault'], str(r.get('engine', ''))) for r in rows})} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
