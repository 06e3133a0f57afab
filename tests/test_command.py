"""Tests for chandrad.engine.command: argv/env building and validation with the real vLLM."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest

from chandrad import config
from chandrad.engine import command
from chandrad.engine.profile import MemoryProfile, initial_profile
from chandrad.errors import ConfigProblem

ENGINE = config.EngineConfig(model="/models/tiny", served_model_name="tiny", port=8123)
PROFILE = MemoryProfile(gpu_memory_utilization=0.85, max_num_seqs=16,
                        max_num_batched_tokens=2048, max_model_len=8192, block_size=16,
                        enforce_eager=True, cpu_offload_gb=2.5, kv_cache_memory_bytes=10**9,
                        mm_processor_cache_gb=1.0, max_pixels=123456, max_output_tokens=99)


def _flag_value(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def _codes(problems: Sequence[ConfigProblem]) -> list[str]:
    return [p.code for p in problems]


# ----------------------------------------------------------------------------- building


def test_default_command_runs_api_server_module_with_identity_flags() -> None:
    """The default program is `<python> -m vllm.entrypoints.openai.api_server` + model/host/port."""
    cmd = command.build_engine_command(ENGINE, MemoryProfile(), base_env={}, python="/py")
    assert cmd.argv[:3] == ("/py", "-m", "vllm.entrypoints.openai.api_server")
    assert _flag_value(cmd.argv, "--model") == "/models/tiny"
    assert _flag_value(cmd.argv, "--served-model-name") == "tiny"
    assert _flag_value(cmd.argv, "--host") == "127.0.0.1"
    assert _flag_value(cmd.argv, "--port") == "8123"
    assert cmd.argv[3:] == cmd.flags


def test_python_defaults_to_engine_python_then_own_interpreter() -> None:
    """Without an explicit python, engine.python is used, else sys.executable."""
    own = command.build_engine_command(ENGINE, MemoryProfile(), base_env={})
    assert own.argv[0] == sys.executable
    other = command.build_engine_command(replace(ENGINE, python="/opt/vllm/bin/python"),
                                         MemoryProfile(), base_env={})
    assert other.argv[0] == "/opt/vllm/bin/python"


def test_engine_command_replaces_program_part() -> None:
    """engine.command replaces `python -m module` but the flags still follow."""
    engine = replace(ENGINE, command=("vllm", "serve"))
    cmd = command.build_engine_command(engine, MemoryProfile(), base_env={}, python="/py")
    assert cmd.argv[:2] == ("vllm", "serve")
    assert cmd.argv[2:] == cmd.flags
    assert "/py" not in cmd.argv


def test_every_profile_knob_becomes_its_flag() -> None:
    """Each set profile knob maps to its vLLM flag; page-budget knobs are not engine flags."""
    engine = replace(ENGINE, memory=config.MemoryConfig(
        limit_mm_per_prompt={"image": 2}, mm_processor_kwargs={"max_pixels": 6291456}))
    argv = command.build_engine_command(engine, PROFILE, base_env={}).argv
    assert _flag_value(argv, "--gpu-memory-utilization") == "0.85"
    assert _flag_value(argv, "--max-num-seqs") == "16"
    assert _flag_value(argv, "--max-num-batched-tokens") == "2048"
    assert _flag_value(argv, "--max-model-len") == "8192"
    assert _flag_value(argv, "--block-size") == "16"
    assert "--enforce-eager" in argv
    assert _flag_value(argv, "--cpu-offload-gb") == "2.5"
    assert _flag_value(argv, "--kv-cache-memory-bytes") == str(10**9)
    assert json.loads(_flag_value(argv, "--limit-mm-per-prompt")) == {"image": 2}
    assert json.loads(_flag_value(argv, "--mm-processor-kwargs")) == {"max_pixels": 6291456}
    assert _flag_value(argv, "--mm-processor-cache-gb") == "1.0"
    assert not any("pixels" in a and a.startswith("--") for a in argv)
    assert not any("output" in a for a in argv)


def test_unset_knobs_leave_vllm_defaults() -> None:
    """None knobs, enforce_eager=False, cpu_offload_gb=0 and empty dicts add no flag."""
    profile = MemoryProfile(gpu_memory_utilization=None)
    engine = replace(ENGINE, memory=config.MemoryConfig(limit_mm_per_prompt={}))
    flags = command.build_engine_command(engine, profile, base_env={}).flags
    assert flags == ("--model", "/models/tiny", "--served-model-name", "tiny",
                     "--host", "127.0.0.1", "--port", "8123")


def test_extra_args_come_last_and_verbatim() -> None:
    """extra_args are appended after the generated flags, unchanged."""
    engine = replace(ENGINE, extra_args=("--enable-prefix-caching", "--seed", "7"))
    flags = command.build_engine_command(engine, MemoryProfile(), base_env={}).flags
    assert flags[-3:] == ("--enable-prefix-caching", "--seed", "7")


def test_auto_profile_from_gpu_memory_reaches_the_flags() -> None:
    """`auto` batching on a 24 GB card becomes Chandra 2's 2048 tokens / 16 seqs."""
    profile = initial_profile(config.MemoryConfig(), 23.6)
    argv = command.build_engine_command(ENGINE, profile, base_env={}).argv
    assert _flag_value(argv, "--max-num-batched-tokens") == "2048"
    assert _flag_value(argv, "--max-num-seqs") == "16"


