"""Exposed communication split at the moment every worker's gradients were ready (:mod:`src.telemetry.peer_wait`):
what a faster worker waited for the slowest one, and what the communication itself left exposed after it."""

from __future__ import annotations

import pytest

from src.telemetry.peer_wait import ddp_steps, ps_steps, split_exposed


def test_a_wait_splits_at_the_slowest_workers_ready_time():
    # step 0: worker 0 ready at 1.0 and waits until 1.5; worker 1 ready at 1.3 and waits until 1.5
    # step 1: both ready at 3.0, both wait 0.1
    ready = [[1.0, 3.0], [1.3, 3.0]]
    waits = [[[(1.0, 1.5)], [(3.0, 3.1)]], [[(1.3, 1.5)], [(3.0, 3.1)]]]
    split = split_exposed(ready, waits)
    assert split["steps"] == 2
    assert split["waiting_for_peers_s"] == pytest.approx(0.3 / 4)
    assert split["after_all_ready_s"] == pytest.approx((0.2 + 0.2 + 0.1 + 0.1) / 4)


def test_a_streamed_workers_forward_waits_count_for_the_step_whose_reply_they_wait_for():
    forward_backward = [(0.0, 1.0), (1.2, 2.0), (2.1, 3.0)]
    reply_wait = [(1.0, 1.2), (2.0, 2.1), (3.0, 3.05)]
    parameter_wait = [(1.5, 1.6), (2.5, 2.55)]  # in the forwards of steps 1 and 2: replies 0 and 1
    ready, waits = ps_steps(forward_backward, reply_wait, parameter_wait)
    assert ready == [1.0, 2.0, 3.0]
    assert waits == [[(1.0, 1.2), (1.5, 1.6)], [(2.0, 2.1), (2.5, 2.55)], [(3.0, 3.05)]]


def test_a_ddp_ranks_exchange_wait_starts_when_its_gradients_are_ready():
    ready, waits = ddp_steps([(1.0, 1.2), (2.0, 2.5)])
    assert ready == [1.0, 2.0] and waits == [[(1.0, 1.2)], [(2.0, 2.5)]]
