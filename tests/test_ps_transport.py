"""PS wire helpers: large bytes fields encoded outside protobuf still make the same protobuf message."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from src import parameter_server_pb2 as pb
from src.transport.wire import (
    MessageSplitter,
    Outgoing,
    copy_bytes_into,
    encode,
    serialize,
    split,
    tensor_to_bytes,
    tensor_view,
)


def full_push(gradients, buffers) -> pb.PushRequest:
    return pb.PushRequest(
        caller=pb.Caller(worker_id=3, session=b"s" * 16),
        base_version=7,
        request_id=2**62 + 5,
        num_samples=32,
        batch_ids=[4, 2**40],
        gradients=gradients,
        buffers=buffers,
        metrics=pb.StepMetrics(epoch=1, step=2, loss=0.5, correct=30, gradient_time_s=0.25),
    )


@pytest.mark.parametrize("sizes", [[], [0], [1, 127, 128, 300], [70_000, 3]])
def test_serialize_equals_protobuf_and_split_inverts_it(sizes):
    gradients = [bytes([i % 251]) * size for i, size in enumerate(sizes)]
    buffers = [b"\x01\x02\x03\x04"] if sizes else []
    small = full_push([], [])
    data = serialize(Outgoing(small, {"gradients": gradients, "buffers": buffers}))
    assert pb.PushRequest.FromString(data) == full_push(gradients, buffers)
    assert len(data) == full_push(gradients, buffers).ByteSize()
    received = split(data, pb.PushRequest, ("gradients", "buffers"))
    assert received.message == small
    assert [bytes(v) for v in received.large["gradients"]] == gradients
    assert [bytes(v) for v in received.large["buffers"]] == buffers


def test_an_identity_payload_in_parts_is_the_payload_and_sends_the_gradient_from_its_own_memory():
    from src.compression import IDENTITY
    from src.transport.wire import chunk_size

    gradient = torch.randn(300, 70)  # 84,000 bytes: a large piece, sent as a view
    header, values = IDENTITY.parts(gradient)
    assert header + bytes(values) == IDENTITY.compress(gradient)
    pieces = encode(Outgoing(full_push([], []), {"gradients": [(header, values), b"small"]}))
    assert any(
        isinstance(p, memoryview) and torch.frombuffer(p, dtype=torch.float32).data_ptr() == gradient.data_ptr()
        for p in pieces.buffers
    )  # no copy of the gradient
    data = bytes(pieces)
    assert data == serialize(Outgoing(full_push([], []), {"gradients": [IDENTITY.compress(gradient), b"small"]}))
    assert [bytes(v) for v in split(data, pb.PushRequest, ("gradients",)).large["gradients"]] == [
        IDENTITY.compress(gradient),
        b"small",
    ]
    assert chunk_size((header, values)) == len(IDENTITY.compress(gradient)) and chunk_size(b"small") == 5
    half = torch.randn(5, dtype=torch.float16)  # converted: the parts are a copy, the same payload
    assert b"".join(bytes(p) for p in IDENTITY.parts(half)) == IDENTITY.compress(half)
    with pytest.raises(ValueError, match="NaN"):
        IDENTITY.parts(torch.tensor([1.0, float("nan")]))


def test_split_reads_what_protobuf_wrote():
    reply = pb.PullReply(version=9, parameters=[b"a" * 1000, b"bc"], buffers=[b"d"])
    received = split(reply.SerializeToString(), pb.PullReply, ("parameters", "buffers"))
    assert received.message == pb.PullReply(version=9)
    assert [bytes(v) for v in received.large["parameters"]] == [b"a" * 1000, b"bc"]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\x08", "truncated or overlong varint"),
        (b"\x08" + b"\xff" * 11, "truncated or overlong varint"),
        (b"\x2a\x05ab", "runs past the end"),
        (b"\x11\x00", "runs past the end"),  # fixed64 with 1 byte
        (b"\x0b", "unsupported wire type 3"),
        (b"\x42\x01\x08", "Wire format was corrupt"),  # metrics: a submessage cut inside a field
    ],
)
def test_split_refuses_malformed_bytes(data, message):
    with pytest.raises(ValueError, match=message):
        split(data, pb.PushRequest, ("gradients", "buffers"))


def _split_outcome(parse):
    try:
        received = parse()
    except ValueError as exc:
        return "refused", str(exc)
    return received.message, {name: [bytes(v) for v in views] for name, views in received.large.items()}


@settings(max_examples=200, deadline=None)
@given(
    gradients=st.lists(st.binary(min_size=1, max_size=400), max_size=4),
    damage=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=3),
    cut=st.none() | st.integers(min_value=0),
    steps=st.lists(st.integers(1, 300), min_size=1, max_size=40),
)
def test_splitting_a_message_as_it_arrives_is_split_of_the_same_bytes(gradients, damage, cut, steps):
    """MessageSplitter, fed the bytes in any pieces, gives split's message and views (or its refusal),
    hands every large field to on_large exactly once, as the very view it returns, and tells on_partial
    of a large field only while it is part-way in, over the whole field's bytes, arriving in order."""
    data = bytearray(serialize(Outgoing(full_push([], []), {"gradients": gradients, "buffers": [b"\x01" * 4]})))
    for position, value in damage:
        data[position % len(data)] = value
    data = bytes(data[: cut % (len(data) + 1)] if cut is not None else data)
    seen, partial = [], []
    splitter = MessageSplitter(
        bytearray(data),
        pb.PushRequest,
        ("gradients", "buffers"),
        on_large=lambda *field: seen.append(field) or 1,
        on_partial=lambda name, index, view, arrived: partial.append((name, index, view, arrived)),
    )
    arrived = 0
    for step in steps:
        arrived = min(len(data), arrived + step)
        splitter.advance(arrived)  # never raises before the last byte: a malformed message waits for finish
    outcome = _split_outcome(splitter.finish)
    assert outcome == _split_outcome(lambda: split(data, pb.PushRequest, ("gradients", "buffers")))
    if outcome[0] != "refused":
        received = splitter.finish()
        assert sorted((name, index) for name, index, _ in seen) == sorted(received.early)
        for (name, index), (view, result) in received.early.items():
            assert view is received.large[name][index] and result == 1
        last: dict = {}
        for name, index, view, arrived in partial:
            whole = received.large[name][index]
            assert 0 < arrived < len(whole) == len(view) and bytes(view) == bytes(whole)
            assert arrived >= last.get((name, index), 0)
            last[(name, index)] = arrived


