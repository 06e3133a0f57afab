"""The documentation in docs/ states the facts the code holds, and links only inside the repo.

``docs/configuration.md`` has one row per configuration key with its default;
``docs/operations.md`` has the state transition tables, failure classes, exit codes and
control commands. These tests read the facts from the code (``config.py``, ``states.py``,
``classify.py``, ``errors.py``, ``protocol.py``) and fail when a doc row is missing, extra
or says something else, so a change in one place cannot silently leave the other behind.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO_ROOT

from chandrad import config, errors, protocol, states
from chandrad.engine.classify import FailureClass
from chandrad.events import MESSAGE_IDS

DOCS = REPO_ROOT / "docs"
SECTIONS: dict[str, type] = {
    "daemon": config.DaemonConfig, "watch": config.WatchConfig, "ocr": config.OcrConfig,
    "engine": config.EngineConfig, "control": config.ControlConfig,
    "metrics": config.MetricsConfig, "api": config.ApiConfig,
}
#: Written in the file as one ``backoff = [initial, max]`` pair.
PAIRS = {"engine.downshift.backoff": ("backoff_initial", "backoff_max")}


def _rows_in(text: str) -> dict[str, list[str]]:
    """Markdown table rows whose first cell is a backticked name: name -> the other cells."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.fullmatch(r"`([^`]+)`", cells[0]) if line.startswith("|") else None
        if name:
            rows[name.group(1)] = cells[1:]
    return rows


def _rows(path: Path) -> dict[str, list[str]]:
    return _rows_in(path.read_text(encoding="utf-8"))


def _defaults(cls: type, prefix: str) -> dict[str, Any]:
    """Every leaf key of a config dataclass -> its default (MISSING when it has none)."""
    out: dict[str, Any] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if config.DERIVED in f.metadata:
            continue  # e.g. engine.urls: what engine.url holds, not a key of its own
        value: Any = MISSING
        if f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()
        if is_dataclass(value):
            out.update(_defaults(type(value), f"{prefix}.{f.name}"))
        else:
            out[f"{prefix}.{f.name}"] = value
    for key, (low, high) in PAIRS.items():
        section = key.rsplit(".", 1)[0]
        if section == prefix:
            out[key] = [out.pop(f"{section}.{low}"), out.pop(f"{section}.{high}")]
    return out


def _config_defaults() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        out.update(_defaults(cls, name))
    return out


def _as_toml(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_as_toml(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _doc_default(cell: str) -> Any:
    """The default cell as a value: a backticked TOML literal, or ``unset`` (None)."""
    if cell == "unset":
        return None
    literal = re.fullmatch(r"`([^`]+)`", cell)
    assert literal, f"default cell is neither a `TOML literal` nor 'unset': {cell!r}"
    return tomllib.loads(f"x = {literal.group(1)}")["x"]


def test_configuration_doc_lists_every_key_once() -> None:
    """Every key config.py reads has a row in docs/configuration.md, and no row is extra."""
    documented = {k for k in _rows(DOCS / "configuration.md") if k.split(".")[0] in SECTIONS}
    expected = set(_config_defaults())
    assert sorted(expected - documented) == [], "keys missing from docs/configuration.md"
    assert sorted(documented - expected) == [], "docs/configuration.md rows config.py lacks"


def test_configuration_doc_defaults_match_the_code() -> None:
    """Each documented default is the dataclass default (keys without one say so)."""
    rows = _rows(DOCS / "configuration.md")
    for key, default in _config_defaults().items():
        cell = rows[key][0]
        if default is MISSING:  # required, or derived from another key: said in words
            assert not re.fullmatch(r"`[^`]+`", cell), (key, cell)
            continue
        value = _doc_default(cell)
        if key == "control.mode":
            value = int(value, 8)
        assert value == _as_toml(default), (key, cell, default)


def test_configuration_doc_lists_every_refused_knob() -> None:
    """Every obsolete recipe knob config.py refuses is explained."""
    rows = _rows(DOCS / "configuration.md")
    assert set(config.OBSOLETE_ENGINE_KNOBS) <= set(rows)


def _section(path: Path, heading: str) -> str:
    """From ``heading`` to the next heading of the same or a higher level."""
    text = path.read_text(encoding="utf-8")
    start = text.index(heading + "\n")
    level = len(heading) - len(heading.lstrip("#"))
    after = re.search(rf"^#{{1,{level}}} ", text[start + len(heading):], re.M)
    return text[start: start + len(heading) + after.start() if after else len(text)]


@pytest.mark.parametrize(("heading", "table"), [
    ("### Engine states", states.ENGINE_TRANSITIONS),
    ("### Daemon states", states.DAEMON_TRANSITIONS),
])
def test_operations_doc_transition_tables_match_states(heading: str, table: Any) -> None:
    """Each state's row lists exactly the states ``states.py`` allows next."""
    rows = _rows_in(_section(DOCS / "operations.md", heading))
    assert set(rows) == {s.value for s in table}
    for state, allowed in table.items():
        listed = set(re.findall(r"`([a-z_]+)`", rows[state.value][0]))
        assert listed == {s.value for s in allowed}, state


def test_operations_doc_failure_classes_exit_codes_and_commands() -> None:
    """Every failure class, exit code and control command (with its tier) is documented."""
    ops = DOCS / "operations.md"
    classes = _rows_in(_section(ops, "## Failure classes"))
    assert set(classes) == {c.value for c in FailureClass}
    codes = _section(ops, "## Exit codes")
    for code in list(errors.ExitCode) + list(errors.CtlExit):
        assert re.search(rf"^\| `{int(code)}` \|", codes, re.M), code
    commands = _rows_in(_section(ops, "## Control protocol"))
    for name, spec in protocol.COMMANDS.items():
        assert name in commands, name
        assert commands[name][0] == spec.tier, name
    control_codes = _rows_in(_section(ops, "### Error codes"))
    assert set(control_codes) == set(errors.CONTROL_ERROR_CODES)


def test_readme_and_docs_link_only_inside_the_repository() -> None:
    """Relative links in README.md and docs/ resolve to files of the checkout."""
    pages = [REPO_ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # an absolute URL (https:, mailto:)
            path = (page.parent / target).resolve()
            if not path.exists() or REPO_ROOT.resolve() not in path.parents:
                broken.append(f"{page.name}: {target}")
        if "SPEC.md" in text:
            broken.append(f"{page.name}: points to the old contract; docs/ replaces it")
    assert broken == []


def test_systemd_doc_message_id_table_matches_logs() -> None:
    """docs/systemd.md's event → MESSAGE_ID table is exactly ``chandrad.events.MESSAGE_IDS``:
    operators filter on these ids, so the doc may neither miss, add nor misspell one."""
    text = (DOCS / "systemd.md").read_text(encoding="utf-8")
    table = text.split("| event | MESSAGE_ID |", 1)[1].split("\n\n", 1)[0]
    documented = {name: cells[0].strip("`") for name, cells in _rows_in(table).items()}
    assert documented == {str(event): mid for event, mid in MESSAGE_IDS.items()}
