"""The performance report's sections, as the blocks both renderers (:mod:`src.reports.render`) read.

:func:`report_blocks` is the page: a title, then for each entry of :data:`src.reports.names.SECTIONS`,
in order, its heading, its plot (if it has one) and the blocks of its function here (paragraphs,
lists, tables) from the report dict of :func:`src.reports.report.build_report`. Cells are formatted here
(:func:`_fmt`): a figure a run did not record reads "not recorded".
"""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Sequence

from src.reports.names import NOT_RECORDED, SECTIONS
from src.reports.render import Block


def _fmt(value: Any, kind: str = "") -> str:
    """A cell: ``None`` -> not recorded; ``pct`` / ``s`` / ``bytes`` / ``x`` / ``rate`` formats."""
    if value is None:
        return NOT_RECORDED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return str(value)
    if kind == "pct":
        return f"{value * 100:.2f}%"
    if kind == "s":
        return f"{value:.2f} s"
    if kind == "bytes":
        return f"{value:,.0f}"
    if kind == "x":
        return f"{value:.2f}x"
    if kind == "rate":
        return f"{value:,.1f}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return f"{value:,}" if abs(value) >= 10000 else str(value)


def _definitions(report: Mapping[str, Any]) -> list[Block]:
    """How each figure is measured, as the report's definitions say."""
    return [("ul", [f"**{k.replace('_', ' ')}**: {v}" for k, v in report["definitions"].items()])]


def _summary(report: Mapping[str, Any]) -> list[Block]:
    """One row per run (accuracy, loss, times, throughput, speedup), its training clock, emulated conditions."""
    runs = report["runs"]
    blocks: list[Block] = [
        (
            "table",
            [
                "run",
                "architecture",
                "workers",
                "dataset",
                "epochs",
                "final accuracy",
                "final loss",
                "total time",
                "train time",
                "throughput (samples/s)",
                "speedup vs baseline",
            ],
            [
                [
                    r["label"],
                    r["architecture"],
                    r["num_workers"],
                    r["dataset"],
                    r["epochs"],
                    _fmt(r["final_accuracy"], "pct"),
                    _fmt(r["final_loss"]),
                    _fmt(r["total_time_s"], "s"),
                    _fmt(r["train_time_s"], "s"),
                    _fmt(r["throughput_samples_per_s"], "rate"),
                    _fmt(r["speedup_vs_baseline"], "x") if report["baseline"] else "no baseline run",
                ]
                for r in runs
            ],
        ),
        ("p", "Training clocks: " + "; ".join(f"{r['label']}: {r['clock']}" for r in runs) + "."),
    ]
    emulated = [r for r in runs if r["emulation"]]
    if emulated:  # slowed workers or links: the times above are not this machine's own
        blocks.append(
            (
                "p",
                "Emulated conditions: "
                + "; ".join(f"{r['label']}: {json.dumps(r['emulation'], sort_keys=True)}" for r in emulated)
                + ".",
            )
        )
    return blocks


def _accuracy(report: Mapping[str, Any]) -> list[Block]:
    """Each run's number of evaluations, its first and its last (below the accuracy-vs-time plot)."""
    return [
        (
            "table",
            ["run", "evaluations", "first", "last"],
            [
                [
                    r["label"],
                    len(r["accuracy_curve"]),
                    _point(r["accuracy_curve"][0]) if r["accuracy_curve"] else NOT_RECORDED,
                    _point(r["accuracy_curve"][-1])
                    if r["accuracy_curve"]
                    else (NOT_RECORDED + " (no event log)" if not r["events_recorded"] else NOT_RECORDED),
                ]
                for r in report["runs"]
            ],
        )
    ]


def _throughput(report: Mapping[str, Any]) -> list[Block]:
    """Each run's samples, train time, throughput and speedup (below the throughput plot)."""
    return [
        (
            "table",
            ["run", "samples processed", "train time", "throughput (samples/s)", "speedup vs baseline"],
            [
                [
                    r["label"],
                    _fmt(r["samples_processed"]),
                    _fmt(r["train_time_s"], "s"),
                    _fmt(r["throughput_samples_per_s"], "rate"),
                    _fmt(r["speedup_vs_baseline"], "x"),
                ]
                for r in report["runs"]
            ],
        )
    ]


def _time_to_target(report: Mapping[str, Any]) -> list[Block]:
    """Each run's time to its target accuracy, or that it did not reach it."""
    return [
        (
            "table",
            ["run", "target", "time to target", "step", "source"],
            [
                [
                    r["label"],
                    _fmt(r["time_to_target"]["target_accuracy"], "pct"),
                    (
                        "not reached"
                        if r["time_to_target"]["reached"] is False
                        else _fmt(r["time_to_target"]["seconds"], "s")
                    ),
                    "-" if r["time_to_target"]["reached"] is False else _fmt(r["time_to_target"]["step"]),
                    r["time_to_target"]["source"] or "no target set",
                ]
                for r in report["runs"]
            ],
        ),
    ]


