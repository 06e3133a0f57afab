"""The HTTP side of one engine: health, model list, metrics and chat completions.

Owns the ``httpx.AsyncClient`` to the OpenAI-compatible server. Transport failures
become :class:`errors.EngineUnavailable`; nothing here decides what they mean.
"""

from __future__ import annotations

import functools
import re
from collections.abc import AsyncIterator, Collection
from typing import Any

import httpx

from chandrad.engine.progress import PROGRESS_SERIES
from chandrad.errors import EngineUnavailable
from chandrad.interfaces import ChatBody, EncodedJson

#: 5xx answers that say no engine could take the request, whatever the page: a gateway's
#: own statuses, and what vllm-router 0.1.17 answers when the engines behind it cannot be
#: reached (500 "Request failed: error sending request for url (...)" once its retries
#: are spent; 503 "No available workers (all circuits open or unhealthy)").
GATEWAY_STATUSES = frozenset({502, 503, 504})
UNREACHABLE_MARKERS = ("error sending request for url", "No available workers")

#: The engine's series the supervisor reads (dispatch, capacity and ``status``): the
#: scheduler's queue. Scraped every few seconds, so only these are parsed.
SCHEDULER_SERIES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
#: What the supervisor scrapes: the scheduler's gauges and the counters of its progress.
ENGINE_SERIES = SCHEDULER_SERIES + PROGRESS_SERIES


@functools.cache
def _series_pattern(names: tuple[str, ...] | None) -> re.Pattern[str]:
    """Sample lines of ``names`` (any ``vllm:*`` series for None): name, labels, value."""
    name = "vllm:[a-z_]+" if names is None else "|".join(map(re.escape, names))
    return re.compile(rf"^[ \t]*({name})(\{{[^}}\n]*\}})?[ \t]+([0-9.eE+\-]+|NaN)[ \t]*$",
                      re.MULTILINE)


def parse_metrics(text: str, names: Collection[str] | None = None) -> dict[str, float]:
    """Sum each ``vllm:*`` series of a Prometheus text page over its labels; only those in
    ``names`` when given. The page is searched by one regular expression rather than line
    by line: vLLM's has hundreds of histogram lines and it is scraped every few seconds."""
    out: dict[str, float] = {}
    pattern = _series_pattern(None if names is None else tuple(sorted(names)))
    for name, _labels, value in pattern.findall(text):
        if value != "NaN":
            out[name] = out.get(name, 0.0) + float(value)
    return out


async def _parts(body: EncodedJson) -> AsyncIterator[bytes]:
    for part in body.parts():
        yield part


class EngineClient:
    """Async client for one engine base URL (``http://host:port``, no ``/v1``)."""

    def __init__(self, base_url: str, *, api_key: str = "", timeout: float = 600.0,
                 health_path: str = "/health") -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.health_path = health_path
        #: ``max_model_len`` of each served model, as the last ``/v1/models`` listed it.
        self.max_model_len: dict[str, int] = {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def health(self, timeout: float = 5.0) -> bool:
        """``GET /health`` (or the configured ``health_path``) answered 200."""
        try:
            response = await self._http.get(self.health_path, timeout=timeout)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def models(self, timeout: float = 5.0) -> list[str]:
        """Model ids listed by ``GET /v1/models`` (empty when unreachable)."""
        try:
            response = await self._http.get("/v1/models", timeout=timeout)
            if response.status_code != 200:
                return []
            data = response.json()
        except (httpx.HTTPError, ValueError):
            return []
        listed = [m for m in data.get("data", []) if isinstance(m, dict)]
        for m in listed:
            if isinstance(m.get("max_model_len"), int):
                self.max_model_len[str(m.get("id"))] = int(m["max_model_len"])
        return [str(m.get("id")) for m in listed]

    async def is_ready(self, model: str) -> bool:
        """Ready: ``/health`` 200 and ``model`` listed in ``/v1/models``."""
        return await self.health() and model in await self.models()

    async def metrics(self, timeout: float = 2.0) -> dict[str, float]:
        """The engine's :data:`ENGINE_SERIES`, from its Prometheus page (empty when
        unavailable)."""
        try:
            response = await self._http.get("/metrics", timeout=timeout)
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            return {}
        return parse_metrics(response.text, ENGINE_SERIES)

    async def chat(self, body: ChatBody, timeout: float | None = None) -> dict[str, Any]:
        """``POST /v1/chat/completions``. An :class:`EncodedJson` body is sent part after
        part as it is written, with its ``Content-Length`` (not chunked).

        Raises:
            EngineUnavailable: transport error or a 5xx answer (the engine may be sick);
                ``unreachable`` when a router or gateway says no engine took the request.
            ValueError: a 4xx answer (the request itself is wrong), with the body text.
        """
        if isinstance(body, EncodedJson):
            content: dict[str, Any] = {"content": _parts(body), "headers": {
                "Content-Type": "application/json", "Content-Length": str(body.size)}}
        else:
            content = {"json": body}
        try:
            response = await self._http.post(
                "/v1/chat/completions", **content,
                timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
            )
        except httpx.HTTPError as exc:
            # A request that reached the engine and timed out may be the page's fault; a
            # connection refused, dropped or never made is the engine's.
            timed_out = isinstance(exc, httpx.TimeoutException) and not isinstance(
                exc, httpx.ConnectTimeout | httpx.PoolTimeout)
            raise EngineUnavailable(f"engine request failed: {type(exc).__name__}: {exc}",
                                    timed_out=timed_out) from exc
        if response.status_code >= 500:
            raise EngineUnavailable(
                f"engine answered {response.status_code}: {response.text[:500]}",
                status=response.status_code,
                unreachable=response.status_code in GATEWAY_STATUSES
                or any(marker in response.text for marker in UNREACHABLE_MARKERS),
            )
        if response.status_code >= 400:
            raise ValueError(f"engine rejected the request ({response.status_code}): "
                             f"{response.text[:500]}")
        result: dict[str, Any] = response.json()
        return result