# ----------------------------------------------------------------------------- environment


def test_env_is_full_environment_scrubbed_of_systemd_variables() -> None:
    """The child gets the whole base env minus NOTIFY_SOCKET, WATCHDOG_* and LISTEN_*."""
    base = {"PATH": "/usr/bin", "HOME": "/var/lib/chandrad", "NOTIFY_SOCKET": "/run/n",
            "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1", "LISTEN_FDS": "1",
            "LISTEN_PID": "1", "LISTEN_FDNAMES": "x"}
    env = command.build_engine_command(ENGINE, MemoryProfile(), base_env=base).env
    assert env["PATH"] == "/usr/bin" and env["HOME"] == "/var/lib/chandrad"
    assert not [k for k in env if k.startswith(("NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_"))]


def test_env_privacy_defaults_and_config_override() -> None:
    """Usage stats off; the hub reachable unless engine.offline; [engine] env overrides them."""
    env = command.build_engine_command(ENGINE, MemoryProfile(), base_env={}).env
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["DO_NOT_TRACK"] == "1"
    assert env["HF_HUB_OFFLINE"] == "0"
    offline = command.build_engine_command(replace(ENGINE, offline=True), MemoryProfile(),
                                           base_env={"HF_HUB_OFFLINE": "0"}).env
    assert offline["HF_HUB_OFFLINE"] == "1"
    engine = replace(ENGINE, env={"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"})
    env = command.build_engine_command(engine, MemoryProfile(), base_env={}).env
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_env_added_lists_only_what_chandrad_changed() -> None:
    """env_added holds the variables that differ from base_env (for check-config output)."""
    cmd = command.build_engine_command(ENGINE, MemoryProfile(),
                                       base_env={"PATH": "/bin", "DO_NOT_TRACK": "1"})
    assert "PATH" not in cmd.env_added and "DO_NOT_TRACK" not in cmd.env_added
    assert cmd.env_added["HF_HUB_OFFLINE"] == "0"


def test_cuda_visible_devices_from_gpus_unless_all() -> None:
    """engine.gpus "0, 2" sets CUDA_VISIBLE_DEVICES=0,2; "all" leaves it alone."""
    env = command.build_engine_command(replace(ENGINE, gpus="0, 2"), MemoryProfile(),
                                       base_env={"CUDA_VISIBLE_DEVICES": "3"}).env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,2"
    env = command.build_engine_command(ENGINE, MemoryProfile(),
                                       base_env={"CUDA_VISIBLE_DEVICES": "3"}).env
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in command.build_engine_command(
        ENGINE, MemoryProfile(), base_env={}).env


