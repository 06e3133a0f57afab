"""``chandrad tune``: the search of ``tune.py`` run on this host's engine, with a progress bar.

Owns what the search needs of the outside: the store (opened as the daemon opens it, so a
daemon on the same state dir, or on a shared PostgreSQL store a live host with this
``daemon.host_id``, makes ``tune`` refuse, exit 78, and ``tune`` holding it keeps this
host's daemon from starting meanwhile; the profile is saved under the host's id there, as
the daemon saves it), the starting profile and learned key (the daemon's own
``ProfileKeeper``: the memory plan, the key the daemon loads), the calibration pages
(``--files``, rendered by the daemon's renderer, else :data:`SYNTHETIC_PAGES` pages of text
drawn here), one ``EngineSupervisor`` per engine start (the daemon's supervision, spawn and
flag check; downshift off, so a memory failure ends the step instead of moving the profile),
the requests (``ocr.encode_chat_request`` through the daemon's ``Dispatcher``), the memory
the engine holds (NVML on a GPU, its processes' RSS on the CPU), and the learned profile
saved each time the best improves (so Ctrl-C keeps what was measured). The log goes to
``<state_dir>/tune.log``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import structlog

from chandrad import model_files, ocr, render
from chandrad.config import Config
from chandrad.daemon.wiring import (
    NvmlProbe,
    engine_name,
    key_line_of,
    open_store,
    plan_engines,
)
from chandrad.engine.dispatch import Dispatcher
from chandrad.engine.flagcache import FlagVerdictCache, flag_cache_dir
from chandrad.engine.flagcheck import FlagChecks
from chandrad.engine.keeper import TUNED_MARK, ProfileKeeper
from chandrad.engine.process import session_members
from chandrad.engine.profile import (
    PIXELS_PER_IMAGE_TOKEN,
    MemoryProfile,
    estimate_prompt_tokens,
)
from chandrad.engine.replicas import ReplicaSpec
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import ConfigError, ConfigProblem, EngineUnavailable, ExitCode, InputError
from chandrad.interfaces import ChatBody
from chandrad.logs import configure_logging
from chandrad.states import EngineState
from chandrad.tune import EngineStep, Measure, TunePolicy, table_rows

log = structlog.get_logger("chandrad.tune")

LOG_NAME = "tune.log"
#: Pages of the calibration set at most (the first pages of ``--files``, in name order).
CALIBRATION_PAGES = 16
SYNTHETIC_PAGES = 8
#: A level sends at least this many pages, and at least this many per page at once.
MIN_LEVEL_PAGES = 12
PAGES_PER_LEVEL = 4
OUT_OF_TIME = "the time budget is spent"


@dataclass(frozen=True)
class TuneOutcome:
    """How a tune ended; ``cli.py`` maps it to the exit status."""

    policy: TunePolicy
    interrupted: bool
    saved_key: str  #: "" when nothing was saved (engine 0's key)
    #: The engines that profile was saved for (alike replicas: each under its own key).
    saved_for: int = 1

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return int(ExitCode.INTERRUPTED)
        return int(ExitCode.OK if self.policy.best is not None else ExitCode.UNAVAILABLE)


# ----------------------------------------------------------------- calibration pages
def synthetic_page(path: Path, seed: int) -> None:
    """A letter-size page of printed text (a title, paragraphs, a small table) as a PNG."""
    from PIL import Image, ImageDraw, ImageFont

    words = ["invoice", "total", "amount", "period", "account", "balance", "payment",
             "statement", "annual", "report", "section", "table", "figure", "summary",
             "revenue", "costs", "net", "gross", "page", "note"]
    img = Image.new("L", (1275, 1650), 255)
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=22)
    title = ImageFont.load_default(size=40)
    draw.text((100, 90), f"Calibration page {seed + 1}", fill=0, font=title)
    y = 180
    for line in range(36):
        text = " ".join(words[(seed * 7 + line * 3 + k * 5) % len(words)] for k in range(12))
        draw.text((100, y), text.capitalize() + ".", fill=0, font=font)
        y += 32 if line % 9 else 56
    for row in range(4):
        for col in range(4):
            draw.rectangle((100 + col * 260, y + row * 40, 360 + col * 260, y + 40 + row * 40),
                           outline=0)
            draw.text((110 + col * 260, y + 8 + row * 40), f"{(seed + row) * 13 + col:,}",
                      fill=0, font=font)
    img.save(path, format="PNG")


def calibration_files(files: Path | None, scratch: Path) -> list[Path]:
    """``--files``' files (recursively, name order), else synthetic pages in ``scratch``."""
    if files is not None:
        found = sorted(p for p in files.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not found:
            raise InputError(f"{files}: no files to calibrate with")
        return found
    made = []
    for i in range(SYNTHETIC_PAGES):
        path = scratch / f"calibration-{i + 1}.png"
        synthetic_page(path, i)
        made.append(path)
    return made


def render_pages(paths: Sequence[Path], cfg: Config, max_pixels: int) -> list[ocr.PageImage]:
    """The first :data:`CALIBRATION_PAGES` pages of ``paths``, as the daemon renders them;
    a file that cannot be rendered is skipped."""
    pages: list[ocr.PageImage] = []
    for path in paths:
        try:
            count = render.probe(path, cfg.ocr.max_pages).page_count
            for index in range(count):
                if len(pages) >= CALIBRATION_PAGES:
                    return pages
                pages.append(render.render_page(path, index, cfg.ocr.render_min_side,
                                                max_pixels))
        except InputError as exc:
            log.warning("tune_file_skipped", file=str(path), error=exc.message)
    if not pages:
        raise InputError("no page of the calibration files could be rendered")
    return pages


class PageVariants:
    """Every request a page never sent before: the calibration pages in turn, each time
    with a mark of a few pixels in its top-left corner (the request's number, in two greys
    on white), so vLLM's prefix and multimodal caches, which would skip the prefill of a
    page they saw, cannot make a repeated page cheaper than real work."""

    def __init__(self, pages: Sequence[ocr.PageImage]) -> None:
        from PIL import Image

        self._images = []
        for page in pages:
            with Image.open(io.BytesIO(page.png)) as img:
                self._images.append((page, img.copy()))
        self._sent = 0

    def next(self) -> ocr.PageImage:
        """The next page, marked with this request's number."""
        n = self._sent
        self._sent += 1
        page, img = self._images[n % len(self._images)]
        marked = img.copy()
        white = 255 if marked.mode == "L" else (255,) * len(marked.getbands())
        grey = 247 if marked.mode == "L" else (247,) * len(marked.getbands())
        for bit in range(24):
            marked.putpixel((bit, 0), grey if n >> bit & 1 else white)
        out = io.BytesIO()
        marked.save(out, format="PNG", compress_level=1)
        return dataclasses.replace(page, png=out.getvalue())


# ----------------------------------------------------------------- the engine's memory
def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def engine_memory(engine: EngineSupervisor, gpu: NvmlProbe, on_gpu: bool) -> int | None:
    """GPU memory its processes hold (NVML), or on the CPU their resident memory."""
    if engine.pid is None:
        return None
    pids = session_members(engine.pid)  # the API server leads its own session
    if on_gpu:
        held = gpu.memory_held_by(pids)
        return sum(held.values()) if held else None
    return sum(_rss(p) for p in pids) or None


def _cpu_count(cpus: str) -> int:
    """How many CPUs a CPU list (``"0-3,8"``) names."""
    count = 0
    for part in filter(None, cpus.replace(" ", "").split(",")):
        first, _, last = part.partition("-")
        count += int(last or first) - int(first) + 1
    return count


def _replica_kind(spec: ReplicaSpec, keeper: ProfileKeeper, gpu: NvmlProbe) -> dict[str, str]:
    """What decides whether one engine's best profile is another's, by the key naming it:
    its GPUs' model, count and memory, its CPUs, its starting profile."""
    name, count = gpu.identity(spec.engine.gpus)
    facts = gpu.facts(spec.engine.gpus)
    memory = f", {facts.total_gib:.1f} GiB" if facts is not None else ""
    return {"engine.gpus": f"{count} x {name}{memory}",
            "engine.cpu_affinity": f"{_cpu_count(spec.cpus)} CPUs" if spec.cpus else "all CPUs",
            "engine.memory": str(keeper.policy.configured.to_dict())}


def alike_replica_keys(cfg: Config, specs: Sequence[ReplicaSpec], gpu: NvmlProbe,
                       first: ProfileKeeper) -> list[str]:
    """The learned key of every engine ``run`` starts, engine 0's first, each as that
    engine's own supervisor computes it (its GPUs by UUID, its CPU list), so that every
    replica starts from what tune measured on engine 0. Raises ``ConfigError`` (78) when
    a replica is not like engine 0 (another GPU model, count or memory, another number of
    CPUs, another starting profile): what engine 0 measured says nothing of it."""
    keys = [first.key(specs[0].engine, cfg.ocr)]
    kind = _replica_kind(specs[0], first, gpu)
    for spec in specs[1:]:
        keeper = ProfileKeeper(spec.engine, cfg.ocr, gpu=gpu, store=None, cpus=spec.cpus,
                               log=log)
        other = _replica_kind(spec, keeper, gpu)
        differ = [k for k in kind if other[k] != kind[k]]
        if differ:
            raise ConfigError([ConfigProblem(
                differ[0], f"chandrad tune measures engine 0 and keeps its profile for every "
                f"replica, but engine {spec.id} is not like engine 0 ("
                + "; ".join(f"{k}: {other[k]} vs {kind[k]}" for k in differ)
                + "): tune each kind of engine on its own, with a copy of the config whose "
                "engine.gpus (or engine.cpu_affinity) selects only that kind; each replica "
                "of the daemon loads the profile tuned for its own GPUs",
                str(cfg.path), key_line_of(cfg, differ[0]), "tune_replicas_differ")])
        keys.append(keeper.key(spec.engine, cfg.ocr))
    return keys


# ----------------------------------------------------------------- measuring
class Tuner:
    """One tune: the engine starts of the search, the levels measured on each."""

    def __init__(self, cfg: Config, pages: list[ocr.PageImage], deadline: float,
                 view: Any, max_starts: int | None = None) -> None:
        specs = plan_engines(cfg)
        spec = specs[0]
        self.cfg = cfg
        self.spec = spec
        self.engine = dataclasses.replace(
            spec.engine, downshift=dataclasses.replace(spec.engine.downshift, enabled=False))
        self.pages = pages
        self.deadline = deadline
        self.max_starts = max_starts
        self.starts = 0
        self._save: Callable[[MemoryProfile], None] = lambda _profile: None
        self._saved: MemoryProfile | None = None
        self.view = view
        self.gpu = NvmlProbe()
        self.on_gpu = self.gpu.facts(spec.engine.gpus) is not None
        self.flag_checks = FlagChecks(FlagVerdictCache(
            flag_cache_dir(cfg.daemon.state_dir, os.environ)))
        keeper = ProfileKeeper(spec.engine, cfg.ocr, gpu=self.gpu, store=None, cpus=spec.cpus,
                               log=log)
        #: Every engine's learned key, engine 0's first: the replicas are alike, so each
        #: starts from what engine 0 measures (else ConfigError, before any start).
        self.keys = alike_replica_keys(cfg, specs, self.gpu, keeper)
        self.policy = TunePolicy(keeper.policy.configured)
        self.stop = asyncio.Event()
        self.start_s = 0.0  # the last engine start's seconds: whether another fits the budget
        per_token = model_files.pixels_per_image_token(spec.engine.model)
        self.pixels_per_token = per_token or PIXELS_PER_IMAGE_TOKEN
        self.sampling = ocr.first_sampling()
        self.variants = PageVariants(pages)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    async def run(self, save: Callable[[MemoryProfile], None]) -> None:
        """The search until it ends, the budget is spent or ``stop`` is set; ``save`` is
        called with each new best profile, as soon as it is measured."""
        self._save = save
        while not self.stop.is_set() and (step := self.policy.next_step()) is not None:
            if self.left() < self.start_s:
                self.policy.stop(OUT_OF_TIME)
                break
            if self.max_starts is not None and self.starts >= self.max_starts:
                self.policy.stop(f"{self.starts} engine start(s), as --max-starts allows")
                break
            self.starts += 1
            await self._step(step)
        if self.stop.is_set():
            self.policy.ended = "interrupted"

    async def _step(self, step: EngineStep) -> None:
        """Start the engine of ``step``, measure its levels, stop it."""
        engine = EngineSupervisor(
            self.engine, self.cfg.ocr, gpu=self.gpu, profiles=None,
            session_file=self.cfg.daemon.state_dir / f"{engine_name(self.spec.id)}.session",
            engine_id=self.spec.id, cpus=self.spec.cpus, flag_checks=self.flag_checks)
        engine.policy.reset(step.profile, self.engine.downshift)
        changed = asyncio.Event()
        engine.on_change = lambda _new, _reason: changed.set()
        self.view.step(step, "starting")
        t0 = time.monotonic()
        task = asyncio.create_task(engine.run())
        try:
            state = await self._started(engine, changed, task)
            self.start_s = time.monotonic() - t0
            if state is not EngineState.READY:
                if state is not None:  # None: stopped (Ctrl-C, the budget)
                    failure = engine.last_failure
                    self.policy.failed(step, str(failure.cls) if failure else state.value,
                                       failure.numbers if failure else None)
                    self.view.measured(self.policy.measures[-1])
                elif not self.stop.is_set():
                    self.policy.stop(OUT_OF_TIME)
                return
            dispatcher = Dispatcher([engine])
            try:
                await self._send(dispatcher, 1)  # the first request's warm-up, not measured
            except EngineUnavailable:
                if engine.last_failure is None:
                    raise
                self.policy.failed(dataclasses.replace(step, levels=step.levels[:1]),
                                   str(engine.last_failure.cls), engine.last_failure.numbers)
                self.view.measured(self.policy.measures[-1])
                return
            for level in step.levels:
                measure = await self._level(engine, dispatcher, level, step)
                if measure is None:
                    return
                self.view.measured(measure)
                rising = self.policy.record(measure)
                self._keep()
                if not rising:
                    return
        finally:
            await engine.shutdown()
            await task

    def _keep(self) -> None:
        """Save the best profile if it changed (Ctrl-C or a kill loses no measure)."""
        profile = self.policy.best_profile()
        if profile is not None and profile != self._saved:
            self._save(profile)
            self._saved = profile

    async def _started(self, engine: EngineSupervisor, changed: asyncio.Event,
                       task: asyncio.Task[None]) -> EngineState | None:
        """READY, FAILED or FATAL once the engine gets there; None when stopped first.
        Raises what ended the supervisor's run (vLLM's parser refusing a flag: 78)."""
        while True:
            if task.done():
                task.result()
                return None
            state = engine.state
            if state in (EngineState.READY, EngineState.FAILED, EngineState.FATAL,
                         EngineState.BACKOFF):
                return EngineState.FAILED if state is EngineState.BACKOFF else state
            if self.stop.is_set() or self.left() <= 0:
                return None
            changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout=1.0)

    async def _send(self, dispatcher: Dispatcher, count: int) -> None:
        for _ in range(count):
            await dispatcher.chat(await self._body(dispatcher),
                                  timeout=self.cfg.ocr.request_timeout)

    async def _body(self, dispatcher: Dispatcher) -> ChatBody:
        """The daemon's request for the next page variant (marked off the event loop)."""
        page = await asyncio.to_thread(self.variants.next)
        prompt = estimate_prompt_tokens(page.width, page.height, self.pixels_per_token)
        temperature, top_p = self.sampling
        return ocr.encode_chat_request(
            page, model=dispatcher.served_model_name, prompt_type=self.cfg.ocr.prompt_type,
            max_output_tokens=ocr.request_max_tokens(
                dispatcher.max_output_tokens, dispatcher.max_model_len, prompt),
            temperature=temperature, top_p=top_p)

    async def _level(self, engine: EngineSupervisor, dispatcher: Dispatcher, level: int,
                     step: EngineStep) -> Measure | None:
        """``level`` pages at once until ``count`` are answered: the rate with the engine
        full all along (the pages still in flight at the end are cut, not waited for).
        None: stopped or out of time (nothing recorded), or the engine failed (recorded)."""
        count = max(MIN_LEVEL_PAGES, PAGES_PER_LEVEL * level)
        done = 0
        finished = asyncio.Event()
        self.view.level(level, count)

        async def worker() -> None:
            nonlocal done
            while not finished.is_set():
                await dispatcher.chat(await self._body(dispatcher),
                                      timeout=self.cfg.ocr.request_timeout)
                done += 1
                self.view.page(done)
                if done >= count:
                    finished.set()

        t0 = time.monotonic()
        workers = [asyncio.create_task(worker()) for _ in range(level)]
        ends = [asyncio.create_task(finished.wait()), asyncio.create_task(self.stop.wait()),
                asyncio.create_task(asyncio.sleep(max(self.left(), 0)))]
        try:  # a worker ends early only by an error; the rest end with ``finished``
            await asyncio.wait([*ends, *workers], return_when=asyncio.FIRST_COMPLETED)
            seconds = time.monotonic() - t0
        finally:
            for task in (*workers, *ends):
                task.cancel()
            await asyncio.gather(*workers, *ends, return_exceptions=True)
        profile = step.profile
        tokens = profile.max_num_batched_tokens or self.policy.start_tokens
        if finished.is_set():
            return Measure(level, tokens, done, seconds,
                           engine_memory(engine, self.gpu, self.on_gpu))
        error = next((w.exception() for w in workers
                      if not w.cancelled() and w.exception() is not None), None)
        if error is None:  # stopped, or the budget spent
            if not self.stop.is_set():
                self.policy.stop(OUT_OF_TIME)
            return None
        if isinstance(error, EngineUnavailable) and engine.last_failure is not None:
            self.policy.failed(dataclasses.replace(step, levels=(level,)),
                               str(engine.last_failure.cls), engine.last_failure.numbers)
            self.view.measured(self.policy.measures[-1])
            return None
        raise error


