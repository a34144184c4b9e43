"""Checkpoint format: weights_only loading, atomic writes, corruption detection and fallback."""

from __future__ import annotations

import pytest
import torch

from src.common import checkpoint as ckpt
from src.common.checkpoint import (
    CheckpointError,
    load_checkpoint,
    load_latest_good,
    make_checkpoint,
    numbered_checkpoints,
    numbered_path,
    prune_checkpoints,
    save_checkpoint,
)


def sample(step: int) -> dict:
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, float(step))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    return make_checkpoint(
        model_state_dict=model.state_dict(),
        optimizer_state_dict=optimizer.state_dict(),
        model_architecture="mlp",
        dataset="synthetic",
        epoch=step,
        step=step * 10,
        config={"training": {"seed": 1}},
        extra={"residuals": {"0": torch.zeros(2)}},
    )


def test_round_trip_loads_with_weights_only(tmp_path):
    path = save_checkpoint(tmp_path / "a.pt", sample(1))
    raw = torch.load(path, weights_only=True)
    assert set(ckpt.REQUIRED_KEYS) <= set(raw)
    loaded = load_checkpoint(path)
    assert loaded["epoch"] == 1 and loaded["step"] == 10
    torch.testing.assert_close(
        loaded["model_state_dict"]["weight"], torch.full((2, 3), 1.0) - 0.1 * torch.ones(2, 3) * 1.0, rtol=0, atol=1e-6
    )
    assert loaded["optimizer_state_dict"]["state"][0]["momentum_buffer"].shape == (2, 3)


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "a.pt", sample(1))
    before = path.read_bytes()

    def crash(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt.torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, sample(2))
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


def test_missing_keys_are_refused_on_save_and_load(tmp_path):
    incomplete = sample(1)
    del incomplete["dataset"]
    with pytest.raises(ValueError, match="dataset"):
        save_checkpoint(tmp_path / "x.pt", incomplete)
    torch.save({"model_state_dict": {}}, tmp_path / "y.pt")
    with pytest.raises(CheckpointError, match="lacks required keys"):
        load_checkpoint(tmp_path / "y.pt")


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_is_a_clear_error(tmp_path, damage):
    path = save_checkpoint(tmp_path / "a.pt", sample(1))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"\x00not a zip" * 50, "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_checkpoint(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope.pt")


def test_fallback_to_newest_good_checkpoint(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(numbered_path(tmp_path, step), sample(step))
    newest = numbered_path(tmp_path, 3)
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(RuntimeWarning, match="corrupt"):
        path, loaded = load_latest_good(tmp_path)
    assert path == numbered_path(tmp_path, 2) and loaded["epoch"] == 2
    # an explicit corrupt file also falls back to the numbered ones beside it
    final = save_checkpoint(tmp_path / "final.pt", sample(9))
    final.write_bytes(b"junk")
    with pytest.warns(RuntimeWarning):
        path, loaded = load_latest_good(final)
    assert loaded["epoch"] == 2


def test_nothing_usable_raises(tmp_path):
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        load_latest_good(tmp_path)


def test_prune_keeps_newest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(numbered_path(tmp_path, step), sample(step))
    prune_checkpoints(tmp_path, keep_last=2)
    assert numbered_checkpoints(tmp_path) == [numbered_path(tmp_path, 5), numbered_path(tmp_path, 4)]


def test_unfinished_run_checkpoint_resumes_only_an_interrupted_run(tmp_path):
    import os

    from src.common.checkpoint import final_checkpoint_path, numbered_path, unfinished_run_checkpoint

    assert unfinished_run_checkpoint(tmp_path, "parameter_server") is None  # nothing there: start afresh
    for number, mtime in ((10, 100), (20, 200)):
        numbered_path(tmp_path, number).write_bytes(b"x")
        os.utime(numbered_path(tmp_path, number), (mtime, mtime))
    assert unfinished_run_checkpoint(tmp_path, "parameter_server") == numbered_path(tmp_path, 20)  # crashed
    final = final_checkpoint_path(tmp_path, "parameter_server")
    final.write_bytes(b"x")
    os.utime(final, (300, 300))
    assert unfinished_run_checkpoint(tmp_path, "parameter_server") is None  # finished
    numbered_path(tmp_path, 5).write_bytes(b"x")  # a new run crashed after that one had finished
    os.utime(numbered_path(tmp_path, 5), (400, 400))
    assert unfinished_run_checkpoint(tmp_path, "parameter_server") == numbered_path(tmp_path, 5)
