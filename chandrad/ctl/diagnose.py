"""``chandractl diagnose [FILE|-] [--json]``: classify pasted vLLM log text.

Owns reading the text (a file, or stdin for ``-``/None) and printing the verdict of
:func:`chandrad.engine.classify.classify`; needs no daemon.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

from chandrad.engine.classify import Diagnosis, FailureClass, classify
from chandrad.errors import CtlExit


def _read(source: str | None) -> str:
    if source is None or source == "-":
        return sys.stdin.read()
    with open(source, encoding="utf-8", errors="replace") as fh:
        return fh.read()


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def diagnosis_json(d: Diagnosis) -> dict[str, object]:
    """The ``--json`` document: ``{"v", "class", "evidence", "action", "numbers", ...}``."""
    out = d.to_dict()
    out["numbers"] = {k: _number(v) for k, v in d.numbers.items()}
    return out


def _human(d: Diagnosis, out: TextIO) -> None:
    out.write(f"class:    {d.cls.value}" + (f" ({d.subclass})" if d.subclass else "") + "\n")
    if d.cls is FailureClass.NONE:
        out.write("no failure found in this text\n")
        return
    out.write(f"evidence: {d.evidence}\n")
    if d.numbers:
        figures = ", ".join(f"{k}={_number(v)}" for k, v in d.numbers.items())
        out.write(f"numbers:  {figures}\n")
    out.write(f"action:   {d.action}\n")
    if not d.restartable:
        out.write("a restart cannot fix this: the engine goes fatal until an operator acts\n")


def run_diagnose(source: str | None, as_json: bool, out: TextIO) -> int:
    """Classify the text of ``source`` (path, ``-`` or None for stdin) and print it.

    Returns 0, or 1 when the file cannot be read (message on stderr).
    """
    try:
        text = _read(source)
    except OSError as exc:
        sys.stderr.write(f"chandractl diagnose: cannot read {source}: {exc.strerror or exc}\n")
        return int(CtlExit.ERROR)
    d = classify(text)
    if as_json:
        out.write(json.dumps(diagnosis_json(d), ensure_ascii=False) + "\n")
    else:
        _human(d, out)
    return 0