# ----------------------------------------------------------------- the terminal
class View:
    """Progress on ``out``: a rich bar over the time budget on a terminal, else plain lines."""

    def __init__(self, out: TextIO, tty: bool, budget_s: float) -> None:
        self.out, self.tty, self.budget_s = out, tty, budget_s
        self.t0 = time.monotonic()
        self._progress: Any = None
        self._task: Any = None
        self._what = ""

    def __enter__(self) -> View:
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("chandrad tune"), BarColumn(),
                                      TextColumn("{task.description}"), TimeElapsedColumn(),
                                      console=Console(file=self.out), transient=True)
            self._progress.__enter__()
            self._task = self._progress.add_task("", total=self.budget_s)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.__exit__(None, None, None)
            self._progress = None

    def _show(self, what: str, line: bool = True) -> None:
        self._what = what
        if self._progress is not None:
            self._progress.update(self._task, description=what,
                                  completed=min(time.monotonic() - self.t0, self.budget_s))
        elif line:
            self.out.write(f"tune: {what}\n")
            self.out.flush()

    def step(self, step: EngineStep, what: str) -> None:
        p = step.profile
        self._show(f"engine {what}: max_num_seqs {p.max_num_seqs}, max_num_batched_tokens "
                   f"{p.max_num_batched_tokens}")

    def level(self, level: int, count: int) -> None:
        self._count = count
        self._level = level
        self._show(f"measuring {level} page(s) at once: 0/{count}", line=False)

    def page(self, done: int) -> None:
        self._show(f"measuring {self._level} page(s) at once: {done}/{self._count}",
                   line=False)

    def measured(self, m: Measure) -> None:
        if m.failure:
            self._show(f"max_num_seqs {m.max_num_seqs}, max_num_batched_tokens "
                       f"{m.max_num_batched_tokens}: over the edge ({m.failure})")
        else:
            self._show(f"{m.max_num_seqs} at once, max_num_batched_tokens "
                       f"{m.max_num_batched_tokens}: {m.pages} pages in {m.seconds:.1f} s, "
                       f"{m.pages_per_s * 60:.1f} pages/min")