def test_expandable_segments_only_when_profile_asks() -> None:
    """PYTORCH_CUDA_ALLOC_CONF is set only for a profile with expandable_segments."""
    plain = command.build_engine_command(ENGINE, MemoryProfile(), base_env={}).env
    assert "PYTORCH_CUDA_ALLOC_CONF" not in plain
    frag = command.build_engine_command(ENGINE, MemoryProfile(expandable_segments=True),
                                        base_env={}).env
    assert frag["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_expandable_segments_merges_with_existing_allocator_options() -> None:
    """Existing allocator options are kept and a contrary expandable_segments is replaced."""
    base = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False",
            "PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    env = command.build_engine_command(ENGINE, MemoryProfile(expandable_segments=True),
                                       base_env=base).env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"
    assert env["PYTORCH_ALLOC_CONF"] == (
        "garbage_collection_threshold:0.6,expandable_segments:True")
    engine = replace(ENGINE, env={"PYTORCH_CUDA_ALLOC_CONF": "roundup_power2_divisions:4"})
    env = command.build_engine_command(engine, MemoryProfile(expandable_segments=True),
                                       base_env={}).env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "roundup_power2_divisions:4,expandable_segments:True"


# ----------------------------------------------------------------------------- duplicates


def test_pure_duplicate_detection_names_flag_and_origin() -> None:
    """A profile flag repeated in extra_args (olmOCR #269) is reported, spelling-tolerant."""
    engine = replace(ENGINE, extra_args=("--gpu_memory_utilization=0.5",))
    cmd = command.build_engine_command(engine, PROFILE, base_env={})
    problems = command.duplicate_flags(cmd.flags)
    assert len(problems) == 1
    assert problems[0].key == "engine.extra_args"
    assert problems[0].code == "engine_flag_duplicate"
    assert "--gpu-memory-utilization" in problems[0].message
    assert "engine.memory.gpu_memory_utilization" in problems[0].message


def test_pure_duplicate_detection_passes_distinct_flags() -> None:
    """Distinct flags, values that look like flags' names and dotted JSON keys are no duplicates."""
    flags = ("--model", "m", "--compilation-config.level", "1",
             "--compilation-config.cudagraph_mode", "NONE", "--seed", "1")
    assert command.duplicate_flags(flags) == []


# ----------------------------------------------------------------------------- real vLLM parser


def _validate(*extra: str, profile: MemoryProfile = PROFILE) -> list[ConfigProblem]:
    engine = replace(ENGINE, extra_args=extra)
    return command.validate_engine_args(
        command.build_engine_command(engine, profile, base_env={}).flags)


def test_real_parser_accepts_the_full_generated_command() -> None:
    """Every flag chandrad generates exists in the installed vLLM, with valid values."""
    engine = replace(ENGINE, memory=config.MemoryConfig(mm_processor_kwargs={"max_pixels": 9}))
    flags = command.build_engine_command(engine, PROFILE, base_env={}).flags
    assert command.validate_engine_args(flags) == []


@pytest.mark.parametrize(
    ("extra", "flag", "hint"),
    [
        (("--swap-space", "4"), "--swap-space", "0.18"),
        (("--preemption-mode", "swap"), "--preemption-mode", "V0"),
        (("--batch-size", "8"), "--batch-size", "max_num_seqs"),
        (("--enable-memory-fragmentation-handler",), "--enable-memory-fragmentation-handler",
         "expandable_segments:True"),
    ],
)
def test_real_parser_rejects_obsolete_recipe_flags_with_replacement(
    extra: tuple[str, ...], flag: str, hint: str
) -> None:
    """Blog-recipe flags the installed vLLM lacks fail, naming the flag and the real mechanism."""
    problems = _validate(*extra)
    assert len(problems) == 1, problems
    assert problems[0].code == "engine_flag_obsolete"
    assert problems[0].key == "engine.extra_args"
    assert flag in problems[0].message
    assert hint in problems[0].message


def test_real_parser_rejects_made_up_flag() -> None:
    """An unknown flag is reported as unknown to the installed vLLM, named."""
    problems = _validate("--frobnicate-kv", "3")
    assert _codes(problems) == ["engine_flag_unknown"]
    assert "--frobnicate-kv" in problems[0].message
    assert "installed vLLM" in problems[0].message


