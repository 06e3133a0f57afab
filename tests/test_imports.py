"""Import discipline: the daemon stays small, and imports point down the layer map.

Heavy libraries load only in workers or the engine; every module sits on one layer of
docs/architecture.md (leaf, pure, adapter, service, daemon, entry) and imports only below it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

#: psycopg too: only a host whose ``daemon.store`` is PostgreSQL imports it (0.12 s).
HEAVY = ("torch", "vllm", "pymupdf", "chandra.model", "chandra.output", "openai", "transformers",
         "psycopg")


def test_daemon_imports_no_heavy_library() -> None:
    """Importing the daemon (everything `chandrad run` wires) loads none of torch, vLLM,
    PyMuPDF, chandra.model/output or openai: those live in the engine and render workers;
    nor psycopg, which the PostgreSQL store alone needs."""
    code = (
        "import json, sys, chandrad.daemon, chandrad.cli; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout) == []


# ------------------------------------------------------------------ the layer map

#: Every module of the package, by layer (docs/architecture.md). Imports point down only.
LAYERS: dict[str, tuple[str, ...]] = {
    "leaf": ("chandrad", "chandrad.errors", "chandrad.states", "chandrad.events", "chandrad.names",
             "chandrad.early",
             "chandrad.png", "chandrad.malloc", "chandrad.engine", "chandrad.control",
             "chandrad.ctl"),
    "pure": ("chandrad.tasks", "chandrad.config", "chandrad.protocol", "chandrad.interfaces",
             "chandrad.engine.classify", "chandrad.engine.profile", "chandrad.engine.launch",
             "chandrad.engine.command", "chandrad.engine.policy", "chandrad.engine.budget",
             "chandrad.engine.progress", "chandrad.engine.inflight", "chandrad.engine.inbox",
             "chandrad.engine.replicas", "chandrad.engine.planner", "chandrad.engine.replan",
             "chandrad.tune",
             "chandrad.ocr", "chandrad.textlayer", "chandrad.pipeline.attempts",
             "chandrad.pipeline.limits"),
    "adapter": ("chandrad.engine.process", "chandrad.engine.session", "chandrad.engine.learned",
                "chandrad.engine.flagcache",
                "chandrad.engine.client", "chandrad.gpu",
                "chandrad.store", "chandrad.store.records", "chandrad.store.contract",
                "chandrad.store.sqlite", "chandrad.store.jobs", "chandrad.store.pages",
                "chandrad.store.profiles", "chandrad.store.database", "chandrad.store.schema",
                "chandrad.store.guard", "chandrad.store.repair", "chandrad.store.operations",
                "chandrad.store.api", "chandrad.store.pg_check",
                "chandrad.store.postgres", "chandrad.store.pg_database",
                "chandrad.store.pg_schema", "chandrad.store.leases", "chandrad.store.pg_listen",
                "chandrad.store.page_leases",
                "chandrad.watch", "chandrad.render", "chandrad.outputs",
                "chandrad.systemd", "chandrad.logs", "chandrad.model_files", "chandrad.fetch",
                "chandrad.metrics"),
    "service": ("chandrad.engine.supervisor", "chandrad.engine.fetching",
                "chandrad.engine.generation", "chandrad.engine.dispatch", "chandrad.pipeline",
                "chandrad.pipeline.scheduler", "chandrad.pipeline.intake",
                "chandrad.pipeline.jobs", "chandrad.pipeline.worker", "chandrad.pipeline.content",
                "chandrad.pipeline.helping",
                "chandrad.pipeline.waits", "chandrad.pipeline.held",
                "chandrad.engine.flagcheck", "chandrad.engine.probe", "chandrad.engine.spawn",
                "chandrad.engine.keeper", "chandrad.engine.planning",
                "chandrad.batch",
                "chandrad.control.server", "chandrad.control.handlers",
                "chandrad.api", "chandrad.api.app", "chandrad.api.door", "chandrad.api.openapi",
                "chandrad.api.server", "chandrad.api.tokens", "chandrad.api.uploads",
                "chandrad.api.webhooks"),
    "daemon": ("chandrad.daemon", "chandrad.daemon.core", "chandrad.daemon.queue",
               "chandrad.daemon.lifecycle", "chandrad.daemon.wiring", "chandrad.daemon.report",
               "chandrad.daemon.watching", "chandrad.daemon.controls",
               "chandrad.daemon.reload", "chandrad.daemon.shutdown",
               "chandrad.daemon.door"),
    "entry": ("chandrad.cli", "chandrad.batch_view", "chandrad.tune_run", "chandrad.__main__",
              "chandrad.ctl.main",
              "chandrad.ctl.client",
              "chandrad.ctl.diagnose", "chandrad.ctl.journal", "chandrad.ctl.render",
              "chandrad.ctl.top", "chandrad.ctl.cluster"),
}
RANK = {name: rank for rank, name in enumerate(LAYERS)}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
PACKAGE = Path(__file__).resolve().parents[1] / "chandrad"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _chandrad_imports(path: Path) -> set[str]:
    """Every chandrad module ``path`` imports, at top level or inside a function, including
    ``importlib.import_module("chandrad...")`` with a literal name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "chandrad")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = _module_name(path).split(".")
                if path.name != "__init__.py":
                    package = package[:-1]
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "chandrad":
                continue
            for alias in node.names:  # `from chandrad import gpu` imports the module chandrad.gpu
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in LAYER_OF else base)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and node.args[0].value.split(".")[0] == "chandrad"):
            found.add(node.args[0].value)
    return found