def print_table(outcome: TuneOutcome, out: TextIO, tty: bool) -> None:
    """The before/after table, then what was kept and why the search ended."""
    rows = table_rows(outcome.policy)
    columns = ("max_num_seqs", "max_num_batched_tokens", "memory used", "pages", "pages/s",
               "pages/min", "note")
    if tty and rows:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="chandrad tune", title_justify="left")
        for col in columns:
            table.add_column(col, justify="left" if col == "note" else "right")
        for row in rows:
            table.add_row(*(row[c] for c in columns))
        Console(file=out).print(table)
    elif rows:
        out.write("| " + " | ".join(columns) + " |\n")
        out.write("|" + "---|" * len(columns) + "\n")
        for row in rows:
            out.write("| " + " | ".join(row[c] for c in columns) + " |\n")
    policy = outcome.policy
    first = next((m for m in policy.measures if not m.failure), None)
    best = policy.best
    if first is not None and best is not None:
        gain = best.pages_per_s / first.pages_per_s if first.pages_per_s else 0.0
        out.write(f"before: {first.pages_per_s * 60:.1f} pages/min (max_num_seqs "
                  f"{first.max_num_seqs}, max_num_batched_tokens {first.max_num_batched_tokens})"
                  f"; after: {best.pages_per_s * 60:.1f} pages/min (max_num_seqs "
                  f"{best.max_num_seqs}, max_num_batched_tokens {best.max_num_batched_tokens})"
                  f"; x{gain:.2f}\n")
    if outcome.saved_key:
        also = (f" and, alike, of the {outcome.saved_for - 1} other replica(s), each under its "
                "own key") if outcome.saved_for > 1 else ""
        out.write(f"kept as the learned profile of {outcome.saved_key}{also}\n")
    else:
        out.write("nothing kept: no profile was measured\n")
    out.write(f"ended: {policy.ended or 'done'}\n")
    out.flush()


