"""The planner against vLLM's own numbers: start real ``vllm serve`` on the CPU, read what it logs.

    .venv/bin/python bench/planner_check.py                 # record every configuration, compare
    .venv/bin/python bench/planner_check.py --compare-only  # compare the recorded numbers again

For each configuration of CONFIGS (the tiny Idefics3 model of ``tests/tiny_model.py`` and the
tiny Chandra 2 of ``tests/tiny_chandra2.py``; ``VLLM_CPU_KVCACHE_SPACE``, ``--max-model-len``,
``--block-size``, ``--max-num-seqs``) it starts the OpenAI API server in its own session, waits
for the start-up line ``KV cache size: N tokens, Maximum concurrency for L tokens per request:
Cx``, records N and C and stops the session (readiness is not needed: vLLM sizes its cache
before it serves). The raw numbers go to ``bench/results/planner-check.json`` (the fixture
``tests/test_planner.py`` checks the planner against); then each is compared with
``chandrad.engine.planner.plan`` for the same model files and flags, as a Markdown table in
``bench/results/planner-check.md``. Paths in the results are relative to the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import _proc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

RESULTS = REPO / "bench" / "results" / "planner-check.json"
TABLE = REPO / "bench" / "results" / "planner-check.md"
START_TIMEOUT_S = 900.0
#: vLLM 0.32's start-up line (vllm/v1/core/kv_cache_utils.py, update_kv_cache_capacity).
KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens "
                     r"per request: ([\d.]+)x")
#: Other start-up lines worth keeping beside the numbers (block sizes of a hybrid model).
NOTE_LINE = re.compile(r"attention block size|mamba page size|GiB for KV cache|prefers block_size")
#: A start that logged its KV cache and then failed (a block size the CPU kernels reject).
ERROR_LINE = re.compile(r"(?:ValueError|RuntimeError): .*")

#: (model, VLLM_CPU_KVCACHE_SPACE GiB, max_model_len, block_size or None, max_num_seqs or None)
CONFIGS: tuple[tuple[str, int, int, int | None, int | None], ...] = (
    ("idefics3", 1, 4096, None, None),
    ("idefics3", 1, 2048, None, None),
    ("idefics3", 1, 8192, None, None),
    ("idefics3", 2, 4096, None, None),
    ("idefics3", 3, 4096, None, None),
    ("idefics3", 1, 4096, 16, None),
    ("idefics3", 1, 4096, 32, None),
    ("idefics3", 1, 3000, None, None),
    ("idefics3", 1, 1000, 64, None),
    ("idefics3", 2, 5000, 16, None),
    ("idefics3", 1, 4096, None, 4),
    ("chandra2", 1, 4096, None, None),
    ("chandra2", 1, 8192, None, None),
    ("chandra2", 2, 4096, None, 8),
)


def model_dir(model: str) -> Path:
    """The tiny model's directory, built (in the test cache) if missing."""
    import tiny_chandra2
    import tiny_model

    root = Path(os.environ.get("CHANDRAD_TEST_CACHE", REPO / ".tiny-model"))
    if model == "chandra2":
        return tiny_chandra2.build_tiny_chandra2(tiny_chandra2.cache_dir(root))
    return tiny_model.build_tiny_model(tiny_model.cache_dir(root))


def flags(config: dict[str, Any]) -> list[str]:
    """The engine flags of one configuration (besides model, host and port)."""
    argv = ["--max-model-len", str(config["max_model_len"]), "--enforce-eager"]
    if config["block_size"] is not None:
        argv += ["--block-size", str(config["block_size"])]
    if config["max_num_seqs"] is not None:
        argv += ["--max-num-seqs", str(config["max_num_seqs"])]
    return argv


def measure(config: dict[str, Any], logs: Path) -> dict[str, Any]:
    """Start one engine, wait for its KV cache line, stop it; the numbers it logged."""
    port = _proc.free_port()
    log = logs / f"{config['name']}.log"
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir(config["model"])), "--served-model-name", "chandra",
            "--host", "127.0.0.1", "--port", str(port), *flags(config)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(config["kv_space_gib"])}
    started = time.monotonic()
    proc = _proc.start_session(argv, log, env=env)
    found: re.Match[str] | None = None
    try:
        while time.monotonic() - started < START_TIMEOUT_S and proc.poll() is None:
            text = log.read_text(errors="replace")
            found = KV_LINE.search(text)
            if found and ("Starting vLLM server" in text or ERROR_LINE.search(text)):
                break  # the KV line comes before the workers take the block size
            time.sleep(1.0)
    finally:
        left = _proc.stop_session(proc)
    text = log.read_text(errors="replace")
    found = found or KV_LINE.search(text)
    return {
        "kv_cache_tokens": int(found.group(1).replace(",", "")) if found else None,
        "max_concurrency": float(found.group(3)) if found else None,
        "seconds": round(time.monotonic() - started, 1),
        "notes": [line.split("] ", 1)[-1] for line in text.splitlines() if NOTE_LINE.search(line)],
        "leftover_pids": left,
        "engine_error": next((m.group(0) for m in ERROR_LINE.finditer(text)), None),
        "error": None if found else text.splitlines()[-5:],
    }


