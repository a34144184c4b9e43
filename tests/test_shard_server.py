"""A sharded server over real connections: shard 0 (the parameter server with its part) and a follower shard
(src/ps/shards/follower_server.py), each serving on loopback over each transport, driven by hand through raw clients.

A session shard 0 issued works on the follower with no call between the shards; a forged one and a stale one
are refused there; calls that are shard 0's are refused by the follower with a line that says so; random and
mutated holds are refused cleanly (the fuzzing of tests/test_ps_fuzz.py, against a follower), and the follower
keeps serving at its version."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY
from src.ps.shards.follower_server import FollowerServer
from src.transport.clients import TRANSPORTS, make_client
from src.transport.errors import CallError
from src.transport.wire import Outgoing, serialize
from tests.ps_fixtures import TOKEN, ServedServer, ps_config
from tests.test_ps_fuzz import REFUSALS, mutate

pytestmark = pytest.mark.timeout(300)


class Shards:
    """Shard 0 and follower shard 1 of one run (one worker), on free loopback ports."""

    def __init__(self, tmp_path, transport: str):
        config = ps_config(
            tmp_path,
            system__num_servers=2,
            system__shard_slice_bytes=16 << 10,  # simple_cnn's larger layers cut across both shards
            system__aggregation_mode="sync",
            system__transport=transport,
            training__num_epochs=1000,
            training__max_train_samples=32,
        )
        self.transport = transport
        self.follower = FollowerServer(config, shard=1, address="127.0.0.1:0", token=TOKEN)
        self.follower_address = f"127.0.0.1:{self.follower.start()}"
        self.zero = ServedServer(config, evaluate=False)
        self.placement = self.zero.server.core.sharding.placement

    def client(self, shard: int, token: str = TOKEN):
        address = self.zero.address if shard == 0 else self.follower_address
        return make_client(address, transport=self.transport, token=token, retries=0, connect_timeout_s=10)

    def close(self) -> None:
        self.zero.close()
        self.follower.stop(grace=0)


class ShardWorker:
    """Worker 0 by hand: registered with shard 0, holding its first work and a connection to each shard."""

    def __init__(self, shards: Shards):
        self.shards = shards
        self.clients = [shards.client(0), shards.client(1)]
        self.register()
        self.reply = self.clients[0].pull(self.caller)
        self.version = self.reply.message.version
        self.request_id = 0

    def register(self) -> None:
        self.registration = self.clients[0].register(0)
        self.caller = pb.Caller(worker_id=0, session=self.registration.session)

    def hold(self, shard: int, caller: pb.Caller | None = None) -> pb.PushRequest:
        """Hold a zero gradient of the held work on ``shard``; the request (to commit)."""
        batches = list(self.reply.message.work.batches)
        request = pb.PushRequest(
            caller=caller or self.caller,
            base_version=self.version,
            request_id=self.request_id,
            num_samples=sum(len(b.indices) for b in batches),
            batch_ids=[b.batch_id for b in batches],
            hold=True,
        )
        self.clients[shard].push(request, zero_slices(self.shards.placement, shard))
        return request

    def step(self) -> None:
        """One version: hold on both shards, commit to shard 0, pull the follower with the certificate."""
        self.request_id += 1
        request = self.hold(0)
        self.hold(1)
        commit = pb.PushRequest()
        commit.CopyFrom(request)
        commit.hold, commit.commit = False, True
        self.reply = self.clients[0].push(commit)
        assert self.reply.message.accepted and self.reply.message.certificate
        pulled = self.clients[1].pull(self.caller, certificate=self.reply.message.certificate, parameters_only=True)
        assert pulled.message.version == self.reply.message.version
        self.version = self.reply.message.version

    def close(self) -> None:
        for client in self.clients:
            client.close()


def zero_slices(placement, shard: int) -> list[bytes]:
    return [IDENTITY.compress(torch.zeros(piece.numel)) for piece in placement.on_shard(shard)]


@pytest.fixture(scope="module", params=TRANSPORTS)
def shards(tmp_path_factory, request):
    served = Shards(tmp_path_factory.mktemp(f"shards-{request.param}"), request.param)
    worker = ShardWorker(served)
    yield served, worker
    worker.close()
    served.close()


def test_a_session_of_shard_0_works_on_the_follower_and_versions_go_together(shards):
    served, worker = shards
    assert len(served.placement.on_shard(1)) > 0 and any("#" in s.key for s in served.placement.slices)
    before = worker.version
    worker.step()
    worker.step()
    assert worker.version == before + 2
    assert served.follower.core.version == served.zero.server.version == worker.version


def test_forged_and_stale_sessions_are_refused_on_the_follower(shards):
    served, worker = shards
    follower = worker.clients[1]
    forged = pb.Caller(worker_id=0, session=bytes(32))
    with pytest.raises(CallError) as refused:
        follower.pull(forged, parameters_only=True)
    assert refused.value.code == "NOT_FOUND" and "signature" in refused.value.message
    old = worker.caller
    worker.register()  # a new incarnation: shard 0 issues a new session; the follower learns it from its use
    worker.reply = worker.clients[0].pull(worker.caller)
    worker.version = worker.reply.message.version
    follower.pull(worker.caller, parameters_only=True)
    with pytest.raises(CallError) as refused:
        follower.pull(old, parameters_only=True)
    assert refused.value.code == "ABORTED" and "stale" in refused.value.message
    worker.step()  # the new session goes on working on both shards
    assert served.follower.core.version == served.zero.server.version


def test_calls_of_shard_0_are_refused_by_the_follower(shards):
    served, worker = shards
    with pytest.raises(CallError) as refused:
        worker.clients[1].register(0)
    assert refused.value.code == "UNIMPLEMENTED" and "shard 0" in refused.value.message
    plain = pb.PushRequest(caller=worker.caller, base_version=worker.version, request_id=99)
    with pytest.raises(CallError) as refused:
        worker.clients[1].push(plain)
    assert refused.value.code == "INVALID_ARGUMENT" and "hold" in refused.value.message


def valid_hold(worker: ShardWorker) -> bytes:
    batches = list(worker.reply.message.work.batches)
    request = pb.PushRequest(
        caller=worker.caller,
        base_version=worker.version,
        request_id=worker.request_id + 1,
        num_samples=sum(len(b.indices) for b in batches),
        batch_ids=[b.batch_id for b in batches],
        hold=True,
    )
    return serialize(Outgoing(request, {"gradients": zero_slices(worker.shards.placement, 1)}))


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_and_mutated_holds_are_refused_cleanly_by_a_follower(shards, data):
    served, worker = shards
    if data.draw(st.booleans(), label="random"):
        body = data.draw(st.binary(max_size=512), label="body")
    else:
        body = bytearray(valid_hold(worker))
        for _ in range(data.draw(st.integers(1, 4), label="mutations")):
            mutate(data, body, ["flip", "truncate", "insert", "delete", "overwrite"])
    core = served.follower.core
    before_version = core.version
    before = [p.detach().clone() for p in core.state.params]
    try:
        worker.clients[1].push_bytes(bytes(body), timeout=30)
    except CallError as refused:
        assert refused.code in REFUSALS | {"PERMISSION_DENIED"}, (refused.code, refused.message)
        details = refused.message or ""
        assert details and "\n" not in details and "Traceback" not in details, details
    assert core.version == before_version  # a hold changes nothing until a certificate names it
    assert all(torch.equal(a, b) for a, b in zip(before, core.state.params))
    assert worker.clients[1].status(timeout=10).version == core.version  # still serving
