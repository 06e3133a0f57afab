"""Memory profiles and the downshift ladder (docs/operations.md, The downshift ladder).

Owns :class:`MemoryProfile` (the memory-related engine settings plus the page
budget that goes with them) and the pure decision "given this failure, what is
the next profile, or why can a restart not help". No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

from chandrad.config import DownshiftConfig, MemoryConfig
from chandrad.engine import launch
from chandrad.engine.classify import FailureClass

if TYPE_CHECKING:
    from chandrad.engine.planner import Plan


@dataclass(frozen=True)
class MemoryProfile:
    """Every knob the ladder may turn. ``None`` leaves vLLM's own default."""

    gpu_memory_utilization: float | None = 0.9
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    block_size: int | None = None
    enforce_eager: bool = False
    cpu_offload_gb: float = 0.0
    kv_cache_memory_bytes: int | None = None
    mm_processor_cache_gb: float | None = None
    expandable_segments: bool = False
    # Page budget: lowered only as a last resort (degraded quality, logged as such).
    max_pixels: int | None = None
    max_output_tokens: int | None = None
    # Chandra's GPU launch (engine/launch.py): --dtype, --enable-prefix-caching,
    # --no-enforce-eager and its processor pixel limits. Set when there is a GPU.
    chandra_launch: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryProfile:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def changes_from(self, old: MemoryProfile) -> dict[str, tuple[Any, Any]]:
        """``{knob: (old, new)}`` for every knob that differs."""
        return {
            f.name: (getattr(old, f.name), getattr(self, f.name))
            for f in fields(self)
            if getattr(old, f.name) != getattr(self, f.name)
        }

    def with_changes(self, **changes: Any) -> MemoryProfile:
        return replace(self, **changes)


def auto_batching(gpu_total_gib: float | None) -> tuple[int, int] | None:
    """Chandra's GPU table: GPU memory → (max_num_batched_tokens, max_num_seqs).

    ``None`` when there is no GPU to size from (leave vLLM's defaults).
    """
    return None if gpu_total_gib is None else launch.batching(gpu_total_gib)


def initial_profile(memory: MemoryConfig, gpu_total_gib: float | None,
                    plan: Plan | None = None) -> MemoryProfile:
    """The configured starting profile with ``"auto"`` resolved.

    With a GPU, ``"auto"`` is Chandra's own launch (``engine/launch.py``) sized for
    ``gpu_total_gib``, the memory of the GPU the engine will use; without one it is
    vLLM's default. A ``plan`` that fits (``engine/planner.py``, made with those as its
    upper bounds) overrides ``"auto"`` ``max_model_len`` / ``max_num_seqs`` /
    ``max_num_batched_tokens`` with what it says fits; the ladder stays the net.
    """
    gpu = gpu_total_gib is not None
    auto = auto_batching(gpu_total_gib)
    seqs = memory.max_num_seqs
    tokens = memory.max_num_batched_tokens
    util = memory.gpu_memory_utilization
    length = memory.max_model_len
    if seqs == "auto":
        seqs = auto[1] if auto else None
    if tokens == "auto":
        tokens = auto[0] if auto else None
    if util == "auto":
        util = launch.GPU_MEMORY_UTILIZATION if gpu else None
    if length == "auto":
        length = launch.MAX_MODEL_LEN if gpu else None
    if plan is not None and plan.fits:
        seqs = plan.max_num_seqs if memory.max_num_seqs == "auto" else seqs
        tokens = plan.max_num_batched_tokens if memory.max_num_batched_tokens == "auto" else tokens
        length = plan.max_model_len if memory.max_model_len == "auto" else length
    return MemoryProfile(
        gpu_memory_utilization=None if util is None else float(util),
        max_num_seqs=None if seqs is None else int(seqs),
        max_num_batched_tokens=None if tokens is None else int(tokens),
        max_model_len=None if length is None else int(length),
        block_size=memory.block_size,
        enforce_eager=memory.enforce_eager,
        cpu_offload_gb=memory.cpu_offload_gb,
        kv_cache_memory_bytes=memory.kv_cache_memory_bytes,
        mm_processor_cache_gb=memory.mm_processor_cache_gb,
        chandra_launch=gpu,
    )