def record(logs: Path, only: set[str] | None) -> None:
    """Measure every configuration (or ``only`` those names), saving after each."""
    rows: list[dict[str, Any]] = []
    if RESULTS.is_file():
        rows = json.loads(RESULTS.read_text())["rows"]
    by_name = {row["name"]: row for row in rows}
    for model, space, length, block, seqs in CONFIGS:
        name = f"{model}-kv{space}-len{length}-bs{block or 'auto'}-seqs{seqs or 'auto'}"
        if only is not None and name not in only:
            continue
        config = {"name": name, "model": model, "kv_space_gib": space, "max_model_len": length,
                  "block_size": block, "max_num_seqs": seqs}
        print(f"[planner-check] {name} ...", flush=True)
        by_name[name] = {**config, "measured": measure(config, logs)}
        print(f"[planner-check] {name}: {by_name[name]['measured']}", flush=True)
        RESULTS.write_text(json.dumps({"vllm": _vllm_version(), "cpu_avx512_bf16": _bf16(),
                                       "rows": list(by_name.values())}, indent=2) + "\n")


def _bf16() -> bool:
    from chandrad.engine.planner import avx512_bf16

    return avx512_bf16(Path("/proc/cpuinfo").read_text())


def plan_for_row(row: dict[str, Any], model: Path, cpu_avx512_bf16: bool) -> dict[str, Any]:
    """The plan for one recorded configuration (the CPU budget is its KV space)."""
    from chandrad import model_files
    from chandrad.engine import planner

    shape = model_files.planner_shape(str(model))
    assert shape is not None, f"no model files in {model}"
    budget = planner.Budget("cpu", kv_cache_bytes=row["kv_space_gib"] * planner.GIB,
                            cpu_avx512_bf16=cpu_avx512_bf16)
    request = planner.Request(max_model_len=row["max_model_len"],
                              max_num_seqs=row["max_num_seqs"], block_size=row["block_size"])
    return planner.plan(shape, budget, request).as_dict()


def _vllm_version() -> str:
    from importlib.metadata import version

    return version("vllm") if _installed("vllm") else version("vllm-cpu")


def _installed(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
    except PackageNotFoundError:
        return False
    return True


def compare(rows: list[dict[str, Any]], cpu_avx512_bf16: bool) -> str:
    """The Markdown table of predicted against measured, and the worst error."""
    lines = ["| configuration | vLLM KV tokens | planned | error | vLLM max concurrency | planned"
             " | error | naive KV tokens (bytes ÷ KV per token) | naive error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    worst = 0.0
    for row in rows:
        got = row["measured"]
        if got["kv_cache_tokens"] is None:
            lines.append(f"| {row['name']} | (no line) | | | | | | | |")
            continue
        planned = plan_for_row(row, model_dir(row["model"]), cpu_avx512_bf16)
        errs = []
        for key in ("kv_cache_tokens", "max_concurrency"):
            errs.append(abs(planned[key] - got[key]) / got[key] * 100)
        worst = max(worst, *errs)
        naive = row["kv_space_gib"] * (1 << 30) // planned["kv_bytes_per_token"]
        lines.append(f"| {row['name']} | {got['kv_cache_tokens']:,} | "
                     f"{planned['kv_cache_tokens']:,} | {errs[0]:.2f} % | "
                     f"{got['max_concurrency']:.2f} | "
                     f"{planned['max_concurrency']:.2f} | {errs[1]:.2f} % | {naive:,} | "
                     f"{abs(naive - got['kv_cache_tokens']) / got['kv_cache_tokens']:.1%} |")
    lines.append(f"\nWorst error: {worst:.2f} % over {len(rows)} configurations.")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare-only", action="store_true")
    parser.add_argument("--only", nargs="*", help="configuration names to (re)measure")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/planner-check-logs"))
    args = parser.parse_args()
    if not args.compare_only:
        args.logs.mkdir(parents=True, exist_ok=True)
        record(args.logs, set(args.only) if args.only else None)
    recorded = json.loads(RESULTS.read_text())
    table = compare(recorded["rows"], recorded["cpu_avx512_bf16"])
    TABLE.write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
