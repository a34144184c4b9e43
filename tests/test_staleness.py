"""Contract tests of src/ps/state/staleness.py: policy verdicts follow the formulas; LookaheadMomentum equals
torch's SGD with one worker and synchronous momentum SGD on the mean gradient with N workers.

Tolerances: verdict weights are exact formulas (1e-12); optimizer trajectories are float32 sums in a
different order than torch's, so they agree to 1e-6 relative / 1e-7 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch

from src.config import validate_config
from src.ps.state.staleness import (
    LookaheadMomentum,
    StalenessPolicy,
    compensated_momentum,
    implicit_momentum,
    lookahead_stability_limit,
    lookahead_step_scale,
)

RTOL, ATOL = 1e-6, 1e-7


# ----------------------------------------------------------------------------- policy verdicts


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0, 3.0])
@pytest.mark.parametrize("tau", [0, 1, 2, 7, 100])
def test_soft_weight_is_one_over_one_plus_beta_tau(beta, tau):
    weight, reason = StalenessPolicy("soft", beta=beta).verdict(tau)
    assert weight == pytest.approx(1.0 / (1.0 + beta * tau), rel=1e-12)
    assert f"staleness {tau}" in reason


@pytest.mark.parametrize("max_staleness", [0, 1, 4, 8])
def test_hard_bound_rejects_exactly_above_max_staleness(max_staleness):
    policy = StalenessPolicy("hard", max_staleness=max_staleness)
    for tau in range(0, max_staleness + 5):
        weight, reason = policy.verdict(tau)
        if tau > max_staleness:
            assert weight is None and reason == f"staleness {tau} > max_staleness {max_staleness}"
        else:
            assert weight == 1.0


def test_both_bounds_then_attenuates():
    policy = StalenessPolicy("both", beta=0.5, max_staleness=3)
    for tau in range(4):
        assert policy.verdict(tau)[0] == pytest.approx(1.0 / (1.0 + 0.5 * tau), rel=1e-12)
    for tau in (4, 5, 50):
        assert policy.verdict(tau)[0] is None


def test_none_accepts_every_push_at_full_weight():
    policy = StalenessPolicy("none", beta=2.0, max_staleness=0)
    assert all(policy.verdict(tau)[0] == 1.0 for tau in range(20))


def test_policy_from_config_and_new_bound():
    system = validate_config(
        {"system": {"staleness_policy": "both", "staleness_beta": 0.25, "max_staleness": 2}}
    ).system
    policy = StalenessPolicy.from_config(system)
    assert policy == StalenessPolicy("both", beta=0.25, max_staleness=2)
    assert policy.verdict(3)[0] is None
    looser = policy.with_max_staleness(5)
    assert looser.verdict(3)[0] == pytest.approx(1 / 1.75) and policy.max_staleness == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="sometimes"), "staleness policy must be one of"),
        (dict(kind="soft", beta=-0.1), "beta must be a finite number >= 0"),
        (dict(kind="soft", beta=math.nan), "beta must be a finite number >= 0"),
        (dict(kind="hard", max_staleness=-1), "max_staleness must be an int >= 0"),
    ],
)
def test_bad_policy_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StalenessPolicy(**kwargs)


@pytest.mark.parametrize("tau", [-1, 1.5, True])
def test_bad_staleness_is_refused(tau):
    with pytest.raises(ValueError, match="staleness must be an int >= 0"):
        StalenessPolicy("soft").verdict(tau)


def test_implicit_and_compensated_momentum():
    assert [implicit_momentum(n) for n in (1, 2, 4, 10)] == pytest.approx([0.0, 0.5, 0.75, 0.9])
    assert compensated_momentum(0.9, 2) == pytest.approx(0.4)
    assert compensated_momentum(0.9, 4) == pytest.approx(0.15)
    assert compensated_momentum(0.5, 4) == 0.0
    with pytest.raises(ValueError):
        implicit_momentum(0)


# ----------------------------------------------------------------------------- LookaheadMomentum


def _gradients(steps: int, shapes, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in shapes] for _ in range(steps)]


SHAPES = [(3, 4), (5,)]


def _params(seed: int = 1) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in SHAPES]


def _apply(optimizer, params, gradients, **step_kwargs) -> None:
    for param, gradient in zip(params, gradients):
        param.grad = gradient.clone()
    optimizer.step(**step_kwargs)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_one_worker_is_torch_sgd(weight_decay):
    reference, ours = _params(), _params()
    sgd = torch.optim.SGD(reference, lr=0.05, momentum=0.9, weight_decay=weight_decay)
    lookahead = LookaheadMomentum(ours, num_workers=1, lr=0.05, momentum=0.9, weight_decay=weight_decay)
    for gradients in _gradients(12, SHAPES):
        _apply(sgd, reference, gradients)
        _apply(lookahead, ours, gradients, worker=0)
        for expected, actual in zip(reference, ours):
            torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("num_workers", [2, 3, 4])
def test_one_push_per_worker_is_a_sync_momentum_step_on_the_mean_gradient(num_workers):
    """N pushes (one per worker, any order) == torch SGD on the mean of their gradients, same lr and momentum."""
    reference, ours = _params(), _params()
    sgd = torch.optim.SGD(reference, lr=0.05, momentum=0.9)
    lookahead = LookaheadMomentum(ours, num_workers=num_workers, lr=0.05, momentum=0.9, step_scale=1.0)
    rounds = 6
    pushes = _gradients(rounds * num_workers, SHAPES)
    order = torch.Generator().manual_seed(3)
    for r in range(rounds):
        batch = pushes[r * num_workers : (r + 1) * num_workers]
        mean = [torch.stack(parts).mean(dim=0) for parts in zip(*batch)]
        _apply(sgd, reference, mean)
        for worker in torch.randperm(num_workers, generator=order).tolist():
            _apply(lookahead, ours, batch[worker], worker=worker)
        for expected, actual in zip(reference, ours):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_the_comparison_above_can_fail():
    """Plain SGD with the same lr applied per push is not the sync step: the contract test can tell."""
    reference, plain = _params(), _params()
    sgd = torch.optim.SGD(reference, lr=0.05, momentum=0.9)
    per_push = torch.optim.SGD(plain, lr=0.05, momentum=0.9)
    pushes = _gradients(4, SHAPES)
    for r in range(2):
        batch = pushes[2 * r : 2 * r + 2]
        _apply(sgd, reference, [torch.stack(parts).mean(dim=0) for parts in zip(*batch)])
        for gradients in batch:
            _apply(per_push, plain, gradients)
    with pytest.raises(AssertionError):
        for expected, actual in zip(reference, plain):
            torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_lookahead_is_params_minus_pending_momentum():
    params = _params()
    optimizer = LookaheadMomentum(params, num_workers=3, lr=0.1, momentum=0.8)
    assert all(torch.equal(a, p) for a, p in zip(optimizer.lookahead(), params))  # no momentum yet
    pushes = _gradients(5, SHAPES)
    for index, gradients in enumerate(pushes):
        _apply(optimizer, params, gradients, worker=index % 3)
    scale = optimizer.param_groups[0]["step_scale"]
    assert scale == pytest.approx(lookahead_step_scale(0.8, 3))
    for param, ahead in zip(params, optimizer.lookahead()):
        buffers = optimizer.state[param]["momentum_buffers"]
        expected = param.detach() - scale * (0.1 / 3) * 0.8 * buffers.sum(dim=0)
        torch.testing.assert_close(ahead, expected, rtol=RTOL, atol=ATOL)
    out = [torch.empty_like(p) for p in params]
    assert optimizer.lookahead(out=out) is out


def test_one_worker_lookahead_follows_nesterov_sgd():
    """With one worker the lookahead points are torch's Nesterov SGD iterates (gradients taken there)."""
    target = torch.tensor([1.0, -2.0, 0.5])
    curvature = torch.tensor([3.0, 0.5, 1.0])
    ours = [torch.nn.Parameter(torch.zeros(3))]
    nesterov = [torch.nn.Parameter(torch.zeros(3))]
    lookahead = LookaheadMomentum(ours, num_workers=1, lr=0.1, momentum=0.9)
    reference = torch.optim.SGD(nesterov, lr=0.1, momentum=0.9, nesterov=True)
    for _ in range(20):
        point = lookahead.lookahead()[0]
        _apply(lookahead, ours, [curvature * (point - target)], worker=0)
        _apply(reference, nesterov, [curvature * (nesterov[0].detach() - target)])
        torch.testing.assert_close(lookahead.lookahead()[0], nesterov[0].detach(), rtol=1e-5, atol=1e-6)


