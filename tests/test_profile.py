"""The memory profile and the downshift ladder (pure: every class, every floor)."""

from __future__ import annotations

import pytest

from chandrad.config import DownshiftConfig, MemoryConfig
from chandrad.engine.profile import (
    GpuFacts,
    MemoryProfile,
    auto_batching,
    initial_profile,
    next_profile,
    page_tokens,
)

FLOORS = DownshiftConfig()
BUDGET = {"max_pixels": 6291456, "max_output_tokens": 12384}


def step(profile: MemoryProfile, failure: str, numbers: dict[str, float] | None = None,
         **kw: object) -> MemoryProfile | None:
    decision = next_profile(profile, failure, numbers or {}, kw.pop("floors", FLOORS),  # type: ignore[arg-type]
                            **{**BUDGET, **kw})  # type: ignore[arg-type]
    return decision.profile


@pytest.mark.parametrize(("gib", "expected"), [
    (79.2, (8192, 64)), (139.7, (8192, 64)), (44.4, (4096, 32)), (39.4, (4096, 32)),
    (23.6, (2048, 16)), (15.7, (1024, 8)), (8.0, (1024, 8)), (None, None),
])
def test_auto_table(gib: float | None, expected: tuple[int, int] | None) -> None:
    """Chandra 2's table maps reported GPU memory (GiB, slightly under the label) to sizes."""
    assert auto_batching(gib) == expected


def test_initial_profile_resolves_auto_from_gpu() -> None:
    """'auto' knobs come from GPU memory; without a GPU they are left to vLLM."""
    with_gpu = initial_profile(MemoryConfig(), 79.2)
    assert (with_gpu.max_num_batched_tokens, with_gpu.max_num_seqs) == (8192, 64)
    no_gpu = initial_profile(MemoryConfig(), None)
    assert no_gpu.max_num_seqs is None and no_gpu.max_num_batched_tokens is None


def test_kv_cache_uses_estimated_length_when_a_page_fits() -> None:
    """kv_cache_insufficient with N ≥ one page sets max_model_len to N (block-aligned)."""
    need = page_tokens(**BUDGET)
    start = MemoryProfile(max_model_len=65536)
    new = step(start, "kv_cache_insufficient", {"estimated_max_model_len": need + 1001})
    assert new is not None and new.max_model_len == (need + 1001) // 16 * 16


def test_kv_cache_too_small_for_a_page_raises_explicit_budget() -> None:
    """An explicit kv_cache_memory_bytes that cannot hold one page is raised, in proportion."""
    start = MemoryProfile(kv_cache_memory_bytes=1_000_000, max_model_len=4096)
    new = step(start, "kv_cache_insufficient", {"estimated_max_model_len": 500},
               max_pixels=200_000, max_output_tokens=256)
    assert new is not None and new.kv_cache_memory_bytes is not None
    need = max(page_tokens(200_000, 256), FLOORS.min_max_model_len)
    assert new.kv_cache_memory_bytes >= 1_000_000 * need / 500
    assert new.max_model_len is not None and need <= new.max_model_len < 4096


def test_kv_cache_adds_memory_in_spec_order() -> None:
    """Without a usable N: raise utilization if NVML shows free memory, then eager, then offload."""
    gpu = GpuFacts(total_gib=80, free_gib=76)
    p0 = MemoryProfile(gpu_memory_utilization=0.8)
    floors = DownshiftConfig(max_cpu_offload_gb=8)
    p1 = step(p0, "kv_cache_insufficient", gpu=gpu, floors=floors)
    assert p1 is not None and p1.gpu_memory_utilization == 0.85
    p2 = step(p1, "kv_cache_insufficient", gpu=GpuFacts(80, 1), floors=floors)
    assert p2 is not None and p2.enforce_eager and p2.gpu_memory_utilization == 0.85
    p3 = step(p2, "kv_cache_insufficient", gpu=GpuFacts(80, 1), floors=floors)
    assert p3 is not None and p3.cpu_offload_gb == 4.0


