"""One optimizer step with given gradients (src.training.optimizers.apply_gradients): torch's SGD update called
directly is ``optimizer.step()`` bit for bit; whatever it cannot take goes through ``step()``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src.ps.state.aggregation import ModelState
from src.training import optimizers
from src.training.optimizers import apply_gradients


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 3))


def _gradients(params, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


def _reference_step(optimizer, params, gradients) -> None:
    for param, gradient in zip(params, gradients):
        param.grad = gradient.clone()
    optimizer.step()


@pytest.mark.parametrize(
    "options",
    [
        {"momentum": 0.9, "fused": True},
        {"momentum": 0.9},
        {"momentum": 0.9, "foreach": True},
        {"momentum": 0.9, "weight_decay": 1e-3, "nesterov": True, "fused": True},
        {"momentum": 0.5, "dampening": 0.1, "maximize": True},
        {"momentum": 0.0, "fused": True},
    ],
)
def test_the_direct_update_is_step_bit_for_bit(options):
    ours, theirs = _model(), _model()
    our_params, their_params = list(ours.parameters()), list(theirs.parameters())
    our_optimizer = torch.optim.SGD(our_params, lr=0.05, **options)
    their_optimizer = torch.optim.SGD(their_params, lr=0.05, **options)
    for step in range(6):
        if step == 3:  # a rate change between steps (the schedule sets the group's lr) is taken
            for optimizer in (our_optimizer, their_optimizer):
                optimizer.param_groups[0]["lr"] = 0.02
        gradients = _gradients(our_params, step)
        apply_gradients(our_optimizer, our_params, gradients)
        _reference_step(their_optimizer, their_params, gradients)
    for mine, reference in zip(our_params, their_params):
        assert torch.equal(mine, reference)
        assert mine.grad is None  # no gradient outlives its step
    ours_state, theirs_state = our_optimizer.state_dict()["state"], their_optimizer.state_dict()["state"]
    assert ours_state.keys() == theirs_state.keys()
    for key in ours_state:
        assert torch.equal(ours_state[key]["momentum_buffer"], theirs_state[key]["momentum_buffer"])


def test_the_direct_update_is_taken_once_the_momentum_buffers_exist(monkeypatch):
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
    calls = []
    real_sgd = optimizers.sgd
    monkeypatch.setattr(optimizers, "sgd", lambda *a, **k: (calls.append(1), real_sgd(*a, **k)))
    apply_gradients(optimizer, params, _gradients(params, 0))
    assert calls == []  # the first step goes through step(), which creates the buffers
    apply_gradients(optimizer, params, _gradients(params, 1))
    assert calls == [1]


def test_hooks_and_other_optimizers_go_through_step():
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    apply_gradients(optimizer, params, _gradients(params, 0))
    seen = []
    handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
    apply_gradients(optimizer, params, _gradients(params, 1))
    handle.remove()
    assert seen == ["post"]

    ours, theirs = _model(), _model()
    our_params, their_params = list(ours.parameters()), list(theirs.parameters())
    our_adam, their_adam = torch.optim.Adam(our_params, lr=0.01), torch.optim.Adam(their_params, lr=0.01)
    for step in range(3):
        gradients = _gradients(our_params, step)
        apply_gradients(our_adam, our_params, gradients)
        _reference_step(their_adam, their_params, gradients)
    assert all(torch.equal(a, b) for a, b in zip(our_params, their_params))
    assert all(p.grad is None for p in our_params)


def test_the_server_step_reads_read_only_gradients_and_counts_the_version():
    model = _model()
    state = ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True))
    reference = _model()
    reference_params = list(reference.parameters())
    reference_optimizer = torch.optim.SGD(reference_params, lr=0.1, momentum=0.9, fused=True)
    for step in range(3):
        gradients = _gradients(state.params, step)
        frozen = [  # as a push's gradients are: read-only views of the received message
            torch.frombuffer(bytes(g.numpy().tobytes()), dtype=torch.float32).view(g.shape) for g in gradients
        ]
        state.step(frozen, [], weight=0.5)
        _reference_step(reference_optimizer, reference_params, [g * 0.5 for g in gradients])
    assert state.version == 3
    assert all(torch.equal(a, b) for a, b in zip(state.params, reference_params))


def test_several_parameter_groups_take_their_own_settings():
    ours, theirs = _model(), _model()

    def groups(model):
        first, second = list(model[0].parameters()), list(model[2].parameters())
        return [{"params": first, "lr": 0.1}, {"params": second, "lr": 0.01, "weight_decay": 1e-2}]

    our_optimizer = torch.optim.SGD(groups(ours), lr=0.05, momentum=0.9, fused=True)
    their_optimizer = torch.optim.SGD(groups(theirs), lr=0.05, momentum=0.9, fused=True)
    our_params, their_params = list(ours.parameters()), list(theirs.parameters())
    for step in range(4):
        gradients = _gradients(our_params, step)
        apply_gradients(our_optimizer, our_params, gradients)
        _reference_step(their_optimizer, their_params, gradients)
    assert all(torch.equal(a, b) for a, b in zip(our_params, their_params))
