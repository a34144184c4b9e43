"""Learning-rate schedules that reach the server (src/training/lr_schedule.py, training.lr_schedule,
PushRequest.learning_rate).

Claims: each kind, with and without warm-up, gives torch's own scheduler's rate at every step; the
parameter server's update at version v steps at that rate for v (its events say so, and its
parameters equal the baseline trainer's under the same schedule: the optimizer really used it); a
server resumed from a checkpoint continues the schedule; the library's DistributedOptimizer sends
its scheduler's rate with each push and the server steps with it, with a warning when the server
has a schedule of its own. Lightning's and Hugging Face's schedulers: tests/test_library_plugins.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from src.common.checkpoint import load_checkpoint
from src.config import load_config
from src.metrics import read_events
from src.training.lr_schedule import scheduled_learning_rate
from src.virtual.run import run_virtual
from tests.ps_fixtures import ps_config
from tests.test_ps_equivalence import assert_same_parameters

pytestmark = pytest.mark.timeout(300)

BASE_LR = 0.05


def schedule_config(**fields):
    return load_config(assignments={f"training.lr_schedule.{k}": v for k, v in fields.items()}).training.lr_schedule


def torch_rates(
    steps: int,
    *,
    kind: str,
    warmup_steps: int = 0,
    warmup_start_factor: float = 0.1,
    step_size: int = 0,
    gamma: float = 0.1,
    total_steps: int = 0,
    min_lr: float = 0.0,
) -> list[float]:
    """The rate torch's schedulers hold during each of ``steps`` optimizer steps."""
    from torch.optim import lr_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE_LR)
    main = {
        "constant": lambda: lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0),
        "step": lambda: lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=gamma),
        "cosine": lambda: lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps - warmup_steps, eta_min=min_lr),
    }[kind]
    if warmup_steps:
        warmup = lr_scheduler.LinearLR(optimizer, start_factor=warmup_start_factor, total_iters=warmup_steps)
        scheduler = lr_scheduler.SequentialLR(optimizer, [warmup, main()], milestones=[warmup_steps])
    else:
        scheduler = main()
    return rates_during(optimizer, scheduler, steps)


