"""The adaptive controller's ``link`` policy (src/adaptive/controller.py, src/adaptive/link_model.py), event-driven.

Streams of push events from a modelled link go in (each push's step less compression is ``fixed + bytes /
throughput``; top-k's payload is 8 bytes per kept entry, dense 4), decisions come out: a probe window, then
the Active Fraction (or none) whose predicted step is fastest; a slower link moves it without another probe;
a server that paces every step whatever the payload means no compression; while the loss falls fast (the
critical regime) it pays for a denser rho; a rebound raises the floor. Plus the parameter server's pairing of
a push's reported communication time with its previous payload.
"""

from __future__ import annotations

import json

import pytest

from src.adaptive.controller import CompressionController
from src.adaptive.link_model import LinkModel, WindowPoint
from src.adaptive.settings import ControllerSettings

NUMEL = 5_800_000
DENSE = 4 * NUMEL
COMPRESS_S = 0.037
GRADIENT_S = 0.014


def settings(**changes) -> ControllerSettings:
    base = dict(rho_initial=0.05, rho_min=0.05, rho_max=1.0, policy="link", rebound_threshold=0.05)
    return ControllerSettings(**{**base, **changes})


def payload(rho: float) -> int:
    return DENSE if rho >= 1 else int(8 * NUMEL * rho)


class Link:
    """Pushes of workers over a link: ``fixed_s`` beyond the gradient, ``mbps`` for the payload; or, with
    ``paced_s``, a server that makes every step last that long whatever is sent."""

    def __init__(self, mbps: float, fixed_s: float = 0.066, paced_s: float | None = None):
        self.mbps, self.fixed_s, self.paced_s = mbps, fixed_s, paced_s

    def push(self, rho: float) -> dict:
        compression = 0.0 if rho >= 1 else COMPRESS_S
        transfer = payload(rho) * 8 / (self.mbps * 1e6)
        communication = self.fixed_s + transfer
        if self.paced_s is not None:  # the worker waits for the server: its step lasts paced_s
            communication = self.paced_s - GRADIENT_S - compression
        return {
            "kind": "push",
            "worker": 0,
            "gradient_time_s": GRADIENT_S,
            "compression_time_s": compression,
            "communication_time_s": communication,
            "payload_bytes": payload(rho),
            "dense_bytes": DENSE,
        }


def window(controller: CompressionController, link: Link, step: int, loss: float, pushes: int = 8) -> dict:
    """``pushes`` pushes at the controller's rho, then an evaluation: its decision."""
    for _ in range(pushes):
        assert controller.observe(link.push(controller.rho)) is None
    return controller.observe({"kind": "eval", "step": step, "test_loss": loss})


def falling(n: int, start: float = 2.0) -> list[float]:
    return [start * 0.7**i for i in range(n)]  # 30% lower each time: the critical regime, never a rebound


def calm(n: int, start: float = 1.0) -> list[float]:
    return [start * 0.97**i for i in range(n)]  # 3% lower each time: calm, never a rebound


def trace(controller: CompressionController, link: Link, losses: list[float]) -> list[dict]:
    return [window(controller, link, 10 * (i + 1), loss) for i, loss in enumerate(losses)]


def test_a_slow_link_probes_once_then_keeps_the_floor_while_calm():
    controller = CompressionController(settings())
    decisions = trace(controller, Link(250), calm(5))
    assert [d["action"] for d in decisions] == ["probe", "compress_more", "hold", "hold", "hold"]
    assert [d["rho"] for d in decisions] == [0.1, 0.05, 0.05, 0.05, 0.05]
    assert "probe: one payload size (2320000 bytes)" in decisions[0]["reason"]
    fitted = decisions[1]["inputs"]
    assert fitted["fixed_s"] == pytest.approx(GRADIENT_S + 0.066)
    assert fitted["throughput_bytes_per_s"] == pytest.approx(250e6 / 8)
    predicted = fitted["predicted_step_s"]
    assert predicted["0.05"] == pytest.approx(GRADIENT_S + 0.066 + COMPRESS_S + payload(0.05) * 8 / 250e6)
    assert predicted["1"] == pytest.approx(GRADIENT_S + 0.066 + DENSE * 8 / 250e6)
    assert min(predicted, key=predicted.get) == "0.05"


def test_a_fast_link_turns_compression_off():
    controller = CompressionController(settings())
    decisions = trace(controller, Link(10_000), falling(3))
    assert [d["action"] for d in decisions] == ["probe", "compress_less", "hold"]
    assert decisions[1]["rho"] == 1.0 and "at no compression" in decisions[1]["reason"]


def test_a_server_that_paces_every_step_means_no_compression():
    """Every step lasts 0.2 s whatever the payload: a larger payload costs nothing, compression only its time."""
    controller = CompressionController(settings())
    decisions = trace(controller, Link(250, paced_s=0.2), falling(3))
    assert decisions[1]["action"] == "compress_less" and decisions[1]["rho"] == 1.0
    assert decisions[1]["inputs"]["throughput_bytes_per_s"] is None  # no measurable transfer time


