"""Consolidated performance report: every architecture's run side by side, as JSON, Markdown and HTML.

From the runs :mod:`src.reports.inputs` reads (run summaries, per-worker and per-rank figures, event
logs) and, optionally, ``reports/bench.json`` from ``scripts/bench_all.py``. The pieces:

* :func:`build_report`: pure, from :class:`~src.reports.inputs.Run` objects to the report dict (the
  JSON report). Numbers are copied from the summaries, never recomputed differently; what a summary
  lacks is ``None`` and rendered as "not recorded". Definitions of throughput, bytes and speedup travel
  in the report.
* :func:`write_report`: the JSON, and beside it a Markdown page and a self-contained HTML page
  (:mod:`src.reports.render`) of the report's sections (:mod:`src.reports.sections`), with the plots
  drawn by :mod:`src.reports.plots` (headless matplotlib).
* :func:`merge_run_traces`: the ``--trace`` runs' timelines merged into one file the report links.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from src.reports.inputs import ReportInputError, Run
from src.reports.names import NOT_RECORDED, PLOTS
from src.reports.render import to_html, to_markdown
from src.reports.sections import report_blocks

REPORT_VERSION = 1
FAULT_KINDS = (
    "worker_failed",
    "work_reassigned",
    "worker_restarted",
    "worker_rejoined",
    "server_failed",
    "server_restarted",
    "server_recovered",
    "rank_failed",
    "rank_restarted",
    "checkpoint_failed",
)


def _training_clock(summary: dict[str, Any]) -> str:
    """What a run's training time measures (and, for a virtual-time run, that it was computed, not measured)."""
    clock = summary.get("clock")
    if clock not in (None, "real", "virtual"):
        return clock  # a summary from before the clock field said real or virtual: it held the description
    described = summary.get("training_clock") or _TRAINING_CLOCKS[summary["architecture"]]
    return f"{described}; virtual time, from the cost model" if clock == "virtual" else described


_TRAINING_CLOCKS = {
    "baseline": "the epoch loops only (evaluation and checkpoints excluded)",
    "parameter_server": "from the first worker's registration to the last worker's finish",
    "ddp": "the slowest rank's epoch loops (evaluation and checkpoints excluded)",
}
DEFINITIONS = {
    "throughput": "training samples processed by all workers/ranks together (each sample counted once, by "
    "whoever computed its gradient) divided by the run's training time (train_time_s, the "
    "training clock of the summary). The same figure every runner prints.",
    "speedup": "throughput over the baseline run's throughput in this report (with the same data and epochs "
    "this equals baseline train time / train time).",
    "bytes": "every byte a worker or rank put on the wire (sent) or took off it (received), summed over all "
    "workers/ranks of the run. Parameter server: the serialized gRPC messages (pushes up, parameters "
    "down). DDP: the gradient exchange; measured from what the ring and compression hooks send, "
    "estimated as 2(N-1)/N x gradient bytes per rank for the backend's own allreduce (its traffic "
    "cannot be seen), which the table marks 'estimated'. Baseline: nothing crosses a wire.",
    "bytes_per_step": "bytes one worker/rank sends (receives) for one training step on its batch: total bytes / "
    "(steps of all workers or ranks together).",
    "time_split": "seconds per worker/rank, mean over workers: gradient (forward + backward), compression "
    "(error feedback + compress), communication (push and pull round trips, or the comm hook). "
    "The backend allreduce of DDP overlaps the backward pass and is not separable from it.",
    "exposed_communication": "seconds per worker/rank, mean over workers, that training stood still waiting for "
    "communication (not hidden by computation); its share is of the run's training time. "
    "Parameter server: the worker's time blocked on each push's reply (all of its "
    "communication time: a worker computes nothing meanwhile; in sync mode it includes the "
    "barrier wait). DDP: each step's wait at the end of the backward pass, from the last "
    "gradient computed until every bucket's exchange is done (any allreduce, hook or not). "
    "Baseline: 0, nothing is communicated. See src/telemetry/exposed_comm.py.",
    "compression_ratio": "uncompressed gradient bytes / bytes of the payloads actually sent (1 = uncompressed).",
    "accuracy_vs_time": "test accuracy of each evaluation event against seconds since the run's run_start "
    "event (its main log): process start-up is included, so the curves share one clock.",
    "time_to_target": "the summary's own time to target accuracy (seconds on its training clock) when it "
    "records one; otherwise the first evaluation at or above --target-accuracy on the "
    "accuracy-vs-wall-time curve.",
    "staleness": "server version at arrival minus the version the worker computed on, per push.",
}


