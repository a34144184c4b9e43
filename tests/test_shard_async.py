"""Async pushes across shards (src/ps/shards/asynchronous.py) between the real cores, in one process: each shard judges
a push's staleness against its own version, a push is applied on the shards that find it fresh enough and rolled back
on the others (its residual there too), in shard 0's order, and the followers apply the pushes of a worker that died
after its commit.

The messages are the protocol's own bytes (serialized and split as a transport does), built by the workers' own
code (src/ps/worker/machine.py); the runs of real shard processes are in tests/test_shard_server.py and
tests/test_ps_equivalence.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from src import parameter_server_pb2 as pb
from src.config import config_from_data
from src.coordinator import applied_history, check_shards
from src.parameter_server import planned_work
from src.ps.server.core import ServerCore
from src.ps.shards.asynchronous import ROLLED_BACK_HERE, decode_chain
from src.ps.shards.follower import FollowerCore
from src.ps.shards.parts import model_placement
from src.ps.shards.shard_zero import Sharding
from src.ps.worker.codec import PushCodec
from src.ps.worker.loading import load_reply, load_shard_reply, served_tensors
from src.ps.worker.machine import applied_on, commit, holds
from src.transport.errors import PushRefused, Refused
from tests.test_shard_protocol import KEY, SAMPLES, _data, _message, _model, _reply

RTOL, ATOL = 1e-5, 1e-6
"""Sharded against unsharded: the same pushes in the same order on the same values; float32 rounding only."""


def _config(tmp_path: Path, *, workers: int = 2, policy: str = "none", max_staleness: int = 8, beta: float = 0.5):
    return config_from_data(
        {
            "training": {"batch_size": 8, "num_epochs": 1, "learning_rate": 0.1, "checkpoint_interval": 1000},
            "system": {
                "num_workers": workers,
                "aggregation_mode": "async",
                "staleness_policy": policy,
                "max_staleness": max_staleness,
                "staleness_beta": beta,
                "heartbeat_timeout": 600,
                "log_dir": str(tmp_path / "logs"),
                "checkpoint_dir": str(tmp_path / "checkpoints"),
            },
        }
    )


class AsyncRun:
    """``shards`` server cores (or one unsharded server) and workers that take their steps call by call, so a test
    chooses the interleaving: each worker's hold, commit and pulls (sharded) or push (unsharded)."""

    def __init__(self, config, model, shards: int):
        self.config, self.shards = config, shards
        work = planned_work(config, SAMPLES)
        self.placement = model_placement(model, shards, 1024) if shards > 1 else None
        sharding = Sharding(self.placement, KEY) if shards > 1 else None
        self.core = ServerCore(config, work=work, model=copy.deepcopy(model), tensorboard=False, sharding=sharding)
        self.followers = [
            FollowerCore(config, model=model, placement=self.placement, shard=k, key=KEY) for k in range(1, shards)
        ]
        workers = range(config.system.num_workers)
        self.replicas = [copy.deepcopy(model) for _ in workers]
        names = [n for n, _ in served_tensors(model)[0]]
        self.codecs = [
            PushCodec(
                config.system, None, error_feedback=True, seed=0, worker_id=w, names=names, placement=self.placement
            )
            for w in workers
        ]
        self.callers, self.members, self.work = {}, {}, {}
        self.versions = {w: [0] * shards for w in workers}
        self.request_ids = {w: 0 for w in workers}
        self.pending: dict[int, tuple] = {}
        self.acks: dict[int, list[pb.PushReply]] = {}
        self.chains: dict[int, bytes] = {}
        self.verdicts: dict[int, pb.PushReply] = {}
        self.x, self.y = _data()
        for w in workers:
            self.join(w)

    def join(self, w: int) -> None:
        """Register ``w`` (again: a new incarnation, the old one failed) and pull every shard."""
        core = self.core
        with core.lock:
            reply, _ = core.register(pb.RegisterRequest(worker_id=w), f"test:{w}")
            self.callers[w] = caller = pb.Caller(worker_id=w, session=reply.session)
            member = core.begin_pull(caller)
            reply = _reply(core.pull_reply(member, core.poll_work(member)), pb.PullReply)
        self._load(w, 0, reply)
        self.work[w] = list(reply.message.work.batches)
        for k in range(1, self.shards):
            self._pull_follower(w, k, reply.message.certificate)

    def _load(self, w: int, shard: int, reply) -> None:
        params, buffers = served_tensors(self.replicas[w])
        if self.placement is None:
            self.versions[w][0] = load_reply([p for _, p in params], [b for _, b in buffers], reply)
        else:
            self.versions[w][shard] = load_shard_reply(
                self.placement, shard, dict(params), [b for _, b in buffers], reply
            )

    def _pull_follower(self, w: int, k: int, chain: bytes) -> None:
        follower, caller = self.followers[k - 1], self.callers[w]
        follower.member(caller)
        data = follower.pull(w, pb.PullRequest(caller=caller, certificate=chain, parameters_only=True))
        self._load(w, k, _reply(data, pb.PullReply))

    def compute(self, w: int) -> None:
        model = self.replicas[w]
        model.zero_grad()
        indices = [i for batch in self.work[w] for i in batch.indices]
        torch.nn.functional.cross_entropy(model(self.x[indices]), self.y[indices]).backward()
        self.request_ids[w] += 1
        request = pb.PushRequest(
            caller=self.callers[w],
            base_version=self.versions[w][0],
            request_id=self.request_ids[w],
            num_samples=len(indices),
            batch_ids=[b.batch_id for b in self.work[w]],
        )
        self.pending[w] = ([(n, p.grad) for n, p in served_tensors(model)[0]], request)

    def hold(self, w: int) -> list[pb.PushReply]:
        """Every shard holds ``w``'s pending push (each based on its own version); the followers' hold replies."""
        gradients, request = self.pending[w]
        per_shard = self.codecs[w].encode(gradients, 0)
        held = holds(request, self.versions[w])
        acks = [pb.PushReply(accepted=True)]
        for k, follower in enumerate(self.followers, start=1):
            follower.member(held[k].caller)
            data = follower.hold(w, held[k], follower.decode(w, _message(held[k], per_shard[k])))
            acks.append(pb.PushReply.FromString(data))
        with self.core.lock:
            self.core.hold(
                self.core.member(held[0].caller), held[0], self.core.decode(w, _message(held[0], per_shard[0]))
            )
        self.acks[w] = acks
        return acks[1:]

    def commit(self, w: int) -> pb.PushReply:
        """Commit ``w``'s held push to shard 0; its verdict (the reply's parameters wait for :meth:`pull`), settled on
        ``w``'s residuals shard by shard as a worker settles it (:func:`src.ps.worker.machine.applied_on`)."""
        _, request = self.pending[w]
        message = _message(commit(request, self.acks[w], self.versions[w][0], "async"))
        verdict = self._push_to_core(w, message)
        for shard in range(self.shards):
            self.codecs[w].settle(shard, accepted=applied_on(verdict, shard))
        return verdict

    def residuals(self, w: int, shard: int) -> list[torch.Tensor]:
        """``w``'s error-feedback residuals of shard ``shard``'s slices (zeros where none)."""
        feedback = self.codecs[w].feedback
        out = []
        for piece in self.placement.on_shard(shard):
            residual = feedback.residual(piece.key)
            out.append(torch.zeros(piece.stop - piece.start) if residual is None else residual.reshape(-1))
        return out

    def slices(self, shard: int) -> list[torch.Tensor]:
        """Shard ``shard``'s parameters now (copies)."""
        state = self.core.state if shard == 0 else self.followers[shard - 1].state
        return [p.detach().clone().reshape(-1) for p in state.params]

    def push(self, w: int) -> pb.PushReply:
        """Unsharded: push ``w``'s pending gradient and load the reply."""
        gradients, request = self.pending[w]
        verdict = self._push_to_core(w, _message(request, self.codecs[w].encode(gradients, 0)[0]))
        self._load(w, 0, self._reply)
        return verdict

    def _push_to_core(self, w: int, received) -> pb.PushReply:
        core = self.core
        with core.lock:
            member = core.begin_push(received.message.caller, received.message)
            verdict = core.apply_push(member, received.message, core.decode(w, received))
            data = core.push_reply(member, received.message.request_id, verdict, core.poll_work(member))
            self.members[w] = member
        self._reply = reply = _reply(data, pb.PushReply)
        carried = [] if reply.message.accepted else self.work[w]  # a rejected push's batches stay with the worker
        self.work[w] = carried + list(reply.message.work.batches)
        self.chains[w] = reply.message.certificate
        self.verdicts[w] = reply.message
        return reply.message

    def pull_shard_0(self, w: int) -> None:
        """Pull shard 0's slices alone (at its newest version)."""
        with self.core.lock:
            self._load(w, 0, _reply(self.core.parameters(self.core.member(self.callers[w])), pb.PullReply))

    def pull(self, w: int) -> None:
        """Pull every shard, the followers with the window of ``w``'s commit reply."""
        with self.core.lock:
            self._load(w, 0, _reply(self.core.parameters(self.members[w]), pb.PullReply))
        for k in range(1, self.shards):
            self._pull_follower(w, k, self.chains[w])

    def step(self, w: int) -> pb.PushReply:
        """One whole step of ``w``."""
        self.compute(w)
        if self.placement is None:
            return self.push(w)
        self.hold(w)
        verdict = self.commit(w)
        self.pull(w)
        return verdict

    def whole(self) -> dict[str, torch.Tensor]:
        state = self.core.state
        parts = {n: p.detach().clone() for n, p in zip(state.param_names, state.params)}
        if self.placement is None:
            return parts
        for follower in self.followers:
            parts.update({n: p.detach().clone() for n, p in zip(follower.state.param_names, follower.state.params)})
        shapes = {n: p.shape for n, p in self.replicas[0].named_parameters()}
        return {n: t.reshape(shapes[n]) for n, t in self.placement.assemble(parts, torch.cat).items()}

    def events(self, shard: int) -> list[dict]:
        (self.core if shard == 0 else self.followers[shard - 1]).log.flush()
        folder = "server" if shard == 0 else f"server_{shard}"
        path = Path(self.config.system.log_dir) / folder / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def close(self) -> None:
        self.core.close()
        for follower in self.followers:
            follower.close()


