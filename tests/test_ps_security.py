"""Parameter-server security and bad input: auth token, loopback by default, TLS, refused pushes, idempotent retries.

Every test holds on both transports (``system.transport`` grpc and tcp): the refusals carry the same
status codes and name the same problems.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY, build_compressor
from src.config import validate_config
from src.metrics import read_events
from src.ps.server.members import SENT_WHEN_ON, SERVER_ONLY, SERVER_PATHS, config_for_workers
from src.transport.clients import TRANSPORTS, make_client
from src.transport.errors import CallError
from src.worker import Worker
from tests.ps_fixtures import TOKEN, ServedServer, identity_gradients, make_self_signed_cert, ps_config, transport  # noqa: F401

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=TRANSPORTS)
def served(tmp_path_factory, request):
    """One async single-worker server per transport, shared by the tests that only poke at it with a raw client."""
    server = ServedServer(ps_config(tmp_path_factory.mktemp("served"), system__transport=request.param), evaluate=False)
    yield server
    server.close()


def listening_addresses(port: int) -> list[str]:
    """Local addresses with a listening TCP socket on ``port``, from /proc/net/tcp{,6}."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            next(handle)
            for line in handle:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if int(hex_port, 16) == port and state == "0A":  # 0A = LISTEN
                    found.append(address)
    return found


def test_binds_loopback_only_by_default(served):
    assert served.server.config.system.server_address == "127.0.0.1:0"
    # 127.0.0.1 as /proc shows it: IPv4 socket, or gRPC's IPv4-mapped IPv6 socket (::ffff:127.0.0.1).
    assert listening_addresses(served.port) in (["0100007F"], ["0000000000000000FFFF00000100007F"])


@pytest.mark.parametrize("token", [None, "wrong-token"])
@pytest.mark.parametrize("call", ["status", "register", "pull", "push", "heartbeat", "finish"])
def test_calls_without_the_token_are_refused(served, token, call):
    caller = pb.Caller(worker_id=0, session=b"x" * 16)
    with served.client(token=token) as client:
        invoke = {
            "status": lambda: client.status(),
            "register": lambda: client.register(0, timeout=5),
            "pull": lambda: client.pull(caller),
            "push": lambda: client.push(pb.PushRequest(caller=caller, request_id=1)),
            "heartbeat": lambda: client.heartbeat(caller, pb.WorkerStats(), timeout=5),
            "finish": lambda: client.finish(caller, pb.WorkerStats()),
        }[call]
        with pytest.raises(CallError) as refused:
            invoke()
    assert refused.value.code == "UNAUTHENTICATED"
    assert "auth token" in refused.value.message


def test_the_right_token_is_accepted(served):
    with served.client() as client:
        status = client.status()
    assert status.num_workers == 1 and status.aggregation_mode == "async"


def corrupt(payload: bytes, value: float) -> bytes:
    """An identity payload with its first entry overwritten (the checksum covers only the header)."""
    from src.compression import HEADER_SIZE

    return payload[:HEADER_SIZE] + torch.tensor([value]).numpy().tobytes() + payload[HEADER_SIZE + 4 :]


