"""Timelines: Chrome trace-event JSON from spans, torch profiler labels, a traced baseline run, merging across
processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict

import pytest
import torch

from src.metrics import read_events
from src.telemetry import tracing
from tests.ps_fixtures import ROOT
from tests.test_config_cli import _runner

pytestmark = pytest.mark.timeout(120)


def complete_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X"]


def assert_spans_nest(events: list[dict]) -> None:
    """Within each thread, two spans are either disjoint or one contains the other (as ``with`` blocks do)."""
    by_thread = defaultdict(list)
    for e in complete_events(events):
        assert (
            isinstance(e["ts"], (int, float))
            and e["dur"] >= 0
            and isinstance(e["pid"], int)
            and isinstance(e["tid"], int)
        )
        by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    slack = 0.01  # microseconds: ts and dur are rounded to nanoseconds separately
    for spans in by_thread.values():
        open_spans: list[tuple[float, float, str]] = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_spans and open_spans[-1][1] <= start + slack:
                open_spans.pop()
            if open_spans:
                assert end <= open_spans[-1][1] + slack, (
                    f"{name} [{start}, {end}] overlaps {open_spans[-1]} without nesting"
                )
            open_spans.append((start, end, name))


def test_spans_from_threads_nest_and_the_file_is_trace_event_json(tmp_path):
    path = tmp_path / "trace.json"
    barrier = threading.Barrier(2)

    def work(label: str) -> None:
        barrier.wait()  # both threads inside the trace at once
        with tracing.span("outer", who=label):
            for step in range(3):
                with tracing.span("inner", step=step):
                    sum(range(1000))

    with tracing.trace_to(path, "unit test") as tracer:
        assert tracing.active() is tracer
        threads = [threading.Thread(target=work, args=(name,), name=name) for name in ("left", "right")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert tracing.active() is None

    events = json.loads(path.read_text())  # closed: plain JSON
    assert_spans_nest(events)
    spans = complete_events(events)
    assert Counter(e["name"] for e in spans) == {"outer": 2, "inner": 6}
    assert len({e["tid"] for e in spans}) == 2 and {e["pid"] for e in events} == {tracer.pid}
    names = {e["args"]["name"] for e in events if e["ph"] == "M"}
    assert names == {"unit test", "left", "right"}  # process and thread names for the viewer
    assert sorted(e["args"]["step"] for e in spans if e["name"] == "inner") == [0, 0, 1, 1, 2, 2]


def test_spans_cost_nothing_when_off_and_label_a_users_profiler_run(tmp_path):
    assert tracing.span("anything", step=1) is tracing._NO_SPAN  # no tracer, no profiler: the shared no-op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        with tracing.span("dts_user_visible_span"):
            torch.ones(8).add_(1)
    assert "dts_user_visible_span" in {event.key for event in profiler.key_averages()}
    assert not list(tmp_path.iterdir())


def test_a_killed_process_leaves_a_readable_trace(tmp_path):
    path = tmp_path / "trace.json"
    tracer = tracing.Tracer(path, "killed")
    with tracer.span("done"):
        pass
    tracer._handle.flush()  # what the OS has when the process dies without closing the file
    events = tracing.read_trace(path)
    assert [e["name"] for e in complete_events(events)] == ["done"]
    tracer.close()
    (tmp_path / "bad.json").write_text('{"not": "a trace"}')
    with pytest.raises(ValueError, match="bad.json: not a trace-event JSON file"):
        tracing.read_trace(tmp_path / "bad.json")


_TRACED_PROCESS = """
import sys
from src.telemetry import tracing
with tracing.trace_to(sys.argv[1], sys.argv[2]):
    with tracing.span("work"):
        sum(range(100000))
"""


def test_merged_traces_of_two_processes_keep_both_pids_on_one_clock(tmp_path):
    before_us = time.time() * 1e6
    for name in ("first", "second"):  # the second process starts after the first has ended
        done = subprocess.run(
            [sys.executable, "-c", _TRACED_PROCESS, str(tmp_path / name / "trace.json"), name],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    after_us = time.time() * 1e6
    merged = tracing.load_traces(tmp_path)  # every trace under the folder, merged
    names = {e["pid"]: e["args"]["name"] for e in merged if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["first", "second"] and len(names) == 2
    work = {names[e["pid"]]: e for e in complete_events(merged)}
    # One wall clock: each span lies within the test's own wall-clock readings, in the order they ran.
    assert (
        before_us
        <= work["first"]["ts"]
        < work["first"]["ts"] + work["first"]["dur"]
        <= work["second"]["ts"]
        <= after_us
    )
    summary = tracing.describe_trace(merged)
    assert [p["name"] for p in summary["processes"]] == ["first", "second"] and summary["spans"] == 2
    again = tracing.merge_traces([merged, merged])  # the same pids twice (another run, another machine) stay apart
    assert len({e["pid"] for e in again}) == 4


def test_loading_traces_reads_a_file_and_names_what_is_not_a_trace(tmp_path):
    events = [{"name": "step", "ph": "X", "ts": 1.0, "dur": 2.0, "pid": 7, "tid": 1}]
    path = tracing.write_trace(tmp_path / "run" / "trace.json", events)
    assert tracing.load_traces(path) == events
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no trace.json under it \(train with --trace\)"):
        tracing.load_traces(tmp_path / "empty")
    with pytest.raises(ValueError, match="absent.json: no such file or folder"):
        tracing.load_traces(tmp_path / "absent.json")
    (tmp_path / "run" / "trace.1.json").write_text("{}")
    with pytest.raises(ValueError, match=r"trace\.1\.json: not a trace-event JSON file"):
        tracing.load_traces(tmp_path / "run")


def test_a_traced_baseline_run_has_one_span_per_step_nested_in_its_epochs(tmp_path, capsys):
    logs = tmp_path / "logs"
    status = _runner("run_baseline_training.py")(
        [
            *(
                "--dataset mnist_5k --num-epochs 2 --max-train-samples 320 --max-test-samples 100 "
                "--eval-interval 3 --trace --checkpoint-dir"
            ).split(),
            str(tmp_path / "ckpt"),
            "--log-dir",
            str(logs),
        ]
    )
    assert status == 0, capsys.readouterr().err
    summary = json.loads((logs / "summary.json").read_text())
    events = json.loads((logs / "trace.json").read_text())
    assert_spans_nest(events)
    spans = complete_events(events)
    counts = Counter(e["name"] for e in spans)
    assert summary["steps"] == 10
    assert counts["forward_backward"] == counts["optimizer_step"] == summary["steps"]
    assert [e["args"]["step"] for e in spans if e["name"] == "forward_backward"] == list(range(1, summary["steps"] + 1))
    assert counts["epoch"] == summary["epochs"]
    assert counts["evaluate"] == len(list(read_events(logs / "events.jsonl", kind="eval")))  # steps 3, 5, 6, 9, 10
    assert (
        counts["checkpoint"] == len(list(read_events(logs / "events.jsonl", kind="checkpoint"))) + 1
    )  # + the final one
    for epoch in (e for e in spans if e["name"] == "epoch"):
        inside = [
            e for e in spans if e["name"] == "forward_backward" and epoch["ts"] <= e["ts"] <= epoch["ts"] + epoch["dur"]
        ]
        assert len(inside) == summary["steps"] // summary["epochs"]
