"""The configuration: one TOML file validated into frozen dataclasses (docs/configuration.md).

Owns parsing (``tomllib``), defaults, type/range checks and the location of each
problem (key, file, line). Pure: the only I/O is reading the file. Engine flags are
checked against the installed vLLM elsewhere (``engine/command.py``); here we only
reject the known-obsolete knobs with the real replacement named (docs/configuration.md,
Refused recipe knobs).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from chandrad.errors import ConfigError, ConfigProblem

DEFAULT_CONFIG_PATH = Path("/etc/chandrad/chandrad.toml")

#: Knobs that blog recipes use, refused as keys of chandrad's config, with the real
#: mechanism; the same text explains their flag when the engine's vLLM parser lacks it.
OBSOLETE_ENGINE_KNOBS: dict[str, str] = {
    "swap_space": (
        "sized a CPU swap space that vLLM's V1 engine never allocates (preempted requests "
        "are recomputed): vLLM 0.17 accepts --swap-space and only checks it against host "
        "RAM, 0.18 removed it; remove it (where engine.python's vLLM has the flag, "
        "engine.extra_args may pass it; cpu_offload_gb puts weights in host RAM)"
    ),
    "preemption_mode": (
        "only existed in the V0 engine; the V1 engine always preempts by recomputation; "
        "remove the key"
    ),
    "enable_memory_fragmentation_handler": (
        "is not a vLLM flag; the mechanism is PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
        "which chandrad sets itself when it sees fragmentation; remove the key"
    ),
    "batch_size": "is not a `vllm serve` flag; use max_num_seqs (concurrent sequences)",
    "enable_chunked_prefill_memory": "is not a vLLM flag; use max_num_batched_tokens",
}

LOG_FORMATS = ("auto", "journal", "json", "console")
LOG_LEVELS = ("debug", "info", "warning", "error")
WATCH_MODES = ("auto", "inotify", "poll")
DUPLICATE_POLICIES = ("process", "skip")
OUTPUT_FORMATS = ("md", "html", "json", "pdf")
#: ``ocr.pdf_text_pages``: a PDF page with text of its own keeps it alone, or gets the layer too.
PDF_TEXT_PAGES = ("skip", "add")
#: ``vllm serve --dtype`` choices, plus "auto" (chandrad's: bfloat16 on a GPU).
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


#: Field metadata of a value derived from another key (not a key of its own).
DERIVED = "derived_from"


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: Path = Path("/var/lib/chandrad")
    log_format: str = "auto"
    log_level: str = "info"
    #: ``daemon.store`` as written: "" (SQLite in ``state_dir``), a directory or
    #: ``sqlite:<directory>`` (SQLite there), or a ``postgresql://`` URL.
    store: str = ""
    #: From ``daemon.store``: the PostgreSQL URL (one queue shared by several hosts), or
    #: "" for the SQLite store (in ``sqlite_dir``, else ``state_dir``).
    store_url: str = field(default="", metadata={DERIVED: "store"})
    #: From ``daemon.store``: the SQLite store's directory when not ``state_dir``.
    sqlite_dir: Path | None = field(default=None, metadata={DERIVED: "store"})
    #: ``daemon.host_id``: this host's name in a shared store ("" = the hostname).
    host_id: str = ""
    #: ``daemon.lease_s``: seconds a job stays this host's without a heartbeat (PostgreSQL).
    lease_s: float = 30.0


@dataclass(frozen=True)
class WatchConfig:
    input: Path
    output: Path
    done: Path
    failed: Path
    recursive: bool = True
    mode: str = "auto"
    poll_interval: float = 5.0
    settle_seconds: float = 2.0
    rescan_interval: float = 300.0
    ignore: tuple[str, ...] = ()
    duplicates: str = "process"
    #: Create ``input`` at start when it does not exist (else that is a config error).
    create_input: bool = False


@dataclass(frozen=True)
class OcrConfig:
    prompt_type: str = "ocr_layout"
    max_output_tokens: int = 12384
    formats: tuple[str, ...] = ("md", "html", "json")
    include_images: bool = True
    include_headers_footers: bool = False
    #: ``pdf`` output: a PDF page that has text of its own is left alone ("skip") or gets
    #: the text layer as well ("add").
    pdf_text_pages: str = "skip"
    min_side_px: int | str = "auto"  # "auto": Chandra's, PDFs 1024 and images 1536
    max_pixels: int = 6291456
    max_pages: int = 5000
    retries: int = 6
    request_timeout: float = 600.0
    render_workers: int = 0  # 0 = number of CPUs
    max_in_flight: int = 0  # 0 = follow engine capacity

    @property
    def render_min_side(self) -> int | None:
        """``min_side_px`` for the renderer: ``None`` = Chandra's own per kind of input."""
        return None if self.min_side_px == "auto" else int(self.min_side_px)


@dataclass(frozen=True)
class MemoryConfig:
    """The starting memory profile. ``None`` means: leave vLLM's default.

    ``"auto"``: with a GPU, the value of Chandra's own launch for that GPU
    (``engine/launch.py``); without one, vLLM's default.
    """

    gpu_memory_utilization: float | str | None = "auto"
    max_num_seqs: int | str | None = "auto"
    max_num_batched_tokens: int | str | None = "auto"
    max_model_len: int | str | None = "auto"
    block_size: int | None = None
    enforce_eager: bool = False
    cpu_offload_gb: float = 0.0
    kv_cache_memory_bytes: int | None = None
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 1})
    mm_processor_kwargs: dict[str, Any] = field(default_factory=dict)
    mm_processor_cache_gb: float | None = None


