"""A memory failure fed back into the plan (chandrad/engine/replan.py): the ladder's next
profile sized by the KV cache vLLM measured. Pure: no process, no model files."""

from __future__ import annotations

from dataclasses import replace

from chandrad.config import DownshiftConfig
from chandrad.engine import planner, replan
from chandrad.engine.classify import Diagnosis, FailureClass
from chandrad.engine.policy import ProfilePolicy
from chandrad.engine.profile import (
    Decision,
    GpuFacts,
    MemoryProfile,
    next_profile,
    page_tokens,
)

GIB = planner.GIB
#: A dense 4B model: 8 GiB of weights, 4 KiB of KV per token and layer, 8 layers.
SHAPE = planner.ModelShape(
    dtype_bytes=2, weights_bytes=8 * GIB, hidden_size=2560, intermediate_size=9216,
    vocab_size=151936, num_heads=16, num_kv_heads=4, head_dim=256, full_attention_layers=8,
    linear_attention_layers=0, max_position_embeddings=262144)
PIXELS, OUT_TOKENS = 1_000_000, 2048
FLOORS = DownshiftConfig()


def ladder(profile: MemoryProfile, failure: str, numbers: dict[str, float],
           floors: DownshiftConfig, *, gpu: GpuFacts | None = None) -> Decision:
    """The ladder's own step (engine/profile.py) for this page budget."""
    return next_profile(profile, failure, numbers, floors, max_pixels=PIXELS,
                        max_output_tokens=OUT_TOKENS, gpu=gpu)


def _context(total_gib: float, *, max_num_seqs: int | None = None) -> replan.PlanContext:
    """The plan a 24 GiB card's start was made from: 18000 tokens, 16 pages at once."""
    budget = planner.Budget("gpu", gpu_total_bytes=int(total_gib * GIB),
                            gpu_memory_utilization=0.85)
    request = planner.Request(max_num_seqs=max_num_seqs,
                              page_tokens=page_tokens(PIXELS, OUT_TOKENS),
                              default_max_num_seqs=16, default_max_num_batched_tokens=2048,
                              default_max_model_len=18000)
    return replan.PlanContext(SHAPE, budget, request, planner.plan(SHAPE, budget, request))


STARTED = MemoryProfile(gpu_memory_utilization=0.85, max_num_seqs=16,
                        max_num_batched_tokens=2048, max_model_len=18000)
#: vLLM: 18000 tokens need 0.55 GiB, 0.30 GiB are there (the plan expected far more), and
#: the card has no room left to raise the utilisation.
KV_SHORT = {"needed_gib": 0.55, "available_gib": 0.30, "estimated_max_model_len": 9600.0,
            "max_model_len": 18000.0}
NO_ROOM = GpuFacts(total_gib=24.0, free_gib=0.5)


def _fits(context: replan.PlanContext, kv_gib: float, profile: MemoryProfile) -> bool:
    """``profile``'s pages at once fit a KV cache of ``kv_gib`` (by the plan's own blocks)."""
    blocks = int(kv_gib * GIB) // (8 * 16 * planner.kv_bytes_per_token_layer(SHAPE)) - 1
    per_page = planner.blocks_per_request(SHAPE, context.request.page_tokens, 16, True)
    assert profile.max_num_seqs is not None
    return profile.max_num_seqs * per_page <= blocks


def test_kv_failure_sizes_the_concurrency_from_the_measured_kv_cache() -> None:
    """The ladder alone fits the length vLLM estimates and keeps 16 pages at once, which the
    measured 0.30 GiB cannot hold; from the plan corrected by that number the next profile
    also runs only as many pages at once as fit (2), at the same length."""
    context = _context(24.0)
    assert context.plan.fits and context.plan.max_num_seqs == 16
    blind = ladder(STARTED, "kv_cache_insufficient", KV_SHORT, FLOORS, gpu=NO_ROOM)
    assert blind.profile is not None and blind.profile.max_model_len == 9600
    assert not _fits(context, 0.30, blind.profile)
    refined = replan.refine(blind, STARTED, "kv_cache_insufficient", KV_SHORT, context)
    assert refined.profile == blind.profile.with_changes(max_num_seqs=2), refined.reason
    assert _fits(context, 0.30, refined.profile)
    assert "KV cache vLLM measured (0.29 GiB" in refined.reason