# ----------------------------------------------------------------------------- building the report (pure)


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _describe(summary: Mapping[str, Any]) -> str:
    """A short run label: ``baseline``, ``ps sync``, ``ps async topk(0.1)``, ``ddp ring``, ``ddp topk``."""
    architecture, compression = summary["architecture"], summary.get("compression") or "none"
    if architecture == "baseline":
        return "baseline"
    if architecture == "parameter_server":
        parts = ["ps", str(summary.get("aggregation_mode", "sync"))]
    else:
        parts = ["ddp", "ring" if summary.get("allreduce") == "ring" else "allreduce"]
    if compression != "none":
        ratio = summary.get("compression_ratio")
        parts.append(
            f"{compression}({ratio:g})"
            if architecture == "ddp" and isinstance(ratio, (int, float))
            else str(compression)
        )
    return " ".join(parts)


def run_labels(runs: Sequence[Run]) -> list[str]:
    """One distinct label per run: its own or :func:`_describe`; repeats get their folder, then a number."""
    described = [run.label or _describe(run.summary) for run in runs]
    labels = list(described)
    for index, run in enumerate(runs):
        folder = Path(run.origin).parent.name
        if described.count(described[index]) > 1 and folder:
            labels[index] = f"{described[index]} [{folder}]"
    with_folders, seen = list(labels), {}
    for index, label in enumerate(with_folders):
        if with_folders.count(label) > 1:
            seen[label] = seen.get(label, 0) + 1
            labels[index] = f"{label} #{seen[label]}"
    return labels


def _main_events(run: Run, kind: str) -> list[dict[str, Any]]:
    return [e for e in run.events if e["kind"] == kind and e.get("source", "") == (run.main_source or "")]


def _run_start_time(run: Run) -> float | None:
    starts = [e["time"] for e in _main_events(run, "run_start")]
    if starts:
        return starts[0]
    return run.events[0]["time"] if run.events else None


def _accuracy_curve(run: Run) -> list[dict[str, Any]]:
    start = _run_start_time(run)
    curve = []
    for event in _main_events(run, "eval"):
        if _number(event.get("test_accuracy")) is None:
            continue
        curve.append(
            {
                "seconds": event["time"] - start,
                "accuracy": event["test_accuracy"],
                "loss": event.get("test_loss"),
                "step": event.get("step"),
                "epoch": event.get("epoch"),
            }
        )
    return curve


def _time_to_target(run: Run, curve: list[dict[str, Any]], target: float | None) -> dict[str, Any]:
    s = run.summary
    if s.get("target_accuracy") is not None:
        return {
            "target_accuracy": s["target_accuracy"],
            "seconds": s.get("time_to_target_s"),
            "step": s.get("time_to_target_step"),
            "source": "summary (training clock)",
            "reached": s.get("time_to_target_s") is not None,
        }
    if target is None:
        return {"target_accuracy": None, "seconds": None, "step": None, "source": None, "reached": None}
    hit = next((point for point in curve if point["accuracy"] >= target), None)
    return {
        "target_accuracy": target,
        "seconds": hit["seconds"] if hit else None,
        "step": hit["step"] if hit else None,
        "source": "eval events (seconds since run_start)" if curve else None,
        "reached": (hit is not None) if curve else None,
    }


def _split_value(run: Run, key: str) -> float | None:
    value = _number(run.summary.get(key))
    if value is not None:
        return value
    members = run.workers or run.ranks
    if members and all(_number(m.get(key)) is not None for m in members):
        return sum(float(m[key]) for m in members)
    return None


