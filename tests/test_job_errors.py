"""What a job's error says after the job recovers, and what systemd's ``STATUS=`` says about
held jobs, on the real daemon (``chandrad run``) with the stand-in engine process reached
through ``engine.url``, a real read-only bind mount, the real notify socket and the real
``chandractl``.

A held job (``output_unwritable``) shows in ``STATUS=`` while it waits, and so does one
backing off after an error; once its outputs can be written it ends ``done`` with no
error left in the store, ``queue`` or ``status``; a job retried by the operator after it
failed ends the same way. The failed attempt stays
in the log. Needs root for the bind mount.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest
from daemon_harness import Daemon, drop
from PIL import Image, ImageDraw
from standin_engine import StandinServer

pytestmark = pytest.mark.engine


class Notify:
    """A datagram socket bound where systemd's would be: every ``STATUS=`` the daemon sent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.received: list[str] = []

    def statuses(self) -> list[str]:
        while True:
            try:
                msg = self.sock.recv(1 << 20).decode()
            except BlockingIOError:
                break
            self.received += [line[len("STATUS="):] for line in msg.splitlines()
                              if line.startswith("STATUS=")]
        return self.received

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, StandinServer,
                                                                        Notify]]:
    root = tmp_path_factory.mktemp("joberr")
    engine = StandinServer(root / "engine").start()
    notify = Notify(root / "notify.sock")
    d = Daemon(root / "d", f'[engine]\nurl = "{engine.url}"\n', settle=0.5,
               tables='[metrics]\nlisten = ""\n', env={"NOTIFY_SOCKET": str(notify.path)})
    d.start()
    try:
        d.wait_answering(60)
        yield d, engine, notify
    finally:
        d.cleanup()
        engine.stop()
        notify.close()


def _two_page_tiff(path: Path, colours: tuple[str, str]) -> Path:
    """A two-page TIFF; each page's colour (its centre pixel) picks the stand-in's reply."""
    frames = [Image.new("RGB", (1120, 1400), colour) for colour in colours]
    for i, frame in enumerate(frames):
        ImageDraw.Draw(frame).text((40, 40), f"page {i + 1}", fill="black")
    frames[0].save(path, format="TIFF", save_all=True, append_images=frames[1:])
    return path


def _stored(d: Daemon, name: str) -> dict[str, object]:
    return next(j for j in d.stored_jobs() if Path(str(j["path"])).name == name)


def _done_without_error(d: Daemon, name: str) -> None:
    """The job ends done, with no error left on it in ``chandractl queue`` or the store."""
    d.wait_jobs_final([name], 120)
    listed = d.job(name)
    stored = _stored(d, name)
    assert listed is not None and listed["state"] == "done", listed
    assert (listed["error_code"], listed["error_message"]) == (None, None), listed
    assert (stored["error_code"], stored["error_message"]) == (None, None), stored


def test_held_job_shows_in_status_line_and_ends_done_without_its_error(
    served: tuple[Daemon, StandinServer, Notify], corpus_dir: Path,
    read_only_mount: Callable[[Path], AbstractContextManager[None]]
) -> None:
    d, _, notify = served
    name = "held.png"
    with read_only_mount(d.done):
        drop(corpus_dir / "good/image_hi-devanagari.png", d.inbox, name)
        held = d.wait_job(name, "held", 60, lambda j: j["state"] == "held")
        assert held["error_code"] == "output_unwritable", held
        d.wait_for("STATUS= naming the held job",
                   lambda: any("held=1" in s for s in notify.statuses()), 10)
    print(f"\nSTATUS= while held: {[s for s in notify.statuses() if 'held' in s][-1]}")
    _done_without_error(d, name)
    status = d.ctl_json("status")
    assert status["held"]["count"] == 0 and status["queue"]["held"] == 0, status
    d.wait_for("STATUS= without held jobs", lambda: "held" not in notify.statuses()[-1], 10)
    # The failed attempt is kept where an operator looks for history: the log.
    log = [json.loads(line) for line in d.log_path.read_text().splitlines()
           if '"job_held"' in line]
    assert log and log[0]["code"] == "output_unwritable", log


