"""The de-dup log (src/ps/state/aggregation.py RequestLog): a retry gets the first reply, nothing is applied twice."""

from __future__ import annotations

from src.ps.state.aggregation import RequestLog


def test_a_retry_gets_the_first_reply_and_only_the_newest_reply_is_kept():
    log = RequestLog()
    log.begin(0, 7)
    assert log.lookup(0, 7) is RequestLog.IN_PROGRESS
    log.finish(0, 7, b"reply 7", applied=True)
    assert log.lookup(0, 7) == b"reply 7" and log.was_applied(0, 7)
    log.begin(0, 8)
    log.finish(0, 8, b"reply 8", applied=False)  # a rejected push: handled, not applied
    assert log.lookup(0, 8) == b"reply 8" and not log.was_applied(0, 8)
    # A model-sized reply is held once per worker: the older one is gone, its request still known.
    assert log.lookup(0, 7) is RequestLog.SUPERSEDED
    assert log.lookup(0, 9) is None and log.lookup(1, 7) is None


def test_an_abandoned_request_is_handled_afresh_and_outcomes_survive_a_checkpoint():
    log = RequestLog()
    log.begin(3, 1)
    log.abandon(3, 1)
    assert log.lookup(3, 1) is None
    log.finish(3, 2, b"r", applied=True)
    restored = RequestLog()
    restored.load_state_dict(log.state_dict())
    assert restored.was_applied(3, 2) and restored.lookup(3, 2) is RequestLog.SUPERSEDED  # no reply after a restart
