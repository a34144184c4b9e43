"""The push parser is untrusted-input code: random and mutated Push bodies against a live server.

Every body either is a valid push (applied, as any valid push is) or is refused with a status that
names the problem; the server never fails inside a handler (UNKNOWN/INTERNAL), never changes its
parameters or version for a refused push, and answers Status after every attempt.
"""

from __future__ import annotations

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from src.ps_transport import Outgoing, serialize
from tests.ps_fixtures import TOKEN, ServedServer, ps_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.ABORTED}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    served = ServedServer(ps_config(tmp_path_factory.mktemp("fuzz"), training__num_epochs=1000, training__max_train_samples=32),
                          evaluate=False)
    worker = served.worker(0)
    raw_push = worker.client.channel.unary_unary("/dts.ps.ParameterServer/Push")  # bytes in, bytes out
    yield served, worker, raw_push
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
        raw_push(body, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
    except grpc.RpcError as refused:
        assert refused.code() in REFUSALS, (refused.code(), refused.details())
        details = refused.details() or ""
        assert details and "\n" not in details and "Traceback" not in details, details
        assert served.server.state.version == before_version
        assert all(torch.equal(a, b) for a, b in zip(before, served.server.state.params))
    else:  # a mutation that is still a valid push of the held work: applied like any other
        assert served.server.state.version == before_version + 1
        worker.reply = worker.client.pull(worker.caller)  # its next work (the reply went to the raw call)
        worker.version = worker.reply.message.version
        worker.next_request_id += 1
    assert worker.client.status(timeout=10).version == served.server.state.version  # still serving


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=512))
def test_random_bodies_are_refused_cleanly(target, body):
    attempt(target, body)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_pushes_are_refused_cleanly_or_applied_when_still_valid(target, data):
    body = bytearray(valid_body(target[1]))
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]), label="kind")
        # drawn from a fixed range: the valid body's length depends on the server's state, and hypothesis
        # needs the same strategies when it replays an example
        position = data.draw(st.integers(0, 1 << 22), label="position") % max(len(body), 1)
        if kind == "flip" and body:
            body[position] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif kind == "truncate":
            del body[position:]
        elif kind == "insert":
            body[position:position] = data.draw(st.binary(min_size=1, max_size=16), label="inserted")
        elif kind == "delete" and body:
            del body[position:position + data.draw(st.integers(1, 16), label="deleted")]
        elif kind == "overwrite" and body:
            chunk = data.draw(st.binary(min_size=1, max_size=8), label="written")
            body[position:position + len(chunk)] = chunk
    attempt(target, bytes(body))