def test_job_backing_off_counts_in_status_line_with_its_reason(
    served: tuple[Daemon, StandinServer, Notify], corpus_dir: Path
) -> None:
    """Every reason ``status`` lists a job under ``held`` counts in ``STATUS=``, not only
    ``output_unwritable``: here a bad input whose move to failed/ fails (failed/ is a file)
    backs off until failed/ is a folder again, then fails as it should."""
    d, _, notify = served
    name = "unfailable.pdf"
    away = d.root / "failed.away"
    d.failed.rename(away)
    try:
        d.failed.write_text("not a folder")
        drop(corpus_dir / "bad/broken_not-a-pdf-text.pdf", d.inbox, name)
        d.wait_for("status listing the job as backing off", lambda: [
            j["reason"] for j in d.ctl_json("status")["held"]["jobs"]] == ["backoff"], 60)
        d.wait_for("STATUS= counting the job backing off",
                   lambda: any("held=1 (backoff 1)" in s for s in notify.statuses()), 10)
    finally:
        if d.failed.is_file():
            d.failed.unlink()
        away.rename(d.failed)
    print(f"\nSTATUS= while backing off: {[s for s in notify.statuses() if 'held' in s][-1]}")
    d.wait_jobs_final([name], 60)
    listed = d.job(name)
    assert listed is not None and listed["state"] == "failed", listed
    d.wait_for("STATUS= without held jobs", lambda: "held" not in notify.statuses()[-1], 10)


def test_retried_job_that_succeeds_keeps_no_error(
    served: tuple[Daemon, StandinServer, Notify], corpus_dir: Path
) -> None:
    d, _, _ = served
    name = "retried.png"
    assert d.ctl_json("pause")["state"] == "paused"
    drop(corpus_dir / "good/image_hi-devanagari.png", d.inbox, name)
    job = d.wait_job(name, "accepted", 60)
    assert d.ctl_json("cancel", str(job["id"]))["cancelled"] == job["id"]
    # The store, chandractl and error.json give the same reason.
    stored = _stored(d, name)
    assert (stored["state"], stored["error_code"]) == ("cancelled", "cancelled"), stored
    listed = d.job(name)
    assert listed is not None and listed["error_code"] == "cancelled", listed
    assert json.loads((d.failed / f"{name}.error.json").read_text())["code"] == "cancelled"
    assert d.ctl_json("retry", str(job["id"]))["retried"] == [job["id"]]
    assert not (d.failed / f"{name}.error.json").exists()
    d.ctl_json("resume")
    _done_without_error(d, name)
    assert "cancelled" not in d.ctl("queue").stdout


def test_retried_partial_job_redoes_only_its_failed_page(
    served: tuple[Daemon, StandinServer, Notify], tmp_path: Path
) -> None:
    """``chandractl retry`` of a ``partial`` job (one page of two failed: the engine
    answered it 500) moves its input back from done/, sends only the failed page again
    and ends ``done`` with both pages in the outputs; the done page is not recomputed."""
    d, engine, _ = served
    name = "half.tif"
    engine.update(replies={"colour:255,0,0": {"status": 500, "message": "poison page"}})
    try:
        drop(_two_page_tiff(tmp_path / name, ("white", "red")), d.inbox, name)
        d.wait_jobs_final([name], 120)
        job = d.job(name)
        assert job is not None and job["state"] == "partial", job
        assert (d.done / name).exists() and not (d.inbox / name).exists()
    finally:
        engine.update(replies={})
    sent = len(engine.chats())
    assert d.ctl_json("retry", str(job["id"]))["retried"] == [job["id"]]
    assert (d.inbox / name).exists() and not (d.done / name).exists()
    d.wait_jobs_final([name], 120)
    again = d.job(name)
    assert again is not None and again["state"] == "done", again
    assert (again["error_code"], again["error_message"]) == (None, None), again
    assert (d.done / name).exists() and not (d.inbox / name).exists()
    assert len(engine.chats()) == sent + 1, "the done page was sent again"
    assert [j["state"] for j in d.stored_jobs() if Path(str(j["path"])).name == name] == [
        "done"], "the input moved back was queued as a second job"
    metadata = json.loads((d.output / "half" / "half_metadata.json").read_text())
    assert (metadata["pages_ok"], metadata["pages_failed"]) == (2, 0), metadata
