"""The hybrid model's figures, measured: the tiny Chandra 2 on real ``vllm serve`` (CPU).

    .venv/bin/python bench/chandra2_hybrid.py            # ~6-10 min on 2 shared cores

For each configuration of CONFIGS (prefix caching on / off, two ``max_model_len``) it starts
the OpenAI API server on the tiny Chandra 2 of ``tests/tiny_chandra2.py`` (Qwen3.5: Gated
DeltaNet + full attention) in its own session with ``VLLM_CPU_KVCACHE_SPACE=1``,
``--enforce-eager`` and ``--max-num-seqs 8``, and records, side by side:

1. vLLM's start-up lines about the KV cache and the Mamba (GDN) state (block size, Mamba page
   padding, cache mode, group sizes, KV tokens and concurrency), and the per-sequence figures
   they imply, next to ``chandrad.engine.planner.plan`` for the same flags;
2. where ``throughput`` is on: pages/s at the same concurrency (4) on a few corpus images
   (first frame, scaled to at most MAX_PIXELS), sent with chandrad's own request body
   (``chandrad.ocr.build_chat_request``), once as distinct pages and once again (the repeat
   round is what a prefix cache can serve), with vLLM's prefix-cache counters of ``/metrics``;
3. the prompt's token count as the engine counts it (``usage.prompt_tokens``): Chandra's
   ``ocr_layout`` prompt alone and with each page, against chandrad's estimate
   (``estimate_prompt_tokens``) and the ``max_tokens`` its clamp (``request_max_tokens``)
   sends at the configured ``max_model_len``.

Results: ``bench/results/<date>-chandra2-hybrid.json`` and ``.md`` (``--out`` names the JSON);
paths relative to the repository.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import io
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import _proc
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

RESULTS = REPO / "bench" / "results" / f"{datetime.date.today()}-chandra2-hybrid.json"
START_TIMEOUT_S = 900.0
KV_SPACE_GIB = 1
MAX_NUM_SEQS = 8
CONCURRENCY = 4
MAX_PIXELS = 262_144
MAX_OUTPUT_TOKENS = 64
#: Corpus images (first frame), the pages of the throughput rounds.
IMAGES = ("image_hi-devanagari.png", "image_us-senate-document-1870s.jpg",
          "image_brochure-colour-300dpi_linn.jpg", "image_numeric-table-scan.tif",
          "image_magazine-page_unlv-8087_054.tif", "image_receipt-like-lottery-tickets.tif")
#: (name, prefix caching, max_model_len, throughput rounds)
#: The throughput pairs run twice, alternating (the host's speed drifts over minutes).
CONFIGS: tuple[tuple[str, bool, int, bool], ...] = (
    ("prefix-on-len4096", True, 4096, True),
    ("prefix-off-len4096", False, 4096, True),
    ("prefix-on-len4096-again", True, 4096, True),
    ("prefix-off-len4096-again", False, 4096, True),
    ("prefix-on-len16384", True, 16384, False),
    ("prefix-off-len16384", False, 16384, False),
)
LINES = {
    "kv": re.compile(r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens "
                     r"per request: ([\d.]+)x"),
    "block": re.compile(r"Setting attention block size to (\d+) tokens"),
    "padding": re.compile(r"Padding mamba page size by ([\d.]+)%"),
    "groups": re.compile(r"kv cache group sizes \(?([\d, ]+)\)?"),
    "align": re.compile(r"Mamba cache mode is set to '(\w+)'"),
    "kv_gib": re.compile(r"([\d.]+) GiB for KV cache"),
}
NOTE = re.compile(r"attention block size|mamba page size|Mamba cache mode|kv cache group|"
                  r"KV cache size|GiB for KV cache|prefix cach", re.IGNORECASE)


def model_dir() -> Path:
    import tiny_chandra2

    root = Path(os.environ.get("CHANDRAD_TEST_CACHE", REPO / ".tiny-model"))
    return tiny_chandra2.build_tiny_chandra2(tiny_chandra2.cache_dir(root))


def pages() -> list[tuple[str, bytes, int, int]]:
    """(name, PNG, width, height): each image whole and its top three quarters (two distinct
    pages), scaled down to at most MAX_PIXELS."""
    from PIL import Image

    out = []
    for name in IMAGES:
        with Image.open(REPO / "tests" / "corpus" / "good" / name) as img:
            img.seek(0)
            whole = img.convert("RGB")
        top = whole.crop((0, 0, whole.width, whole.height * 3 // 4))
        for label, page in ((name, whole), (f"{name} (top 3/4)", top)):
            scale = min(1.0, math.sqrt(MAX_PIXELS / (page.width * page.height)))
            page = page.resize((max(32, int(page.width * scale)),
                                max(32, int(page.height * scale))))
            buf = io.BytesIO()
            page.save(buf, format="PNG")
            out.append((label, buf.getvalue(), page.width, page.height))
    return out


def warm_page() -> bytes:
    """A blank page for the one request before the rounds (first-request costs)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (320, 320), "white").save(buf, format="PNG")
    return buf.getvalue()


