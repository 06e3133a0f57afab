"""vLLM's own memory-related message templates, per release, through the classifier.

Rows come from tests/fixtures/classify/templates/vllm-<version>.jsonl (generated from the
release's source by extract.py in that folder; each names the vLLM file:line). Each template's
sample is rendered into the log vLLM prints: a failure raised at start-up as EngineCore's
ERROR traceback ending in the exception, then the engine process's exit and the API server's
"Engine core initialization failed"; a serving engine's death in a model step as EngineCore's
fatal error and the API server's EngineDeadError; a request's validation error as the API
server's ERROR traceback and a 400; a WARNING or INFO line as that line among a normal
start-up's. Then class, subclass, figures and action are checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chandrad.engine.classify import FailureClass, LineScanner, action_for, classify

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "classify" / "templates"
#: The pinned release and the newest: both must be there (a missing file fails collection).
VERSIONS = ("0.17.1", "0.34.0")
ROWS = [
    json.loads(line)
    for version in VERSIONS
    for line in (TEMPLATES / f"vllm-{version}.jsonl").read_text().splitlines()
    if line.strip()
]

_SITE = "/usr/local/lib/python3.12/dist-packages"
_TS = "12-05 22:31:07"
_ENGINE = f"(EngineCore_DP0 pid=4242) ERROR {_TS} [core.py:1100] "
_API = "(APIServer pid=4100) "


def _frames(row: dict[str, Any]) -> list[str]:
    return [
        "Traceback (most recent call last):",
        f'  File "{_SITE}/vllm/v1/engine/core.py", line 1090, in run_engine_core',
        "    engine_core = EngineCoreProc(*args, engine_index=dp_rank, **kwargs)",
        f'  File "{_SITE}/{row["file"]}", line {row["statement_line"]}, in {row["function"]}',
        f"    {row['statement_source']}",
    ]


def _exception_line(row: dict[str, Any]) -> str:
    name = row["exception"]
    if name not in ("ValueError", "RuntimeError", "AssertionError") and "." not in name:
        name = f"vllm.exceptions.{name}"
    return f"{name}: {row['sample']}" if row["sample"] else name


def _startup_failure(row: dict[str, Any]) -> list[str]:
    """The engine's start-up dies on this message (vLLM 0.17–0.34's shape of it)."""
    if row["then_raise"]:  # logged at ERROR, then the original exception re-raised
        original = row["then_raise"].split(": ", 1)[1]
        logged = [
            f"(EngineCore_DP0 pid=4242) ERROR {_TS} [{Path(row['file']).name}:{row['line']}] "
            f"{row['sample']} (original error: {original})"
        ]
        body = [*_frames(row)[:3], "    raise e", row["then_raise"]]
    else:
        logged = []
        body = [*_frames(row), _exception_line(row)]
    return [
        *logged,
        _ENGINE + "EngineCore failed to start.",
        *(_ENGINE + line for line in body),
        "(EngineCore_DP0 pid=4242) Process EngineCore_DP0:",
        f"{_API}Traceback (most recent call last):",
        f'{_API}  File "{_SITE}/vllm/v1/engine/utils.py", line 1432, in wait_for_engine_startup',
        f"{_API}    raise RuntimeError(",
        f"{_API}RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}",
    ]


def _runtime_failure(row: dict[str, Any]) -> list[str]:
    """The serving engine dies in a model step: EngineCore's fatal error, the API server's
    EngineDeadError."""
    head = f"(EngineCore_DP0 pid=4242) ERROR {_TS} [core.py:1129] "
    frames = [
        "Traceback (most recent call last):",
        f'  File "{_SITE}/vllm/v1/engine/core.py", line 1125, in run_busy_loop',
        "    self._process_engine_step()",
        f'  File "{_SITE}/{row["file"]}", line {row["statement_line"]}, in {row["function"]}',
        f"    {row['statement_source']}",
    ]
    return [
        head + "EngineCore encountered a fatal error.",
        *(head + line for line in [*frames, _exception_line(row)]),
        f"{_API}ERROR {_TS} [async_llm.py:480] AsyncLLM output_handler failed.",
        f"{_API}ERROR {_TS} [async_llm.py:480] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
    ]


def _request_rejected(row: dict[str, Any]) -> list[str]:
    """One request refused by the API server's input processing; the engine serves on."""
    head = f"{_API}ERROR {_TS} [serving.py:312] "
    return [
        head + "Error in preprocessing prompt inputs",
        *(head + line for line in _frames(row)[:1] + _frames(row)[3:]),
        head + _exception_line(row),
        f'{_API}INFO:     127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 400 Bad Request',
    ]


def _logged(row: dict[str, Any]) -> list[str]:
    """The line as vLLM logs it, among a normal start-up's."""
    where = f"[{Path(row['file']).name}:{row['statement_line']}]"
    return [
        f"(EngineCore_DP0 pid=4242) INFO {_TS} [core.py:98] Initializing a V1 LLM engine",
        f"(EngineCore_DP0 pid=4242) {row['level']} {_TS} {where} {row['sample']}",
        f"(APIServer pid=4100) INFO {_TS} [api_server.py:1970] Starting vLLM API server 0 on "
        "http://0.0.0.0:8000",
    ]


def render(row: dict[str, Any]) -> list[str]:
    """The log lines vLLM prints for this template's sample."""
    if row["level"] in ("WARNING", "INFO", "DEBUG"):
        return _logged(row)
    if row["context"] == "request":
        return _request_rejected(row)
    if row["context"] == "runtime":
        return _runtime_failure(row)
    return _startup_failure(row)


def _id(row: dict[str, Any]) -> str:
    return f"{row['version']}-{row['id']}"


def test_both_releases_have_templates() -> None:
    """Each release contributes its failure templates and its benign lines."""
    for version in VERSIONS:
        rows = [r for r in ROWS if r["version"] == version]
        assert sum(r["class"] != "none" for r in rows) >= 10, version
        assert sum(r["class"] == "none" for r in rows) >= 8, version


@pytest.mark.parametrize("row", ROWS, ids=[_id(r) for r in ROWS])
def test_template(row: dict[str, Any]) -> None:
    """The rendered template classifies to its class, figures and action; a WARNING/INFO
    line (and a rejected request) is never a failure."""
    lines = render(row)
    exit_code = None if row["class"] == "none" else 1
    d = classify(lines, exit_code=exit_code)
    cls = FailureClass(row["class"])
    assert d.cls is cls, (row["file"], row["line"], d)
    if cls in (FailureClass.CUDA_OOM_LOAD, FailureClass.CUDA_OOM_RUNTIME):  # and more figures
        assert all(d.numbers.get(k) == pytest.approx(v) for k, v in row["numbers"].items())
    else:
        assert d.numbers == pytest.approx(row["numbers"]), d.numbers
    if cls is FailureClass.OTHER_FATAL:
        assert d.subclass == row["subclass"], d
        assert d.restartable is row["restartable"]
        assert d.action
    else:
        assert d.action == action_for(cls)
    if cls is FailureClass.NONE:
        assert d.evidence == ""
        scanner = LineScanner()
        assert all(scanner.feed(line) is None for line in lines)
    else:
        # The evidence is vLLM's message, not the RuntimeError that follows it.
        assert "Engine core initialization failed" not in d.evidence
        assert (row["sample"] or row["template"])[:40] in d.evidence or (
            row["then_raise"] and "out of memory" in d.evidence.lower()
        ), d.evidence
