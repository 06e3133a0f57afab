"""Requests in flight at the engine, seen from both sides.

vLLM 0.32's OpenAI server holds a chat request in three places before it is answered,
and only the last is in its scheduler's gauges:

1. the API server's HTTP layer: the body is read and parsed (uvicorn, pydantic);
2. the API server's renderer: the image is decoded (``MediaConnector``, a thread pool)
   and the multimodal processor runs (``BaseRenderer._mm_executor``, **one** thread),
   then ``AsyncLLM.add_request`` sends it to the engine core;
3. the engine core's scheduler: ``waiting`` then ``running``
   (``vllm:num_requests_waiting`` / ``_running``).

Nothing in its ``/metrics`` counts 1 + 2 as a gauge (prometheus-fastapi-instrumentator
runs without its in-progress gauge). Started with ``--enable-server-load-tracking``, the
server counts every chat request from its handler's start to its response at ``GET
/load`` (``server_load``): the engine's own figure for requests in flight. Its
histograms give the same by Little's law: ``http_request_duration_seconds`` (the whole
time in the API server) and ``vllm:e2e_request_latency_seconds`` (from
``AsyncLLM.add_request``, after the preprocessing) per request.

:class:`Sampler` reads ``/load``, the scheduler's gauges and (optionally) chandrad's
``status`` (requests in flight, rendered pages waiting) every ``every`` seconds in a
thread; :func:`summary` weights each sample by the time to the next one.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from chandrad.engine.client import SCHEDULER_SERIES, parse_metrics

CHAT = "/v1/chat/completions"
_SERIES = re.compile(r'^([a-zA-Z0-9_:]+)(\{[^}]*\})?\s+([0-9.eE+\-]+)$')


@dataclass(frozen=True)
class Sample:
    t: float  #: monotonic
    http: float | None  #: the engine's ``/load``: chat requests in its API server
    scheduler: float | None  #: its scheduler's running + waiting
    chandrad: int | None = None  #: chandrad's requests in flight (its ``status``)
    waiting: int | None = None  #: chandrad's rendered pages waiting for a request slot


def engine_sample(client: httpx.Client) -> tuple[float | None, float | None]:
    """(``/load``, scheduler running + waiting) of the engine, None where unreadable."""
    http: float | None = None
    scheduler: float | None = None
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        reply = client.get("/load")
        if reply.status_code == 200:
            http = float(reply.json()["server_load"])
    with contextlib.suppress(httpx.HTTPError):
        # The series by name, as the supervisor reads them: a prefix also matched
        # ``vllm:num_requests_waiting_by_reason``, counting the waiting twice.
        scheduler = sum(parse_metrics(client.get("/metrics").text, SCHEDULER_SERIES).values())
    return http, scheduler


def histograms(client: httpx.Client) -> dict[str, float]:
    """Sums and counts of the per-request histograms that split the engine's time:
    ``http`` (the API server, body read to response), ``core`` (``AsyncLLM`` to the end:
    after the preprocessing), ``queue`` (the scheduler's waiting queue)."""
    wanted = {
        "http_request_duration_seconds": "http",
        "vllm:e2e_request_latency_seconds": "core",
        "vllm:request_queue_time_seconds": "queue",
    }
    out: dict[str, float] = {}
    try:
        text = client.get("/metrics").text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        match = _SERIES.match(line.strip())
        if not match:
            continue
        name, labels, value = match.groups()
        for base, key in wanted.items():
            for suffix in ("_sum", "_count"):
                if name == base + suffix and (key != "http" or f'handler="{CHAT}"' in
                                              (labels or "")):
                    out[key + suffix] = out.get(key + suffix, 0.0) + float(value)
    return out


def little(before: dict[str, float], after: dict[str, float],
           seconds: float) -> dict[str, Any]:
    """Mean seconds per request in each part of the engine between two
    :func:`histograms` readings, and the mean requests there (Little's law: requests per
    second × seconds each)."""
    out: dict[str, Any] = {}
    for key in ("http", "core", "queue"):
        n = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        s = after.get(f"{key}_sum", 0.0) - before.get(f"{key}_sum", 0.0)
        if n > 0 and seconds > 0:
            out[f"{key}_s_per_request"] = round(s / n, 3)
            out[f"{key}_mean_requests"] = round(s / seconds, 1)
    if "http_s_per_request" in out and "core_s_per_request" in out:
        out["api_server_s_per_request"] = round(
            out["http_s_per_request"] - out["core_s_per_request"], 3)
    return out


class Sampler:
    """Samples the engine (and chandrad's ``status`` when given) in a thread."""

    def __init__(self, base: str, every: float = 0.25,
                 status: Callable[[], dict[str, Any] | None] | None = None) -> None:
        self.base = base
        self.every = every
        self.status = status
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inflight-sampler",
                                        daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=5) as client:
            while not self._stop.is_set():
                t = time.monotonic()
                http, scheduler = engine_sample(client)
                chandrad = waiting = None
                if self.status is not None:
                    throughput = (self.status() or {}).get("throughput") or {}
                    chandrad = throughput.get("requests_in_flight")
                    waiting = throughput.get("pages_waiting")
                self.samples.append(Sample(t, http, scheduler, chandrad, waiting))
                self._stop.wait(max(0.0, self.every - (time.monotonic() - t)))


