"""The vLLM engine command line, its environment, and its validation (docs/configuration.md).

Owns turning an :class:`EngineConfig` plus a :class:`MemoryProfile` into the exact
argv and environment of the engine child, and checking that argv with the installed
vLLM's own argument parser. Pure except :func:`validate_engine_args`, which imports
vLLM lazily (only ``check-config`` and the hidden ``check-flags`` subcommand call it),
and :func:`validate_in_child`, which runs that check in a child interpreter so the
daemon process never imports vLLM or torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib
import io
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chandrad import config, errors
from chandrad.engine import launch
from chandrad.engine.profile import MemoryProfile

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

#: Set for the engine unless the config's ``[engine] env`` says otherwise.
DEFAULT_ENGINE_ENV: dict[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}

#: The variables that belong to chandrad's own systemd unit, never to a child's.
SCRUBBED_ENV_PREFIXES: tuple[str, ...] = ("NOTIFY_SOCKET", "WATCHDOG_", "LISTEN_")

#: Which config key each generated flag comes from; anything else comes from extra_args.
FLAG_KEYS: dict[str, str] = {
    "--model": "engine.model",
    "--served-model-name": "engine.served_model_name",
    "--host": "engine.host",
    "--port": "engine.port",
    "--gpu-memory-utilization": "engine.memory.gpu_memory_utilization",
    "--max-num-seqs": "engine.memory.max_num_seqs",
    "--max-num-batched-tokens": "engine.memory.max_num_batched_tokens",
    "--max-model-len": "engine.memory.max_model_len",
    "--block-size": "engine.memory.block_size",
    "--enforce-eager": "engine.memory.enforce_eager",
    "--no-enforce-eager": "engine.memory.enforce_eager",
    "--dtype": "engine.dtype",
    "--enable-prefix-caching": "engine",  # Chandra's GPU launch, no key of its own
    "--cpu-offload-gb": "engine.memory.cpu_offload_gb",
    "--kv-cache-memory-bytes": "engine.memory.kv_cache_memory_bytes",
    "--limit-mm-per-prompt": "engine.memory.limit_mm_per_prompt",
    "--mm-processor-kwargs": "engine.memory.mm_processor_kwargs",
    "--mm-processor-cache-gb": "engine.memory.mm_processor_cache_gb",
}
EXTRA_ARGS_KEY = "engine.extra_args"

BLOCK_SIZE_HINT = (
    "block size is tokens per KV block (16 by default; 1, 8, 16, 32, 64, 128 or 256), not "
    "a size in MB; to limit KV cache memory use kv_cache_memory_bytes or "
    "gpu_memory_utilization"
)
_SANE_BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)

CHECK_FLAGS_TIMEOUT = 120.0


@dataclass(frozen=True)
class EngineCommand:
    """What to exec for the engine. ``env`` is the child's FULL environment."""

    argv: tuple[str, ...]
    env: dict[str, str]
    #: The flags after the program part (what :func:`validate_engine_args` checks).
    flags: tuple[str, ...] = ()
    #: The variables chandrad set or changed relative to ``base_env`` (for display).
    env_added: dict[str, str] = field(default_factory=dict)


def engine_python(engine: config.EngineConfig) -> str:
    """The interpreter that runs vLLM: ``engine.python``, else the daemon's own."""
    return engine.python or sys.executable


