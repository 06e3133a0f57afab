"""Fetching the model's weights into the Hugging Face cache (weights on first start).

Owns ``chandrad fetch-model``: ``engine.model`` into the cache the engine reads
(``engine.env``'s ``HF_*`` variables apply) with huggingface_hub's own client and cache
layout, resumable (a file cut by kill -9 continues from its ``.chandrad-part``), with
progress as bytes done of bytes total, read from the cache's blobs while it runs. Imports
huggingface_hub only when called: it runs in its own process, never in the daemon. Run as
``python -m chandrad.fetch MODEL`` it is the child the engine supervisor starts before
vLLM (chandrad/engine/fetching.py reads its lines).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from chandrad.errors import ExitCode
from chandrad.errors import ModelFetchFailed as FetchFailed


def hub_environment(engine_env: Mapping[str, str]) -> dict[str, str]:
    """The ``HF_*`` variables of the engine's environment, with the hub reachable."""
    env = {k: v for k, v in engine_env.items() if k.startswith("HF_")}
    env["HF_HUB_OFFLINE"] = "0"
    return env


def _blob_bytes(blobs: Path) -> int:
    total = 0
    try:
        for entry in os.scandir(blobs):
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    except OSError:
        return 0
    return total


def _resume_blob(model: str, commit: str, filename: str, blobs: Path) -> None:
    """Download one file into ``blobs/<etag>`` where huggingface_hub would put it,
    continuing a ``.chandrad-part`` left by an interrupted run (huggingface_hub 2.4
    downloads into a process-unique temporary file and never resumes one)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]  # lazy export

    meta = get_hf_file_metadata(hf_hub_url(model, filename, revision=commit))
    if not meta.etag:
        return  # nothing to key the blob by: leave the file to snapshot_download
    blob = blobs / meta.etag
    if blob.exists():
        return
    blobs.mkdir(parents=True, exist_ok=True)
    part = blob.with_name(blob.name + ".chandrad-part")
    with part.open("ab") as sink:
        done = sink.tell()
        if meta.size is None or done < meta.size:
            http_get(meta.location, sink, resume_size=done, headers=build_hf_headers(),
                     expected_size=meta.size)
    os.replace(part, blob)


def fetch_model(model: str, report: Callable[[int, int], None], *,
                interval: float = 1.0) -> Path:
    """Download ``model`` (a hub id) into the HF cache; ``report(done, total)`` as it goes.

    Each file goes to the cache's ``blobs/`` (resuming a part an interrupted run left),
    then ``snapshot_download`` links the snapshot and the ref as it always does, finding
    every blob already there. Call with the hub environment in ``os.environ``
    (huggingface_hub reads it at import). Returns the snapshot directory.

    Raises:
        FetchFailed: with huggingface_hub's own reason.
    """
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import DryRunError, HfHubHTTPError
    except ImportError as exc:
        raise FetchFailed(f"huggingface_hub is not installed: {exc}") from exc
    try:
        plan = snapshot_download(model, dry_run=True)
        total = sum(int(f.file_size or 0) for f in plan)
        repo = Path(constants.HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))
        stop = threading.Event()

        def watch() -> None:
            last = -1
            while not stop.wait(interval):
                done = min(_blob_bytes(repo / "blobs"), total)
                if done != last:
                    report(done, total)
                    last = done

        report(min(_blob_bytes(repo / "blobs"), total), total)
        watcher = threading.Thread(target=watch, name="fetch-progress", daemon=True)
        watcher.start()
        try:
            for item in plan:
                if item.will_download:
                    _resume_blob(model, item.commit_hash, item.filename, repo / "blobs")
            path = Path(snapshot_download(model))
        finally:
            stop.set()
            watcher.join()
        report(total, total)
        return path
    except (HfHubHTTPError, OSError, ValueError) as exc:
        cause = _chain(exc)[-1] if isinstance(exc, DryRunError) else exc  # hides the answer
        raise FetchFailed(f"cannot fetch {model}: {type(cause).__name__}: {cause}") from exc


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes, outermost first, without the HTTP client's own error."""
    chain = [exc]
    while chain[-1].__cause__ is not None and type(chain[-1].__cause__).__module__.startswith(
            ("huggingface_hub", "builtins")):
        chain.append(chain[-1].__cause__)
    return chain


#: The child's protocol (``python -m chandrad.fetch MODEL``), one line each on stdout.
PROGRESS_LINE = "progress"  # ``progress DONE TOTAL``
ERROR_LINE = "error"  # ``error REASON``, then the exit status: ExitCode.CONFIG when the
# hub says no such repository, revision or file, or no access (fatal); ExitCode.UNAVAILABLE
# for anything else (network, hub errors, disk: worth a retry).


def _not_found(exc: BaseException | None) -> bool:
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    for cause in [] if exc is None else _chain(exc):
        if isinstance(cause, RepositoryNotFoundError | RevisionNotFoundError
                      | EntryNotFoundError):
            return True
        response = getattr(cause, "response", None) if isinstance(cause, HfHubHTTPError) \
            else None
        if getattr(response, "status_code", None) in (401, 403, 404):
            return True
    return False


def main(argv: list[str] | None = None) -> int:
    """The fetch child: ``engine.model`` into the cache of this process's ``HF_*``."""
    [model] = sys.argv[1:] if argv is None else argv

    def report(done: int, total: int) -> None:
        print(f"{PROGRESS_LINE} {done} {total}", flush=True)

    try:
        fetch_model(model, report)
    except FetchFailed as exc:
        print(f"{ERROR_LINE} {exc}".replace("\n", " "), flush=True)
        return ExitCode.CONFIG if _not_found(exc.__cause__) else ExitCode.UNAVAILABLE
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
