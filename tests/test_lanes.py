"""The lock between the suite's two lanes (tests/lanes.py): shared holders run together, an exclusive one runs
by itself, one waiting for the machine is not overtaken by a shared holder that comes after it, and a lane keeps
its exclusive hold from one alone test to the next."""

from __future__ import annotations

import fcntl
import threading
import time

import pytest

from tests.lanes import LaneLock, holding

pytestmark = pytest.mark.timeout(60)


def held_exclusively_by_someone(path) -> bool:
    """True while another open file holds ``path``'s flock (a probe that takes nothing it can get)."""
    with open(path, "a") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(probe, fcntl.LOCK_UN)
        return False


def until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_shared_holders_hold_together_and_an_exclusive_one_waits_for_them(tmp_path):
    with holding(tmp_path, exclusive=False), holding(tmp_path, exclusive=False):  # two at once: no deadlock
        assert held_exclusively_by_someone(tmp_path / "machine")
    assert not held_exclusively_by_someone(tmp_path / "machine")
    with holding(tmp_path, exclusive=True):
        assert held_exclusively_by_someone(tmp_path / "machine")


def test_an_exclusive_holder_waits_for_the_shared_one_and_is_not_overtaken_by_the_next(tmp_path):
    order: list[str] = []
    release_first = threading.Event()
    release_exclusive = threading.Event()

    def hold(name: str, exclusive: bool, release: threading.Event | None) -> None:
        with holding(tmp_path, exclusive):
            order.append(f"{name} in")
            if release is not None:
                release.wait(20)
            order.append(f"{name} out")

    first = threading.Thread(target=hold, args=("first shared", False, release_first))
    first.start()
    until(lambda: order == ["first shared in"], "the first shared holder")
    exclusive = threading.Thread(target=hold, args=("exclusive", True, release_exclusive))
    exclusive.start()
    # It waits for the machine holding the turnstile, so the next shared holder queues behind it.
    until(lambda: held_exclusively_by_someone(tmp_path / "turnstile"), "the exclusive holder to wait in the turnstile")
    late = threading.Thread(target=hold, args=("late shared", False, None))
    late.start()
    release_first.set()
    until(lambda: "exclusive in" in order, "the exclusive holder to get the machine")
    assert "late shared in" not in order  # the machine is the exclusive holder's alone
    release_exclusive.set()
    for thread in (first, exclusive, late):
        thread.join(20)
    assert order == [
        *("first shared in", "first shared out"),
        *("exclusive in", "exclusive out"),
        *("late shared in", "late shared out"),
    ]


def test_a_lane_keeps_its_exclusive_hold_until_it_lets_go_and_a_shared_take_gives_it_up(tmp_path):
    lane = LaneLock(tmp_path)
    lane.take(exclusive=True)
    lane.take(exclusive=True)  # the next alone test: still held, not taken again
    assert lane.exclusive is True and held_exclusively_by_someone(tmp_path / "machine")
    entered = threading.Event()

    def other_lane() -> None:
        with holding(tmp_path, exclusive=False):
            entered.set()

    other = threading.Thread(target=other_lane)
    other.start()
    # it waits for the machine holding the turnstile: its test cannot start while the hold lasts
    until(lambda: held_exclusively_by_someone(tmp_path / "turnstile"), "the other lane to wait for the machine")
    assert not entered.is_set()
    lane.take(exclusive=False)  # a test that is not alone: the exclusive hold goes, a shared one comes
    assert entered.wait(20) and lane.exclusive is False
    other.join(20)
    lane.let_go()
    assert lane.exclusive is None and not held_exclusively_by_someone(tmp_path / "machine")
