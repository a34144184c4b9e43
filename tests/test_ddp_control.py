"""The adaptive compression controller in DDP (src/ddp/control.py): every rank switches in the same step.

* unit: rank 0's decision, broadcast as four float64 numbers, becomes the same switch on every rank,
  due from ``apply_from_step``; the hook's top-k ratio can be set and nothing else can; a run without
  evaluations or top-k is refused naming the field (trainer, launcher, runner, experiments);
* (slow) two real gloo ranks on the synthetic set, the controller made to compress more at every
  evaluation: decisions change rho, every rank's ``control_applied`` is at the same step with the
  same rho, every step's payload on every rank is exactly the top-k payload of the rho in effect, and
  a run resumed from a checkpoint taken with a switch pending decides and switches as the
  uninterrupted one did, landing on the same parameters.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.adaptive.controller import CompressionController
from src.compression import build_compressor
from src.compressors.policy import CompressionPolicy
from src.config import SetupError, validate_config
from src.ddp.comm_hooks import CommHook, comm_hook_from_config, compression_hook
from src.ddp.control import RankControl, Switch, config_problem
from src.ddp.hook_state import CompressionHookState
from tests.ddp_fixtures import join_group, spawn_ranks

WORLD = 2


def _system(**fields):
    return validate_config(
        {
            "system": {
                "architecture": "ddp",
                "compression_enabled": True,
                "compression_type": "topk",
                "compression_ratio": 0.1,
                "adaptive_compression": True,
                "controller_policy": "rebound",
                "controller_rebound_threshold": 10.0,
                "controller_stable_evaluations": 1,
                "controller_communication_share": 0.0,
                **fields,
            },
            "training": {"eval_interval": 2},
        }
    )


# ----------------------------------------------------------------------------- unit


def test_the_link_policy_reads_each_steps_payload_and_broadcasts_its_probe(monkeypatch):
    """The default policy: rank 0's steps carry their payload and dense bytes; the first decision is a probe (action
    index 3 of the broadcast) that every rank takes as a switch; the second fits the link from two payload sizes."""
    system = _system(controller_policy="link", compression_ratio=0.2, controller_rho_max=1.0).system
    ranks = [RankControl.for_run(system, rank, compression_ratio=0.2) for rank in range(WORLD)]
    sent: list[torch.Tensor] = []

    def broadcast(tensor, src):
        if sent:
            tensor.copy_(sent.pop())
        else:
            sent.append(tensor.clone())

    monkeypatch.setattr(dist, "broadcast", broadcast)
    device, decisions = torch.device("cpu"), []
    for step, loss in [(2, 0.9), (4, 0.88)]:  # calm: the fastest step, not a denser one
        rho = ranks[0].compression_ratio if ranks[0].pending is None else ranks[0].pending.rho
        for control in ranks:  # an exchange of 0.01 s + 1 s per 10 MB of payload
            payload = int(8 * 1_000_000 * rho)
            exchange = 0.01 + payload / 1e7
            control.step_done(0.05 + exchange, exchange, payload, 4_000_000)
        decisions.append(ranks[0].decide({"kind": "eval", "step": step, "test_loss": loss}, device))
        assert ranks[1].decide(None, device) is None
        for control in ranks:
            control.due(step + 1)
    assert decisions[0]["action"] == "probe" and decisions[0]["rho"] == pytest.approx(0.1)
    fitted = decisions[1]["inputs"]
    assert fitted["throughput_bytes_per_s"] == pytest.approx(1e7) and fitted["fixed_s"] == pytest.approx(0.06)
    # no compression time apart in DDP: the smallest payload is the fastest step (0.068 s at rho 0.01, 0.46 dense)
    assert fitted["predicted_step_s"]["0.01"] == pytest.approx(0.068) and fitted["predicted_step_s"][
        "1"
    ] == pytest.approx(0.46)
    assert decisions[1]["action"] == "compress_more" and decisions[1]["rho"] == 0.01
    assert [control.decisions for control in ranks] == [{"probe": 1, "compress_more": 1}] * WORLD


def test_a_broadcast_decision_becomes_the_same_switch_on_every_rank_from_apply_from_step(monkeypatch):
    system = _system().system
    ranks = [RankControl.for_run(system, rank, compression_ratio=0.1) for rank in range(WORLD)]
    assert isinstance(ranks[0].controller, CompressionController) and ranks[1].controller is None
    sent: list[torch.Tensor] = []

    def broadcast(tensor, src):  # rank 0 sends first, rank 1 receives what it sent
        assert src == 0
        if sent:
            tensor.copy_(sent.pop())
        else:
            sent.append(tensor.clone())

    monkeypatch.setattr(dist, "broadcast", broadcast)
    device = torch.device("cpu")
    for step, loss in [(2, 0.9), (4, 0.8)]:
        for control in ranks:
            control.step_done(0.01, 0.004)  # rank 0's controller counts them
        event = {"kind": "eval", "step": step, "test_loss": loss}
        decision = ranks[0].decide(event, device)
        assert ranks[1].decide(None, device) is None
    assert decision["action"] == "compress_more" and decision["rho"] == 0.05 and decision["apply_from_step"] == 5
    assert decision["inputs"]["timed_pushes"] == 1 and decision["inputs"]["communication_share"] == pytest.approx(0.4)
    for control in ranks:
        assert control.pending == Switch(5, 0.05, 9)
        assert control.due(4) is None and control.compression_ratio == 0.1
        assert control.due(5) == Switch(5, 0.05, 9) and control.compression_ratio == 0.05
        assert control.due(6) is None
        assert control.summary() == {
            "decisions": {"hold": 1, "compress_more": 1},
            "final_compression_ratio": 0.05,
            "final_max_staleness": 9,
        }


def test_a_start_outside_the_bounds_switches_at_step_one_and_the_state_resumes():
    system = _system(compression_ratio=0.9, controller_rho_max=0.4).system
    control = RankControl.for_run(system, 0, compression_ratio=0.9)
    assert control.pending == Switch(1, 0.4, 8) and control.due(1).rho == 0.4
    control.receive(0.2, 9, 11, "compress_more")
    saved = json.loads(json.dumps(control.state_dict()))  # plain values, as a checkpoint keeps them
    for rank in range(WORLD):
        resumed = RankControl.for_run(system, rank, compression_ratio=0.9, saved=saved)
        assert (resumed.compression_ratio, resumed.pending, dict(resumed.decisions)) == (
            0.4,
            Switch(11, 0.2, 9),
            {"compress_more": 1},
        )
        assert (resumed.controller is not None) == (rank == 0)
    assert (
        RankControl.for_run(system, 0, compression_ratio=0.9, saved=saved).controller.state_dict()
        == control.controller.state_dict()
    )


def _hook(kind: str) -> CommHook:
    compressor = (
        build_compressor("topk", ratio=0.1, selection="exact")
        if kind == "topk"
        else build_compressor("quantization", bits=8)
    )
    state = CompressionHookState(CompressionPolicy(compressor, warmup_steps=3), param_names={})
    return CommHook(kind, state, compression_hook, state.stats)


def test_the_hooks_top_k_ratio_can_be_set_and_nothing_else():
    hook = _hook("topk")
    assert hook.topk_ratio == 0.1
    hook.set_topk_ratio(0.025)
    assert hook.topk_ratio == 0.025
    assert hook.state.policy.compressor.selection == "exact" and hook.state.policy.warmup_steps == 3
    with pytest.raises(ValueError, match=r"topk.ratio must be a number in \(0, 1\]"):
        hook.set_topk_ratio(0.0)
    for other in (_hook("quantization"), CommHook("allreduce")):
        assert other.topk_ratio is None
        with pytest.raises(ValueError, match="does not compress with top-k"):
            other.set_topk_ratio(0.05)


def test_a_run_without_evaluations_or_top_k_is_refused_naming_the_field(capsys, monkeypatch, tmp_path):
    import run_ddp_training
    from src.ddp_trainer import DDPTrainer, RankContext
    from src.launch.ddp import check_launch

    no_eval = validate_config(
        {"system": {"architecture": "ddp", "adaptive_compression": True, "compression_enabled": True}}
    )
    no_topk = validate_config(
        {
            "system": {
                "architecture": "ddp",
                "adaptive_compression": True,
                "compression_enabled": True,
                "compression_type": "quantization",
            },
            "training": {"eval_interval": 5},
        }
    )
    assert config_problem(no_eval) == (
        "system.adaptive_compression decides at evaluations: set training.eval_interval (steps between evaluations)"
    )
    assert config_problem(no_topk) == (
        "system.adaptive_compression sets top-k's Active Fraction: in DDP it needs "
        "system.compression_enabled: true with system.compression_type: topk"
    )
    assert config_problem(_system()) is None
    context = RankContext(0, 1, 0, 1, "gloo", torch.device("cpu"))
    for config in (no_eval, no_topk):
        with pytest.raises(SetupError, match=r"^system\.adaptive_compression"):
            DDPTrainer(config, context)  # before anything else: no process group needed
        with pytest.raises(SetupError, match=r"^system\.adaptive_compression"):
            check_launch(config, local_world_size=1)
    for args, field in [
        (["--adaptive-compression", "--compression-enabled"], "training.eval_interval"),
        (["--adaptive-compression", "--eval-interval", "4"], "system.compression_enabled"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            run_ddp_training.main(args)
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert exit_.value.code == 2 and "error: --adaptive-compression" in err and field in err
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from src.launch import experiment as rx

    experiment, data = rx.split_experiment(
        {"experiment": {"controller": "on"}, "training": {"eval_interval": 4}, "system": {"architecture": "ddp"}}, "x"
    )
    with pytest.raises(rx.ExperimentError, match="system.compression_enabled: true with system.compression_type: topk"):
        rx.build_config(experiment, data, tmp_path)


# ----------------------------------------------------------------------------- two real ranks


def _config(root: Path, name: str, **training) -> dict:
    # 256 samples / (2 ranks x 16) = 8 steps per epoch, an evaluation every 2 steps. Never a rebound,
    # communication always "dominant", one stable evaluation is enough: rho halves at every evaluation
    # after the first, 0.1 -> 0.05 -> 0.025 -> 0.0125 -> 0.01 (the floor), then S_max alone relaxes.
    return {
        "training": {
            "dataset": "synthetic",
            "num_samples": 256,
            "batch_size": 16,
            "num_epochs": 2,
            "learning_rate": 0.05,
            "seed": 3,
            "eval_interval": 2,
            "checkpoint_interval_steps": 5,
            **training,
        },
        "system": {
            "architecture": "ddp",
            "num_workers": WORLD,
            "compression_enabled": True,
            "compression_type": "topk",
            "compression_ratio": 0.1,
            "adaptive_compression": True,
            "controller_policy": "rebound",
            "controller_rho_min": 0.01,
            "controller_rebound_threshold": 10.0,
            "controller_stable_evaluations": 1,
            "controller_communication_share": 0.0,
            "checkpoint_dir": str(root / name / "checkpoints"),
            "log_dir": str(root / name / "logs"),
        },
    }


def _train_recording_payloads(rank: int, world: int, config, resume: str | None) -> None:
    """Train one rank, saving each step's payload bytes (the hook's count) as ``payloads_<rank>.json``."""
    from src.ddp_trainer import DDPTrainer, RankContext

    payloads: list[int] = []

    def factory(module):
        hook = comm_hook_from_config(config.system, module, seed=config.training.seed)
        end_step = hook.end_step
        before = [0]

        def recorded():
            end_step()
            payloads.append(hook.stats.payload_bytes - before[0])
            before[0] = hook.stats.payload_bytes

        hook.end_step = recorded
        return hook

    DDPTrainer(
        config, RankContext(rank, world, rank, world, "gloo", torch.device("cpu")), resume=resume, comm_hook=factory
    ).run()
    Path(config.system.log_dir, f"payloads_{rank}.json").write_text(json.dumps(payloads))


def _session(rank: int, world: int, port: int, runs: list[tuple[dict, str | None]]) -> None:
    join_group(rank, world, port)
    try:
        for config, resume in runs:
            _train_recording_payloads(rank, world, validate_config(config), resume)
    finally:
        dist.destroy_process_group()


def _events(root: Path, name: str, kind: str, rank: int | None = None) -> list[dict]:
    from src.metrics import read_events

    folder = root / name / "logs" / (f"rank_{rank}" if rank is not None else "")
    return list(read_events(folder / "events.jsonl", kind))


def _assert_the_resumed_run_repeats_the_rest(tmp_path, rest, payload, final, parameters, controller):
    """Resumed from step 10 with the switch to 0.01 pending: the same decisions (``rest``, without their timings,
    measured anew), switches, payloads and final ``parameters`` as the uninterrupted run."""
    from src.common.checkpoint import load_checkpoint

    def decided(d: dict) -> tuple:  # a decision without its timings (measured anew)
        return (
            d["step"],
            d["action"],
            d["rho"],
            d["max_staleness"],
            d["inputs"]["losses_in_window"],
            d["inputs"]["stable_evaluations"],
        )

    assert [decided(d) for d in _events(tmp_path, "resumed", "controller")] == [decided(d) for d in rest]
    for rank in range(WORLD):
        assert [(e["step"], e["compression_ratio"]) for e in _events(tmp_path, "resumed", "control_applied", rank)] == [
            (11, 0.01)
        ]
        steps = json.loads((tmp_path / "resumed" / "logs" / f"payloads_{rank}.json").read_text())
        assert steps == [payload(0.01)] * 6
    again = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "ddp_final.pt")
    assert (
        max(float((again["model_state_dict"][k] - final["model_state_dict"][k]).abs().max()) for k in parameters) == 0.0
    )
    assert json.loads((tmp_path / "resumed" / "logs" / "summary.json").read_text())["controller"] == controller


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_rank_switches_in_the_same_step_to_the_payload_of_the_new_rho(tmp_path):
    from src.common.checkpoint import load_checkpoint
    from src.trainer import model_from_config

    mid_epoch = tmp_path / "adaptive" / "checkpoints" / "checkpoint_000010.pt"  # after the evaluation at step 10
    spawn_ranks(
        _session,
        WORLD,
        [(_config(tmp_path, "adaptive"), None), (_config(tmp_path, "resumed"), str(mid_epoch))],
        timeout=280,
    )

    decisions = _events(tmp_path, "adaptive", "controller")
    assert [d["step"] for d in decisions] == [2, 4, 6, 8, 10, 12, 14, 16]
    assert [d["rho"] for d in decisions] == [0.1, 0.05, 0.025, 0.0125, 0.01, 0.01, 0.01, 0.01]
    assert [d["action"] for d in decisions] == ["hold"] + ["compress_more"] * 7  # S_max goes on relaxing at rho's floor
    assert all(d["apply_from_step"] == d["step"] + 1 and d["inputs"]["timed_pushes"] == 2 for d in decisions)
    assert all(d["inputs"]["communication_share"] > 0 for d in decisions)  # the hook's exchange time was measured

    def rho_at(step: int, taken=decisions) -> float:
        return next((d["rho"] for d in reversed(taken) if d["apply_from_step"] <= step), 0.1)

    config = validate_config(_config(tmp_path, "adaptive"))
    final = load_checkpoint(tmp_path / "adaptive" / "checkpoints" / "ddp_final.pt")
    sizes = {name: p.numel() for name, p in model_from_config(config).named_parameters()}
    segments = [sum(sizes[name] for name in segment) for segment in final["extra"]["comm_hook"]["ranks"][0]["segments"]]
    assert sum(segments) == sum(sizes.values())

    def payload(rho: float) -> int:
        policy = CompressionPolicy(build_compressor("topk", ratio=rho, selection=config.system.topk_selection))
        return sum(len(policy.compress(torch.randn(numel), 0)) for numel in segments)

    switches = [
        (d["apply_from_step"], d["rho"]) for d in decisions[1:5]
    ]  # rho changed: 0.05 from step 5, ..., 0.01 from 11
    for rank in range(WORLD):
        applied = _events(tmp_path, "adaptive", "control_applied", rank)
        assert (
            [(e["step"], e["compression_ratio"]) for e in applied]
            == switches
            == [(5, 0.05), (7, 0.025), (9, 0.0125), (11, 0.01)]
        )
        assert [e["previous_compression_ratio"] for e in applied] == [0.1, 0.05, 0.025, 0.0125]
        steps = json.loads((tmp_path / "adaptive" / "logs" / f"payloads_{rank}.json").read_text())
        assert len(steps) == 16
        assert steps == [payload(rho_at(step)) for step in range(1, 17)], rank
    assert payload(0.01) < payload(0.1) / 5
    summary = json.loads((tmp_path / "adaptive" / "logs" / "summary.json").read_text())
    assert summary["controller"] == {
        "decisions": {"hold": 1, "compress_more": 7},
        "final_compression_ratio": 0.01,
        "final_max_staleness": 15,
    }
    assert (
        json.loads((tmp_path / "adaptive" / "logs" / "ddp_rank_1.json").read_text())["controller"]
        == summary["controller"]
    )
    saved = load_checkpoint(mid_epoch)["extra"]["controller"]
    assert (saved["compression_ratio"], saved["pending"]) == (0.0125, [11, 0.01, 12])  # decided at 10, due at 11

    _assert_the_resumed_run_repeats_the_rest(tmp_path, decisions[5:], payload, final, sizes, summary["controller"])
