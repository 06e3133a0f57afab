"""The memory plan of one engine on this host: ``engine/planner.py`` fed from the outside.

Owns gathering the planner's inputs for an ``[engine]``: the model's shape from its files
(``model_files``, the Hugging Face cache the engine reads), the engine's environment
(``VLLM_CPU_KVCACHE_SPACE``), the CPU's flags (``/proc/cpuinfo``) and the GPU's memory given
by the caller (NVML or ``check-config --gpu-memory``). ``None`` when the model's files are not
on this host yet (first start before the fetch): callers keep today's defaults.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from chandrad import model_files
from chandrad.config import EngineConfig, OcrConfig
from chandrad.engine import launch, planner
from chandrad.engine.profile import MemoryProfile, page_tokens
from chandrad.engine.replan import PlanContext


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def engine_plan(engine: EngineConfig, profile: MemoryProfile, ocr: OcrConfig, *,
                gpu_total_bytes: int | None = None, gpu_free_bytes: int | None = None,
                env: Mapping[str, str] | None = None) -> planner.Plan | None:
    """The plan for ``engine`` started at ``profile`` (``"auto"`` resolved, the plan's upper
    bounds); ``env`` is the engine's environment (default: this process's + ``engine.env``)."""
    context = plan_context(engine, profile, ocr, gpu_total_bytes=gpu_total_bytes,
                           gpu_free_bytes=gpu_free_bytes, env=env)
    return None if context is None else context.plan


def plan_context(engine: EngineConfig, profile: MemoryProfile, ocr: OcrConfig, *,
                 gpu_total_bytes: int | None = None, gpu_free_bytes: int | None = None,
                 env: Mapping[str, str] | None = None) -> PlanContext | None:
    """:func:`engine_plan` with what it was made from, for a failure to correct
    (``engine/replan.py``)."""
    env = {**os.environ, **engine.env} if env is None else env
    kwargs = engine.memory.mm_processor_kwargs
    pixels = kwargs.get("max_pixels") if isinstance(kwargs.get("max_pixels"), int) else None
    if pixels is None and profile.chandra_launch:  # Chandra's launch bounds the processor
        pixels = launch.MM_PROCESSOR_KWARGS["max_pixels"]
    shape = model_files.planner_shape(engine.model, pixels,
                                      cache_dir=model_files.hub_cache_dir(env))
    if shape is None:
        return None
    budget, request = planner.engine_inputs(
        engine.memory, profile, env=env, gpu_total_bytes=gpu_total_bytes,
        gpu_free_bytes=gpu_free_bytes, cpu_avx512_bf16=planner.avx512_bf16(_cpuinfo()),
        page_tokens=page_tokens(ocr.max_pixels, ocr.max_output_tokens))
    request = dataclasses.replace(request, enable_prefix_caching=prefix_caching(engine.extra_args))
    return PlanContext(shape, budget, request, planner.plan(shape, budget, request))


def prefix_caching(extra_args: Sequence[str]) -> bool:
    """Whether the engine caches prefixes: on unless ``extra_args`` turns it off (vLLM 0.32's
    default and Chandra's GPU launch, ``--enable-prefix-caching``; vLLM 0.17 would leave it off
    for a hybrid model without that flag). Off, a hybrid model holds one state block per
    sequence instead of ``align`` mode's two: more KV tokens fit."""
    on = True
    for token in extra_args:
        name = token.split("=", 1)[0].replace("_", "-")
        if name in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            on = name == "--enable-prefix-caching"
    return on