# --------------------------------------------------------------------------- the ladder

#: Tokens of Chandra's layout prompt and chat template around one page (measured on
#: the Qwen3-VL tokenizer: the prompt is ~900 tokens; rounded up).
PROMPT_TOKENS = 1024
#: Qwen-VL family: one visual token per 28x28 pixel patch after merging.
PIXELS_PER_IMAGE_TOKEN = 28 * 28
#: Margin kept free when gpu_memory_utilization is lowered to what the GPU has free.
UTILIZATION_MARGIN = 0.03
UTILIZATION_STEP = 0.05
MIN_PIXELS_BUDGET = 1024 * 1024
#: Margin added to the utilisation a KV-cache failure's numbers call for: vLLM prints its
#: GiB to two decimals, and the profile run's peak moves a little from start to start.
KV_UTILIZATION_MARGIN = 0.01
#: A length fitted from the numbers keeps this share of what they say fits (rounding of
#: the printed GiB, the tokens-per-GiB ratio of a hybrid model being only near-linear).
KV_LENGTH_MARGIN = 0.98


@dataclass(frozen=True)
class GpuFacts:
    """What NVML says right now (``None`` fields: unknown, e.g. no GPU)."""

    total_gib: float | None = None
    free_gib: float | None = None


@dataclass(frozen=True)
class Decision:
    """The ladder's answer: a new profile, the same one (plain restart), or give up."""

    profile: MemoryProfile | None  # None = a restart cannot help (fatal)
    reason: str
    degraded: bool = False  # the page budget was lowered (quality loss)

    @property
    def fatal(self) -> bool:
        return self.profile is None


