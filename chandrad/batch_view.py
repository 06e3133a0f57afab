"""``chandrad batch`` for the operator: runs the daemon in batch mode, shows its progress,
prints the summary.

On a terminal: a rich progress bar (pages done/total, pages/s, ETA, engine state, files
finished). Otherwise (a pipe, a CI log): one plain line whenever the numbers or the
engine state change, at most one a second and at least one every 30 s. Afterwards a
summary: a table of the files that did not finish well, with the reason, and the totals.
The daemon's own log goes to ``<output>/.chandrad/batch.log`` (JSON lines), so it never
tears the bar. The exit status is chosen in ``cli.py`` from :class:`BatchOutcome`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from chandrad import names
from chandrad.batch import (
    LOG_NAME,
    BatchRun,
    FileResult,
    Progress,
    batch_config,
    plan,
    state_dir,
    summarize,
)
from chandrad.config import Config
from chandrad.ctl.render import duration
from chandrad.daemon import Daemon
from chandrad.errors import ConfigError, ExitCode
from chandrad.logs import configure_logging
from chandrad.store import Store

#: Plain mode: seconds between lines at most / at least.
PLAIN_MIN_S = 1.0
PLAIN_MAX_S = 30.0


@dataclass(frozen=True)
class BatchOutcome:
    """How a batch ended; ``cli.py`` maps it to the exit status."""

    results: list[FileResult]
    finished: bool  # False: stopped by Ctrl-C (or a signal) before the end
    daemon_exit: int  # the daemon's own status: 69 when the engine gave up

    @property
    def failed(self) -> list[FileResult]:
        return [r for r in self.results if not r.ok]


def _rate(p: Progress) -> str:
    return f"{p.pages_per_s:.2f} pages/s" if p.pages_per_s is not None else "- pages/s"


def _engine(p: Progress) -> str:
    return f"engine {p.engine}" + (f" ({p.engine_detail})" if p.engine_detail else "")


def _files(p: Progress) -> str:
    text = f"files {p.files_finished}/{p.files}"
    return text + (f" ({p.files_failed} failed)" if p.files_failed else "")


def plain_line(p: Progress) -> str:
    failed = f" ({p.pages_failed} failed)" if p.pages_failed else ""
    return (f"batch: {p.pages_done}/{p.pages_total} pages{failed}, {_rate(p)}, "
            f"ETA {duration(p.eta_s)}, {_engine(p)}, {_files(p)}, "
            f"elapsed {duration(p.elapsed_s)}")


def bar(p: Progress) -> Any:
    """The rich renderable of one progress snapshot."""
    from rich.console import Group
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    grid.add_column(no_wrap=True, justify="right")
    done = p.pages_done + p.pages_failed
    grid.add_row(Text("chandrad batch", style="bold"),
                 ProgressBar(total=float(max(p.pages_total, 1)), completed=float(done)),
                 f"{p.pages_done}/{p.pages_total} pages  {_rate(p)}  ETA {duration(p.eta_s)}")
    colour = {"ready": "green", "starting": "yellow", "backoff": "yellow", "failed": "red",
              "fatal": "bold red"}.get(p.engine, "")
    status = Text.assemble((_engine(p), colour), f"  {_files(p)}",
                           (f"  {p.pages_failed} page(s) failed" if p.pages_failed else "",
                            "red"), f"  elapsed {duration(p.elapsed_s)}",
                           ("  staging inputs…" if p.phase == "staging" else "", "dim"))
    return Group(grid, status)


class View:
    """Progress on ``out``: a live bar on a terminal, plain lines otherwise."""

    def __init__(self, out: TextIO, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self.last: Progress | None = None
        self._live: Any = None
        self._printed: tuple[str, float] = ("", 0.0)

    def __enter__(self) -> View:
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.out), auto_refresh=False,
                              transient=False, redirect_stderr=False, redirect_stdout=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None
        elif self.last is not None:
            self._plain(self.last, force=True)

    def update(self, p: Progress) -> None:
        self.last = p
        if self._live is not None:
            self._live.update(bar(p), refresh=True)
        else:
            self._plain(p)

    def _plain(self, p: Progress, force: bool = False) -> None:
        line = plain_line(p)
        key = line.split(", elapsed")[0].split(", ETA")[0] + _engine(p)
        last_key, last_at = self._printed
        now = time.monotonic()
        if force or (key != last_key and now - last_at >= PLAIN_MIN_S) or \
                now - last_at >= PLAIN_MAX_S:
            self.out.write(line + "\n")
            self.out.flush()
            self._printed = (key, now)


def print_summary(outcome: BatchOutcome, output: Path, last: Progress | None, out: TextIO,
                  tty: bool) -> None:
    """Which files did not finish well and why, then the totals and where things are."""
    failed = outcome.failed
    if failed:
        if tty:
            from rich.console import Console
            from rich.table import Table

            table = Table(title="files not done", title_justify="left")
            for col in ("file", "state", "pages", "reason"):
                table.add_column(col, overflow="fold")
            for r in failed:
                table.add_row(r.file, r.state, _pages(r), r.reason or "-")
            Console(file=out).print(table)
        else:
            out.write("files not done:\n")
            for r in failed:
                out.write(f"  {r.state}\t{r.file}\t{_pages(r)}\t{r.reason or '-'}\n")
    done = sum(1 for r in outcome.results if r.ok)
    already = sum(1 for r in outcome.results if r.state == "already_done")
    pages = sum(r.pages_done for r in outcome.results)
    line = (f"{len(outcome.results)} file(s): {done} done"
            + (f" ({already} already done before this run)" if already else "")
            + f", {len(failed)} not done; {pages} page(s) in {names.display(output)}")
    out.write(line + "\n")
    if not outcome.finished:
        if outcome.daemon_exit == ExitCode.UNAVAILABLE:
            reason = last.engine_detail if last is not None else ""
            out.write(f"stopped: the engine gave up ({reason}); see "
                      f"{names.display(state_dir(output) / LOG_NAME)}\n")
        else:
            out.write("interrupted: run the same command again to resume "
                      "(finished pages are kept)\n")
    out.write(f"log: {names.display(state_dir(output) / LOG_NAME)}\n")
    out.flush()


def _pages(r: FileResult) -> str:
    total = "?" if r.pages_total is None else str(r.pages_total)
    return f"{r.pages_done}/{total}" + (f" ({r.pages_failed} failed)" if r.pages_failed else "")


def run_batch(cfg: Config, inputs: Sequence[Path], output: Path, out: TextIO,
              tty: bool | None = None) -> BatchOutcome:
    """Plan, run the daemon in batch mode until done (or Ctrl-C), summarize.

    Raises ``errors.BatchInputError`` for inputs that cannot be used (cli: exit 2) and
    ``ConfigError`` for a bad config or an output whose state dir another chandrad holds
    (exit 78).
    """
    output = Path(os.path.realpath(output))
    entries = plan(inputs, output)
    if tty is None:
        tty = out.isatty()
    state = state_dir(output)
    state.mkdir(parents=True, exist_ok=True)
    run = BatchRun(entries)
    view = View(out, tty)
    run.on_progress = view.update
    daemon_exit = int(ExitCode.OK)
    # Left open until the process ends: whatever logs during teardown still has a stream.
    log_file = (state / LOG_NAME).open("a", encoding="utf-8")
    configure_logging("json", cfg.daemon.log_level, stream=log_file)
    with view:
        try:
            daemon_exit = asyncio.run(Daemon(batch_config(cfg, output), batch=run).serve())
        except KeyboardInterrupt:
            pass  # Ctrl-C before the daemon's own handler was set: nothing was started
        except ConfigError as exc:
            raise _as_batch_problem(exc) from None
    store = Store.open(state)
    try:
        results = summarize(store, run.entries)
    finally:
        store.close()
    outcome = BatchOutcome(results, run.finished, daemon_exit)
    print_summary(outcome, output, view.last, out, tty)
    return outcome


def _as_batch_problem(exc: ConfigError) -> ConfigError:
    """The state dir of a batch is ``--output``'s, not the config's ``daemon.state_dir``."""
    return ConfigError([dataclasses.replace(p, key="--output", file="", line=None)
                        if p.key == "daemon.state_dir" else p for p in exc.problems])
