"""The pipeline's own rules, on the real Pipeline, Store (SQLite), RenderPool (worker
processes) and EngineSupervisor, with real files in real folders.

The engine is the only stand-in, and only at the process boundary: the stand-in engine
process (tests/standin_engine.py, driven through :class:`StandinEngine`) serves
``/health``, ``/v1/models``, ``/metrics`` and ``/v1/chat/completions``, and the supervisor
watches it as a remote engine (``engine.url``). It answers per page (told apart by the
page image's width) as each test needs: a layout, an error status, or slowly. These rules
need no inference, and a stand-in makes the failures they guard against deterministic.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageDraw
from standin_engine import StandinServer, standin_server
from waiting import wait_until_async

import chandrad.pipeline as pipeline_module
from chandrad.config import Config, load_config
from chandrad.daemon import NvmlProbe
from chandrad.engine.dispatch import Dispatcher
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import InternalError
from chandrad.outputs import move_to
from chandrad.pipeline import Pipeline, sha256_file
from chandrad.render import RenderPool
from chandrad.states import EngineState, JobState, PageState, PipelineMode
from chandrad.store import Job, Store
from chandrad.tasks import TaskSupervisor

MODEL = "standin"


@dataclass
class Reply:
    """How the stand-in answers a page: status, delay, content."""

    status: int = 200
    delay: float = 0.0
    content: str = '<div data-bbox="10 10 990 200" data-label="Text"><p>Stand-in page.</p></div>'
    raw: bytes | None = None  # a body that is not a chat completion

    def scenario(self) -> dict[str, Any]:
        """This reply in the stand-in engine's scenario (tests/standin_engine.py)."""
        reply: dict[str, Any] = {"status": self.status, "delay_s": self.delay,
                                 "content": self.content}
        if self.raw is not None:
            reply["raw"] = self.raw.decode()
        return reply


class StandinEngine:
    """The stand-in engine process, answering per page (told apart by the image's width)."""

    def __init__(self, server: StandinServer) -> None:
        self.server = server

    @property
    def url(self) -> str:
        return self.server.url

    def reply(self, width: int, reply: Reply) -> None:
        """How pages of this width are answered from the next request on."""
        replies = {**self.server.scenario.get("replies", {}), f"width:{width}": reply.scenario()}
        self.server.update(replies=replies)

    def reply_default(self, reply: Reply) -> None:
        """How the other pages are answered from the next request on."""
        self.server.update(default=reply.scenario())

    def requests(self) -> list[dict[str, Any]]:
        """The chat requests so far, at their arrival."""
        return self.server.chats()

    def widths(self) -> list[int]:
        return [int(e["width"]) for e in self.server.chats()]

    def held_max(self) -> int:
        """The most chat requests the engine held at once."""
        return max((int(e["running"]) for e in self.server.chats()), default=0)


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[StandinEngine]:
    with standin_server(tmp_path / "standin-engine", {"default": Reply().scenario()},
                        served=MODEL) as server:
        yield StandinEngine(server)


def make_image(path: Path, width: int = 1120, height: int = 1400, text: str = "page") -> Path:
    """A real PNG with some text on it; ``width`` picks the stand-in's reply (the page is
    sent at this width: it is on the 28-px grid and within the pixel budget)."""
    img = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(img).text((40, 40), text, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format="PNG")
    return path


def make_tiff(path: Path, widths: list[int], height: int = 1400) -> Path:
    """A multi-page TIFF, one page per width."""
    frames = [Image.new("RGB", (w, height), "white") for w in widths]
    for i, frame in enumerate(frames):
        ImageDraw.Draw(frame).text((40, 40), f"page {i + 1}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, format="TIFF", save_all=True, append_images=frames[1:])
    return path


@dataclass
class Folders:
    input: Path
    output: Path
    done: Path
    failed: Path


def folders(root: Path, name: str) -> Folders:
    f = Folders(root / name / "in", root / name / "out", root / name / "done",
                root / name / "failed")
    for p in (f.input, f.output, f.done, f.failed):
        p.mkdir(parents=True, exist_ok=True)
    return f


def write_config(root: Path, standin: StandinEngine, watches: list[Folders],
                 engine_lines: str = "", **ocr: Any) -> Config:
    # min_side_px fixed: the stand-in tells pages apart by their rendered width, and
    # "auto" renders images at Chandra's 1536 px minimum.
    ocr_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in
                          {"retries": 1, "render_workers": 1, "min_side_px": 1024,
                           **ocr}.items())
    watch_text = "\n".join(f"""
[[watch]]
input = "{w.input}"
create_input = true
output = "{w.output}"
done = "{w.done}"
failed = "{w.failed}"
""" for w in watches)
    path = root / "chandrad.toml"
    path.write_text(f"""
[daemon]
state_dir = "{root / 'state'}"
{watch_text}
[engine]
url = "{standin.url}"
served_model_name = "{MODEL}"
model = "{MODEL}"
{engine_lines}
[ocr]
{ocr_lines}
""")
    return load_config(path)


