"""The check and decode of a push's buffers against the served model's layout (``ModelLayout.decode``)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY
from src.ps.state.aggregation import ModelState
from src.ps.state.decoding import ModelLayout
from src.transport.errors import PushRefused
from src.transport.wire import Received


def _layout() -> tuple[ModelLayout, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 1, 5, 5))
    model.append(nn.BatchNorm1d(2))
    state = ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return ModelLayout(state), model


def _decode(layout: ModelLayout, model: nn.Module, buffers: list) -> list[torch.Tensor]:
    gradients = [memoryview(IDENTITY.compress(torch.zeros_like(p))) for p in model.parameters()]
    received = Received(pb.PushRequest(num_samples=4), {"gradients": gradients, "buffers": buffers})
    return layout.decode(0, received, owns_data=True).buffers


def _values(model: nn.Module) -> list[torch.Tensor]:
    return [torch.randn_like(b) for b in model.buffers() if b.is_floating_point()]


def test_the_buffers_come_back_with_their_shapes_and_values_from_any_offset():
    layout, model = _layout()
    values = _values(model)
    assert len(values) == 4  # two batch norms: running mean and variance each
    message = bytearray(b"\x07")  # odd offsets: the views of a received message need not be aligned
    spans = []
    for value in values:
        spans.append((len(message), value.numel() * 4))
        message += value.numpy().tobytes() + b"\x01"
    views = [memoryview(message)[start : start + size] for start, size in spans]
    for decoded in (_decode(layout, model, views), _decode(layout, model, [bytes(v) for v in views])):
        assert [tuple(d.shape) for d in decoded] == [tuple(v.shape) for v in values]
        for d, v in zip(decoded, values):
            assert torch.equal(d, v) and d.dtype == torch.float32
    message[spans[0][0]] ^= 0xFF  # the decoded buffers are the push's values, not views of its bytes
    assert torch.equal(decoded[0], values[0])


@pytest.mark.parametrize("index", [0, 2, 3])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_buffer_value_is_refused_naming_that_buffer(index, value):
    layout, model = _layout()
    values = _values(model)
    values[index].view(-1)[-1] = value
    with pytest.raises(PushRefused, match="holds NaN or Inf values") as refused:
        _decode(layout, model, [v.numpy().tobytes() for v in values])
    assert refused.value.message == f"buffer {layout.buffer_names[index]}: holds NaN or Inf values"


def test_a_buffer_of_the_wrong_size_or_count_is_refused_naming_it():
    layout, model = _layout()
    raw = [v.numpy().tobytes() for v in _values(model)]
    with pytest.raises(PushRefused, match=rf"buffer {layout.buffer_names[1]}: 8 bytes, expected 12"):
        _decode(layout, model, [raw[0], raw[1][:8], *raw[2:]])
    with pytest.raises(PushRefused, match="push carries 3 buffers, the model has 4"):
        _decode(layout, model, raw[:3])
    assert np.frombuffer(raw[0], dtype=np.float32).size == 3