def test_policy_steps_from_the_corrected_plan() -> None:
    """Through the engine's policy: with the plan the change moves both knobs; without one
    (a model not on this host) it is the ladder's step."""
    diag = Diagnosis(FailureClass.KV_CACHE_INSUFFICIENT, numbers=dict(KV_SHORT))
    with_plan, without = ProfilePolicy(STARTED, FLOORS), ProfilePolicy(STARTED, FLOORS)
    with_plan.after_failure(diag, gpu=NO_ROOM, plan=_context(24.0), max_pixels=PIXELS,
                            max_output_tokens=OUT_TOKENS)
    without.after_failure(diag, gpu=NO_ROOM, max_pixels=PIXELS, max_output_tokens=OUT_TOKENS)
    assert (with_plan.profile.max_model_len, with_plan.profile.max_num_seqs) == (9600, 2)
    assert (without.profile.max_model_len, without.profile.max_num_seqs) == (9600, 16)


def test_a_utilisation_raise_keeps_the_length_and_sizes_the_pages_at_once() -> None:
    """Where the card has room, the ladder raises the utilisation by what was missing
    (0.85 -> 0.88); the corrected plan (measured 0.30 GiB + 0.03 × 24 GiB) holds the
    length, and 7 pages of 4347 tokens at once, not 16."""
    roomy = GpuFacts(total_gib=24.0, free_gib=23.0)
    blind = ladder(STARTED, "kv_cache_insufficient", KV_SHORT, FLOORS, gpu=roomy)
    assert blind.profile is not None and blind.profile.gpu_memory_utilization == 0.88
    refined = replan.refine(blind, STARTED, "kv_cache_insufficient", KV_SHORT, _context(24.0))
    assert refined.profile == blind.profile.with_changes(max_num_seqs=7), refined.reason
    assert _fits(_context(24.0), 0.295 + 0.03 * 24, refined.profile)


def test_cuda_oom_takes_the_missing_allocation_off_the_plan() -> None:
    """An OOM at load: the plan's KV budget less the allocation that did not fit (requested
    − free) leaves 0.3 GiB; the ladder's rung (enforce_eager) comes with the pages that fit."""
    context = _context(12.0)
    left = context.plan.kv_budget_bytes / GIB - 0.3
    numbers = {"requested_gib": left + 0.25, "free_gib": 0.25}
    blind = ladder(STARTED, "cuda_oom_load", numbers, FLOORS)
    assert blind.profile == STARTED.with_changes(enforce_eager=True)
    refined = replan.refine(blind, STARTED, "cuda_oom_load", numbers, context)
    assert refined.profile is not None and refined.profile.enforce_eager
    assert refined.profile.max_num_seqs is not None and refined.profile.max_num_seqs < 16
    assert _fits(context, 0.3, refined.profile)


def test_configured_concurrency_is_kept_and_exact_numbers_are_not_second_guessed() -> None:
    """A configured ``max_num_seqs`` is the operator's (only a length that cannot fit is
    lowered); ``mamba_cache_insufficient`` names its exact block count: nothing to correct;
    a message without the measured GiB: the ladder's step as it is."""
    configured = _context(24.0, max_num_seqs=16)
    blind = ladder(STARTED, "kv_cache_insufficient", KV_SHORT, FLOORS, gpu=NO_ROOM)
    assert replan.refine(blind, STARTED, "kv_cache_insufficient", KV_SHORT, configured) == blind
    mamba = {"mamba_cache_blocks": 6.0, "max_num_seqs": 16.0}
    step = ladder(STARTED, "mamba_cache_insufficient", mamba, FLOORS)
    assert replan.refine(step, STARTED, "mamba_cache_insufficient", mamba,
                         _context(24.0)) == step
    bare = {k: v for k, v in KV_SHORT.items() if k != "available_gib"}
    step = ladder(STARTED, "kv_cache_insufficient", bare, FLOORS, gpu=NO_ROOM)
    assert replan.refine(step, STARTED, "kv_cache_insufficient", bare, _context(24.0)) == step


def test_a_corrected_plan_too_small_for_a_page_leaves_the_ladder_its_rungs() -> None:
    """0.05 GiB holds less than one page: the corrected plan cannot size anything, and the
    ladder's own step (a lower length, then eager, offload, the page budget) goes on."""
    tiny = dict(KV_SHORT, available_gib=0.05, estimated_max_model_len=1600.0)
    blind = ladder(STARTED, "kv_cache_insufficient", tiny, FLOORS, gpu=NO_ROOM)
    assert replan.refine(blind, STARTED, "kv_cache_insufficient", tiny,
                         replace(_context(24.0))) == blind
