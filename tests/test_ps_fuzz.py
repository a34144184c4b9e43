"""The push parser is untrusted-input code: random and mutated Push bodies against a live server.

Every body either is a valid push (applied, as any valid push is) or is refused with a status that
names the problem; the server never fails inside a handler (UNKNOWN/INTERNAL), never changes its
parameters or version for a refused push, and answers Status after every attempt. On both
transports (the bodies are the same messages).

The TCP transport reads its own frames too: random bytes and mutated frames on a raw connection
(before and after authenticating) are answered with an ERROR frame or the connection is closed,
never accepted as a call; the server allocates nothing near a frame's claimed length, never wedges
(each attempt ends within a bounded time, and the server answers Status after it) and keeps serving.
"""

from __future__ import annotations

import socket
import time
import tracemalloc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from src import parameter_server_pb2 as pb
from src.transport.clients import TRANSPORTS
from src.transport.errors import CallError
from src.transport.wire import Outgoing, serialize
from tests.ps_fixtures import TOKEN, ServedServer, ps_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REFUSALS = {
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "NOT_FOUND",
    "ABORTED",
}


def fuzz_server(tmp_path_factory, transport: str) -> ServedServer:
    return ServedServer(
        ps_config(
            tmp_path_factory.mktemp("fuzz"),
            training__num_epochs=1000,
            training__max_train_samples=32,
            system__transport=transport,
        ),
        evaluate=False,
    )


@pytest.fixture(scope="module", params=TRANSPORTS)
def target(tmp_path_factory, request):
    served = fuzz_server(tmp_path_factory, request.param)
    worker = served.worker(0)
    yield served, worker, lambda body: worker.client.push_bytes(body, timeout=30)  # bytes in as they are
    worker.close()
    served.close()


def valid_body(worker) -> bytes:
    request = worker.request()
    gradients = list(request.gradients)
    del request.gradients[:]
    return serialize(Outgoing(request, {"gradients": gradients}))


def attempt(target, body: bytes) -> None:
    served, worker, raw_push = target
    before_version = served.server.state.version
    before = [p.detach().clone() for p in served.server.state.params]
    try:
        raw_push(body)
    except CallError as refused:
        assert refused.code in REFUSALS, (refused.code, refused.message)
        details = refused.message or ""
        assert details and "\n" not in details and "Traceback" not in details, details
        assert served.server.state.version == before_version
        assert all(torch.equal(a, b) for a, b in zip(before, served.server.state.params))
    else:  # a mutation that is still a valid push of the held work: applied like any other
        assert served.server.state.version == before_version + 1
        worker.reply = worker.client.pull(worker.caller)  # its next work (the reply went to the raw call)
        worker.version = worker.reply.message.version
        worker.next_request_id += 1
    assert worker.client.status(timeout=10).version == served.server.state.version  # still serving


def mutate(data, body: bytearray, kinds: list[str]) -> None:
    """Apply one mutation, of a kind drawn from ``kinds``, to ``body`` in place."""
    from src.transport.tcp_frames import HEADER

    kind = data.draw(st.sampled_from(kinds), label="kind")
    # drawn from a fixed range: the valid body's length depends on the server's state, and hypothesis
    # needs the same strategies when it replays an example
    position = data.draw(st.integers(0, 1 << 22), label="position") % max(len(body), 1)
    if kind == "header field" and len(body) >= HEADER.size:  # one field of the first frame header: kind .. length
        offset, size = data.draw(
            st.sampled_from([(4, 1), (5, 1), (6, 1), (7, 1), (8, 4), (12, 4), (16, 4)]), label="field"
        )
        body[offset : offset + size] = data.draw(st.integers(0, 256**size - 1), label="value").to_bytes(size, "little")
    elif kind == "flip" and body:
        body[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    elif kind == "truncate":
        del body[position:]
    elif kind == "insert":
        body[position:position] = data.draw(st.binary(min_size=1, max_size=16), label="inserted")
    elif kind == "delete" and body:
        del body[position : position + data.draw(st.integers(1, 16), label="deleted")]
    elif kind == "overwrite" and body:
        chunk = data.draw(st.binary(min_size=1, max_size=8), label="written")
        body[position : position + len(chunk)] = chunk


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=512))
def test_random_bodies_are_refused_cleanly(target, body):
    attempt(target, body)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_pushes_are_refused_cleanly_or_applied_when_still_valid(target, data):
    body = bytearray(valid_body(target[1]))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        mutate(data, body, ["flip", "truncate", "insert", "delete", "overwrite"])
    attempt(target, bytes(body))


# ----------------------------------------------------------------------------- the TCP transport's own frames

ATTEMPT_S = 20.0
"""An attempt (connect, send, read to the end) must end within this: the server closes or answers, never wedges."""
REFUSED_FRAMES = REFUSALS | {"UNAUTHENTICATED", "RESOURCE_EXHAUSTED"}