def test_forget_worker_drops_its_momentum_from_the_lookahead():
    params = _params()
    optimizer = LookaheadMomentum(params, num_workers=2, lr=0.1, momentum=0.9, step_scale=1.0)
    pushes = _gradients(4, SHAPES)
    for index, gradients in enumerate(pushes):
        _apply(optimizer, params, gradients, worker=index % 2)
    optimizer.forget_worker(1)
    for param, ahead in zip(params, optimizer.lookahead()):
        state = optimizer.state[param]
        assert torch.count_nonzero(state["momentum_buffers"][1]) == 0
        torch.testing.assert_close(
            ahead, param.detach() - 0.05 * 0.9 * state["momentum_buffers"][0], rtol=RTOL, atol=ATOL
        )


def test_state_dict_resumes_the_same_trajectory(tmp_path):
    first, second = _params(), _params()
    original = LookaheadMomentum(first, num_workers=2, lr=0.05, momentum=0.9, weight_decay=1e-3)
    pushes = _gradients(10, SHAPES)
    for index, gradients in enumerate(pushes[:5]):
        _apply(original, first, gradients, worker=index % 2)
    path = tmp_path / "state.pt"
    torch.save({"params": [p.detach() for p in first], "optimizer": original.state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    with torch.no_grad():
        for param, value in zip(second, saved["params"]):
            param.copy_(value)
    resumed = LookaheadMomentum(second, num_workers=2, lr=0.05, momentum=0.9, weight_decay=1e-3)
    resumed.load_state_dict(saved["optimizer"])
    for index, gradients in enumerate(pushes[5:], start=5):
        _apply(original, first, gradients, worker=index % 2)
        _apply(resumed, second, gradients, worker=index % 2)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_from_config_reads_the_run():
    config = validate_config(
        {
            "training": {"learning_rate": 0.02, "momentum": 0.8, "weight_decay": 0.001},
            "system": {"num_workers": 4, "aggregation_mode": "async"},
        }
    )
    optimizer = LookaheadMomentum.from_config(config, _params())
    group = optimizer.param_groups[0]
    assert (optimizer.num_workers, group["lr"], group["momentum"], group["weight_decay"]) == (4, 0.02, 0.8, 0.001)
    assert group["step_scale"] == pytest.approx(lookahead_step_scale(0.8, 4))
    config = validate_config({"system": {"num_workers": 4, "async_step_scale": 1.0}})
    assert LookaheadMomentum.from_config(config, _params()).param_groups[0]["step_scale"] == 1.0


# ----------------------------------------------------------------------------- the stability model


def test_stability_limit_with_one_worker_is_nesterovs():
    for momentum in (0.0, 0.5, 0.9):
        assert lookahead_stability_limit(momentum, 1) == pytest.approx(
            2 * (1 + momentum) / (1 + 2 * momentum), rel=1e-6
        )


def test_stability_limit_falls_with_workers_and_the_scale_follows():
    limits = [lookahead_stability_limit(0.9, n) for n in (1, 2, 4, 8, 32)]
    assert limits == pytest.approx([1.357, 1.119, 0.881, 0.777, 0.706], abs=2e-3)
    assert lookahead_stability_limit(0.9, 1000) == lookahead_stability_limit(0.9, 32)
    assert [lookahead_step_scale(0.9, n) for n in (1, 2, 4, 8)] == pytest.approx([1.0, 0.825, 0.649, 0.572], abs=2e-3)


@pytest.mark.parametrize("num_workers", [2, 4])
def test_the_optimizer_converges_below_the_limit_and_diverges_above(num_workers):
    """LookaheadMomentum itself, driven round robin on lam/2 x^2 with gradients at the pulled lookahead."""

    def final_size(factor: float) -> float:
        curvature = factor * lookahead_stability_limit(0.9, num_workers)  # lr = 1
        x = torch.nn.Parameter(torch.ones(1, dtype=torch.float64))
        optimizer = LookaheadMomentum([x], num_workers=num_workers, lr=1.0, momentum=0.9, step_scale=1.0)
        pulled = [x.detach().clone() for _ in range(num_workers)]
        for push in range(400 * num_workers):
            worker = push % num_workers
            x.grad = curvature * pulled[worker]
            optimizer.step(worker=worker)
            pulled[worker] = optimizer.lookahead()[0].clone()
        return float(x.detach().abs())

    assert final_size(0.9) < 1e-2
    assert final_size(1.1) > 1e2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_workers=0, lr=0.1), "num_workers must be an int >= 1"),
        (dict(num_workers=2, lr=0.0), "lr must be a finite number > 0"),
        (dict(num_workers=2, lr=0.1, momentum=1.0), r"momentum must be in \[0, 1\)"),
        (dict(num_workers=2, lr=0.1, weight_decay=-1.0), "weight_decay must be a finite number >= 0"),
        (dict(num_workers=2, lr=0.1, step_scale=0.0), "step_scale must be a finite number > 0"),
    ],
)
def test_bad_optimizer_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LookaheadMomentum(_params(), **kwargs)


