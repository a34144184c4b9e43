"""The streamed worker's hooks (src/ps/worker/streaming.py) on a model, in one process.

Backward hands each gradient over as autograd produces it (reverse layer order); the next forward waits for a
module's tensors of the awaited reply only, takes the values the reply brought, and raises when that reply broke
off. (The whole streamed step against a server: tests/test_streaming.py.)
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from src.ps.worker.streaming import PushStreams, StreamedModel
from src.transport.stream import ReplyBroken
from src.transport.wire import tensor_to_bytes

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """What a push stream is handed (the indices, in order)."""

    def __init__(self):
        self.handed: list[int] = []

    def ready(self, index: int) -> None:
        self.handed.append(index)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.BatchNorm1d(3))


def test_backward_hands_every_gradient_over_once_in_reverse_layer_order_and_the_unused_after_it():
    net = model()
    params = list(net.parameters())
    unused = nn.Parameter(torch.zeros(2))  # a served parameter no forward touches: sent as zeros after backward
    streamed = StreamedModel(net, params + [unused], [])
    recorder = Recorder()
    streamed.begin_push(recorder)
    net(torch.randn(5, 4)).sum().backward()
    during = list(recorder.handed)
    streamed.end_backward()
    assert sorted(during) == list(range(len(params)))
    # autograd reaches the last layers first: the batch norm's and the second linear's before the first linear's
    assert during.index(4) < during.index(2) < during.index(0), during
    assert recorder.handed == during + [len(params)]
    streamed.close()


def test_a_gradient_cut_across_shards_goes_to_each_shard_holding_a_slice():
    streams = [Recorder(), Recorder()]
    shards = PushStreams(streams, [[(0, 0), (1, 0)], [(1, 1)]])
    shards.ready(0)
    shards.ready(1)
    assert streams[0].handed == [0] and streams[1].handed == [0, 1]


def _forward_in_thread(net: nn.Module, x: torch.Tensor):
    result: dict[str, object] = {}

    def run():
        try:
            with torch.no_grad():
                result["output"] = net(x)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_the_forward_waits_for_a_module_until_the_awaited_reply_brought_its_tensors_and_uses_them():
    net = model().eval()
    params, buffers = list(net.parameters()), [b for b in net.buffers() if b.is_floating_point()]
    streamed = StreamedModel(net, params, buffers)
    new = {i: torch.full_like(p, 0.01 * (i + 1)) for i, p in enumerate(params)}
    take = streamed.on_large(1)
    for index, buffer in enumerate(buffers):  # buffers first, as a reply carries them
        take("buffers", index, memoryview(tensor_to_bytes(buffer)))
    take("parameters", 0, memoryview(tensor_to_bytes(new[0])))
    take("parameters", 1, memoryview(tensor_to_bytes(new[1])))
    streamed.expect(1)
    thread, result = _forward_in_thread(net, torch.ones(2, 4))
    thread.join(0.5)
    assert thread.is_alive(), "the forward went past the second linear, whose parameters have not come"
    for index in range(2, len(params)):
        take("parameters", index, memoryview(tensor_to_bytes(new[index])))
    thread.join(10)
    assert not thread.is_alive() and "error" not in result, result
    for index, param in enumerate(params):
        assert torch.equal(param.detach(), new[index])
    expected = model().eval()
    with torch.no_grad():
        for param, value in zip(expected.parameters(), new.values()):
            param.copy_(value)
        assert torch.equal(result["output"], expected(torch.ones(2, 4)))
    assert streamed.waited_s > 0
    streamed.close()


def test_a_forward_waiting_on_a_reply_that_broke_off_raises_and_a_pull_lets_it_go_on():
    net = model().eval()
    streamed = StreamedModel(net, list(net.parameters()), [b for b in net.buffers() if b.is_floating_point()])
    streamed.expect(3)
    thread, result = _forward_in_thread(net, torch.ones(2, 4))
    thread.join(0.3)
    assert thread.is_alive()
    streamed.reply_broken(3, ConnectionError("connection lost"))
    thread.join(10)
    assert isinstance(result.get("error"), ReplyBroken) and "connection lost" in str(result["error"])
    streamed.loaded()  # the worker pulled the parameters itself
    with torch.no_grad():
        net(torch.ones(2, 4))
    streamed.close()
