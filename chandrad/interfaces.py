"""Protocols for the seams between services (no implementations).

``pipeline`` sees the engine only as an :class:`EngineHandle`; ``control.handlers``
sees the daemon only as :class:`DaemonControl`. The ``daemon`` package is the one place
that wires concrete objects to these. :class:`EncodedJson` is the one value type that
crosses a seam (a request body the pipeline encoded, which the engine client sends).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from chandrad.protocol import EngineStatus
from chandrad.states import EngineState

#: Bytes of the image written to base64 at a time as a body is sent (a multiple of 3, so
#: the slices' base64 joins into the whole's).
BASE64_SLICE_BYTES = 3 << 16


@dataclass(frozen=True)
class EncodedJson:
    """A request body encoded as JSON (UTF-8) around one image: ``head``, the image in
    base64, ``tail``. The base64 is written only as the body is sent, a slice at a time,
    and the body is never joined: a page's image is most of a chat request, and the
    daemon holds each page as its PNG alone (3/4 of its base64; the size per page:
    bench/README.md, "Current figures"), however many requests are in flight."""

    head: bytes
    image: bytes
    tail: bytes

    @property
    def size(self) -> int:
        """The body's length in bytes (its ``Content-Length``)."""
        return len(self.head) + 4 * -(-len(self.image) // 3) + len(self.tail)

    def parts(self) -> Iterator[bytes]:
        """The body, part after part."""
        yield self.head
        image = memoryview(self.image)
        for start in range(0, len(image), BASE64_SLICE_BYTES):
            yield base64.b64encode(image[start:start + BASE64_SLICE_BYTES])
        yield self.tail


#: A chat request as the engine client takes it: a JSON-able dict, or already encoded.
ChatBody = dict[str, Any] | EncodedJson


class EngineTarget(Protocol):
    """One engine a request goes to: the request is built for it (its page budget and
    context) and sent to it."""

    @property
    def served_model_name(self) -> str: ...

    @property
    def max_output_tokens(self) -> int: ...

    @property
    def max_model_len(self) -> int | None: ...

    async def chat(self, body: ChatBody, timeout: float | None = None) -> dict[str, Any]:
        """One chat completion. Raises ``errors.EngineUnavailable`` when not ready or sick."""
        ...

    def report_failure(self, reason: str, evidence: str = "") -> None:
        """Tell its supervisor a request failed in a way that suggests the engine is sick."""
        ...


class EngineHandle(Protocol):
    """What the pipeline may ask of the engines: the dispatcher (``engine/dispatch.py``),
    the request gate over one or more supervised engines."""

    @property
    def state(self) -> EngineState: ...

    @property
    def base_url(self) -> str:
        """OpenAI-compatible root, e.g. ``http://127.0.0.1:8000``."""
        ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def capacity(self) -> int:
        """How many requests may be in flight now (from ``max_num_seqs`` and /metrics)."""
        ...

    @property
    def max_pixels(self) -> int:
        """The page pixel budget in force (the profile may have lowered it)."""
        ...

    @property
    def max_output_tokens(self) -> int:
        """The output token budget in force (the profile may have lowered it)."""
        ...

    @property
    def max_model_len(self) -> int | None:
        """The served model's context length as the engine reports it (``None``: unknown)."""
        ...

    def snapshot(self) -> EngineStatus:
        """The engine part of ``status`` (state, pid, profile, last failure)."""
        ...

    async def wait_ready(self) -> None:
        """Return once the engine is ``ready``."""
        ...

    async def chat(self, body: ChatBody, timeout: float | None = None) -> dict[str, Any]:
        """One chat completion. Raises ``errors.EngineUnavailable`` when not ready or sick."""
        ...

    def report_failure(self, reason: str, evidence: str = "") -> None:
        """Tell the supervisor a request failed in a way that suggests the engine is sick."""
        ...

    def pick(self) -> EngineTarget | None:
        """The ready engine the next request goes to (the one with the most free
        capacity), counted as one request outstanding on it until :meth:`release`;
        ``None`` when no engine is ready."""
        ...

    def release(self, target: EngineTarget) -> None:
        """The request sent to ``target`` by :meth:`pick` is over (answered or not)."""
        ...


class DaemonControl(Protocol):
    """The operations the control socket may call. Every method returns JSON-able data.

    Mutating methods raise ``errors.ControlError`` (``invalid_state``, ``not_found``)
    when the request cannot be honoured.
    """

    def status(self) -> Mapping[str, Any]:
        """A ``protocol.StatusReply``."""
        ...

    def queue(self, state: str | None = None, limit: int = 1000) -> list[dict[str, Any]]: ...

    def gpu(self) -> Mapping[str, Any]:
        """A ``protocol.GpuReply``."""
        ...

    def version(self) -> dict[str, Any]: ...

    async def pause(self) -> dict[str, Any]: ...

    async def resume(self) -> dict[str, Any]: ...

    async def drain(self, wait: bool = False) -> dict[str, Any]: ...

    async def retry(self, job_id: int | None = None, all_failed: bool = False) -> dict[str, Any]:
        ...

    async def cancel(self, job_id: int) -> dict[str, Any]: ...

    async def reload(self, wait: bool = False) -> dict[str, Any]: ...

    async def engine_restart(self, engine_id: str | None = None) -> dict[str, Any]:
        """Restart one engine (``None``: every local engine)."""
        ...

    async def rescan(self) -> dict[str, Any]: ...


class Observer(Protocol):
    """Events counted as they happen (``metrics.Metrics``); everything else is read at
    scrape time. The pipeline and the engine supervisor call it when one is set."""

    def page_finished(self, ok: bool, render_s: float, inference_s: float,
                      total_s: float) -> None: ...

    def engine_failed(self, failure_class: str, engine: str = "0") -> None: ...

    def profile_changed(self, reason: str, engine: str = "0") -> None: ...