def estimate_prompt_tokens(width: int, height: int,
                           pixels_per_token: int = PIXELS_PER_IMAGE_TOKEN) -> int:
    """An upper estimate of one page's prompt: Chandra's prompt plus the image's tokens.

    ``pixels_per_token`` from the model's own processor config where it is on this host
    (``model_files.pixels_per_image_token``), else the Qwen2-VL 28×28 px, which
    overestimates newer Qwen models.
    """
    return PROMPT_TOKENS + -(-(width * height) // pixels_per_token)


def page_tokens(max_pixels: int, max_output_tokens: int) -> int:
    """What one page needs in the context: prompt + image tokens + output budget."""
    return PROMPT_TOKENS + max_pixels // PIXELS_PER_IMAGE_TOKEN + max_output_tokens


#: A profile that already failed → (its failure class, the numbers its message gave).
FailedProfiles = Mapping[MemoryProfile, tuple[str, dict[str, float]]]


def next_profile(
    profile: MemoryProfile,
    failure: str,
    numbers: dict[str, float],
    floors: DownshiftConfig,
    *,
    max_pixels: int,
    max_output_tokens: int,
    gpu: GpuFacts | None = None,
    failed: FailedProfiles | None = None,
) -> Decision:
    """One step down the ladder (docs/operations.md, The downshift ladder) for ``failure``.

    Never returns to a profile in ``failed``: where the step leads to one, the ladder
    goes on from there as that profile's own failure directs (so 0.86 that ran out of
    KV cache, reached again after 0.91 did not fit, moves on to ``enforce_eager``
    instead of bouncing between the two until the restart budget is spent).

    Args:
        profile: the profile the engine failed with.
        failure: a ``FailureClass`` value.
        numbers: what the failure message gave (see ``classify.Diagnosis.numbers``).
        floors: limits from ``[engine.downshift]``.
        max_pixels, max_output_tokens: the configured page budget (used unless the
            profile already lowered it).
        gpu: NVML facts, when there is a GPU.
        failed: profiles that already failed in this run, with their failure.
    """
    failed = failed or {}
    decision = _step(profile, failure, numbers, floors, max_pixels, max_output_tokens, gpu)
    visited = {profile}
    while (decision.profile is not None and decision.profile not in visited
           and decision.profile in failed):
        skipped = decision.profile
        visited.add(skipped)
        old_failure, old_numbers = failed[skipped]
        after = _step(skipped, old_failure, old_numbers, floors, max_pixels,
                      max_output_tokens, gpu)
        decision = Decision(after.profile, f"{decision.reason}; that profile already failed "
                            f"({old_failure}), so: {after.reason}",
                            degraded=decision.degraded or after.degraded)
    if decision.profile is not None and decision.profile != profile \
            and decision.profile in visited:
        return Decision(None, f"{failure}: every next step leads back to a profile that "
                        "already failed")
    return decision


def _step(
    profile: MemoryProfile,
    failure: str,
    numbers: dict[str, float],
    floors: DownshiftConfig,
    max_pixels: int,
    max_output_tokens: int,
    gpu: GpuFacts | None,
) -> Decision:
    pixels = profile.max_pixels or max_pixels
    out_tokens = profile.max_output_tokens or max_output_tokens
    if failure == FailureClass.KV_CACHE_INSUFFICIENT:
        return _kv_cache(profile, numbers, floors, gpu, pixels, out_tokens)
    if failure == FailureClass.GPU_MEMORY_UTILIZATION_TOO_HIGH:
        return _utilization(profile, numbers, floors, gpu)
    if failure == FailureClass.CUDA_OOM_LOAD:
        return _oom_load(profile, floors, pixels)
    if failure == FailureClass.FRAGMENTATION:
        if not profile.expandable_segments:
            return Decision(profile.with_changes(expandable_segments=True),
                            "fragmentation: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        return _oom_runtime(profile, floors, pixels, "fragmentation recurred with "
                            "expandable_segments; treating it as a runtime OOM")
    if failure == FailureClass.CUDA_OOM_RUNTIME:
        return _oom_runtime(profile, floors, pixels, "CUDA OOM while serving")
    if failure == FailureClass.HOST_OOM:
        return _host_oom(profile, floors)
    if failure == FailureClass.MAMBA_CACHE_INSUFFICIENT:
        return _mamba_cache(profile, numbers, floors)
    return Decision(profile, f"{failure}: restart with the same profile")


def _halve(value: int | None, floor: int, default: int) -> int | None:
    current = value if value is not None else default
    new = max(floor, current // 2)
    return new if new < current else None


def _kv_cache(
    profile: MemoryProfile,
    numbers: dict[str, float],
    floors: DownshiftConfig,
    gpu: GpuFacts | None,
    pixels: int,
    out_tokens: int,
) -> Decision:
    need = page_tokens(pixels, out_tokens)
    # V0's "... that can be stored in KV cache (N)" names the same limit as V1's estimate.
    estimated = numbers.get("estimated_max_model_len") or numbers.get("kv_cache_tokens")
    if profile.kv_cache_memory_bytes is None:  # else utilisation does not size the KV cache
        fitted = _kv_from_numbers(profile, numbers, floors, gpu, need, pixels, out_tokens)
        if fitted is not None:
            return fitted
    if estimated is not None and int(estimated) >= max(need, floors.min_max_model_len):
        new_len = int(estimated) // 16 * 16
        current = profile.max_model_len
        if current is None or new_len < current:
            return Decision(profile.with_changes(max_model_len=new_len),
                            f"KV cache holds {int(estimated)} tokens; a page needs {need}: "
                            f"max_model_len {current} -> {new_len}")
    # The KV cache cannot hold one page: add memory.
    if profile.kv_cache_memory_bytes is not None:
        # An explicit KV budget: size it for one page (at least the floor length) and cap
        # max_model_len there, so the next start fits without another round.
        tokens = max(need, floors.min_max_model_len)
        tokens = -(-tokens // 16) * 16
        if estimated and estimated > 0:
            target = int(profile.kv_cache_memory_bytes * (tokens / estimated) * 1.25)
        else:
            target = profile.kv_cache_memory_bytes * 4
        target = max(target, profile.kv_cache_memory_bytes * 2)
        current_len = profile.max_model_len
        new_len = tokens if current_len is None or current_len > tokens else current_len
        return Decision(profile.with_changes(kv_cache_memory_bytes=target, max_model_len=new_len),
                        f"explicit KV cache budget holds {int(estimated or 0)} tokens, a page "
                        f"needs {need}: kv_cache_memory_bytes {profile.kv_cache_memory_bytes} "
                        f"-> {target}, max_model_len {profile.max_model_len} -> {new_len}")
    util = profile.gpu_memory_utilization
    if util is not None and gpu is not None and gpu.free_gib is not None and gpu.total_gib:
        # Raise only as far as what is free (the old engine is gone by now) allows, minus
        # the margin: asking for more fails "utilization too high" at the next start.
        fits = round(gpu.free_gib / gpu.total_gib - UTILIZATION_MARGIN, 2)
        new_util = round(min(util + UTILIZATION_STEP, floors.max_gpu_memory_utilization,
                             fits), 2)
        if new_util >= round(util + 0.01, 2):
            return Decision(profile.with_changes(gpu_memory_utilization=new_util),
                            f"KV cache too small and the GPU has {gpu.free_gib:.1f} of "
                            f"{gpu.total_gib:.1f} GiB free: gpu_memory_utilization {util} -> "
                            f"{new_util}")
    if not profile.enforce_eager:
        return Decision(profile.with_changes(enforce_eager=True),
                        "KV cache too small: enforce_eager frees the CUDA graph memory")
    if profile.cpu_offload_gb < floors.max_cpu_offload_gb:
        new_off = min(floors.max_cpu_offload_gb, profile.cpu_offload_gb + 4.0)
        return Decision(profile.with_changes(cpu_offload_gb=new_off),
                        f"KV cache too small: cpu_offload_gb {profile.cpu_offload_gb} -> {new_off}")
    return _lower_page_budget(profile, pixels, out_tokens, estimated, floors)


def _kv_from_numbers(
    profile: MemoryProfile,
    numbers: dict[str, float],
    floors: DownshiftConfig,
    gpu: GpuFacts | None,
    need: int,
    pixels: int,
    out_tokens: int,
) -> Decision | None:
    """One step to a profile that fits, from vLLM's "X GiB KV cache is needed, which is
    larger than the available KV cache memory (Y GiB)" and NVML's total and free memory.

    Raising ``gpu_memory_utilization`` by Δ gives the KV cache Δ × total more (the weights
    and activations do not change), so: if the card has it, utilisation + (X − Y)/total +
    a margin, keeping ``max_model_len``; else, where the length vLLM estimates holds a page,
    ``None`` (the ladder fits it, taking no more memory); else as much as the card has, plus
    ``cpu_offload_gb``
    (within ``max_cpu_offload_gb``), and ``max_model_len`` fitted to what that KV cache holds
    (the message's own ratio of tokens to GiB). Where that length would not hold a page:
    ``enforce_eager`` first (the CUDA graphs' memory is in no message), then the page
    budget lowered to fit (degraded). ``None`` when the numbers (or NVML's total) are
    missing: the ladder walks its rungs.
    """
    needed = numbers.get("needed_gib")
    available = numbers.get("available_gib")
    length = numbers.get("max_model_len") or profile.max_model_len
    util = profile.gpu_memory_utilization
    if (not needed or available is None or needed <= available or not length or util is None
            or gpu is None or not gpu.total_gib):
        return None
    total = gpu.total_gib
    ceiling = floors.max_gpu_memory_utilization
    if gpu.free_gib is not None:  # the old engine is gone: what is free is the card's room
        ceiling = min(ceiling, gpu.free_gib / total - UTILIZATION_MARGIN)
    ceiling = math.floor(round(ceiling, 6) * 100) / 100
    exact = math.ceil(round((util + (needed - available) / total + KV_UTILIZATION_MARGIN)
                            * 100, 6)) / 100
    shown = f"KV cache needs {needed:g} GiB, has {available:g} GiB"
    if exact <= ceiling:
        return Decision(profile.with_changes(gpu_memory_utilization=exact),
                        f"{shown}; the GPU has {gpu.free_gib} of {total:g} GiB free: "
                        f"gpu_memory_utilization {util} -> {exact} (the missing "
                        f"{needed - available:.2f} GiB plus a margin)")
    estimated = numbers.get("estimated_max_model_len")
    if estimated is not None and int(estimated) >= max(need, floors.min_max_model_len):
        return None  # the length vLLM estimates holds a page: fit it, take no more memory
    new_util = max(util, ceiling)
    kv = available + (new_util - util) * total
    changes: dict[str, Any] = {}
    if new_util > util:
        changes["gpu_memory_utilization"] = new_util
    room = floors.max_cpu_offload_gb - profile.cpu_offload_gb
    if room > 0:  # offloaded weights leave their GiB to the KV cache
        offload = min(room, float(math.ceil(needed - kv + KV_UTILIZATION_MARGIN * total)))
        changes["cpu_offload_gb"] = profile.cpu_offload_gb + offload
        kv += offload
        if kv >= needed + KV_UTILIZATION_MARGIN * total:
            return Decision(profile.with_changes(**changes),
                            f"{shown}; the GPU has room for {new_util}: "
                            f"{_describe(changes, profile)}")
    # The length a KV cache of ``kv`` GiB holds, from the message's own tokens per GiB
    # (the printed GiB are rounded to 0.01: count the needed side high, the rest low).
    if estimated and kv == available:  # nothing gained: vLLM's own estimate is exact
        fits = int(estimated) // 16 * 16
    else:
        fits = int((kv - 0.01) * length / (needed + 0.005) * KV_LENGTH_MARGIN) // 16 * 16
    if fits >= length:  # fits, if only within the margin: the raise is all there is to do
        return Decision(profile.with_changes(**changes),
                        f"{shown}; the GPU has room for {new_util}: "
                        f"{_describe(changes, profile)}") if changes else None
    if fits >= max(need, floors.min_max_model_len):
        changes["max_model_len"] = fits
        return Decision(profile.with_changes(**changes),
                        f"{shown}; the GPU has room for {new_util} at most: "
                        f"{_describe(changes, profile)} (still one page of {need} tokens)")
    if not profile.enforce_eager:
        # Fitting would lower the page budget; the CUDA graphs' memory, which no message
        # states, may be enough: try that first (one start more at worst, not a lasting
        # quality loss).
        changes["enforce_eager"] = True
        return Decision(profile.with_changes(**changes),
                        f"{shown}; the GPU has room for {new_util} at most and a fitted "
                        f"max_model_len ({fits}) would not hold a page of {need} tokens: "
                        f"{_describe(changes, profile)} (frees the CUDA graphs' memory)")
    lowered = _lower_page_budget(profile.with_changes(**changes), pixels, out_tokens, fits,
                                 floors)
    if lowered.profile is None:
        return lowered
    return Decision(lowered.profile, f"{shown}; the GPU has room for {new_util} at most: "
                    f"{_describe(lowered.profile.changes_from(profile), profile)}; "
                    f"{lowered.reason}", degraded=True)


def _describe(changes: Mapping[str, Any], profile: MemoryProfile) -> str:
    return ", ".join(f"{k} {getattr(profile, k)} -> "
                     f"{v[1] if isinstance(v, tuple) else v}" for k, v in changes.items())


def _mamba_cache(
    profile: MemoryProfile, numbers: dict[str, float], floors: DownshiftConfig
) -> Decision:
    """vLLM's "max_num_seqs (R) exceeds available Mamba cache blocks (N)": ``max_num_seqs``
    = N in one step.

    No margin: the pool is sized from the KV cache memory before this check, and a lower
    ``max_num_seqs`` only shrinks what the profile run and CUDA graphs take, so the pool
    at the next start is at least N. This step changes nothing else; a later step that does
    shrink the pool (a lower ``gpu_memory_utilization``) makes vLLM name the new N.
    """
    blocks = numbers.get("mamba_cache_blocks")
    requested = numbers.get("max_num_seqs") or profile.max_num_seqs
    if blocks is None:  # the number was cut off: halve what was asked
        seqs = _halve(None if requested is None else int(requested),
                      floors.min_max_num_seqs, 256)
        if seqs is None:
            return Decision(None, "the Mamba cache cannot hold the floor's "
                            f"min_max_num_seqs={floors.min_max_num_seqs} sequences")
        return Decision(profile.with_changes(max_num_seqs=seqs),
                        f"Mamba cache too small for {requested} sequences: max_num_seqs -> "
                        f"{seqs}")
    target = int(blocks)
    if target < max(1, floors.min_max_num_seqs):
        return Decision(None, f"the Mamba cache holds {target} sequences, below the floor "
                        f"min_max_num_seqs={floors.min_max_num_seqs}; give the engine more "
                        "GPU memory (gpu_memory_utilization) or use a larger GPU")
    current = profile.max_num_seqs
    if current is not None and current <= target:
        return Decision(profile, f"mamba_cache_insufficient, but max_num_seqs {current} is "
                        f"within the {target} blocks named: restart with the same profile")
    return Decision(profile.with_changes(max_num_seqs=target),
                    f"Mamba cache holds {target} sequences, {int(requested or 0) or 'more'} "
                    f"were asked: max_num_seqs {current} -> {target}")


def _lower_page_budget(
    profile: MemoryProfile, pixels: int, out_tokens: int, estimated: float | None,
    floors: DownshiftConfig,
) -> Decision:
    if estimated is None or estimated < PROMPT_TOKENS + 256:
        return Decision(None, "the KV cache cannot hold even a minimal page and no memory "
                        "knob is left; give the engine more GPU memory or a smaller model")
    room = int(estimated) - PROMPT_TOKENS
    new_out = max(256, min(out_tokens, room // 2))
    new_pixels = max(MIN_PIXELS_BUDGET // 4, min(pixels, (room - new_out) *
                                                   PIXELS_PER_IMAGE_TOKEN))
    new_len = int(estimated) // 16 * 16
    if new_len < floors.min_max_model_len:
        return Decision(None, f"the KV cache holds only {int(estimated)} tokens, below the "
                        f"floor min_max_model_len={floors.min_max_model_len}")
    return Decision(
        profile.with_changes(max_model_len=new_len, max_pixels=new_pixels,
                             max_output_tokens=new_out),
        f"last resort: page budget lowered to {new_pixels} px and {new_out} output tokens "
        f"to fit max_model_len {new_len} (degraded quality)",
        degraded=True,
    )


def _utilization(
    profile: MemoryProfile, numbers: dict[str, float], floors: DownshiftConfig, gpu: GpuFacts | None
) -> Decision:
    free = numbers.get("free_gib")
    total = numbers.get("total_gib")
    if (free is None or not total) and gpu is not None:
        free, total = gpu.free_gib, gpu.total_gib
    current = profile.gpu_memory_utilization or 0.9
    if free is not None and total:
        target = round(free / total - UTILIZATION_MARGIN, 2)
    else:
        target = round(current - UTILIZATION_STEP, 2)
    target = min(target, round(current - 0.01, 2))
    if target < floors.min_gpu_memory_utilization:
        return Decision(None, f"only {target:.2f} of the GPU is free, below the floor "
                        f"min_gpu_memory_utilization={floors.min_gpu_memory_utilization}; "
                        "another process holds the GPU (see `chandractl gpu`)")
    return Decision(profile.with_changes(gpu_memory_utilization=target),
                    f"GPU has less free memory than asked: gpu_memory_utilization "
                    f"{current} -> {target}")


def _oom_load(profile: MemoryProfile, floors: DownshiftConfig, pixels: int) -> Decision:
    if not profile.enforce_eager:
        return Decision(profile.with_changes(enforce_eager=True),
                        "CUDA OOM while loading: enforce_eager (no CUDA graphs)")
    image_tokens = pixels // PIXELS_PER_IMAGE_TOKEN
    seqs = _halve(profile.max_num_seqs, floors.min_max_num_seqs, 256)
    batched = _halve(profile.max_num_batched_tokens,
                     max(floors.min_max_num_batched_tokens, image_tokens), 8192)
    if seqs is not None or batched is not None:
        changes: dict[str, Any] = {}
        if seqs is not None:
            changes["max_num_seqs"] = seqs
        if batched is not None:
            changes["max_num_batched_tokens"] = batched
        return Decision(profile.with_changes(**changes),
                        "CUDA OOM while loading: fewer concurrent sequences and batched tokens")
    if profile.cpu_offload_gb < floors.max_cpu_offload_gb:
        new_off = min(floors.max_cpu_offload_gb, profile.cpu_offload_gb + 4.0)
        return Decision(profile.with_changes(cpu_offload_gb=new_off),
                        f"CUDA OOM while loading: cpu_offload_gb {profile.cpu_offload_gb} -> "
                        f"{new_off}")
    return Decision(None, "the model does not fit on this GPU even at the floors "
                    "(enforce_eager, minimal batch, no more CPU offload allowed); raise "
                    "engine.downshift.max_cpu_offload_gb or use a larger GPU")


def _oom_runtime(
    profile: MemoryProfile, floors: DownshiftConfig, pixels: int, why: str
) -> Decision:
    image_tokens = pixels // PIXELS_PER_IMAGE_TOKEN
    seqs = _halve(profile.max_num_seqs, floors.min_max_num_seqs, 256)
    batched = _halve(profile.max_num_batched_tokens,
                     max(floors.min_max_num_batched_tokens, image_tokens), 8192)
    new_pixels = max(MIN_PIXELS_BUDGET, int(pixels * 0.75))
    changes: dict[str, Any] = {}
    if seqs is not None:
        changes["max_num_seqs"] = seqs
    if batched is not None:
        changes["max_num_batched_tokens"] = batched
    degraded = new_pixels < pixels
    if degraded:
        changes["max_pixels"] = new_pixels
    if not changes:
        return Decision(None, f"{why}, and every knob is at its floor")
    return Decision(profile.with_changes(**changes),
                    f"{why}: halve max_num_seqs/max_num_batched_tokens, lower the pixel budget",
                    degraded=degraded)


def _host_oom(profile: MemoryProfile, floors: DownshiftConfig) -> Decision:
    cache = profile.mm_processor_cache_gb
    current = 4.0 if cache is None else cache
    if current > 0:
        new = 0.0 if current <= 1 else current / 2
        return Decision(profile.with_changes(mm_processor_cache_gb=new),
                        f"host RAM exhausted (kernel OOM killer): mm_processor_cache_gb "
                        f"{cache} -> {new}")
    seqs = _halve(profile.max_num_seqs, floors.min_max_num_seqs, 256)
    if seqs is not None:
        return Decision(profile.with_changes(max_num_seqs=seqs),
                        "host RAM exhausted: fewer concurrent sequences")
    return Decision(None, "host RAM exhausted even at the floors; add RAM or swap")
