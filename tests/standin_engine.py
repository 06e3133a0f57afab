"""The stand-in engine: vLLM as seen from outside, one process, for every test where the
inference itself is not the point (no vLLM, no GPU here).

It prints vLLM's real log lines, fails the way vLLM fails on a GPU that is too small (the
exact messages of vLLM 0.32, see tests/fixtures/classify/cases.jsonl), and serves
``/health``, ``/v1/models``, ``/metrics`` and ``/v1/chat/completions`` with uvicorn's
access-log line per request. It is started three ways:

* as ``engine.python``, through a wrapper script (:func:`write_standin`):
  ``<wrapper> -m vllm.entrypoints.openai.api_server FLAGS`` is the engine,
  ``<wrapper> -m chandrad check-flags`` the flag-check child (a verdict, a crash, a kill or
  a slow answer), and anything else (``-c CODE``) runs the real interpreter;
* as ``engine.command`` (``[python, THIS]``; chandrad appends its vLLM flags), the scenario
  named by ``$STANDIN_CONTROL`` (the fault suite, ``bench/soak.py``);
* by a test itself, reached through ``engine.url`` (:class:`StandinServer`).

Its behaviour is one JSON scenario (``--standin-scenario FILE`` or ``$STANDIN_CONTROL``),
read once at start, so that a test can change what the *next* generation does:

* ``mode``: ``serve`` (default); ``never_ready`` (prints the loading lines, never listens);
  ``term_crash`` (serves, but dies with SIGSEGV-like exit 139 on SIGTERM, mid-shutdown);
  ``term_ignore`` (serves, ignores SIGTERM: only SIGKILL ends it).
* ``startup_s``: seconds of "loading" before it listens (default 0.5; 0 in a wrapper's).
* ``free_fraction``: the GPU's free share; a larger ``--gpu-memory-utilization`` fails
  with vLLM's ValueError. ``kv_needs_eager``: no room for the KV cache unless
  ``--enforce-eager``. ``kv_late_s``: the same, but as the real CPU engine's log
  (tests/fixtures/vllm_cpu_kv_insufficient.log) reached us on a loaded box: its
  "EngineCore failed to start." line, the traceback ending in the KV-cache ValueError
  ``kv_late_s`` seconds later, and then no exit. ``setsid_grandchild``: leave a child in
  a session of its own. ``mamba_cache_blocks``: N, a hybrid model's pool of Mamba-state
  blocks; a ``--max-num-seqs`` above it (vLLM's default on an H100: 1024) fails with the
  ValueError of vLLM's vllm/config/compilation.py (>= 0.19; 0.17 has no such check), then
  "Engine core initialization failed", exit 1.
* ``check_flags``: the flag check's answers in turn (``ok``, ``bad_flag``,
  ``import_error``, ``killed``, ``sleep:S``; the last repeats).
* ``per_port``: overrides for the replica on that port (replica i listens on port + i).
* ``delay_s``: seconds each page takes (default 0.2; 0 in a wrapper's).
* ``max_running``: requests served at once, the others waiting their turn (a GPU's
  fixed concurrency; default: no limit).
* ``hang_after``: the first N requests answered, the engine core hangs (vllm-project/vllm
  #39863, #7633): every later request is accepted and never answered while ``/health``
  still says 200;
  ``/metrics`` shows them waiting, none running, the token counters stand still, and
  vLLM's stats line says "Running: 0 reqs, Waiting: N reqs" every 10 s.
* ``exit_after``: N answered, the API server shuts down as vLLM's does when its core died
  (vllm-project/vllm#48966): uvicorn's shutdown lines, then exit status 0.
* ``generations``: a list of overrides, one per spawn in turn (the last repeats), merged
  into the scenario of that spawn: ``[{"hang_after": 2}, {}]`` hangs once, then serves.
* ``max_model_len``: reported by ``/v1/models``; a ``max_tokens`` that does not fit after
  the prompt is answered with vLLM 0.11-0.17's 400 (MinerU#4868).
  ``prompt_text_tokens``: the prompt's text tokens, plus one per 32x32 px of the page.
* ``replies`` and ``default`` (re-read at every request, so a test may change them while
  the engine runs): how a page is answered, by the first key that matches the page image:
  ``width:W``, ``colour:R,G,B`` (its centre pixel) or ``sha256:HEX``; a reply, or a list
  answered in turn (the last repeats). A reply: ``status`` (200), ``delay_s``, ``content``
  (``{n}``: the count of earlier answers to that key), ``finish_reason`` ("stop"), ``raw``
  (a body that is not a chat completion), ``message`` (an error's), ``prompt_tokens``,
  ``until`` (a path: the answer waits until it exists, 120 s at most). The default
  content names the page image's sha256, so a test can tell pages apart.
* ``page_id``: ``"png"`` (default): a page's ``sha256`` is its PNG's bytes'; ``"pixels"``:
  its decoded pixels' (mode, size, rows), the page as a real engine sees it — the same
  pixels may come in other PNG bytes (``chandrad.png``'s deflate now and then picks other
  valid matches on a busy machine), which a test comparing two runs' outputs must not see.
* ``record_messages``: keep the messages (the page image) in the ``chat`` events too.
* ``gate``: N > 0 holds every request until N are held at once (at most ``gate_s``,
  default 120 s), then answers them and all later ones as usual: the engine is the
  bottleneck whatever the client's speed (in flight >= ``max_num_seqs``).

What happened is appended to ``events.jsonl`` beside the scenario (``spawn``,
``check_flags``, ``chat`` at each request's arrival, ``grandchild``) and, when it listens,
the port to ``port``; each completed page appends ``<unix time> <sha256> <pid>`` to
``$STANDIN_LOG``. The GPU stand-in (gpu_standin_engine.py) shares its log lines and HTTP
side.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import io
import json
import math
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
VERSION = "0.32.0"
TOTAL_GIB = 79.19
#: vLLM's max_num_seqs for the OpenAI server on a GPU of >= 70 GiB that is not an A100
#: (engine/arg_utils.py); the stand-in's GPU is an H100 (TOTAL_GIB).
MAX_NUM_SEQS = 1024
THIS = Path(__file__).resolve()
#: vLLM 0.32's CPU engine failing for want of KV cache (estimated maximum model length 768).
KV_LOG = THIS.parent / "fixtures" / "vllm_cpu_kv_insufficient.log"
#: What a wrapper's engine does unless its scenario says otherwise: start and answer at
#: once (the supervision tests count restarts, not seconds).
WRAPPER_DEFAULTS = {"startup_s": 0.0, "delay_s": 0.0}


# ------------------------------------------------------------------ test side
def write_standin(folder: Path, scenario: dict[str, Any]) -> Path:
    """Write the scenario and an executable wrapper (``engine.python``) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "scenario.json"
    path.write_text(json.dumps({**WRAPPER_DEFAULTS, **scenario}))
    wrapper = folder / "python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {THIS} --standin-scenario {path} "
                       "\"$@\"\n")
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper


