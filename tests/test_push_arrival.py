"""A push decoded as it arrives (the TCP transport's path) is the push decoded once it is in.

The TCP server hands a push's bytes to :meth:`ParameterServer.push_splitter` as they arrive; each
identity gradient's values are checked finite piece by piece as they come in, each gradient is
decoded as soon as it is whole, and :meth:`handle_push` uses those results. These
tests drive one in-process server each way (no transport: the bytes are fed by hand, in pieces) and
compare what they apply and what they refuse.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY, build_compressor
from src.compressors.payload_format import HEADER_SIZE
from src.parameter_server import ParameterServer
from src.transport.errors import PushRefused
from src.transport.tcp_frames import new_body
from src.transport.wire import Outgoing, serialize, split
from tests.ps_fixtures import TOKEN, ps_config


class _Call:
    peer = "ipv4:127.0.0.1:1"
    framing_bytes = 0

    def is_active(self) -> bool:
        return True


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(20, 16), nn.ReLU(), nn.Linear(16, 4))


def _server(tmp_path, name: str, model: nn.Module) -> tuple[ParameterServer, pb.Caller, pb.PullReply]:
    server = ParameterServer(
        ps_config(tmp_path, name), token=TOKEN, model=model, evaluate=False, tensorboard=False, num_train_samples=64
    )
    registration = server.handle_register(pb.RegisterRequest(worker_id=0, pid=1), _Call.peer)
    caller = pb.Caller(worker_id=0, session=registration.session)
    pulled = server.handle_pull(pb.PullRequest(caller=caller), _Call())
    reply = split(bytes(pulled), pb.PullReply, ("parameters", "buffers")).message
    pulled.release()
    return server, caller, reply


def _push(caller: pb.Caller, reply: pb.PullReply, payloads: list) -> bytes:
    batches = reply.work.batches
    request = pb.PushRequest(
        caller=caller,
        base_version=reply.version,
        request_id=7,
        num_samples=sum(len(b.indices) for b in batches),
        batch_ids=[b.batch_id for b in batches],
    )
    return serialize(Outgoing(request, {"gradients": payloads, "buffers": []}))


def _arriving(server: ParameterServer, body: bytes, piece: int):
    """The splitter of ``body`` fed ``piece`` bytes at a time, as the TCP server feeds it."""
    splitter = server.push_splitter(new_body(len(body)))
    for start in range(0, len(body), piece):
        end = min(len(body), start + piece)
        splitter.view[start:end] = body[start:end]
        splitter.advance(end)
    return splitter


def _outcome(server: ParameterServer, push) -> str:
    try:
        reply = server.handle_push(push, _Call())
    except PushRefused as refused:
        return f"{refused.code}: {refused.message}"
    reply.release()
    return "applied"


@pytest.mark.parametrize("piece", [1, 97, 10**9])
def test_a_push_decoded_as_it_arrives_applies_what_the_whole_push_applies(tmp_path, piece):
    model = _model()
    whole, caller, reply = _server(tmp_path, "whole", copy.deepcopy(model))
    arriving, caller_2, reply_2 = _server(tmp_path, "arriving", copy.deepcopy(model))
    torch.manual_seed(5)
    gradients = [torch.randn_like(p) for p in model.parameters()]
    topk = build_compressor("topk", ratio=0.25)
    payloads = [(IDENTITY if k % 2 else topk).compress(g) for k, g in enumerate(gradients)]
    body, body_2 = _push(caller, reply, payloads), _push(caller_2, reply_2, payloads)
    splitter = _arriving(arriving, body_2, piece)
    received = splitter.finish()
    assert sorted(received.early) == [("gradients", k) for k in range(len(gradients))]  # all decoded on arrival
    assert all(isinstance(result, torch.Tensor) for _, result in received.early.values())
    assert _outcome(whole, body) == _outcome(arriving, splitter) == "applied"
    for a, b in zip(whole.state.params, arriving.state.params):
        assert torch.equal(a, b)
    whole.core.close()
    arriving.core.close()


@pytest.mark.parametrize(
    "damage",
    ["nan", "wrong_shape", "truncated_payload", "extra_gradient", "missing_gradient", "malformed_message"],
)
def test_a_bad_push_decoded_as_it_arrives_is_refused_as_the_whole_push_is(tmp_path, damage):
    model = _model()
    whole, caller, reply = _server(tmp_path, "whole", copy.deepcopy(model))
    arriving, caller_2, reply_2 = _server(tmp_path, "arriving", copy.deepcopy(model))
    payloads = [IDENTITY.compress(torch.zeros_like(p)) for p in model.parameters()]
    if damage == "nan":
        payloads[2] = IDENTITY.compress(torch.full_like(next(iter(model[2].parameters())), 0.0))
        broken = bytearray(payloads[2])
        broken[-4:] = torch.tensor([math.nan]).numpy().tobytes()
        payloads[2] = bytes(broken)
    elif damage == "wrong_shape":
        payloads[1] = IDENTITY.compress(torch.zeros(3))
    elif damage == "truncated_payload":
        payloads[0] = payloads[0][:-8]
    elif damage == "extra_gradient":
        payloads.append(IDENTITY.compress(torch.zeros(2)))
    elif damage == "missing_gradient":
        payloads.pop()
    body, body_2 = _push(caller, reply, payloads), _push(caller_2, reply_2, payloads)
    if damage == "malformed_message":
        body, body_2 = body[:-3], body_2[:-3]
    refused = _outcome(whole, body)
    assert refused.startswith("INVALID_ARGUMENT: ")
    assert _outcome(arriving, _arriving(arriving, body_2, 53)) == refused
    whole.core.close()
    arriving.core.close()


def _recording_checks(monkeypatch, piece_bytes: int) -> list[int]:
    """Check arriving values in pieces of ``piece_bytes``; the number of values of every finiteness check."""
    import src.compressors.base as compressor_base
    import src.ps.state.decoding as push_decode

    checks: list[int] = []
    real = push_decode.all_finite

    def recorded(values):
        checks.append(len(values))
        return real(values)

    monkeypatch.setattr(push_decode, "FINITE_CHECK_PIECE_BYTES", piece_bytes)
    monkeypatch.setattr(push_decode, "all_finite", recorded)
    monkeypatch.setattr(compressor_base, "all_finite", recorded)  # decompress's identity view
    return checks


def test_an_identity_gradient_is_checked_in_pieces_as_it_arrives_and_once_in_all(tmp_path, monkeypatch):
    """Its values are checked in pieces of at least the piece size while the push comes in, the decode of
    the whole gradient checks only what is left, and the push applies what the whole push applies."""
    model = _model()
    whole, caller, reply = _server(tmp_path, "whole", copy.deepcopy(model))
    arriving, caller_2, reply_2 = _server(tmp_path, "arriving", copy.deepcopy(model))
    torch.manual_seed(6)
    gradients = [torch.randn_like(p) for p in model.parameters()]
    payloads = [IDENTITY.compress(g) for g in gradients]
    body, body_2 = _push(caller, reply, payloads), _push(caller_2, reply_2, payloads)
    checks = _recording_checks(monkeypatch, 256)  # 64 values: the 320 of the first weight come in 5+ pieces
    splitter = _arriving(arriving, body_2, 97)
    numel = [g.numel() for g in gradients]
    assert sum(checks) == sum(numel)  # every value checked once, none twice
    assert len(checks) >= len(gradients) + 3  # the first weight's in pieces of >= 64 values as it came in
    assert _outcome(whole, body) == _outcome(arriving, splitter) == "applied"
    for a, b in zip(whole.state.params, arriving.state.params):
        assert torch.equal(a, b)
    whole.core.close()
    arriving.core.close()


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_found_as_it_arrives_is_refused_as_the_whole_push_is(tmp_path, monkeypatch, where, value):
    """Wherever the bad value is (in a piece checked on the way, or in the rest checked once the gradient
    is in), the push is refused with the whole push's reason and nothing is applied."""
    model = _model()
    whole, caller, reply = _server(tmp_path, "whole", copy.deepcopy(model))
    arriving, caller_2, reply_2 = _server(tmp_path, "arriving", copy.deepcopy(model))
    before = [p.detach().clone() for p in arriving.state.params]
    payloads = [IDENTITY.compress(torch.zeros_like(p)) for p in model.parameters()]
    broken, position = bytearray(payloads[0]), HEADER_SIZE + 4 * {"first": 0, "middle": 170, "last": 319}[where]
    broken[position : position + 4] = torch.tensor([value]).numpy().tobytes()  # compress refuses to write it
    payloads[0] = bytes(broken)
    body, body_2 = _push(caller, reply, payloads), _push(caller_2, reply_2, payloads)
    refused = _outcome(whole, body)
    assert refused.startswith("INVALID_ARGUMENT: gradient 0 (0.weight): ") and "NaN/Inf" in refused
    checks = _recording_checks(monkeypatch, 256)
    assert _outcome(arriving, _arriving(arriving, body_2, 97)) == refused
    assert len(checks) >= 2  # pieces were checked while it arrived
    for a, b in zip(before, arriving.state.params):
        assert torch.equal(a, b)
    whole.core.close()
    arriving.core.close()


def test_decompress_checks_only_the_values_after_those_the_caller_checked():
    """``finite_values`` is the caller's word for the leading values; the rest are checked as ever."""
    from src.compression import decompress

    broken = bytearray(IDENTITY.compress(torch.zeros(10)))
    broken[HEADER_SIZE + 8 : HEADER_SIZE + 12] = torch.tensor([math.nan]).numpy().tobytes()  # value 2
    payload = bytes(broken)
    with pytest.raises(ValueError, match="NaN/Inf"):
        decompress(payload, copy=False)
    with pytest.raises(ValueError, match="NaN/Inf"):
        decompress(payload, copy=False, finite_values=2)
    assert decompress(payload, copy=False, finite_values=3).shape == (10,)  # taken on the caller's word
    assert decompress(payload, copy=False, finite_values=10).shape == (10,)