def test_tensor_bytes_round_trip_without_copies_on_the_way_out():
    tensor = torch.randn(3, 5)
    view = tensor_view(tensor)
    assert view.nbytes == 60 and bytes(view) == tensor_to_bytes(tensor)
    tensor[0, 0] = 42.0
    assert bytes(view)[:4] == torch.tensor([42.0]).numpy().tobytes()  # a view of the tensor, not a copy
    target = torch.empty(3, 5)
    copy_bytes_into(target, memoryview(tensor_to_bytes(tensor)))
    assert torch.equal(target, tensor)
    with pytest.raises(ValueError, match="parameter 2: 56 bytes, expected 60"):
        copy_bytes_into(target, b"\x00" * 56, "parameter 2")


def test_shared_buffers_keep_a_sends_bytes_and_copy_only_when_the_memory_changes_under_it():
    from src.transport.wire import SharedBuffers

    tensor = torch.arange(6, dtype=torch.float32)
    before = tensor_to_bytes(tensor)
    leased = SharedBuffers([tensor_view(tensor)])
    reply = encode(Outgoing(pb.PullReply(version=1), {"parameters": [leased.ref(0)]}))
    assert leased.acquire() and reply.shared is leased and len(reply) == len(bytes(reply))
    leased.before_write()  # a send holds a lease: the bytes are copied before the tensor changes
    tensor.add_(1.0)
    assert leased.copied and split(bytes(reply), pb.PullReply, ("parameters",)).large["parameters"][0] == before
    reply.release()
    unleased = SharedBuffers([tensor_view(tensor)])
    unleased.before_write()  # nobody sends from it: dropped, no copy
    assert not unleased.valid and not unleased.copied and not unleased.acquire()