def rates_during(optimizer, scheduler, steps: int) -> list[float]:
    """The rate of each of ``steps`` optimizer steps, ``scheduler`` stepped after each as a training loop does."""
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.filterwarnings("ignore::UserWarning")  # SequentialLR's deprecation notes on its inner schedulers
@pytest.mark.parametrize(
    "fields",
    [
        dict(kind="constant"),
        dict(kind="constant", warmup_steps=5, warmup_start_factor=0.2),
        dict(kind="step", step_size=7, gamma=0.5),
        dict(kind="step", step_size=4, gamma=0.3, warmup_steps=6),
        dict(kind="cosine", total_steps=30),
        dict(kind="cosine", total_steps=30, warmup_steps=8, min_lr=0.001),
    ],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
def test_each_schedule_gives_torchs_rate_at_every_step(fields):
    steps = 30
    ours = [scheduled_learning_rate(schedule_config(**fields), BASE_LR, step) for step in range(steps)]
    torch.testing.assert_close(
        torch.tensor(ours, dtype=torch.float64),
        torch.tensor(torch_rates(steps, **fields), dtype=torch.float64),
        rtol=1e-6,
        atol=1e-9,
    )


def test_a_cosine_run_past_its_total_stays_at_the_floor():
    schedule = schedule_config(kind="cosine", total_steps=10, min_lr=0.002)
    assert [scheduled_learning_rate(schedule, BASE_LR, step) for step in (10, 11, 50)] == [0.002] * 3
    assert math.isclose(scheduled_learning_rate(schedule, BASE_LR, 5), 0.002 + (BASE_LR - 0.002) / 2)


# ----------------------------------------------------------------------------- the parameter server

COSINE = dict(kind="cosine", warmup_steps=2, total_steps=8, min_lr=0.001)
COSTS = {"emulation__compute_s": 0.02, "emulation__server_update_s": 0.002, "emulation__server_reply_s": 0.001}


def lr_fields(**schedule) -> dict:
    return {f"training__lr_schedule__{k}": v for k, v in schedule.items()}


def updates(config) -> list[dict]:
    return list(read_events(Path(config.system.log_dir) / "server" / "events.jsonl", "update"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_servers_update_at_each_version_steps_at_torchs_cosine_rate_as_the_baseline_does(tmp_path):
    """Sync, 2 workers, 250 samples in 16-sample batches: 8 versions; the schedule reaches its floor at
    the last. The parameters are the baseline's at batch 32 under the same schedule."""
    from src.trainer import BaselineTrainer

    config = ps_config(
        tmp_path,
        "ps",
        system__clock="virtual",
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__max_train_samples=250,
        training__momentum=0.9,
        **COSTS,
        **lr_fields(**COSINE),
    )
    summary = run_virtual(config, tensorboard=False)
    applied = updates(config)
    assert [u["version"] for u in applied] == list(range(1, 9))
    expected = torch_rates(8, **COSINE)
    torch.testing.assert_close(
        torch.tensor([u["learning_rate"] for u in applied], dtype=torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=1e-6,
        atol=1e-9,
    )
    assert len(set(expected)) == 8  # every version a different rate: a version off by one would show

    baseline = load_config(
        overrides={
            "training.dataset": "mnist_5k",
            "training.batch_size": 32,
            "training.num_epochs": 1,
            "training.max_train_samples": 250,
            "training.max_test_samples": 64,
            "training.learning_rate": BASE_LR,
            "training.momentum": 0.9,
            "system.architecture": "baseline",
            "system.num_workers": 1,
            "system.checkpoint_dir": str(tmp_path / "baseline" / "ckpt"),
            "system.log_dir": str(tmp_path / "baseline" / "logs"),
        },
        assignments={f"training.lr_schedule.{k}": v for k, v in COSINE.items()},
    )
    trainer = BaselineTrainer(baseline)
    trainer.run()
    assert_same_parameters(
        {k: v.detach() for k, v in trainer.model.state_dict().items()},
        load_checkpoint(summary["checkpoint_path"])["model_state_dict"],
    )


@pytest.mark.slow
def test_a_resumed_server_continues_the_schedule_from_its_checkpoint(tmp_path):
    """The server is killed at version 13 and resumes from its checkpoint at 10: the versions it redoes and
    the rest step at the schedule's rate for their version, as if nothing had happened."""
    schedule = dict(kind="step", step_size=4, gamma=0.5, warmup_steps=3)
    config = ps_config(
        tmp_path,
        "resume",
        system__clock="virtual",
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__max_train_samples=640,
        training__checkpoint_interval=5,
        system__inject_faults=["kill:server@version=13"],
        emulation__restart_s=0.5,
        **COSTS,
        **lr_fields(**schedule),
    )
    run_virtual(config, tensorboard=False)
    events = list(read_events(Path(config.system.log_dir) / "server" / "events.jsonl"))
    (recovered,) = [e for e in events if e["kind"] == "server_recovered"]
    assert recovered["version"] == 10
    after = [e for e in events[events.index(recovered) :] if e["kind"] == "update"]
    assert [u["version"] for u in after] == list(range(11, 21))
    rates = torch_rates(20, **schedule)
    for update in (e for e in events if e["kind"] == "update"):
        assert update["learning_rate"] == pytest.approx(rates[update["version"] - 1], rel=1e-9), update["version"]


# ----------------------------------------------------------------------------- the library


def _library_steps(client, count: int, scheduler_for=None, *, scheduled_from: int = 0) -> list[float]:
    """``count`` steps of a user's loop, a scheduler made by ``scheduler_for`` driving its optimizer from step
    ``scheduled_from`` on; returns the rates the wrapped optimizer held at each step."""
    from tests.library_fixtures import small_mlp
    from torch_asgc import DistributedModel, DistributedOptimizer

    net = small_mlp()
    model = DistributedModel(net, client)
    inner = torch.optim.SGD(net.parameters(), lr=BASE_LR)
    optimizer = DistributedOptimizer(inner, client)
    scheduler = None
    generator = torch.Generator().manual_seed(0)
    rates = []
    for step in range(count):
        if step == scheduled_from and scheduler_for is not None:
            scheduler = scheduler_for(inner)
        images = torch.randn(16, 1, 28, 28, generator=generator)
        optimizer.zero_grad()
        F.cross_entropy(model(images), (images.flatten(1)[:, 0] > 0).long()).backward()
        rates.append(inner.param_groups[0]["lr"])
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return rates


def test_the_librarys_scheduler_reaches_the_server_which_steps_with_it(tmp_path):
    from tests.library_fixtures import TOKEN, LibraryServer, library_config
    from torch_asgc import connect

    config = library_config(tmp_path, "library")
    with LibraryServer(config) as server:
        with connect(server.address, token=TOKEN) as client:
            sent = _library_steps(client, 6, lambda inner: torch.optim.lr_scheduler.CosineAnnealingLR(inner, T_max=6))
        server.finish()
    assert [u["learning_rate"] for u in updates(config)] == pytest.approx(sent, rel=1e-12)
    assert len(set(sent)) == 6


def test_without_a_scheduler_the_servers_schedule_applies_and_a_scheduler_against_it_is_named(tmp_path):
    from tests.library_fixtures import TOKEN, LibraryServer, library_config
    from torch_asgc import connect

    config = library_config(tmp_path, "own", **lr_fields(kind="step", step_size=2, gamma=0.5))
    with LibraryServer(config) as server:
        with connect(server.address, token=TOKEN) as client:
            # 4 steps without a scheduler on the wrapped optimizer (nothing sent), then 2 driven by one
            with pytest.warns(
                UserWarning,
                match=r"the server has a training.lr_schedule \(step\); this worker sends "
                r"its own scheduler's learning rates",
            ):
                _library_steps(
                    client,
                    6,
                    lambda inner: torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.1),
                    scheduled_from=4,
                )
        server.finish()
    rates = [u["learning_rate"] for u in updates(config)]
    assert rates == pytest.approx([BASE_LR, BASE_LR, BASE_LR / 2, BASE_LR / 2, BASE_LR, BASE_LR / 10], rel=1e-12)
    overridden = list(read_events(Path(config.system.log_dir) / "server" / "events.jsonl", "lr_schedule_overridden"))
    assert [(e["worker"], e["schedule"]) for e in overridden] == [(0, "step")]