def _may_import(importer: str, imported: str) -> bool:
    """Down the map; sideways only within the pure, daemon and entry layers, and within one
    service package (``control.server`` -> ``control.handlers``). Adapters own one outside
    resource each and import no other adapter (a package that is itself an adapter, ``store``,
    is one resource: its modules import each other); services meet each other only through the
    daemon (one package, whose modules wire the parts together)."""
    a, b = LAYER_OF[importer], LAYER_OF[imported]
    if RANK[b] < RANK[a]:
        return True
    if a != b:
        return False
    if a in ("pure", "daemon", "entry"):
        return True
    if a == "adapter":
        return any(LAYER_OF.get(package) == "adapter" and imported.startswith(package + ".")
                   for package in (importer, importer.rsplit(".", 1)[0]))
    if a == "service":  # a package's modules, and its __init__ re-exporting them
        package = imported.rsplit(".", 1)[0]
        return package in (importer.rsplit(".", 1)[0], importer) and package != "chandrad"
    return False


def test_every_module_has_a_layer() -> None:
    """A new module must be placed on the map (here and in docs/architecture.md)."""
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    unplaced = sorted(modules - set(LAYER_OF))
    assert not unplaced, f"add these to LAYERS in tests/test_imports.py: {unplaced}"
    assert not set(LAYER_OF) - modules, "LAYERS names a module that no longer exists"


def test_imports_point_down_the_layer_map() -> None:
    """No module imports a layer above its own (the pure layer imports no adapter, an adapter
    no service, ...), nor a sideways neighbour it should reach only through an interface."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = _module_name(path)
        for imported in sorted(_chandrad_imports(path)):
            if imported not in LAYER_OF:
                bad.append(f"{importer} imports unknown {imported}")
            elif imported != importer and not _may_import(importer, imported):
                bad.append(f"{importer} ({LAYER_OF[importer]}) imports {imported} "
                           f"({LAYER_OF[imported]})")
    assert bad == []


def test_layer_check_sees_every_form_of_import() -> None:
    """The scanner finds plain, from-, relative, function-local and import_module imports."""
    probe = PACKAGE / "engine" / "command.py"
    assert "chandrad.engine.profile" in _chandrad_imports(probe)
    assert "chandrad.control.handlers" in _chandrad_imports(PACKAGE / "control" / "server.py")
    assert {"chandrad.daemon", "chandrad.gpu"} <= _chandrad_imports(PACKAGE / "cli.py")
    assert "chandrad.ctl.render" in _chandrad_imports(PACKAGE / "ctl" / "main.py")
    assert not _may_import("chandrad.engine.command", "chandrad.systemd")
    assert not _may_import("chandrad.pipeline", "chandrad.engine.supervisor")
    assert not _may_import("chandrad.store", "chandrad.render")
    assert not _may_import("chandrad.store.jobs", "chandrad.gpu")
    assert not _may_import("chandrad.engine.process", "chandrad.engine.session")
    assert _may_import("chandrad.store.sqlite", "chandrad.store.jobs")
    assert _may_import("chandrad.engine.command", "chandrad.engine.profile")


def test_the_daemon_parts_do_not_import_the_daemon_back() -> None:
    """Each part of the daemon package is given the collaborators it uses; none imports
    ``daemon.core`` (the ``Daemon`` that builds them), not even for type hints."""
    parts = sorted(p for p in (PACKAGE / "daemon").glob("*.py")
                   if p.name not in ("__init__.py", "core.py"))
    assert len(parts) >= 8
    bad = [p.name for p in parts if "chandrad.daemon.core" in _chandrad_imports(p)]
    assert bad == []


#: The pipeline package, top to bottom: each module imports only those after it, so the
#: page worker and its attempts policy never reach back into the scheduler.
PIPELINE_ORDER = ("scheduler", "held", "waits", "intake", "helping", "jobs", "worker",
                  "attempts", "limits", "content")


def test_the_pipeline_package_imports_downwards() -> None:
    bad = []
    for rank, name in enumerate(PIPELINE_ORDER):
        below = {f"chandrad.pipeline.{n}" for n in PIPELINE_ORDER[rank + 1:]}
        for imported in _chandrad_imports(PACKAGE / "pipeline" / f"{name}.py"):
            if imported.startswith("chandrad.pipeline") and imported not in below:
                bad.append(f"chandrad.pipeline.{name} imports {imported}")
    assert bad == []
    modules = {p.stem for p in (PACKAGE / "pipeline").glob("*.py")} - {"__init__"}
    assert modules == set(PIPELINE_ORDER), "place a new pipeline module in PIPELINE_ORDER"