def _interleaved(run: AsyncRun) -> None:
    """Two workers: in turn, then stale (1 commits and 0 pushes on what it pulled before), then worker 0 fails
    (registers again: its momentum is dropped) and both go on."""
    run.step(0)
    run.step(1)
    run.compute(0)
    run.step(1)  # worker 0's gradient is now one version stale
    if run.placement is None:
        run.push(0)
    else:
        run.hold(0)
        run.commit(0)
        run.pull(0)
    run.join(0)  # a new incarnation: its predecessor's momentum goes, on every shard
    for _ in range(2):
        run.step(1)
        run.step(0)


def _replace(config, folder: Path):
    system = config.system.model_copy(update={"log_dir": str(folder / "logs"), "checkpoint_dir": str(folder / "ck")})
    return config.model_copy(update={"system": system})


def test_async_over_shards_is_async_on_one_server_push_for_push(tmp_path):
    """The same interleaving of two workers (stale pushes, a worker registering again) on one server and on
    sharded servers: the same model, parameter for parameter (lookahead momentum: per-worker state, dropped
    on every shard at the same point); every follower's history is shard 0's, and coverage is exact so far."""
    config, model = _config(tmp_path / "one"), _model()
    one = AsyncRun(config, model, 1)
    _interleaved(one)
    for shards in (2, 3):
        sharded = AsyncRun(_replace(config, tmp_path / f"s{shards}"), model, shards)
        _interleaved(sharded)
        assert sharded.core.version == one.core.version == 8
        assert len(sharded.placement.of_tensor("0.weight")) > 1, "the test should cut a tensor across shards"
        whole, reference = sharded.whole(), one.whole()
        for name in reference:
            torch.testing.assert_close(whole[name], reference[name], rtol=RTOL, atol=ATOL, msg=name)
        audit = check_shards(sharded.events(0), {k: sharded.events(k) for k in range(1, shards)})
        assert audit["ok"], audit
        dropped = [(e["version"], e["worker"]) for e in sharded.events(1) if e["kind"] == "momentum_dropped"]
        assert dropped == [(4, 0)], "worker 0's momentum is dropped once, where shard 0 dropped it"
        sharded.close()
    one.close()