@pytest.fixture(scope="module")
def frames_target(tmp_path_factory):
    """A TCP-transport server with a registered worker, and a valid frame of each kind a client sends."""
    from src.transport.tcp_frames import Kind, Method, pack_header

    served = fuzz_server(tmp_path_factory, "tcp")
    worker = served.worker(0)
    token = TOKEN.encode()
    body = valid_body(worker)
    status = pb.StatusRequest().SerializeToString()
    frames = {
        "hello": pack_header(Kind.REQUEST, Method.HELLO, len(token), call=1) + token,
        "health": pack_header(Kind.REQUEST, Method.HEALTH, 0, call=2),
        "status": pack_header(Kind.REQUEST, Method.STATUS, len(status), call=3) + status,
        "push": pack_header(Kind.REQUEST, Method.PUSH, len(body), call=4) + body,
    }
    tracemalloc.start()  # numpy reports its buffers to tracemalloc: a frame's body buffer shows here
    yield FrameTarget(served, worker, frames)
    tracemalloc.stop()
    worker.close()
    served.close()


class FrameTarget(tuple):
    """(server, worker, valid frames by name), shown briefly when hypothesis reports an example."""

    def __new__(cls, *items):
        return super().__new__(cls, items)

    def __repr__(self) -> str:
        return "frames_target"


def raw_exchange(served, data: bytes) -> list[tuple]:
    """Send ``data`` on a new connection and half-close it; the frames the server sent back until it closed."""
    from src.transport.tcp_frames import HEADER_BYTES, parse_header

    received = bytearray()
    with socket.create_connection(("127.0.0.1", served.port), timeout=ATTEMPT_S) as sock:
        started = time.monotonic()
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)  # the server sees the end of what we send: it cannot wait for more
            while chunk := sock.recv(1 << 16):
                received += chunk
                assert time.monotonic() - started < ATTEMPT_S, "the server keeps the connection open (wedged)"
        except (BrokenPipeError, ConnectionResetError, OSError) as exc:  # the server closed first: refused
            if isinstance(exc, socket.timeout):
                raise AssertionError("the server neither answered nor closed the connection (wedged)") from None
    frames, position = [], 0
    while position < len(received):
        header = parse_header(received[position : position + HEADER_BYTES])  # the server writes only valid frames
        body = bytes(received[position + HEADER_BYTES : position + HEADER_BYTES + header.length])
        assert len(body) == header.length, "the server sent a truncated frame"
        frames.append((header, body))
        position += HEADER_BYTES + header.length
    return frames


def frame_attempt(target, data: bytes, *, authenticated_prefix: bool) -> None:
    from src.transport.tcp_frames import STATUS_NAMES, Kind, Method

    served, worker, frames = target
    before_version = served.server.state.version
    tracemalloc.reset_peak()
    baseline = tracemalloc.get_traced_memory()[0]
    replies = raw_exchange(served, (frames["hello"] if authenticated_prefix else b"") + data)
    grown = tracemalloc.get_traced_memory()[1] - baseline
    limit = served.server.core.max_message_bytes
    assert grown < limit + (8 << 20), f"the server allocated {grown} bytes for {len(data)} bytes sent"
    authenticated = False
    for header, body in replies:
        assert header.kind in (Kind.REPLY, Kind.ERROR)
        if header.kind == Kind.ERROR:
            code = STATUS_NAMES[header.status]
            details = body.decode()
            assert code in REFUSED_FRAMES, (code, details)
            assert details and "\n" not in details and "Traceback" not in details, details
        elif header.method == Method.HELLO:
            authenticated = True
        elif header.method != Method.HEALTH:  # a call is answered only after the server accepted a HELLO
            assert authenticated, header
    if not authenticated:
        assert served.server.state.version == before_version
    elif served.server.state.version != before_version:  # a mutation that is still a valid push: its reply came
        assert any(h.method == Method.PUSH and h.kind == Kind.REPLY for h, _ in replies)
        worker.reply = worker.client.pull(worker.caller)
        worker.version = worker.reply.message.version
    assert worker.client.status(timeout=10).version == served.server.state.version  # still serving


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=256), authenticated=st.booleans())
def test_random_bytes_on_a_connection_are_never_a_call(frames_target, data, authenticated):
    frame_attempt(frames_target, data, authenticated_prefix=authenticated)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_frames_are_refused_cleanly_or_answered_when_still_valid(frames_target, data):
    frames = frames_target[2]
    authenticated = data.draw(st.booleans(), label="authenticated")
    names = data.draw(
        st.lists(st.sampled_from(["hello", "health", "status", "push"]), min_size=1, max_size=3), label="frames"
    )
    body = bytearray(b"".join(frames[name] for name in names))
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        mutate(data, body, ["header field", "flip", "truncate", "insert", "delete"])
    frame_attempt(frames_target, bytes(body), authenticated_prefix=authenticated)