def _weights(samples: list[Sample], every: float) -> list[float]:
    """Each sample stands for the time to the next one (at most twice the period)."""
    out = [min(b.t - a.t, 2 * every) for a, b in zip(samples, samples[1:], strict=False)]
    return [*out, every] if samples else []


def _mean(pairs: list[tuple[float, float]]) -> float | None:
    total = sum(w for _, w in pairs)
    return round(sum(v * w for v, w in pairs) / total, 1) if total > 0 else None


def _share(pairs: list[tuple[bool, float]]) -> float | None:
    total = sum(w for _, w in pairs)
    return round(sum(w for ok, w in pairs if ok) / total, 3) if total > 0 else None


def summary(samples: list[Sample], seqs: int, every: float) -> dict[str, Any]:
    """Time-weighted figures: the engine's two counts (mean, max, share of the time at
    ``seqs`` or more) and, with chandrad's, its requests in flight while rendered pages
    waited (the share of that time with ``seqs`` or more: the bench's target)."""
    weights = _weights(samples, every)
    rows = list(zip(samples, weights, strict=True))
    out: dict[str, Any] = {"samples": len(samples), "every_s": every, "seqs": seqs}
    for name in ("http", "scheduler", "chandrad"):
        pairs = [(float(getattr(s, name)), w) for s, w in rows if getattr(s, name) is not None]
        if not pairs:
            continue
        out[f"{name}_mean"] = _mean(pairs)
        out[f"{name}_max"] = max(v for v, _ in pairs)
        out[f"{name}_at_seqs_share"] = _share([(v >= seqs, w) for v, w in pairs])
    waited = [(s, w) for s, w in rows if s.waiting]
    if any(s.waiting is not None for s in samples):
        out["pages_waiting_s"] = round(sum(w for _, w in waited), 2)
        out["pages_waiting_max"] = max((s.waiting or 0 for s in samples), default=0)
        out["chandrad_at_seqs_while_waiting"] = _share(
            [((s.chandrad or 0) >= seqs, w) for s, w in waited])
        out["http_at_seqs_while_waiting"] = _share(
            [((s.http or 0) >= seqs, w) for s, w in waited if s.http is not None])
        out["chandrad_mean_while_waiting"] = _mean(
            [(float(s.chandrad or 0), w) for s, w in waited])
        out["http_mean_while_waiting"] = _mean(
            [(s.http, w) for s, w in waited if s.http is not None])
    return out