def _stale_on(run: AsyncRun, shard: int) -> None:
    """Leave worker 0's next push one version stale on ``shard`` and fresh on the other (2 shards, worker 1 commits a
    push first). Shard 1: worker 0 pulls shard 0 after worker 1's commit but its follower before (the follower lags),
    then worker 1's pull brings the follower up. Shard 0: worker 0 has pulled both before worker 1's commit, and the
    follower has not moved when worker 0's hold comes."""
    if shard == 1:
        run.compute(1)
        run.hold(1)
        run.commit(1)  # version 1 on shard 0; worker 1 has not pulled, so the follower is at 0
        run.pull_shard_0(0)
        run._pull_follower(0, 1, b"")
        assert run.versions[0] == [1, 0]
        run.pull(1)  # worker 1's window brings the follower to version 1
    else:
        run.compute(1)
        run.hold(1)
        run.commit(1)  # version 1 on shard 0 only: worker 0 computes on version 0 of both
    run.compute(0)
    staleness = [0, 0]
    staleness[shard] = 1
    (held,) = run.hold(0)
    assert held.accepted and held.staleness == staleness[1]  # the follower holds it and says its staleness


def test_a_push_one_shard_finds_too_stale_is_rolled_back_there_only_and_its_residual_goes_with_the_next(tmp_path):
    """Per-slice Residual Rollback. With max_staleness 0 (set on shard 0 as the controller sets it; the config says
    8), worker 0's push is one version stale on one shard and fresh on the other. Shard 0 judges both: the push is
    applied where it is fresh, and rolled back where it is too stale (the version passes there, nothing changes).
    The worker rolls back that shard's residual only: it holds the whole gradient of those slices, and the next push
    sends it there; the other shard's residual is committed. Every shard holds the same versions of the same pushes,
    and the push's batches are done."""
    for stale in (1, 0):
        run = AsyncRun(_config(tmp_path / f"hard{stale}", policy="hard", max_staleness=8), _model(), 2)
        control = run.core.control  # the bound as the adaptive controller moves it: on shard 0 only
        control.staleness_policy = control.staleness_policy.with_max_staleness(0)
        _stale_on(run, stale)
        fresh = 1 - stale
        batches = [b.batch_id for b in run.work[0]]
        before = [run.slices(k) for k in range(2)]
        verdict = run.commit(0)
        run.pull(0)
        assert verdict.accepted and list(verdict.rolled_back) == [stale], verdict
        assert verdict.reason == f"rolled back by the staleness policy on shard {stale}: staleness 1 > max_staleness 0"
        assert run.core.version == run.followers[0].version == 2
        assert all(torch.equal(a, b) for a, b in zip(run.slices(stale), before[stale])), "the version passes there"
        assert not all(torch.equal(a, b) for a, b in zip(run.slices(fresh), before[fresh])), "applied here"
        gradients, _ = run.pending[0]
        rolled = dict(gradients)  # worker 0's gradient of the push, whole tensors
        expected = [rolled[p.name].reshape(-1)[p.start : p.stop] for p in run.placement.on_shard(stale)]
        for residual, gradient in zip(run.residuals(0, stale), expected):
            torch.testing.assert_close(residual, gradient, rtol=0, atol=0)  # identity: all of it, back
        assert all(not r.any() for r in run.residuals(0, fresh)), "sent and applied: nothing kept"
        assert not set(batches) & {b.batch_id for b in run.work[0]}, "applied: its batches are done"
        push = next(e for e in run.events(0) if e["kind"] == "push" and e["worker"] == 0)
        assert push["accepted"] and push["rolled_back"] == [stale]
        assert push["shard_staleness"] == [int(stale == 0), int(stale == 1)]
        chain = decode_chain(verdict.certificate)  # the followers learn it from shard 0's signed word
        assert [(c.version, c.rolled_back) for c in chain] == [(1, ()), (2, (stale,))]
        update = [e for e in run.events(stale) if e["kind"] == "update"][-1]
        assert update["version"] == 2 and update.get("rolled_back") is True
        audit = check_shards(run.events(0), {1: run.events(1)})
        assert audit["ok"] and audit["versions"] == 2, audit
        assert run.core.totals.counters[ROLLED_BACK_HERE] == (stale == 0)  # shard 0's own; a follower counts its
        run.compute(0)
        assert run.step(0).accepted and run.core.version == run.followers[0].version == 3
        assert all(not r.any() for k in range(2) for r in run.residuals(0, k)), "the rolled-back gradient went out"
        run.close()


