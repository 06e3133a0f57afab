"""Tests for `chandrad check-config` and the CLI's exit codes, run as real subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pinned_parser import require_pinned_python

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CHANDRAD_CONFIG"}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _chandrad(*args: str, env: dict[str, str] | None = None,
              stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "chandrad", *args], capture_output=True,
                          text=True, env=env or _env(), input=stdin, timeout=300, check=False)


def _config(tmp_path: Path, engine: str = "", extra: str = "") -> Path:
    path = tmp_path / "chandrad.toml"
    (tmp_path / "in").mkdir(exist_ok=True)
    path.write_text(
        f'[daemon]\nstate_dir = "{tmp_path}/state"\n'
        f'[[watch]]\ninput = "{tmp_path}/in"\n'
        f'[engine]\nmodel = "/models/tiny-idefics3"\nserved_model_name = "tiny"\nport = 8311\n'
        f"{engine}"
        f'[engine.memory]\nmax_num_seqs = 4\nmax_model_len = 4096\n'
        f"{extra}",
        encoding="utf-8")
    return path


def test_check_config_good_prints_engine_command_and_exits_0(tmp_path: Path) -> None:
    """A valid config passes the real vLLM parser and prints the effective command line."""
    path = _config(tmp_path, engine='env = { VLLM_CPU_KVCACHE_SPACE = "1" }\n')
    started = time.monotonic()
    done = _chandrad("check-config", "--config", str(path))
    print(f"check-config took {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stderr
    command_line = next(line for line in done.stdout.splitlines()
                        if "vllm.entrypoints.openai.api_server" in line)
    assert command_line.strip().startswith(f"{sys.executable} -m ")
    for part in ("--model /models/tiny-idefics3", "--served-model-name tiny", "--port 8311",
                 "--max-num-seqs 4", "--max-model-len 4096",
                 "--limit-mm-per-prompt '{\"image\": 1}'"):
        assert part in command_line
    assert "VLLM_CPU_KVCACHE_SPACE=1" in done.stdout
    assert "HF_HUB_OFFLINE=0" in done.stdout
    assert done.stderr == ""


def test_check_config_unknown_vllm_flags_in_extra_args_exit_78(tmp_path: Path) -> None:
    """Flags the installed vLLM lacks are caught before any GPU work, one line each."""
    path = _config(tmp_path, engine='extra_args = ["--swap-space", "4", "--frobnicate", '
                                    '"--max-num-seqs", "8"]\n')
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 78, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 3, lines
    assert all(line.startswith(f"{path}:9: engine.extra_args: ") for line in lines)
    text = "\n".join(lines)
    assert "--swap-space" in text and "0.18" in text
    assert "--frobnicate" in text
    assert "--max-num-seqs is given more than once" in text


def test_check_config_judges_flags_with_engine_python_s_vllm(tmp_path: Path) -> None:
    """With ``engine.python`` the flags go to that interpreter's vLLM, as the daemon's flag
    check sends them: the pinned 0.17 (``.venv-pinned``) accepts ``--swap-space``, which
    the installed 0.32 lacks, and refuses ``--distributed-timeout-seconds``, which only
    0.32 has; the GPU path's version warning (an H100 previewed) names 0.17.1. One child
    importing vLLM 0.17 (~10 s)."""
    python = require_pinned_python()
    path = _config(tmp_path, engine=f'python = "{python}"\nextra_args = ["--swap-space", '
                                    '"4", "--distributed-timeout-seconds", "60"]\n')
    done = _chandrad("check-config", "--config", str(path), "--gpu-memory", "81559MiB")
    assert done.returncode == 78, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    problems = [line for line in lines if not line.startswith("warning: ")]
    assert len(problems) == 1, lines
    assert problems[0].startswith(f"{path}:10: engine.extra_args: --distributed-timeout-seconds")
    assert "vLLM 0.17.1" in problems[0]
    # The GPU path's version warning names that vLLM too (the side venv's is vllm-cpu).
    assert "warning: engine.python: the GPU path expects" in done.stderr, lines
    assert "installed: vllm-cpu 0.17.1" in done.stderr, lines


def test_check_config_engine_python_that_cannot_run_exit_78(tmp_path: Path) -> None:
    """An ``engine.python`` that is not there is named, not replaced by chandrad's own."""
    missing = tmp_path / "no-such-venv" / "bin" / "python"
    path = _config(tmp_path, engine=f'python = "{missing}"\n')
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 78, done.stdout + done.stderr
    assert f"{path}:9: engine.python: cannot run {missing}: No such file" in done.stderr
    assert "vllm serve" in done.stderr


def test_check_config_bad_config_one_line_per_problem(tmp_path: Path) -> None:
    """Config errors exit 78 with one `file:line: key: message` line per problem."""
    path = _config(tmp_path, engine="startup_timeout = 0\nbogus = 1\n",
                   extra="swap_space = 4\nblock_size = \"16MB\"\n")
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 78
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 4, lines
    by_key = {line.split(": ", 2)[1]: line for line in lines}
    assert by_key["engine.startup_timeout"] == (
        f"{path}:9: engine.startup_timeout: 0 is out of range [1, 86400]")
    assert by_key["engine.bogus"] == f"{path}:10: engine.bogus: unknown key"
    assert by_key["engine.memory.swap_space"].startswith(f"{path}:14: ")
    assert "0.18" in by_key["engine.memory.swap_space"]
    assert by_key["engine.memory.block_size"].startswith(f"{path}:15: ")
    assert "tokens per KV block" in by_key["engine.memory.block_size"]


