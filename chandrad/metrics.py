"""Prometheus metrics: ``/metrics`` on ``[metrics] listen`` (adapter: one HTTP listener).

Pull model: a custom collector reads the daemon's state (store counts, engine state and
profile, watcher health) at scrape time, through the small read-only protocols below, so
no service keeps a second copy of a fact. Only what exists as events is counted as it
happens, through :class:`Metrics` as the ``interfaces.Observer`` the pipeline and the
engine supervisor call: page outcomes and latencies, engine failures by class, profile
changes by reason. Labels are bounded sets (states, failure classes, engine and watch
indexes), never a file name. vLLM's own ``/metrics`` is not re-exported: scrape the engine
port beside this one (docs/operations.md).

The listener is an asyncio server on the daemon's loop, so a scrape reads SQLite and the
supervisor on the same thread as every other reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from chandrad.engine.classify import FailureClass
from chandrad.errors import StoreUnreachable
from chandrad.states import DaemonState, EngineState, JobState, PageState

log = structlog.get_logger("chandrad.metrics")

#: The classic text format, which every Prometheus 2.x and agent reads (prometheus_client's
#: "latest" names 1.0.0, which older scrapers do not know).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: Seconds; render is CPU work (ms to seconds), inference and the whole page are GPU
#: queueing plus decode (seconds to minutes on a loaded engine).
RENDER_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
INFERENCE_BUCKETS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
PAGE_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200)

#: Profile knobs exported as gauges: (profile key, metric suffix, factor to base units).
PROFILE_GAUGES: tuple[tuple[str, str, float], ...] = (
    ("gpu_memory_utilization", "gpu_memory_utilization_ratio", 1.0),
    ("max_num_seqs", "max_num_seqs", 1.0),
    ("max_num_batched_tokens", "max_num_batched_tokens", 1.0),
    ("max_model_len", "max_model_len_tokens", 1.0),
    ("block_size", "block_size_tokens", 1.0),
    ("kv_cache_memory_bytes", "kv_cache_memory_bytes", 1.0),
    ("cpu_offload_gb", "cpu_offload_bytes", 2.0**30),
    ("mm_processor_cache_gb", "mm_processor_cache_bytes", 2.0**30),
    ("max_pixels", "max_pixels", 1.0),
    ("max_output_tokens", "max_output_tokens", 1.0),
    ("enforce_eager", "enforce_eager", 1.0),
    ("expandable_segments", "expandable_segments", 1.0),
)
PROFILE_SOURCES = ("config", "learned", "tuned", "downshift", "upshift")


# ------------------------------------------------------------------ what a scrape reads

class ClusterView(Protocol):
    """The shared queue's hosts and leases (``store.records.ClusterCounts``)."""

    @property
    def hosts(self) -> Mapping[str, int]: ...

    @property
    def jobs(self) -> Mapping[tuple[str, str], int]: ...

    @property
    def leases_expired(self) -> int: ...

    @property
    def takeovers(self) -> int: ...

    @property
    def pages_helped(self) -> int: ...


class StoreView(Protocol):
    def counts(self) -> dict[str, int]: ...

    def page_counts(self) -> dict[str, int]: ...

    def cluster_counts(self) -> ClusterView | None: ...

    def learned_profile_saved_at(self, key: str) -> float | None: ...


