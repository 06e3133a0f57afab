#!/usr/bin/env python3
"""A GPU stand-in for vLLM's OpenAI server, on PyTorch: real CUDA memory, real OOM.

vLLM cannot be carried to the device machine, so this process plays the engine there,
started through ``engine.command`` (``[python3, THIS, --standin-dir DIR]``; chandrad appends
its vLLM flags). Like vLLM it is two processes:

- the API server (this process): ``/health``, ``/v1/models`` (with ``max_model_len``),
  ``/v1/chat/completions`` (a fixed Chandra layout page, ``finish_reason`` "stop", after one
  step of the engine core), ``/metrics`` (vLLM's request gauges). It holds no GPU memory.
- the engine core (a child, named ``VLLM::EngineCore`` as vLLM's is): it sizes itself as
  vLLM V1 does from ``torch.cuda.mem_get_info`` of the one GPU ``CUDA_VISIBLE_DEVICES`` gives
  it: the budget is ``--gpu-memory-utilization`` x total; it refuses to start when less is
  free (vLLM's ValueError); it allocates the weights (``--standin-weights-gib``), an
  activation peak from ``--max-num-batched-tokens`` and the sampler's logits from
  ``--max-num-seqs``, and gives the rest of the budget to the KV cache (or
  ``--kv-cache-memory-bytes``). Every chat request runs a matmul on that memory.

An out-of-memory error on demand: a file ``oom`` or ``oom-<port>`` in the stand-in folder
(taken, i.e. deleted, by the core that sees it) makes the core really allocate past what the
card has free; PyTorch's own ``torch.OutOfMemoryError`` is logged the way vLLM's EngineCore
logs a fatal error (its traceback, each line prefixed), the core exits 1, and the API server
logs vLLM's ``EngineDeadError`` and exits 1, as vLLM does. chandrad's classifier reads
those lines as it reads vLLM's.

Run as ``engine.python``, it plays that interpreter: ``THIS -m chandrad check-flags`` is the
flag check, with its own parser as the verdict (a flag it does not know is refused the way
chandrad reports vLLM's refusals), and ``THIS -c CODE`` (the version query) answers
``0.17.0+gpu-standin``. Without CUDA (the CPU test machines) the core holds no memory and an OOM
request is answered by a plain error exit (no GPU, no OOM text is made up); the protocol
is tested here, the memory on the device (``tests/fixtures/gpu/``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from standin_engine import EngineHandler, EngineServer, completion, error, log

VERSION = "0.17.0"  # the vLLM release whose log lines and defaults this stand-in follows
GIB = 1 << 30
PAGE = ('<div data-bbox="40 40 960 120" data-label="Section-Header"><h1>GPU stand-in</h1>'
        '</div><div data-bbox="40 140 960 900" data-label="Text"><p>Served by the GPU '
        'stand-in engine.</p></div>')
#: Stand-ins for the real model's shape (chandra-ocr-2: Qwen3.5-based, 4B): hidden size and
#: vocabulary, for the activation peak and the sampler's fp32 logits.
HIDDEN, VOCAB = 2560, 151936
KV_BYTES_PER_TOKEN = 36 * 1024
ACTIVATION_FACTOR = 8  # intermediate tensors per batched token, in hidden-size bf16 rows
#: vLLM flags chandrad may pass that change nothing here; accepted as vLLM would.
IGNORED_FLAGS = ("--dtype", "--block-size", "--limit-mm-per-prompt", "--mm-processor-kwargs",
                 "--mm-processor-cache-gb", "--cpu-offload-gb", "--host")
IGNORED_SWITCHES = ("--enforce-eager", "--no-enforce-eager", "--enable-prefix-caching",
                    "--enable-log-requests", "--enable-log-outputs")


def parser() -> argparse.ArgumentParser:
    """The vLLM flags the stand-in understands (and its own ``--standin-*`` options)."""
    p = argparse.ArgumentParser(prog="gpu_standin_engine", allow_abbrev=False)
    p.add_argument("--standin-dir", type=Path, default=Path("."))
    p.add_argument("--standin-weights-gib", type=float, default=8.0)
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    for flag in IGNORED_FLAGS:
        p.add_argument(flag, default=None)
    for flag in IGNORED_SWITCHES:
        p.add_argument(flag, action="store_true")
    return p


# ------------------------------------------------------------------ flag check (engine.python)
def check_flags() -> int:
    """``-m chandrad check-flags``: read the flags (JSON list), print the verdict (JSON)."""
    flags = json.loads(sys.stdin.read())
    problems = []
    try:
        _, unknown = parser().parse_known_args(flags)
    except SystemExit:
        unknown = flags
    for flag in (u for u in unknown if u.startswith("--")):
        problems.append({"key": "engine.extra_args", "code": "engine_flag_invalid",
                         "message": f"{flag} is not an option of the GPU stand-in engine"})
    print(json.dumps(problems))
    return 0


# ------------------------------------------------------------------ engine core (child)
def _name_process(name: str) -> None:
    """Set the kernel's name of this process (``/proc/PID/comm``), as setproctitle does."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15] + b"\0", 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _oom_marker(folder: Path, port: int) -> bool:
    """Take (delete) an OOM request addressed to this engine or to any."""
    for name in (f"oom-{port}", "oom"):
        try:
            (folder / name).unlink()
            return True
        except FileNotFoundError:
            continue
    return False


