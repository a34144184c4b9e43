"""Sessions across parameter-server shards (src/common/sessions.py, src/ps/shards/sessions.py): a session shard 0
issues is accepted on every shard without asking shard 0; forged, misdirected, stale and failed ones are refused
on each."""

from __future__ import annotations

import pytest

from src.common.sessions import SESSION_BYTES, ForgedSession, SessionSigner, session_key
from src.coordinator import Membership, MembershipError
from src.ps.shards.sessions import ShardSessions

KEY = session_key(b"the run's token")


def _shards(count: int = 3) -> tuple[Membership, list[ShardSessions]]:
    membership = Membership(4, heartbeat_timeout_s=30.0, clock=lambda: 0.0, signer=SessionSigner(KEY))
    return membership, [ShardSessions(SessionSigner(KEY), 4) for _ in range(count - 1)]


def test_a_session_shard_0_issues_is_accepted_on_every_shard_and_by_shard_0():
    membership, others = _shards()
    member, _ = membership.register(2)
    assert len(member.session) == SESSION_BYTES
    assert membership.check(2, member.session) is member
    assert [shard.check(2, member.session) for shard in others] == [member.incarnation] * len(others)


def test_forged_and_misdirected_sessions_are_refused_as_unknown_on_every_shard():
    membership, others = _shards()
    member, _ = membership.register(1)
    foreign = SessionSigner(session_key(b"another run's token")).issue(1, member.incarnation)
    tampered = bytearray(member.session)
    tampered[0] ^= 1  # the incarnation changed: the tag no longer holds
    for session in (foreign, bytes(tampered), member.session[:-1], b""):
        for shard in others:
            with pytest.raises(MembershipError) as refused:
                shard.check(1, session)
            assert refused.value.kind == "unknown"
        with pytest.raises(MembershipError):
            membership.check(1, session)
    for shard in others:  # worker 3 cannot use worker 1's session
        with pytest.raises(MembershipError, match="signature") as refused:
            shard.check(3, member.session)
        assert refused.value.kind == "unknown"
        with pytest.raises(MembershipError, match="out of range"):
            shard.check(4, member.session)


def test_a_stale_session_is_refused_once_a_newer_incarnation_is_seen_and_a_failed_one_once_revoked():
    membership, others = _shards()
    old, _ = membership.register(0)
    new, replaced = membership.register(0)
    assert replaced is old and new.incarnation > old.incarnation
    shard = others[0]
    assert shard.check(0, old.session) == old.incarnation  # nothing newer seen here yet
    assert shard.check(0, new.session) == new.incarnation
    with pytest.raises(MembershipError, match="stale") as refused:
        shard.check(0, old.session)
    assert refused.value.kind == "revoked"
    other = others[1]  # a shard that never saw the new incarnation learns of the old one's end from shard 0
    other.revoke(0, old.incarnation)
    with pytest.raises(MembershipError, match="failed by shard 0") as refused:
        other.check(0, old.session)
    assert refused.value.kind == "revoked"
    assert other.check(0, new.session) == new.incarnation


def test_the_signer_refuses_what_it_did_not_sign_and_the_key_needs_a_secret():
    signer = SessionSigner(KEY, nonce=lambda n: bytes(n))
    session = signer.issue(5, 9)
    assert signer.open(5, session) == 9
    assert signer.issue(5, 9) == session  # the same nonce: the same session (the nonce is what makes them differ)
    assert SessionSigner(KEY).issue(5, 9) != SessionSigner(KEY).issue(5, 9)
    with pytest.raises(ForgedSession):
        SessionSigner(session_key(b"x")).open(5, session)
    with pytest.raises(ValueError, match="secret is empty"):
        session_key(b"")


def test_an_unsigned_membership_keeps_its_random_sessions():
    membership = Membership(2, heartbeat_timeout_s=30.0, clock=lambda: 0.0, session_bytes=lambda n: b"s" * n)
    member, _ = membership.register(0)
    assert member.session == b"s" * 16