def _time_split(run: Run) -> dict[str, Any]:
    s = run.summary
    count = len(run.workers) or len(run.ranks) or int(s.get("num_workers") or 1)
    totals = {key: _split_value(run, key) for key in ("gradient_time_s", "compression_time_s", "communication_time_s")}
    note = None
    if (
        s["architecture"] == "ddp"
        and s.get("comm_hook", "allreduce") == "allreduce"
        and s.get("bytes_accounting") == "estimated"
    ):
        totals["communication_time_s"] = None  # the hook timer reads 0: the backend's allreduce runs unseen
        note = (
            "backend allreduce: overlapped with the backward pass, not separable (inside gradient time when recorded)"
        )
    per_worker = {key: (value / count if value is not None else None) for key, value in totals.items()}
    recorded = [v for v in per_worker.values() if v is not None]
    total = sum(recorded) if recorded else None
    shares = {key: (value / total if value is not None and total else None) for key, value in per_worker.items()}
    # Exposed communication is a part of the time above (of communication, or for DDP of the backward
    # pass), so it is not in the shares: its own share is of the training time.
    exposed = 0.0 if s["architecture"] == "baseline" else _split_value(run, "exposed_communication_s")
    exposed_per_worker = exposed / count if exposed is not None else None
    train_time = _number(s.get("train_time_s"))
    return {
        "workers": count,
        "total_s": totals,
        "per_worker_s": per_worker,
        "shares": shares,
        "note": note,
        "exposed_communication_s": exposed_per_worker,
        "exposed_share_of_train_time": exposed_per_worker / train_time
        if exposed_per_worker is not None and train_time
        else None,
    }


def _bytes(run: Run) -> dict[str, Any]:
    s = run.summary
    architecture = s["architecture"]
    sent, received = s["bytes_sent"], s["bytes_received"]
    steps = None
    if architecture == "baseline":
        steps, accounting = s.get("steps"), "none (no communication)"
    elif architecture == "parameter_server":
        if run.workers and all(isinstance(w.get("steps"), int) for w in run.workers):
            steps = sum(w["steps"] for w in run.workers)
        elif s.get("pushes_applied") is not None:
            steps = int(s["pushes_applied"]) + int(s.get("pushes_rejected") or 0)
        accounting = "measured (serialized gRPC messages)"
    else:
        world = s.get("world_size", s["num_workers"])
        per_rank_steps = s.get("steps_this_run", s.get("steps"))
        steps = world * per_rank_steps if per_rank_steps is not None else None
        accounting = str(s.get("bytes_accounting", NOT_RECORDED))
    per_step_sent = s.get("bytes_sent_per_rank_per_step") if architecture == "ddp" else None
    if per_step_sent is None and steps:
        per_step_sent = sent / steps
    notes = {
        "estimated": "estimate: 2(N-1)/N x gradient bytes per rank for the backend allreduce",
        "mixed": "partly estimated (backend allreduce steps) and partly measured (hook payloads)",
    }
    return {
        "sent": sent,
        "received": received,
        "uplink": s.get("uplink_bytes"),
        "downlink": s.get("downlink_bytes"),
        "worker_steps": steps,
        "sent_per_step": per_step_sent,
        "received_per_step": received / steps if steps else None,
        "accounting": accounting,
        "estimated": accounting in ("estimated", "mixed"),
        "note": notes.get(accounting),
    }


def _compression_ratio(run: Run) -> dict[str, Any]:
    s = run.summary
    for key in ("compression_ratio_achieved", "achieved_compression_ratio"):
        if _number(s.get(key)) is not None:
            return {"value": s[key], "source": f"summary ({key})"}
    if (s.get("compression") or "none") == "none":
        return {
            "value": 1.0 if s["architecture"] != "baseline" else None,
            "source": "uncompressed" if s["architecture"] != "baseline" else None,
        }
    last: dict[str, float] = {}
    for event in run.events:  # workers log their cumulative ratio in their train events
        if event["kind"] == "train" and _number(event.get("compression_ratio")) is not None:
            last[event.get("source", "")] = float(event["compression_ratio"])
    if last:
        return {
            "value": sum(last.values()) / len(last),
            "source": "workers' train events (mean of their cumulative ratios)",
        }
    return {"value": None, "source": None}