def test_a_push_every_shard_finds_too_stale_is_applied_on_none_and_its_batches_stay(tmp_path):
    """Stale on both shards: no shard applies it, the worker rolls back every residual and carries its batches."""
    run = AsyncRun(_config(tmp_path / "hard", policy="hard", max_staleness=0), _model(), 2)
    run.compute(0)
    run.step(1)  # worker 0 computed on version 0 of both shards, which are now at 1
    run.hold(0)
    batches = [b.batch_id for b in run.work[0]]
    verdict = run.commit(0)
    assert not verdict.accepted and not verdict.rolled_back and verdict.staleness == 1
    assert verdict.reason == "rejected by the staleness policy: staleness 1 > max_staleness 0"
    assert run.core.version == run.followers[0].version == 1, "applied on no shard"
    assert [b.batch_id for b in run.work[0]][: len(batches)] == batches, "its batches stay with it"
    assert all(r.any() for k in range(2) for r in run.residuals(0, k)), "every residual rolled back"
    run.pull(0)
    run.compute(0)
    assert run.step(0).accepted and run.core.version == run.followers[0].version == 2
    run.close()


def test_each_shard_weighs_a_push_by_its_own_staleness(tmp_path):
    """With the soft policy each shard weighs a push by the staleness it counted."""
    run = AsyncRun(_config(tmp_path / "soft", policy="soft", beta=0.5), _model(), 2)
    run.step(0)
    run.compute(0)
    run.step(1)  # worker 1 computed on version 0, worker 0 on version 1: each push one version stale
    run.hold(0)
    run.commit(0)
    run.pull(0)
    holds = [e for e in run.events(1) if e["kind"] == "hold"]
    assert [e["staleness"] for e in holds] == [0, 1, 1]
    updates = [e for e in run.events(1) if e["kind"] == "update"]
    assert [e["weight"] for e in updates] == [1.0, pytest.approx(1 / 1.5), pytest.approx(1 / 1.5)]
    run.close()