def _time_split(report: Mapping[str, Any]) -> list[Block]:
    """Each run's seconds per worker/rank in each part of a step (below the time-split plot)."""
    return [
        (
            "table",
            ["run", "workers", "gradient", "compression", "communication", "exposed communication", "note"],
            [
                [r["label"], r["time_split"]["workers"]]
                + [
                    _split_cell(r["time_split"], key)
                    for key in ("gradient_time_s", "compression_time_s", "communication_time_s")
                ]
                + [_exposed_cell(r["time_split"]), r["time_split"]["note"] or ""]
                for r in report["runs"]
            ],
        )
    ]


def _bytes(report: Mapping[str, Any]) -> list[Block]:
    """Each run's bytes, per step, compression ratio and how they were counted (below the bytes plot)."""
    return [
        (
            "table",
            [
                "run",
                "bytes sent",
                "bytes received",
                "uplink",
                "downlink",
                "sent per step",
                "received per step",
                "compression ratio",
                "accounting",
            ],
            [
                [
                    r["label"],
                    _fmt(r["bytes"]["sent"], "bytes"),
                    _fmt(r["bytes"]["received"], "bytes"),
                    _fmt(r["bytes"]["uplink"], "bytes"),
                    _fmt(r["bytes"]["downlink"], "bytes"),
                    _fmt(r["bytes"]["sent_per_step"], "bytes"),
                    _fmt(r["bytes"]["received_per_step"], "bytes"),
                    _fmt(r["compression_ratio"]["value"], "x")
                    if r["compression_ratio"]["value"] is not None
                    else ("n/a" if r["architecture"] == "baseline" else NOT_RECORDED),
                    r["bytes"]["accounting"] + (f" ({r['bytes']['note']})" if r["bytes"]["note"] else ""),
                ]
                for r in report["runs"]
            ],
        )
    ] + _shard_loads(report)


def _shard_loads(report: Mapping[str, Any]) -> list[Block]:
    """Each sharded run's load per server shard: the bytes placed on it, the bytes of the messages it took in and
    sent out, its optimizer's seconds, the async pushes it rolled back (too stale there, applied on the others), and
    the imbalance (the busiest shard's bytes over the mean)."""
    blocks: list[Block] = []
    for r in report["runs"]:
        if not r.get("shards"):
            continue
        rollbacks = any("rolled_back" in shard for shard in r["shards"])  # async runs only
        blocks += [
            ("h3", f"{r['label']}: load per server shard (imbalance {_fmt(r['shard_imbalance'], 'x')})"),
            (
                "table",
                ["shard", "bytes placed", "bytes in", "bytes out", "optimizer time"]
                + (["pushes rolled back"] if rollbacks else []),
                [
                    [
                        str(shard["shard"]),
                        _fmt(shard["bytes_placed"], "bytes"),
                        _fmt(shard["bytes_in"], "bytes"),
                        _fmt(shard["bytes_out"], "bytes"),
                        f"{_fmt(shard['update_s'])} s",
                    ]
                    + ([_fmt(shard.get("rolled_back"))] if rollbacks else [])
                    for shard in r["shards"]
                ],
            ),
        ]
    return blocks


def _staleness(report: Mapping[str, Any]) -> list[Block]:
    """Each parameter-server run's staleness figures (below the staleness plot)."""
    stale = [r for r in report["runs"] if r["staleness"] is not None]
    if not stale:
        return [("p", "No parameter-server run: staleness not recorded.")]
    return [
        (
            "table",
            ["run", "mode", "mean", "max", "pushes rejected", "histogram (staleness: pushes)", "source"],
            [
                [
                    r["label"],
                    r["staleness"]["mode"],
                    _fmt(r["staleness"]["mean"]),
                    _fmt(r["staleness"]["max"]),
                    _fmt(r["staleness"]["pushes_rejected"]),
                    ", ".join(f"{k}: {v}" for k, v in r["staleness"]["histogram"].items())
                    if r["staleness"]["histogram"]
                    else NOT_RECORDED,
                    r["staleness"]["source"] or "",
                ]
                for r in stale
            ],
        )
    ]


def _faults(report: Mapping[str, Any]) -> list[Block]:
    """For each run that had faults, its :func:`_run_faults` (below the fault timeline plot)."""
    faulty = [r for r in report["runs"] if r["faults"]["happened"]]
    if not faulty:
        return [("p", "No faults recorded in these runs (no fault events, no fault counts in the summaries).")]
    blocks: list[Block] = []
    for r in faulty:
        blocks += [("h3", r["label"])] + _run_faults(r["faults"])
    return blocks