def engine_core(args: argparse.Namespace) -> int:
    """Hold the GPU memory; answer ``step`` lines on stdin; die of a real OOM on demand."""
    who = "EngineCore_DP0"
    _name_process("VLLM::EngineCor")
    out = sys.stderr  # stdout is the pipe to the API server
    held: list[Any] = []
    torch: Any = None
    try:
        import torch as _torch

        torch = _torch if _torch.cuda.is_available() else None
    except ImportError:
        torch = None
    if torch is None:
        log(who, "WARNING", "core.py:90", "no CUDA device: the stand-in holds no GPU memory",
            out)
    else:
        free, total = torch.cuda.mem_get_info()
        budget = args.gpu_memory_utilization * total
        name = torch.cuda.get_device_name(0)
        log(who, "INFO", "gpu_worker.py:239", f"Device: {name}; total {total / GIB:.2f} GiB, "
            f"free {free / GIB:.2f} GiB; CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')}", out)
        if free < budget:
            log(who, "ERROR", "core.py:708", "EngineCore failed to start.", out)
            log(who, "ERROR", "core.py:708", "ValueError: Free memory on device cuda:0 "
                f"({free / GIB:.2f}/{total / GIB:.2f} GiB) on startup is less than desired "
                f"GPU memory utilization ({args.gpu_memory_utilization}, {budget / GIB:.2f} "
                "GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
                "processes.", out)
            return 1
        weights = int(args.standin_weights_gib * GIB)
        activations = args.max_num_batched_tokens * HIDDEN * 2 * ACTIVATION_FACTOR
        logits = args.max_num_seqs * VOCAB * 4
        held.append(torch.empty(weights, dtype=torch.uint8, device="cuda"))
        log(who, "INFO", "gpu_model_runner.py:2007", f"Model loading took {weights / GIB:.4f} "
            "GiB and 1.02 seconds", out)
        held.append(torch.empty(activations + logits, dtype=torch.uint8, device="cuda"))
        used = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        kv = (args.kv_cache_memory_bytes if args.kv_cache_memory_bytes is not None
              else int(budget - used))
        if kv <= 0:
            log(who, "ERROR", "core.py:708", "ValueError: No available memory for the cache "
                "blocks. Try increasing `gpu_memory_utilization` when initializing the "
                "engine.", out)
            return 1
        held.append(torch.empty(kv, dtype=torch.uint8, device="cuda"))
        tokens = kv // KV_BYTES_PER_TOKEN
        log(who, "INFO", "gpu_worker.py:298", f"Available KV cache memory: {kv / GIB:.2f} GiB",
            out)
        log(who, "INFO", "kv_cache_utils.py:1087", f"GPU KV cache size: {tokens:,} tokens", out)
        log(who, "INFO", "kv_cache_utils.py:1091", "Maximum concurrency for "
            f"{args.max_model_len:,} tokens per request: {tokens / args.max_model_len:.2f}x", out)
        torch.cuda.synchronize()
    work = None if torch is None else torch.ones(1024, 1024, device="cuda", dtype=torch.bfloat16)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([sys.stdin], [], [], 0.2)
        if readable:
            line = sys.stdin.readline()
            if not line:
                return 0  # the API server is gone
            if work is not None:
                (work @ work).sum().item()
            print("done", flush=True)
        if _oom_marker(args.standin_dir, args.port):
            if torch is None:
                log(who, "ERROR", "core.py:1010", "OOM requested, but there is no CUDA device: "
                    "nothing to allocate past", out)
                return 1
            try:
                free, _ = torch.cuda.mem_get_info()
                held.append(torch.empty(free + GIB, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError as exc:
                log(who, "ERROR", "core.py:1010", "EngineCore encountered a fatal error.", out)
                for chunk in traceback.format_exception(exc):
                    for text in chunk.rstrip("\n").splitlines():
                        log(who, "ERROR", "core.py:1010", text, out)
                return 1


# ------------------------------------------------------------------ API server (leader)
class _Server(EngineServer):
    core: subprocess.Popen[str]
    lock: threading.Lock


class _Handler(EngineHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if self.path != "/v1/chat/completions":
            self.send(404, {"detail": "Not Found"})
            return
        if body.get("model") != self.server.served:
            self.send(404, error(404, f"The model `{body.get('model')}` does not exist."))
            return
        self.server.running += 1
        try:
            with self.server.lock:  # one engine step at a time, on the GPU
                core = self.server.core
                assert core.stdin is not None and core.stdout is not None
                try:
                    core.stdin.write("step\n")
                    core.stdin.flush()
                    answer = core.stdout.readline()
                except (BrokenPipeError, ValueError):
                    answer = ""
        finally:
            self.server.running -= 1
        if answer.strip() != "done":  # the access line says which engine served a page
            self.send(500, error(500, "EngineCore encountered an issue."))
            return
        self.send(200, completion(self.server.served, PAGE, prompt_tokens=1000,
                                  completion_tokens=60))


def serve(argv: list[str]) -> int:
    """The API server: start the core, wait until it holds its memory, then listen."""
    args = parser().parse_args(argv)
    who = "APIServer"
    log(who, "INFO", "api_server.py:1890", f"vLLM API server version {VERSION}")
    log(who, "INFO", "api_server.py:1891", f"args: {vars(args)}")
    core = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--engine-core", *argv],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert core.stdout is not None
    first = core.stdout.readline()
    if first.strip() != "ready":
        code = core.wait()
        log(who, "ERROR", "api_server.py:1910", f"Engine core initialization failed. See root "
            f"cause above. Failed core proc(s): {{'EngineCore_DP0': {code}}}")
        return 1
    dead = threading.Event()
    exits: list[int] = []

    def reap() -> None:  # the only waiter on the core (Popen.wait holds a lock while waiting)
        exits.append(core.wait())
        dead.set()

    def on_sigterm(*_: Any) -> None:
        # Stop the core (it frees its GPU memory by exiting), then leave, as vLLM does.
        core.terminate()
        if not dead.wait(10):
            core.kill()
        os._exit(0)

    threading.Thread(target=reap, daemon=True).start()
    signal.signal(signal.SIGTERM, on_sigterm)
    server = _Server(("127.0.0.1", args.port), _Handler)
    server.served = args.served_model_name or args.model
    server.max_model_len = args.max_model_len
    server.core = core
    server.lock = threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(who, "INFO", "api_server.py:1971", f"Starting vLLM API server 0 on "
        f"http://127.0.0.1:{args.port}")
    print("INFO:     Application startup complete.", flush=True)
    while not dead.wait(1.0):
        pass
    log(who, "ERROR", "async_llm.py:480", "AsyncLLM output_handler failed.")
    log(who, "ERROR", "serving_chat.py:1173", "vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.")
    log(who, "INFO", "launcher.py:110", f"Engine core proc EngineCore_DP0 died (exit "
        f"{exits[0]}); shutting down the API server.")
    return 1


def main(argv: list[str]) -> int:
    """Dispatch: the flag check, the engine core, or the API server."""
    if argv[:3] == ["-m", "chandrad", "check-flags"]:
        return check_flags()
    if argv[:1] == ["-c"]:  # chandrad asks the engine's interpreter for its vLLM version
        print(f"{VERSION}+gpu-standin")
        return 0
    if argv[:1] == ["--engine-core"]:
        return engine_core(parser().parse_args(argv[1:]))
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