# ----------------------------------------------------------------- the entry point
def run_tune(cfg: Config, files: Path | None, minutes: float, out: TextIO,
             tty: bool | None = None, max_starts: int | None = None) -> TuneOutcome:
    """Tune the engine of ``cfg`` on this host for ``minutes`` at most; Ctrl-C stops it,
    keeping the best measured so far. Raises ``ConfigError`` (78) when a daemon holds the
    state dir, ``InputError`` when no calibration page renders."""
    if tty is None:
        tty = out.isatty()
    cfg.daemon.state_dir.mkdir(parents=True, exist_ok=True)
    # Left open until the process ends: whatever logs during teardown still has a stream.
    log_file = (cfg.daemon.state_dir / LOG_NAME).open("a", encoding="utf-8")
    configure_logging("json", cfg.daemon.log_level, stream=log_file)
    store = open_store(cfg)  # the daemon's lock: refused while it runs, held meanwhile
    saved = ""
    try:
        with tempfile.TemporaryDirectory(prefix="chandrad-tune-") as scratch:
            paths = calibration_files(files, Path(scratch))
            pages = render_pages(paths, cfg, cfg.ocr.max_pixels)
        budget = minutes * 60
        with View(out, tty, budget) as view:
            tuner = Tuner(cfg, pages, time.monotonic() + budget, view, max_starts)

            def save(profile: MemoryProfile) -> None:
                nonlocal saved
                for key in tuner.keys:  # every replica's (alike: alike_replica_keys)
                    store.save_learned_profile(key, {**profile.to_dict(), TUNED_MARK: True})
                    log.info("tune_profile_saved", key=key, profile=profile.to_dict())
                saved = tuner.keys[0]

            async def main() -> None:
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, tuner.stop.set)
                await tuner.run(save)

            asyncio.run(main())
        outcome = TuneOutcome(tuner.policy, tuner.stop.is_set(), saved,
                              len(tuner.keys) if saved else 0)
    finally:
        store.close()
    print_table(outcome, out, tty)
    return outcome