def _staleness(run: Run) -> dict[str, Any] | None:
    s = run.summary
    if s["architecture"] != "parameter_server":
        return None
    histogram, source = s.get("staleness_histogram"), "summary"
    if not isinstance(histogram, dict):
        counts: dict[str, int] = {}
        for event in _main_events(run, "push"):
            if isinstance(event.get("staleness"), int):
                counts[str(event["staleness"])] = counts.get(str(event["staleness"]), 0) + 1
        histogram, source = (counts, "server push events") if counts else (None, None)
    if histogram is not None:
        histogram = {str(k): int(v) for k, v in sorted(histogram.items(), key=lambda item: int(item[0]))}
    return {
        "mode": s.get("aggregation_mode"),
        "histogram": histogram,
        "source": source,
        "mean": s.get("mean_staleness"),
        "max": s.get("max_staleness"),
        "pushes_rejected": s.get("pushes_rejected"),
    }


def _faults(run: Run) -> dict[str, Any]:
    start = _run_start_time(run)
    events = [e for e in run.events if e["kind"] in FAULT_KINDS]
    timeline = [
        {
            "seconds": e["time"] - start,
            "kind": e["kind"],
            **{k: v for k, v in e.items() if k not in ("time", "kind", "config")},
        }
        for e in events
    ]
    # The server cannot know when a process died, only how long it had been silent when it was failed:
    # that silence is an upper bound of the detection latency (the fault came at or after its last sign of life).
    detections = [
        {"worker": e.get("worker"), "seconds": e.get("detection_latency_s", e.get("silent_for_s"))}
        for e in events
        if e["kind"] == "worker_failed" and _number(e.get("detection_latency_s", e.get("silent_for_s"))) is not None
    ]
    recoveries = []
    for failed in (e for e in events if e["kind"] in ("worker_failed", "rank_failed", "server_failed")):
        who = "worker" if failed["kind"] == "worker_failed" else ("rank" if failed["kind"] == "rank_failed" else None)
        back_kinds = {"worker": ("worker_rejoined",), "rank": ("rank_restarted",), None: ("server_recovered",)}[who]
        back = next(
            (
                e
                for e in events
                if e["kind"] in back_kinds
                and e["time"] >= failed["time"]
                and (who is None or e.get(who) == failed.get(who))
            ),
            None,
        )
        if back is not None:
            recoveries.append(
                {
                    "who": f"{who} {failed.get(who)}" if who else "server",
                    "from": failed["kind"],
                    "to": back["kind"],
                    "seconds": back["time"] - failed["time"],
                }
            )
    for event in events:  # recoveries the event states itself (e.g. a server restarted from its checkpoint)
        for key in ("recovery_s", "recovery_time_s", "downtime_s"):
            if _number(event.get(key)) is not None:
                recoveries.append({"who": event["kind"], "from": None, "to": event["kind"], "seconds": event[key]})
    versions_lost = [e["versions_lost"] for e in events if e["kind"] == "server_recovered" and "versions_lost" in e]
    return {
        "counts": run.summary.get("faults"),
        "timeline": timeline,
        "detection": detections,
        "recovery": recoveries,
        "versions_lost": versions_lost,
        "happened": bool(events)
        or bool(
            isinstance(run.summary.get("faults"), dict) and any(_number(v) for v in run.summary["faults"].values())
        ),
    }


def _table_rows(members: Sequence[Mapping[str, Any]], key: str) -> list[dict[str, Any]]:
    return sorted((dict(m) for m in members), key=lambda m: (m.get(key) is None, m.get(key)))