def test_check_config_overlapping_watches_exit_78(tmp_path: Path) -> None:
    """A second watch on the same input, and one whose output lies in the first watch's
    input, are config errors with key and line (the first was silently ignored)."""
    path = _config(tmp_path, extra=(f'[[watch]]\ninput = "{tmp_path}/in"\n'
                                    f'output = "{tmp_path}/in/ocr"\n'))
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 78, done.stdout + done.stderr
    lines = sorted(done.stderr.strip().splitlines())
    assert lines == [
        f"{path}:13: watch[1].input: {tmp_path}/in is already watched by watch[0].input "
        "(line 4); a folder can have only one watch",
        f"{path}:14: watch[1].output: {tmp_path}/in/ocr is inside the watched input "
        f"{tmp_path}/in; its files would be taken as new input. Put it beside the input folder",
    ], lines


def test_check_config_missing_file_exit_78(tmp_path: Path) -> None:
    """A config path that does not exist is a config error, not a crash."""
    done = _chandrad("check-config", "--config", str(tmp_path / "missing.toml"))
    assert done.returncode == 78
    assert "cannot read config" in done.stderr


def test_check_config_uses_chandrad_config_env(tmp_path: Path) -> None:
    """Without --config, $CHANDRAD_CONFIG names the file."""
    path = _config(tmp_path, engine="stop_timeout = 0\n")
    done = _chandrad("check-config", env=_env(CHANDRAD_CONFIG=str(path)))
    assert done.returncode == 78
    assert done.stderr.startswith(f"{path}:9: engine.stop_timeout")


def test_check_config_remote_engine_has_no_command(tmp_path: Path) -> None:
    """With engine.url there is no engine to start: said so, URL checked, exit 0."""
    path = _config(tmp_path, engine='url = "http://gpu-box:8000/v1"\n')
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 0, done.stderr
    assert "remote at http://gpu-box:8000" in done.stdout
    assert "api_server" not in done.stdout


@pytest.mark.parametrize("url", ["http://", "http://host:notaport", "https://h/v1?x=1"])
def test_check_config_remote_engine_bad_url_shape(tmp_path: Path, url: str) -> None:
    """A remote URL without a host, with a bad port or a query is refused with its line."""
    path = _config(tmp_path, engine=f'url = "{url}"\n')
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 78
    assert done.stderr.startswith(f"{path}:9: engine.url: ")


def test_run_with_bad_config_exits_78(tmp_path: Path) -> None:
    """`chandrad run` refuses a bad config with EX_CONFIG (systemd will not restart it)."""
    path = _config(tmp_path, extra="preemption_mode = \"swap\"\n")
    done = _chandrad("run", "--config", str(path))
    assert done.returncode == 78
    assert "engine.memory.preemption_mode" in done.stderr and "V0" in done.stderr


@pytest.mark.parametrize("args", [[], ["bogus"], ["check-config", "--bogus"], ["run", "x"]])
def test_usage_errors_exit_2(args: list[str]) -> None:
    """Unknown commands and options are usage errors (exit 2)."""
    done = _chandrad(*args)
    assert done.returncode == 2
    assert "usage:" in done.stderr


def test_help_lists_public_commands_only() -> None:
    """--help exits 0 and does not advertise the hidden check-flags."""
    done = _chandrad("--help")
    assert done.returncode == 0
    assert "check-config" in done.stdout and "run" in done.stdout
    assert "check-flags" not in done.stdout


def test_check_flags_rejects_non_json_stdin() -> None:
    """The hidden check-flags wants a JSON list of strings on stdin (usage error otherwise)."""
    assert _chandrad("check-flags", stdin="--swap-space 4").returncode == 2
    assert _chandrad("check-flags", stdin=json.dumps({"a": 1})).returncode == 2


@pytest.mark.parametrize("delay", [0.5, 1.5, 3.0])
def test_interrupt_during_check_is_clean_exit_0(tmp_path: Path, delay: float) -> None:
    """Ctrl-C (SIGINT) while vLLM's parser loads ends with exit 0, no traceback.

    Several moments, because where the import is when the signal lands decides how
    Python would otherwise fail: exit by signal 2, or an unrelated import error → 78.
    """
    path = _config(tmp_path)
    # A suite started in the background (`cmd &`) inherits SIGINT ignored, and so would
    # the child; a terminal's Ctrl-C reaches a process whose SIGINT is at its default.
    proc = subprocess.Popen([sys.executable, "-u", "-m", "chandrad", "check-config", "--config",
                             str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "OK" in first  # config parsed; the vLLM import is now under way
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "engine command" not in out


def test_check_config_refuses_a_tokens_file_others_may_read(tmp_path: Path) -> None:
    """``[api]``'s tokens file is read as ``run`` reads it: mode o+r is exit 78 naming the
    key and its line; mode 0600 passes."""
    tokens = tmp_path / "tokens"
    tokens.write_text("alice 0123456789abcdef0123\n")
    tokens.chmod(0o644)
    path = _config(tmp_path, engine='url = "http://gpu-box:8000/v1"\n',
                   extra=f'[api]\nenabled = true\ntokens_file = "{tokens}"\n')
    done = _chandrad("check-config", "--config", str(path))
    assert done.returncode == 78, done.stderr
    assert done.stderr.startswith(f"{path}:15: api.tokens_file: ") and "readable by others" in (
        done.stderr), done.stderr
    tokens.chmod(0o600)
    assert _chandrad("check-config", "--config", str(path)).returncode == 0
