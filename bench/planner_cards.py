"""The memory plan of chandra-ocr-2 per GPU size, from its published shape (no GPU, no weights).

    .venv/bin/python bench/planner_cards.py     # prints and writes bench/results/planner-cards.md

Each card is planned the way ``chandrad check-config --gpu-memory SIZE --json`` plans it:
Chandra's own launch (utilisation 0.85, ``--max-model-len 18000``, prefix caching, CUDA
graphs, its ``max_pixels`` 6291456) with ``max_num_seqs`` / ``max_num_batched_tokens`` left
``auto`` (bounded by Chandra's GPU table), by ``chandrad.engine.planner``.

chandra-ocr-2's ``config.json`` cannot be read from here (no hub access), so SHAPE takes each
value from a published source, named beside it. Values marked "assumed" are Qwen3.5's
transformers defaults; the plan moves with them (the state dtype doubles the state page).
"""

from __future__ import annotations

from pathlib import Path

from chandrad.engine import launch, planner

OUT = Path(__file__).resolve().parent / "results" / "planner-cards.md"
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_DIM, CONV_KERNEL = 16, 32, 128, 4  # assumed (Qwen3.5)
SHAPE = planner.ModelShape(
    dtype_bytes=2,                   # bf16 (Chandra's launch: --dtype bfloat16)
    weights_bytes=9_300_000_000,     # README "First start": about 9.3 GB of bf16 weights
    hidden_size=2560, num_heads=16, num_kv_heads=4, head_dim=256, vocab_size=248_320,
    # huggingface.co/jbarrow/joecr-chandra-2-eagle3.1 ("matched to the target": hidden 2560,
    # head_dim 256, GQA 16/4, vocab 248320, "5B Qwen3.5-based")
    intermediate_size=9216,          # Qwen3.5-4B's (apxml.com/models/qwen35-4b), assumed
    full_attention_layers=8, linear_attention_layers=24,  # 32 layers, 8 × (3 GDN + 1 full)
    max_position_embeddings=262_144,
    conv_state_elems=(GDN_DIM * GDN_KEY_HEADS * 2 + GDN_DIM * GDN_VALUE_HEADS) * (CONV_KERNEL - 1),
    ssm_state_elems=GDN_VALUE_HEADS * GDN_DIM * GDN_DIM,
    ssm_dtype="float32",             # assumed: Qwen3.5 configs name mamba_ssm_dtype float32
    vision_hidden=1152, vision_intermediate=4304,  # Qwen3.5 vision defaults (transformers 5.19)
    vision_patches_max=launch.MM_PROCESSOR_KWARGS["max_pixels"] // (16 * 16),
    image_tokens_max=launch.MM_PROCESSOR_KWARGS["max_pixels"] // (32 * 32),
)
#: (card, NVML total MiB): README's table where it names one, else the label in GiB.
CARDS = (("8 GB (RTX 3070/4060)", 8192), ("12 GB (RTX 3060)", 12288), ("16 GB (T4)", 15360),
         ("24 GB (A10/RTX 4090)", 23028), ("48 GB (L40S)", 46068), ("80 GB (H100)", 81559),
         ("141 GB (H200)", 143771))


def table() -> str:
    lines = ["| card | NVML MiB | Chandra's table (tokens / seqs) | KV budget GiB | activation GiB"
             " | block | KV tokens | concurrency at 18000 | plan: seqs / batched tokens / "
             "max_model_len | fits |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---|"]
    for card, mib in CARDS:
        total = mib << 20
        tokens, seqs = launch.batching(total / planner.GIB)
        budget = planner.Budget("gpu", gpu_total_bytes=total, gpu_free_bytes=total,
                                gpu_memory_utilization=launch.GPU_MEMORY_UTILIZATION)
        request = planner.Request(default_max_model_len=launch.MAX_MODEL_LEN,
                                  default_max_num_seqs=seqs, default_max_num_batched_tokens=tokens,
                                  page_tokens=4096)
        p = planner.plan(SHAPE, budget, request)
        lines.append(
            f"| {card} | {mib} | {launch.chandra_gpu(total / planner.GIB)}: {tokens} / {seqs} | "
            f"{p.kv_budget_bytes / planner.GIB:.2f} | {p.activation_peak_bytes / planner.GIB:.2f}"
            f" | {p.block_size} | {p.kv_cache_tokens:,} | {p.max_concurrency:.1f} | "
            f"{p.max_num_seqs} / {p.max_num_batched_tokens} / {p.max_model_len} | "
            f"{'yes' if p.fits else 'no: ' + (p.problem or '')} |")
    one = planner.plan(SHAPE, planner.Budget("gpu", gpu_total_bytes=81559 << 20),
                       planner.Request())
    return ("\n".join(lines) + f"\n\nKV bytes per token: {one.kv_bytes_per_token:,} (8 full-"
            f"attention layers); linear-attention state per sequence: "
            f"{one.state_bytes_per_seq:,} bytes (24 GDN layers, before padding to the attention"
            " page).\n")


def main() -> None:
    text = table()
    OUT.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
