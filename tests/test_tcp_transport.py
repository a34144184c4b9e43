"""The binary TCP transport's own behaviour: frame limits before allocation, exact byte counts, deadlines,
reconnection through a server restart, the health probe, the flag.

What both transports share (auth, sessions, refusals, retries, TLS) is in tests/test_ps_security.py
and tests/test_ps_fuzz.py, parametrized over the transport; sync training over TCP against gRPC and
large-batch SGD in tests/test_ps_equivalence.py.
"""

from __future__ import annotations

import select
import socket
import threading
import time
import tracemalloc

import pytest

from src import parameter_server_pb2 as pb
from src.transport.errors import STATUS_NAMES, CallError
from src.transport.tcp import TCPParameterServerClient
from src.transport.tcp_frames import (
    HEADER_BYTES,
    HELLO_MAX_BYTES,
    Kind,
    Method,
    pack_header,
    parse_header,
    receive_body,
)
from src.transport.wire import serialize
from tests.ps_fixtures import TOKEN, ServedServer, ps_config

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = ServedServer(ps_config(tmp_path_factory.mktemp("tcp"), system__transport="tcp"), evaluate=False)
    yield server
    server.close()


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.05)


def read_frame(sock: socket.socket):
    header = parse_header(receive_exactly(sock, HEADER_BYTES))
    return header, bytes(receive_body(sock, header.length))


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"connection closed after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


def connected(served, *, hello: bool) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.port), timeout=30)
    if hello:
        sock.sendall(pack_header(Kind.REQUEST, Method.HELLO, len(TOKEN), call=1) + TOKEN.encode())
        header, _ = read_frame(sock)
        assert header.kind == Kind.REPLY and header.method == Method.HELLO
    return sock


@pytest.mark.parametrize(
    "hello, method, length, limit",
    [
        (True, Method.PUSH, None, "max_message_bytes"),  # one byte over the model-sized limit
        (True, Method.PUSH, 2**32 - 1, "max_message_bytes"),
        (True, Method.STATUS, 2 << 20, "small"),  # the small calls' limit
        (False, Method.HELLO, 1 << 30, "hello"),  # before authenticating: a token's worth
    ],
    ids=["push-just-over", "push-4GiB", "status-2MiB", "hello-1GiB"],
)
def test_a_frame_longer_than_its_limit_is_refused_before_allocation(served, hello, method, length, limit):
    limits = {"max_message_bytes": served.server.core.max_message_bytes, "small": 1 << 20, "hello": HELLO_MAX_BYTES}
    claimed = length if length is not None else limits[limit] + 1
    with connected(served, hello=hello) as sock:
        tracemalloc.start()  # numpy reports its buffers here: a body buffer of the claimed size would show
        try:
            sock.sendall(pack_header(Kind.REQUEST, method, claimed, call=7))  # the header alone: no body follows
            header, body = read_frame(sock)  # answered without waiting for a body
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert sock.recv(1) == b""  # and the connection closed: the next frame cannot be found
    assert header.kind == Kind.ERROR and header.closing and header.call == 7
    assert STATUS_NAMES[header.status] == "RESOURCE_EXHAUSTED"
    assert f"{method.name} frame of {claimed} bytes exceeds the limit of {limits[limit]} bytes" in body.decode()
    assert peak < 1 << 20, f"{peak} bytes allocated while refusing a frame of {claimed}"


def test_byte_counters_count_the_exact_frames(served):
    with served.client() as client:
        reply = client.status()
        hello_sent, hello_received = HEADER_BYTES + len(TOKEN), HEADER_BYTES
        assert client.bytes_sent == hello_sent + HEADER_BYTES + len(serialize(pb.StatusRequest()))
        assert client.bytes_received == hello_received + HEADER_BYTES + len(reply.SerializeToString())
        before = client.bytes_sent, client.bytes_received
        client.status()  # the same connection: no second hello
        assert (client.bytes_sent - before[0], client.bytes_received - before[1]) == (
            HEADER_BYTES,
            HEADER_BYTES + len(reply.SerializeToString()),
        )


