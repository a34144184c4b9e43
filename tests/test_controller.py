"""Event-driven tests of src/adaptive/controller.py: streams of push and eval events in, decisions out.

The controller raises rho after a Loss Rebound, lowers it while training is stable and communication
dominates, never leaves its bounds, ignores the fast early drop of the loss, and decides the same way
for the same stream (what DDP ranks rely on).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest

from src.adaptive.controller import CompressionController, loss_rebound
from src.adaptive.settings import ControllerSettings
from src.config import ConfigError, validate_config


def push(communication: float = 0.8, gradient: float = 0.2, compression: float = 0.0) -> dict:
    return {
        "kind": "push",
        "worker": 0,
        "staleness": 1,
        "gradient_time_s": gradient,
        "compression_time_s": compression,
        "communication_time_s": communication,
    }


def evaluation(step: int, loss: float) -> dict:
    return {"kind": "eval", "step": step, "test_loss": loss, "test_accuracy": 0.5, "time": 1e9 + step}


def run(controller: CompressionController, losses, *, communication=0.8, gradient=0.2, pushes_between=5):
    """Feed ``pushes_between`` pushes then one evaluation per loss; returns the decisions."""
    decisions = []
    for index, loss in enumerate(losses):
        for _ in range(pushes_between):
            assert controller.observe(push(communication, gradient)) is None
        decisions.append(controller.observe(evaluation(10 * (index + 1), loss)))
    return decisions


SETTINGS = ControllerSettings(
    rho_initial=0.1,
    rho_min=0.01,
    rho_max=0.5,
    max_staleness_initial=8,
    max_staleness_min=1,
    max_staleness_max=16,
    rebound_threshold=0.05,
    rebound_window=3,
    stable_evaluations=2,
    communication_share=0.5,
    policy="rebound",
)


def test_loss_rebound_is_the_mean_positive_jump():
    assert loss_rebound([1.0, 0.8, 1.0, 0.9]) == pytest.approx((0 + 0.2 + 0) / 3)
    assert loss_rebound([2.3, 1.0, 0.4]) == 0.0
    assert loss_rebound([0.5]) == 0.0


def test_raises_rho_and_tightens_max_staleness_after_a_loss_rebound():
    controller = CompressionController(SETTINGS)
    decisions = run(controller, [0.60, 0.50, 0.75])  # rebound = mean(0, 0.25) = 0.125 > 0.05
    last = decisions[-1]
    assert last["action"] == "compress_less"
    assert (last["rho"], last["previous_rho"]) == (pytest.approx(0.2), pytest.approx(0.1))
    assert (last["max_staleness"], last["previous_max_staleness"]) == (4, 8)
    assert last["inputs"]["loss_rebound"] == pytest.approx(0.125)
    assert "Loss Rebound 0.125 > 0.05" in last["reason"]
    assert last["apply_from_step"] == last["step"] + 1 == 31


def test_one_rebound_acts_once():
    controller = CompressionController(SETTINGS)
    decisions = run(controller, [0.60, 0.50, 0.75, 0.74, 0.73], communication=0.1, gradient=0.9)
    assert [d["action"] for d in decisions] == ["hold", "hold", "compress_less", "hold", "hold"]
    assert controller.rho == pytest.approx(0.2)


def test_persistence_holds_a_lone_rebound_and_acts_on_one_that_persists():
    settings = dataclasses.replace(SETTINGS, instability_persistence=2)
    lone = run(CompressionController(settings), [0.60, 0.50, 0.75, 0.74, 0.73], communication=0.1, gradient=0.9)
    assert [d["action"] for d in lone] == ["hold", "hold", "hold_for_persistence", "hold", "hold"]
    assert "need 2 (instability_persistence)" in lone[2]["reason"] and lone[2]["rho"] == pytest.approx(0.1)
    controller = CompressionController(settings)
    persisting = run(controller, [0.60, 0.50, 0.75, 0.85], communication=0.1, gradient=0.9)  # a second rise of 0.1
    assert [d["action"] for d in persisting] == ["hold", "hold", "hold_for_persistence", "compress_less"]
    assert controller.rho == pytest.approx(0.2) and persisting[-1]["inputs"]["unstable_evaluations"] == 0
    # a stable evaluation between two rebounds starts the count again
    broken = run(CompressionController(settings), [0.60, 0.50, 0.75, 0.70, 0.90], communication=0.1, gradient=0.9)
    assert [d["action"] for d in broken] == ["hold", "hold", "hold_for_persistence", "hold", "hold_for_persistence"]
    # persistence 1 is the controller without the knob
    plain = run(CompressionController(SETTINGS), [0.60, 0.50, 0.75, 0.85], communication=0.1, gradient=0.9)
    assert [d["action"] for d in plain] == ["hold", "hold", "compress_less", "compress_less"]


def test_persistence_resumes_mid_count_from_its_state():
    settings = dataclasses.replace(SETTINGS, instability_persistence=2)
    controller = CompressionController(settings)
    run(controller, [0.60, 0.50, 0.75], communication=0.1, gradient=0.9)
    resumed = CompressionController()
    resumed.load_state_dict(json.loads(json.dumps(controller.state_dict())))
    assert run(resumed, [0.85], communication=0.1, gradient=0.9)[0]["action"] == "compress_less"


def test_lowers_rho_while_stable_and_communication_dominates():
    controller = CompressionController(SETTINGS)
    decisions = run(controller, [0.9, 0.7, 0.6, 0.55, 0.52], communication=0.8, gradient=0.2)
    actions = [d["action"] for d in decisions]
    # evaluation 1: no pair yet; 2: stable once; 3: stable twice -> compress more; 4: once; 5: twice -> again
    assert actions == ["hold", "hold", "compress_more", "hold", "compress_more"]
    assert decisions[2]["rho"] == pytest.approx(0.05) and decisions[2]["max_staleness"] == 9
    assert decisions[4]["rho"] == pytest.approx(0.025) and decisions[4]["max_staleness"] == 10
    assert decisions[2]["inputs"]["communication_share"] == pytest.approx(0.8)


def test_holds_while_stable_when_computation_dominates():
    controller = CompressionController(SETTINGS)
    decisions = run(controller, [0.9, 0.7, 0.6, 0.55, 0.52], communication=0.2, gradient=0.8)
    assert all(d["action"] == "hold" for d in decisions)
    assert "communication share 0.200 < 0.5" in decisions[-1]["reason"]
    assert controller.rho == pytest.approx(0.1)


def test_holds_without_timings():
    controller = CompressionController(SETTINGS)
    decisions = [controller.observe(evaluation(step, loss)) for step, loss in [(1, 0.9), (2, 0.8), (3, 0.7)]]
    assert [d["action"] for d in decisions] == ["hold"] * 3
    assert "no push timings" in decisions[-1]["reason"]


def test_ignores_the_fast_early_drop_of_the_loss():
    """A steep fall of the loss has a large spread but no rebound: it is never taken for instability."""
    early = [2.30, 1.20, 0.55, 0.35, 0.28, 0.25]
    controller = CompressionController(SETTINGS)
    decisions = run(controller, early)
    assert max(early) - min(early) > 2.0  # what a raw-spread rule would have called unstable
    assert all(d["action"] != "compress_less" for d in decisions)
    assert all(d["inputs"]["loss_rebound"] == 0.0 for d in decisions)
    assert controller.rho < SETTINGS.rho_initial  # stable and communication-bound: it compressed more


def test_never_leaves_its_bounds():
    """Long stable, communication-bound stretches and unstable ones, alternating, with random timings."""
    generator = random.Random(7)
    controller = CompressionController(SETTINGS)
    rhos, bounds = set(), set()
    loss = 1.0
    for step in range(1, 3001):
        stable = (step // 600) % 2 == 0
        if generator.random() < 0.8:
            communication = generator.uniform(0.6, 1.0) if stable else generator.random()
            controller.observe(push(communication, generator.uniform(0.0, 0.3), generator.random() * 0.05))
            continue
        jump = generator.uniform(-0.02, 0.0) if stable else generator.choice([-0.3, -0.05, 0.1, 0.4])
        loss = max(0.01, loss + jump)
        decision = controller.observe(evaluation(step, loss))
        assert SETTINGS.rho_min <= decision["rho"] <= SETTINGS.rho_max
        assert SETTINGS.max_staleness_min <= decision["max_staleness"] <= SETTINGS.max_staleness_max
        rhos.add(decision["rho"])
        bounds.add(decision["max_staleness"])
    # the stream pushed it against both ends of both ranges
    assert {SETTINGS.rho_min, SETTINGS.rho_max} <= rhos
    assert {SETTINGS.max_staleness_min, SETTINGS.max_staleness_max} <= bounds


def test_at_the_bound_a_decision_is_a_hold_that_says_so():
    settings = ControllerSettings(
        rho_initial=0.5, rho_min=0.01, rho_max=0.5, max_staleness_initial=1, max_staleness_min=1, max_staleness_max=4
    )
    controller = CompressionController(settings)
    decision = run(controller, [0.5, 0.9])[-1]
    assert decision["action"] == "hold" and "(already at the bound)" in decision["reason"]
    assert (decision["rho"], decision["max_staleness"]) == (0.5, 1)


def test_same_stream_same_decisions_and_json_events():
    """Deterministic: two controllers (two DDP ranks) fed the same events switch at the same steps."""
    generator = random.Random(3)
    stream = []
    loss = 1.5
    for step in range(300):
        stream.append(push(generator.random(), generator.random()))
        if step % 7 == 6:
            loss = max(0.05, loss + generator.uniform(-0.2, 0.12))
            stream.append(evaluation(step, loss))
    first, second = CompressionController(SETTINGS), CompressionController(SETTINGS)
    a = [d for d in map(first.observe, stream) if d is not None]
    b = [d for d in map(second.observe, stream) if d is not None]
    assert a == b and len(a) == sum(e["kind"] == "eval" for e in stream)
    assert json.loads(json.dumps(a)) == a  # each decision is a plain event


def test_state_dict_resumes_the_same_decisions():
    stream = [push() for _ in range(3)] + [evaluation(10, 0.9), evaluation(20, 0.8)] + [push() for _ in range(2)]
    later = [evaluation(30, 0.7), evaluation(40, 0.95), push(), evaluation(50, 0.6), evaluation(60, 0.5)]
    original = CompressionController(SETTINGS)
    for event in stream:
        original.observe(event)
    resumed = CompressionController()
    resumed.load_state_dict(json.loads(json.dumps(original.state_dict())))
    assert [original.observe(e) for e in later] == [resumed.observe(e) for e in later]


def test_other_events_are_ignored_and_bad_evals_refused():
    controller = CompressionController(SETTINGS)
    assert controller.observe({"kind": "checkpoint", "version": 5}) is None
    assert controller.observe({"kind": "push", "communication_time_s": float("nan")}) is None
    assert controller.communication_share() is None
    with pytest.raises(ValueError, match="finite test_loss"):
        controller.observe({"kind": "eval", "step": 3, "test_loss": None})
    with pytest.raises(ValueError, match="integer step"):
        controller.observe({"kind": "eval", "step": "3", "test_loss": 0.5})


def test_settings_from_config_clamp_the_start_into_the_bounds():
    system = validate_config(
        {
            "system": {
                "compression_ratio": 0.9,
                "max_staleness": 30,
                "controller_rho_max": 0.4,
                "controller_max_staleness_max": 12,
                "controller_rebound_threshold": 0.1,
            }
        }
    ).system
    settings = ControllerSettings.from_config(system)
    assert (settings.rho_initial, settings.max_staleness_initial) == (0.4, 12)
    assert settings.rebound_threshold == 0.1
    assert CompressionController.from_config(system).rho == 0.4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rho_min=0.6, rho_max=0.5), "rho_min <= rho_max"),
        (dict(max_staleness_min=5, max_staleness_max=2), "max_staleness_min <= max_staleness_max"),
        (dict(rebound_window=0), "rebound_window must be >= 1"),
        (dict(rho_factor=1.0), "rho_factor must be a finite number > 1"),
        (dict(instability_persistence=0), "instability_persistence must be >= 1"),
        (dict(communication_share=1.5), r"communication_share must be in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ControllerSettings(**kwargs)


def test_the_config_takes_the_controllers_defaults_and_refuses_what_it_refuses():
    """``system.controller_*`` are built from ControllerSettings: the same defaults, the same bounds, the same words."""
    system, defaults = validate_config({}).system, ControllerSettings()
    for setting in dataclasses.fields(ControllerSettings):
        if hasattr(system, f"controller_{setting.name}"):
            assert getattr(system, f"controller_{setting.name}") == getattr(defaults, setting.name), setting.name
    for name, bad in (("rebound_window", 0), ("communication_share", 1.5), ("rebound_threshold", float("inf"))):
        with pytest.raises(ConfigError) as caught:
            validate_config({"system": {f"controller_{name}": bad}})
        rule = caught.value.problems[0].split(": ", 1)[1].rsplit(", got", 1)[0]
        with pytest.raises(ValueError, match=f"^{name} {re.escape(rule)}, got {bad}$"):
            ControllerSettings(**{name: bad})


# ----------------------------------------------------------------------------- end to end, real processes


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_decisions_reach_the_workers_payload_sizes(tmp_path):
    """A parameter-server run (server and 2 worker processes) with the controller on: each decision is a
    server event, and every later push of each worker is exactly the top-k payload of the new rho."""
    import torch

    from src.compression import build_compressor
    from src.compressors.policy import CompressionPolicy
    from src.launch.ps import run_local
    from src.metrics import read_events
    from src.trainer import model_from_config
    from tests.ps_fixtures import ps_config

    # Never a rebound, communication always "dominant", one stable evaluation: compress more at every
    # evaluation after the first (rho 0.1 -> 0.05 -> 0.025 -> 0.0125 -> 0.01, the floor).
    config = ps_config(
        tmp_path,
        system__num_workers=2,
        system__compression_enabled=True,
        system__compression_type="topk",
        system__compression_ratio=0.1,
        system__adaptive_compression=True,
        system__controller_policy="rebound",
        system__controller_rho_min=0.01,
        system__controller_rebound_threshold=10.0,
        system__controller_stable_evaluations=1,
        system__controller_communication_share=0.0,
        training__max_train_samples=768,
        training__batch_size=32,
        training__eval_interval=4,
        training__momentum=0.9,
    )
    summary = run_local(config)
    decisions = list(read_events(f"{config.system.log_dir}/server/events.jsonl", kind="controller"))
    assert [d["action"] for d in decisions][:5] == [
        "hold",
        "compress_more",
        "compress_more",
        "compress_more",
        "compress_more",
    ]
    assert [d["rho"] for d in decisions][:5] == [0.1, 0.05, 0.025, 0.0125, 0.01]
    assert all(d["rho"] == 0.01 for d in decisions[4:]) and all(
        "communication share" in d["reason"] for d in decisions[1:5]
    )
    assert sum(summary["controller"]["decisions"].values()) == len(decisions)  # S_max keeps relaxing after rho's floor
    assert summary["controller"]["final_compression_ratio"] == 0.01

    shapes = [tuple(p.shape) for p in model_from_config(config).parameters()]
    generator = torch.Generator().manual_seed(0)

    def payload_bytes(rho: float) -> int:
        policy = CompressionPolicy(build_compressor("topk", ratio=rho, selection=config.system.topk_selection))
        return sum(len(policy.compress(torch.randn(shape, generator=generator), 0, generator)) for shape in shapes)

    for worker in range(2):
        events = list(read_events(f"{config.system.log_dir}/worker_{worker}/events.jsonl"))
        switches = [(e["step"], e["compression_ratio"]) for e in events if e["kind"] == "control_applied"]
        assert [rho for _, rho in switches] == sorted({rho for _, rho in switches}, reverse=True) and switches
        assert {rho for _, rho in switches} <= {0.05, 0.025, 0.0125, 0.01}
        for push in (e for e in events if e["kind"] == "push"):
            rho = next((r for step, r in reversed(switches) if step <= push["step"]), 0.1)  # the rho in effect
            assert push["payload_bytes"] == payload_bytes(rho), (push["step"], rho, switches)
