"""The sharded server's sync protocol between the real cores (src/ps/shards/rounds.py), in one process: hold on every
shard, commit to shard 0, pull every shard with its certificate. Two shards train as one server does, and both as
large-batch SGD does; what a shard must refuse, it refuses.

The messages are the protocol's own bytes (serialized and split as a transport does); the cores are the ones the
shard processes will run. What this does not show is the processes and their transports (not built yet)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.common.sessions import SessionSigner, session_key
from src.config import config_from_data
from src.parameter_server import planned_work
from src.ps.server.core import ServerCore
from src.ps.shards.follower import FollowerCore
from src.ps.shards.parts import model_placement
from src.ps.shards.rounds import RoundCertificate
from src.ps.shards.shard_zero import Sharding
from src.ps.worker.codec import PushCodec
from src.ps.worker.loading import load_reply, load_shard_reply, served_tensors
from src.transport.errors import PushRefused, Refused
from src.transport.wire import Outgoing, serialize, split

KEY = session_key(b"the run's token")
SAMPLES, FEATURES, CLASSES = 96, 12, 5
RTOL, ATOL = 1e-5, 1e-6
"""Sharded against unsharded against one large-batch SGD: float32 rounding of a few steps (the sum of the workers'
gradients is taken in another order than one backward pass over their union)."""


def _data():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, torch.randint(0, CLASSES, (SAMPLES,), generator=generator)


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(FEATURES, 48), nn.ReLU(), nn.Linear(48, CLASSES))


def _config(tmp_path, optimizer: str = "sgd", workers: int = 3):
    return config_from_data(
        {
            "training": {
                "batch_size": 8,
                "num_epochs": 1,
                "learning_rate": 0.1,
                "optimizer": optimizer,
                "checkpoint_interval": 1000,
                "lr_schedule": {"kind": "step", "step_size": 2, "gamma": 0.5},
            },
            "system": {
                "num_workers": workers,
                "aggregation_mode": "sync",
                "heartbeat_timeout": 600,
                "log_dir": str(tmp_path / "logs"),
                "checkpoint_dir": str(tmp_path / "checkpoints"),
            },
        }
    )


def _message(request, gradients=(), buffers=()) -> object:
    """A push as a transport hands it to a server: serialized, then split."""
    data = serialize(Outgoing(request, {"gradients": list(gradients), "buffers": list(buffers)}))
    return split(data, pb.PushRequest, ("gradients", "buffers"))


def _reply(data: bytes, message_type):
    return split(data, message_type, ("parameters", "buffers"))


class Shards:
    """A run of ``shards`` server cores (shard 0 and its followers, or one unsharded server) and ``workers`` workers,
    each a replica of the model that computes its batches' gradient and pushes it as the protocol says."""

    def __init__(self, config, model: nn.Module, shards: int, slice_bytes: int = 1024):
        self.config, self.shards = config, shards
        work = planned_work(config, SAMPLES)
        if shards > 1:
            self.placement = model_placement(model, shards, slice_bytes)
            sharding = Sharding(self.placement, KEY)
            self.core = ServerCore(config, work=work, model=copy.deepcopy(model), tensorboard=False, sharding=sharding)
            self.followers = [
                FollowerCore(config, model=model, placement=self.placement, shard=k, key=KEY) for k in range(1, shards)
            ]
        else:
            self.core = ServerCore(config, work=work, model=copy.deepcopy(model), tensorboard=False)
            self.followers = []
        self.workers = range(config.system.num_workers)
        self.replicas = [copy.deepcopy(model) for _ in self.workers]
        names = [n for n, _ in served_tensors(model)[0]]
        placement = self.placement if shards > 1 else None
        self.codecs = [
            PushCodec(config.system, None, error_feedback=False, seed=0, worker_id=w, names=names, placement=placement)
            for w in self.workers
        ]
        self.callers, self.work, self.request_ids = {}, {}, {w: 0 for w in self.workers}
        self.certificates: dict[int, bytes] = {}
        self.x, self.y = _data()
        self.rounds_trained: list[list[tuple[int, list[int]]]] = []

    # ---- the calls, as a driver makes them (lock held where the core's convention asks)

    def start(self) -> None:
        core = self.core
        with core.lock:
            for w in self.workers:
                reply, _ = core.register(pb.RegisterRequest(worker_id=w), f"test:{w}")
                self.callers[w] = pb.Caller(worker_id=w, session=reply.session)
            members = {w: core.begin_pull(self.callers[w]) for w in self.workers}
            for w in self.workers:
                work = core.poll_work(members[w])
                reply = _reply(core.pull_reply(members[w], work), pb.PullReply)
                self._load(w, 0, reply)
                self.work[w] = list(reply.message.work.batches)
        for w in self.workers:
            for k, follower in enumerate(self.followers, start=1):
                self._pull_follower(w, k, follower, b"")

    def _load(self, worker: int, shard: int, reply) -> int:
        params, buffers = served_tensors(self.replicas[worker])
        if self.shards == 1:
            return load_reply([p for _, p in params], [b for _, b in buffers], reply)
        return load_shard_reply(self.placement, shard, dict(params), [b for _, b in buffers], reply)

    def _pull_follower(self, worker: int, shard: int, follower: FollowerCore, certificate: bytes) -> None:
        caller = self.callers[worker]
        follower.member(caller)
        data = follower.pull(worker, pb.PullRequest(caller=caller, certificate=certificate, parameters_only=True))
        self._load(worker, shard, _reply(data, pb.PullReply))

    def gradient(self, worker: int) -> tuple[list[tuple[str, torch.Tensor]], int, list[int]]:
        model = self.replicas[worker]
        model.zero_grad()
        indices = [i for batch in self.work[worker] for i in batch.indices]
        loss = nn.functional.cross_entropy(model(self.x[indices]), self.y[indices])
        loss.backward()
        return [(n, p.grad) for n, p in served_tensors(model)[0]], len(indices), indices

    def request(self, worker: int, num_samples: int, **flags) -> pb.PushRequest:
        return pb.PushRequest(
            caller=self.callers[worker],
            base_version=self.core.version,
            request_id=self.request_ids[worker],
            num_samples=num_samples,
            batch_ids=[b.batch_id for b in self.work[worker]],
            **flags,
        )

    def step(self) -> bool:
        """One sync version: every worker with work pushes; returns False once the run has no work left."""
        pushing = [w for w in self.workers if self.work[w]]
        if not pushing:
            return False
        self.rounds_trained.append([(w, self.gradient(w)[2]) for w in pushing])
        members, verdicts = {}, {}
        for w in pushing:
            gradients, num_samples, _ = self.gradient(w)
            self.request_ids[w] += 1
            if self.shards == 1:
                payloads = self.codecs[w].encode(gradients, 0)[0]
                received = _message(self.request(w, num_samples), payloads)
                with self.core.lock:
                    members[w] = self.core.begin_push(received.message.caller, received.message)
                    verdicts[w] = self.core.apply_push(members[w], received.message, self.core.decode(w, received))
                continue
            per_shard = self.codecs[w].encode(gradients, 0)
            held = self.request(w, num_samples, hold=True)
            for k, follower in enumerate(self.followers, start=1):  # hold on every shard
                received = _message(held, per_shard[k])
                follower.member(held.caller)
                follower.hold(w, held, follower.decode(w, received))
            received = _message(held, per_shard[0])
            with self.core.lock:
                self.core.hold(self.core.member(held.caller), held, self.core.decode(w, received))
            commit = _message(self.request(w, num_samples, commit=True))  # then commit to shard 0
            with self.core.lock:
                members[w] = self.core.begin_push(commit.message.caller, commit.message)
                verdicts[w] = self.core.apply_push(members[w], commit.message, self.core.decode(w, commit))
        with self.core.lock:
            replies = {}
            for w in pushing:
                work = self.core.poll_work(members[w])
                assert work is not None, f"worker {w}: the barrier did not close with every push in"
                replies[w] = self.core.push_reply(members[w], self.request_ids[w], verdicts[w], work)
        for w in pushing:
            reply = _reply(replies[w], pb.PushReply)
            assert reply.message.accepted
            self.work[w] = list(reply.message.work.batches)
            if self.shards == 1:
                self._load(w, 0, reply)
                continue
            assert not reply.large["parameters"], "a commit reply carries the certificate, not the parameters"
            certificate = reply.message.certificate
            assert RoundCertificate.decode(certificate).version == reply.message.version
            self.certificates[w] = certificate
            with self.core.lock:
                self._load(w, 0, _reply(self.core.parameters(members[w]), pb.PullReply))
            for k, follower in enumerate(self.followers, start=1):
                self._pull_follower(w, k, follower, certificate)
        return True

    def whole(self) -> dict[str, torch.Tensor]:
        """The model as the shards hold it together (parameters by name)."""
        if self.shards == 1:
            return {n: p.detach().clone() for n, p in zip(self.core.state.param_names, self.core.state.params)}
        parts = {}
        for k, state in enumerate([self.core.state] + [f.state for f in self.followers]):
            assert state.version == self.core.version, f"shard {k} is at version {state.version}"
            parts.update({n: p.detach().clone() for n, p in zip(state.param_names, state.params)})
        shapes = {n: p.shape for n, p in self.replicas[0].named_parameters()}
        return {n: t.reshape(shapes[n]) for n, t in self.placement.assemble(parts, torch.cat).items()}

    def close(self) -> None:
        self.core.close()
        for follower in self.followers:
            follower.close()