def accept(store: Store, watch: Folders, path: Path, watch_index: int = 0,
           duplicates: str = "process") -> Job:
    """Record a settled file as the watcher + intake would (real hash, real stat)."""
    st = path.stat()
    root = Path(os.path.realpath(watch.input))
    job = store.accept(watch_index, root, root / path.relative_to(watch.input), st.st_size,
                       st.st_mtime, sha256_file(path), duplicates)
    assert job is not None
    return job


@dataclass
class Running:
    pipeline: Pipeline
    store: Store
    engine: EngineSupervisor
    pool: RenderPool

    def job(self, job_id: int) -> Job:
        job = self.store.get(job_id)
        assert job is not None
        return job

    async def wait(self, what: str, predicate: Callable[[], bool],
                   timeout: float = 60.0) -> None:
        def jobs() -> str:
            return "jobs: " + repr([(j.id, j.state.value, j.error_code, j.error_message)
                                    for j in self.store.list_jobs()])

        await wait_until_async(predicate, timeout, what, every=0.1, context=jobs)

    async def wait_finished(self, job_id: int, timeout: float = 60.0) -> Job:
        await self.wait(f"job {job_id} to finish",
                        lambda: self.job(job_id).state not in (JobState.PENDING,
                                                               JobState.RUNNING), timeout)
        return self.job(job_id)


@contextlib.asynccontextmanager
async def running(config: Config, store: Store | None = None,
                  render_timeout: float = 300.0) -> AsyncIterator[Running]:
    """The real pipeline with its real parts, as the daemon wires them."""
    own_store = store is None
    store = store or Store.open(config.daemon.state_dir)
    engine = EngineSupervisor(config.engine, config.ocr, gpu=NvmlProbe(), profiles=store)
    pool = RenderPool(config.ocr.render_workers, timeout=render_timeout)
    pipeline = Pipeline(config, store, Dispatcher([engine]), pool)
    engine_task = asyncio.create_task(engine.run())
    tasks = TaskSupervisor()
    tasks.start("intake", pipeline.intake_loop, quarantine=pipeline.quarantine)
    tasks.start("dispatch", pipeline.dispatch_loop, quarantine=pipeline.quarantine)
    run = Running(pipeline, store, engine, pool)
    try:
        await run.wait("the engine", lambda: engine.state is EngineState.READY, 30)
        yield run
    finally:
        # Python 3.11's wait_for can swallow a cancel that races its timeout: insist.
        for name in ("intake", "dispatch"):
            runner = tasks.runner(name)
            while runner is not None and not runner.done():
                runner.cancel()
                await asyncio.wait({runner}, timeout=1.0)
        for task in list(pipeline._active.values()):
            task.cancel()
        await asyncio.gather(*pipeline._active.values(), return_exceptions=True)
        await engine.shutdown()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(engine_task, 30)
        pool.close()
        if own_store:
            store.close()


