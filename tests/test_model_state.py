"""The sync barrier's average (src.ps.state.aggregation.ModelState.average): the sample-weighted mean of the pushes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src.ps.state.aggregation import Contribution, ModelState


def _state() -> ModelState:
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    return ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("samples", [[64, 64], [64, 17], [3, 50, 9], [1, 2, 3, 4]])
def test_the_average_is_the_sample_weighted_mean_of_the_pushes(samples):
    state = _state()
    generator = torch.Generator().manual_seed(len(samples))
    pushes = [
        Contribution(worker, n, [torch.randn(p.shape, generator=generator) for p in state.params])
        for worker, n in enumerate(samples)
    ]
    for _ in range(2):  # the sums' buffers are reused from barrier to barrier
        gradients, buffers = state.average(pushes)
        for index, gradient in enumerate(gradients):
            expected = sum(c.gradients[index].double() * c.num_samples for c in pushes) / sum(samples)
            torch.testing.assert_close(gradient.double(), expected, rtol=1e-6, atol=1e-7)
        assert buffers == []
    assert all(not g.data_ptr() == c.data_ptr() for g in gradients for p in pushes for c in p.gradients)


def test_one_push_is_its_own_average():
    state = _state()
    push = Contribution(0, 5, [torch.randn(p.shape) for p in state.params])
    gradients, _ = state.average([push])
    assert all(g is c for g, c in zip(gradients, push.gradients))


def test_two_pushes_of_equal_samples_average_bit_for_bit_as_ddp_does():
    """DDP's allreduce sums the ranks' gradients and divides by the world size: the same bits."""
    state = _state()
    pushes = [Contribution(w, 64, [torch.randn(p.shape) for p in state.params]) for w in range(2)]
    gradients, _ = state.average(pushes)
    for index, gradient in enumerate(gradients):
        assert torch.equal(gradient, (pushes[0].gradients[index] + pushes[1].gradients[index]) / 2)