def test_a_push_whose_worker_died_after_its_commit_reaches_the_followers_with_the_next_window(tmp_path):
    """Worker 0 commits and never pulls (it died): shard 0 applied its push; worker 1's next commit reply carries
    it in its window, so the follower applies both, in shard 0's order."""
    run = AsyncRun(_config(tmp_path), _model(), 2)
    run.compute(0)
    run.hold(0)
    run.commit(0)  # version 1 on shard 0 only
    assert run.followers[0].version == 0
    run.step(1)
    assert run.core.version == run.followers[0].version == 2
    history = applied_history(run.events(1))
    assert history == applied_history(run.events(0)) and sorted(history) == [1, 2]
    assert history[1] == [(0, run.request_ids[0])]
    run.close()


def test_what_a_sharded_async_server_refuses(tmp_path):
    """A commit without every follower's staleness; a forged window; a hold based on a version the follower has
    not reached (it started again from an older checkpoint)."""
    run = AsyncRun(_config(tmp_path), _model(), 2)
    run.compute(0)
    run.hold(0)
    _, request = run.pending[0]
    bare = _message(commit(request, run.acks[0][:1], 0, "sync"))  # no follower's staleness
    with run.core.lock:
        member = run.core.begin_push(bare.message.caller, bare.message)
        with pytest.raises(PushRefused, match=r"staleness of shards \[\], but an async commit carries every"):
            run.core.apply_push(member, bare.message, run.core.decode(0, bare))
        run.core.abandon(0, request.request_id)
    run.commit(0)
    forged = bytearray(run.chains[0])
    forged[-1] ^= 1
    with pytest.raises(Refused, match="not shard 0's"):
        run._pull_follower(0, 1, bytes(forged))
    run.compute(0)
    run.versions[0][1] = 5
    with pytest.raises(Refused, match="a push on version 5, but this shard holds version 0"):
        run.hold(0)
    run.close()
