"""Sync versions across shards (src/ps/shards/rounds.py): followers apply what shard 0 certified, so S shards give
the unsharded server's model (to float32 rounding), also when a worker fails mid-push; forged and out-of-order
certificates are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from src.common.sessions import session_key
from src.config import Config
from src.ps.shards.parts import model_placement, shard_module, trainable, whole_state
from src.ps.shards.rounds import FollowerRounds, ForgedCertificate, RoundCertificate, ShardBehind, certify
from src.ps.state.aggregation import Contribution, ModelState
from src.ps.state.staleness import server_optimizer
from src.ps.worker.codec import shard_gradients

KEY = session_key(b"the run's token")
WORKERS = 3
RTOL, ATOL = 1e-6, 1e-7
"""Sharded against unsharded: float32 rounding. The sums of a cut tensor's pieces are the whole tensor's element for
element except where a cut moves an element between torch's vectorized loop and its scalar tail (fused
multiply-add in one, not in the other): measured, at most 1.5e-8 on weights of magnitude 0.3 after five steps."""


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10))


def _state(module: nn.Module, config: Config) -> ModelState:
    return ModelState(module, server_optimizer(config, [p for _, p in trainable(module)]))


def _push(whole: ModelState, round_: int, worker: int) -> Contribution:
    generator = torch.Generator().manual_seed(1000 * round_ + worker)
    gradients = [torch.randn(p.shape, generator=generator) for p in whole.params]
    buffers = [torch.rand(b.shape, generator=generator) for b in whole.buffers]
    return Contribution(worker, 16 + 5 * worker, gradients, buffers, request_id=10 * round_ + worker + 1)


def _slices(push: Contribution, whole: ModelState, part: ModelState, placement, shard: int) -> Contribution:
    gradients = [e for _, e in shard_gradients(placement, zip(whole.param_names, push.gradients))[shard]]
    by_name = dict(zip(whole.buffer_names, push.buffers))
    buffers = [by_name[name] for name in part.buffer_names]
    return Contribution(push.worker, push.num_samples, gradients, buffers, request_id=push.request_id)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("shards", [2, 3])
def test_followers_applying_shard_0s_certificates_give_the_unsharded_model(optimizer, shards):
    """Five rounds of three workers. Round 1: worker 2 fails mid-push (its slices reach the first follower only,
    never shard 0), so it contributes on no shard. Round 3: worker 0's push to a follower is retried. The rate
    changes every round (shard 0's schedule, carried by the certificate)."""
    config = Config()
    config = config.model_copy(update={"training": config.training.model_copy(update={"optimizer": optimizer})})
    model = _model()
    unsharded = _state(model, config)
    placement = model_placement(model, shards, slice_bytes=1024)  # the 5 KB first layer is cut in 5
    parts = [_state(shard_module(model, placement, k), config) for k in range(shards)]
    followers = [FollowerRounds(part, KEY) for part in parts[1:]]
    for round_ in range(5):
        pushes = [_push(unsharded, round_, w) for w in range(WORKERS)]
        for push in pushes:
            reached = range(1, 2) if (round_, push.worker) == (1, 2) else range(1, shards)  # worker 2 dies
            for k in reached:
                assert followers[k - 1].hold(round_ + 1, _slices(push, unsharded, parts[k], placement, k))
            if round_ == 3 and push.worker == 0:
                assert not followers[0].hold(round_ + 1, _slices(push, unsharded, parts[1], placement, 1))
        committed = [p for p in pushes if (round_, p.worker) != (1, 2)]
        rate = 0.05 / (1 + round_)
        for state, shard in ((unsharded, None), (parts[0], 0)):  # the unsharded server and shard 0's barrier
            state.set_learning_rate(rate)
            mine = committed if shard is None else [_slices(p, unsharded, state, placement, 0) for p in committed]
            state.step(*state.average(mine))
        certificate = certify(KEY, parts[0].version, [(p.worker, p.request_id) for p in committed], rate)
        for follower in followers:
            assert follower.apply(certificate)
            assert not follower.apply(certificate)  # a second worker carries it too: already applied
            assert follower.held == {}
    assert {part.version for part in parts} == {unsharded.version} == {5}
    assembled = whole_state(model, placement, [part.model.state_dict() for part in parts])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(assembled[name], value, rtol=RTOL, atol=ATOL, msg=name)


def _follower() -> tuple[FollowerRounds, ModelState]:
    model = _model()
    placement = model_placement(model, 2, slice_bytes=1024)
    part = _state(shard_module(model, placement, 1), Config())
    return FollowerRounds(part, KEY), part


def _contribution(part: ModelState, worker: int, request_id: int) -> Contribution:
    return Contribution(worker, 8, [torch.ones_like(p) for p in part.params], request_id=request_id)


def test_a_forged_or_tampered_certificate_is_refused_and_changes_nothing():
    follower, part = _follower()
    follower.hold(1, _contribution(part, 0, 7))
    before = [p.clone() for p in part.params]
    genuine = certify(KEY, 1, [(0, 7)], 0.1)
    for forged in (
        certify(session_key(b"not the run's token"), 1, [(0, 7)], 0.1),
        replace(genuine, learning_rate=0.2),
        replace(genuine, contributors=((0, 7), (1, 8))),
        replace(genuine, rolled_back=(1,)),  # an async push's rollbacks are shard 0's word too
        replace(genuine, tag=b""),
    ):
        with pytest.raises(ForgedCertificate):
            follower.apply(forged)
    assert part.version == 0 and all(torch.equal(p, b) for p, b in zip(part.params, before))
    assert follower.apply(genuine) and part.version == 1


def test_a_certificate_on_the_wire_is_the_certificate_rolled_back_shards_and_all():
    """A sync version's certificate has no rollbacks (its bytes as they always were); an async one's names the shards
    that rolled its push back, maybe none."""
    sync = certify(KEY, 5, [(2, 9), (0, 4)], 0.05)
    assert RoundCertificate.decode(sync.encode()) == sync and len(sync.encode()) == 16 + 2 * 12 + 16
    assert sync.contributors == ((0, 4), (2, 9)) and sync.rolled_back is None and not sync.rolls_back(0)
    for rolled_back in ((), (0,), (1, 3)):
        certificate = certify(KEY, 5, [(2, 9), (0, 4)], 0.05, rolled_back)
        assert RoundCertificate.decode(certificate.encode(), asynchronous=True) == certificate
        assert certificate.rolled_back == rolled_back and certificate.rolls_back(1) == (1 in rolled_back)
    for malformed in (b"", certify(KEY, 5, [(0, 4)], 0.05, (1, 2)).encode()[:-3], sync.encode()[:17]):
        with pytest.raises(ForgedCertificate, match="malformed"):
            RoundCertificate.decode(malformed, asynchronous=True)


def test_a_follower_that_lacks_a_certified_push_or_a_version_says_it_is_behind():
    follower, part = _follower()
    follower.hold(1, _contribution(part, 0, 7))
    with pytest.raises(ShardBehind, match=r"\(1, 8\)"):
        follower.apply(certify(KEY, 1, [(0, 7), (1, 8)], 0.1))
    with pytest.raises(ShardBehind, match=r"\(0, 9\)"):  # another push of worker 0 was certified
        follower.apply(certify(KEY, 1, [(0, 9)], 0.1))
    with pytest.raises(ShardBehind, match="version 3"):
        follower.apply(certify(KEY, 3, [(0, 7)], 0.1))
    assert part.version == 0
    assert follower.apply(certify(KEY, 1, [(0, 7)], 0.1)) and part.version == 1


def test_a_push_for_another_version_is_refused_and_a_workers_newer_push_replaces_its_held_one():
    """A worker that registered again redoes its work with a new request id: the new push replaces the held one,
    and only the certificate says which counts (the old one certified is then missing: behind)."""
    follower, part = _follower()
    with pytest.raises(ValueError, match="push for version 2, but this shard's next version is 1"):
        follower.hold(2, _contribution(part, 0, 7))
    assert follower.hold(1, _contribution(part, 0, 7))
    assert not follower.hold(1, _contribution(part, 0, 7))  # a retry of the held push: nothing changes
    assert follower.hold(1, _contribution(part, 0, 8))
    assert follower.held[0].request_id == 8
    with pytest.raises(ShardBehind, match=r"\(0, 7\)"):
        follower.apply(certify(KEY, 1, [(0, 7)], 0.1))
    assert follower.apply(certify(KEY, 1, [(0, 8)], 0.1)) and part.version == 1
    with pytest.raises(ValueError, match="at least one contributor"):
        certify(KEY, 1, [], 0.1)
