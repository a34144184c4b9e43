"""Provisional slices (``system.pipelined_replies``, :mod:`src.ps.state.slice_pipeline`), one component at a time.

A slice stepped before the barrier must be the barrier's step of it bit for bit, or be voided: its optimizer step
(:func:`~src.training.optimizers.stepped_slice`) is torch's SGD on fewer elements; the pipeline steps a slice once
every worker of the round has its values, and a reply leaves out only the tensors whose every slice the barrier's
step confirmed. A worker that drops out mid-push, or pushes other sample counts than it was handed, voids the
slices it touched. On the worker's side, the reply's head loads what it names from the slices that came, and a
head that names a slice that never came is a broken reply, not a silent gap.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.config import load_config
from src.ps.state.aggregation import Contribution, ModelState
from src.ps.state.slice_pipeline import SlicePipeline, slice_elements_of
from src.training.optimizers import apply_gradients, build_optimizer, stepped_slice
from src.transport.sinks import Sink
from src.transport.stream import PROVISIONAL_HEAD, PushStream
from src.transport.wire import Outgoing, serialize, split

SLICE = 64


class RecordingSink(Sink):
    def __init__(self):
        self.slices: list[tuple[int, int, int, torch.Tensor]] = []

    def send(self, version, index, start, values):
        self.slices.append((version, index, start, values.clone()))


def model_state(momentum: float = 0.9, **options) -> ModelState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 10), nn.Linear(10, 3))  # 200 + 10 + 30 + 3 values: several slices, a tail
    optimizer = build_optimizer(
        "sgd", model.parameters(), learning_rate=0.1, momentum=momentum, weight_decay=options.pop("wd", 0.0)
    )
    for group in optimizer.param_groups:
        group.update(options)
    return ModelState(model, optimizer)


def gradient_buffers(state: ModelState, seed: int) -> list[bytearray]:
    generator = torch.Generator().manual_seed(seed)
    return [bytearray(torch.randn(p.numel(), generator=generator).numpy().tobytes()) for p in state.params]


def contribution(state: ModelState, worker: int, buffers: list[bytearray], samples: int) -> Contribution:
    gradients = [torch.frombuffer(b, dtype=torch.float32).view_as(p) for b, p in zip(buffers, state.params)]
    return Contribution(worker=worker, num_samples=samples, gradients=gradients)


def barrier_step(state: ModelState, contributions: list[Contribution]) -> None:
    gradients, buffers = state.average(contributions)
    state.step(gradients, buffers)


@pytest.mark.parametrize(
    "options",
    [
        dict(momentum=0.9),
        dict(momentum=0.9, nesterov=True, wd=1e-3),
        dict(momentum=0.0),
        dict(momentum=0.9, dampening=0.1),
    ],
)
def test_a_stepped_slice_is_the_step_of_that_slice_bit_for_bit(options):
    momentum = options.pop("momentum")
    state = model_state(momentum, **options)
    for step in range(3):  # the first step starts the momentum buffers; later ones read them
        gradients = [torch.randn(p.shape) for p in state.params]
        predicted = [
            [
                stepped_slice(state.optimizer, p, g.reshape(-1)[a : a + SLICE], a, min(a + SLICE, p.numel()))
                for a in range(0, p.numel(), SLICE)
            ]
            for p, g in zip(state.params, gradients)
        ]
        apply_gradients(state.optimizer, state.params, gradients)
        for param, slices in zip(state.params, predicted):
            assert torch.equal(torch.cat(slices), param.detach().reshape(-1)), f"step {step}"


def test_a_slice_of_an_optimizer_it_cannot_predict_is_none():
    model = nn.Linear(4, 2)
    adam = build_optimizer("adam", model.parameters(), learning_rate=0.1, momentum=0.0, weight_decay=0.0)
    assert stepped_slice(adam, model.weight, torch.zeros(4), 0, 4) is None


def run_round(state, pipeline, sinks, pushes, *, chunk: int = 37):
    """Report each worker's buffers to the pipeline in pieces of ``chunk`` values, the workers taking turns."""
    for worker, sink in sinks.items():
        pipeline.attach(worker, sink)
    longest = max(p.numel() for p in state.params)
    for upto in range(chunk, longest + chunk, chunk):
        for worker, buffers in pushes.items():
            for index, (buffer, param) in enumerate(zip(buffers, state.params)):
                pipeline.arrived(sinks[worker], index, buffer, min(upto, param.numel()))