def run_async(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(body())


async def _nothing() -> None:
    pass


def _task_serial() -> int:
    """asyncio numbers the tasks it creates (``Task-<n>``): the last number given."""
    task = asyncio.get_running_loop().create_task(_nothing())
    task.cancel()
    return int(task.get_name().rsplit("-", 1)[1])


async def tasks_started_over(seconds: float) -> int:
    """How many asyncio tasks the process starts while the loop runs for ``seconds``."""
    before = _task_serial()
    await asyncio.sleep(seconds)
    return _task_serial() - before - 1


# ----------------------------------------------------------------- a job's watch and state


def test_a_job_is_running_in_the_store_from_the_step_that_dispatches_it(
        tmp_path: Path, standin: StandinEngine) -> None:
    """No job the dispatcher has taken is still ``pending`` in the store at any turn of the
    event loop. A job marked running only when its task first ran could be stamped
    started after a SIGTERM that came in between (a fresh-clone CI run: "jobs started
    after SIGTERM" in test_sigterm_with_a_backlog_finishes_in_flight_work_only_and_exits)."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])

    async def body() -> None:
        async with running(config) as run:
            run.pipeline.set_mode(PipelineMode.PAUSED)  # no job starts while they are accepted
            jobs = [accept(run.store, w, make_image(w.input / f"doc{i}.png", text=str(i)))
                    for i in range(12)]
            behind: list[int] = []
            run.pipeline.set_mode(PipelineMode.RUNNING)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                # Every turn of the loop: the jobs dispatched so far against the store.
                pending = {j.id for j in run.store.list_jobs() if j.state is JobState.PENDING}
                behind += sorted(pending & set(run.pipeline._active))
                if not pending and not run.pipeline._active:
                    break
                await asyncio.sleep(0)
            assert not behind, f"dispatched jobs still pending in the store: {behind}"
            assert all(run.job(j.id).state is JobState.DONE for j in jobs)

    run_async(body)


def test_job_follows_its_watch_by_input_folder_not_position(tmp_path: Path,
                                                           standin: StandinEngine) -> None:
    """A restart whose config reorders the watches sends the job's outputs and input to
    its own watch's folders, not to the watch now at its old position."""
    a, b = folders(tmp_path, "a"), folders(tmp_path, "b")
    store = Store.open(write_config(tmp_path, standin, [a, b]).daemon.state_dir)
    job = accept(store, b, make_image(b.input / "doc_b.png"), watch_index=1)
    reordered = write_config(tmp_path, standin, [b, a])

    async def body() -> None:
        async with running(reordered, store) as run:
            done = await run.wait_finished(job.id)
            assert done.state is JobState.DONE
            assert (b.done / "doc_b.png").is_file() and (b.output / "doc_b").is_dir()
            assert not any(a.done.iterdir()) and not any(a.output.iterdir())

    try:
        run_async(body)
    finally:
        store.close()


def test_job_whose_watch_was_removed_is_held_visibly(tmp_path: Path,
                                                     standin: StandinEngine) -> None:
    """A restart without the job's watch: the job is held, without the dispatcher
    spinning on it, listed in status with the reason; a drain does not wait for it, and
    it runs to its own folders once the watch is back."""
    a, c = folders(tmp_path, "a"), folders(tmp_path, "c")
    with_c = write_config(tmp_path, standin, [a, c])
    store = Store.open(with_c.daemon.state_dir)
    job = accept(store, c, make_image(c.input / "doc_c.png"), watch_index=1)
    # One held for unwritable outputs before its watch went: counted once, as removed.
    unwritable = accept(store, c, make_image(c.input / "doc_c2.png", text="two"), watch_index=1)
    store.set_job_state(unwritable.id, JobState.RUNNING)
    store.set_job_state(unwritable.id, JobState.HELD, error_code="output_unwritable")
    without_c = write_config(tmp_path, standin, [a])

    async def body() -> None:
        async with running(without_c, store) as run:
            await asyncio.sleep(1.0)
            started = await tasks_started_over(3.0)
            assert started < 60, f"the dispatcher spins on the held job: {started} tasks"
            assert run.job(job.id).state is JobState.PENDING
            assert (c.input / "doc_c.png").is_file()
            held = run.pipeline.held()
            assert held["count"] == 2, held
            assert [(j["id"], j["reason"]) for j in held["jobs"]] == [
                (job.id, "watch_removed"), (unwritable.id, "watch_removed")]
            assert str(c.input.resolve()) in str(held["jobs"][0]["message"])
            assert run.pipeline.held_counts() == {"watch_removed": 2}
            assert run.pipeline.idle()
        async with running(with_c, store) as run:
            for one in (job, unwritable):
                done = await run.wait_finished(one.id)
                assert done.state is JobState.DONE
            assert (c.done / "doc_c.png").is_file() and (c.done / "doc_c2.png").is_file()
            assert run.pipeline.held()["count"] == 0
            assert run.pipeline.held_counts() == {}

    try:
        run_async(body)
    finally:
        store.close()


def test_job_dispatched_just_before_its_watch_is_removed_goes_back_to_pending(
        tmp_path: Path, standin: StandinEngine) -> None:
    """A reload that removes a watch in the loop step after the dispatcher took one of its
    jobs (marked ``running``, its task not yet run): the job goes back to ``pending``, as
    every job of a removed watch is, instead of staying ``running`` with nothing running it."""
    a, c = folders(tmp_path, "a"), folders(tmp_path, "c")
    with_c = write_config(tmp_path, standin, [a, c])
    without_c = write_config(tmp_path, standin, [a])

    async def body() -> None:
        async with running(with_c) as run:
            run.pipeline.set_mode(PipelineMode.PAUSED)
            job = accept(run.store, c, make_image(c.input / "doc_c.png"), watch_index=1)
            run.pipeline.set_mode(PipelineMode.RUNNING)
            run.pipeline._start_jobs()  # the dispatcher's step ...
            assert run.job(job.id).state is JobState.RUNNING
            run.pipeline.config = without_c  # ... then the reload's, as daemon/reload.py
            await run.wait("the job's task to end", lambda: run.pipeline.idle())
            assert run.job(job.id).state is JobState.PENDING
            assert [(j["id"], j["reason"]) for j in run.pipeline.held()["jobs"]] == [
                (job.id, "watch_removed")]
            assert (c.input / "doc_c.png").is_file()

    run_async(body)


# ----------------------------------------------------------------- a job that cannot be failed


def test_job_that_cannot_be_failed_backs_off_and_stays_visible(tmp_path: Path,
                                                              standin: StandinEngine) -> None:
    """A bad input whose move to failed/ fails (here failed/ is a file, as it is in effect
    on a full or read-only disk) is retried with back-off, not re-dispatched at once;
    status lists it with the reason; once failed/ is usable the job fails normally."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])
    (w.input / "empty.pdf").write_bytes(b"")
    w.failed.rmdir()
    w.failed.write_text("not a folder")

    async def body() -> None:
        async with running(config) as run:
            job = accept(run.store, w, w.input / "empty.pdf")
            await run.wait("the job to start", lambda: run.job(job.id).attempts == 1)
            await asyncio.sleep(1.0)
            started = await tasks_started_over(3.0)
            # Each dispatch of the job is a task; the supervisor's probes are a few more.
            assert started < 60, f"the unfailable job is re-run at full speed: {started} tasks"
            await run.wait("a second try after the back-off",
                           lambda: run.pipeline.held()["jobs"][0]["failures"] >= 2)
            held = run.pipeline.held()["jobs"][0]
            assert (held["id"], held["reason"]) == (job.id, "backoff")
            assert "failed" in str(held["message"]) and held["retry_in_s"] <= 4.0
            assert run.job(job.id).state is JobState.RUNNING
            assert (w.input / "empty.pdf").is_file()
            w.failed.unlink()
            w.failed.mkdir()
            failed = await run.wait_finished(job.id, timeout=30)
            assert failed.state is JobState.FAILED and failed.error_code == "empty_input"
            assert (w.failed / "empty.pdf.error.json").is_file()
            assert run.pipeline.held()["count"] == 0

    run_async(body)


def test_job_backing_off_whose_watch_is_removed_is_held_once(tmp_path: Path,
                                                             standin: StandinEngine) -> None:
    """A job backing off when a reload removes its watch is held for one reason,
    ``watch_removed``, not also counted under ``backoff``; with the watch back it is
    listed as backing off again."""
    w, a = folders(tmp_path, "w"), folders(tmp_path, "a")
    both = write_config(tmp_path, standin, [w, a])
    only_a = write_config(tmp_path, standin, [a])
    (w.input / "empty.pdf").write_bytes(b"")
    w.failed.rmdir()
    w.failed.write_text("not a folder")  # the job cannot be failed: it backs off

    async def body() -> None:
        async with running(both) as run:
            job = accept(run.store, w, w.input / "empty.pdf")
            await run.wait("the back-off", lambda: run.pipeline.held_counts() == {"backoff": 1})
            run.pipeline.config = only_a  # what a reload does
            held = run.pipeline.held()
            assert held["count"] == 1, held
            assert [(j["id"], j["reason"]) for j in held["jobs"]] == [(job.id, "watch_removed")]
            assert run.pipeline.held_counts() == {"watch_removed": 1}
            run.pipeline.config = both
            assert [(j["id"], j["reason"]) for j in run.pipeline.held()["jobs"]] == [
                (job.id, "backoff")]
            assert run.pipeline.held_counts() == {"backoff": 1}

    run_async(body)


# ----------------------------------------------------------------- a poison page


@pytest.mark.parametrize("failure", [Reply(status=500), Reply(delay=2.0)],
                         ids=["5xx", "request-timeout"])
def test_poison_page_ends_instead_of_retrying_forever(tmp_path: Path, standin: StandinEngine,
                                                      failure: Reply) -> None:
    """A page whose every request fails (a 5xx, or longer than ocr.request_timeout) while
    the engine stays healthy is given back uncharged MAX_FREE_RELEASES times, then its
    failures count: it fails after ocr.retries, the job ends partial and a drain can
    finish. Its sibling page is done."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w], request_timeout=1.0)
    standin.reply(1148, failure)  # page 2 of 2 is poison
    make_tiff(w.input / "two.tif", [1120, 1148])

    async def body() -> None:
        async with running(config) as run:
            job = accept(run.store, w, w.input / "two.tif")
            finished = await run.wait_finished(job.id, timeout=60)
            assert finished.state is JobState.PARTIAL
            good, poison = run.store.pages(job.id)
            assert good.state is PageState.DONE and poison.state is PageState.FAILED
            free = pipeline_module.MAX_FREE_RELEASES
            assert poison.releases == free
            assert poison.error is not None and "request failed" in poison.error
            # retries = 1: two charged requests after the free ones.
            assert standin.widths().count(1148) == free + 2
            # The job's state is stored before its task returns: idle follows, not at once.
            await run.wait("the pipeline to be idle", run.pipeline.idle, timeout=10)

    run_async(body)


# ----------------------------------------------------------------- an input replaced under a job


def _metadata(out_dir: Path) -> dict[str, Any]:
    found = list(out_dir.glob("*metadata.json")) + list(out_dir.glob("*.json"))
    assert found, f"no JSON output in {out_dir}: {list(out_dir.iterdir())}"
    for path in found:
        data = json.loads(path.read_text())
        meta = data.get("metadata", data) if isinstance(data, dict) else {}
        if isinstance(meta, dict) and "source_sha256" in meta:
            return meta
    raise AssertionError(f"no source_sha256 in {found}")


def test_file_replaced_while_pending_is_processed_as_new_content(
        tmp_path: Path, standin: StandinEngine) -> None:
    """A job accepted for one content whose file is replaced before it starts: the job
    ends cancelled (input_replaced) and the new content is a new job whose outputs name
    the new content's sha256, and which moves exactly that content to done/."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])
    store = Store.open(config.daemon.state_dir)
    doc = make_image(w.input / "doc.png", text="version one")
    old = accept(store, w, doc)
    make_image(tmp_path / "v2.png", text="version two, longer")
    os.replace(tmp_path / "v2.png", doc)
    new_sha = sha256_file(doc)

    async def body() -> None:
        async with running(config, store) as run:
            await run.wait_finished(old.id)
            replaced = run.job(old.id)
            assert (replaced.state, replaced.error_code) == (JobState.CANCELLED,
                                                             "input_replaced")
            new = [j for j in run.store.list_jobs() if j.id != old.id]
            assert len(new) == 1 and new[0].sha256 == new_sha
            done = await run.wait_finished(new[0].id)
            assert done.state is JobState.DONE
            assert _metadata(w.output / "doc")["source_sha256"] == new_sha
            assert sha256_file(w.done / "doc.png") == new_sha

    try:
        run_async(body)
    finally:
        store.close()


def test_file_replaced_while_running_is_not_moved_with_old_results(
        tmp_path: Path, standin: StandinEngine) -> None:
    """The file is replaced while its page is at the engine: the running job must not
    move the new bytes to done/ under outputs made from the old ones. The new version,
    settled and submitted as the watcher does, is hashed and queued; it is processed
    from its own bytes."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])
    standin.reply(1120, Reply(delay=3.0))  # version one is slow at the engine
    doc = make_image(w.input / "doc.png", width=1120, text="version one")

    async def body() -> None:
        async with running(config) as run:
            old = accept(run.store, w, doc)
            await run.wait("the page at the engine", lambda: 1120 in standin.widths())
            make_image(tmp_path / "v2.png", width=1148, text="version two")
            os.replace(tmp_path / "v2.png", doc)
            new_sha = sha256_file(doc)
            st = doc.stat()
            run.pipeline.submit(0, Path(os.path.realpath(w.input)), doc.resolve(),
                                st.st_size, st.st_mtime)
            await run.wait("the new version queued",
                           lambda: any(j.sha256 == new_sha for j in run.store.list_jobs()))
            await run.wait_finished(old.id)
            assert run.job(old.id).state is JobState.CANCELLED
            new = next(j for j in run.store.list_jobs() if j.sha256 == new_sha)
            done = await run.wait_finished(new.id)
            assert done.state is JobState.DONE
            assert _metadata(w.output / "doc")["source_sha256"] == new_sha
            assert sha256_file(w.done / "doc.png") == new_sha
            assert not (w.done / "doc (1).png").exists()
            assert 1148 in standin.widths()  # the new version's page was OCR'd

    run_async(body)


def test_store_names_the_output_dir_the_document_was_written_to(
        tmp_path: Path, standin: StandinEngine) -> None:
    """A second doc.png with other content lands in ``doc (1)/`` (the first one owns
    ``doc/``): the job's ``output_dir`` in the store, which status, queue and batch
    summaries show, must name ``doc (1)``, not the directory it was kept out of."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])

    async def body() -> None:
        async with running(config) as run:
            first = accept(run.store, w, make_image(w.input / "doc.png", text="version one"))
            assert (await run.wait_finished(first.id)).output_dir == w.output / "doc"
            second_doc = make_image(w.input / "doc.png", text="version two, other bytes")
            second = accept(run.store, w, second_doc)
            done = await run.wait_finished(second.id)
            assert done.state is JobState.DONE, (done.error_code, done.error_message)
            assert done.output_dir == w.output / "doc (1)"
            assert _metadata(w.output / "doc (1)")["source_sha256"] == second.sha256

    run_async(body)


# ----------------------------------------------------------------- a crash between done/ and DONE


def test_crash_after_moving_input_to_done_completes_at_restart(
        tmp_path: Path, standin: StandinEngine) -> None:
    """The store as a crash leaves it between moving the input to done/ and recording
    DONE (every page done, job running, input already in done/ under a clashing name):
    the restarted pipeline finds the input in done/ and records the job done with its
    outputs, instead of failing it as corrupt_input. No page is recomputed."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])
    store = Store.open(config.daemon.state_dir)
    doc = make_image(w.input / "doc.png")
    (w.done / "doc.png").write_bytes(b"an older doc.png, another file")
    job = accept(store, w, doc)
    store.set_job_state(job.id, JobState.RUNNING, pages_total=1)
    store.init_pages(job.id, 1)
    store.claim_page(job.id, 0)
    store.finish_page(job.id, 0, width=1120, height=1400, seconds=1.0,
                      result={"markdown": "Stand-in page.", "html": "<p>Stand-in page.</p>",
                              "blocks": [], "images": [], "attempts": 1})
    moved = move_to(w.done, Path(os.path.realpath(w.input)), doc.resolve())
    assert moved.name == "doc (1).png"
    store.close()  # the crash: nothing more was recorded

    async def body() -> None:
        async with running(config) as run:
            done = await run.wait_finished(job.id)
            assert done.state is JobState.DONE, (done.error_code, done.error_message)
            assert done.final_path == moved
            # one name per document: done/doc (1).png goes with output/doc (1)/
            assert "Stand-in page." in (w.output / "doc (1)" / "doc.md").read_text()
            assert standin.requests() == []

    run_async(body)


# ----------------------------------------------------------------- timeouts


def test_render_timeout_times_the_work_not_the_wait_for_a_worker(tmp_path: Path) -> None:
    """Pages queued on one worker: each renders in well under the timeout, all together
    take longer than it. None may time out for having waited its turn.

    The queue is sized from the fastest of three single renders, for about three times
    the timeout: sized for 1.5 times from one sample and capped at 80 pages, it took
    3.9 s against the 5 s it had to pass in a fresh-clone CI run, once pages rendered in
    ~0.05 s."""
    page = make_image(tmp_path / "page.png", width=2240, height=2800)

    async def body() -> None:
        pool = RenderPool(1, timeout=3.0)
        try:
            await pool.probe(page, 10)  # start the worker
            await pool.render(page, 0, 1024, 6_291_456)  # load its imports
            singles = []
            for _ in range(3):
                t0 = time.monotonic()
                await pool.render(page, 0, 1024, 6_291_456)
                singles.append(time.monotonic() - t0)
            one = min(singles)
            assert one < pool.timeout / 10
            n = min(1000, int(3 * pool.timeout / one) + 2)
            t0 = time.monotonic()
            pages = await asyncio.gather(*(pool.render(page, 0, 1024, 6_291_456)
                                           for _ in range(n)))
            assert time.monotonic() - t0 > pool.timeout  # the queue was longer than it
            assert [p.width for p in pages] == [pages[0].width] * n
        finally:
            pool.close()

    run_async(body)


def test_a_timeout_does_not_fail_the_calls_sharing_the_pool(tmp_path: Path) -> None:
    """One page overruns the timeout and the pool is killed for it; calls running on the
    other worker at that moment are innocent: they rerun and succeed."""
    tiff = make_tiff(tmp_path / "pages.tif", [1120, 1148, 1176])
    # A page that never finishes, on any machine: opening a FIFO with no writer blocks.
    hang = tmp_path / "hang.png"
    os.mkfifo(hang)

    async def body() -> None:
        pool = RenderPool(2, timeout=8.0)
        try:
            await asyncio.gather(*(pool.probe(tiff, 10) for _ in range(2)))
            slow = asyncio.create_task(pool.render(hang, 0, 1024, 60_000_000))
            probed = 0
            while not slow.done():
                # Probes (no page imports: a worker restarts in well under the timeout)
                # keep the second worker busy; one is in flight when the pool is killed.
                assert (await pool.probe(tiff, 10)).page_count == 3  # raises if a victim
                probed += 1
            with pytest.raises(Exception, match="longer than 8 s"):
                slow.result()
            assert probed >= 3
        finally:
            pool.close()

    run_async(body)


def _big_layout(blocks: int) -> str:
    return "".join(f'<div data-bbox="10 {i % 900} 990 {i % 900 + 50}" data-label="Text">'
                   f"<p>block {i} with a few words in it</p></div>" for i in range(blocks))


def test_post_processing_timeout_fails_the_page_not_the_job(tmp_path: Path,
                                                           standin: StandinEngine) -> None:
    """A page whose answer takes longer than the render timeout to post-process is
    retried, then failed as a page (job partial); it is never claimed twice (which
    failed the whole job as internal_error)."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])
    # ~27 s of post-processing on the machine that wrote this (12,000 blocks took 4.5 s):
    # over the 8 s limit with a wide margin on a faster one.
    standin.reply(1148, Reply(content=_big_layout(60000)))
    make_tiff(w.input / "two.tif", [1120, 1148])

    async def body() -> None:
        async with running(config, render_timeout=8.0) as run:
            job = accept(run.store, w, w.input / "two.tif")
            finished = await run.wait_finished(job.id, timeout=120)
            assert finished.state is JobState.PARTIAL, (finished.error_code,
                                                        finished.error_message)
            good, slow = run.store.pages(job.id)
            assert good.state is PageState.DONE
            assert slow.state is PageState.FAILED and "post-processing" in (slow.error or "")
            assert standin.widths().count(1148) == 2  # retries = 1

    run_async(body)


def test_a_failing_page_cancels_its_siblings(tmp_path: Path, standin: StandinEngine) -> None:
    """When one page fails the job (here a reply that is not a chat completion), the
    job's other pages stop: the slow sibling's request is abandoned and its page given
    back, not completed for a job already failed."""
    w = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [w])
    standin.reply(1120, Reply(raw=b'{"choices": 5}'))
    standin.reply(1148, Reply(delay=4.0))
    make_tiff(w.input / "two.tif", [1148, 1120])

    async def body() -> None:
        async with running(config) as run:
            job = accept(run.store, w, w.input / "two.tif")
            await run.wait("both pages at the engine",
                           lambda: sorted(standin.widths()) == [1120, 1148])
            failed = await run.wait_finished(job.id)
            assert failed.state is JobState.FAILED
            await asyncio.sleep(5.0)  # the slow reply has come back by now
            states = [p.state for p in run.store.pages(job.id)]
            assert PageState.DONE not in states and PageState.IN_FLIGHT not in states, states
            assert standin.widths().count(1148) == 1

    run_async(body)


# ----------------------------------------------------------------- a full engine batch


def test_one_page_files_keep_the_engine_batch_full(tmp_path: Path,
                                                   standin: StandinEngine) -> None:
    """While rendered pages wait, the engine holds at least its ``max_num_seqs`` requests.
    40 one-page files: one-page jobs must fill the batch as a long PDF does (it
    held 10 of 16 when jobs were capped at half the capacity); the stand-in counts the
    requests it holds at once, and answers nothing until it holds 16 (its ``gate``), so
    the engine is the bottleneck whatever this box's render speed. With a fixed 2 s a
    page instead it held 13 on the 2-core box at load 11 (16 renders in 2 s needed)."""
    seqs = 16
    watch = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [watch],
                          engine_lines=f"[engine.memory]\nmax_num_seqs = {seqs}\n")
    standin.server.update(gate=seqs, gate_s=60)
    standin.reply_default(Reply(delay=0.5))
    files = [make_image(watch.input / f"p{i:02d}.png", text=f"page {i}") for i in range(40)]

    async def body() -> None:
        async with running(config) as run:
            jobs = [accept(run.store, watch, f) for f in files]
            run.pipeline._wake.set()
            for job in jobs:
                assert (await run.wait_finished(job.id, timeout=120)).state is JobState.DONE

    run_async(body)
    assert standin.held_max() >= seqs, (standin.held_max(), seqs)


def test_one_117_page_pdf_fills_a_64_seq_engine(tmp_path: Path, standin: StandinEngine,
                                                corpus_dir: Path) -> None:
    """Chandra's H100 setting, ``max_num_seqs = 64``: one long PDF alone (the corpus's
    117 pages) keeps at least 64 requests at the engine while rendered pages wait.
    The stand-in answers nothing until it holds 64 (its ``gate``), so the
    engine is the bottleneck whatever this box's render speed, then everything at once.
    With a fixed 6 s per page instead, renders never got ahead on the loaded 2-core box
    (it held 24) and the test proved nothing."""
    seqs = 64
    watch = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [watch],
                          engine_lines=f"[engine.memory]\nmax_num_seqs = {seqs}\n")
    standin.server.update(gate=seqs)
    pdf = watch.input / "long.pdf"
    pdf.write_bytes((corpus_dir / "good" / "digital_de-math-lecture-notes_117p_geotopo.pdf")
                    .read_bytes())

    async def body() -> None:
        async with running(config) as run:
            job = accept(run.store, watch, pdf)
            run.pipeline._wake.set()
            assert (await run.wait_finished(job.id, timeout=300)).state is JobState.DONE

    run_async(body)
    assert len(standin.requests()) == 117
    assert standin.held_max() >= seqs, (standin.held_max(), seqs)


def test_a_full_engine_has_half_a_batch_rendered_behind_it(tmp_path: Path,
                                                           standin: StandinEngine,
                                                           corpus_dir: Path) -> None:
    """With ``max_num_seqs = 64``, while the engine holds a full batch, chandrad renders
    ahead, so that when answers come back (vLLM finishes requests in bursts) the freed slots
    are refilled from pages already rendered, not one render at a time; and while rendered
    pages wait, the requests in flight are at the limit. The stand-in holds every request
    (its gate is never reached), the 117-page PDF gives pages to spare. With a render-ahead
    of 3 pages per worker, the one worker rendered 3 pages and idled while the engine was
    full; then a burst of answers held the window for post-processing and the engine's
    batch fell to a few requests (bench: 80 -> 3 in flight on the stand-in)."""
    seqs = 64
    watch = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [watch],
                          # it holds every request on purpose: not a hung engine here
                          engine_lines=f"progress_timeout = 0\n"
                          f"[engine.memory]\nmax_num_seqs = {seqs}\n")
    standin.server.update(gate=10_000, gate_s=600)
    pdf = watch.input / "long.pdf"
    pdf.write_bytes((corpus_dir / "good" / "digital_de-math-lecture-notes_117p_geotopo.pdf")
                    .read_bytes())
    waiting_seen: list[tuple[int, int]] = []  # (rendered pages waiting, requests in flight)

    async def body() -> None:
        async with running(config) as run:
            accept(run.store, watch, pdf)
            run.pipeline._wake.set()
            pipeline = run.pipeline

            def rendered_ahead() -> bool:
                if pipeline.pages_waiting:
                    waiting_seen.append((pipeline.pages_waiting, pipeline.requests_in_flight))
                return pipeline.pages_waiting >= seqs // 2

            # 112 pages to render on one worker: minutes at worst on a loaded 2-core box.
            await run.wait("half a batch rendered ahead of a full engine", rendered_ahead,
                           timeout=300)

    run_async(body)
    assert standin.held_max() >= seqs, (standin.held_max(), seqs)
    short = [s for s in waiting_seen if s[1] < seqs]
    assert not short, f"rendered pages waited while fewer than {seqs} were in flight: {short}"


def test_a_pause_sends_no_page_that_was_waiting_for_a_request_slot(
        tmp_path: Path, standin: StandinEngine, corpus_dir: Path) -> None:
    """``chandractl pause`` (the pipeline's mode ``paused``): the requests already at the engine
    finish, but a rendered page still waiting for a request slot is not sent when a slot
    frees; it goes on resume, and the job completes. It used to be sent: the pause was
    checked only before the page queued for its slot."""
    limit = 2
    watch = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [watch], max_in_flight=limit)
    # Every request is held ~15 s (the gate is never reached): time to pause with the
    # limit at the engine and rendered pages queued behind it.
    standin.server.update(gate=10_000, gate_s=15)
    pdf = watch.input / "fifteen.pdf"
    pdf.write_bytes((corpus_dir / "good" / "digital_federal-register_15p.pdf").read_bytes())

    async def body() -> None:
        async with running(config) as run:
            pipeline = run.pipeline
            job = accept(run.store, watch, pdf)
            pipeline._wake.set()
            # The pipeline counts a request before the engine has it: wait for both.
            await run.wait("the limit at the engine and a rendered page waiting",
                           lambda: pipeline.requests_in_flight == limit
                           and len(standin.requests()) == limit
                           and pipeline.pages_waiting >= 1, timeout=120)
            pipeline.set_mode(PipelineMode.PAUSED)  # what the daemon's pause does
            sent_at_pause = len(standin.requests())
            assert sent_at_pause == limit, standin.requests()
            await run.wait("the held requests answered",
                           lambda: pipeline.requests_in_flight == 0, timeout=60)
            for _ in range(20):  # 2 s: slots are free, pages are rendered, nothing goes
                await asyncio.sleep(0.1)
                assert len(standin.requests()) == sent_at_pause, (
                    f"{len(standin.requests()) - sent_at_pause} pages sent while paused")
            standin.server.update(gate=0)
            pipeline.set_mode(PipelineMode.RUNNING)  # resume
            finished = await run.wait_finished(job.id, timeout=180)
            assert finished.state is JobState.DONE, finished
            assert len({e["sha256"] for e in standin.requests()}) == 15

    run_async(body)


def test_a_pipeline_mode_edge_that_states_forbids_raises(
        tmp_path: Path, standin: StandinEngine) -> None:
    """The mode has one writer and explicit edges: a drain is not resumed, a stop is final."""
    config = write_config(tmp_path, standin, [folders(tmp_path, "w")])

    async def body() -> None:
        async with running(config) as run:
            pipeline = run.pipeline
            pipeline.set_mode(PipelineMode.DRAINING)
            with pytest.raises(InternalError, match="draining -> running"):
                pipeline.set_mode(PipelineMode.RUNNING)
            assert pipeline.mode.value == "draining"  # unchanged
            await pipeline.stop_jobs()
            assert pipeline.mode is PipelineMode.STOPPING
            with pytest.raises(InternalError, match="stopping -> draining"):
                pipeline.set_mode(PipelineMode.DRAINING)

    run_async(body)


# ----------------------------------------------------------------- write transactions per job


def test_a_one_page_job_commits_six_write_transactions(tmp_path: Path,
                                                       standin: StandinEngine) -> None:
    """Every write transaction is an fsync of the WAL on the event loop's thread
    (``synchronous=FULL``); a backlog of one-page files pays them per file.
    From start to ``done`` a one-page job needs six, each for a durability reason:
    ``running`` (counts the attempt), its pages, the page's claim and its result, where
    the input is going (before the move), and ``done``. The page count used to be
    written twice (``set_job_state(pages_total=)`` and ``init_pages``): seven."""
    watch = folders(tmp_path, "w")
    config = write_config(tmp_path, standin, [watch])
    image = make_image(watch.input / "one.png", text="one page")
    writes: list[list[str]] = []
    current: list[str] = []

    def trace(statement: str) -> None:
        word = statement.split(None, 1)[0].upper()
        if word == "BEGIN":
            current.clear()
        elif word == "COMMIT":
            if any(s.split(None, 1)[0].upper() in ("INSERT", "UPDATE", "DELETE")
                   for s in current):
                writes.append(list(current))
        else:
            current.append(statement)

    async def body() -> None:
        async with running(config) as run:
            job = accept(run.store, watch, image)
            run.store._conn.set_trace_callback(trace)
            run.pipeline._wake.set()
            assert (await run.wait_finished(job.id)).state is JobState.DONE
            run.store._conn.set_trace_callback(None)

    run_async(body)
    assert len(writes) == 6, "\n".join(" | ".join(s[:60] for s in tx) for tx in writes)
