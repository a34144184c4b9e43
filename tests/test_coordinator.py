"""Membership and work assignment, pure: a fake clock instead of waiting, plain lists instead of processes."""

from __future__ import annotations

import pytest

from src.coordinator import Membership, MembershipError, WorkPlan, check_coverage
from src.training.data import make_shards


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_sessions_bind_calls_to_one_incarnation():
    members = Membership(2, heartbeat_timeout_s=5.0, clock=FakeClock())
    first, replaced = members.register(0)
    assert replaced is None and first.incarnation == 1
    assert members.check(0, first.session) is first
    with pytest.raises(MembershipError) as wrong:
        members.check(1, first.session)  # worker 1 never registered: another id with my session is unknown
    assert wrong.value.kind == "unknown"
    second, replaced = members.register(0)
    assert replaced is first and first.state == "replaced" and second.incarnation == 2
    with pytest.raises(MembershipError) as late:
        members.check(0, first.session)  # a late message from the old incarnation
    assert late.value.kind == "revoked" and "incarnation 1 was replaced" in late.value.message
    with pytest.raises(MembershipError) as forged:
        members.check(0, b"\0" * 16)
    assert forged.value.kind == "unknown"
    with pytest.raises(ValueError, match="worker_id 2 is out of range 0..1"):
        members.register(2)


def test_a_restarted_server_awaits_the_checkpoints_live_workers_and_fails_the_silent_one():
    clock = FakeClock()
    members = Membership(3, heartbeat_timeout_s=5.0, clock=clock, first_incarnation=7)
    members.await_(0, incarnation=3, pid=100)
    members.await_(1, incarnation=4, pid=101)
    assert members.awaited() == [0, 1] and members.live() == [] and members.history == []
    with pytest.raises(MembershipError) as old:
        members.check(0, b"\1" * 16)  # the old incarnation's session: unknown here, so it registers again
    assert old.value.kind == "unknown"
    back, replaced = members.register(0, pid=100)
    assert replaced is None and back.incarnation == 7 and members.awaited() == [1] and members.live() == [0]
    clock.now += 5.5
    members.check(0, back.session)
    ((failed, silence),) = members.expire()
    assert (failed.worker_id, failed.pid, failed.state, silence) == (1, 101, "failed", 5.5)
    assert members.awaited() == [] and failed in members.history  # a registration after this is a rejoin
    assert members.expire() == []


def test_silence_past_the_timeout_fails_a_worker_and_calls_count_as_life():
    clock = FakeClock()
    members = Membership(2, heartbeat_timeout_s=5.0, clock=clock)
    a, _ = members.register(0)
    b, _ = members.register(1)
    clock.now += 4.0
    members.check(1, b.session)  # a heartbeat or any call
    assert members.expire() == []
    clock.now += 1.5  # worker 0 silent for 5.5 s, worker 1 for 1.5 s
    failed = members.expire()
    assert [(m.worker_id, round(s, 2)) for m, s in failed] == [(0, 5.5)]
    assert a.state == "failed" and members.live() == [1]
    assert members.expire() == []  # failed once
    with pytest.raises(MembershipError) as gone:
        members.check(0, a.session)
    assert gone.value.kind == "revoked"
    with pytest.raises(MembershipError):
        members.verify(a)
    members.finish(b)
    assert members.live() == [] and members.expire() == []  # a finished worker is never failed


def batches_of(handed):
    return {w: [list(b.indices) for b in bs] for w, bs in handed.items()}


def test_sync_rounds_read_the_baselines_large_batches():
    """Round i of all workers together is positions i*N*b .. (i+1)*N*b of the epoch permutation."""
    plan = WorkPlan(num_samples=50, num_workers=2, batch_size=8, num_epochs=2, seed=3, mode="sync")
    shards = make_shards(50, 2, 0, 3)
    rounds = []
    while not plan.finished():
        handed = plan.start_round([0, 1], [0, 1])
        assert handed, "a round with nothing to hand out before the run is finished"
        rounds.append(batches_of(handed))
        for worker in handed:
            plan.applied(worker)
    assert len(rounds) == 2 * 4  # 25 samples per shard: 3 full batches and one of 1, per epoch
    assert rounds[0] == {0: [shards[0].indices[:8]], 1: [shards[1].indices[:8]]}
    assert rounds[3] == {0: [shards[0].indices[24:]], 1: [shards[1].indices[24:]]}
    assert plan.epochs_done() == 2