def test_every_slice_is_stepped_once_all_workers_have_it_and_confirmed_by_the_barrier():
    state = model_state()
    pipeline = SlicePipeline(state, SLICE)
    sinks = {0: RecordingSink(), 1: RecordingSink()}
    for version in range(3):
        pipeline.open_round(state.version, {0: 16, 1: 9})
        pushes = {w: gradient_buffers(state, 10 * version + w) for w in sinks}
        run_round(state, pipeline, sinks, pushes)
        slices_per_tensor = [-(-p.numel() // SLICE) for p in state.params]
        for sink in sinks.values():  # every slice once, to each worker, stamped with the round's version
            sent = [(index, start) for v, index, start, _ in sink.slices if v == state.version]
            assert sorted(sent) == sorted(
                (index, start) for index, n in enumerate(slices_per_tensor) for start in range(0, n * SLICE, SLICE)
            )
        stepped = {(index, start): values for v, index, start, values in sinks[0].slices if v == state.version}
        barrier_step(state, [contribution(state, w, pushes[w], n) for w, n in ((0, 16), (1, 9))])
        for (index, start), values in stepped.items():
            assert torch.equal(values, state.params[index].detach().reshape(-1)[start : start + len(values)])
        assert pipeline.omitted(sinks[0]) == list(range(len(state.params)))
        assert pipeline.omitted(RecordingSink()) == []  # a connection that was sent nothing holds nothing
    assert pipeline.counts["slices_voided"] == 0
    assert pipeline.counts["slices_confirmed"] == 3 * sum(slices_per_tensor)


def test_a_barrier_that_steps_something_else_voids_the_slices():
    state = model_state()
    pipeline = SlicePipeline(state, SLICE)
    sinks = {0: RecordingSink(), 1: RecordingSink()}
    pipeline.open_round(state.version, {0: 16, 1: 16})
    pushes = {w: gradient_buffers(state, w) for w in sinks}
    run_round(state, pipeline, sinks, pushes)
    # worker 1 failed after its parts: the barrier steps worker 0's push alone
    barrier_step(state, [contribution(state, 0, pushes[0], 16)])
    assert pipeline.omitted(sinks[0]) == []
    assert pipeline.counts["slices_confirmed"] == 0 and pipeline.counts["slices_voided"] > 0
    # the next round: worker 1 pushes 8 samples where it was handed 16 (its own work): voided again, nothing wrong
    pipeline.open_round(state.version, {0: 16, 1: 16})
    pushes = {w: gradient_buffers(state, 5 + w) for w in sinks}
    run_round(state, pipeline, sinks, pushes)
    barrier_step(state, [contribution(state, 0, pushes[0], 16), contribution(state, 1, pushes[1], 8)])
    assert pipeline.omitted(sinks[0]) == [] and pipeline.omitted(sinks[1]) == []


def test_a_slice_waits_for_the_slowest_worker_and_a_worker_outside_the_round_counts_for_nothing():
    state = model_state()
    pipeline = SlicePipeline(state, SLICE)
    sinks = {0: RecordingSink(), 1: RecordingSink(), 2: RecordingSink()}
    for worker, sink in sinks.items():
        pipeline.attach(worker, sink)
    pipeline.open_round(state.version, {0: 16, 1: 16})
    buffers = {w: gradient_buffers(state, w) for w in sinks}
    pipeline.arrived(sinks[0], 0, buffers[0][0], 200)
    pipeline.arrived(sinks[2], 0, buffers[2][0], 200)  # not in the round
    pipeline.arrived(sinks[1], 0, buffers[1][0], 100)  # one slice of worker 1's in, and part of the next
    assert [(index, start) for _, index, start, _ in sinks[0].slices] == [(0, 0)]
    assert sinks[2].slices == []
    pipeline.arrived(sinks[1], 0, buffers[1][0], 200)
    assert [(index, start) for _, index, start, _ in sinks[1].slices] == [(0, 0), (0, 64), (0, 128), (0, 192)]
    # a worker handed no samples (a skipped step: a library user's, or a follower's guess from one) is not waited
    # for, and weighs nothing: worker 0's values alone are the mean
    pipeline.open_round(state.version, {0: 16, 2: 0})
    pipeline.arrived(sinks[0], 0, buffers[0][0], 64)
    assert sinks[0].slices[-1][1:3] == (0, 0) and sinks[2].slices == []
    assert torch.equal(
        sinks[0].slices[-1][3],
        stepped_slice(
            state.optimizer, state.params[0], torch.frombuffer(buffers[0][0], dtype=torch.float32, count=64), 0, 64
        ),
    )


def test_slice_elements_are_whole_vectors():
    assert slice_elements_of(128 << 10) == 32768
    assert slice_elements_of(1000) == 192
    assert slice_elements_of(1) == 64


def reply_with(message: pb.PushReply, params: list[bytes]) -> bytes:
    return serialize(Outgoing(message, {"buffers": [], "parameters": params}))


def streamed_reply(stream: PushStream, data: bytes):
    splitter = stream.splitter(memoryview(bytearray(data)), pb.PushReply, ("parameters", "buffers"), len(data))
    splitter.advance(len(data))
    return splitter


def test_the_head_loads_the_provisional_tensors_it_names_and_the_rest_come_in_the_reply():
    loaded: dict[int, bytes] = {}
    stream = PushStream(lambda index: b"", lambda name, index, view: loaded.__setitem__(index, bytes(view)))
    stream.attempt()
    first = torch.arange(100, dtype=torch.float32)
    for start in (0, 64):  # two slices, the second first
        values = first[start : start + 64].numpy().tobytes()
        body = PROVISIONAL_HEAD.pack(4, 0, start) + values
        stream.provisional(body, 16 + len(body))
    stream.provisional(PROVISIONAL_HEAD.pack(4, 1, 0) + b"\0" * 8, 40)  # sent, but the head does not name it
    second = torch.ones(2).numpy().tobytes()
    splitter = streamed_reply(stream, reply_with(pb.PushReply(version=5, provisional=[0]), [b"", second]))
    assert stream.wait_head(1).version == 5
    assert loaded == {0: first.numpy().tobytes(), 1: second}
    # the slices' frames (as the transport counted them) count as received with the reply
    reply = reply_with(pb.PushReply(version=5, provisional=[0]), [b"", second])
    assert stream.reply_bytes == len(reply) + sum(16 + PROVISIONAL_HEAD.size + n for n in (256, 144, 8))
    assert split(bytes(splitter.view), pb.PushReply, ("parameters", "buffers")).message.provisional == [0]


def test_a_head_naming_a_slice_that_never_came_fails_the_attempt_and_the_next_one_starts_clean():
    stream = PushStream(lambda index: b"", lambda name, index, view: None)
    stream.attempt()
    stream.provisional(PROVISIONAL_HEAD.pack(4, 0, 64) + b"\0" * 16, 48)  # the slice at 0 never came
    streamed_reply(stream, reply_with(pb.PushReply(version=5, provisional=[0]), [b""]))
    assert "gap" in stream.problem and not stream.has_head  # the transport fails the attempt; it is sent again
    stream.attempt()
    assert stream.problem is None
    streamed_reply(stream, reply_with(pb.PushReply(version=5), [b"\0" * 4]))  # a retry's reply: whole
    assert stream.wait_head(1).version == 5


def test_pipelined_replies_name_what_they_need():
    base = {"system.transport": "tcp", "system.aggregation_mode": "sync", "system.pipelined_replies": True}
    assert load_config(overrides={**base, "system.streaming": True}).system.pipelined_replies
    tls = {"system.tls_cert_file": "server.pem", "system.tls_key_file": "server.key"}
    assert load_config(overrides={**base, **tls, "system.streaming": True, "system.transport": "grpc"})
    links = {"emulation.uplink_mbps": 40.0, "emulation.downlink_mbps": 40.0}
    assert load_config(overrides={**base, **links, "system.streaming": True, "system.clock": "virtual"})
    shards = {"system.streaming": True, "system.num_servers": 2}
    assert load_config(overrides={**base, **shards})  # over TCP
    assert load_config(overrides={**base, **shards, "system.transport": "grpc", "system.clock": "virtual"})
    for change, needs in [
        ({}, "needs system.streaming"),
        ({"system.streaming": True, **tls}, "not with TLS over system.transport tcp"),
        ({"system.streaming": True, "system.aggregation_mode": "async"}, "sync only"),
        ({**shards, "system.transport": "grpc"}, "with several shards, system.transport tcp only"),
        ({"system.streaming": True, **links}, "not with emulated links in real time"),
    ]:
        with pytest.raises(Exception, match=needs):
            load_config(overrides={**base, **change})