def engine_flags(engine: config.EngineConfig, profile: MemoryProfile) -> tuple[str, ...]:
    """The vLLM flags for ``engine`` at ``profile``, then ``extra_args`` verbatim.

    A profile made for a GPU (``profile.chandra_launch``) carries every flag of
    Chandra's own launcher (``engine/launch.py``); the configured values win.
    """
    flags: list[str] = [
        "--model", engine.model,
        "--served-model-name", engine.served_model_name,
        "--host", engine.host,
        "--port", str(engine.port),
    ]
    numeric: tuple[tuple[str, float | int | None], ...] = (
        ("--gpu-memory-utilization", profile.gpu_memory_utilization),
        ("--max-num-seqs", profile.max_num_seqs),
        ("--max-num-batched-tokens", profile.max_num_batched_tokens),
        ("--max-model-len", profile.max_model_len),
        ("--block-size", profile.block_size),
    )
    for flag, value in numeric:
        if value is not None:
            flags += [flag, str(value)]
    dtype = engine.dtype
    if dtype == "auto":
        dtype = launch.DTYPE if profile.chandra_launch else ""
    if dtype:
        flags += ["--dtype", dtype]
    if profile.enforce_eager:
        flags.append("--enforce-eager")
    elif profile.chandra_launch:
        flags.append("--no-enforce-eager")
    if profile.chandra_launch:
        flags.append("--enable-prefix-caching")
    if profile.cpu_offload_gb > 0:
        flags += ["--cpu-offload-gb", str(profile.cpu_offload_gb)]
    if profile.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(profile.kv_cache_memory_bytes)]
    memory = engine.memory
    if memory.limit_mm_per_prompt:
        flags += ["--limit-mm-per-prompt", json.dumps(memory.limit_mm_per_prompt,
                                                      sort_keys=True)]
    mm_kwargs = memory.mm_processor_kwargs or (
        launch.MM_PROCESSOR_KWARGS if profile.chandra_launch else {})
    if mm_kwargs:
        flags += ["--mm-processor-kwargs", json.dumps(mm_kwargs, sort_keys=True)]
    if profile.mm_processor_cache_gb is not None:
        flags += ["--mm-processor-cache-gb", str(profile.mm_processor_cache_gb)]
    return (*flags, *engine.extra_args)


def _merge_alloc_conf(existing: str) -> str:
    """``existing`` PyTorch allocator options with ``expandable_segments:True`` forced on."""
    parts = [p for p in existing.split(",") if p.strip()]
    kept = [p for p in parts if p.split(":", 1)[0].strip() != "expandable_segments"]
    return ",".join([*kept, "expandable_segments:True"])


