"""The worker's heartbeat thread (src/ps/worker/connections.py ``Heartbeats``) is over once its owner has closed it.

A beat still in flight when a worker process exits aborts the interpreter inside gRPC's C core
(exit 134 after a finished run); ``stop_and_close`` therefore closes the channel under the beat
and waits for the thread. Here the beat is a stand-in that blocks until the channel is closed.
"""

from __future__ import annotations

import threading

import pytest

from src.ps.worker.connections import Heartbeats
from src.transport.errors import CallError

pytestmark = pytest.mark.timeout(60)


class _Cancelled(CallError):
    def __init__(self) -> None:
        super().__init__("CANCELLED", "the channel was closed")


def test_stop_and_close_returns_only_after_a_beat_in_flight_has_ended():
    in_flight, closed, beats = threading.Event(), threading.Event(), []

    def beat() -> None:
        in_flight.set()
        closed.wait(30)  # a call that only a closed channel ends (it is cancelled)
        beats.append("ended")
        raise _Cancelled()

    heartbeats = Heartbeats(beat, interval=0.01)
    heartbeats.start()
    assert in_flight.wait(30), "no beat started"
    heartbeats.stop_and_close(closed.set)
    assert not heartbeats.is_alive() and beats == ["ended"]


def test_stop_and_close_of_a_thread_never_started_closes_the_channel():
    closed = []
    Heartbeats(lambda: None, interval=1.0).stop_and_close(lambda: closed.append(True))
    assert closed == [True]