def events(folder: Path) -> list[dict[str, Any]]:
    """What the stand-in recorded so far in ``folder``, oldest first."""
    path = folder / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class StandinServer:
    """A stand-in engine process the test runs itself and names as ``engine.url``; under
    ``prefix`` (``ip netns exec NAME``: on a host of its own network)."""

    def __init__(self, folder: Path, scenario: dict[str, Any] | None = None, *,
                 served: str = "chandra", prefix: Sequence[str] = ()) -> None:
        self.folder = folder
        self.prefix = list(prefix)
        self.served = served
        self.scenario: dict[str, Any] = {**WRAPPER_DEFAULTS, **(scenario or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def update(self, **scenario: Any) -> None:
        """Change the scenario (``replies`` and ``default`` apply to the next request)."""
        self.scenario.update(scenario)
        tmp = self.folder / "scenario.json.tmp"
        tmp.write_text(json.dumps(self.scenario))
        tmp.replace(self.folder / "scenario.json")

    def start(self) -> StandinServer:
        from waiting import exited, wait_until

        self.folder.mkdir(parents=True, exist_ok=True)
        self.update()
        with (self.folder / "engine.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, str(THIS), "--standin-scenario",
                 str(self.folder / "scenario.json"), "--port", "0",
                 "--served-model-name", self.served],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = self.folder / "port"
        wait_until(lambda: port_file.exists() and port_file.read_text().strip(), 60,
                   "the stand-in engine listens", every=0.05, gone=exited(self.proc),
                   context=lambda: (self.folder / "engine.log").read_text())
        self.port = int(port_file.read_text())
        return self

    def chats(self) -> list[dict[str, Any]]:
        """The chat requests so far, at their arrival, oldest first."""
        return [e for e in events(self.folder) if e["what"] == "chat"]

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None


@contextlib.contextmanager
def standin_server(folder: Path, scenario: dict[str, Any] | None = None, *,
                   served: str = "chandra") -> Iterator[StandinServer]:
    """:class:`StandinServer`, started, and stopped afterwards."""
    server = StandinServer(folder, scenario, served=served)
    try:
        yield server.start()
    finally:
        server.stop()


# ------------------------------------------------------------------ vLLM's lines and replies
def log(who: str, level: str, where: str, text: str, stream: Any = None) -> None:
    """One line as vLLM prints it: ``(WHO pid=N) LEVEL mm-dd HH:MM:SS [file:line] text``
    (uvicorn's lines, ``where`` empty: ``(WHO pid=N) LEVEL:     text``)."""
    stamp = time.strftime("%m-%d %H:%M:%S")
    line = (f"({who} pid={os.getpid()}) {level} {stamp} [{where}] {text}" if where
            else f"({who} pid={os.getpid()}) {level}:     {text}")
    print(line, file=stream or sys.stdout, flush=True)


def completion(model: str, content: str, *, finish_reason: str = "stop",
               prompt_tokens: int = 1, completion_tokens: int = 1) -> dict[str, Any]:
    """A chat completion as vLLM's OpenAI server answers it."""
    return {"id": f"chatcmpl-{time.monotonic_ns()}", "object": "chat.completion",
            "model": model,
            "choices": [{"index": 0, "finish_reason": finish_reason,
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def error(status: int, message: str) -> dict[str, Any]:
    """vLLM's error body."""
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    return {"object": "error", "type": kind, "code": status, "message": message}


class EngineServer(ThreadingHTTPServer):
    """vLLM's API server as chandrad probes it: the served name, the length, the load."""

    daemon_threads = True
    served = "chandra"
    max_model_len: int | None = None
    running = 0
    waiting = 0  #: requests a hung core holds
    prompt_tokens = 0  #: vLLM's counters, as the requests answered add to them
    generation_tokens = 0


class EngineHandler(BaseHTTPRequestHandler):
    """``/health``, ``/v1/models`` and ``/metrics``, with uvicorn's access-log line;
    a subclass answers ``POST /v1/chat/completions``."""

    server: EngineServer
    server_version = "uvicorn"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib name
        del format, args

    def send(self, code: int, body: dict[str, Any] | bytes,
             ctype: str = "application/json") -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the client gave up (a timeout, a cancel)
            self.wfile.write(data)
        log("APIServer", "INFO", "", f'{self.client_address[0]}:{self.client_address[1]} - '
            f'"{self.command} {self.path} HTTP/1.1" {code}')

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        served = self.server.served
        if self.path == "/health":
            self.send(200, b"", "text/plain")
        elif self.path == "/v1/models":
            model: dict[str, Any] = {"id": served, "object": "model"}
            if self.server.max_model_len is not None:
                model["max_model_len"] = self.server.max_model_len
            self.send(200, {"object": "list", "data": [model]})
        elif self.path == "/metrics":
            label = f'{{model_name="{served}"}}'
            self.send(200, (f'vllm:num_requests_running{label} {self.server.running}.0\n'
                            f'vllm:num_requests_waiting{label} {self.server.waiting}.0\n'
                            f'vllm:prompt_tokens_total{label} {self.server.prompt_tokens}.0\n'
                            f'vllm:generation_tokens_total{label} '
                            f'{self.server.generation_tokens}.0\n').encode(), "text/plain")
        else:
            self.send(404, {"detail": "Not Found"})


# ------------------------------------------------------------------ the CPU stand-in
class _Engine(EngineServer):
    scenario_path: Path | None
    folder: Path | None
    delay_s: float
    prompt_text_tokens: int | None
    lock: threading.Lock
    answered: dict[str, int]
    gate_open: threading.Event
    #: ``max_running``: requests served at once (a GPU's batch); the rest wait their turn.
    slots: threading.Semaphore | None
    completed: int
    arrived: int
    hang_after: int | None
    exit_after: int | None


def _read(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _record(folder: Path | None, **event: Any) -> None:
    if folder is None:
        return
    fd = os.open(folder / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())
    finally:
        os.close(fd)


def _page(body: dict[str, Any], colour: bool, pixels: bool = False) -> dict[str, Any]:
    """The page image of a chat request: its sha256 (of its PNG bytes, or with ``pixels``
    of its decoded pixels), size and (if asked) centre colour."""
    from PIL import Image

    for message in body.get("messages", []):
        for part in message.get("content") or []:
            if isinstance(part, dict) and part.get("type") == "image_url":
                data = base64.b64decode(part["image_url"]["url"].split(",", 1)[1])
                page: dict[str, Any] = {"sha256": hashlib.sha256(data).hexdigest(),
                                        "colour": []}
                with Image.open(io.BytesIO(data)) as image:  # reads the header only
                    page["width"], page["height"] = image.size
                    if pixels:  # decodes the image: only for a scenario that asks
                        page["sha256"] = hashlib.sha256(
                            f"{image.mode} {image.size}\n".encode() + image.tobytes()
                        ).hexdigest()
                    if colour:  # decodes the image: only for a scenario that needs it
                        rgb = image.convert("RGB").getpixel((image.width // 2,
                                                             image.height // 2))
                        assert isinstance(rgb, tuple)
                        page["colour"] = [int(c) for c in rgb[:3]]
                return page
    return {"sha256": "", "width": 0, "height": 0, "colour": []}


def _keys(page: dict[str, Any]) -> list[str]:
    """The scenario keys that name this page, in the order they are tried."""
    return [f"width:{page['width']}", f"colour:{','.join(map(str, page['colour']))}",
            f"sha256:{page['sha256']}"]


class _ChatHandler(EngineHandler):
    server: _Engine

    def _reply(self, scenario: dict[str, Any], page: dict[str, Any]) -> dict[str, Any]:
        """The scenario's next reply to this page (the last one repeats)."""
        replies: dict[str, Any] = scenario.get("replies", {})
        key = next((k for k in _keys(page) if k in replies), "default")
        script = replies[key] if key in replies else scenario.get("default", {})
        script = script if isinstance(script, list) else [script]
        with self.server.lock:
            n = self.server.answered.get(key, 0)
            self.server.answered[key] = n + 1
        reply: dict[str, Any] = dict(script[min(n, len(script) - 1)]) if script else {}
        reply["n"] = n
        return reply

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if self.path != "/v1/chat/completions":
            self.send(404, {"detail": "Not Found"})
            return
        with self.server.lock:
            self.server.running += 1
            running = self.server.running
        try:
            scenario = _read(self.server.scenario_path)  # replies may change while it runs
            named = [*scenario.get("replies", {}), *scenario.get("prompt_tokens", {})]
            page = _page(body, colour=any(k.startswith("colour:") for k in named),
                         pixels=scenario.get("page_id") == "pixels")
            prompt = 1
            if self.server.prompt_text_tokens is not None:
                prompt = (self.server.prompt_text_tokens + math.ceil(page["width"] / 32)
                          * math.ceil(page["height"] / 32))
            measured: dict[str, int] = scenario.get("prompt_tokens", {})
            prompt = next((int(measured[k]) for k in _keys(page) if k in measured), prompt)
            _record(self.server.folder, what="chat", t=time.monotonic(), pid=os.getpid(),
                    running=running, prompt_tokens=prompt,
                    body={k: v for k, v in body.items()
                          if k != "messages" or scenario.get("record_messages")}, **page)
            limit, max_tokens = self.server.max_model_len, body.get("max_tokens")
            if limit is not None and max_tokens is not None and max_tokens + prompt > limit:
                # vLLM 0.11-0.17's answer (serving_chat.py), as MinerU#4868 quotes it.
                self.send(400, error(400, "'max_tokens' or 'max_completion_tokens' is too "
                                     f"large: {max_tokens}. This model's maximum context "
                                     f"length is {limit} tokens and your request has {prompt} "
                                     f"input tokens ({max_tokens} > {limit} - {prompt})."))
                return
            with self.server.lock:
                self.server.arrived += 1
                hangs = (self.server.hang_after is not None
                         and self.server.arrived > self.server.hang_after)
                if hangs:
                    self.server.running -= 1
                    self.server.waiting += 1
            if hangs:
                while True:  # a hung core: accepted, never answered
                    time.sleep(3600)
            gate = int(scenario.get("gate", 0))
            if gate:  # one-shot: hold requests until this many are held at once
                if running >= gate:
                    self.server.gate_open.set()
                self.server.gate_open.wait(float(scenario.get("gate_s", 120)))
            # Read again: a test that changed the replies after it saw this request's
            # ``chat`` event expects this request to be answered the new way.
            reply = self._reply(_read(self.server.scenario_path), page)
            if self.server.slots is None:
                time.sleep(float(reply.get("delay_s", self.server.delay_s)))
            else:
                with self.server.slots:
                    time.sleep(float(reply.get("delay_s", self.server.delay_s)))
            held_until = time.monotonic() + 120
            while "until" in reply and not Path(reply["until"]).exists() \
                    and time.monotonic() < held_until:
                time.sleep(0.05)
        finally:
            with self.server.lock:
                self.server.running -= 1
        self._answer(page, reply, prompt)

    def _answer(self, page: dict[str, Any], reply: dict[str, Any], prompt: int) -> None:
        status = int(reply.get("status", 200))
        if status != 200:
            self.send(status, error(status, str(reply.get("message", "stand-in failure"))))
            return
        if "raw" in reply:
            self.send(200, str(reply["raw"]).encode())
            return
        content = str(reply.get("content", '<div data-bbox="10 10 500 60" data-label="Text">'
                                f'<p>stand-in page {page["sha256"][:16]}</p></div>'))
        with self.server.lock:
            self.server.prompt_tokens += prompt
            self.server.generation_tokens += 10
        self.send(200, completion(self.server.served, content.replace("{n}", str(reply["n"])),
                                  finish_reason=str(reply.get("finish_reason", "stop")),
                                  prompt_tokens=prompt, completion_tokens=10))
        with self.server.lock:
            self.server.completed += 1
            done = self.server.completed
        if self.server.exit_after is not None and done == self.server.exit_after:
            threading.Thread(target=_core_died_quietly, daemon=True).start()
        path = os.environ.get("STANDIN_LOG")
        if path:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, f"{time.time():.3f} {page['sha256']} {os.getpid()}\n".encode())
            finally:
                os.close(fd)


def _next_behaviour(folder: Path, name: str, plan: list[str]) -> str:
    """The next entry of ``plan`` (the last one repeats), counted in a file."""
    counter = folder / f"{name}.count"
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    return plan[min(n, len(plan) - 1)] if plan else "ok"


def check_flags(folder: Path, scenario: dict[str, Any]) -> int:
    """``-m chandrad check-flags``: read the flags (JSON list), answer as scripted."""
    flags = json.loads(sys.stdin.read())
    behaviour = _next_behaviour(folder, "check_flags", scenario.get("check_flags", ["ok"]))
    _record(folder, what="check_flags", behaviour=behaviour, pid=os.getpid())
    if behaviour.startswith("sleep:"):
        time.sleep(float(behaviour.split(":", 1)[1]))
        behaviour = "ok"
    if behaviour == "ok":
        print("[]")
        return 0
    if behaviour == "bad_flag":
        bad = next((f for f in flags if f.startswith("--no-such")), flags[-1])
        print(json.dumps([{"key": "engine.extra_args", "code": "engine_flag_invalid",
                           "message": f"{bad} is not an option of the installed vLLM "
                           f"{VERSION}"}]))
        return 0
    if behaviour == "import_error":
        print("Traceback (most recent call last):\n  File \"<frozen runpy>\", line 198\n"
              "ModuleNotFoundError: No module named 'vllm'", file=sys.stderr)
        return 1
    if behaviour == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SystemExit(f"unknown check_flags behaviour {behaviour!r}")


def _flags(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="standin_engine", allow_abbrev=False)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="")
    p.add_argument("--served-model-name", default="chandra")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    return p.parse_known_args(argv)[0]


def _kv_late(pause_s: float) -> None:
    """vLLM's real KV-cache failure, its first ERROR line ``pause_s`` before the rest;
    then the process hangs on (only a signal ends it)."""
    lines = KV_LOG.read_text().splitlines()
    first = next(i for i, ln in enumerate(lines) if ln.endswith("EngineCore failed to start."))
    last = next(i for i, ln in enumerate(lines) if i > first and "ValueError: To serve" in ln)
    print(lines[first], file=sys.stderr, flush=True)
    time.sleep(pause_s)
    for line in lines[first + 1:last + 1]:
        print(line, file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


def _core_died_quietly() -> None:
    """vLLM's API server after its EngineCore died (#48966): a normal shutdown, status 0."""
    time.sleep(0.2)  # the last answer leaves first
    for line in ("Shutting down", "Waiting for application shutdown.",
                 "Application shutdown complete.", f"Finished server process [{os.getpid()}]"):
        log("APIServer", "INFO", "", line)
    os._exit(0)


def _stats_lines(server: EngineServer) -> None:
    """vLLM's periodic stats line (loggers.py), every 10 s, as a hung core leaves it."""
    while True:
        time.sleep(10)
        log("APIServer", "INFO", "loggers.py:123", "Engine 000: Avg prompt throughput: 0.0 "
            "tokens/s, Avg generation throughput: 0.0 tokens/s, Running: "
            f"{server.running} reqs, Waiting: {server.waiting} reqs, GPU KV cache usage: "
            "0.0%, Prefix cache hit rate: 0.0%")


def _mamba_refused(seqs: int, blocks: int) -> None:
    """vLLM's refusal of more sequences than Mamba-state blocks, as a single-GPU engine
    prints it: EngineCore's exception log, then the API server's RuntimeError."""
    core = "core.py:1510"
    log("EngineCore_DP0", "ERROR", core, "EngineCore failed to start.")
    log("EngineCore_DP0", "ERROR", core, "Traceback (most recent call last):")
    log("EngineCore_DP0", "ERROR", core, '  File "/usr/local/lib/python3.12/dist-packages/'
        'vllm/config/compilation.py", line 1518, in resolve_cudagraph_mode_and_sizes')
    log("EngineCore_DP0", "ERROR", core, "    raise ValueError(")
    log("EngineCore_DP0", "ERROR", core, f"ValueError: max_num_seqs ({seqs}) exceeds "
        f"available Mamba cache blocks ({blocks}). Each decode sequence requires one Mamba "
        "cache block, so CUDA graph capture cannot proceed. Please lower max_num_seqs to at "
        f"most {blocks} or increase gpu_memory_utilization.")
    print("Traceback (most recent call last):", file=sys.stderr, flush=True)
    print('  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/utils.py", line '
          "1431, in wait_for_engine_startup\n    raise RuntimeError(", file=sys.stderr,
          flush=True)
    print("RuntimeError: Engine core initialization failed. See root cause above. Failed "
          "core proc(s): {}", file=sys.stderr, flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def serve(scenario_path: Path | None, argv: list[str]) -> int:
    """The API server: vLLM's start-up lines, its start-up failures, then the endpoints."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # stopped while loading
    args = _flags(argv)
    folder = scenario_path.parent if scenario_path is not None else None
    scenario = _read(scenario_path)
    # One scenario for several replicas: "per_port" overrides what the engine on that port
    # does (replica i listens on engine.port + i).
    scenario = {**scenario, **scenario.get("per_port", {}).get(str(args.port), {})}
    plan = scenario.get("generations")
    if plan and folder is not None:
        counter = folder / "generation.count"
        n = int(counter.read_text()) if counter.exists() else 0
        counter.write_text(str(n + 1))
        scenario = {**scenario, **plan[min(n, len(plan) - 1)]}
    mode = str(scenario.get("mode", "serve"))
    util, eager = args.gpu_memory_utilization, args.enforce_eager
    _record(folder, what="spawn", pid=os.getpid(), util=util, eager=eager, argv=argv,
            sid=os.getsid(0), t=time.monotonic(), port=args.port,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            cpus=sorted(os.sched_getaffinity(0)))
    who = "APIServer"
    log(who, "INFO", "api_server.py:1890", f"vLLM API server version {VERSION}")
    log(who, "INFO", "api_utils.py:286", f"non-default args: {{'port': {args.port}, "
        f"'model': '{args.model}', 'served_model_name': ['{args.served_model_name}']}}")
    if scenario.get("setsid_grandchild"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session=True)
        _record(folder, what="grandchild", pid=child.pid)
    free = scenario.get("free_fraction")
    if free is not None and util > float(free):
        free_gib = round(float(free) * TOTAL_GIB, 2)
        log("EngineCore_DP0", "ERROR", "core.py:708", f"ValueError: Free memory on device "
            f"cuda:0 ({free_gib:.2f}/{TOTAL_GIB} GiB) on startup is less than the engine's "
            f"budget after excluding external process's weights ({util}, "
            f"{util * TOTAL_GIB:.2f} GiB). Decrease GPU memory utilization or reduce GPU "
            "memory used by other processes.")
        return 1
    if scenario.get("kv_needs_eager") and not eager:
        log("EngineCore_DP0", "ERROR", "core.py:708", "ValueError: No available memory for "
            "the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
            "engine (this flag also controls CPU memory reservation on the CPU backend, "
            "despite its name). See https://docs.vllm.ai/en/latest/configuration/"
            "conserving_memory/ for more details.")
        log("EngineCore_DP0", "ERROR", "core.py:708", "EngineCore failed to start.")
        return 1
    if scenario.get("kv_late_s") is not None and not eager:
        _kv_late(float(scenario["kv_late_s"]))
    blocks = scenario.get("mamba_cache_blocks")
    if blocks is not None and args.max_num_seqs > int(blocks):
        _mamba_refused(args.max_num_seqs, int(blocks))
        return 1
    log(who, "INFO", "model.py:733", "Resolved architecture: Idefics3ForConditionalGeneration")
    time.sleep(float(scenario.get("startup_s", 0.5)))
    if mode == "never_ready":
        log(who, "INFO", "default_loader.py:291", "Loading weights took 0.02 seconds")
        while True:  # a load that never finishes: only startup_timeout ends it
            time.sleep(3600)
    try:
        server = _Engine((args.host, args.port), _ChatHandler)
    except OSError as exc:
        log(who, "ERROR", "api_server.py:1890", f"OSError: [Errno {exc.errno}] {exc.strerror}")
        return 1
    server.served = args.served_model_name
    server.scenario_path, server.folder = scenario_path, folder
    server.delay_s = float(scenario.get("delay_s", 0.2))
    server.max_model_len = scenario.get("max_model_len")
    server.prompt_text_tokens = scenario.get("prompt_text_tokens")
    server.lock, server.answered = threading.Lock(), {}
    server.gate_open = threading.Event()
    slots = scenario.get("max_running")
    server.slots = threading.Semaphore(int(slots)) if slots else None
    server.completed = server.arrived = 0
    server.hang_after = scenario.get("hang_after")
    server.exit_after = scenario.get("exit_after")
    if server.hang_after is not None:
        threading.Thread(target=_stats_lines, args=(server,), daemon=True).start()
    port = server.server_address[1]
    log(who, "INFO", "api_server.py:1890", f"Starting vLLM API server 0 on "
        f"http://{args.host}:{port}")
    print(f"INFO:     Started server process [{os.getpid()}]", flush=True)
    print("INFO:     Waiting for application startup.", flush=True)
    print("INFO:     Application startup complete.", flush=True)
    if folder is not None:
        (folder / "port.tmp").write_text(str(port))
        (folder / "port.tmp").replace(folder / "port")
    if mode == "term_crash":
        def crash(signum: int, frame: Any) -> None:
            print("Fatal Python error: Segmentation fault", file=sys.stderr, flush=True)
            os._exit(139)
        signal.signal(signal.SIGTERM, crash)
    elif mode == "term_ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        print("INFO:     Shutting down", flush=True)
    server.server_close()
    return 0


def main(argv: list[str]) -> int:
    """Dispatch: the flag check, the API server, or the real interpreter."""
    scenario_path: Path | None = None
    if argv[:1] == ["--standin-scenario"]:
        scenario_path, argv = Path(argv[1]), argv[2:]
    elif os.environ.get("STANDIN_CONTROL"):
        scenario_path = Path(os.environ["STANDIN_CONTROL"])
    if argv[:3] == ["-m", "chandrad", "check-flags"]:
        assert scenario_path is not None, "the flag check needs a scenario"
        return check_flags(scenario_path.parent, _read(scenario_path))
    if argv[:2] == ["-m", API_SERVER_MODULE]:
        return serve(scenario_path, argv[2:])
    if argv[:1] in (["-c"], ["-m"]):
        os.execv(sys.executable, [sys.executable, *argv])
    return serve(scenario_path, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