def test_kv_cache_last_resort_lowers_page_budget_as_degraded() -> None:
    """With every memory knob spent, the page budget shrinks to fit N and is flagged degraded."""
    p = MemoryProfile(enforce_eager=True)
    decision = next_profile(p, "kv_cache_insufficient", {"estimated_max_model_len": 4000},
                            FLOORS, **BUDGET)  # type: ignore[arg-type]
    assert decision.degraded and decision.profile is not None
    new = decision.profile
    assert new.max_model_len == 4000 // 16 * 16
    assert new.max_output_tokens is not None and new.max_pixels is not None
    assert page_tokens(new.max_pixels, new.max_output_tokens) <= 4000 + 1024


def test_kv_cache_below_floor_is_fatal() -> None:
    """A KV cache smaller than min_max_model_len cannot be fixed by a restart."""
    p = MemoryProfile(enforce_eager=True)
    assert step(p, "kv_cache_insufficient", {"estimated_max_model_len": 1500}) is None


def test_kv_cache_raises_utilization_only_as_far_as_free_memory_allows() -> None:
    """10 % of the GPU free is not room for +0.05 on top of 0.86 (free 0.89 −
    margin = 0.86): the raise is capped there, so the ladder goes on to enforce_eager
    instead of asking for 0.91, which fails "utilization too high" at the next start."""
    gpu = GpuFacts(total_gib=79.19, free_gib=70.48)  # 0.89 free once the engine is gone
    p = step(MemoryProfile(gpu_memory_utilization=0.86), "kv_cache_insufficient", gpu=gpu)
    assert p == MemoryProfile(gpu_memory_utilization=0.86, enforce_eager=True)
    partial = step(MemoryProfile(gpu_memory_utilization=0.8), "kv_cache_insufficient",
                   gpu=GpuFacts(total_gib=80, free_gib=68))  # 0.85 - 0.03 = 0.82
    assert partial == MemoryProfile(gpu_memory_utilization=0.82)


def test_ladder_never_returns_to_a_profile_that_failed() -> None:
    """A step that leads back to a profile that already failed goes on from
    there as that profile's own failure directs (0.86 ran out of KV cache → eager)."""
    at_086 = MemoryProfile(gpu_memory_utilization=0.86)
    at_091 = MemoryProfile(gpu_memory_utilization=0.91)
    failed = {MemoryProfile(gpu_memory_utilization=0.9): ("gpu_memory_utilization_too_high",
                                                          {"free_gib": 70.48, "total_gib": 79.19}),
              at_086: ("kv_cache_insufficient", {})}
    decision = next_profile(at_091, "gpu_memory_utilization_too_high",
                            {"free_gib": 70.48, "total_gib": 79.19}, FLOORS,
                            gpu=GpuFacts(79.19, 70.48), failed=failed, **BUDGET)  # type: ignore[arg-type]
    assert decision.profile == MemoryProfile(gpu_memory_utilization=0.86, enforce_eager=True)
    assert "already failed" in decision.reason
    # Same class, same profile (a plain restart) is not "returning" to a failed profile.
    same = next_profile(at_086, "other_fatal", {}, FLOORS, failed=failed, **BUDGET)  # type: ignore[arg-type]
    assert same.profile == at_086


def test_utilization_lowered_to_free_minus_margin() -> None:
    """gpu_memory_utilization_too_high lowers utilization to free/total minus a margin."""
    new = step(MemoryProfile(gpu_memory_utilization=0.9), "gpu_memory_utilization_too_high",
               {"free_gib": 60.0, "total_gib": 80.0})
    assert new is not None and new.gpu_memory_utilization == 0.72


def test_utilization_uses_nvml_when_message_has_no_numbers() -> None:
    """Without numbers in the message, NVML's free/total decide."""
    new = step(MemoryProfile(gpu_memory_utilization=0.9), "gpu_memory_utilization_too_high",
               gpu=GpuFacts(total_gib=80, free_gib=64))
    assert new is not None and new.gpu_memory_utilization == 0.77


def test_utilization_below_floor_is_fatal() -> None:
    """If another process holds most of the GPU, chandrad gives up instead of looping."""
    assert step(MemoryProfile(gpu_memory_utilization=0.9), "gpu_memory_utilization_too_high",
                {"free_gib": 10.0, "total_gib": 80.0}) is None