def test_real_parser_reports_every_bad_flag_not_only_the_first() -> None:
    """Several unknown flags and a bad value are all reported in one pass."""
    problems = _validate("--swap-space", "4", "--seed", "x", "--batch-size", "8", "--made-up")
    messages = " | ".join(p.message for p in problems)
    for flag in ("--swap-space", "--seed", "--batch-size", "--made-up"):
        assert flag in messages
    assert len(problems) == 4


def test_real_parser_rejects_bad_value_of_profile_flag_under_its_config_key() -> None:
    """A malformed value for a generated flag names the config key it came from."""
    problems = command.validate_engine_args(["--model", "m", "--max-num-seqs", "lots"])
    assert len(problems) == 1
    assert problems[0].key == "engine.memory.max_num_seqs"
    assert "--max-num-seqs" in problems[0].message and "lots" in problems[0].message


def test_real_parser_rejects_block_size_in_megabytes() -> None:
    """--block-size 16MB or 2048 is a size, not tokens per block: one problem with the hint."""
    for value in ("16MB", "2048"):
        problems = command.validate_engine_args(["--model", "m", "--block-size", value])
        assert len(problems) == 1, problems
        assert "--block-size" in problems[0].message and "not a size in MB" in problems[0].message


def test_real_parser_reports_duplicate_via_alias_and_abbreviation() -> None:
    """Duplicates are found through vLLM's aliases and argparse abbreviations too."""
    problems = _validate("--device-memory-utilization", "0.5")
    assert _codes(problems) == ["engine_flag_duplicate"]
    assert "--gpu-memory-utilization" in problems[0].message
    problems = _validate("--max-num-seq", "4")
    assert _codes(problems) == ["engine_flag_duplicate"]
    assert "--max-num-seqs" in problems[0].message


def test_real_parser_reports_stray_positional() -> None:
    """A bare value in extra_args would become vLLM's model tag: reported."""
    problems = _validate("oops")
    assert _codes(problems) == ["engine_flag_invalid"]
    assert "'oops'" in problems[0].message


def test_validation_prints_nothing_and_does_not_exit(capfd: pytest.CaptureFixture[str]) -> None:
    """Neither a bad flag nor vLLM's own logging writes to stdout/stderr or raises SystemExit."""
    problems = _validate("--swap-space", "4", "--enforce-eager")
    assert problems
    out, err = capfd.readouterr()
    assert out == "" and err == ""


# ----------------------------------------------------------------------------- child process


def test_validate_in_child_runs_real_vllm_parser_in_engine_interpreter() -> None:
    """The child check returns the same typed problems as the in-process check."""
    engine = replace(ENGINE, extra_args=("--preemption-mode", "swap", "--max-num-seqs", "2"))
    started = time.monotonic()
    problems = asyncio.run(command.validate_in_child(engine, PROFILE, sys.executable))
    elapsed = time.monotonic() - started
    print(f"validate_in_child took {elapsed:.1f} s")
    assert sorted(_codes(problems)) == ["engine_flag_duplicate", "engine_flag_obsolete"]
    assert any("--preemption-mode" in p.message for p in problems)


def test_validate_in_child_without_vllm_is_one_clear_problem() -> None:
    """An interpreter without vLLM yields exactly one problem saying so."""
    system_python = shutil.which("python3", path="/usr/bin")
    if system_python is None:
        pytest.skip("no system python3 without vLLM on this machine")
    problems = asyncio.run(command.validate_in_child(ENGINE, PROFILE, system_python))
    assert len(problems) == 1
    assert problems[0].code == "engine_vllm_missing"
    assert "vLLM" in problems[0].message or "vllm" in problems[0].message


def test_validate_in_child_with_missing_interpreter() -> None:
    """A python path that does not exist is reported against engine.python."""
    problems = asyncio.run(command.validate_in_child(ENGINE, PROFILE, "/nonexistent/bin/python"))
    assert [p.key for p in problems] == ["engine.python"]
    assert "/nonexistent/bin/python" in problems[0].message