def test_sync_never_mixes_epochs_and_uneven_shards_leave_workers_out():
    plan = WorkPlan(num_samples=9, num_workers=2, batch_size=2, num_epochs=2, seed=0, mode="sync")
    sizes = []
    while not plan.finished():
        handed = plan.start_round([0, 1], [0, 1])
        sizes.append({w: len(b[0].indices) for w, b in handed.items()})
        assert len({b.epoch for bs in handed.values() for b in bs}) == 1
        for worker in handed:
            plan.applied(worker)
    assert sizes[:3] == [{0: 2, 1: 2}, {0: 2, 1: 2}, {0: 1}]  # shard 0 has 5 samples, shard 1 has 4


def test_a_failed_workers_work_goes_to_the_survivors_and_every_index_lands_once():
    plan = WorkPlan(num_samples=60, num_workers=3, batch_size=5, num_epochs=1, seed=1, mode="sync")
    applied: list[int] = []
    first = plan.start_round([0, 1, 2], [0, 1, 2])
    for worker in (0, 1):
        batches, _ = plan.applied(worker)
        applied += [i for b in batches for i in b.indices]
    moved = plan.release(2, [0, 1])  # worker 2 dies holding its first batch, with 3 more queued
    assert sum(len(bs) for bs in moved.values()) == 4 and set(moved) == {0, 1}
    assert first[2][0] in [b for bs in moved.values() for b in bs]
    live = [0, 1]
    while not plan.finished():
        handed = plan.start_round(live, live)
        assert handed and set(handed) <= {0, 1}
        for worker in handed:
            batches, _ = plan.applied(worker)
            applied += [i for b in batches for i in b.indices]
    assert sorted(applied) == list(range(60))


def test_async_one_worker_reads_the_baselines_order_and_epochs_roll_on():
    plan = WorkPlan(num_samples=20, num_workers=1, batch_size=6, num_epochs=2, seed=5, mode="async")
    order = []
    while True:
        batches = plan.next_for(0, [0])
        if not batches:
            break
        order.append((batches[0].epoch, list(batches[0].indices)))
        plan.applied(0)
    expected = [(e, s.indices[i : i + 6]) for e in range(2) for s in make_shards(20, 1, e, 5) for i in range(0, 20, 6)]
    assert order == expected and plan.finished()


def test_async_stealing_keeps_a_fast_worker_busy():
    """Worker 1 takes one batch and stalls; worker 0 does all the rest of the epoch, taking from 1's queue."""
    plan = WorkPlan(num_samples=40, num_workers=2, batch_size=5, num_epochs=1, seed=0, mode="async")
    slow = plan.next_for(1, [0, 1])
    done_by_fast = 0
    while True:
        batches = plan.next_for(0, [0, 1])
        if not batches:
            break
        plan.applied(0)
        done_by_fast += 1
    assert done_by_fast == 7 and not plan.finished()  # everything but the slow worker's batch in flight
    plan.applied(1)
    assert plan.finished() and len(slow) == 1


def test_local_steps_hand_out_several_batches_and_sync_stops_at_the_epoch_end():
    plan = WorkPlan(num_samples=30, num_workers=1, batch_size=4, num_epochs=2, seed=0, mode="sync", batches_per_step=3)
    handed = plan.start_round([0], [0])
    assert [len(b.indices) for b in handed[0]] == [4, 4, 4]
    plan.applied(0)
    plan.start_round([0], [0])
    plan.applied(0)
    last = plan.start_round([0], [0])[0]
    assert [len(b.indices) for b in last] == [4, 2] and {b.epoch for b in last} == {0}


def test_carried_batches_can_be_claimed_back_after_a_restart():
    plan = WorkPlan(num_samples=20, num_workers=1, batch_size=5, num_epochs=1, seed=0, mode="async")
    first = plan.next_for(0, [0])
    state = plan.state_dict()  # the server checkpoints while worker 0 holds `first` (say, carried after a rejection)
    restored = WorkPlan(num_samples=20, num_workers=1, batch_size=5, num_epochs=1, seed=0, mode="async")
    restored.load_state_dict(state)
    assert restored.holding(0) == [] and restored.claim(0, [first[0].batch_id, 999]) == [999]
    assert restored.holding(0) == first
    rest = []
    while batches := restored.next_for(0, [0]):
        rest += batches
    assert first[0] not in rest and len(rest) == 3