@pytest.mark.slow
def test_a_call_past_its_deadline_ends_on_both_sides(tmp_path):
    """A sync pull waits for a round that cannot start (one of two workers): the client's deadline ends it,
    and the server's waiting call sees it and stops (the worker's next call is served at once)."""
    served = ServedServer(
        ps_config(tmp_path, system__transport="tcp", system__num_workers=2, system__aggregation_mode="sync"),
        evaluate=False,
    )
    try:
        with served.client() as client:
            registration = client.register(0)
            caller = pb.Caller(worker_id=0, session=registration.session)
            started = time.monotonic()
            with pytest.raises(CallError) as late:
                client._call("Pull", pb.PullRequest(caller=caller), timeout=1.0, retry=False)
            assert late.value.code == "DEADLINE_EXCEEDED"
            assert time.monotonic() - started < 10
            tcp = served.server.transport_server
            wait_for(lambda: tcp.open_connections() == 0, 10, "the server's waiting call to end")
            assert client.heartbeat(caller, pb.WorkerStats(), timeout=10).version == 0
    finally:
        served.close()


@pytest.mark.slow
def test_the_client_reconnects_through_a_server_restart(tmp_path):
    """A server stopped and started again on the same port: a client's idle connection is dead, the next call
    connects afresh; a Register sent while no server listens waits for it (``wait_for_ready``)."""
    config = ps_config(tmp_path, system__transport="tcp")
    first = ServedServer(config, evaluate=False)
    address = first.address
    restarted_config = config.model_copy(
        update={"system": config.system.model_copy(update={"server_address": address})}
    )
    client = TCPParameterServerClient(address, token=TOKEN, retries=2, connect_timeout_s=60)
    servers = [first]
    try:
        assert client.register(0).incarnation == 1
        first.close()
        with pytest.raises(CallError) as down:
            TCPParameterServerClient(address, token=TOKEN, retries=0).status(timeout=5)
        assert down.value.code == "UNAVAILABLE"
        starter = threading.Timer(1.0, lambda: servers.append(ServedServer(restarted_config, evaluate=False)))
        starter.start()  # the server comes back while the client is already waiting for it
        registration = client.register(0)
        starter.join()
        assert registration.incarnation == 1  # a new server: a new run's first incarnation
        assert client.status().registered == [0]
    finally:
        client.close()
        for server in servers[1:]:
            server.close()


def test_health_probe_needs_no_token(served, capsys):
    from src.transport.healthcheck import main

    assert main(["--transport", "tcp", "--address", served.address]) == 0
    assert capsys.readouterr().out.strip() == f"{served.address}: SERVING"
    assert main("--transport tcp --address 127.0.0.1:1 --timeout 2".split()) == 1
    assert "unhealthy: 127.0.0.1:1: UNAVAILABLE" in capsys.readouterr().err


def test_a_grpc_client_at_a_tcp_server_is_told_in_one_line(served):
    from src.transport.grpc import ParameterServerClient

    with ParameterServerClient(served.address, token=TOKEN, retries=0) as client:
        with pytest.raises(CallError) as refused:
            client.status(timeout=5)
    assert refused.value.code == "UNAVAILABLE"
    with connected(served, hello=False) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # what a gRPC client opens with
        header, body = read_frame(sock)
    assert STATUS_NAMES[header.status] == "INVALID_ARGUMENT"
    assert "not a frame of this protocol" in body.decode() and "system.transport" in body.decode()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_server_is_rejoined_over_tcp(tmp_path):
    """Real processes over TCP: the server SIGKILLs itself at version 10; the launcher restarts it from its
    version-9 checkpoint on the same port, the workers' connections are dead, they reconnect, register
    again and finish the run with every sample applied once (the lost version's redone)."""
    from src.coordinator import check_coverage
    from src.launch.ps import run_local
    from src.metrics import read_events

    config = ps_config(
        tmp_path,
        system__transport="tcp",
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__max_train_samples=512,
        training__checkpoint_interval=3,
        system__inject_faults=["kill:server@version=10"],
        system__heartbeat_interval=0.5,
        system__heartbeat_timeout=5.0,
    )
    summary = run_local(config)
    events = list(read_events(tmp_path / "run" / "logs" / "server" / "events.jsonl"))
    recovered = [i for i, e in enumerate(events) if e["kind"] == "server_recovered"]
    assert len(recovered) == 1 and events[recovered[0]]["version"] == 9 and events[recovered[0]]["versions_lost"] == 1
    assert {e["worker"] for e in events[recovered[0] :] if e["kind"] == "register"} == {0, 1}  # with the new server
    coverage = check_coverage(events, 512, 1)
    assert coverage["ok"] and coverage["voided"] == 1, coverage
    assert summary["samples_processed"] == 512 and summary["faults"]["server_recoveries"] == 1