def _run_faults(f: Mapping[str, Any]) -> list[Block]:
    """One run's faults: the summary's counts, detection latencies, recovery times, versions lost, timeline."""
    blocks: list[Block] = []
    if f["counts"]:
        blocks.append(("p", "Counts from the summary: " + ", ".join(f"{k} {v}" for k, v in f["counts"].items()) + "."))
    blocks.append(
        (
            "table",
            ["worker", "detection latency (at most: silence before the failure was declared)"],
            [[d["worker"], _fmt(d["seconds"], "s")] for d in f["detection"]],
        )
        if f["detection"]
        else ("p", "Detection latency: " + NOT_RECORDED + ".")
    )
    blocks.append(
        (
            "table",
            ["who", "from", "to", "recovery time"],
            [[x["who"], x["from"] or "", x["to"], _fmt(x["seconds"], "s")] for x in f["recovery"]],
        )
        if f["recovery"]
        else ("p", "Recovery time: " + NOT_RECORDED + ".")
    )
    if f["versions_lost"]:
        blocks.append(("p", "Server versions lost to recovery: " + ", ".join(map(str, f["versions_lost"])) + "."))
    if f["timeline"]:
        blocks.append(
            (
                "table",
                ["time", "event", "details"],
                [
                    [
                        _fmt(e["seconds"], "s"),
                        e["kind"],
                        ", ".join(f"{k}={v}" for k, v in e.items() if k not in ("seconds", "kind")),
                    ]
                    for e in f["timeline"]
                ],
            )
        )
    return blocks


def _members(report: Mapping[str, Any], entry: str, key: str, missing: str) -> list[Block]:
    """A :func:`_member_table` of ``entry`` (``per_worker``/``per_rank``) for each run that has one."""
    having = [r for r in report["runs"] if r[entry]]
    blocks: list[Block] = [] if having else [("p", missing)]
    for r in having:
        blocks += [("h3", r["label"]), _member_table(r[entry], key)]
    return blocks


def _per_worker(report: Mapping[str, Any]) -> list[Block]:
    """A table of each parameter-server run's workers."""
    return _members(
        report, "per_worker", "worker_id", "No per-worker figures (no parameter-server run with worker metrics)."
    )


def _per_rank(report: Mapping[str, Any]) -> list[Block]:
    """A table of each DDP run's ranks."""
    return _members(report, "per_rank", "rank", "No per-rank figures (no DDP run with ddp_rank_<r>.json).")


def _benchmarks(report: Mapping[str, Any]) -> list[Block]:
    """The benchmark figures of ``scripts/bench_all.py`` beside their references, and how they were measured."""
    if report["benchmarks"] is None:
        return [
            (
                "p",
                "Benchmarks " + NOT_RECORDED + " (run `python scripts/bench_all.py` and pass "
                "`--bench-json reports/bench.json`).",
            )
        ]
    blocks: list[Block] = []
    setup = report.get("benchmark_setup") or {}
    if setup:
        blocks.append(
            (
                "p",
                "Measured " + ", ".join(f"{k}: {v}" for k, v in setup.items() if not isinstance(v, (dict, list))) + ".",
            )
        )
    blocks.append(
        (
            "table",
            ["benchmark", "figure", "ours", "reference", "ratio", "target", "meets target"],
            [
                [
                    b.get("benchmark", ""),
                    b.get("figure", ""),
                    _with_unit(b.get("ours"), b.get("unit")),
                    f"{_with_unit(b.get('reference'), b.get('unit'))} ({b.get('reference_name', '')})",
                    _fmt(b.get("ratio")) + (f" ({b['ratio_definition']})" if b.get("ratio_definition") else ""),
                    b.get("target_text") or ("none set" if b.get("target") is None else f">= {b['target']}"),
                    "n/a" if b.get("meets_target") is None else _fmt(b["meets_target"]),
                ]
                for b in report["benchmarks"]
            ],
        )
    )
    return blocks


def _timeline(report: Mapping[str, Any]) -> list[Block]:
    """The merged trace the report links: its processes and its spans by name."""
    trace = report.get("trace")
    if not trace:
        return [
            (
                "p",
                "Timeline " + NOT_RECORDED + " (train with `--trace`, then pass the run's log folder as "
                "`--trace-dir`).",
            )
        ]
    return [
        (
            "p",
            f"The run's traces merged on one clock: [{trace['file']}]({trace['file']}) "
            f"({len(trace['processes'])} processes, {trace['spans']:,} spans, {_fmt(trace['seconds'], 's')}); "
            "open it in https://ui.perfetto.dev or `chrome://tracing`.",
        ),
        ("table", ["process", "pid", "spans"], [[p["name"], p["pid"], p["spans"]] for p in trace["processes"]]),
        (
            "table",
            ["span", "count", "total time", "mean"],
            [
                [name, n["count"], _fmt(n["seconds"], "s"), _fmt(n["seconds"] / n["count"] * 1000, "") + " ms"]
                for name, n in trace["names"].items()
            ],
        ),
    ]