def test_coverage_audit_counts_missing_and_twice_applied_samples_and_voids_lost_updates():
    def update(version, epoch, indices):
        return {"kind": "update", "version": version, "samples": [[epoch, indices]]}

    events = [
        update(1, 0, [0, 1]),
        update(2, 0, [2]),
        update(3, 0, [3]),
        {"kind": "server_recovered", "version": 2},
        update(3, 0, [3]),
    ]
    report = check_coverage(events, num_samples=4, num_epochs=1)
    assert report["ok"] and report["voided"] == 1
    bad = check_coverage([update(1, 0, [0, 1]), update(2, 0, [1])], num_samples=3, num_epochs=1)
    assert not bad["ok"] and bad["missing"] == 1 and bad["duplicated"] == 1
    assert bad["examples"] == {"missing": [(0, 2)], "duplicated": [(0, 1)], "unexpected": []}
    twice = check_coverage(
        [{**update(1, 0, [0]), "requests": [[0, 7]]}, {**update(2, 0, [1]), "requests": [[0, 7]]}], 2, 1
    )
    assert not twice["ok"] and twice["requests_applied_twice"] == 1


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_queued_count_follows_every_change_of_the_queues(mode):
    """The O(1) ``unassigned`` a polling server relies on equals the queues' length after any sequence of changes."""
    import random

    chooser = random.Random(7)
    plan = WorkPlan(200, 4, 8, 3, seed=1, mode=mode)
    live = [0, 1, 2, 3]

    def check() -> None:
        for epoch in plan.epochs.values():
            assert epoch.unassigned() == sum(len(q) for q in epoch.queues.values())

    for _ in range(300):
        action = chooser.choice(["take", "take", "apply", "fail", "rejoin", "restore"])
        worker = chooser.choice(range(4))
        if action == "take":
            plan.start_round(live, live) if mode == "sync" else plan.next_for(worker, live)
        elif action == "apply" and plan.holding(worker):
            plan.applied(worker)
        elif action == "fail" and len(live) > 1 and worker in live:
            live.remove(worker)
            plan.release(worker, live)
        elif action == "rejoin" and worker not in live:
            live.append(worker)
            live.sort()
            plan.claim(worker, [b.batch_id for q in plan.epochs[max(plan.epochs)].queues.values() for b in list(q)[:1]])
        elif action == "restore":
            restored = WorkPlan(200, 4, 8, 3, seed=1, mode=mode)
            restored.load_state_dict(plan.state_dict())
            plan = restored
        check()


def test_sync_a_worker_back_mid_epoch_gets_its_share_of_what_is_left():
    """Worker 1 fails after one round (its queue goes to worker 0) and comes back: the next round evens the
    queues, so it trains again in this epoch; every index still lands once."""
    plan = WorkPlan(num_samples=80, num_workers=2, batch_size=4, num_epochs=1, seed=2, mode="sync")
    applied: list[int] = []
    for worker in plan.start_round([0, 1], [0, 1]):
        applied += [i for b in plan.applied(worker)[0] for i in b.indices]
    plan.release(1, [0])  # 9 queued batches of worker 1 go to worker 0: 18 there, none left for 1
    assert len(plan.start_round([0], [0])[0]) == 1  # a round without it
    applied += [i for b in plan.applied(0)[0] for i in b.indices]
    handed = plan.start_round([0, 1], [0, 1])  # worker 1 is back
    assert set(handed) == {0, 1}
    queues = plan.epochs[0].queues
    assert abs(len(queues[0]) - len(queues[1])) <= 1 and len(queues[0]) + len(queues[1]) == 15
    assert [b.batch_id for b in queues[1]] == sorted(b.batch_id for b in queues[1])
    while True:
        for worker in handed:
            applied += [i for b in plan.applied(worker)[0] for i in b.indices]
        if plan.finished():
            break
        handed = plan.start_round([0, 1], [0, 1])
    assert sorted(applied) == list(range(80))


def test_check_shards_finds_a_follower_version_missing_extra_or_made_of_other_pushes():
    from src.coordinator import check_shards

    def update(version, *requests):
        return {"kind": "update", "version": version, "requests": [list(r) for r in requests]}

    server = [update(1, (0, 1), (1, 1)), update(2, (0, 2)), {"kind": "server_recovered", "version": 1}]
    server += [update(2, (0, 3), (1, 2))]
    same = [update(1, (1, 1), (0, 1)), update(2, (0, 2)), {"kind": "shard_recovered", "version": 1}]
    same += [update(2, (0, 3), (1, 2))]
    assert check_shards(server, {1: same}) == {
        "ok": True,
        "versions": 2,
        "shards": {1: {"versions": 2, "missing": [], "extra": [], "differ": []}},
    }
    not_rolled_back = [update(1, (0, 1), (1, 1)), update(2, (0, 2))]  # kept the voided version 2
    lagging = [update(1, (0, 1), (1, 1))]
    ahead = same + [update(3, (0, 4))]
    report = check_shards(server, {1: not_rolled_back, 2: lagging, 3: ahead})
    assert not report["ok"]
    assert report["shards"][1]["differ"] == [2]
    assert report["shards"][2]["missing"] == [2]
    assert report["shards"][3]["extra"] == [3]