def test_oom_load_ladder_eager_then_batch_then_offload_then_fatal() -> None:
    """cuda_oom_load: eager, then halve seqs/tokens to the floors, then offload, then fatal."""
    floors = DownshiftConfig(max_cpu_offload_gb=4, min_max_num_seqs=16,
                             min_max_num_batched_tokens=8192)
    p = MemoryProfile(max_num_seqs=64, max_num_batched_tokens=16384)
    seen = []
    for _ in range(10):
        nxt = step(p, "cuda_oom_load", floors=floors)
        if nxt is None:
            break
        seen.append(nxt.changes_from(p))
        p = nxt
    assert list(seen[0]) == ["enforce_eager"]
    assert seen[1] == {"max_num_seqs": (64, 32), "max_num_batched_tokens": (16384, 8192)}
    assert seen[2] == {"max_num_seqs": (32, 16)}
    assert seen[3] == {"cpu_offload_gb": (0.0, 4.0)}
    assert len(seen) == 4


def test_fragmentation_sets_expandable_segments_then_runtime() -> None:
    """fragmentation: expandable_segments first; if it recurs, the runtime-OOM remedy."""
    p1 = step(MemoryProfile(max_num_seqs=64), "fragmentation")
    assert p1 is not None and p1.expandable_segments
    p2 = step(p1, "fragmentation")
    assert p2 is not None and p2.max_num_seqs == 32


def test_runtime_oom_never_below_one_page_of_tokens() -> None:
    """cuda_oom_runtime halves batching but keeps max_num_batched_tokens ≥ one page image."""
    p = MemoryProfile(max_num_seqs=2, max_num_batched_tokens=9000)
    new = step(p, "cuda_oom_runtime")
    assert new is not None
    assert new.max_num_seqs == 1
    assert new.max_num_batched_tokens == 6291456 // 784  # one page image, not 9000 // 2
    assert new.max_pixels is not None and new.max_pixels < 6291456


def test_host_oom_lowers_processor_cache() -> None:
    """host_oom: halve mm_processor_cache_gb to zero, then fewer sequences."""
    p = step(MemoryProfile(), "host_oom")
    assert p is not None and p.mm_processor_cache_gb == 2.0
    p = step(MemoryProfile(mm_processor_cache_gb=1.0), "host_oom")
    assert p is not None and p.mm_processor_cache_gb == 0.0
    p = step(MemoryProfile(mm_processor_cache_gb=0.0, max_num_seqs=8), "host_oom")
    assert p is not None and p.max_num_seqs == 4


def test_other_fatal_keeps_profile() -> None:
    """other_fatal never lowers memory: same profile, restart with backoff."""
    p = MemoryProfile(max_num_seqs=64)
    assert step(p, "other_fatal") == p


def test_profile_round_trips_through_dict() -> None:
    """Learned profiles are stored as dicts and come back equal; unknown keys are ignored."""
    p = MemoryProfile(max_model_len=18000, expandable_segments=True)
    assert MemoryProfile.from_dict({**p.to_dict(), "future_knob": 1}) == p


# ------------------------------------------------------------------ one step from the numbers
# (restarts to ready per class: tests/test_ladder_restarts.py)

ISSUE_KV = {"max_model_len": 18000.0, "needed_gib": 2.06, "available_gib": 1.2,
            "estimated_max_model_len": 10480.0}


def test_kv_numbers_raise_utilization_by_exactly_what_is_missing() -> None:
    """The card has the memory: 0.85 + (2.06 − 1.20)/79.19 + 0.01 = 0.8709 → 0.88, in one
    step, max_model_len kept (the old ladder asked for +0.05 whatever was missing)."""
    p = MemoryProfile(gpu_memory_utilization=0.85, max_model_len=18000)
    new = step(p, "kv_cache_insufficient", ISSUE_KV, gpu=GpuFacts(79.19, 78.6))
    assert new == p.with_changes(gpu_memory_utilization=0.88)
    # A large shortfall takes the whole of it at once, not 0.05 a restart.
    big = step(p, "kv_cache_insufficient", {**ISSUE_KV, "needed_gib": 7.2},
               gpu=GpuFacts(79.19, 78.6))
    assert big == p.with_changes(gpu_memory_utilization=0.94)