def test_push_from_an_unknown_worker_is_refused():
    params = _params()
    optimizer = LookaheadMomentum(params, num_workers=2, lr=0.1)
    with pytest.raises(ValueError, match="worker must be in 0..1"):
        _apply(optimizer, params, _gradients(1, SHAPES)[0], worker=2)


# ----------------------------------------------------------------------------- the parameter server's use of them


@pytest.mark.timeout(120)
def test_server_applies_the_policy_and_pulls_the_lookahead(tmp_path):
    """An in-process async server with a hard bound of 0: a stale push is turned away with its reason,
    and replies carry the lookahead point while the server's model stays at ``params``."""
    from tests.ps_fixtures import ServedServer, identity_gradients, ps_config

    config = ps_config(
        tmp_path,
        system__num_workers=2,
        system__staleness_policy="hard",
        system__max_staleness=0,
        training__momentum=0.9,
        training__max_train_samples=256,
    )  # work left for every reply
    served = ServedServer(config, evaluate=False)
    zero, one = served.worker(0), served.worker(1)
    try:
        server = served.server
        assert isinstance(server.state.optimizer, LookaheadMomentum)
        start = [p.detach().clone() for p in server.state.params]
        gradients = identity_gradients(server, value=1.0)
        first = zero.push(zero.request(gradients=gradients))
        stale = one.push(one.request(gradients=gradients))  # computed on version 0, the server is at 1
        assert first.message.accepted and first.message.version == 1
        assert not stale.message.accepted and stale.message.staleness == 1 and stale.message.version == 1
        assert "staleness 1 > max_staleness 0" in stale.message.reason
        # the rejected batch stays with worker 1 and is listed again (with new work) in its next push
        fresh = one.push(one.request(gradients=gradients))
        assert fresh.message.accepted and fresh.message.version == 2 and server.counters["pushes_rejected"] == 1
        # both workers pushed a gradient of ones once: each buffer is ones, the params moved by 2 * s * lr/2 * 1
        lr, momentum = config.training.learning_rate, config.training.momentum
        step = lookahead_step_scale(momentum, 2) * lr / 2
        for param, begin, data in zip(server.state.params, start, fresh.large["parameters"]):
            torch.testing.assert_close(param.detach(), begin - 2 * step, rtol=RTOL, atol=1e-6)
            sent = torch.frombuffer(bytearray(data), dtype=torch.float32).view(param.shape)
            torch.testing.assert_close(sent, begin - 2 * step - step * momentum * 2, rtol=RTOL, atol=1e-6)
    finally:
        zero.close()
        one.close()
        served.close()


