"""The dispatcher (engine/dispatch.py) over two real supervisors driving stand-in engine
*processes* (tests/standin_engine.py: vLLM's log lines, /health and /metrics on their own
ports): which engine each request goes to, and what happens when one leaves ``ready``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from standin_engine import write_standin
from test_replicas_daemon import port_pair
from test_supervision import GpuStandIn, engine_config
from waiting import wait_until_async as wait_for

from chandrad.config import OcrConfig
from chandrad.engine.dispatch import Dispatcher
from chandrad.engine.inflight import InFlight
from chandrad.engine.supervisor import EngineSupervisor
from chandrad.errors import EngineUnavailable
from chandrad.states import EngineCommand, EngineState


def test_requests_spread_by_free_capacity_and_skip_an_engine_that_left_ready(
    tmp_path: Path, free_port: Callable[[], int]
) -> None:
    port = port_pair(free_port)
    python = write_standin(tmp_path / "engine", {})
    engines = [EngineSupervisor(engine_config(python, port + i), OcrConfig(), gpu=GpuStandIn(),
                                engine_id=str(i)) for i in range(2)]
    dispatcher = Dispatcher(engines)

    async def main() -> None:
        tasks = [asyncio.create_task(e.run()) for e in engines]
        try:
            await asyncio.wait_for(dispatcher.wait_ready(), 30)
            await wait_for(lambda: all(e.state is EngineState.READY for e in engines), 30,
                           "both ready")
            assert dispatcher.capacity == engines[0].capacity + engines[1].capacity
            # One request at a time (pages arriving slower than they are answered): the
            # engines take turns instead of the first one taking everything.
            turns = []
            for _ in range(6):
                lease = dispatcher.pick()
                assert lease is not None
                turns.append(lease.engine_id)
                dispatcher.release(lease)
            assert turns == ["0", "1", "0", "1", "0", "1"], turns
            # Outstanding requests count: the engine with more free capacity is chosen.
            held = [dispatcher.pick() for _ in range(3)]
            assert [h.engine_id for h in held if h] == ["0", "1", "0"]
            assert dispatcher.outstanding == {"0": 2, "1": 1}
            nxt = dispatcher.pick()
            assert nxt is not None and nxt.engine_id == "1"
            for lease in [*held, nxt]:
                dispatcher.release(lease)
                dispatcher.release(lease)  # a second release of one lease counts once
            assert dispatcher.outstanding == {"0": 0, "1": 0}
            # Engine 1 leaves ready: no request goes there; none ready: no engine at all.
            engines[1].request(EngineCommand.STOP)
            await wait_for(lambda: engines[1].state is EngineState.STOPPED, 30, "1 stopped")
            picked = [dispatcher.pick() for _ in range(3)]
            assert {p.engine_id for p in picked if p} == {"0"}
            engines[0].request(EngineCommand.STOP)
            await wait_for(lambda: engines[0].state is EngineState.STOPPED, 30, "0 stopped")
            assert dispatcher.pick() is None
        finally:
            for engine in engines:
                await engine.shutdown()
            await asyncio.wait_for(asyncio.gather(*tasks), 60)

    asyncio.run(main())


def test_inflight_cut_ends_requests_at_once_and_counts_answers() -> None:
    """The gate's per-engine record (engine/inflight.py): a request the supervisor cuts
    (the engine failed under it) raises EngineUnavailable at once; a caller cancelling its
    own request is cancelled as usual; any answer, an error answer too, counts for the
    hung-engine watch, a transport failure does not."""

    async def main() -> None:
        requests = InFlight()
        never = asyncio.Event()

        async def held() -> dict[str, Any]:
            await never.wait()
            return {}

        async def answer(error: Exception | None = None) -> dict[str, Any]:
            if error is not None:
                raise error
            return {"choices": []}

        cut = asyncio.create_task(requests.run(held()))
        mine = asyncio.create_task(requests.run(held()))
        await asyncio.sleep(0)
        assert requests.count == 2
        mine.cancel()
        with pytest.raises(asyncio.CancelledError):
            await mine
        requests.cut("engine failed under the request: failed")
        with pytest.raises(EngineUnavailable, match="failed under the request"):
            await asyncio.wait_for(cut, 1)
        assert requests.count == 0 and requests.answered == 0
        assert await requests.run(answer()) == {"choices": []}
        with pytest.raises(ValueError):
            await requests.run(answer(ValueError("400: prompt too long")))
        with pytest.raises(EngineUnavailable):
            await requests.run(answer(EngineUnavailable("connection refused")))
        assert requests.answered == 2 and requests.count == 0

    asyncio.run(main())