@dataclass(frozen=True)
class DownshiftConfig:
    enabled: bool = True
    min_gpu_memory_utilization: float = 0.5
    max_gpu_memory_utilization: float = 0.95
    min_max_num_seqs: int = 1
    min_max_num_batched_tokens: int = 512
    min_max_model_len: int = 2048
    max_cpu_offload_gb: float = 0.0
    max_restarts: int = 5
    window: float = 600.0
    backoff_initial: float = 1.0
    backoff_max: float = 60.0
    upshift_after: float = 1800.0




@dataclass(frozen=True)
class EngineConfig:
    model: str = "datalab-to/chandra-ocr-2"
    served_model_name: str = "chandra"
    host: str = "127.0.0.1"
    port: int = 8000
    gpus: str = "all"
    dtype: str = "auto"  # "auto": bfloat16 with a GPU (Chandra's launch), vLLM's default without
    offline: bool = False  # true: never reach the hub (HF_HUB_OFFLINE=1); the cache holds it
    python: str = ""  # "" = the daemon's own interpreter
    command: tuple[str, ...] = ()  # overrides python + module when set
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout: float = 900.0
    stop_timeout: float = 30.0
    stable_seconds: float = 60.0
    #: Requests in flight and none answered, no token generated for this long: the engine
    #: hangs (its /health may still say 200); 0 = never judged. Chandra's own figures are
    #: 60 s average and 156 s P95 per page at 96 in flight on an H100 (its README): a
    #: working engine answers some request far sooner, and generates tokens every step.
    progress_timeout: float = 300.0
    url: str = ""  # a remote engine: health-watched only, never supervised (the first of urls)
    #: Every remote engine when ``engine.url`` is a list (``(url,)`` for one; ``()``: local).
    urls: tuple[str, ...] = field(default=(), metadata={DERIVED: "url"})
    #: Local engines to run: 0 = one per GPU ``gpus`` selects (groups of
    #: ``tensor_parallel_size``), 1 without GPUs (or one per ``cpu_affinity`` entry).
    replicas: int = 0
    #: Replica i runs pinned to CPU list i ("0", "2-3", "0,4"): the CPU stand-in for one
    #: engine per GPU.
    cpu_affinity: tuple[str, ...] = ()
    #: GPUs per engine (vLLM ``--tensor-parallel-size``), for a model that does not fit one.
    tensor_parallel_size: int = 1
    #: "replicas": one supervised vLLM per GPU group; "data_parallel": one vLLM with
    #: ``--data-parallel-size N`` over all of them.
    layout: str = "replicas"
    api_key: str = ""
    #: The path whose 200 means "can serve": ``/readiness`` for a vllm-router, whose
    #: ``/health`` is 503 while any one of its engines is down.
    health_path: str = "/health"
    exit_on_fatal: bool = False
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    downshift: DownshiftConfig = field(default_factory=DownshiftConfig)

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible root the daemon talks to (without ``/v1``)."""
        if self.url:
            return self.url.rstrip("/").removesuffix("/v1")
        return f"http://{self.host}:{self.port}"

    @property
    def supervised(self) -> bool:
        return not self.url


@dataclass(frozen=True)
class ControlConfig:
    socket: Path = Path("/run/chandrad/control.sock")
    group: str = ""
    mode: int = 0o660


@dataclass(frozen=True)
class MetricsConfig:
    #: ``host:port`` for Prometheus' ``/metrics``; "" = off. Loopback by default: the
    #: exposition names the model and queue sizes, and has no authentication.
    listen: str = "127.0.0.1:9478"


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP job API (``chandrad/api/``). Off unless ``enabled``; loopback by default."""

    enabled: bool = False
    listen: str = "127.0.0.1:9479"
    #: ``NAME TOKEN [admin]`` per line; required when enabled; refused if world-readable
    #: (checked when the API starts: ``chandrad/api/tokens.py``).
    tokens_file: Path | None = None
    #: The HMAC-SHA256 key that signs webhooks; unset: callbacks are refused.
    webhook_secret_file: Path | None = None
    #: The largest upload, in bytes (413 above it).
    max_upload: int = 256 << 20
    #: Seconds an upload's body may send nothing before it is refused (408).
    upload_timeout: float = 30.0
    #: Output formats a job lists and serves when its request names none (unset in the
    #: file: ``ocr.formats``).
    formats: tuple[str, ...] = ("md", "html", "json")
    #: The webhook URL of a job that names no ``callback_url``; "" = none.
    callback_url: str = ""
    #: The hosts a job's own ``callback_url`` may name: a host name or IP address, or
    #: ``*.example.com`` (any name below it); unset: ``callback_url``'s host, else none
    #: (a job naming a callback is refused).
    callback_hosts: tuple[str, ...] = ()
    #: What a second upload of content already queued or done does.
    duplicates: str = "process"
    #: Seconds a webhook is retried before it is given up (``webhook_undeliverable``).
    webhook_deadline: float = 86400.0
    #: Where uploads and their outputs are kept (``inbox/``, ``output/``, ``done/``,
    #: ``failed/``, ``tmp/``); unset: ``<state_dir>/api``. Required with a PostgreSQL
    #: store: a folder every host mounts at the same path.
    folder: Path | None = None