def test_in_the_critical_regime_it_pays_for_a_denser_rho_and_compresses_more_once_calm():
    controller = CompressionController(settings())
    decisions = trace(controller, Link(250), [2.0, 1.4, 0.98, 0.95, 0.93])
    assert [d["action"] for d in decisions] == ["probe", "compress_less", "hold", "compress_more", "hold"]
    assert [d["rho"] for d in decisions] == [0.1, 0.2, 0.2, 0.05, 0.05]
    assert (
        "critical: the loss fell 30.0% (>= 0.2)" in decisions[1]["reason"]
        and "within 1.5 of it" in decisions[1]["reason"]
    )
    assert "calm: the loss fell 3.1% (< 0.2)" in decisions[3]["reason"] and "within 0.1 of it" in decisions[3]["reason"]


def test_a_link_that_changes_moves_the_choice_without_another_probe():
    controller = CompressionController(settings(rho_initial=0.05))
    fast, slow = Link(10_000), Link(25)
    decisions = trace(controller, fast, calm(3))
    assert controller.rho == 1.0
    later = [window(controller, slow, 40 + 10 * i, loss) for i, loss in enumerate(calm(3, 0.9))]
    assert [d["action"] for d in later] == ["compress_more", "hold", "hold"]
    assert later[0]["rho"] == 0.05 and "probe" not in later[0]["reason"]
    assert later[0]["inputs"]["throughput_bytes_per_s"] == pytest.approx(25e6 / 8)
    assert [d["action"] for d in decisions].count("probe") == 1


def test_an_evaluation_without_pushes_is_no_new_reading_of_the_loss():
    controller = CompressionController(settings())
    trace(controller, Link(250), falling(3))
    window(controller, Link(250), 30, falling(3)[-1], pushes=0)  # the epoch's end, again
    assert "critical: the loss fell 30.0%" in window(controller, Link(250), 40, falling(4)[-1])["reason"]


def test_a_rebound_compresses_less_and_raises_the_floor():
    controller = CompressionController(settings())
    decisions = trace(controller, Link(250), [1.0, 0.97, 0.94, 1.1])
    assert [d["action"] for d in decisions] == ["probe", "compress_more", "hold", "compress_less"]
    assert "Loss Rebound" in decisions[-1]["reason"]
    assert controller.floor == pytest.approx(0.1) and controller.rho == pytest.approx(0.1)
    assert window(controller, Link(250), 50, 0.9)["rho"] == pytest.approx(0.1)  # calm, but not below the floor


def test_a_resumed_controller_decides_as_the_uninterrupted_one():
    link, losses = Link(250), falling(6)
    whole = CompressionController(settings())
    expected = trace(whole, link, losses)
    first = CompressionController(settings())
    head = trace(first, link, losses[:2])
    for _ in range(3):  # pushes of the next window before the checkpoint
        first.observe(link.push(first.rho))
    resumed = CompressionController()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    for _ in range(5):
        resumed.observe(link.push(resumed.rho))
    tail = [resumed.observe({"kind": "eval", "step": 30, "test_loss": losses[2]})]
    tail += [window(resumed, link, 10 * (i + 4), loss) for i, loss in enumerate(losses[3:])]
    assert head + tail == expected


def test_the_model_needs_two_payload_sizes_for_a_fit():
    model = LinkModel()
    point = WindowPoint(
        payload_bytes=1e6, communication_s=0.1, gradient_s=0.01, compression_s=0.02, dense_bytes=8e6, pushes=4
    )
    model.update(point, 0.05)
    assert not model.fitted and model.step_s(0.05) is None and model.bytes_per_rho == pytest.approx(2e7)
    model.update(WindowPoint(1.1e6, 0.109, 0.01, 0.02, 8e6, 4), None)  # on the line, but 1.1x: too close to split
    assert not model.fitted
    model.update(WindowPoint(2e6, 0.19, 0.01, 0.02, 8e6, 4), 0.1)
    assert model.fixed_s == pytest.approx(0.02) and model.throughput == pytest.approx(1e6 / 0.09)
    assert model.step_s(1.0) == pytest.approx(0.02 + 8e6 * 0.09 / 1e6)
    # a smaller payload that took far longer: the link slowed between the windows; the fit stays, the rate moves
    model.update(WindowPoint(1e6, 0.99, 0.01, 0.02, 8e6, 4), 0.05)
    assert model.fixed_s == pytest.approx(0.02) and model.throughput == pytest.approx(1e6 / 0.98)


def test_the_server_pairs_a_push_s_communication_time_with_the_worker_s_previous_payload():
    from src.config import validate_config
    from src.ps.server.control import ServerControl

    config = validate_config(
        {"system": {"adaptive_compression": True, "compression_enabled": True, "compression_type": "topk"}}
    )
    control = ServerControl(config, None)
    seen = []
    control.controller.observe = seen.append
    for worker, communication, size in ((0, 0.0, 100), (1, 0.0, 300), (0, 0.5, 200), (1, 0.7, 400), (0, 0.6, 900)):
        control.observe_push({"kind": "push", "worker": worker, "communication_time_s": communication}, size, 4000)
    assert [(e["worker"], e["payload_bytes"]) for e in seen] == [(0, 0), (1, 0), (0, 100), (1, 300), (0, 200)]
    assert {e["dense_bytes"] for e in seen} == {4000}


def test_the_policy_is_a_config_choice_with_link_the_default():
    from src.config import ConfigError, validate_config

    assert validate_config({}).system.controller_policy == "link" == ControllerSettings().policy
    with pytest.raises(ConfigError, match="controller_policy"):
        validate_config({"system": {"controller_policy": "fastest"}})
    with pytest.raises(ValueError, match=r"^policy must be one of \['link', 'rebound'\], got 'fastest'$"):
        ControllerSettings(policy="fastest")
