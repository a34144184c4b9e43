"""Telemetry: events.jsonl is the source of truth; TensorBoard mirrors scalar events; summaries are complete."""

from __future__ import annotations

import json

import pytest

from src.metrics import SUMMARY_FIELDS, MetricsLogger, format_summary, read_events, write_summary


def test_scalars_go_to_events_and_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, worker=3) as log:
        log.event("run_start", note="hi")
        log.scalars("train", 5, {"loss": 0.5, "accuracy": 0.75})
    events = list(read_events(tmp_path / "events.jsonl"))
    assert [e["kind"] for e in events] == ["run_start", "train"]
    assert events[1]["step"] == 5 and events[1]["loss"] == 0.5 and events[1]["worker"] == 3
    assert all(isinstance(e["time"], float) for e in events)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(tmp_path))
    accumulator.Reload()
    assert [s.value for s in accumulator.Scalars("train/loss")] == [0.5]
    assert [s.step for s in accumulator.Scalars("train/accuracy")] == [5]


def test_torn_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"time": 1.0, "kind": "a"}) + "\n" + '{"time": 2.0, "ki')
    assert [e["kind"] for e in read_events(path)] == ["a"]


def test_summary_requires_every_field(tmp_path):
    summary = {name: 0 for name in SUMMARY_FIELDS}
    with pytest.raises(ValueError, match="checkpoint_path"):
        write_summary(tmp_path / "s.json", {k: v for k, v in summary.items() if k != "checkpoint_path"})
    summary.update(final_accuracy=0.5, final_loss=float("nan"))
    written = json.loads(write_summary(tmp_path / "s.json", summary).read_text())
    assert written["final_loss"] is None  # NaN is not JSON
    assert "Final Accuracy: 50.00%" in format_summary({**summary, "final_loss": 1.0})


def test_time_to_target_records_the_first_crossing_only():
    from src.metrics import TimeToTarget

    tracker = TimeToTarget(0.9)
    assert not tracker.observe(0.5, 1.0, 10)
    assert tracker.observe(0.91, 2.5, 20)
    assert not tracker.observe(0.95, 3.0, 30)
    assert tracker.fields() == {"target_accuracy": 0.9, "time_to_target_s": 2.5, "time_to_target_step": 20}
    assert TimeToTarget(None).fields() == {
        "target_accuracy": None,
        "time_to_target_s": None,
        "time_to_target_step": None,
    }
    assert not TimeToTarget(None).observe(1.0, 1.0, 1)


def test_events_recorded_for_later_are_written_in_order_by_the_next_write_or_flush(tmp_path):
    """The parameter server records a push's events under its lock and writes them once the reply is out:
    nothing is in the file before, the order of recording is the order of the lines, close writes the rest."""
    logger = MetricsLogger(tmp_path, tensorboard=False, worker=-1)
    path = tmp_path / "events.jsonl"
    first = logger.event("push", later=True, version=1)
    logger.event("update", later=True, version=2)
    assert first["kind"] == "push" and first["worker"] == -1  # the event as it will be written, at once
    assert list(read_events(path)) == []
    logger.event("checkpoint", version=2)  # a plain write goes after what was recorded before it
    assert [(e["kind"], e["version"]) for e in read_events(path)] == [("push", 1), ("update", 2), ("checkpoint", 2)]
    logger.event("push", later=True, version=3)
    logger.flush()
    assert [e["version"] for e in read_events(path)] == [1, 2, 2, 3]
    logger.event("push", later=True, version=4)
    logger.close()
    assert [e["version"] for e in read_events(path)] == [1, 2, 2, 3, 4]