class ProfileView(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class EngineView(Protocol):
    @property
    def engine_id(self) -> str: ...

    @property
    def state(self) -> EngineState: ...

    @property
    def restarts(self) -> int: ...

    @property
    def profile(self) -> ProfileView: ...

    @property
    def profile_source(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def stalled_seconds(self) -> float: ...

    def learned_key(self) -> str: ...


class WatcherView(Protocol):
    def describe(self) -> list[dict[str, Any]]: ...


class DaemonView(Protocol):
    """What the collector reads from the daemon at scrape time (``daemon.Daemon``)."""

    @property
    def state(self) -> DaemonState: ...

    @property
    def store(self) -> StoreView | None: ...

    @property
    def engines(self) -> Sequence[EngineView]: ...

    @property
    def watcher(self) -> WatcherView | None: ...


# ------------------------------------------------------------------ the collector

def _one_hot(name: str, doc: str, label: str, values: Iterable[str], current: str,
             extra: Mapping[str, str] | None = None) -> GaugeMetricFamily:
    extra = dict(extra or {})
    fam = GaugeMetricFamily(name, doc, labels=[*extra, label])
    for value in values:
        fam.add_metric([*extra.values(), value], 1.0 if value == current else 0.0)
    return fam


_StoreRead = tuple[dict[str, int], dict[str, int], ClusterView | None]


def _cluster(cluster: ClusterView) -> Iterator[Metric]:
    """The shared queue (PostgreSQL): hosts by state, open jobs by owner and state."""
    hosts = GaugeMetricFamily("chandrad_cluster_hosts", "Hosts of the shared store by "
                              "state: up (heartbeat within its lease), silent (none for "
                              "longer), stopped.", labels=["state"])
    for state, n in sorted(cluster.hosts.items()):
        hosts.add_metric([state], float(n))
    yield hosts
    jobs = GaugeMetricFamily("chandrad_cluster_jobs", "Open jobs of the shared store by "
                             "the host that holds their lease (\"\" for none) and state.",
                             labels=["host", "state"])
    for (host, state), n in sorted(cluster.jobs.items()):
        jobs.add_metric([host, state], float(n))
    yield jobs
    yield GaugeMetricFamily("chandrad_cluster_leases_expired", "Open jobs whose host's "
                            "lease expired: another host takes them over at its next poll.",
                            value=float(cluster.leases_expired))
    yield CounterMetricFamily("chandrad_lease_takeovers", "Jobs this host took over from "
                              "another host whose lease had expired, since it started.",
                              value=float(cluster.takeovers))
    yield CounterMetricFamily("chandrad_pages_helped", "Pages of jobs other hosts own that "
                              "this host inferred and stored (it helped with their "
                              "documents), since it started.", value=float(cluster.pages_helped))


class DaemonCollector(Collector):
    """Reads the daemon's state at scrape time."""

    def __init__(self, daemon: DaemonView, info: Callable[[], Mapping[str, str]]) -> None:
        self.daemon = daemon
        self.info = info
        #: Scrapes that found the store unreachable, and the last one's reason ("": none).
        self.store_errors = 0
        self.store_error = ""
        self.store_seconds = 0.0

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        info = GaugeMetricFamily("chandrad_info", "Daemon version, vLLM version and model "
                                 "(value 1).", labels=list(self.info()))
        info.add_metric(list(self.info().values()), 1.0)
        yield info
        yield _one_hot("chandrad_daemon_state", "Daemon state (one-hot).", "state",
                       [s.value for s in DaemonState], d.state.value)
        store = d.store
        if store is not None:
            read = self._read_store(store)
            yield from self._store_up(read)
            if read is None:
                store = None  # unreachable: no store-derived series, no more reads
            else:
                yield from self._store(*read)
        if d.engines:
            yield from self._engines(d.engines, store)
        if d.watcher is not None:
            yield from self._watches(d.watcher)

    def _read_store(self, store: StoreView) -> _StoreRead | None:
        """What a scrape reads from the store, or None when it cannot be reached (the
        scrape answers without those series; it never fails for the store)."""
        t0 = time.monotonic()
        try:
            read = (store.counts(), store.page_counts(), store.cluster_counts())
        except StoreUnreachable as exc:
            self.store_errors += 1
            self.store_error = exc.message
            return None
        self.store_error = ""
        self.store_seconds = time.monotonic() - t0
        return read

    def _store_up(self, read: _StoreRead | None) -> Iterator[Metric]:
        yield GaugeMetricFamily("chandrad_store_up", "1 when this scrape could read the "
                                "store, 0 when its server cannot be reached (the store's "
                                "series are then absent).", value=0.0 if read is None else 1.0)
        yield CounterMetricFamily("chandrad_store_unreachable_scrapes", "Scrapes that found "
                                  "the store's server unreachable.", value=self.store_errors)
        if read is not None:
            yield GaugeMetricFamily("chandrad_store_read_seconds", "Seconds this scrape's "
                                    "store reads took (PostgreSQL: three round trips).",
                                    value=round(self.store_seconds, 6))

    @staticmethod
    def _store(counts: dict[str, int], pages: dict[str, int],
               cluster: ClusterView | None) -> Iterator[Metric]:
        jobs = GaugeMetricFamily("chandrad_jobs", "Jobs in the store by state.",
                                 labels=["state"])
        for state in JobState:
            key = "active" if state is JobState.RUNNING else state.value
            jobs.add_metric([state.value], float(counts.get(key, 0)))
        yield jobs
        yield GaugeMetricFamily("chandrad_queue_files", "Accepted files not finished "
                                "(pending + running jobs).",
                                value=float(counts.get("pending", 0) + counts.get("active", 0)))
        fam = GaugeMetricFamily("chandrad_pages", "Pages of probed jobs in the store by state.",
                                labels=["state"])
        for page_state in PageState:
            fam.add_metric([page_state.value], float(pages.get(page_state.value, 0)))
        yield fam
        yield GaugeMetricFamily(
            "chandrad_queue_pages", "Pages of probed jobs not finished (pending + in flight); "
            "a job not yet opened adds its pages once it is.",
            value=float(pages.get("pending", 0) + pages.get("in_flight", 0)))
        yield GaugeMetricFamily("chandrad_pages_in_flight", "Pages sent to the engine now.",
                                value=float(pages.get("in_flight", 0)))
        if cluster is not None:
            yield from _cluster(cluster)

    @staticmethod
    def _engines(engines: Sequence[EngineView], store: StoreView | None) -> Iterator[Metric]:
        """One family per metric, one sample per engine (label ``engine`` = its id)."""
        state = GaugeMetricFamily("chandrad_engine_state", "Engine state (one-hot).",
                                  labels=["engine", "state"])
        restarts = CounterMetricFamily("chandrad_engine_restarts", "Engine restarts after a "
                                       "failure since the daemon started.", labels=["engine"])
        cap = GaugeMetricFamily("chandrad_engine_capacity", "In-flight requests the pipeline "
                                "aims for.", labels=["engine"])
        stalled = GaugeMetricFamily("chandrad_engine_stalled_seconds", "Seconds the engine's "
                                    "requests in flight have waited with none answered and "
                                    "no token generated (0 when idle or moving); at "
                                    "engine.progress_timeout it is failed as engine_hung.",
                                    labels=["engine"])
        gauges = {key: GaugeMetricFamily(f"chandrad_engine_profile_{suffix}",
                                         f"Memory profile in force: {key} (absent = vLLM "
                                         "default).", labels=["engine"])
                  for key, suffix, _ in PROFILE_GAUGES}
        source_fam = GaugeMetricFamily("chandrad_engine_profile_source", "Where the profile "
                                       "in force came from (one-hot).",
                                       labels=["engine", "source"])
        age = GaugeMetricFamily("chandrad_engine_learned_profile_age_seconds",
                                "Seconds since the learned profile for this engine's "
                                "model/vLLM/GPU was last saved.", labels=["engine"])
        for engine in engines:
            eid = engine.engine_id
            for value in EngineState:
                state.add_metric([eid, value.value], 1.0 if value is engine.state else 0.0)
            restarts.add_metric([eid], float(engine.restarts))
            cap.add_metric([eid], float(engine.capacity))
            stalled.add_metric([eid], round(engine.stalled_seconds, 1))
            profile = engine.profile.to_dict()
            for key, _, factor in PROFILE_GAUGES:
                if profile.get(key) is not None:  # None: vLLM's own default, not known here
                    gauges[key].add_metric([eid], float(profile[key]) * factor)
            source = (engine.profile_source if engine.profile_source in PROFILE_SOURCES
                      else "config")
            for value_s in PROFILE_SOURCES:
                source_fam.add_metric([eid, value_s], 1.0 if value_s == source else 0.0)
            key_ = engine.learned_key()
            saved = store.learned_profile_saved_at(key_) if store is not None and key_ else None
            if saved is not None:
                age.add_metric([eid], max(0.0, time.time() - saved))
        yield state
        yield restarts
        yield cap
        yield stalled
        yield from (fam for fam in gauges.values() if fam.samples)
        yield source_fam
        if age.samples:
            yield age

    @staticmethod
    def _watches(watcher: WatcherView) -> Iterator[Metric]:
        up = GaugeMetricFamily("chandrad_watch_up", "1 when the watch's observer is armed "
                               "and alive.", labels=["watch"])
        polling = GaugeMetricFamily("chandrad_watch_polling", "1 when the watch polls "
                                    "instead of using inotify.", labels=["watch"])
        tracking = GaugeMetricFamily("chandrad_watch_tracking_files", "Files seen and not "
                                     "yet settled.", labels=["watch"])
        for root in watcher.describe():
            index = str(root["index"])
            up.add_metric([index], 1.0 if root["armed"] else 0.0)
            polling.add_metric([index], 1.0 if root["mode"] == "poll" else 0.0)
            tracking.add_metric([index], float(root["tracking"]))
        yield up
        yield polling
        yield tracking


# ------------------------------------------------------------------ events + registry

class Metrics:
    """The registry: the scrape-time collector plus the event counters (an Observer)."""

    def __init__(self, daemon: DaemonView, info: Callable[[], Mapping[str, str]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(DaemonCollector(daemon, info))
        self._pages = Counter("chandrad_pages_processed", "Pages finished by this daemon, "
                              "by outcome.", ["outcome"], registry=self.registry)
        for outcome in ("done", "failed"):
            self._pages.labels(outcome)
        self._render = Histogram("chandrad_page_render_seconds", "Time to render one page.",
                                 registry=self.registry, buckets=RENDER_BUCKETS)
        self._inference = Histogram("chandrad_page_inference_seconds", "Engine time of one "
                                    "page: its requests, retries included.",
                                    registry=self.registry, buckets=INFERENCE_BUCKETS)
        self._page = Histogram("chandrad_page_seconds", "One page from its start (render) to "
                               "its result committed.", registry=self.registry,
                               buckets=PAGE_BUCKETS)
        self._failures = Counter("chandrad_engine_failures", "Engine failures by class.",
                                 ["engine", "class"], registry=self.registry)
        self._changes = Counter("chandrad_engine_profile_changes", "profile_change events by "
                                "reason (the failure class, or upshift).",
                                ["engine", "reason"], registry=self.registry)
        # Every class starts at 0, so increase() sees the first failure (a series that
        # appears at 1 has no earlier sample to increase from).
        for cls in FailureClass:
            if cls is not FailureClass.NONE:
                self._failures.labels("0", cls.value)
                self._changes.labels("0", cls.value)
        self._changes.labels("0", "upshift")

    # interfaces.Observer
    def page_finished(self, ok: bool, render_s: float, inference_s: float,
                      total_s: float) -> None:
        self._pages.labels("done" if ok else "failed").inc()
        self._render.observe(render_s)
        if inference_s > 0:
            self._inference.observe(inference_s)
        self._page.observe(total_s)

    def engine_failed(self, failure_class: str, engine: str = "0") -> None:
        self._failures.labels(engine, failure_class).inc()

    def profile_changed(self, reason: str, engine: str = "0") -> None:
        self._changes.labels(engine, reason).inc()

    def count_webhooks(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Export the HTTP API's webhook outbox (``pending``, ``delivered``,
        ``undeliverable``), read from the store at scrape time."""
        self.registry.register(_WebhookCollector(counts))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _WebhookCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Metric]:
        try:
            counts = dict(self.counts())
        except StoreUnreachable:
            return  # absent while the store cannot be read (chandrad_store_up says so)
        fam = GaugeMetricFamily("chandrad_webhooks", "The HTTP API's webhooks in the store's "
                                "outbox by state (undeliverable: given up after "
                                "api.webhook_deadline).", labels=["state"])
        for state, n in counts.items():
            fam.add_metric([state], float(n))
        yield fam


# ------------------------------------------------------------------ the listener

def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) → (host, port). Raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{listen!r} is not host:port")
    host = host.strip("[]")
    if not host:
        raise ValueError(f"{listen!r} has no host")
    return host, int(port)


class MetricsServer:
    """A minimal HTTP/1.1 server for ``GET /metrics`` on the daemon's event loop."""

    READ_TIMEOUT = 10.0

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        """Bind; raises OSError when the address cannot be taken."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        sock = self._server.sockets[0].getsockname()
        self.port = int(sock[1])
        log.info("metrics_listening", address=f"{self.host}:{self.port}")

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.READ_TIMEOUT)
            method, target, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
            elif path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE, self.metrics.exposition()
            elif path == "/":
                status, ctype, body = ("200 OK", "text/html",
                                       b'<html><body><a href="/metrics">metrics</a></body></html>')
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                         .encode("latin-1") + (body if method != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError, ValueError):
            pass
        except Exception:  # a scrape must never take the daemon down
            log.exception("metrics_scrape_error")
            with contextlib.suppress(Exception):
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