def _train(config, model, shards: int) -> Shards:
    run = Shards(config, model, shards)
    run.start()
    while run.step():
        pass
    run.close()
    return run


def _large_batch_sgd(config, model: nn.Module, rounds) -> dict[str, torch.Tensor]:
    """The reference: one model, one SGD step per version on the mean loss over every worker's batch of it, at the
    schedule's rate (no momentum in the comparison: the config's momentum applies)."""
    model = copy.deepcopy(model)
    t = config.training
    optimizer = torch.optim.SGD(model.parameters(), lr=t.learning_rate, momentum=t.momentum)
    x, y = _data()
    for version, pushes in enumerate(rounds):
        optimizer.param_groups[0]["lr"] = t.learning_rate * 0.5 ** (version // 2)
        optimizer.zero_grad()
        total = sum(len(indices) for _, indices in pushes)
        loss = sum(nn.functional.cross_entropy(model(x[i]), y[i], reduction="sum") for _, i in pushes) / total
        loss.backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_two_and_three_shards_train_as_one_server(tmp_path, optimizer):
    """Every version of an epoch: three workers, the first layer's weight cut across shards (1 kB slices). Each
    shard ends at the last version, and the model they hold together is the unsharded server's, parameter for
    parameter."""
    config, model = _config(tmp_path, optimizer), _model()
    one = _train(config, model, 1)
    for shards in (2, 3):
        sharded = _train(replace_dirs(config, tmp_path / f"s{shards}"), model, shards)
        assert sharded.core.version == one.core.version == 4  # 96 samples, 3 workers of batch 8
        assert len(sharded.placement.of_tensor("0.weight")) > 1, "the test should cut a tensor across shards"
        whole, reference = sharded.whole(), one.whole()
        for name in reference:
            torch.testing.assert_close(whole[name], reference[name], rtol=RTOL, atol=ATOL, msg=name)


def test_sharded_sync_is_large_batch_sgd(tmp_path):
    """Sync with two shards, and with one, equal large-batch SGD with momentum at the schedule's rates."""
    config, model = _config(tmp_path), _model()
    sharded = _train(config, model, 2)
    reference = _large_batch_sgd(config, model, sharded.rounds_trained)
    whole = sharded.whole()
    for name, value in reference.items():
        torch.testing.assert_close(whole[name], value, rtol=RTOL, atol=ATOL, msg=name)


def replace_dirs(config, folder):
    system = config.system.model_copy(update={"log_dir": str(folder / "logs"), "checkpoint_dir": str(folder / "ck")})
    return config.model_copy(update={"system": system})


def test_what_the_shards_refuse(tmp_path):
    """A commit shard 0 does not hold, a plain push to a sharded server, a hold to an unsharded one, a session of
    another run's key, a forged certificate: each is refused with a line that says what was wrong."""
    config, model = _config(tmp_path, workers=2), _model()
    run = Shards(config, model, 2)
    run.start()
    follower, caller = run.followers[0], run.callers[0]
    _, num_samples, _ = run.gradient(0)
    run.request_ids[0] += 1
    commit = _message(run.request(0, num_samples, commit=True))
    with run.core.lock:
        member = run.core.begin_push(caller, commit.message)
        with pytest.raises(PushRefused, match="does not hold"):
            run.core.apply_push(member, commit.message, run.core.decode(0, commit))
        run.core.abandon(0, run.request_ids[0])
    plain = _message(run.request(0, num_samples))
    with pytest.raises(PushRefused, match="two calls"):
        run.core.decode(0, plain)
    forged_session = pb.Caller(worker_id=0, session=SessionSigner(session_key(b"another run")).issue(0, 1))
    with pytest.raises(Refused, match="signature"):
        follower.member(forged_session)
    certificate = RoundCertificate(1, ((0, 1), (1, 1)), 0.1, b"\0" * 16).encode()
    with pytest.raises(Refused, match="not shard 0's"):
        follower.pull(0, pb.PullRequest(caller=caller, certificate=certificate, parameters_only=True))
    with pytest.raises(Refused, match="malformed"):
        follower.pull(0, pb.PullRequest(caller=caller, certificate=b"short", parameters_only=True))
    run.close()
    unsharded = Shards(replace_dirs(config, tmp_path / "one"), model, 1)
    with pytest.raises(PushRefused, match="for a sharded server"):
        unsharded.core.decode(0, _message(pb.PushRequest(request_id=1, hold=True)))
    unsharded.close()


@pytest.mark.parametrize(("code", "kind"), [("INTERNAL", "ends"), ("UNAVAILABLE", "registers again")])
def test_a_run_stopped_from_outside_refuses_waiting_calls_with_its_code(tmp_path, code, kind):
    """Shard 0 stops the run when another shard goes away (src/ps/shards/recovery.py): the shards start again
    together, so a worker's waiting call is refused UNAVAILABLE, as after a server restart (the worker registers
    again); any other stop is INTERNAL (the worker ends with the error)."""
    from src.ps.state.refusals import RunFailed
    from src.ps.worker.membership import failed_call

    run = Shards(replace_dirs(_config(tmp_path, workers=2), tmp_path / code), _model(), 2)
    run.start()
    core = run.core
    with core.lock:
        member = core.begin_pull(run.callers[0])
    core.stop_run(RunFailed("shard 1 has not answered for 3.0 s"), **({"code": code} if code != "INTERNAL" else {}))
    with pytest.raises(Refused, match="the server stopped the run: shard 1 has not answered") as refused:
        with core.lock:
            core.check_waiting(member)
    assert refused.value.code == code
    assert (failed_call(code, refused.value.message, 0, None) == "lost") == (kind == "registers again")
    run.close()


def test_the_pull_that_opens_the_first_round_wakes_the_pulls_waiting_for_it(tmp_path):
    """A sync run's first round opens with the last worker's pull; the workers whose pulls already wait for their work
    are woken then, not when their wait next times out (a transport's call waits in ``lock.wait`` with a timeout
    to notice a cancelled call: a missed wake-up held worker 0 back by most of that timeout)."""
    import threading
    import time

    config = _config(tmp_path, workers=2)
    core = ServerCore(config, work=planned_work(config, SAMPLES), model=_model(), tensorboard=False)
    timeout_s = 20.0
    waited: list[float] = []
    waits = threading.Event()
    with core.lock:
        callers = [
            pb.Caller(worker_id=w, session=core.register(pb.RegisterRequest(worker_id=w), f"test:{w}")[0].session)
            for w in range(2)
        ]
        first = core.begin_pull(callers[0])
        assert core.poll_work(first) is None  # the round waits for worker 1

    def wait_for_work() -> None:
        started = time.monotonic()
        with core.lock:
            while core.poll_work(first) is None:
                waits.set()  # the lock is held until the wait below releases it
                core.lock.wait(timeout_s)
        waited.append(time.monotonic() - started)

    waiting = threading.Thread(target=wait_for_work)
    waiting.start()
    assert waits.wait(timeout_s)
    with core.lock:  # taken once worker 0's pull waits inside lock.wait
        second = core.begin_pull(callers[1])  # opens the round
        assert core.poll_work(second) is not None
    waiting.join(timeout_s + 5)
    core.close()
    assert waited and waited[0] < timeout_s / 2, f"worker 0's pull waited {waited} s for the round worker 1 opened"