@dataclass(frozen=True)
class Config:
    path: Path
    daemon: DaemonConfig
    watch: tuple[WatchConfig, ...]
    ocr: OcrConfig
    engine: EngineConfig
    control: ControlConfig
    metrics: MetricsConfig = MetricsConfig()
    api: ApiConfig = ApiConfig()

    def api_watch(self) -> WatchConfig | None:
        """The folders of the API's uploads (``api.folder``, else ``<state_dir>/api/``),
        as the pipeline sees a watch: the input ``inbox`` (never watched: an upload is
        accepted by the API itself), ``output``, ``done``, ``failed``. None when the API
        is off."""
        if not self.api.enabled:
            return None
        root = self.api.folder or self.daemon.state_dir / "api"
        return WatchConfig(input=root / "inbox", output=root / "output", done=root / "done",
                           failed=root / "failed", duplicates=self.api.duplicates)

    def control_socket(self) -> Path:
        """``$RUNTIME_DIRECTORY/control.sock`` under systemd, else the config's."""
        runtime = os.environ.get("RUNTIME_DIRECTORY")
        if runtime:
            return Path(runtime.split(":")[0]) / "control.sock"
        return self.control.socket


def default_config_path() -> Path:
    """``$CHANDRAD_CONFIG``, else ``/etc/chandrad/chandrad.toml``."""
    env = os.environ.get("CHANDRAD_CONFIG")
    return Path(env) if env else DEFAULT_CONFIG_PATH


class _Locator:
    """Finds the line of ``section.key`` in the raw TOML text (tomllib gives no positions)."""

    _header = re.compile(r"^\s*\[\[?\s*([A-Za-z0-9_.\-]+)\s*\]\]?\s*(#.*)?$")
    _key = re.compile(r"^\s*([A-Za-z0-9_\-]+)\s*=")

    def __init__(self, text: str) -> None:
        self.index: dict[str, int] = {}
        section = ""
        counts: dict[str, int] = {}
        for lineno, line in enumerate(text.splitlines(), start=1):
            header = self._header.match(line)
            if header:
                name = header.group(1)
                if line.lstrip().startswith("[["):
                    n = counts.get(name, 0)
                    counts[name] = n + 1
                    name = f"{name}[{n}]"
                section = name
                self.index.setdefault(section, lineno)
                continue
            key = self._key.match(line)
            if key:
                dotted = f"{section}.{key.group(1)}" if section else key.group(1)
                self.index.setdefault(dotted, lineno)

    def line(self, dotted: str) -> int | None:
        found = self._nearest(dotted)
        if found is None and "[0]" in dotted:  # a single [watch] table is watch[0]
            found = self._nearest(dotted.replace("[0]", "", 1))
        return found

    def _nearest(self, dotted: str) -> int | None:
        while dotted:
            if dotted in self.index:
                return self.index[dotted]
            dotted = dotted.rpartition(".")[0]
        return None


