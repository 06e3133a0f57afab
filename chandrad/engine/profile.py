"""Memory profiles and the downshift ladder (SPEC §4.3).

Owns :class:`MemoryProfile` (the memory-related engine settings plus the page
budget that goes with them) and the pure decision "given this failure, what is
the next profile, or why can a restart not help". No I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from chandrad.config import AUTO_TABLE, MemoryConfig


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
    """Chandra 2's table: GPU memory → (max_num_batched_tokens, max_num_seqs).

    ``None`` when there is no GPU to size from (leave vLLM's defaults).
    """
    if gpu_total_gib is None:
        return None
    for min_gib, tokens, seqs in AUTO_TABLE:
        # Marketing sizes: an "80 GB" card reports ~79.2 GiB, a "24 GB" one ~23.6 GiB.
        if gpu_total_gib >= min_gib * 0.95:
            return tokens, seqs
    _, tokens, seqs = AUTO_TABLE[-1]
    return tokens, seqs


def initial_profile(memory: MemoryConfig, gpu_total_gib: float | None) -> MemoryProfile:
    """The configured starting profile with ``"auto"`` resolved from GPU memory."""
    auto = auto_batching(gpu_total_gib)
    seqs = memory.max_num_seqs
    tokens = memory.max_num_batched_tokens
    util = memory.gpu_memory_utilization
    if seqs == "auto":
        seqs = auto[1] if auto else None
    if tokens == "auto":
        tokens = auto[0] if auto else None
    if util == "auto":
        util = 0.9 if gpu_total_gib is not None else None
    return MemoryProfile(
        gpu_memory_utilization=None if util is None else float(util),
        max_num_seqs=None if seqs is None else int(seqs),
        max_num_batched_tokens=None if tokens is None else int(tokens),
        max_model_len=memory.max_model_len,
        block_size=memory.block_size,
        enforce_eager=memory.enforce_eager,
        cpu_offload_gb=memory.cpu_offload_gb,
        kv_cache_memory_bytes=memory.kv_cache_memory_bytes,
        mm_processor_cache_gb=memory.mm_processor_cache_gb,
    )
