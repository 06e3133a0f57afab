"""How often the supervisor asks a ready engine for its scheduler series (``/metrics``):
every METRICS_INTERVAL while chandrad has requests at it, every METRICS_IDLE_INTERVAL
while it has none. The engine is the stand-in server process (``tests/standin_engine.py``)
at ``engine.url``; its access log counts the scrapes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from standin_engine import StandinServer
from waiting import wait_until_async

from chandrad.config import EngineConfig, OcrConfig
from chandrad.daemon import NvmlProbe
from chandrad.engine.client import SCHEDULER_SERIES, parse_metrics
from chandrad.engine.dispatch import Dispatcher
from chandrad.engine.probe import METRICS_IDLE_INTERVAL, METRICS_INTERVAL
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.states import EngineState

WINDOW_S = 7.0


def _scrapes(engine: StandinServer) -> int:
    return (engine.folder / "engine.log").read_text().count('"GET /metrics HTTP/1.1"')


async def _scrapes_over(engine: StandinServer, seconds: float) -> int:
    before = _scrapes(engine)
    await asyncio.sleep(seconds)
    return _scrapes(engine) - before


def test_an_idle_engine_is_scraped_less_often_than_a_busy_one(tmp_path: Path) -> None:
    """Idle: at most one scrape in 7 s (it was three or four, every 2 s). With a request
    in flight (the stand-in takes 10 s to answer): one at least every METRICS_INTERVAL
    + 1 s (the supervisor's loop turns once a second)."""
    assert METRICS_IDLE_INTERVAL > WINDOW_S > 3 * METRICS_INTERVAL
    engine = StandinServer(tmp_path / "engine", {"delay_s": 10.0}).start()
    sup = EngineSupervisor(EngineConfig(url=engine.url, served_model_name="chandra"),
                           OcrConfig(), gpu=NvmlProbe())

    async def body() -> None:
        task = asyncio.create_task(sup.run())
        try:
            await wait_until_async(lambda: sup.state is EngineState.READY, 30, "ready")
            # Past the first scrape, made on becoming ready; the next idle one is due 10 s
            # after it, 2 s after the idle window ends.
            await asyncio.sleep(1.0)
            idle = await _scrapes_over(engine, WINDOW_S)
            chat = asyncio.create_task(Dispatcher([sup]).chat({
                "model": "chandra", "max_tokens": 1,
                "messages": [{"role": "user", "content": "hello"}]}))
            t0 = time.monotonic()
            busy = await _scrapes_over(engine, WINDOW_S)
            assert not chat.done(), "the request ended before the busy window did"
            chat.cancel()
            assert idle <= 1, f"{idle} scrapes of an idle engine in {WINDOW_S:g} s"
            least = int((time.monotonic() - t0) // (METRICS_INTERVAL + 1.0))
            assert busy >= least, f"{busy} scrapes in {WINDOW_S:g} s with a request in flight"
        finally:
            await sup.shutdown()
            await asyncio.wait_for(task, 30)

    try:
        asyncio.run(body())
    finally:
        engine.stop()


FIXTURES = Path(__file__).parent / "fixtures"


def test_scheduler_series_parsed_from_a_real_vllm_page() -> None:
    """vLLM's own page, 16 running and 8 waiting: the two series the supervisor reads,
    alone, the same as parsing every series and picking them; across two engines' labels
    (a router's page) each is summed."""
    page = (FIXTURES / "vllm_cpu_metrics_busy.txt").read_text()
    wanted = parse_metrics(page, SCHEDULER_SERIES)
    assert wanted == {"vllm:num_requests_running": 16.0, "vllm:num_requests_waiting": 8.0}
    every = parse_metrics(page)
    assert len(every) > 50 and {k: every[k] for k in SCHEDULER_SERIES} == wanted
    second = page.replace('engine="0"', 'engine="1"')
    assert parse_metrics(page + second, SCHEDULER_SERIES) == {k: 2 * v for k, v in wanted.items()}
    assert parse_metrics("vllm:num_requests_waiting NaN\n# vllm:x 1\n", SCHEDULER_SERIES) == {}
