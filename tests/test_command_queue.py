"""The daemon's one command queue and the pipeline's mode, without processes.

The queue (``chandrad/daemon/queue.py``) carries every state change to the main loop: a
control request waits on its command's future for the answer, and what is still queued
when the daemon stops is refused, never dropped. The pipeline's mode
(``states.PipelineMode``) is the one value that says what the pipeline may do; each mode's
three answers are the flag combinations the daemon used to set by hand.
"""

from __future__ import annotations

import asyncio

import pytest

from chandrad.daemon.queue import CommandQueue
from chandrad.errors import ControlError, ControlErrorCode
from chandrad.states import PIPELINE_TRANSITIONS, DaemonCommand, PipelineMode

M = PipelineMode


@pytest.mark.parametrize(("mode", "accepts", "starts", "dispatches"), [
    (M.RUNNING, True, True, True),
    (M.PAUSED, True, True, False),  # files accepted, jobs queued, no page sent
    (M.DRAINING, False, True, True),  # accepted work runs to the end
    (M.STOPPING, False, False, True),  # running jobs finish their pages, none starts
    (M.STOPPING_PAUSED, False, False, False),  # a stop keeps the pause
])
def test_each_mode_says_what_the_pipeline_may_do(
        mode: PipelineMode, accepts: bool, starts: bool, dispatches: bool) -> None:
    assert (mode.accepts_files, mode.starts_jobs, mode.dispatches) == (
        accepts, starts, dispatches)


def test_a_stop_keeps_a_pause_and_ends_every_mode() -> None:
    assert {m: m.stopping() for m in M} == {
        M.RUNNING: M.STOPPING, M.PAUSED: M.STOPPING_PAUSED, M.DRAINING: M.STOPPING,
        M.STOPPING: M.STOPPING, M.STOPPING_PAUSED: M.STOPPING_PAUSED}
    for mode in M:  # every stop is a legal edge (or no change), and a stop is final
        assert mode.stopping() in PIPELINE_TRANSITIONS[mode] | {mode}
        if mode.stopping() is mode:
            assert not PIPELINE_TRANSITIONS[mode]


def test_a_drain_cannot_be_resumed_and_a_pause_can_be_drained() -> None:
    assert M.RUNNING not in PIPELINE_TRANSITIONS[M.DRAINING]
    assert M.DRAINING in PIPELINE_TRANSITIONS[M.PAUSED]


def test_ask_waits_for_the_main_loop_s_answer_with_the_arguments() -> None:
    async def body() -> None:
        queue = CommandQueue()
        asked = asyncio.create_task(queue.ask(DaemonCommand.CANCEL, job_id=7))
        command = await queue.next(5)
        assert command is not None and command.name is DaemonCommand.CANCEL
        assert dict(command.args) == {"job_id": 7}
        assert not asked.done()
        command.answer({"cancelled": 7})
        assert await asked == {"cancelled": 7}
    asyncio.run(body())


def test_commands_still_queued_at_the_stop_are_refused_not_dropped() -> None:
    async def body() -> None:
        queue = CommandQueue()
        asked = [asyncio.create_task(queue.ask(name))
                 for name in (DaemonCommand.PAUSE, DaemonCommand.ENGINE_RESTART)]
        queue.put(DaemonCommand.RELOAD)  # nobody waits on this one: refused all the same
        await asyncio.sleep(0)
        queue.refuse_all()
        for task, what in zip(asked, ("pause", "engine restart"), strict=True):
            with pytest.raises(ControlError) as err:
                await task
            assert err.value.error_code is ControlErrorCode.INVALID_STATE
            assert f"daemon is stopping: {what} refused" in str(err.value)
        assert await queue.next(0.01) is None
    asyncio.run(body())
