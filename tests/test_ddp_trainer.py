"""DDPTrainer contracts on a real 2-rank gloo group.

One spawned session runs several short trainings back to back in the same process group (a group
per test would cost a spawn each); the tests assert on their checkpoints and summaries:

* 2 ranks with batch b == the baseline with batch 2b (97 samples: short and empty last steps too);
* the ring hook == the backend's allreduce; every step's byte count (the ring's, the compressed
  hooks', and the estimate for the backend's allreduce) matches what the kernel saw each rank send
  (:class:`tests.ddp_fixtures.StepBytes`), not a formula of the code under test;
* resume continues the uninterrupted trajectory exactly, comm hook residuals included (and a resume
  whose checkpoint lost the hook state does not: the state matters), also from a checkpoint taken
  mid-epoch (``checkpoint_interval_steps``);
* evaluation every ``eval_interval`` steps and the time to target accuracy;
* compressed hooks send ~2 x ratio (top-k) or ~1/4 (8-bit) of the dense bytes; warm-up steps are dense;
* (slow) top-k 0.1 with error feedback reaches >= 90% on mnist_5k in 2 epochs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.common.checkpoint import load_checkpoint, save_checkpoint
from src.config import validate_config
from src.ddp.comm_hooks import comm_hook_from_config
from src.ddp.rank import RankContext
from src.ddp_trainer import DDPTrainer
from src.metrics import SUMMARY_FIELDS, read_events
from src.trainer import BaselineTrainer, model_from_config
from tests.ddp_fixtures import StepBytes, join_group, spawn_ranks

WORLD = 2
#: gloo's framing on top of the tensors of one step (~300 bytes per message, a few messages per bucket).
FRAMING_BYTES = 4096


def _config(root: Path, name: str, training: dict | None = None, system: dict | None = None) -> dict:
    return {
        "training": {
            "dataset": "synthetic",
            "num_samples": 97,
            "batch_size": 16,
            "num_epochs": 2,
            "learning_rate": 0.05,
            "checkpoint_interval": 1,
            "seed": 3,
            **(training or {}),
        },
        "system": {
            "architecture": "ddp",
            "num_workers": WORLD,
            "checkpoint_dir": str(root / name / "checkpoints"),
            "log_dir": str(root / name / "logs"),
            **(system or {}),
        },
    }


TOPK = {"compression_enabled": True, "compression_type": "topk", "compression_ratio": 0.1}


def _plan(root: Path) -> list[tuple]:
    topk_training = {"num_samples": 256}  # 8 steps per epoch
    first_epoch = root / "topk" / "checkpoints" / "checkpoint_000008.pt"
    every = {**topk_training, "checkpoint_interval_steps": 5, "eval_interval": 3, "target_accuracy": 0.3}
    return [
        ("train", _config(root, "default"), None),
        ("train", _config(root, "final_eval_only", {"eval_at_epoch_ends": False}), None),
        ("train", _config(root, "ring", system={"allreduce": "ring"}), None),
        ("train", _config(root, "topk", topk_training, TOPK), None),
        ("train", _config(root, "topk_resumed", topk_training, TOPK), str(first_epoch)),
        ("strip_hook_state", str(first_epoch), str(root / "stateless.pt")),
        ("train", _config(root, "topk_stateless", topk_training, TOPK), str(root / "stateless.pt")),
        ("train", _config(root, "topk_every", every, TOPK), None),  # checkpoints at 5, 8, 10, 15, 16
        (
            "train",
            _config(root, "topk_mid_epoch", topk_training, TOPK),
            str(root / "topk_every" / "checkpoints" / "checkpoint_000010.pt"),
        ),
        (
            "train",
            _config(
                root,
                "quantization",
                {"num_samples": 256, "num_epochs": 1},
                {"compression_enabled": True, "compression_type": "quantization", "warmup_steps": 3},
            ),
            None,
        ),
    ]


def _train_counting_bytes(rank: int, world: int, config, resume: str | None) -> None:
    """Train one rank, saving each step's bytes (hook's count and the kernel's) as ``step_bytes_<rank>.json``."""
    counter = StepBytes(lambda module: comm_hook_from_config(config.system, module, seed=config.training.seed))
    context = RankContext(rank, world, rank, world, "gloo", torch.device("cpu"))
    DDPTrainer(config, context, resume=resume, comm_hook=counter.wrap).run()
    Path(config.system.log_dir, f"step_bytes_{rank}.json").write_text(json.dumps(counter.steps))