def bad_pushes(worker):
    """(description, request, expected status, words the refusal must contain) for a registered worker holding work."""
    server = worker.served.server
    good = identity_gradients(server)
    shapes = [tuple(spec.shape) for spec in server.param_specs]
    wrong_shape = list(good)
    wrong_shape[0] = IDENTITY.compress(torch.zeros(shapes[0][0] + 1, *shapes[0][1:]))
    truncated = list(good)
    truncated[1] = good[1][:-4]
    nan = list(good)
    nan[0] = corrupt(good[0], float("nan"))
    inf = list(good)
    inf[2] = corrupt(good[2], float("inf"))
    garbage = list(good)
    garbage[0] = b"\x00" * 64
    topk_nan = list(good)
    topk_payload = bytearray(build_compressor("topk", ratio=0.5).compress(torch.ones(shapes[0])))
    from src.compression import HEADER_SIZE

    topk_payload[HEADER_SIZE : HEADER_SIZE + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    topk_nan[0] = bytes(topk_payload)
    held = list(worker.request().batch_ids)
    other = 1 - worker.caller.worker_id
    samples = worker.request().num_samples
    invalid = "INVALID_ARGUMENT"
    not_found = "NOT_FOUND"
    return [
        (
            "unknown worker",
            worker.request(caller=pb.Caller(worker_id=7, session=worker.caller.session)),
            not_found,
            ["worker 7", "not registered"],
        ),
        (
            "another worker's id with this session",
            worker.request(caller=pb.Caller(worker_id=other, session=worker.caller.session)),
            not_found,
            [f"worker {other}"],
        ),
        ("no session", worker.request(caller=pb.Caller(worker_id=0)), not_found, ["worker 0", "unknown session"]),
        ("request id 0", worker.request(request_id=0), invalid, ["request_id must be non-zero"]),
        (
            "an empty push (proto3 defaults)",
            pb.PushRequest(caller=worker.caller, request_id=99),
            invalid,
            ["covers batches []", f"it holds {held}"],
        ),
        (
            "batches it does not hold",
            worker.request(batch_ids=[b + 1000 for b in held]),
            invalid,
            ["covers batches", "it holds"],
        ),
        ("wrong sample count", worker.request(num_samples=samples + 1), invalid, [f"num_samples {samples + 1}"]),
        (
            "too few tensors",
            worker.request(gradients=good[:-1]),
            invalid,
            [f"{len(good) - 1} gradients", f"{len(good)} parameters"],
        ),
        ("wrong shape", worker.request(gradients=wrong_shape), invalid, ["gradient 0", "shape", "expected"]),
        ("truncated payload", worker.request(gradients=truncated), invalid, ["gradient 1", "truncated"]),
        ("NaN", worker.request(gradients=nan), invalid, ["gradient 0", "NaN"]),
        ("Inf", worker.request(gradients=inf), invalid, ["gradient 2", "NaN/Inf"]),
        ("NaN in a top-k payload", worker.request(gradients=topk_nan), invalid, ["gradient 0"]),
        ("garbage payload", worker.request(gradients=garbage), invalid, ["gradient 0", "magic"]),
        ("base version from the future", worker.request(base_version=99), invalid, ["ahead"]),
    ]


def test_bad_pushes_are_refused_and_the_server_keeps_serving(tmp_path, transport):
    served = ServedServer(ps_config(tmp_path, system__transport=transport), evaluate=False)
    worker = served.worker(0)
    try:
        before = [p.detach().clone() for p in served.server.state.params]
        cases = bad_pushes(worker)
        for description, request, code, words in cases:
            with pytest.raises(CallError) as refused:
                worker.client.push(request)
            assert refused.value.code == code, description
            for word in words:
                assert word in refused.value.message, (description, refused.value.message)
        status = worker.client.status()
        assert (
            status.version == 0 and status.pushes_refused == len(cases) - 3
        )  # 3 refused as callers, before any push logic
        for old, new in zip(before, served.server.state.params):
            assert torch.equal(old, new)
        reply = worker.push()  # a good push still goes through
        assert reply.message.accepted and reply.message.version == 1
    finally:
        worker.close()
        served.close()


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\x08", "truncated or overlong varint"),
        (b"\x2a\x80\x01abc", "runs past the end"),
        (b"\x0f\x00", "unsupported wire type 7"),
    ],
)
def test_malformed_push_bytes_are_refused(served, data, words):
    with served.client() as client:
        with pytest.raises(CallError) as refused:
            client.push_bytes(data, timeout=10)  # bytes in as they are
        assert client.status().version == 0  # still serving
    assert refused.value.code == "INVALID_ARGUMENT"
    assert words in refused.value.message


def test_retried_push_is_applied_once(tmp_path, transport):
    served = ServedServer(ps_config(tmp_path, system__transport=transport), evaluate=False)
    worker = served.worker(0)
    try:
        request = worker.request(request_id=5, gradients=identity_gradients(served.server, value=1.0))
        first = worker.push(request)
        after_first = [p.detach().clone() for p in served.server.state.params]
        retry = worker.client.push(request)
        assert retry.message == first.message and first.message.version == 1
        assert worker.client.status().pushes_applied == 1
        for old, new in zip(after_first, served.server.state.params):
            assert torch.equal(old, new)
        other = worker.push(worker.request(request_id=6))
        assert other.message.version == 2  # a new request id is a new push
    finally:
        worker.close()
        served.close()


def test_a_replaced_incarnation_is_refused(tmp_path, transport):
    """Registering worker 0 again makes a new incarnation; the old session can push, pull or beat no more."""
    served = ServedServer(ps_config(tmp_path, system__transport=transport), evaluate=False)
    old = served.worker(0)
    try:
        stale = old.request()
        new = served.worker(0)
        assert new.registration.incarnation == old.registration.incarnation + 1
        for call in (
            lambda: old.client.push(stale),
            lambda: old.client.pull(old.caller),
            lambda: old.client.heartbeat(old.caller, pb.WorkerStats(), timeout=5),
        ):
            with pytest.raises(CallError) as refused:
                call()
            assert refused.value.code == "ABORTED"
            assert f"incarnation {old.registration.incarnation} was replaced" in refused.value.message
        assert new.push().message.accepted  # the new incarnation holds the work and trains
        events = [e["kind"] for e in read_events(served.server.log.events.path)]
        assert "worker_failed" in events and "worker_rejoined" in events
        new.close()
    finally:
        old.close()
        served.close()