def scrub_systemd_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without the variables that belong to chandrad's own unit.

    A child that inherits ``NOTIFY_SOCKET`` or ``WATCHDOG_*`` could speak for the unit
    (``NotifyAccess=main`` would drop it, but a foreign ``READY=1`` is still confusing);
    ``LISTEN_*`` would make it claim our sockets. ``config.REFUSED_ENGINE_ENV`` goes too:
    an engine kept alive after its core died would hide the failure.
    """
    return {k: v for k, v in env.items()
            if not k.startswith(SCRUBBED_ENV_PREFIXES) and k not in config.REFUSED_ENGINE_ENV}


def engine_env(
    engine: config.EngineConfig, profile: MemoryProfile, base_env: Mapping[str, str]
) -> dict[str, str]:
    """The child's full environment.

    Order: ``base_env`` without systemd's per-unit variables; the privacy defaults where
    ``base_env`` does not set them; ``HF_HUB_OFFLINE`` from ``engine.offline``;
    ``CUDA_VISIBLE_DEVICES`` from ``engine.gpus``; ``engine.env`` (wins over all of these); finally
    ``expandable_segments:True`` merged into the allocator config when the profile asks.
    """
    env = scrub_systemd_env(base_env)
    for name, value in DEFAULT_ENGINE_ENV.items():
        env.setdefault(name, value)
    # engine.offline: the hub is never asked (the cache must hold the model); otherwise a
    # model id that is not cached is downloaded on the first start.
    env["HF_HUB_OFFLINE"] = "1" if engine.offline else "0"
    if engine.gpus.strip().lower() != "all":
        env["CUDA_VISIBLE_DEVICES"] = engine.gpus.replace(" ", "")
    env.update(engine.env)
    if profile.expandable_segments:
        env["PYTORCH_CUDA_ALLOC_CONF"] = _merge_alloc_conf(env.get("PYTORCH_CUDA_ALLOC_CONF", ""))
        # torch >= 2.9 also reads the device-neutral name, and it takes precedence there.
        if "PYTORCH_ALLOC_CONF" in env:
            env["PYTORCH_ALLOC_CONF"] = _merge_alloc_conf(env["PYTORCH_ALLOC_CONF"])
    return env


def build_engine_command(
    engine: config.EngineConfig,
    profile: MemoryProfile,
    *,
    base_env: Mapping[str, str],
    python: str | None = None,
    cpus: str = "",
) -> EngineCommand:
    """The argv and full environment that start the engine for ``profile``.

    ``engine.command`` replaces the program part (``python -m <api server>``).
    ``cpus`` (a replica's ``engine.cpu_affinity`` entry) runs it under ``taskset -c``,
    which execs the engine in place (same pid, every thread and child pinned).
    Duplicate flags are not resolved here; :func:`validate_engine_args` reports them.
    """
    program = engine.command or (python or engine_python(engine), "-m", API_SERVER_MODULE)
    if cpus:
        program = ("taskset", "-c", cpus, *program)
    flags = engine_flags(engine, profile)
    env = engine_env(engine, profile, base_env)
    added = {k: v for k, v in env.items() if base_env.get(k) != v}
    return EngineCommand(argv=(*program, *flags), env=env, flags=flags, env_added=added)


# --------------------------------------------------------------------------- validation


def _option_name(token: str) -> str | None:
    """``--foo_bar=1`` → ``--foo-bar``; ``None`` for values and vLLM's dotted JSON keys."""
    if not token.startswith("--") or token == "--":
        return None
    name = token.split("=", 1)[0]
    if "." in name or name.endswith("+"):
        return None
    return "--" + name[2:].replace("_", "-")


def _values_after(argv: Sequence[str], index: int) -> list[str]:
    """The tokens after ``argv[index]`` up to the next option."""
    values: list[str] = []
    for token in argv[index + 1:]:
        if token.startswith("-") and not _is_number(token):
            break
        values.append(token)
    return values


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def _problem(flag: str, message: str, code: str = "engine_flag_invalid") -> errors.ConfigProblem:
    return errors.ConfigProblem(FLAG_KEYS.get(flag, EXTRA_ARGS_KEY), message, code=code)


def _unknown_flag_problem(flag: str, vllm_version: str) -> errors.ConfigProblem:
    knob = flag[2:].replace("-", "_")
    base = f"{flag} is not an option of the installed vLLM {vllm_version}"
    if knob in config.OBSOLETE_ENGINE_KNOBS:
        return _problem(flag, f"{base}: {knob} {config.OBSOLETE_ENGINE_KNOBS[knob]}",
                        "engine_flag_obsolete")
    return _problem(flag, base, "engine_flag_unknown")


def _block_size_problems(argv: Sequence[str]) -> list[errors.ConfigProblem]:
    """``--block-size`` given as a size (``16MB``, ``2048``) instead of tokens per block."""
    out: list[errors.ConfigProblem] = []
    for i, token in enumerate(argv):
        if _option_name(token) != "--block-size":
            continue
        value = token.split("=", 1)[1] if "=" in token else next(iter(argv[i + 1:i + 2]), "")
        if value.isdigit() and int(value) in _SANE_BLOCK_SIZES:
            continue
        out.append(_problem("--block-size", f"--block-size {value}: {BLOCK_SIZE_HINT}",
                            "engine_flag_obsolete"))
    return out


def duplicate_flags(argv: Sequence[str]) -> list[errors.ConfigProblem]:
    """Every option given more than once (olmOCR #269: vLLM silently takes the last one).

    Pure and spelling-tolerant (``--a_b`` = ``--a-b``); :func:`validate_engine_args`
    also resolves aliases and abbreviations through the real parser.
    """
    return _duplicates([(n, n) for n in map(_option_name, argv) if n], repeatable=set())


def _duplicates(
    options: Sequence[tuple[str, str]], repeatable: set[str]
) -> list[errors.ConfigProblem]:
    """``options`` is ``(identity, spelling)`` pairs in argv order."""
    seen: dict[str, str] = {}
    out: list[errors.ConfigProblem] = []
    reported: set[str] = set()
    for ident, spelling in options:
        if ident in repeatable:
            continue
        if ident in seen and ident not in reported:
            reported.add(ident)
            first = seen[ident]
            origin = FLAG_KEYS.get(first)
            detail = f"it is already set from {origin}" if origin else "it appears twice"
            also = f" (as {spelling})" if spelling != first else ""
            out.append(errors.ConfigProblem(
                EXTRA_ARGS_KEY,
                f"{first} is given more than once{also}: {detail}; vLLM would silently use "
                "the last value. Remove the duplicate from extra_args",
                code="engine_flag_duplicate"))
        seen.setdefault(ident, spelling)
    return out


class _ParseFailure(Exception):
    """argparse wanted to print a usage error and exit."""


@functools.cache
def _load_vllm_parser() -> tuple[argparse.ArgumentParser, Any, str]:
    """vLLM's serve parser (error-raising, extras-collecting), its post-parse check, version."""
    # Imported by name so that type checking chandrad never walks vLLM's sources.
    vllm = importlib.import_module("vllm")
    flexible: Any = importlib.import_module("vllm.utils.argparse_utils").FlexibleArgumentParser
    try:
        cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    except ImportError:  # vLLM < 0.30 kept it under the openai package
        cli_args = importlib.import_module("vllm.entrypoints.openai.cli_args")

    class QuietParser(flexible):  # type: ignore[misc,valid-type]
        """Raises instead of exiting, and hands back unknown options instead of failing."""

        extras: list[str] = []

        def error(self, message: str) -> Any:
            raise _ParseFailure(message)

        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            ns, extras = super().parse_known_args(args, namespace)
            self.extras = list(extras)
            return ns, []

    parser = cli_args.make_arg_parser(QuietParser(prog="vllm serve", exit_on_error=False))
    return parser, cli_args.validate_parsed_serve_args, str(getattr(vllm, "__version__", "?"))


def _resolve(parser: argparse.ArgumentParser, option: str) -> argparse.Action | None:
    """The parser action an option spelling selects, abbreviations included (as argparse)."""
    actions = parser._option_string_actions
    if option in actions:
        return actions[option]
    matches = {id(a): a for name, a in actions.items() if name.startswith(option)}
    return next(iter(matches.values())) if len(matches) == 1 else None


def _without(argv: list[str], option_names: set[str]) -> list[str]:
    """``argv`` minus the first occurrence of one of ``option_names`` and its values."""
    for i, token in enumerate(argv):
        if _option_name(token) in option_names:
            end = i + 1 if "=" in token else i + 1 + len(_values_after(argv, i))
            return argv[:i] + argv[end:]
    return argv


def validate_engine_args(argv_tail: Sequence[str]) -> list[errors.ConfigProblem]:
    """Check the engine flags with the installed vLLM's own parser (docs/configuration.md,
    `[engine]`).

    Returns one problem per unknown, obsolete, malformed or duplicated flag, each
    naming the flag and, for known obsolete knobs, the real mechanism. Prints
    nothing and never exits. Imports vLLM (and with it torch): keep it out of the
    daemon process (see :func:`validate_in_child`).
    """
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            parser, post_check, version = _load_vllm_parser()
        except Exception as exc:
            return [errors.ConfigProblem(
                "engine.python", f"cannot import vLLM's argument parser here ({exc}); is vllm "
                "installed for this interpreter?", code="engine_vllm_missing")]
        vllm_logger = logging.getLogger("vllm")
        was_disabled, vllm_logger.disabled = vllm_logger.disabled, True
        try:
            return _validate_with(parser, post_check, version, list(argv_tail))
        finally:
            vllm_logger.disabled = was_disabled


def _validate_with(
    parser: argparse.ArgumentParser, post_check: Any, version: str, argv: list[str]
) -> list[errors.ConfigProblem]:
    problems: list[errors.ConfigProblem] = []
    remaining = list(argv)
    namespace: argparse.Namespace | None = None
    for _ in range(len(argv) + 1):
        try:
            namespace = parser.parse_args(remaining)
            break
        except argparse.ArgumentError as exc:
            names = set((exc.argument_name or "").split("/"))
            flag = next(iter(sorted(names)), "") if names else ""
            shown = next((n for n in names if n in FLAG_KEYS), flag)
            if shown != "--block-size":  # reported with the tokens-not-MB hint below
                problems.append(_problem(shown, f"{exc.argument_name}: {exc.message}"))
            shorter = _without(remaining, names)
            if shorter == remaining:
                break
            remaining = shorter
        except (_ParseFailure, ValueError, TypeError) as exc:
            problems.append(errors.ConfigProblem(EXTRA_ARGS_KEY, str(exc),
                                                 code="engine_flag_invalid"))
            break
    extras: list[str] = getattr(parser, "extras", [])
    unknown = {_option_name(e) for e in extras} - {None}
    explained: set[str] = set()
    for i, token in enumerate(remaining):
        name = _option_name(token)
        if name is not None and name in unknown:
            unknown.discard(name)
            problems.append(_unknown_flag_problem(name, version))
            explained.update(_values_after(remaining, i))
    for token in extras:
        if not token.startswith("-") and token not in explained:
            problems.append(errors.ConfigProblem(
                EXTRA_ARGS_KEY, f"unexpected argument {token!r}", code="engine_flag_invalid"))
    stray = getattr(namespace, "model_tag", None)
    if stray is not None and stray not in explained:
        problems.append(errors.ConfigProblem(
            EXTRA_ARGS_KEY, f"stray positional argument {stray!r}: vLLM would take it as the "
            "model name; use [engine] model", code="engine_flag_invalid"))
    problems += _block_size_problems(argv)
    problems += _parser_duplicates(parser, remaining)
    if namespace is not None and not problems:
        try:
            post_check(namespace)
        except Exception as exc:
            problems.append(errors.ConfigProblem(EXTRA_ARGS_KEY, str(exc),
                                                 code="engine_flag_invalid"))
    return problems


def _parser_duplicates(
    parser: argparse.ArgumentParser, argv: Sequence[str]
) -> list[errors.ConfigProblem]:
    options: list[tuple[str, str]] = []
    repeatable: set[str] = set()
    for token in argv:
        name = _option_name(token)
        if not name:
            continue
        action = _resolve(parser, name)
        if action is None:
            continue
        canonical = action.option_strings[0] if action.option_strings else name
        options.append((action.dest, name if name in FLAG_KEYS else canonical))
        if isinstance(action, (argparse._AppendAction, argparse._CountAction)):
            repeatable.add(action.dest)
    return _duplicates(options, repeatable)


async def validate_in_child(
    engine: config.EngineConfig,
    profile: MemoryProfile,
    python: str | None = None,
    *,
    timeout: float = CHECK_FLAGS_TIMEOUT,
) -> list[errors.ConfigProblem]:
    """:func:`validate_engine_args` run by ``<python> -m chandrad check-flags``.

    The daemon uses this so that vLLM and torch are imported by a short-lived child
    (the engine's own interpreter), never by the daemon itself. Cancelling it kills the
    child at once (importing vLLM takes up to a minute; a stopping daemon must not wait).
    """
    interpreter = python or engine_python(engine)
    flags = engine_flags(engine, profile)
    package_root = str(Path(__file__).resolve().parents[2])
    env = scrub_systemd_env(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env.update({"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
    try:
        child = await asyncio.create_subprocess_exec(
            interpreter, "-m", "chandrad", "check-flags", stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    except OSError as exc:
        return [errors.ConfigProblem(
            "engine.python", f"cannot run {interpreter}: {exc.strerror}; engine.python must "
            "be the Python interpreter with vLLM installed that runs `vllm serve`",
            code="engine_vllm_missing")]
    try:
        async with asyncio.timeout(timeout):
            out, err = await child.communicate(json.dumps(list(flags)).encode())
    except TimeoutError:
        return [errors.ConfigProblem("engine.python", f"checking the engine flags with "
                                     f"{interpreter} took longer than {timeout:.0f} s",
                                     code="engine_vllm_missing")]
    finally:
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            await asyncio.shield(child.wait())
    code = child.returncode if child.returncode is not None else -1
    done = subprocess.CompletedProcess([interpreter], code, out.decode(errors="replace"),
                                       err.decode(errors="replace"))
    return _problems_from_child(done, interpreter)


def _problems_from_child(
    done: subprocess.CompletedProcess[str], interpreter: str
) -> list[errors.ConfigProblem]:
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    try:
        reply = json.loads(lines[-1])
        return [errors.ConfigProblem(p["key"], p["message"], code=p["code"]) for p in reply]
    except (IndexError, ValueError, KeyError, TypeError):
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return [errors.ConfigProblem(
            "engine.python", f"{interpreter} -m chandrad check-flags failed "
            f"(exit {done.returncode}): {tail}", code="engine_vllm_missing")]


def problems_to_json(problems: Sequence[errors.ConfigProblem]) -> str:
    """The one-line wire form ``check-flags`` prints."""
    return json.dumps([{"key": p.key, "message": p.message, "code": p.code} for p in problems])