@pytest.mark.timeout(120)
def test_server_soft_weight_and_plain_optimizer_without_correction(tmp_path):
    """``async_correction: none`` keeps torch's SGD; a soft weight scales the push's gradient."""
    from tests.ps_fixtures import ServedServer, identity_gradients, ps_config

    config = ps_config(
        tmp_path,
        system__num_workers=2,
        system__async_correction="none",
        system__staleness_policy="soft",
        system__staleness_beta=1.0,
        training__momentum=0.0,
    )
    served = ServedServer(config, evaluate=False)
    zero, one = served.worker(0), served.worker(1)
    try:
        server = served.server
        assert isinstance(server.state.optimizer, torch.optim.SGD)
        before = [p.detach().clone() for p in server.state.params]
        gradients = identity_gradients(server, value=1.0)
        zero.push(zero.request(gradients=gradients))
        stale = one.push(one.request(gradients=gradients))
        assert stale.message.accepted and stale.message.staleness == 1 and stale.message.weight == 0.5
        lr = config.training.learning_rate
        for param, begin in zip(server.state.params, before):  # weight 1 then 1/(1+1*1) = 0.5
            torch.testing.assert_close(param.detach(), begin - 1.5 * lr, rtol=RTOL, atol=1e-6)
    finally:
        zero.close()
        one.close()
        served.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("compression", ["topk", "none"])
