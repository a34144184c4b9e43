"""A shard's part of the model (src/ps/shards/parts.py): the parts put back together are the model, and the
server's steps on the parts are its steps on the whole model, to float32 rounding (sync with S shards is sync with
one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from src.config import Config
from src.ps.shards.parts import model_placement, shard_module, trainable, whole_state
from src.ps.state.aggregation import Contribution, ModelState
from src.ps.state.staleness import server_optimizer
from src.ps.worker.codec import shard_gradients


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 32), nn.Linear(32, 10)
    )


# 2 KB slices: the 36 KB first linear layer is cut into 18 pieces, the conv weight (288 B) travels whole.
SLICE_BYTES = 2048


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_the_parts_are_named_by_slice_and_put_back_together_are_the_model(shards):
    model = _model()
    model[1].running_mean.uniform_()  # buffers that differ from their initial values
    model[1].num_batches_tracked += 3
    placement = model_placement(model, shards, SLICE_BYTES)
    parts = [shard_module(model, placement, k) for k in range(shards)]
    for k, part in enumerate(parts):
        assert [name for name, _ in part.named_parameters()] == [s.key for s in placement.on_shard(k)]
        assert all(p.dim() == 1 for p in part.parameters())
        assert {name for name, _ in part.named_buffers()} == (
            {n for n, _ in model.named_buffers()} if k == 0 else set()
        )
    assert sum(p.numel() for part in parts for p in part.parameters()) == sum(p.numel() for p in model.parameters())
    whole = whole_state(model, placement, [part.state_dict() for part in parts])
    expected = model.state_dict()
    assert list(whole) == list(expected)
    assert all(torch.equal(whole[name], expected[name]) and whole[name].shape == expected[name].shape for name in whole)


def test_the_parts_are_copies_and_a_missing_slice_is_named():
    model = _model()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    placement = model_placement(model, 2, SLICE_BYTES)
    with torch.no_grad():
        for k in range(2):
            for param in shard_module(model, placement, k).parameters():
                param.add_(1.0)
    assert all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    states = [shard_module(model, placement, k).state_dict() for k in range(2)]
    del states[1][placement.on_shard(1)[0].key]
    with pytest.raises(KeyError, match="slices missing"):
        whole_state(model, placement, states)
    with pytest.raises(ValueError, match="3 shard states for a placement over 2 shards"):
        whole_state(model, placement, states + [{}])


def _config(optimizer: str, mode: str, correction: str = "none") -> Config:
    config = Config()
    training = config.training.model_copy(update={"optimizer": optimizer, "weight_decay": 1e-3})
    system = config.system.model_copy(
        update={"aggregation_mode": mode, "async_correction": correction, "num_workers": 3}
    )
    return config.model_copy(update={"training": training, "system": system})


def _pushes(state: ModelState, round_: int, workers: int) -> list[Contribution]:
    """Each worker's gradient and buffer values for one round (seeded by round and worker)."""
    pushes = []
    for worker in range(workers):
        generator = torch.Generator().manual_seed(100 * round_ + worker)
        gradients = [torch.randn(p.shape, generator=generator) for p in state.params]
        buffers = [torch.rand(b.shape, generator=generator) for b in state.buffers]
        pushes.append(Contribution(worker, 32 + 7 * worker, gradients, buffers))
    return pushes


def _on_shard(push: Contribution, whole: ModelState, part: ModelState, placement, shard: int) -> Contribution:
    """The shard's share of a whole-model push: its slices of the gradients, and the buffers by name."""
    named = zip(whole.param_names, push.gradients)
    gradients = [elements for _, elements in shard_gradients(placement, named)[shard]]
    by_name = dict(zip(whole.buffer_names, push.buffers))
    return Contribution(push.worker, push.num_samples, gradients, [by_name[n] for n in part.buffer_names])


@pytest.mark.parametrize(
    "optimizer, mode, correction",
    [
        ("sgd", "sync", "none"),
        ("adam", "sync", "none"),
        ("sgd", "async", "lookahead"),
        ("sgd", "async", "implicit_momentum"),
        ("adam", "async", "none"),
    ],
)
@pytest.mark.parametrize("shards", [2, 3])
def test_the_servers_steps_on_the_parts_are_its_steps_on_the_whole_model(optimizer, mode, correction, shards):
    """Sync: the barrier's sample-weighted average, then one step, per round. Async: each push applied on
    arrival with a staleness weight (and, with lookahead, the pushing worker's own momentum)."""
    config = _config(optimizer, mode, correction)
    model = _model()
    placement = model_placement(model, shards, SLICE_BYTES)
    parts = [shard_module(model, placement, k) for k in range(shards)]
    whole = ModelState(model, server_optimizer(config, [p for _, p in trainable(model)]))
    states = [ModelState(part, server_optimizer(config, part.parameters())) for part in parts]
    for round_ in range(4):
        pushes = _pushes(whole, round_, workers=3)
        for state in [whole, *states]:
            mine = (
                pushes
                if state is whole
                else [_on_shard(p, whole, state, placement, states.index(state)) for p in pushes]
            )
            if mode == "sync":
                state.step(*state.average(mine))
            else:
                for push in mine:
                    state.step(push.gradients, push.buffers, weight=1.0 / (1 + push.worker), worker=push.worker)
    assert {state.version for state in states} == {whole.version}
    assembled = whole_state(model, placement, [part.state_dict() for part in parts])
    for name, value in model.state_dict().items():
        close(assembled[name], value, name)
    for k, state in enumerate(states):  # and what each shard sends is the whole model's, sliced
        sent = dict(zip(whole.param_names, whole.sent()))
        for piece, mine in zip(placement.on_shard(k), state.sent()):
            close(mine, sent[piece.name].reshape(-1)[piece.start : piece.stop], piece.key)


def close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal to float32 rounding: a cut can move an element between torch's vectorized loop and its scalar tail
    (fused multiply-add in one only): a unit in the last place or two (tests/test_shard_rounds.py measures it)."""
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, msg=name)