class _Reader:
    """Pulls typed values out of one TOML table, recording problems instead of raising."""

    def __init__(
        self,
        table: dict[str, Any],
        prefix: str,
        problems: list[ConfigProblem],
        locate: _Locator,
        file: str,
    ) -> None:
        self.table = dict(table)
        self.prefix = prefix
        self.problems = problems
        self.locate = locate
        self.file = file
        self.seen: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def problem(self, name: str, message: str, code: str = "config_invalid") -> None:
        dotted = self.key(name)
        self.problems.append(
            ConfigProblem(dotted, message, self.file, self.locate.line(dotted), code)
        )

    def get(self, name: str, kinds: tuple[type, ...], default: Any) -> Any:
        self.seen.add(name)
        if name not in self.table:
            return default
        value = self.table[name]
        # bool is an int in Python; a TOML `true` is never a valid number here.
        ok = isinstance(value, kinds) and not (
            isinstance(value, bool) and bool not in kinds
        )
        if not ok:
            expected = " or ".join(k.__name__ for k in kinds)
            self.problem(name, f"expected {expected}, got {type(value).__name__} {value!r}",
                         "config_type")
            return default
        return value

    def number(
        self, name: str, default: Any, lo: float | None = None, hi: float | None = None,
        integer: bool = False, allow: tuple[Any, ...] = (),
    ) -> Any:
        kinds: tuple[type, ...] = (int,) if integer else (int, float)
        if allow and name in self.table and self.table[name] in allow:
            self.seen.add(name)
            return self.table[name]
        value = self.get(name, kinds + tuple({type(a) for a in allow if a is not None}), default)
        if isinstance(value, str) and value not in allow:
            self.problem(name, f"{value!r} is neither a number nor one of: "
                         f"{', '.join(map(str, allow))}", "config_type")
            return default
        if value is None or value in allow or not isinstance(value, (int, float)):
            return value
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
            self.problem(name, f"{value!r} is out of range {rng}", "config_range")
            return default
        return float(value) if not integer else int(value)

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        value = self.get(name, (str,), default)
        if value not in choices:
            self.problem(name, f"{value!r} is not one of {', '.join(choices)}", "config_range")
            return default
        return str(value)

    def strings(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        value = self.get(name, (list,), list(default))
        if not all(isinstance(v, str) for v in value):
            self.problem(name, "expected a list of strings", "config_type")
            return default
        return tuple(value)

    def path(self, name: str, default: Path | None, base: Path) -> Path | None:
        value = self.get(name, (str,), None)
        if value is None:
            return default
        p = Path(value).expanduser()
        return p if p.is_absolute() else (base / p)

    def finish(self, obsolete: dict[str, str] | None = None) -> None:
        """Report every key that was not read: unknown or obsolete."""
        for name in self.table:
            if name in self.seen:
                continue
            if obsolete and name in obsolete:
                self.problem(name, obsolete[name], "engine_flag_obsolete")
            else:
                self.problem(name, "unknown key", "config_key_unknown")


def load_config(path: Path | str) -> Config:
    """Read and validate ``path``.

    Raises:
        ConfigError: with every problem found (key, file and line where known).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([ConfigProblem("-", f"cannot read config: {exc.strerror}",
                                         str(path), None, "config_unreadable")]) from exc
    return parse_config(text, path)


def parse_config(text: str, path: Path) -> Config:
    """Validate TOML ``text`` as if read from ``path`` (relative paths resolve beside it)."""
    file = str(path)
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        # TOMLDecodeError.lineno only exists from Python 3.14; older ones say it in the text.
        at = re.search(r"\(at line (\d+)", str(exc))
        line = getattr(exc, "lineno", None) or (int(at.group(1)) if at else None)
        raise ConfigError([ConfigProblem("-", f"not valid TOML: {exc}", file, line,
                                         "config_syntax")]) from exc
    problems: list[ConfigProblem] = []
    loc = _Locator(text)
    base = path.resolve().parent

    def reader(table: Any, prefix: str) -> _Reader:
        if not isinstance(table, dict):
            problems.append(ConfigProblem(prefix, "expected a table", file, loc.line(prefix),
                                          "config_type"))
            table = {}
        return _Reader(table, prefix, problems, loc, file)

    top = reader(raw, "")
    for section in ("daemon", "watch", "ocr", "engine", "control", "metrics", "api"):
        top.seen.add(section)
    top.finish()

    daemon = _daemon(reader(raw.get("daemon", {}), "daemon"), base)
    watches = _watches(raw.get("watch", []), reader, base, problems, loc, file)
    ocr = _ocr(reader(raw.get("ocr", {}), "ocr"))
    engine_raw = raw.get("engine", {})
    engine = _engine(reader(engine_raw, "engine"), reader, engine_raw if isinstance(
        engine_raw, dict) else {})
    control = _control(reader(raw.get("control", {}), "control"), base)
    metrics = _metrics(reader(raw.get("metrics", {}), "metrics"))
    api = _api(reader(raw.get("api", {}), "api"), base, ocr, daemon)
    _cross_checks(watches, problems, loc, file)
    _api_folder_check(api, watches, problems, loc, file)
    if problems:
        raise ConfigError(problems)
    return Config(path=path, daemon=daemon, watch=tuple(watches), ocr=ocr, engine=engine,
                  control=control, metrics=metrics, api=api)


def _daemon(r: _Reader, base: Path) -> DaemonConfig:
    d = DaemonConfig()
    cfg = DaemonConfig(
        state_dir=r.path("state_dir", d.state_dir, base) or d.state_dir,
        log_format=r.choice("log_format", d.log_format, LOG_FORMATS),
        log_level=r.choice("log_level", d.log_level, LOG_LEVELS),
        host_id=r.get("host_id", (str,), d.host_id),
        lease_s=r.number("lease_s", d.lease_s, lo=1.0, hi=3600.0),
    )
    store = r.get("store", (str,), "")
    cfg = dataclasses.replace(cfg, store=store)
    if store.startswith(("postgresql://", "postgres://")):
        cfg = dataclasses.replace(cfg, store_url=store)
    elif store.startswith("sqlite:") or "://" not in store:
        value = store.removeprefix("sqlite:").removeprefix("//")
        if value:
            sqlite_dir = Path(value).expanduser()
            cfg = dataclasses.replace(cfg, sqlite_dir=sqlite_dir if sqlite_dir.is_absolute()
                                      else base / sqlite_dir)
    else:
        r.problem("store", f"{store!r} is neither a path, a sqlite: URL nor a "
                  "postgresql:// URL", "config_range")
    r.finish()
    return cfg


def _watches(
    raw: Any, reader: Any, base: Path, problems: list[ConfigProblem], loc: _Locator, file: str
) -> list[WatchConfig]:
    if isinstance(raw, dict):
        raw = [raw]
    if not isinstance(raw, list):
        problems.append(ConfigProblem("watch", "expected [[watch]] tables", file,
                                      loc.line("watch"), "config_type"))
        return []
    out: list[WatchConfig] = []
    for i, table in enumerate(raw):
        r: _Reader = reader(table, f"watch[{i}]")
        inp = r.path("input", None, base)
        if inp is None:
            r.problem("input", "required: the folder to watch")
            r.seen.update(f.name for f in fields(WatchConfig))
            r.finish()
            continue
        parent = inp.parent
        out.append(WatchConfig(
            input=inp,
            output=r.path("output", parent / "output", base) or parent / "output",
            done=r.path("done", parent / "done", base) or parent / "done",
            failed=r.path("failed", parent / "failed", base) or parent / "failed",
            recursive=r.get("recursive", (bool,), True),
            mode=r.choice("mode", "auto", WATCH_MODES),
            poll_interval=r.number("poll_interval", 5.0, lo=0.05, hi=3600),
            settle_seconds=r.number("settle_seconds", 2.0, lo=0.0, hi=3600),
            rescan_interval=r.number("rescan_interval", 300.0, lo=1.0, hi=86400),
            ignore=r.strings("ignore", ()),
            duplicates=r.choice("duplicates", "process", DUPLICATE_POLICIES),
            create_input=r.get("create_input", (bool,), False),
        ))
        r.finish()
    return out


def _ocr(r: _Reader) -> OcrConfig:
    d = OcrConfig()
    formats = r.strings("formats", d.formats)
    bad = [f for f in formats if f not in OUTPUT_FORMATS]
    if bad:
        r.problem("formats", f"unknown format(s) {bad}; choose from {list(OUTPUT_FORMATS)}",
                  "config_range")
        formats = d.formats
    cfg = OcrConfig(
        prompt_type=r.choice("prompt_type", d.prompt_type, ("ocr_layout", "ocr")),
        max_output_tokens=r.number("max_output_tokens", d.max_output_tokens, 16, 1 << 20, True),
        formats=formats,
        include_images=r.get("include_images", (bool,), d.include_images),
        include_headers_footers=r.get("include_headers_footers", (bool,),
                                      d.include_headers_footers),
        pdf_text_pages=r.choice("pdf_text_pages", d.pdf_text_pages, PDF_TEXT_PAGES),
        min_side_px=r.number("min_side_px", d.min_side_px, 16, 20000, True, allow=("auto",)),
        max_pixels=r.number("max_pixels", d.max_pixels, 1024, 200_000_000, True),
        max_pages=r.number("max_pages", d.max_pages, 1, 1_000_000, True),
        retries=r.number("retries", d.retries, 0, 100, True),
        request_timeout=r.number("request_timeout", d.request_timeout, 1, 86400),
        render_workers=r.number("render_workers", d.render_workers, 0, 512, True),
        max_in_flight=r.number("max_in_flight", d.max_in_flight, 0, 100000, True),
    )
    r.finish()
    return cfg


def _memory(r: _Reader) -> MemoryConfig:
    d = MemoryConfig()
    block = r.get("block_size", (int, str), d.block_size)
    if isinstance(block, str):
        r.problem("block_size", "is tokens per KV block (an integer such as 16), not a size "
                  "in MB; to limit KV memory use kv_cache_memory_bytes or gpu_memory_utilization",
                  "config_type")
        block = None
    elif block is not None and block not in (1, 8, 16, 32, 64, 128, 256):
        r.problem("block_size", f"{block} tokens per KV block is not a vLLM block size "
                  "(1, 8, 16, 32, 64, 128 or 256); it is tokens, not MB", "config_range")
        block = None
    lmpp = r.get("limit_mm_per_prompt", (dict,), d.limit_mm_per_prompt)
    cfg = MemoryConfig(
        gpu_memory_utilization=r.number("gpu_memory_utilization", d.gpu_memory_utilization,
                                        0.05, 1.0, allow=("auto",)),
        max_num_seqs=r.number("max_num_seqs", d.max_num_seqs, 1, 65536, True, allow=("auto",)),
        max_num_batched_tokens=r.number("max_num_batched_tokens", d.max_num_batched_tokens,
                                        16, 10_000_000, True, allow=("auto",)),
        max_model_len=r.number("max_model_len", d.max_model_len, 16, 10_000_000, True,
                               allow=("auto",)),
        block_size=block,
        enforce_eager=r.get("enforce_eager", (bool,), d.enforce_eager),
        cpu_offload_gb=r.number("cpu_offload_gb", d.cpu_offload_gb, 0, 100000),
        kv_cache_memory_bytes=r.number("kv_cache_memory_bytes", d.kv_cache_memory_bytes, 1,
                                       1 << 50, True),
        limit_mm_per_prompt=dict(lmpp),
        mm_processor_kwargs=dict(r.get("mm_processor_kwargs", (dict,), d.mm_processor_kwargs)),
        mm_processor_cache_gb=r.number("mm_processor_cache_gb", d.mm_processor_cache_gb, 0, 1e5),
    )
    r.finish(OBSOLETE_ENGINE_KNOBS)
    return cfg


def _downshift(r: _Reader) -> DownshiftConfig:
    d = DownshiftConfig()
    backoff = r.get("backoff", (list,), [d.backoff_initial, d.backoff_max])
    if (len(backoff) != 2 or not all(isinstance(b, (int, float)) and b > 0 for b in backoff)
            or backoff[0] > backoff[1]):
        r.problem("backoff", "expected [initial_seconds, max_seconds] with 0 < initial <= max",
                  "config_range")
        backoff = [d.backoff_initial, d.backoff_max]
    cfg = DownshiftConfig(
        enabled=r.get("enabled", (bool,), d.enabled),
        min_gpu_memory_utilization=r.number("min_gpu_memory_utilization",
                                            d.min_gpu_memory_utilization, 0.05, 1.0),
        max_gpu_memory_utilization=r.number("max_gpu_memory_utilization",
                                            d.max_gpu_memory_utilization, 0.05, 1.0),
        min_max_num_seqs=r.number("min_max_num_seqs", d.min_max_num_seqs, 1, 65536, True),
        min_max_num_batched_tokens=r.number("min_max_num_batched_tokens",
                                            d.min_max_num_batched_tokens, 16, 10_000_000, True),
        min_max_model_len=r.number("min_max_model_len", d.min_max_model_len, 16, 10_000_000,
                                   True),
        max_cpu_offload_gb=r.number("max_cpu_offload_gb", d.max_cpu_offload_gb, 0, 100000),
        max_restarts=r.number("max_restarts", d.max_restarts, 0, 1000, True),
        window=r.number("window", d.window, 1, 86400 * 7),
        backoff_initial=float(backoff[0]),
        backoff_max=float(backoff[1]),
        upshift_after=r.number("upshift_after", d.upshift_after, 1, 86400 * 30),
    )
    r.finish()
    return cfg


#: The most local engines one daemon supervises (8 GPUs × a margin).
MAX_REPLICAS = 64
ENGINE_LAYOUTS = ("replicas", "data_parallel")
#: Variables that never reach the engine's environment (dropped from the daemon's own,
#: refused in engine.env), and why.
REFUSED_ENGINE_ENV: dict[str, str] = {
    "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "it keeps vLLM's API server up after its EngineCore "
    "died, so chandrad could not see the engine fail and restart it",
}

#: A CPU list as taskset(1) takes it: "0", "2-3", "0,4-5".
CPU_LIST = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def _engine(r: _Reader, reader: Any, raw: dict[str, Any]) -> EngineConfig:
    d = EngineConfig()
    env = r.get("env", (dict,), {})
    if not all(isinstance(v, str) for v in env.values()):
        r.problem("env", "every value must be a string", "config_type")
        env = {}
    for name in REFUSED_ENGINE_ENV.keys() & env.keys():
        r.problem("env", f"{name} is refused: {REFUSED_ENGINE_ENV[name]}")
    command = r.get("command", (list, str), [])
    if isinstance(command, str):
        command = command.split()
    r.seen.update({"memory", "downshift"})
    urls = _urls(r)
    affinity = r.strings("cpu_affinity", d.cpu_affinity)
    for cpus in affinity:
        if not CPU_LIST.fullmatch(cpus.replace(" ", "")):
            r.problem("cpu_affinity", f"{cpus!r} is not a CPU list like \"0\", \"2-3\" or "
                      "\"0,4\"", "config_type")
            affinity = ()
            break
    cfg = EngineConfig(
        model=r.get("model", (str,), d.model),
        served_model_name=r.get("served_model_name", (str,), d.served_model_name),
        host=r.get("host", (str,), d.host),
        port=r.number("port", d.port, 1, 65535, True),
        gpus=str(r.get("gpus", (str, int), d.gpus)),
        dtype=r.choice("dtype", d.dtype, DTYPES),
        offline=r.get("offline", (bool,), d.offline),
        python=r.get("python", (str,), d.python),
        command=tuple(str(c) for c in command),
        extra_args=r.strings("extra_args", d.extra_args),
        env=dict(env),
        startup_timeout=r.number("startup_timeout", d.startup_timeout, 1, 86400),
        stop_timeout=r.number("stop_timeout", d.stop_timeout, 0.5, 3600),
        stable_seconds=r.number("stable_seconds", d.stable_seconds, 0, 86400),
        progress_timeout=r.number("progress_timeout", d.progress_timeout, 0, 86400),
        url=urls[0] if urls else "",
        urls=urls,
        replicas=r.number("replicas", d.replicas, 0, MAX_REPLICAS, True),
        cpu_affinity=affinity,
        tensor_parallel_size=r.number("tensor_parallel_size", d.tensor_parallel_size, 1, 64,
                                      True),
        layout=r.choice("layout", d.layout, ENGINE_LAYOUTS),
        api_key=r.get("api_key", (str,), d.api_key),
        health_path=r.get("health_path", (str,), d.health_path),
        exit_on_fatal=r.get("exit_on_fatal", (bool,), d.exit_on_fatal),
        memory=_memory(reader(raw.get("memory", {}), "engine.memory")),
        downshift=_downshift(reader(raw.get("downshift", {}), "engine.downshift")),
    )
    r.finish(OBSOLETE_ENGINE_KNOBS)
    _engine_layout_checks(r, cfg)
    if not re.match(r"^/[^?#\s]*$", cfg.health_path):
        r.problem("health_path", f"{cfg.health_path!r} is not a URL path (it starts with /)")
    return cfg


def _urls(r: _Reader) -> tuple[str, ...]:
    """``engine.url``: one URL, or a list of them (several remote engines)."""
    raw = r.get("url", (str, list), "")
    values = [raw] if isinstance(raw, str) else raw
    if not all(isinstance(v, str) for v in values) or (isinstance(raw, list) and not raw):
        r.problem("url", "expected an http(s) URL or a non-empty list of them", "config_type")
        return ()
    urls = tuple(v for v in values if v)
    for url in urls:
        if not re.match(r"^https?://", url):
            r.problem("url", f"{url!r} is not an http(s) URL")
            return ()
    if len(set(urls)) != len(urls):
        r.problem("url", "the same URL is listed twice")
        return ()
    return urls


def _engine_layout_checks(r: _Reader, cfg: EngineConfig) -> None:
    """Replicas, CPU pinning, tensor/data parallel and remote URLs that cannot go together."""
    if cfg.urls and (cfg.replicas not in (0, len(cfg.urls)) or cfg.cpu_affinity
                     or cfg.tensor_parallel_size != 1 or cfg.layout != "replicas"):
        r.problem("url", "remote engines (engine.url) are not spawned: leave engine.replicas, "
                  "cpu_affinity, tensor_parallel_size and layout at their defaults",
                  "config_range")
    if cfg.replicas and cfg.cpu_affinity and len(cfg.cpu_affinity) < cfg.replicas:
        r.problem("cpu_affinity", f"{len(cfg.cpu_affinity)} CPU list(s) for "
                  f"engine.replicas = {cfg.replicas}: give one per replica", "config_range")
    if cfg.layout == "data_parallel" and cfg.cpu_affinity:
        r.problem("cpu_affinity", "layout = \"data_parallel\" runs one process tree: pin it "
                  "with the unit's CPUAffinity= instead", "config_range")
    planned = max(cfg.replicas, len(cfg.cpu_affinity), 1)
    if cfg.layout == "replicas" and cfg.port + planned - 1 > 65535:
        r.problem("port", f"replica ports {cfg.port}..{cfg.port + planned - 1} go past 65535",
                  "config_range")
    for flag, key in (("--tensor-parallel-size", "tensor_parallel_size"),
                      ("--data-parallel-size", "layout")):
        if any(a == flag or a.startswith(flag + "=") for a in cfg.extra_args):
            r.problem("extra_args", f"{flag} is set by engine.{key}; remove it from "
                      "extra_args", "engine_flag_duplicate")


def _control(r: _Reader, base: Path) -> ControlConfig:
    d = ControlConfig()
    mode_raw = r.get("mode", (int, str), d.mode)
    mode = d.mode
    if isinstance(mode_raw, str):
        try:
            mode = int(mode_raw, 8)
        except ValueError:
            r.problem("mode", f"{mode_raw!r} is not an octal mode like \"0660\"", "config_type")
    else:
        mode = mode_raw
    if not 0 <= mode <= 0o777:
        r.problem("mode", f"{oct(mode)} is not a file mode", "config_range")
        mode = d.mode
    cfg = ControlConfig(
        socket=r.path("socket", d.socket, base) or d.socket,
        group=r.get("group", (str,), d.group),
        mode=mode,
    )
    r.finish()
    return cfg


def _metrics(r: _Reader) -> MetricsConfig:
    d = MetricsConfig()
    listen = _listen(r, d.listen, "\"\" turns metrics off")
    r.finish()
    return MetricsConfig(listen=listen)


def _listen(r: _Reader, default: str, off: str | None) -> str:
    """``listen`` as ``host:port`` (``off``: what "" means; None: "" is refused too)."""
    listen = r.get("listen", (str,), default)
    if listen or off is None:
        host, sep, port = listen.rpartition(":")
        if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
            r.problem("listen", f"{listen!r} is not host:port" + (f" ({off})" if off else ""),
                      "config_invalid")
            listen = default
    return str(listen)


def _api(r: _Reader, base: Path, ocr: OcrConfig, daemon: DaemonConfig) -> ApiConfig:
    d = ApiConfig()
    enabled = r.get("enabled", (bool,), d.enabled)
    # Unset: what the pipeline writes; set: each must be one it writes.
    given = r.get("formats", (list,), None) is not None
    formats = r.strings("formats", ocr.formats)
    unwritten = [f for f in formats if f not in ocr.formats] if given else []
    if unwritten:
        r.problem("formats", f"{unwritten} not written by the pipeline: ocr.formats is "
                  f"{list(ocr.formats)}", "config_range")
        formats = tuple(f for f in formats if f in ocr.formats)
    callback = r.get("callback_url", (str,), d.callback_url)
    if callback and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", callback):
        r.problem("callback_url", f"{callback!r} is not an http(s) URL", "config_invalid")
        callback = d.callback_url
    hosts = _callback_hosts(r, callback)
    cfg = ApiConfig(
        enabled=enabled,
        listen=_listen(r, d.listen, None),
        tokens_file=r.path("tokens_file", d.tokens_file, base),
        webhook_secret_file=r.path("webhook_secret_file", d.webhook_secret_file, base),
        max_upload=r.number("max_upload", d.max_upload, 1, 1 << 40, True),
        upload_timeout=r.number("upload_timeout", d.upload_timeout, 0.1, 3600),
        formats=formats,
        callback_url=callback,
        callback_hosts=hosts,
        duplicates=r.choice("duplicates", d.duplicates, DUPLICATE_POLICIES),
        webhook_deadline=r.number("webhook_deadline", d.webhook_deadline, 1, 30 * 86400),
        folder=r.path("folder", d.folder, base),
    )
    if enabled and daemon.store_url and cfg.folder is None:
        r.problem("folder", "required when api.enabled with a PostgreSQL daemon.store: "
                  "the uploads' folder every host mounts at the same path, so that any "
                  "host runs an API job and serves its outputs")
    if enabled and cfg.tokens_file is None:
        r.problem("tokens_file", "required when api.enabled: the file of API tokens")
    if cfg.callback_url and cfg.webhook_secret_file is None:
        r.problem("webhook_secret_file", "required with api.callback_url: the key that "
                  "signs webhooks")
    r.finish()
    return cfg


#: An ``api.callback_hosts`` entry: a host name (``*.`` before it: any name below it), an
#: IPv4 address, or an IPv6 one in brackets.
_CALLBACK_HOST = re.compile(r"(\*\.)?[a-z0-9]([a-z0-9.-]*[a-z0-9])?|\[[0-9a-f:.]+\]")


def _callback_hosts(r: _Reader, callback_url: str) -> tuple[str, ...]:
    """``api.callback_hosts``, lower case, IPv6 addresses without brackets; unset: the
    host of ``callback_url``, if any."""
    if r.get("callback_hosts", (list,), None) is None:
        host = re.sub(r"^https?://(?:[^@/]*@)?(\[[^\]]*\]|[^:/]*).*", r"\1", callback_url)
        return (host.lower().strip("[]"),) if callback_url else ()
    hosts = tuple(h.strip().lower() for h in r.strings("callback_hosts", ()))
    bad = [h for h in hosts if not _CALLBACK_HOST.fullmatch(h)]
    if bad:
        r.problem("callback_hosts", f"{bad} are not host names, *.domain patterns or IP "
                  "addresses", "config_invalid")
    return tuple(h.strip("[]") for h in hosts if h not in bad)


def _covers(root: Path, recursive: bool, target: Path) -> bool:
    """Whether a watch on ``root`` sees ``target``: equal, or below it when recursive
    (a subfolder of a non-recursive watch is never scanned)."""
    return target == root or (recursive and root in target.parents)


def _api_folder_check(api: ApiConfig, watches: list[WatchConfig],
                      problems: list[ConfigProblem], loc: _Locator, file: str) -> None:
    """Refuse an ``api.folder`` that a watch would see (its uploads and outputs taken as
    new input) or that holds a watch's input (the API's files would be that watch's)."""
    if not api.enabled or api.folder is None:
        return
    folder = api.folder.resolve()
    for i, w in enumerate(watches):
        root = w.input.resolve()
        if _covers(root, w.recursive, folder) or folder in root.parents or folder == root:
            problems.append(ConfigProblem(
                "api.folder", f"{folder} overlaps watch[{i}].input {root}: uploads and "
                "their outputs would be taken as new input. Put it beside the watched "
                "folders", file, loc.line("api.folder"), "config_range"))
            return


def _cross_checks(
    watches: list[WatchConfig], problems: list[ConfigProblem], loc: _Locator, file: str
) -> None:
    """Refuse folders that would make a watch take files that are not new input.

    Compared after resolving, over every pair of watches (a watch with itself included):

    * an output/done/failed folder that a watch's input covers: the outputs, or inputs
      already finished, would be ingested again as new documents;
    * an input that another watch's input covers (the same folder, or inside a recursive
      one): one file would belong to two watches;
    * an input inside another watch's output/done/failed folder: it would ingest that
      watch's outputs or finished inputs.
    """
    roots = [w.input.resolve() for w in watches]
    homes = [{name: getattr(w, name).resolve() for name in ("output", "done", "failed")}
             for w in watches]

    def add(key: str, message: str) -> None:
        problems.append(ConfigProblem(key, message, file, loc.line(key), "config_range"))

    def where(i: int, name: str) -> str:
        line = loc.line(f"watch[{i}].{name}")
        return f"watch[{i}].{name}" + (f" (line {line})" if line else "")

    order = range(len(watches))
    for j, folders in enumerate(homes):
        for name, target in folders.items():
            # Its own input first, so that one folder gets one problem.
            seen_by = [i for i in (j, *order) if _covers(roots[i], watches[i].recursive, target)]
            if seen_by:
                i = seen_by[0]
                owner = "" if i == j else f" of {where(i, 'input')}"
                add(f"watch[{j}].{name}",
                    f"{target} is inside the watched input {roots[i]}{owner}; its files would "
                    "be taken as new input. Put it beside the input folder")
    for i, (w, root) in enumerate(zip(watches, roots, strict=True)):
        holders = [(j, name, target) for j, folders in enumerate(homes)
                   for name, target in folders.items() if target in root.parents]
        if holders:
            j, name, target = holders[0]
            add(f"watch[{i}].input", f"{root} is inside {target}, the {name} folder of "
                f"{where(j, name)}; its files would be taken as new input")
            continue
        for j in range(i):
            if roots[j] == root:
                add(f"watch[{i}].input", f"{root} is already watched by {where(j, 'input')}; "
                    "a folder can have only one watch")
                break
            if _covers(roots[j], watches[j].recursive, root):
                add(f"watch[{i}].input", f"{root} is inside {roots[j]}, watched recursively "
                    f"by {where(j, 'input')}; its files would belong to both watches")
                break
            if _covers(root, w.recursive, roots[j]):
                add(f"watch[{j}].input", f"{roots[j]} is inside {root}, watched recursively "
                    f"by {where(i, 'input')}; its files would belong to both watches")
                break


def key_line(text: str, dotted: str) -> int | None:
    """The line of ``dotted`` (or of its nearest enclosing table) in TOML ``text``."""
    return _Locator(text).line(dotted)


def engine_settings_changed(old: Config, new: Config) -> bool:
    """Whether a reload must restart the engine (docs/configuration.md, How a reload applies
    each key)."""
    return old.engine != new.engine


def dataclass_dict(obj: Any) -> dict[str, Any]:
    """A JSON-friendly dict of a (nested) config dataclass, for status and metadata."""
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if hasattr(value, "__dataclass_fields__"):
            value = dataclass_dict(value)
        elif isinstance(value, Path):
            value = str(value)
        elif isinstance(value, tuple):
            value = [dataclass_dict(v) if hasattr(v, "__dataclass_fields__")
                     else str(v) if isinstance(v, Path) else v for v in value]
        out[f.name] = value
    return out
