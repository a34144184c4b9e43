"""A streamed push (``system.streaming``) over both transports, against a live server: its parts sent one by one,
then its message, its reply taken as it arrives (:mod:`src.transport.stream`; gRPC's ``PushStream``, TCP's
PUSH_PART frames).

A streamed push is the same push: its reply (verdict, version, parameters bit for bit) is what the same push sent
in one message gets from a server in the same state, whatever order its parts come in. What is wrong with its
parts (one twice, one missing, a bad payload) refuses it with INVALID_ARGUMENT naming the problem, as a unary push
is refused, and the server goes on serving. Both ends count exactly the messages that crossed the wire, and the
reply's head reaches the waiting worker before its last tensor is in.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import grpc
import pytest
import torch

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY
from src.transport.clients import TRANSPORTS
from src.transport.errors import CallError
from src.transport.grpc import (
    PART_PIECE_BYTES,
    push_part_message,
    push_part_messages,
    reply_chunk_bounds,
    reply_stream_bytes,
)
from src.transport.grpc_service import reply_messages
from src.transport.stream import PART_INDEX, PushStream, part_size
from src.transport.tcp_frames import HEADER_BYTES
from src.transport.wire import Outgoing, Received, SharedBuffers, encode, serialize
from tests.ps_fixtures import ServedServer, ps_config

pytestmark = pytest.mark.timeout(60)


def stream_config(tmp_path, transport: str):
    return ps_config(
        tmp_path,
        training__num_epochs=1000,
        training__max_train_samples=32,
        system__transport=transport,
        system__heartbeat_timeout=600,  # the hand-driven workers send no heartbeats between the module's tests
    )


@pytest.fixture(scope="module", params=TRANSPORTS)
def twins(tmp_path_factory, request):
    """Two servers of the same config on one transport, each with its worker: one takes streamed pushes, the other
    the same pushes in one message (shared by the module's tests, which keep them in step)."""
    served = [
        ServedServer(stream_config(tmp_path_factory.mktemp(f"{request.param}{i}"), request.param), evaluate=False)
        for i in range(2)
    ]
    workers = [server.worker(0) for server in served]
    yield request.param, served, workers
    for worker in workers:
        worker.close()
    for server in served:
        server.close()


def gradients(server, seed: int) -> list[bytes]:
    generator = torch.Generator().manual_seed(seed)
    return [
        IDENTITY.compress(0.01 * torch.randn(tuple(spec.shape), generator=generator)) for spec in server.param_specs
    ]


class Recorder:
    """A stream's reply tensors as they come (``on_large``), with whether the head was in by then."""

    def __init__(self):
        self.stream: PushStream | None = None
        self.seen: list[tuple[str, int, bool]] = []
        self.hold: tuple[int, threading.Event] | None = None  # (parameter index, event): on_large waits on it
        self.held: bool | None = None

    def on_large(self, name: str, index: int, view: memoryview) -> None:
        self.seen.append((name, index, self.stream.has_head))
        if self.hold is not None and name == "parameters" and index == self.hold[0]:
            self.held = self.hold[1].wait(10)


def streamed(
    worker,
    request: pb.PushRequest,
    payloads: Sequence[Any],
    order: Sequence[int] | None = None,
    *,
    recorder: Recorder | None = None,
    encode_part=None,
) -> tuple[PushStream, Received]:
    """Send ``request`` as a streamed push, its gradients ``payloads`` as parts in ``order`` (default: parameter
    order; an index twice is sent twice, one left out is not sent); the worker's state follows the reply."""
    recorder = recorder or Recorder()
    stream = PushStream(encode_part or (lambda index: payloads[index]), recorder.on_large)
    recorder.stream = stream
    for index in order if order is not None else range(len(payloads)):
        stream.ready(index)
    message = pb.PushRequest()
    message.CopyFrom(request)
    del message.gradients[:]
    stream.close(Outgoing(message, {"buffers": []}))
    covered = worker.carried + list(worker.work.batches)
    worker.next_request_id = max(worker.next_request_id, request.request_id) + 1
    reply = worker.client.push_streamed(stream, timeout=30)
    worker.carried = [] if reply.message.accepted else [b for b in covered if b.batch_id in request.batch_ids]
    worker.reply, worker.version = reply, reply.message.version
    return stream, reply


def in_step(twins, seed: int, order: Sequence[int] | None = None) -> tuple[Received, Received]:
    """The same push (gradients of ``seed``) to both servers: streamed to the first, in one message to the second."""
    _, served, workers = twins
    payloads = gradients(served[0].server, seed)
    request, twin = (worker.request(gradients=payloads) for worker in workers)
    assert same_push(request, twin)  # the same state: the same push
    _, reply = streamed(workers[0], request, payloads, order)
    return reply, workers[1].push(twin)


def same_push(request: pb.PushRequest, twin: pb.PushRequest) -> bool:
    """The same push but for the caller (each server gives its worker a session of its own) and the request id."""
    copies = pb.PushRequest(), pb.PushRequest()
    for copy, original in zip(copies, (request, twin)):
        copy.CopyFrom(original)
        copy.ClearField("caller")
        copy.ClearField("request_id")
    return copies[0] == copies[1]


def tensors(received: Received) -> dict[str, list[bytes]]:
    return {name: [bytes(view) for view in views] for name, views in received.large.items() if views}


def test_a_streamed_push_gets_the_reply_of_the_same_push_in_one_message_whatever_the_order_of_its_parts(twins):
    count = len(twins[1][0].server.param_specs)
    for seed, order in ((1, None), (2, list(reversed(range(count)))), (3, [3, 0, 7, 1, 6, 2, 5, 4][:count])):
        reply, unary = in_step(twins, seed, order)
        assert reply.message.accepted and reply.message == unary.message
        assert tensors(reply) == tensors(unary)  # the parameters bit for bit: the same update
        assert reply.message.version == unary.message.version >= seed


@pytest.mark.parametrize(
    "case, problem",
    [
        ("twice", "the part of gradient 1 arrived twice"),
        ("missing", "the part of gradient 3 is missing"),
        ("missing last", "the part of gradient 7 is missing"),
        ("bad payload", "gradient 2 ("),
        ("no such gradient", "a part of gradient 40: the model has 8 parameters"),
    ],
)
def test_a_streamed_push_with_a_wrong_part_is_refused_naming_it_and_the_server_goes_on(twins, case, problem):
    _, served, workers = twins
    worker = workers[0]
    payloads = gradients(served[0].server, 10)
    count = len(payloads)
    assert count == 8  # simple_cnn: the cases' indices
    order = list(range(count))
    encode_part = None
    if case == "twice":
        order.insert(2, 1)
    elif case == "missing":
        order.remove(3)
    elif case == "missing last":
        order.remove(7)
    elif case == "bad payload":
        encode_part = lambda index: b"\x00\x01\x02" if index == 2 else payloads[index]  # noqa: E731
    else:
        order.append(40)
        encode_part = lambda index: payloads[index % count]  # noqa: E731
    version = worker.version
    request = worker.request(gradients=payloads)
    with pytest.raises(CallError) as refused:
        streamed(worker, request, payloads, order, encode_part=encode_part)
    assert refused.value.code == "INVALID_ARGUMENT", refused.value.message
    assert problem in refused.value.message
    if case == "bad payload":  # refused as the same push in one message is, in the same words
        with pytest.raises(CallError) as unary:
            worker.client.push(worker.request(gradients=[*payloads[:2], b"\x00\x01\x02", *payloads[3:]]))
        assert (unary.value.code, unary.value.message) == (refused.value.code, refused.value.message)
    # nothing applied; the server serves the next push (on both servers: they stay in step)
    assert served[0].server.version == version
    reply, unary = in_step(twins, 11)
    assert reply.message.accepted and reply.message.version == version + 1
    assert tensors(reply) == tensors(unary)


def test_the_client_counts_exactly_the_messages_that_crossed_the_wire(twins, monkeypatch):
    transport, served, workers = twins
    worker = workers[0]
    client = worker.client
    payloads = gradients(served[0].server, 20)
    request = worker.request(gradients=payloads)
    crossed: dict[str, list[bytes]] = {"sent": [], "received": []}
    if transport == "grpc":  # the messages as gRPC takes and hands them (bytes both ways: no serializer)
        calls = client._push_stream

        class Recorded:
            def __init__(self, call):
                self.call = call

            def __iter__(self):
                return self

            def __next__(self):
                data = next(self.call)
                crossed["received"].append(data)
                return data

            def cancel(self):
                return self.call.cancel()

        def sent(messages):
            for data in messages:
                crossed["sent"].append(data)
                yield data

        monkeypatch.setattr(client, "_push_stream", lambda messages, **kw: Recorded(calls(sent(messages), **kw)))
    before = client.bytes_sent, client.bytes_received
    stream, reply = streamed(worker, request, payloads)
    sent, received = client.bytes_sent - before[0], client.bytes_received - before[1]
    assert stream.sent_bytes == sent and stream.reply_bytes == received
    whole = pb.PushReply()  # the reply's bytes: the PushReply these fields make
    whole.CopyFrom(reply.message)
    for name, views in reply.large.items():
        getattr(whole, name).extend(bytes(view) for view in views)
    unstreamed = pb.PushRequest()
    unstreamed.CopyFrom(request)
    del unstreamed.gradients[:]
    message_bytes = len(serialize(Outgoing(unstreamed, {"buffers": []})))
    if transport == "grpc":
        assert sent == sum(map(len, crossed["sent"])) and received == sum(map(len, crossed["received"]))
        messages = [pb.PushStreamRequest.FromString(data) for data in crossed["sent"]]
        kinds = [m.WhichOneof("kind") for m in messages]
        parts: list[bytes] = []  # a part above PART_PIECE_BYTES travels in pieces: its part, then part_more
        for m in messages[:-1]:
            if m.WhichOneof("kind") == "part":
                parts.append(m.part)
            else:
                parts[-1] += m.part_more
        pieces = [-(-part_size(p) // PART_PIECE_BYTES) for p in payloads]
        assert kinds == [kind for n in pieces for kind in ["part"] + ["part_more"] * (n - 1)] + ["push"]
        assert max(pieces) > 1  # some gradient of the model is large enough to go in pieces
        assert [part[4:] for part in parts] == payloads and messages[-1].push == bytes(encode(unstreamed))
        assert sent == sum(m.ByteSize() for m in messages)
        chunks = [pb.PushStreamReply.FromString(data) for data in crossed["received"]]
        joined = b"".join(c.reply for c in chunks)  # the reply's bytes, in order: the PushReply
        assert pb.PushReply.FromString(joined) == whole and len(joined) == whole.ByteSize()
        assert chunks[0].reply_size == whole.ByteSize() and len(chunks) > 1
        assert received == sum(c.ByteSize() for c in chunks) == reply_stream_bytes(whole.ByteSize())
    else:  # a frame per part, the push's frame, the reply's frame
        assert sent == sum(HEADER_BYTES + part_size(p) for p in payloads) + HEADER_BYTES + message_bytes
        assert received == HEADER_BYTES + whole.ByteSize()
    workers[1].push(workers[1].request(gradients=payloads))  # the twin in step


def test_a_large_part_goes_in_pieces_only_to_a_server_that_reads_them_as_they_come():
    """``PushStream.pieced`` (a worker turns it off when its server does not pipeline): above
    :data:`PART_PIECE_BYTES` a part is pieces, else one message; the pieces carry the same bytes."""
    payload = torch.arange(100_000, dtype=torch.float32).numpy().tobytes()  # 400 kB: 4 pieces of 128 kB at most
    whole = push_part_messages(3, payload, pieced=False)
    pieces = [pb.PushStreamRequest.FromString(m) for m in push_part_messages(3, payload)]
    assert [pb.PushStreamRequest.FromString(m).part for m in whole] == [PART_INDEX.pack(3) + payload]
    assert [p.WhichOneof("kind") for p in pieces] == ["part", "part_more", "part_more", "part_more"]
    assert pieces[0].part_size == 4 + len(payload) and pieces[0].part + b"".join(p.part_more for p in pieces[1:]) == (
        PART_INDEX.pack(3) + payload
    )
    assert len(push_part_messages(3, payload[:1000])) == 1  # a small part is one message either way
    assert PushStream(lambda index: None, lambda *args: None).pieced  # the default: pieces, for any server


def test_the_replys_head_reaches_the_worker_before_its_last_tensor(twins):
    _, served, workers = twins
    worker = workers[0]
    payloads = gradients(served[0].server, 30)
    last = len(payloads) - 1
    head_seen = threading.Event()
    request = worker.request(gradients=payloads)
    outcome: dict[str, Any] = {}
    made = threading.Event()

    class Announced(Recorder):  # says when the push's stream exists
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "stream" and value is not None:
                made.set()

    recorder = Announced()
    recorder.hold = (last, head_seen)  # the client's thread stops on the last tensor until the head is seen

    def push() -> None:
        try:
            outcome["reply"] = streamed(worker, request, payloads, recorder=recorder)[1]
        except BaseException as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=push)
    thread.start()
    assert made.wait(20)
    head = recorder.stream.wait_head(timeout=20)
    head_seen.set()
    thread.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert recorder.held is True  # the head was out while the last tensor waited
    assert head.accepted and head.version == outcome["reply"].message.version
    assert [(name, index) for name, index, _ in recorder.seen] == [("parameters", i) for i in range(last + 1)]
    assert all(has_head for _, _, has_head in recorder.seen)  # every tensor after the head: forward order
    workers[1].push(workers[1].request(gradients=payloads))  # the twin in step


def test_a_streamed_push_given_up_before_its_message_ends_with_the_workers_error(twins):
    _, served, workers = twins
    worker = workers[0]
    version = worker.version
    stream = PushStream(lambda index: gradients(served[0].server, 40)[index], lambda *tensor: None)
    stream.ready(0)
    stream.abort(RuntimeError("the step was given up"))
    with pytest.raises(RuntimeError, match="the step was given up"):
        worker.client.push_streamed(stream, timeout=30)
    with pytest.raises(RuntimeError, match="the step was given up"):
        stream.wait_head(1)
    assert served[0].server.version == version
    reply, unary = in_step(twins, 41)
    assert reply.message.accepted and tensors(reply) == tensors(unary)


def test_a_streamed_push_needs_the_token(twins):
    _, served, _ = twins
    with served[0].client(token="wrong-token") as client:
        stream = PushStream(lambda index: b"", lambda *tensor: None)
        stream.close(Outgoing(pb.PushRequest(), {}))
        with pytest.raises(CallError) as refused:
            client.push_streamed(stream, timeout=10)
    assert refused.value.code == "UNAUTHENTICATED"


@pytest.mark.slow
def test_a_streamed_push_whose_call_ends_while_backward_goes_on_is_sent_again_whole(twins, monkeypatch):
    """The call's deadline passes while the client waits for a gradient: the retry sends every part again, the
    one the ended call's request thread took meanwhile included, and the push is applied once."""
    transport, served, workers = twins
    worker = workers[0]
    payloads = gradients(served[0].server, 50)
    request = worker.request(gradients=payloads)
    version = worker.version
    stream = PushStream(lambda index: payloads[index], lambda *tensor: None)
    message = pb.PushRequest()
    message.CopyFrom(request)
    del message.gradients[:]

    def backward() -> None:
        for index in range(4):
            stream.ready(index)
        threading.Event().wait(2.0)  # past the call's deadline
        for index in range(4, len(payloads)):
            stream.ready(index)
        stream.close(Outgoing(message, {"buffers": []}))

    monkeypatch.setattr(worker.client, "retries", 1)
    attempts = []
    attempt = worker.client._attempt_streamed
    monkeypatch.setattr(worker.client, "_attempt_streamed", lambda *a, **kw: attempts.append(1) or attempt(*a, **kw))
    producer = threading.Thread(target=backward)
    producer.start()
    try:
        reply = worker.client.push_streamed(stream, timeout=1.0)
    finally:
        producer.join()
    worker.next_request_id = request.request_id + 1
    worker.reply, worker.version = reply, reply.message.version
    unary = workers[1].push(workers[1].request(gradients=payloads))
    assert reply.message.accepted and reply.message.version == version + 1 == served[0].server.version
    assert reply.message == unary.message and tensors(reply) == tensors(unary)
    assert [index for index, _ in stream.encoded] == list(range(len(payloads)))  # each encoded once
    # gRPC: the call ended at its deadline, the retry sent it whole; TCP sends nothing while it waits for a part,
    # so its call ends (if it does) at the reply, which the retry gets again: applied once either way
    assert len(attempts) == 2 if transport == "grpc" else 1 <= len(attempts) <= 2


@pytest.mark.parametrize("sizes", [[], [10], [70_000, 3, 200_000], [3 << 20, 5, 1 << 20]])
def test_a_replys_chunks_carry_its_bytes_from_the_parameters_memory_without_holding_it_between_chunks(sizes):
    shared = SharedBuffers([memoryview(bytes([i % 251]) * size) for i, size in enumerate(sizes)])
    assert shared.acquire()
    parameters = [shared.ref(i) for i in range(len(sizes))]
    reply = encode(Outgoing(pb.PushReply(version=3, work=pb.Work()), {"parameters": parameters}))
    messages = []
    for message in reply_messages(reply):
        assert not shared.lock.locked()  # the owner may write (copy) between two chunks
        messages.append(message)
        if len(messages) == 2:
            shared.before_write()  # the model changes under the reply: its bytes were copied, the rest is the same
    chunks = [pb.PushStreamReply.FromString(message) for message in messages]
    assert b"".join(c.reply for c in chunks) == bytes(reply) and chunks[0].reply_size == len(reply)
    assert [len(c.reply) for c in chunks] == [end - start for start, end in reply_chunk_bounds(len(reply))]
    assert sum(map(len, messages)) == reply_stream_bytes(len(reply))
    assert all(c.ByteSize() == len(m) for c, m in zip(chunks, messages))


def test_a_push_stream_that_breaks_its_protocol_is_refused_at_once(twins):
    transport, _, workers = twins
    if transport != "grpc":
        pytest.skip("gRPC's PushStream messages (TCP's frames: tests/test_ps_fuzz.py)")
    client = workers[0].client
    for messages, problem in (
        ([b"\x0b"], "unsupported wire type 3"),
        ([b""], "a message carries a part, a piece or the push, not 0 parts, 0 pieces, 0 pushes"),
        ([push_part_message(0, b"x")], "it ended before the push's message"),
        ([pb.PushStreamRequest(part_more=b"x").SerializeToString()], "a piece of a part came with no part before it"),
        (
            [pb.PushStreamRequest(part=b"xy", part_size=3).SerializeToString(), push_part_message(0, b"x")],
            "a part ended",
        ),
        (
            [pb.PushStreamRequest(part=b"xy", part_size=3).SerializeToString()]
            + [pb.PushStreamRequest(part_more=b"zw").SerializeToString()],
            "run past its 3 bytes",
        ),
        ([pb.PushStreamRequest(part=b"x", part_size=1 << 40).SerializeToString()], "a part of 1099511627776 bytes"),
    ):
        with pytest.raises(grpc.RpcError) as refused:  # gRPC's own stream, below the client
            list(client._push_stream(iter(messages), metadata=client._metadata, timeout=10))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in refused.value.details()
    reply, unary = in_step(twins, 60)
    assert reply.message.accepted and tensors(reply) == tensors(unary)
