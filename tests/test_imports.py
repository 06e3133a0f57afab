"""The daemon process stays small: heavy libraries load only in workers or the engine."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "vllm", "pymupdf", "chandra.model", "chandra.output", "openai", "transformers")


def test_daemon_imports_no_heavy_library() -> None:
    """Importing the daemon (everything `chandrad run` wires) loads none of torch, vLLM,
    PyMuPDF, chandra.model/output or openai: those live in the engine and render workers."""
    code = (
        "import json, sys, chandrad.daemon, chandrad.cli; "
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert json.loads(out.stdout) == []
