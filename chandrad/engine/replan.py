"""A memory failure fed back into the plan: the next profile sized by what vLLM measured.

The plan (``engine/planner.py``) predicts the KV cache before a start; a start that fails for
memory says what vLLM really had. ``kv_cache_insufficient``: "X GiB KV cache is needed, which
is larger than the available KV cache memory (Y GiB)", Y being the measured KV budget (the
profile run's peak and the runtime taken off). ``cuda_oom_load`` / ``cuda_oom_runtime``:
"Tried to allocate R GiB" with F GiB free, the plan's KV budget less the R − F it did not
see. :func:`refine` reruns the plan with that measured budget in place of the predicted one,
moved by what the ladder's step changes (utilisation × total, CPU offload), and caps the
ladder's next profile at what the corrected plan says fits: ``max_model_len`` (the longest
request) and, where the config left it ``auto``, ``max_num_seqs`` (pages the KV cache holds
at once). The ladder (``engine/profile.py``) still chooses which knob moves; the corrected
plan sizes the lengths and the concurrency. ``mamba_cache_insufficient`` names its own exact
number (the Mamba blocks, the ladder's ``max_num_seqs``): nothing to correct. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from chandrad.engine import planner
from chandrad.engine.classify import FailureClass
from chandrad.engine.profile import Decision, MemoryProfile

#: vLLM prints the GiB of its KV message to two decimals: count the measured side low.
PRINTED_GIB_ROUNDING = 0.005


@dataclass(frozen=True)
class PlanContext:
    """A plan and what it was made from (``engine/planning.py``'s ``plan_context``)."""

    shape: planner.ModelShape
    budget: planner.Budget
    request: planner.Request
    plan: planner.Plan


def measured_kv_bytes(context: PlanContext, failure: str,
                      numbers: dict[str, float]) -> int | None:
    """The KV budget the failed start really had, from its message; ``None``: not known."""
    if failure == FailureClass.KV_CACHE_INSUFFICIENT:
        available = numbers.get("available_gib")
        if available is None:
            return None
        return max(int((available - PRINTED_GIB_ROUNDING) * planner.GIB), 0)
    if failure in (FailureClass.CUDA_OOM_LOAD, FailureClass.CUDA_OOM_RUNTIME):
        requested = numbers.get("requested_gib")
        if requested is None or context.budget.device != "gpu":
            return None
        missing = max(requested - numbers.get("free_gib", 0.0), 0.0)
        return max(context.plan.kv_budget_bytes - int(missing * planner.GIB), 0)
    return None


def _budget_for(context: PlanContext, measured: int, failed: MemoryProfile,
                new: MemoryProfile) -> int:
    """The measured budget moved by the ladder's step: an explicit KV size it set is that
    size; on a GPU, Δutilisation × total and Δ``cpu_offload_gb`` more (or less)."""
    if new.kv_cache_memory_bytes is not None and \
            new.kv_cache_memory_bytes != failed.kv_cache_memory_bytes:
        return new.kv_cache_memory_bytes
    total = context.budget.gpu_total_bytes
    if context.budget.device != "gpu" or total is None or new.kv_cache_memory_bytes is not None:
        return measured
    util = ((new.gpu_memory_utilization or 0.9) - (failed.gpu_memory_utilization or 0.9))
    offload = new.cpu_offload_gb - failed.cpu_offload_gb
    return max(measured + int(util * total) + int(offload * planner.GIB), 0)


def corrected_plan(context: PlanContext, kv_bytes: int, profile: MemoryProfile) -> planner.Plan:
    """The plan for ``profile`` on a KV budget of ``kv_bytes``, its length and concurrency
    fitted (up to ``profile``'s own)."""
    budget = planner.Budget(context.budget.device, kv_cache_bytes=kv_bytes,
                            cpu_avx512_bf16=context.budget.cpu_avx512_bf16)
    request = replace(
        context.request, max_model_len=None, max_num_seqs=None,
        max_num_batched_tokens=(profile.max_num_batched_tokens
                                or context.request.default_max_num_batched_tokens),
        block_size=profile.block_size, enforce_eager=profile.enforce_eager,
        default_max_model_len=profile.max_model_len or context.plan.max_model_len,
        default_max_num_seqs=profile.max_num_seqs or context.request.default_max_num_seqs)
    return planner.plan(context.shape, budget, request)


def refine(decision: Decision, failed: MemoryProfile, failure: str, numbers: dict[str, float],
           context: PlanContext | None) -> Decision:
    """The ladder's ``decision`` for ``failed``'s ``failure``, its lengths and concurrency
    capped at what the plan corrected by the failure's numbers says fits. Unchanged when
    there is no plan, no measured number, a fatal or degraded decision, or a corrected plan
    that cannot hold one page (the ladder's own rungs go on from there)."""
    if context is None or decision.profile is None or decision.degraded:
        return decision
    measured = measured_kv_bytes(context, failure, numbers)
    if measured is None:
        return decision
    new = decision.profile
    kv = _budget_for(context, measured, failed, new)
    fitted = corrected_plan(context, kv, new)
    if fitted.max_model_len < context.request.page_tokens or fitted.num_blocks <= 1:
        return decision
    changes: dict[str, Any] = {}
    if new.max_model_len is None or fitted.max_model_len < new.max_model_len:
        changes["max_model_len"] = fitted.max_model_len
    if context.request.max_num_seqs is None and (
            new.max_num_seqs is None or fitted.max_num_seqs < new.max_num_seqs):
        changes["max_num_seqs"] = fitted.max_num_seqs
    if not changes:
        return decision
    moved = ", ".join(f"{k} {getattr(new, k)} -> {v}" for k, v in changes.items())
    return Decision(new.with_changes(**changes),
                    f"{decision.reason}; the plan with the KV cache vLLM measured "
                    f"({kv / planner.GIB:.2f} GiB, {fitted.num_blocks} blocks): {moved}")
