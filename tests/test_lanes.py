"""The lock between the suite's two lanes (tests/lanes.py): shared holders run together, an exclusive one runs
by itself, a cluster one beside a shared one but never beside another cluster or an exclusive one, one waiting for
the machine is not overtaken by a shared holder that comes after it, and a lane keeps its exclusive hold from one
alone test to the next."""

from __future__ import annotations

import fcntl
import threading
import time

import pytest

from tests.lanes import CLUSTER, EXCLUSIVE, SHARED, FileMarks, LaneLock, file_order, holding

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
    with holding(tmp_path, SHARED), holding(tmp_path, SHARED):  # two at once: no deadlock
        assert held_exclusively_by_someone(tmp_path / "machine")
    assert not held_exclusively_by_someone(tmp_path / "machine")
    with holding(tmp_path, EXCLUSIVE):
        assert held_exclusively_by_someone(tmp_path / "machine")


def test_an_exclusive_holder_waits_for_the_shared_one_and_is_not_overtaken_by_the_next(tmp_path):
    order: list[str] = []
    release_first = threading.Event()
    release_exclusive = threading.Event()

    def hold(name: str, kind: str, release: threading.Event | None) -> None:
        with holding(tmp_path, kind):
            order.append(f"{name} in")
            if release is not None:
                release.wait(20)
            order.append(f"{name} out")

    first = threading.Thread(target=hold, args=("first shared", SHARED, release_first))
    first.start()
    until(lambda: order == ["first shared in"], "the first shared holder")
    exclusive = threading.Thread(target=hold, args=("exclusive", EXCLUSIVE, release_exclusive))
    exclusive.start()
    # It waits for the machine holding the turnstile, so the next shared holder queues behind it.
    until(lambda: held_exclusively_by_someone(tmp_path / "turnstile"), "the exclusive holder to wait in the turnstile")
    late = threading.Thread(target=hold, args=("late shared", SHARED, None))
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
    lane.take(EXCLUSIVE)
    lane.take(EXCLUSIVE)  # the next alone test: still held, not taken again
    assert lane.hold == EXCLUSIVE and held_exclusively_by_someone(tmp_path / "machine")
    entered = threading.Event()

    def other_lane() -> None:
        with holding(tmp_path, SHARED):
            entered.set()

    other = threading.Thread(target=other_lane)
    other.start()
    # it waits for the machine holding the turnstile: its test cannot start while the hold lasts
    until(lambda: held_exclusively_by_someone(tmp_path / "turnstile"), "the other lane to wait for the machine")
    assert not entered.is_set()
    lane.take(SHARED)  # a test that is not alone: the exclusive hold goes, a shared one comes
    assert entered.wait(20) and lane.hold == SHARED
    other.join(20)
    lane.let_go()
    assert lane.hold is None and not held_exclusively_by_someone(tmp_path / "machine")


def test_a_cluster_holder_runs_beside_a_shared_one_but_not_beside_another_cluster_or_an_exclusive_one(tmp_path):
    order: list[str] = []
    releases = {name: threading.Event() for name in ("shared", "cluster 1", "cluster 2", "exclusive")}

    def hold(name: str, kind: str) -> threading.Thread:
        def run() -> None:
            with holding(tmp_path, kind):
                order.append(f"{name} in")
                releases[name].wait(20)
                order.append(f"{name} out")

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    threads = [hold("shared", SHARED), hold("cluster 1", CLUSTER)]
    until(lambda: {"shared in", "cluster 1 in"} <= set(order), "a shared and a cluster holder together")
    threads.append(hold("cluster 2", CLUSTER))
    until(lambda: held_exclusively_by_someone(tmp_path / "cluster"), "the cluster lock to be held")
    time.sleep(0.2)  # cluster 2 holds the machine shared and waits for the cluster lock
    assert "cluster 2 in" not in order
    releases["cluster 1"].set()
    until(lambda: "cluster 2 in" in order, "the second cluster holder once the first let go")
    threads.append(hold("exclusive", EXCLUSIVE))
    until(lambda: held_exclusively_by_someone(tmp_path / "turnstile"), "the exclusive holder to wait for the machine")
    releases["shared"].set()
    time.sleep(0.2)
    assert "exclusive in" not in order  # cluster 2 still holds the machine shared
    releases["cluster 2"].set()
    until(lambda: "exclusive in" in order, "the exclusive holder once every other let go")
    assert order[-1] == "exclusive in" and "cluster 2 out" in order
    releases["exclusive"].set()
    for thread in threads:
        thread.join(20)


def test_files_with_alone_tests_come_first_then_the_slowest_with_cluster_files_spread_among_them():
    """After each cluster file, ordinary files with CLUSTER_SPACING (40) slow tests or more: heavy_a and heavy_b."""
    files = {
        "small.py": FileMarks(tests=9, alone=0, slow=0, cluster=0),
        "slurm.py": FileMarks(tests=12, alone=0, slow=9, cluster=9),
        "partly_alone.py": FileMarks(tests=8, alone=1, slow=3, cluster=0),
        "compose.py": FileMarks(tests=4, alone=0, slow=4, cluster=4),
        "heavy_a.py": FileMarks(tests=5, alone=0, slow=30, cluster=0),
        "heavy_b.py": FileMarks(tests=6, alone=0, slow=10, cluster=0),
        "heavy_c.py": FileMarks(tests=3, alone=0, slow=2, cluster=0),
        "alone.py": FileMarks(tests=3, alone=3, slow=1, cluster=0),
    }
    assert file_order(files) == [
        "alone.py",
        "partly_alone.py",
        "slurm.py",
        "heavy_a.py",
        "heavy_b.py",
        "compose.py",
        "heavy_c.py",
        "small.py",
    ]
    assert file_order({"a.py": files["small.py"]}) == ["a.py"]