def _session(rank: int, world: int, port: int, plan: list[tuple]) -> None:
    join_group(rank, world, port)
    try:
        for action, first, second in plan:
            if action == "train":
                _train_counting_bytes(rank, world, validate_config(first), second)
            else:  # a copy of a checkpoint without the comm hook's state
                if rank == 0:
                    checkpoint = load_checkpoint(first)
                    checkpoint["extra"].pop("comm_hook")
                    save_checkpoint(second, checkpoint)
                dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ddp_runs")
    spawn_ranks(_session, WORLD, _plan(root))
    return root


def _final(root: Path, name: str) -> dict:
    return load_checkpoint(root / name / "checkpoints" / "ddp_final.pt")


def _summary(root: Path, name: str, rank: int | None = None) -> dict:
    file = "summary.json" if rank is None else f"ddp_rank_{rank}.json"
    return json.loads((root / name / "logs" / file).read_text())


def _step_bytes(root: Path, name: str, rank: int) -> list[dict]:
    return json.loads((root / name / "logs" / f"step_bytes_{rank}.json").read_text())


def _max_difference(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.slow
def test_two_ranks_match_one_process_with_twice_the_batch(runs, tmp_path):
    config = validate_config(
        _config(tmp_path, "baseline", {"batch_size": 32}, {"architecture": "baseline", "num_workers": 1})
    )
    BaselineTrainer(config).run()
    baseline = load_checkpoint(tmp_path / "baseline" / "checkpoints" / "baseline_final.pt")
    ddp = _final(runs, "default")
    assert ddp["step"] == baseline["step"] == 2 * 4  # 97 samples / (2 x 16): 3 full steps + 1 sample
    start = model_from_config(config).state_dict()
    assert _max_difference(ddp["model_state_dict"], start) > 1e-2  # it did train
    assert _max_difference(ddp["model_state_dict"], baseline["model_state_dict"]) <= 1e-5
    momentum = [s["momentum_buffer"] for s in ddp["optimizer_state_dict"]["state"].values()]
    reference = [s["momentum_buffer"] for s in baseline["optimizer_state_dict"]["state"].values()]
    assert max(float((a - b).abs().max()) for a, b in zip(momentum, reference)) <= 1e-5


@pytest.mark.slow
def test_a_rank_whose_shard_ran_out_takes_empty_steps(runs):
    ranks = [_summary(runs, "default", rank) for rank in range(WORLD)]
    # 97 samples: rank 0 owns 49, rank 1 owns 48 and takes an empty 4th step each epoch
    assert [r["samples_processed"] for r in ranks] == [2 * 49, 2 * 48]
    assert [r["steps"] for r in ranks] == [8, 8]
    assert _summary(runs, "default")["samples_processed"] == 2 * 97


def _assert_counts_match_the_wire(root: Path, name: str) -> list[list[dict]]:
    """Every step of every rank: the bytes the run counted are what the kernel saw it send, give or
    take gloo's framing; the rank summaries hold the sum. Returns each rank's steps."""
    ranks = []
    for rank in range(WORLD):
        steps = _step_bytes(root, name, rank)
        assert len(steps) == _summary(root, name, rank)["steps_this_run"]
        for index, step in enumerate(steps):
            assert 0 <= step["measured"] - step["claimed"] <= FRAMING_BYTES, (name, rank, index, step)
        assert _summary(root, name, rank)["bytes_sent"] == sum(step["claimed"] for step in steps)
        ranks.append(steps)
    return ranks


@pytest.mark.slow
def test_ring_hook_matches_backend_allreduce_and_both_byte_counts_match_the_wire(runs):
    assert (
        _max_difference(_final(runs, "ring")["model_state_dict"], _final(runs, "default")["model_state_dict"]) <= 1e-6
    )
    ring, default = _summary(runs, "ring"), _summary(runs, "default")
    assert ring["bytes_accounting"] == "measured" and default["bytes_accounting"] == "estimated"
    # The ring hook counts the chunks it sends; the built-in allreduce's figure is an estimate
    # (2(N-1)/N of the gradient). The kernel's counts check both: gloo's allreduce on 2 ranks does
    # send what the estimate says.
    _assert_counts_match_the_wire(runs, "ring")
    _assert_counts_match_the_wire(runs, "default")
    gradient_bytes = 4 * sum(
        p.numel() for p in model_from_config(validate_config(_config(Path("."), "x"))).parameters()
    )
    assert ring["bytes_sent_per_rank_per_step"] == pytest.approx(gradient_bytes, rel=1e-4)  # 2 ranks: 2(N-1)/N = 1


@pytest.mark.slow
def test_resume_continues_the_same_trajectory_hook_state_included(runs):
    uninterrupted, resumed = _final(runs, "topk"), _final(runs, "topk_resumed")
    stateless = _final(runs, "topk_stateless")
    assert resumed["step"] == uninterrupted["step"]
    assert _max_difference(resumed["model_state_dict"], uninterrupted["model_state_dict"]) <= 1e-6
    # the same resume without the residuals lands elsewhere: the hook state is what kept it on track
    assert _max_difference(stateless["model_state_dict"], uninterrupted["model_state_dict"]) > 1e-4
    saved = load_checkpoint(runs / "topk" / "checkpoints" / "checkpoint_000008.pt")["extra"]["comm_hook"]
    assert saved["name"] == "topk" and saved["world_size"] == WORLD and len(saved["ranks"]) == WORLD
    for state in saved["ranks"]:
        assert state["step"] == 8  # 256 samples / (2 x 16) per epoch
        residuals = state["error_feedback"]["residuals"]
        assert set(residuals) == {
            name for name, _ in model_from_config(validate_config(_config(Path("."), "x"))).named_parameters()
        }
        assert max(float(r.abs().max()) for r in residuals.values()) > 0
    first, second = (saved["ranks"][r]["error_feedback"]["residuals"]["classifier.1.weight"] for r in range(WORLD))
    assert not torch.equal(first, second)  # residuals are per rank


@pytest.mark.slow
def test_mid_epoch_checkpoint_resumes_exactly_data_order_and_hook_state(runs):
    uninterrupted = _final(runs, "topk")
    # evaluating every 3 steps and checkpointing every 5 leaves the training itself untouched ...
    every = _final(runs, "topk_every")
    assert _max_difference(every["model_state_dict"], uninterrupted["model_state_dict"]) == 0.0
    # ... and resuming from step 10, 2 steps into epoch 2, lands exactly where the uninterrupted run did
    mid = load_checkpoint(runs / "topk_every" / "checkpoints" / "checkpoint_000010.pt")
    assert (mid["epoch"], mid["step"], mid["extra"]["epoch_step"], mid["extra"]["world_size"]) == (1, 10, 2, WORLD)
    assert mid["extra"]["comm_hook"]["ranks"][0]["step"] == 10
    resumed = _final(runs, "topk_mid_epoch")
    assert resumed["step"] == uninterrupted["step"] == 16
    assert _max_difference(resumed["model_state_dict"], uninterrupted["model_state_dict"]) == 0.0
    summary = _summary(runs, "topk_mid_epoch")
    assert (summary["steps_this_run"], summary["samples_processed"]) == (6, 256 - 2 * 2 * 16)
    # numbered by step, newest three kept
    names = sorted(p.name for p in (runs / "topk_every" / "checkpoints").iterdir())
    assert names == ["checkpoint_000010.pt", "checkpoint_000015.pt", "checkpoint_000016.pt", "ddp_final.pt"]


@pytest.mark.slow
def test_eval_every_k_steps_and_time_to_target(runs):
    summary = _summary(runs, "topk_every")
    evals = list(read_events(runs / "topk_every" / "logs" / "events.jsonl", "eval"))
    assert [e["step"] for e in evals] == [3, 6, 8, 9, 12, 15, 16]
    first_good = next(e for e in evals if e["test_accuracy"] >= 0.3)
    assert (summary["target_accuracy"], summary["time_to_target_step"]) == (0.3, first_good["step"])
    assert 0 < summary["time_to_target_s"] <= summary["train_time_s"]
    assert summary["clock"] == "real"
    assert summary["training_clock"] == "from the first training step; evaluation and checkpoints excluded"
    # every rank's summary agrees (the clock is the slowest rank's at each evaluation)
    assert _summary(runs, "topk_every", 1)["time_to_target_s"] == summary["time_to_target_s"]
    assert _summary(runs, "topk")["time_to_target_s"] is None  # no target asked


@pytest.mark.slow
def test_compressed_hooks_count_what_goes_on_the_wire(runs):
    dense = 4 * sum(p.numel() for p in model_from_config(validate_config(_config(Path("."), "x"))).parameters())
    topk = _assert_counts_match_the_wire(runs, "topk")
    assert _summary(runs, "topk")["bytes_accounting"] == "measured"
    # 8 bytes per kept entry at ratio 0.1: ~0.2 of the dense bytes, as measured by the kernel
    assert all(step["measured"] / dense < 0.21 for steps in topk for step in steps)

    quantization = _assert_counts_match_the_wire(runs, "quantization")
    assert (
        _summary(runs, "quantization")["bytes_accounting"] == "mixed"
    )  # 3 warm-up steps through the backend's allreduce
    for steps in quantization:
        assert all(step["measured"] >= dense for step in steps[:3])  # warm-up: dense
        assert all(step["measured"] / dense < 0.26 for step in steps[3:])  # 1 byte per entry + scales


@pytest.mark.slow
def test_outputs_per_rank_and_for_the_run(runs):
    logs = runs / "default" / "logs"
    summary = _summary(runs, "default")
    assert set(SUMMARY_FIELDS) <= set(summary)
    assert summary["architecture"] == "ddp" and summary["num_workers"] == WORLD
    for rank in range(WORLD):
        rank_summary = _summary(runs, "default", rank)
        assert set(SUMMARY_FIELDS) <= set(rank_summary) and rank_summary["rank"] == rank
        assert list((logs / f"rank_{rank}").glob("events.out.tfevents.*"))
        train = list(read_events(logs / f"rank_{rank}" / "events.jsonl", "train"))
        assert train and all(event["rank"] == rank for event in train)
    evals = list(read_events(logs / "events.jsonl", "eval"))
    assert [e["epoch"] for e in evals] == [1, 2]
    assert evals[-1]["test_accuracy"] == summary["final_accuracy"]
    checkpoints = sorted(p.name for p in (runs / "default" / "checkpoints").iterdir())
    assert checkpoints == ["checkpoint_000004.pt", "checkpoint_000008.pt", "ddp_final.pt"]  # numbered by step
    torch.load(runs / "default" / "checkpoints" / "ddp_final.pt", weights_only=True)


@pytest.mark.slow
def test_without_epoch_evaluations_only_the_runs_end_is_evaluated_and_training_is_the_same(runs):
    evals = list(read_events(runs / "final_eval_only" / "logs" / "events.jsonl", "eval"))
    assert [e["epoch"] for e in evals] == [2]
    assert evals[0]["test_accuracy"] == _summary(runs, "final_eval_only")["final_accuracy"]
    final_only, every_epoch = _final(runs, "final_eval_only"), _final(runs, "default")
    assert _max_difference(final_only["model_state_dict"], every_epoch["model_state_dict"]) == 0.0


@pytest.mark.slow
def test_compression_ratio_is_logged_per_step_when_compressing(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for rank in range(WORLD):
        topk = list(read_events(runs / "topk" / "logs" / f"rank_{rank}" / "events.jsonl", "train"))
        # 8 bytes per kept entry at ratio 0.1, biases whole: a bit under 5x
        assert topk and all(4.5 < event["compression_ratio"] < 5.0 for event in topk)
        plain = list(read_events(runs / "default" / "logs" / f"rank_{rank}" / "events.jsonl", "train"))
        assert plain and all("compression_ratio" not in event for event in plain)
        accumulator = EventAccumulator(str(runs / "topk" / "logs" / f"rank_{rank}"))
        accumulator.Reload()
        logged = accumulator.Scalars("train/compression_ratio")
        assert [e.step for e in logged] == [event["step"] for event in topk]


# ----------------------------------------------------------------------------- convergence


def _mnist_session(rank: int, world: int, port: int, config: dict) -> None:
    join_group(rank, world, port)
    try:
        _train_counting_bytes(rank, world, validate_config(config), None)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_topk_with_error_feedback_converges_on_mnist_5k(tmp_path):
    # Global batch 64 (32 per rank): the baseline's default batch, 126 steps in 2 epochs.
    config = _config(
        tmp_path, "mnist", {"dataset": "mnist_5k", "batch_size": 32, "learning_rate": 0.05, "seed": 0}, TOPK
    )
    spawn_ranks(_mnist_session, WORLD, config)
    assert _summary(tmp_path, "mnist")["final_accuracy"] >= 0.90
    dense = 4 * sum(p.numel() for p in model_from_config(validate_config(config)).parameters())
    for steps in _assert_counts_match_the_wire(tmp_path, "mnist"):
        assert all(step["measured"] / dense < 0.21 for step in steps)
