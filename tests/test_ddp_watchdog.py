"""HangWatchdog on a real TCPStore: who is hung, when, and what is done about it.

Each "rank" here is a watchdog instance in this process sharing one store; time is a fake clock the
test advances, so the verdicts are exact and independent of the machine's load. The one process
that is stopped and killed is a real child, SIGSTOPped for real. The end-to-end runs (real ranks,
the elastic agent, torchrun) are in tests/test_ddp_hang.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from torch.distributed import TCPStore

from src.ddp.watchdog import DONE, HUNG_PEER_EXIT, HangWatchdog, heartbeat_interval, process_state
from tests.ddp_fixtures import process_gone

pytestmark = pytest.mark.alone

TIMEOUT_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _ranks(store, world: int, clock: Clock, left: list[int]) -> list[HangWatchdog]:
    return [
        HangWatchdog(store, rank, world, TIMEOUT_S, clock=clock, leave=left.append, host="here")
        for rank in range(world)
    ]


def test_a_peer_silent_for_the_timeout_is_hung_and_not_a_moment_before(store):
    clock, left = Clock(), []
    watcher, silent, beating = _ranks(store, 3, clock, left)
    assert watcher.check() is None  # the peers' first heartbeats are seen: their silence counts from here
    for _ in range(int(TIMEOUT_S / watcher.interval_s) - 1):  # rank 1 stops beating; rank 2 goes on
        clock.now += watcher.interval_s
        beating.beat()
        assert watcher.check() is None
    clock.now += watcher.interval_s
    beating.beat()
    hung = watcher.check()
    assert (hung.rank, hung.silent_s, hung.detected_by, hung.killed) == (1, TIMEOUT_S, "heartbeat", False)
    assert hung.host == "here" and hung.pid is not None  # from rank 1's last heartbeat
    assert left == [HUNG_PEER_EXIT]


def test_a_slow_peer_that_beats_once_an_interval_is_never_hung(store):
    clock, left = Clock(), []
    watcher, slow = _ranks(store, 2, clock, left)
    for _ in range(100):  # ten timeouts long
        clock.now += watcher.interval_s
        slow.beat()
        assert watcher.check() is None
    assert left == [] and watcher.hung is None


def test_a_finished_peer_is_no_longer_watched(store):
    clock, left = Clock(), []
    watcher, finished = _ranks(store, 2, clock, left)
    finished.stop(finished=True)
    assert store.get("heartbeat/1").decode() == DONE
    watcher.check()
    clock.now += 3 * TIMEOUT_S
    assert watcher.check() is None and left == []


def test_a_peer_that_never_beat_is_hung_after_the_timeout(store):
    clock, left = Clock(), []
    watcher = HangWatchdog(store, 0, 2, TIMEOUT_S, clock=clock, leave=left.append, host="here")
    clock.now += TIMEOUT_S
    hung = watcher.check()
    assert (hung.rank, hung.pid, hung.host) == (1, None, None) and left == [HUNG_PEER_EXIT]


def test_silence_while_the_store_cannot_be_read_does_not_count(store):
    clock, left = Clock(), []
    watcher, peer = _ranks(store, 2, clock, left)
    watcher.check()
    real = watcher.store
    watcher.store = None  # every store call fails: the watcher is blind for two timeouts
    clock.now += 2 * TIMEOUT_S
    assert watcher.check() is None
    watcher.store = real
    peer.beat()
    clock.now += TIMEOUT_S - 1
    assert watcher.check() is None and left == []


def _judge(store, clock: Clock, left: list[int], heartbeat: str):
    """A fresh watcher of rank 1 whose last heartbeat was ``heartbeat``, after the timeout."""
    watcher = HangWatchdog(store, 0, 2, TIMEOUT_S, clock=clock, leave=left.append, host="here")
    store.set("heartbeat/1", heartbeat)
    watcher.check()
    clock.now += TIMEOUT_S
    return watcher.check()


def test_a_stopped_peer_on_this_host_is_killed_one_elsewhere_or_running_is_left_to_the_agent(store):
    clock, left = Clock(), []
    children = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        stopped, running = children
        stopped.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(stopped.pid) != "T":
            assert time.monotonic() < deadline, "the child never showed as stopped"
            time.sleep(0.01)  # polling interval of the condition above
        assert process_state(running.pid) in ("R", "S", "D")  # D: still reading its imports from disk
        # the same pid on another host is another process: never signalled
        elsewhere = _judge(store, clock, left, f"7 {stopped.pid} another-host")
        assert (elsewhere.rank, elsewhere.host, elsewhere.killed) == (1, "another-host", False)
        assert process_state(stopped.pid) == "T"
        # running (e.g. stuck in C code holding the GIL): the agent's SIGTERM works on it
        alive = _judge(store, clock, left, f"7 {running.pid} here")
        assert (alive.pid, alive.killed) == (running.pid, False) and not process_gone(running.pid)
        # stopped, here: the agent's SIGTERM would wait 30 s on it, so it is killed
        killed = _judge(store, clock, left, f"7 {stopped.pid} here")
        assert (killed.pid, killed.killed) == (stopped.pid, True)
        assert stopped.wait(10) == -signal.SIGKILL
        assert left == [HUNG_PEER_EXIT] * 3
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_after_a_failed_collective_the_silent_peer_is_the_hung_one(store):
    clock, left = Clock(), []
    watcher, silent, beating = _ranks(store, 3, clock, left)
    watcher.check()
    clock.now += 3 * watcher.interval_s
    beating.beat()
    hung = watcher.collective_failed()
    assert (hung.rank, hung.detected_by) == (1, "collective timeout") and left == [HUNG_PEER_EXIT]


def test_a_failed_collective_whose_silent_peer_died_here_is_not_a_hang(store):
    clock, left = Clock(), []
    watcher = HangWatchdog(store, 0, 2, TIMEOUT_S, clock=clock, leave=left.append, host="here")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # exited: a crash the agent sees by itself
    store.set("heartbeat/1", f"4 {child.pid} here")
    watcher.check()
    clock.now += 3 * watcher.interval_s
    assert watcher.collective_failed() is None and left == []


def test_a_failed_collective_with_every_peer_beating_is_not_a_hang(store):
    clock, left = Clock(), []
    watcher, peer = _ranks(store, 2, clock, left)
    clock.now += 3 * watcher.interval_s
    peer.beat()
    assert watcher.collective_failed() is None and left == []


def test_hung_events_reach_the_reporters(store):
    clock, left, events = Clock(), [], []
    watcher, _ = _ranks(store, 2, clock, left)
    watcher.report_to(lambda kind, **fields: events.append((kind, fields)))
    watcher.check()
    clock.now += TIMEOUT_S
    watcher.check()
    ((kind, fields),) = events
    assert kind == "rank_hung" and (fields["hung_rank"], fields["by_rank"], fields["timeout_s"]) == (1, 0, TIMEOUT_S)


def test_the_thread_beats_and_ends_the_process_when_a_peer_stops(store):
    left, events = [], []
    watcher = HangWatchdog(store, 0, 2, 0.5, leave=left.append, host="here")
    peer = HangWatchdog(store, 1, 2, 0.5, leave=left.append, host="here")
    assert heartbeat_interval(0.5) == 0.05 and heartbeat_interval(600) == 1.0
    watcher.report_to(lambda kind, **fields: events.append(fields["hung_rank"]))
    watcher.start()
    first = store.get("heartbeat/0").decode()
    deadline = time.monotonic() + 30
    while not left:  # rank 1 never beats again (its thread was never started): hung after 0.5 s
        assert time.monotonic() < deadline, "the watchdog thread never declared the silent peer hung"
        time.sleep(0.01)  # polling interval of the condition above
    watcher.stop()
    assert store.get("heartbeat/0").decode() != first  # it did beat meanwhile
    assert left == [HUNG_PEER_EXIT] and events == [1] and peer.hung is None
