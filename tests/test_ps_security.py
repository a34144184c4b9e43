"""Parameter-server security and bad input: auth token, loopback by default, TLS, refused pushes, idempotent retries."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY, build_compressor
from src.ps_transport import ParameterServerClient
from src.worker import Worker
from tests.ps_fixtures import TOKEN, ServedServer, identity_gradients, make_self_signed_cert, ps_config, push_request

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One async single-worker server shared by the tests that only poke at it with a raw client."""
    server = ServedServer(ps_config(tmp_path_factory.mktemp("served")), evaluate=False)
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
@pytest.mark.parametrize("call", ["status", "register", "pull", "push"])
def test_calls_without_the_token_are_refused(served, token, call):
    with served.client(token=token) as client:
        invoke = {
            "status": lambda: client.status(),
            "register": lambda: client.register(0),
            "pull": lambda: client.pull(0, 0),
            "push": lambda: client.push(push_request(served.server)),
        }[call]
        with pytest.raises(grpc.RpcError) as refused:
            invoke()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "auth token" in refused.value.details()


def test_the_right_token_is_accepted(served):
    with served.client() as client:
        status = client.status()
    assert status.num_workers == 1 and status.aggregation_mode == "async"


def corrupt(payload: bytes, value: float) -> bytes:
    """An identity payload with its first entry overwritten (the checksum covers only the header)."""
    from src.compression import HEADER_SIZE

    return payload[:HEADER_SIZE] + torch.tensor([value]).numpy().tobytes() + payload[HEADER_SIZE + 4:]


def bad_pushes(server):
    """(description, request, expected status, words the refusal must contain)."""
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

    topk_payload[HEADER_SIZE:HEADER_SIZE + 4] = torch.tensor([float("nan")]).numpy().tobytes()
    topk_nan[0] = bytes(topk_payload)
    invalid, precondition = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
    return [
        ("unknown worker", push_request(server, worker_id=7), precondition, ["worker 7", "not registered"]),
        ("too few tensors", push_request(server, gradients=good[:-1]), invalid, [f"{len(good) - 1} gradients", f"{len(good)} parameters"]),
        ("wrong shape", push_request(server, gradients=wrong_shape), invalid, ["gradient 0", "shape", "expected"]),
        ("truncated payload", push_request(server, gradients=truncated), invalid, ["gradient 1", "truncated"]),
        ("NaN", push_request(server, gradients=nan), invalid, ["gradient 0", "NaN"]),
        ("Inf", push_request(server, gradients=inf), invalid, ["gradient 2", "NaN/Inf"]),
        ("NaN in a top-k payload", push_request(server, gradients=topk_nan), invalid, ["gradient 0"]),
        ("garbage payload", push_request(server, gradients=garbage), invalid, ["gradient 0", "magic"]),
        ("tensors in an empty step", push_request(server, num_samples=0), invalid, ["empty step"]),
        ("base version from the future", push_request(server, base_version=99), invalid, ["ahead"]),
    ]


def test_bad_pushes_are_refused_and_the_server_keeps_serving(tmp_path):
    served = ServedServer(ps_config(tmp_path), evaluate=False)
    try:
        with served.client() as client:
            client.register(0)
            before = [p.detach().clone() for p in served.server.params]
            cases = bad_pushes(served.server)
            for description, request, code, words in cases:
                with pytest.raises(grpc.RpcError) as refused:
                    client.push(request)
                assert refused.value.code() == code, description
                for word in words:
                    assert word in refused.value.details(), (description, refused.value.details())
            status = client.status()
            assert status.version == 0 and status.pushes_refused == len(cases)
            for old, new in zip(before, served.server.params):
                assert torch.equal(old, new)
            reply = client.push(push_request(served.server, request_id=42))  # a good push still goes through
            assert reply.accepted and reply.version == 1
    finally:
        served.close()


@pytest.mark.parametrize("data, words", [
    (b"\x08", "truncated or overlong varint"),
    (b"\x2a\x80\x01abc", "runs past the end"),
    (b"\x0f\x00", "unsupported wire type 7"),
])
def test_malformed_push_bytes_are_refused(served, data, words):
    with served.client() as client:
        raw_push = client.channel.unary_unary("/dts.ps.ParameterServer/Push")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as refused:
            raw_push(data, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        assert client.status().version == 0  # still serving
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.value.details()


def test_retried_push_is_applied_once(tmp_path):
    served = ServedServer(ps_config(tmp_path), evaluate=False)
    try:
        with served.client() as client:
            client.register(0)
            gradients = identity_gradients(served.server, value=1.0)
            first = client.push(push_request(served.server, request_id=5, gradients=gradients))
            after_first = [p.detach().clone() for p in served.server.params]
            retry = client.push(push_request(served.server, request_id=5, gradients=gradients))
            assert retry == first and first.version == 1
            assert client.status().pushes_applied == 1
            for old, new in zip(after_first, served.server.params):
                assert torch.equal(old, new)
            other = client.push(push_request(served.server, request_id=6, base_version=1, gradients=gradients))
            assert other.version == 2  # a new request id is a new push
    finally:
        served.close()


def test_run_finishes_despite_a_misbehaving_worker(tmp_path):
    """Worker 1 sends only bad pushes and leaves; worker 0 trains to the end and the run completes."""
    config = ps_config(tmp_path, system__num_workers=2, system__aggregation_mode="sync", training__max_train_samples=96)
    served = ServedServer(config)
    try:
        with served.client() as rogue:
            rogue.register(1)
            refused = 0
            for _, request, _, _ in bad_pushes(served.server):
                request.worker_id = 1 if request.worker_id == 0 else request.worker_id
                with pytest.raises(grpc.RpcError):
                    rogue.push(request)
                refused += 1
            rogue.finish(1, pb.WorkerStats())
        worker_config = config.model_copy(update={"system": config.system.model_copy(update={"server_address": served.address})})
        outcome = {}
        thread = threading.Thread(target=lambda: outcome.update(Worker(worker_config, 0, token=TOKEN, tensorboard=False).run()))
        thread.start()
        thread.join(90)
        assert not thread.is_alive() and outcome["steps"] == 3
        assert served.server.wait_until_done(30)
        summary = served.server.finalize()
        assert summary["pushes_refused"] == refused and summary["versions"] == 3
        assert summary["samples_processed"] == 48  # worker 0's shard: half of 96
    finally:
        served.close()


def test_register_refuses_an_out_of_range_worker_id(served):
    with served.client() as client:
        with pytest.raises(grpc.RpcError) as refused:
            client.register(3)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "worker_id 3 is out of range 0..0" in refused.value.details()


def test_tls(tmp_path):
    cert, key = make_self_signed_cert(tmp_path)
    config = ps_config(tmp_path, system__tls_cert_file=str(cert), system__tls_key_file=str(key))
    served = ServedServer(config, evaluate=False)
    try:
        with served.client(system=config.system) as client:  # trusts the self-signed cert
            assert client.status().num_workers == 1
        with ParameterServerClient(served.address, token=TOKEN, retries=0) as plaintext:
            with pytest.raises(grpc.RpcError) as refused:
                plaintext.status(timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        (tmp_path / "other").mkdir()
        other_cert, _ = make_self_signed_cert(tmp_path / "other")
        untrusting = config.system.model_copy(update={"tls_ca_file": str(other_cert)})
        with ParameterServerClient(served.address, token=TOKEN, retries=0, system=untrusting) as client:
            with pytest.raises(grpc.RpcError) as refused:
                client.status(timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # handshake fails: unknown issuer
    finally:
        served.close()