_SECTION_BLOCKS: tuple[tuple[Callable[[Mapping[str, Any]], list[Block]], str | None, str], ...] = (
    (_definitions, None, ""),
    (_summary, None, ""),
    (_accuracy, "accuracy_vs_time", "Test accuracy against seconds since each run's start"),
    (_throughput, "throughput", "Samples per second of training time; the dashed line is the baseline"),
    (_time_to_target, None, ""),
    (
        _time_split,
        "time_split",
        "Mean seconds per worker/rank in gradient computation, compression and communication, "
        "and the communication not hidden by computation (exposed)",
    ),
    (_bytes, "bytes_per_step", "Bytes one worker/rank sends and receives per training step (hatched: estimated)"),
    (_staleness, "staleness", "Pushes by staleness (versions behind at arrival), per parameter-server run"),
    (_faults, "fault_timeline", "Fault events against seconds since each run's start"),
    (_per_worker, None, ""),
    (_per_rank, None, ""),
    (_benchmarks, None, ""),
    (_timeline, None, ""),
)
"""Each section's blocks, its plot (drawn first, under the heading) and the plot's caption, in the order of
:data:`src.reports.names.SECTIONS`."""


def report_blocks(report: Mapping[str, Any], plot_dir: str) -> list[Block]:
    """The report as a list of blocks both renderers share (headings, paragraphs, lists, tables, images).

    Args:
        plot_dir: the folder of the report's PNG plots, as the page links it (relative to the page).
    """
    runs = report["runs"]
    blocks: list[Block] = [
        ("h1", "Performance report"),
        (
            "p",
            f"Generated {report['generated_at']} from {len(runs)} run(s): "
            + ", ".join(f"{r['label']} ({r['origin']})" for r in runs)
            + ".",
        ),
    ]
    for title, (section, plot, caption) in zip(SECTIONS, _SECTION_BLOCKS, strict=True):
        blocks.append(("h2", title))
        if plot is not None:
            blocks.append(("image", f"{plot_dir}/{report['plots'][plot]}", plot, caption))
        blocks += section(report)
    return blocks


def _with_unit(value: Any, unit: str | None) -> str:
    return _fmt(value) + (f" {unit}" if unit and value is not None else "")


def _point(point: Mapping[str, Any]) -> str:
    return f"{point['accuracy'] * 100:.2f}% at {point['seconds']:.1f} s (step {point['step']})"


def _split_cell(split: Mapping[str, Any], key: str) -> str:
    value, share = split["per_worker_s"][key], split["shares"][key]
    if value is None:
        return NOT_RECORDED
    return f"{value:.3f} s ({share * 100:.0f}%)" if share is not None else f"{value:.3f} s"


def _exposed_cell(split: Mapping[str, Any]) -> str:
    value, share = split["exposed_communication_s"], split["exposed_share_of_train_time"]
    if value is None:
        return NOT_RECORDED
    return f"{value:.3f} s ({share * 100:.0f}% of train time)" if share is not None else f"{value:.3f} s"


_MEMBER_FIRST = (
    "worker_id",
    "rank",
    "samples",
    "samples_processed",
    "steps",
    "train_time_s",
    "total_time_s",
    "throughput_samples_per_s",
    "bytes_sent",
    "bytes_received",
    "gradient_time_s",
    "compression_time_s",
    "communication_time_s",
    "exposed_communication_s",
    "pushes_rejected",
    "train_loss",
    "train_accuracy",
)
_SHARED_RANK_FIELDS = (
    "architecture",
    "dataset",
    "num_workers",
    "world_size",
    "backend",
    "allreduce",
    "comm_hook",
    "compression",
    "compression_ratio",
    "quantization_bits",
    "error_feedback",
    "epochs",
    "final_accuracy",
    "final_loss",
    "checkpoint_path",
    "steps",
    "steps_this_run",
)


def _member_table(members: Sequence[Mapping[str, Any]], key: str) -> Block:
    """One row per worker/rank; scalar columns only (the run's shared fields are in the summary)."""
    skip = _SHARED_RANK_FIELDS if key == "rank" else ()
    columns = [c for c in _MEMBER_FIRST if any(c in m for m in members) and c not in skip]
    columns += sorted(
        {
            c
            for m in members
            for c, v in m.items()
            if c not in columns and c not in skip and not isinstance(v, (dict, list))
        }
    )
    return (
        "table",
        columns,
        [
            [
                _fmt(m.get(c), "bytes" if c.startswith("bytes") and isinstance(m.get(c), (int, float)) else "")
                for c in columns
            ]
            for m in members
        ],
    )