def test_kv_numbers_fit_max_model_len_to_what_the_card_has() -> None:
    """The card has room for 0.86 only: utilisation there, and max_model_len fitted to the
    KV cache that gives (the message's own tokens per GiB), when that still holds a page
    and vLLM's estimate (at the old utilisation) did not; where the estimate holds a page,
    it is taken as before, with no more memory."""
    p = MemoryProfile(gpu_memory_utilization=0.85, max_model_len=65536)
    numbers = {"max_model_len": 65536.0, "needed_gib": 7.5, "available_gib": 1.2,
               "estimated_max_model_len": 10485.0}
    page = page_tokens(2_000_000, 12384)
    assert page > 10485
    decision = next_profile(p, "kv_cache_insufficient", numbers, FLOORS,
                            gpu=GpuFacts(79.19, 70.48), max_pixels=2_000_000,
                            max_output_tokens=12384)
    new = decision.profile
    assert new is not None and not decision.degraded
    assert new.gpu_memory_utilization == 0.86 and not new.enforce_eager
    kv = 1.2 + 0.01 * 79.19
    assert page <= new.max_model_len <= kv / 7.5 * 65536  # type: ignore[operator]
    assert new.max_model_len % 16 == 0  # type: ignore[operator]
    small_pages = next_profile(p, "kv_cache_insufficient", numbers, FLOORS,
                               gpu=GpuFacts(79.19, 70.48), max_pixels=2_000_000,
                               max_output_tokens=4096).profile
    assert small_pages == p.with_changes(max_model_len=10480)


def test_kv_numbers_try_eager_before_lowering_the_page_budget() -> None:
    """A fitted length below one page would lower the page budget: enforce_eager (and
    whatever utilisation the card has) first; with eager already on, the degraded fit."""
    p = MemoryProfile(gpu_memory_utilization=0.85, max_model_len=18000)
    new = step(p, "kv_cache_insufficient", ISSUE_KV, gpu=GpuFacts(79.19, 70.48))
    assert new == p.with_changes(gpu_memory_utilization=0.86, enforce_eager=True)
    eager = MemoryProfile(gpu_memory_utilization=0.85, max_model_len=18000, enforce_eager=True)
    decision = next_profile(eager, "kv_cache_insufficient", ISSUE_KV, FLOORS,
                            gpu=GpuFacts(79.19, 69.69), **BUDGET)  # type: ignore[arg-type]
    assert decision.degraded and decision.profile is not None
    assert decision.profile.max_model_len == 10480 // 16 * 16  # vLLM's own estimate: exact


def test_kv_numbers_without_nvml_walk_the_rungs() -> None:
    """No GPU facts (or no needed/available figures): the ladder as before."""
    p = MemoryProfile(gpu_memory_utilization=0.85, max_model_len=18000)
    assert step(p, "kv_cache_insufficient", ISSUE_KV) == p.with_changes(enforce_eager=True)


def test_mamba_cache_sets_max_num_seqs_to_the_named_blocks() -> None:
    """mamba_cache_insufficient: max_num_seqs = the blocks vLLM names, in one step."""
    numbers = {"max_num_seqs": 1024.0, "mamba_cache_blocks": 600.0}
    assert step(MemoryProfile(), "mamba_cache_insufficient", numbers) == \
        MemoryProfile(max_num_seqs=600)
    assert step(MemoryProfile(max_num_seqs=64), "mamba_cache_insufficient",
                {"max_num_seqs": 64.0, "mamba_cache_blocks": 30.0}) == \
        MemoryProfile(max_num_seqs=30)
    # The number cut off: halve what was asked.
    assert step(MemoryProfile(), "mamba_cache_insufficient", {"max_num_seqs": 1024.0}) == \
        MemoryProfile(max_num_seqs=512)


def test_mamba_cache_below_the_floor_is_fatal() -> None:
    """Fewer blocks than min_max_num_seqs (or none): a restart cannot help."""
    floors = DownshiftConfig(min_max_num_seqs=8)
    assert step(MemoryProfile(), "mamba_cache_insufficient",
                {"max_num_seqs": 256.0, "mamba_cache_blocks": 4.0}, floors=floors) is None
    assert step(MemoryProfile(), "mamba_cache_insufficient",
                {"max_num_seqs": 256.0, "mamba_cache_blocks": 0.0}) is None