def test_over_a_whole_run_computed_gradients_are_applied_or_still_in_the_residuals(tmp_path, compression):
    """Server and worker processes, a hard bound of 0 that turns most pushes away: every gradient a worker
    computed was applied by the server or waits in its residual (Residual Rollback, also without
    compression), and every sample counts once."""
    from src.launch.ps import run_local
    from tests.ps_fixtures import ps_config

    config = ps_config(
        tmp_path,
        system__num_workers=2,
        system__staleness_policy="hard",
        system__max_staleness=0,
        system__compression_enabled=compression != "none",
        system__compression_type="topk",
        system__compression_ratio=0.05,
        system__gradient_ledger=True,
        training__max_train_samples=512,
        training__batch_size=16,
        # 0.25 s per step: one worker alone would take 8 s, so the other (whose process may
        # start seconds later) shares the run and pushes interleave (staleness >= 1)
        emulation__step_delay_s=0.25,
    )
    summary = run_local(config)
    assert summary["pushes_rejected"] > 0 and summary["samples_processed"] == 512
    logs = tmp_path / "run" / "logs"
    applied = torch.load(logs / "server" / "gradient_ledger.pt")["applied"]
    workers = [torch.load(logs / f"worker_{k}" / "gradient_ledger.pt") for k in range(2)]
    for name, total in applied.items():
        computed = sum(w["computed"][name] for w in workers)
        residuals = sum(w["residuals"][name] for w in workers)
        assert computed.abs().sum() > 0
        torch.testing.assert_close(
            applied[name] + residuals, computed, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}"
        )
    if compression == "none":  # identity payloads leave nothing behind; the last flush applied what rejections held
        assert all(w["residuals"][n].abs().sum() == 0 for w in workers for n in applied)


SPECS_ASYNC_COMMAND = (
    "--dataset mnist_5k --num-epochs 2 --compression-enabled --compression-type topk --compression-ratio 0.1".split()
)
"""The spec's async command without its worker count and mode (momentum and the correction at their defaults)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_specs_async_command_trains_near_sync(tmp_path):
    """The spec's async command as written (momentum 0.9 by default), against the same command in sync
    mode: mnist_5k's held-out 1,000 after 2 epochs (docs/async.md, section 4). Async runs depend on
    timing (which push lands first), so the bar is on the mean of two runs; sync is deterministic."""
    import json

    from tests.ps_fixtures import run_cli

    command = ["--workers", "2", *SPECS_ASYNC_COMMAND]
    accuracy = {"sync": [], "async": []}
    for mode in ("sync", "async", "async"):
        folder = tmp_path / f"{mode}{len(accuracy[mode])}"
        folder.mkdir()
        result = run_cli([*command, "--aggregation-mode", mode], cwd=folder, timeout=420)
        assert result.returncode == 0, result.stderr[-3000:]
        accuracy[mode].append(json.loads((folder / "logs" / "ps_cli" / "summary.json").read_text())["final_accuracy"])
    assert sum(accuracy["async"]) / 2 >= accuracy["sync"][0] - 0.02, accuracy


VIRTUAL_COSTS = "--clock virtual --compute-s 0.02 --compress-s 0.001 --server-update-s 0.002 --server-reply-s 0.001"
"""The virtual clock and a cost model of this machine's order (scripts/calibrate.py; README's virtual example)."""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_specs_async_command_with_4_workers_trains_as_well_as_sync_over_seeds_on_the_virtual_clock(
    tmp_path, monkeypatch
):
    """4 workers: at the spec's settings sync itself is on the edge of stability (one seed in five
    diverges, the others end between 75% and 85% after a loss spike mid-run; docs/async.md, section 4),
    so one sync run is no reference. Over seeds 0-4 the median async run must be within 2 points of the
    median sync run. Real async runs depend on the processes' timing (under the full suite's load they
    moved by 8 points on average), so the claim is checked on the virtual clock: the same command, the
    same gradients and the same staleness policy, with arrivals from a cost model, so the same numbers
    under any load (measured: sync 82.2 / 75.9 / 80.4 / 11.8 / 75.5, async 78.8 / 61.2 / 82.5 / 85.1 /
    64.5; medians 75.9 and 78.8). The real runs' table is in docs/async.md; the real async path with 2
    workers is ``test_the_specs_async_command_trains_near_sync``. A consistently worse async (or a broken
    one) fails. The runner's ``main`` runs in this process (a virtual run is one process; ten spawns would
    spend a minute importing torch), in each run's own folder as the command would."""
    import json
    import statistics

    import run_parameter_server_training as runner  # the root runner (pytest puts the root on sys.path)

    accuracy: dict[str, list[float]] = {"sync": [], "async": []}
    for seed in range(5):
        for mode in ("sync", "async"):
            folder = tmp_path / f"{mode}{seed}"
            folder.mkdir()
            monkeypatch.chdir(folder)
            command = ["--workers", "4", *SPECS_ASYNC_COMMAND, "--seed", str(seed), "--aggregation-mode", mode]
            assert runner.main([*command, *VIRTUAL_COSTS.split()]) == 0
            summary = json.loads((folder / "logs" / "ps_cli" / "summary.json").read_text())
            assert summary["clock"] == "virtual", summary.get("clock")
            accuracy[mode].append(summary["final_accuracy"])
    assert statistics.median(accuracy["async"]) >= statistics.median(accuracy["sync"]) - 0.02, accuracy