@pytest.mark.slow
def test_run_finishes_despite_a_misbehaving_worker(tmp_path, transport):
    """Worker 1 sends only bad pushes, then stops; worker 0 trains, worker 1's work moves to it, the run completes."""
    config = ps_config(
        tmp_path,
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__max_train_samples=96,
        system__transport=transport,
        system__heartbeat_interval=0.2,
        system__heartbeat_timeout=1.0,
    )
    served = ServedServer(config)
    try:
        worker_config = config.model_copy(
            update={"system": config.system.model_copy(update={"server_address": served.address})}
        )
        outcome = {}
        thread = threading.Thread(
            target=lambda: outcome.update(Worker(worker_config, 0, token=TOKEN, tensorboard=False).run())
        )
        thread.start()
        rogue = served.worker(1)  # both ready: the first round starts
        refused = 0
        for _, request, _, _ in bad_pushes(rogue):
            with pytest.raises(CallError):
                rogue.client.push(request)
            refused += 1
        rogue.close()  # silent from now on: failed after the heartbeat timeout
        thread.join(90)
        assert not thread.is_alive() and outcome["samples"] == 96
        assert served.server.wait_until_done(30)
        summary = served.server.finalize()
        assert summary["pushes_refused"] == refused - 3 and summary["faults"]["worker_failures"] == 1
        assert summary["samples_processed"] == 96  # every sample once, worker 1's shard included
    finally:
        served.close()


def test_register_refuses_an_out_of_range_worker_id(served):
    with served.client() as client:
        with pytest.raises(CallError) as refused:
            client.register(3)
    assert refused.value.code == "INVALID_ARGUMENT"
    assert "worker_id 3 is out of range 0..0" in refused.value.message


def test_the_registration_reply_carries_the_run_without_the_servers_paths(tmp_path):
    """Every field but the server's own paths, which go at their defaults: a message's size does not depend on
    where the server's folders are (the findings' records are reproduced byte for byte from another folder)."""
    near = ps_config(tmp_path / "a", system__tls_ca_file="ca.pem")
    far = ps_config(tmp_path / "a" / "much" / "deeper" / "folder", system__tls_ca_file="/etc/somewhere/else/ca.pem")
    sent = json.loads(config_for_workers(far))
    assert config_for_workers(near) == config_for_workers(far) and str(tmp_path) not in json.dumps(sent)
    expected = far.to_dict()
    for section, field in (dotted.split(".") for dotted in SERVER_PATHS):
        assert sent[section].pop(field) == type(getattr(far, section)).model_fields[field].default
        expected[section].pop(field)
    for section, field in (dotted.split(".") for dotted in SERVER_ONLY):  # the server's alone
        assert field not in sent[section]
        expected[section].pop(field)
    for section, field in (dotted.split(".") for dotted in SENT_WHEN_ON):  # off: left out, as before they existed
        assert field not in sent[section]
        expected[section].pop(field)
    assert sent == expected
    # a worker's config from the reply: the server's settings left out read as their defaults
    assert validate_config(sent).system.controller_policy == "link"
    assert not validate_config(sent).system.pipelined_replies
    # on, a switch of SENT_WHEN_ON is sent (a gRPC worker then sends its large parts in pieces), and nothing else moves
    pipelined = ps_config(
        tmp_path / "p", system__streaming=True, system__aggregation_mode="sync", system__pipelined_replies=True
    )
    sent_on = json.loads(config_for_workers(pipelined))
    assert sent_on["system"].pop("pipelined_replies") is True and "pipeline_slice_bytes" not in sent_on["system"]
    assert validate_config(json.loads(config_for_workers(pipelined))).system.pipelined_replies


def test_tls(tmp_path, transport):
    cert, key = make_self_signed_cert(tmp_path)
    config = ps_config(
        tmp_path, system__tls_cert_file=str(cert), system__tls_key_file=str(key), system__transport=transport
    )
    served = ServedServer(config, evaluate=False)
    try:
        with served.client(system=config.system) as client:  # trusts the self-signed cert
            assert client.status().num_workers == 1
            registration = client.register(0, timeout=5)
        # the run, not the server's files: its key, certificate and folders (all under tmp_path) stay its own
        assert registration.worker_id == 0 and str(tmp_path) not in registration.run_config_json
        with make_client(served.address, transport=transport, token=TOKEN, retries=0) as plaintext:
            with pytest.raises(CallError) as refused:
                plaintext.status(timeout=5)
        assert refused.value.code == "UNAVAILABLE"
        (tmp_path / "other").mkdir()
        other_cert, _ = make_self_signed_cert(tmp_path / "other")
        untrusting = config.system.model_copy(update={"tls_ca_file": str(other_cert)})
        with make_client(served.address, transport=transport, token=TOKEN, retries=0, system=untrusting) as client:
            with pytest.raises(CallError) as refused:
                client.status(timeout=5)
        assert refused.value.code == "UNAVAILABLE"  # handshake fails: unknown issuer
    finally:
        served.close()
