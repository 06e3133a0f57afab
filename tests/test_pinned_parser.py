"""The GPU previews pass the pinned vLLM's own argument parser, not only the installed one's.

Each card's flags (``check-config --gpu-memory <card>``, the cards of test_launch.py) go to the
side venv of ``scripts/pinned-vllm.sh`` (vLLM 0.17.1's Python package beside the main venv's
torch), whose interpreter runs chandrad's flag check with that vLLM's parser. Two probes show
the judge is the pinned parser and not the installed 0.32: ``--swap-space`` (0.17 has it, 0.32
removed it: test_command.py) and ``--kv-cache-dtype nvfp4`` (0.32 only). One child
interpreter, ~10 s.
Skipped where the side venv is absent (it fails instead in CI, where setup.sh builds it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from pinned_parser import judge, previewed_flags, require_pinned_python
from test_launch import CARDS

from chandrad.engine import launch

#: Every knob the downshift ladder may turn on a GPU, at once (engine/profile.py).
LADDER = {"gpu_memory_utilization": 0.6, "max_num_seqs": 4, "max_num_batched_tokens": 1024,
          "max_model_len": 8192, "block_size": 32, "enforce_eager": True, "cpu_offload_gb": 4.0,
          "kv_cache_memory_bytes": 8 << 30, "mm_processor_cache_gb": 0.0}
SWAP_PROBE = ("--swap-space", "4")
NVFP4_PROBE = ("--kv-cache-dtype", "nvfp4")


@pytest.fixture(scope="module")
def verdict() -> dict[str, Any]:
    python = require_pinned_python()
    h100 = list(previewed_flags(81559))
    flag_sets = {card: list(previewed_flags(mib)) for card, mib, _ in CARDS}
    flag_sets["ladder"] = list(previewed_flags(81559, **LADDER))
    flag_sets["probe-swap"] = [*h100, *SWAP_PROBE]
    flag_sets["probe-nvfp4"] = [*h100, *NVFP4_PROBE]
    return judge(Path(python), flag_sets)


def test_the_judge_is_the_gpu_paths_vllm(verdict: dict[str, Any]) -> None:
    """The side venv's vLLM is inside the range the GPU path pins, not the installed one."""
    assert Version(verdict["vllm"]) in SpecifierSet(launch.GPU_VLLM_RANGE), verdict["vllm"]
    problems = verdict["problems"]
    assert problems["probe-swap"] == [], problems["probe-swap"]
    assert [p["code"] for p in problems["probe-nvfp4"]] == ["engine_flag_invalid"]
    assert "nvfp4" in problems["probe-nvfp4"][0]["message"]


@pytest.mark.parametrize(("card", "mib"), [(c, m) for c, m, _ in CARDS],
                         ids=[c[0] for c in CARDS])
def test_preview_passes_the_pinned_parser(verdict: dict[str, Any], card: str, mib: int) -> None:
    """Every flag chandrad previews for the card is one vLLM 0.17 knows, with a valid value."""
    assert verdict["problems"][card] == [], (card, previewed_flags(mib), verdict["problems"][card])


def test_every_ladder_knob_passes_the_pinned_parser(verdict: dict[str, Any]) -> None:
    """The H100 preview with every knob the downshift ladder turns (eager, CPU offload, an
    explicit KV size, a block size, no multimodal cache...) is one vLLM 0.17 accepts."""
    flags = previewed_flags(81559, **LADDER)
    for flag in ("--enforce-eager", "--cpu-offload-gb", "--kv-cache-memory-bytes",
                 "--block-size", "--mm-processor-cache-gb"):
        assert flag in flags, flag
    assert verdict["problems"]["ladder"] == [], (flags, verdict["problems"]["ladder"])