def build_report(
    runs: Sequence[Run],
    *,
    bench: Mapping[str, Any] | None = None,
    target_accuracy: float | None = None,
    inputs: Sequence[str] = (),
    trace: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The report dict (what the JSON report holds) from ``runs``; pure, no I/O.

    Args:
        bench: ``reports/bench.json`` as written by ``scripts/bench_all.py`` (its ``figures`` are tabled).
        target_accuracy: for runs whose summary records no time to target, find it on their eval curve.
        trace: the merged timeline the report links (``file`` beside the report, and
            :func:`src.telemetry.tracing.describe_trace` of its events), or ``None``.
    """
    labels = run_labels(runs)
    baseline_index = next((i for i, r in enumerate(runs) if r.summary["architecture"] == "baseline"), None)
    baseline = runs[baseline_index] if baseline_index is not None else None
    base_throughput = _number(baseline.summary["throughput_samples_per_s"]) if baseline else None
    entries = []
    for run, label in zip(runs, labels):
        s = run.summary
        throughput = _number(s["throughput_samples_per_s"])
        curve = _accuracy_curve(run)
        entries.append(
            {
                "label": label,
                "origin": run.origin,
                "architecture": s["architecture"],
                "aggregation_mode": s.get("aggregation_mode"),
                "compression": s.get("compression"),
                "comm_hook": s.get("comm_hook"),
                "dataset": s["dataset"],
                "num_workers": s["num_workers"],
                "epochs": s.get("epochs"),
                "steps": s.get("versions", s.get("steps")),
                "final_accuracy": s["final_accuracy"],
                "final_loss": s["final_loss"],
                "total_time_s": s["total_time_s"],
                "train_time_s": s.get("train_time_s"),
                "clock": _training_clock(s),
                "throughput_samples_per_s": s["throughput_samples_per_s"],
                "samples_processed": s["samples_processed"],
                "speedup_vs_baseline": throughput / base_throughput
                if throughput is not None and base_throughput
                else None,
                "time_to_target": _time_to_target(run, curve, target_accuracy),
                "time_split": _time_split(run),
                "bytes": _bytes(run),
                "shards": s.get("shards"),
                "shard_imbalance": s.get("shard_imbalance"),
                "compression_ratio": _compression_ratio(run),
                "staleness": _staleness(run),
                "faults": _faults(run),
                "emulation": s.get("emulation"),
                "accuracy_curve": curve,
                "events_recorded": bool(run.events),
                "per_worker": _table_rows(run.workers, "worker_id"),
                "per_rank": _table_rows(run.ranks, "rank"),
                "checkpoint_path": s["checkpoint_path"],
            }
        )
    return {
        "report_version": REPORT_VERSION,
        "generated_at": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "inputs": list(inputs),
        "baseline": labels[baseline_index] if baseline is not None else None,
        "definitions": DEFINITIONS,
        "runs": entries,
        "benchmarks": list(bench.get("figures") or []) if bench else None,
        "benchmark_setup": {k: v for k, v in bench.items() if k != "figures" and k != "results"} if bench else None,
        "plots": {name: f"{name}.png" for name in PLOTS},
        "trace": dict(trace) if trace else None,
    }


# ----------------------------------------------------------------------------- writing the report


def merge_run_traces(trace_dirs: Sequence[str | Path], output: str | Path) -> dict[str, Any]:
    """Merge every ``trace.json`` under ``trace_dirs`` (a ``--trace`` run's log folders) into
    ``<output stem>_trace.json`` beside the report; returns what :func:`build_report` links as ``trace``.

    Raises:
        ReportInputError: a folder without traces, or a file that is not trace-event JSON.
    """
    from src.telemetry.tracing import describe_trace, find_traces, merge_traces, read_trace, write_trace

    paths = []
    for folder in trace_dirs:
        found = find_traces(folder)
        if not found:
            raise ReportInputError(folder, "no trace.json under it (train with --trace and give its log folder)")
        paths += found
    traces = []
    for path in paths:
        try:
            traces.append(read_trace(path))
        except (ValueError, UnicodeDecodeError):
            raise ReportInputError(path, "not a trace-event JSON file") from None
    events = merge_traces(traces)
    output = Path(output)
    merged = write_trace(output.parent / f"{output.stem}_trace.json", events)
    return {"file": merged.name, "sources": [str(path) for path in paths], **describe_trace(events)}


def write_report(report: Mapping[str, Any], output: str | Path) -> dict[str, Path]:
    """Write the JSON report to ``output`` and, beside it, ``<stem>.md``, ``<stem>.html`` and the PNG
    plots in ``<stem>_plots/``; returns every path written by name."""
    from src.reports.plots import draw_all  # matplotlib only when rendering

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    plot_dir = output.parent / f"{output.stem}_plots"
    plots = draw_all(report, plot_dir)
    blocks = report_blocks(report, plot_dir.name)
    paths = {"json": output, "markdown": output.with_suffix(".md"), "html": output.with_suffix(".html")}
    output.write_text(json.dumps(report, indent=2) + "\n")
    paths["markdown"].write_text(to_markdown(blocks))
    paths["html"].write_text(to_html(blocks, {name: path.read_bytes() for name, path in plots.items()}))
    return {**paths, **{f"plot:{name}": path for name, path in plots.items()}}
