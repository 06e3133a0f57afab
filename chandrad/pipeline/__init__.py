"""The job flow: settled file → accepted job → rendered pages → inference → outputs.

Owns the scheduling of work, not any resource: the store keeps state, the render pool
makes pixels, the engine (seen only as an ``EngineHandle``) answers, ``ocr`` turns answers
into Markdown/HTML/blocks, ``outputs`` writes files. Its modules, each importing only those
below it in this list:

- ``scheduler``: :class:`Pipeline`, the job scheduler: intake in, dispatch, held and
  backing-off jobs, cancel and retry, how a job's run ended;
- ``intake``: settled files (:class:`Settled`) hashed and accepted in batches; the store's
  room (``store_full``);
- ``waits``: why a job is not started now (back-off, hold, store wait) and until when;
- ``helping``: pages of other hosts' jobs this host works on while it has room (a shared
  store);
- ``jobs``: one dispatched job's life: probe, its pages, outputs, the input moved;
- ``worker``: one page: render → slot → request → post-process → commit;
- ``attempts``: the page's retry, charge and refit rules as decisions (pure);
- ``limits``: the render-ahead window, the requests in flight, the post-processing bound;
- ``content``: an input by its content (hashes, a recorded move found again).

The intake, dispatch and (on a shared store) helping loops run under ``chandrad.tasks``
supervision (wired by the daemon); intake declares the item it works on, and
:meth:`Pipeline.quarantine` moves an item that crashed a loop out of the way.
"""

from chandrad.pipeline.attempts import MAX_FREE_RELEASES, PagePolicy
from chandrad.pipeline.content import sha256_file
from chandrad.pipeline.intake import INTAKE_BATCH, STORE_FULL_RETRY_S, Settled
from chandrad.pipeline.limits import RENDER_AHEAD_DIVISOR, DynamicLimiter
from chandrad.pipeline.scheduler import Pipeline
from chandrad.pipeline.waits import (
    BACKOFF_FIRST_S,
    BACKOFF_MAX_S,
    HOLD_RETRY_FIRST,
    HOLD_RETRY_MAX,
)

__all__ = [
    "BACKOFF_FIRST_S", "BACKOFF_MAX_S", "HOLD_RETRY_FIRST", "HOLD_RETRY_MAX", "INTAKE_BATCH",
    "MAX_FREE_RELEASES", "RENDER_AHEAD_DIVISOR", "STORE_FULL_RETRY_S", "DynamicLimiter",
    "PagePolicy", "Pipeline", "Settled", "sha256_file",
]