def test_replies_are_sent_from_the_parameters_and_a_late_retry_gets_the_current_ones(tmp_path):
    """Replies over TCP are the parameters' own memory, not copies; a retried push whose first reply was
    overtaken by another worker's step is answered with the same verdict and work and the current parameters."""
    from tests.ps_fixtures import identity_gradients

    served = ServedServer(
        ps_config(
            tmp_path,
            system__transport="tcp",
            system__num_workers=2,
            system__async_correction="none",
            training__max_train_samples=128,
        ),
        evaluate=False,
    )
    first, second = served.worker(0), served.worker(1)
    try:
        request = first.request(request_id=5, gradients=identity_gradients(served.server, value=1.0))
        reply = first.push(request)
        assert not served.server.core.replies.shared.copied  # nothing changed while it was sent: no copy was made
        second.push()  # the model moves on; nobody is sending version 1 any more
        retry = first.client.push(request)
        assert retry.message.version == 2 and retry.message.work == reply.message.work
        assert retry.message.accepted and served.server.counters["pushes_applied"] == 2  # applied once
        for sent, param in zip(retry.large["parameters"], served.server.state.params):
            assert bytes(sent) == param.detach().numpy().tobytes()
    finally:
        first.close()
        second.close()
        served.close()


def test_a_reply_on_the_wire_while_the_model_changes_keeps_its_version():
    """The sender writes a shared piece a non-blocking chunk at a time: a step that comes while the receiver
    has read nothing yet swaps in a copy, and the receiver still gets the bytes of the version sent."""
    import numpy as np
    import torch

    from src.transport.tcp_frames import send_frame
    from src.transport.wire import Outgoing, SharedBuffers, encode, split, tensor_view

    tensor = torch.randn(4 << 20)  # 16 MB: more than the socket buffers hold
    expected = tensor.numpy().tobytes()
    shared = SharedBuffers([tensor_view(tensor)])
    reply = encode(Outgoing(pb.PullReply(version=3), {"parameters": [shared.ref(0)]}))
    assert shared.acquire()
    writer, reader = socket.socketpair()
    sending = threading.Thread(
        target=send_frame, args=(writer, pack_header(Kind.REPLY, Method.PULL, len(reply)), reply.buffers)
    )
    sending.start()
    wait_for(lambda: select.select([reader], [], [], 0)[0], 10, "the send to start")
    assert sending.is_alive()  # 16 MB do not fit in the socket's buffers: the rest waits for the reader
    shared.before_write()  # the next step, while the reply is on the wire
    tensor.add_(1.0)
    header, body = read_frame(reader)
    sending.join(10)
    shared.release()
    writer.close()
    reader.close()
    assert shared.copied and header.length == len(reply)
    assert bytes(split(body, pb.PullReply, ("parameters",)).large["parameters"][0]) == expected
    assert not np.array_equal(np.frombuffer(expected, dtype=np.float32), tensor.numpy())


@pytest.mark.parametrize("bound", ["default", "push"])
def test_a_large_body_is_read_in_bounded_reads_and_whole(bound):
    """Reads take at most RECEIVE_CHUNK_BYTES each by default (reads of several MB stalled a loopback echo), at
    most the bound a reader gives (the server's pushes: PUSH_READ_BYTES), progress follows each, and the body
    arrives byte for byte."""
    from src.transport.tcp_frames import PUSH_READ_BYTES, RECEIVE_CHUNK_BYTES
    from src.transport.tcp_frames import receive_exactly as read_frame_body

    limit = RECEIVE_CHUNK_BYTES if bound == "default" else 2 * RECEIVE_CHUNK_BYTES
    assert PUSH_READ_BYTES > RECEIVE_CHUNK_BYTES
    options = {} if bound == "default" else {"read_bytes": limit}
    payload = bytes(range(256)) * ((3 * limit + 1234) // 256)
    left, right = socket.socketpair()
    asked: list[int] = []

    class Recording:
        def recv_into(self, view, nbytes=0):
            asked.append(nbytes)
            return right.recv_into(view, nbytes)

    sender = threading.Thread(target=left.sendall, args=(payload,))
    sender.start()
    body, progress = bytearray(len(payload)), []
    read_frame_body(Recording(), memoryview(body), progress.append, **options)
    sender.join(10)
    left.close()
    right.close()
    assert bytes(body) == payload
    assert asked and max(asked) == limit
    assert len(asked) >= len(payload) // limit
    assert progress[-1] == len(payload) and progress == sorted(progress)