def body(png: bytes | None, max_tokens: int) -> dict[str, Any]:
    """chandrad's request for one page; ``png=None``: Chandra's prompt alone (no image)."""
    from chandra.prompts import PROMPT_MAPPING

    from chandrad import ocr

    if png is None:
        return {"model": "chandra", "max_tokens": 1, "temperature": 0.0, "messages": [
            {"role": "user", "content": [{"type": "text",
                                          "text": PROMPT_MAPPING["ocr_layout"]}]}]}
    return ocr.build_chat_request(png, model="chandra", prompt_type="ocr_layout",
                                  max_output_tokens=max_tokens, temperature=0.0, top_p=1.0,
                                  fitted=True)


async def _post(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    reply = await client.post(url, json=payload)
    reply.raise_for_status()
    answer: dict[str, Any] = reply.json()
    return answer


async def round_trip(port: int, payloads: list[dict[str, Any]]) -> tuple[float, list[Any]]:
    """Send ``payloads`` CONCURRENCY at a time; seconds and the replies' usage."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(p: dict[str, Any]) -> Any:
            async with gate:
                answer = await _post(client, url, p)
                return {**answer["usage"], "finish_reason": answer["choices"][0]["finish_reason"]}
        t0 = time.monotonic()
        usage = await asyncio.gather(*(one(p) for p in payloads))
        return time.monotonic() - t0, list(usage)


def prefix_counters(port: int) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} ([\d.e+]+)$", text, re.MULTILINE)
        out[name.split(":")[1]] = float(found.group(1)) if found else float("nan")
    return out


def wait_ready(proc: Any, port: int, log: Path) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited {proc.returncode}: "
                               + " | ".join(log.read_text(errors="replace").splitlines()[-5:]))
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError("engine not ready in time")


def measure(name: str, prefix: bool, length: int, throughput: bool, logs: Path,
            model: Path, imgs: list[tuple[str, bytes, int, int]]) -> dict[str, Any]:
    port = _proc.free_port()
    log = logs / f"{name}.log"
    log.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "chandra", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(length), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--enforce-eager", "--mm-processor-cache-gb", "0",
            "--enable-prefix-caching" if prefix else "--no-enable-prefix-caching"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_NO_USAGE_STATS": "1"}
    proc = _proc.start_session(argv, log, env=env)
    row: dict[str, Any] = {"name": name, "prefix_caching": prefix, "max_model_len": length}
    try:
        row["ready_s"] = round(wait_ready(proc, port, log), 1)
        if throughput:
            asyncio.run(round_trip(port, [body(warm_page(), MAX_OUTPUT_TOKENS)]))
            payloads = [body(png, MAX_OUTPUT_TOKENS) for _, png, _, _ in imgs]
            row["loadavg_before"] = [round(x, 2) for x in os.getloadavg()]
            first, usage = asyncio.run(round_trip(port, payloads))
            after_first = prefix_counters(port)
            again, _ = asyncio.run(round_trip(port, payloads))
            row["throughput"] = {
                "pages": len(payloads), "concurrency": CONCURRENCY,
                "distinct_s": round(first, 2),
                "distinct_pages_per_s": round(len(payloads) / first, 3),
                "repeat_s": round(again, 2),
                "repeat_pages_per_s": round(len(payloads) / again, 3),
                "prefix_cache_after_distinct": after_first,
                "prefix_cache_after_repeat": prefix_counters(port)}
            _, alone = asyncio.run(round_trip(port, [body(None, 1)]))
            row["prompt_alone_tokens"] = alone[0]["prompt_tokens"]
            row["pages"] = [{"image": n, "width": w, "height": h, **u}
                            for (n, _, w, h), u in zip(imgs, usage, strict=True)]
    finally:
        row["leftover_pids"] = _proc.stop_session(proc)
    text = log.read_text(errors="replace")
    for key, pattern in LINES.items():
        found = pattern.search(text)
        row[key] = list(found.groups()) if found else None
    row["notes"] = list(dict.fromkeys(line.split("] ", 1)[-1] for line in text.splitlines()
                                      if NOTE.search(line)))
    return row


def planned(model: Path, prefix: bool, length: int) -> dict[str, Any]:
    from chandrad import model_files
    from chandrad.engine import planner

    shape = model_files.planner_shape(str(model))
    assert shape is not None
    bf16 = planner.avx512_bf16(Path("/proc/cpuinfo").read_text())
    budget = planner.Budget("cpu", kv_cache_bytes=KV_SPACE_GIB * planner.GIB,
                            cpu_avx512_bf16=bf16)
    request = planner.Request(max_model_len=length, max_num_seqs=MAX_NUM_SEQS,
                              enable_prefix_caching=prefix)
    return planner.plan(shape, budget, request).as_dict()


def clamp(model: Path, row: dict[str, Any]) -> list[dict[str, Any]]:
    """chandrad's prompt estimate and max_tokens for each measured page."""
    from chandrad import config, model_files, ocr
    from chandrad.engine.profile import estimate_prompt_tokens

    per_token = model_files.pixels_per_image_token(str(model)) or 784
    budget = config.OcrConfig().max_output_tokens
    out = []
    for page in row.get("pages", []):
        estimate = estimate_prompt_tokens(page["width"], page["height"], per_token)
        out.append({"image": page["image"], "prompt_tokens": page["prompt_tokens"],
                    "estimate": estimate, "estimate_covers": estimate >= page["prompt_tokens"],
                    "max_tokens_sent": ocr.request_max_tokens(budget, row["max_model_len"],
                                                              estimate)})
    return out


def table(result: dict[str, Any]) -> str:
    rows = result["rows"]
    out = [f"vLLM {result['vllm']}, tiny Chandra 2, `VLLM_CPU_KVCACHE_SPACE={KV_SPACE_GIB}`, "
           f"`--enforce-eager --max-num-seqs {MAX_NUM_SEQS}`, CPU avx512_bf16 "
           f"{result['cpu_avx512_bf16']}; one run, side by side.", "",
           "| configuration | block size (vLLM / plan) | Mamba page padding | group sizes | "
           "KV tokens (vLLM / plan) | concurrency (vLLM / plan) | state per seq (plan) |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        plan = row["plan"]
        kv = row["kv"] or [None, None, None]
        tokens = int(kv[0].replace(",", "")) if kv[0] else 0
        error = f" ({(plan['kv_cache_tokens'] - tokens) / tokens:+.2%})" if tokens else ""
        block = row["block"][0] if row["block"] else "-"
        padding = f"{row['padding'][0]} %" if row["padding"] else "-"
        groups = row["groups"][0] if row["groups"] else "-"
        blocks = 2 if row["prefix_caching"] else 1
        out.append(f"| {row['name']} | {block} / {plan['block_size']} | {padding} | {groups} | "
                   f"{tokens:,} / {plan['kv_cache_tokens']:,}{error} | "
                   f"{kv[2]} / {plan['max_concurrency']} | "
                   f"{plan['state_bytes_per_seq']:,} B x {blocks} block(s) |")
    out += ["", "| configuration | pages | concurrency | distinct pages/s | repeat pages/s | "
            "prefix-cache hits / queries after distinct, after repeat |",
            "|---|---|---|---|---|---|"]
    for row in rows:
        t = row.get("throughput")
        if not t:
            continue
        a, b = t["prefix_cache_after_distinct"], t["prefix_cache_after_repeat"]
        out.append(f"| {row['name']} | {t['pages']} | {t['concurrency']} | "
                   f"{t['distinct_pages_per_s']} ({t['distinct_s']} s) | "
                   f"{t['repeat_pages_per_s']} ({t['repeat_s']} s) | "
                   f"{a['prefix_cache_hits_total']:.0f} / {a['prefix_cache_queries_total']:.0f}, "
                   f"{b['prefix_cache_hits_total']:.0f} / {b['prefix_cache_queries_total']:.0f} |")
    first = next((r for r in rows if r.get("pages")), None)
    if first:
        out += ["", f"Chandra's `ocr_layout` prompt alone (chat template, no image): "
                f"{first['prompt_alone_tokens']} tokens with the tiny tokenizer.", "",
                "| page | px | prompt tokens (engine) | chandrad's estimate | covers | "
                f"max_tokens sent at max_model_len {first['max_model_len']} |",
                "|---|---|---|---|---|---|"]
        for page, c in zip(first["pages"], first["clamp"], strict=True):
            out.append(f"| {page['image']} | {page['width']}x{page['height']} | "
                       f"{page['prompt_tokens']} | {c['estimate']} | {c['estimate_covers']} | "
                       f"{c['max_tokens_sent']} |")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names to (re)measure")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/chandra2-hybrid-logs"))
    parser.add_argument("--table-only", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON (merged into)")
    args = parser.parse_args()
    out, table_path = args.out, args.out.with_suffix(".md")
    from importlib.metadata import version

    from chandrad.engine import planner

    model = model_dir()
    result: dict[str, Any] = {"rows": []}
    if out.is_file():
        result = json.loads(out.read_text())
    if not args.table_only:
        args.logs.mkdir(parents=True, exist_ok=True)
        imgs = pages()
        by_name = {r["name"]: r for r in result["rows"]}
        for name, prefix, length, throughput in CONFIGS:
            if args.only and name not in args.only:
                continue
            print(f"[chandra2-hybrid] {name} ...", flush=True)
            row = measure(name, prefix, length, throughput, args.logs, model, imgs)
            row["plan"] = planned(model, prefix, length)
            row["clamp"] = clamp(model, row)
            by_name[name] = row
            print(f"[chandra2-hybrid] {name}: {json.dumps(row)[:600]}", flush=True)
            result = {"vllm": version("vllm-cpu"),
                      "cpu_avx512_bf16": planner.avx512_bf16(Path("/proc/cpuinfo").read_text()),
                      "rows": [by_name[c[0]] for c in CONFIGS if c[0] in by_name]}
            out.write_text(json.dumps(_proc.portable(result), indent=2) + "\n")
    table_path.write_text(table(result))
    print(table_path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
