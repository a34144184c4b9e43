"""Every plot of the project: PNG files drawn with headless matplotlib, for the performance report and the experiments.

Two sets share one set-up (headless backend, colours, figure size, the empty plot that says why, the legend):

* the **performance report's** (:func:`draw_all`): every plot of :data:`src.reports.names.PLOTS`, drawn
  from the report dict only (:func:`src.reports.report.build_report`), so the plots show exactly the numbers of
  the JSON and Markdown reports;
* the **experiments'** (:func:`write_results`, the command ``scripts/plot_results.py``; :func:`write_results_under`
  for everything in a results folder): every plot of :data:`RESULTS_PLOTS`, drawn from finished runs
  (:mod:`src.reports.results`), beside their Markdown table.

And a trace's timeline (:func:`draw_timeline`, the command ``scripts/plot_trace.py``): a still image of
a (merged) trace for documents and machines without a browser (Perfetto and ``chrome://tracing`` are
the tools to explore one; docs/observability.md's screenshot). Each thread is a lane, named
``process / thread``; a span is a bar from its start to its end, nested spans drawn below the span that
holds them (one row per depth), colored by name; ``start_s`` / ``seconds`` cut a window (seconds from
the trace's first span) to see single steps.

Every plot of a set is always written, so a folder has the same files whatever ran; a plot whose data
no run recorded says so in its middle instead of being left out.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or servers

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from src.reports.names import NOT_RECORDED, PLOTS  # noqa: E402
from src.reports.results import PLOTS_FOLDER, Run, find_runs, groups_of, markdown_table, result_sets  # noqa: E402

RESULTS_PLOTS = ("accuracy_vs_time", "accuracy_vs_bytes", "time_to_target", "bytes_per_run", "staleness", "controller")
"""The experiments' plots (``<name>.png``), written with ``results.md`` by :func:`write_results`."""

_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"]
_SPLIT = (
    ("gradient_time_s", "gradient"),
    ("compression_time_s", "compression"),
    ("communication_time_s", "communication"),
)


def _color(index: int) -> str:
    return _COLORS[index % len(_COLORS)]


def _empty(ax, title: str, reason: str, *, nothing_happened: bool = False) -> None:
    """An empty plot that says why: the data was not recorded, or (``nothing_happened``) there was none."""
    text = reason if nothing_happened else f"{NOT_RECORDED}\n{reason}"
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#666")
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])


def _legend(ax, drawn: int = 1, *, fontsize: int = 8, loc: str = "best") -> None:
    """The legend of the ``drawn`` labelled series (none when nothing was drawn)."""
    if drawn:
        ax.legend(fontsize=fontsize, loc=loc)


def _save(path: Path, draw: Callable[[Any], None], height: float = 4.5, *, width: float = 8, dpi: int = 100) -> Path:
    """One figure: ``draw`` fills its axes, then it is written to ``path`` as PNG and closed."""
    figure, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    try:
        draw(ax)
        figure.tight_layout()
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path


# ----------------------------------------------------------------------------- the performance report's plots


def accuracy_vs_time(ax, report: Mapping[str, Any]) -> None:
    drawn = False
    for index, run in enumerate(report["runs"]):
        curve = run["accuracy_curve"]
        if not curve:
            continue
        xs, ys = [p["seconds"] for p in curve], [p["accuracy"] * 100 for p in curve]
        ax.plot(xs, ys, marker="o", color=_color(index), label=run["label"])
        drawn = True
    if not drawn:
        _empty(ax, "Accuracy vs wall time", "no eval events in the runs' event logs")
        return
    ax.set_xlabel("wall time since run start (s)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy vs wall time")
    ax.grid(alpha=0.3)
    _legend(ax)


def throughput(ax, report: Mapping[str, Any]) -> None:
    runs = [r for r in report["runs"] if r["throughput_samples_per_s"] is not None]
    if not runs:
        _empty(ax, "Throughput", "no throughput in the summaries")
        return
    values = [r["throughput_samples_per_s"] for r in runs]
    bars = ax.bar(range(len(runs)), values, color=[_color(report["runs"].index(r)) for r in runs])
    for bar, run in zip(bars, runs):
        speedup = run["speedup_vs_baseline"]
        text = f"{bar.get_height():,.0f}" + (f"\n{speedup:.2f}x" if speedup is not None else "")
        ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    baseline = next((r for r in runs if r["architecture"] == "baseline"), None)
    if baseline is not None:
        ax.axhline(baseline["throughput_samples_per_s"], color="#444", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("samples / s of training time")
    ax.set_title("Throughput (label: samples/s and speedup over the baseline)")
    ax.set_ylim(0, max(values) * 1.25 or 1)


def time_split(ax, report: Mapping[str, Any]) -> None:
    runs = report["runs"]
    recorded = [r for r in runs if any(r["time_split"]["per_worker_s"][k] is not None for k, _ in _SPLIT)]
    if not recorded:
        _empty(ax, "Where the time goes", "no gradient / compression / communication times in the summaries")
        return
    positions = range(len(runs))
    bottoms = [0.0] * len(runs)
    for color_index, (key, name) in enumerate(_SPLIT):
        heights = [r["time_split"]["per_worker_s"][key] or 0.0 for r in runs]
        ax.bar(
            [p - 0.12 for p in positions], heights, width=0.55, bottom=bottoms, label=name, color=_color(color_index)
        )
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    # Exposed communication is part of the stack (of communication, or for DDP of the backward pass): beside it.
    exposed = [r["time_split"].get("exposed_communication_s") or 0.0 for r in runs]
    ax.bar(
        [p + 0.3 for p in positions],
        exposed,
        width=0.2,
        label="exposed communication (part of the stack)",
        color="white",
        edgecolor="#222",
        hatch="//",
    )
    bottoms = [max(b, e) for b, e in zip(bottoms, exposed)]
    top = max(bottoms) or 1.0
    for index, run in enumerate(runs):
        missing = [name for key, name in _SPLIT if run["time_split"]["per_worker_s"][key] is None]
        if missing:
            ax.annotate(
                "not recorded:\n" + "\n".join(missing),
                (index, bottoms[index] + top * 0.02),
                ha="center",
                va="bottom",
                fontsize=7,
                color="#666",
            )
    ax.set_xticks(list(positions), [r["label"] for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("seconds per worker / rank (mean)")
    ax.set_title("Where the time goes")
    ax.set_ylim(0, top * 1.45)
    _legend(ax, loc="upper left")


def bytes_per_step(ax, report: Mapping[str, Any]) -> None:
    runs = [r for r in report["runs"] if r["bytes"]["sent_per_step"] is not None]
    if not runs:
        _empty(ax, "Bytes per step", "no bytes or step counts in the summaries")
        return
    width = 0.38
    for offset, key, name, color in (
        (-width / 2, "sent_per_step", "sent", _color(0)),
        (width / 2, "received_per_step", "received", _color(1)),
    ):
        values = [r["bytes"][key] or 0.0 for r in runs]
        bars = ax.bar(
            [i + offset for i in range(len(runs))],
            values,
            width,
            label=name,
            color=color,
            hatch=None,
            edgecolor="white",
        )
        for bar, run, value in zip(bars, runs, values):
            if run["bytes"]["estimated"]:
                bar.set_hatch("//")
                bar.set_edgecolor("#333")
            ax.annotate(
                _short_bytes(value), (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=7
            )
    ax.set_xticks(range(len(runs)), [r["label"] for r in runs], rotation=20, ha="right", fontsize=8)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: _short_bytes(value)))
    ax.set_ylabel("bytes per worker step")
    ax.set_title("Bytes per step (hatched: estimated, backend allreduce)")
    ax.set_ylim(
        0,
        max(
            max((r["bytes"]["sent_per_step"] or 0) for r in runs),
            max((r["bytes"]["received_per_step"] or 0) for r in runs),
        )
        * 1.2
        or 1,
    )
    _legend(ax)


def _short_bytes(value: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def staleness(ax, report: Mapping[str, Any]) -> None:
    runs = [r for r in report["runs"] if r["staleness"] and r["staleness"]["histogram"]]
    if any(r["staleness"]["mode"] == "async" for r in runs):  # sync runs are all 0: the table says so
        runs = [r for r in runs if r["staleness"]["mode"] == "async"]
    if not runs:
        _empty(ax, "Staleness distribution", "no parameter-server run with a staleness histogram or push events")
        return
    keys = list(range(max(int(k) for r in runs for k in r["staleness"]["histogram"]) + 1))  # gaps show as gaps
    width = 0.8 / len(runs)
    for index, run in enumerate(runs):
        histogram = run["staleness"]["histogram"]
        ax.bar(
            [k + (index - (len(runs) - 1) / 2) * width for k in keys],
            [histogram.get(str(k), 0) for k in keys],
            width,
            label=run["label"],
            color=_color(report["runs"].index(run)),
        )
    ax.set_xticks(keys)
    ax.set_xlabel("staleness (server versions behind at arrival)")
    ax.set_ylabel("pushes")
    ax.set_title(
        "Staleness distribution" + (" (async runs)" if all(r["staleness"]["mode"] == "async" for r in runs) else "")
    )
    _legend(ax)


def fault_timeline(ax, report: Mapping[str, Any]) -> None:
    rows: list[tuple[str, float, str]] = []
    silences: list[tuple[str, float, float]] = []  # (lane, start, end): failed but not yet detected
    for run in report["runs"]:
        for event in run["faults"]["timeline"]:
            who = next((f"{k} {event[k]}" for k in ("worker", "rank") if event.get(k) is not None), "server")
            rows.append((f"{run['label']}: {who}", event["seconds"], event["kind"]))
            latency = event.get("detection_latency_s")
            if isinstance(latency, (int, float)) and not isinstance(latency, bool):
                silences.append((f"{run['label']}: {who}", event["seconds"] - latency, event["seconds"]))
    if not rows:
        _empty(ax, "Fault timeline", "no faults: these runs' logs hold no fault events", nothing_happened=True)
        return
    lanes = sorted({lane for lane, _, _ in rows})
    kinds = sorted({kind for _, _, kind in rows})
    for index, kind in enumerate(kinds):
        points = [(t, lanes.index(lane)) for lane, t, k in rows if k == kind]
        ax.scatter([t for t, _ in points], [y for _, y in points], label=kind, color=_color(index), s=50, zorder=3)
    for index, (lane, start, end) in enumerate(silences):
        ax.hlines(
            lanes.index(lane),
            start,
            end,
            color="#999",
            linewidth=8,
            alpha=0.4,
            zorder=2,
            label="until detected (detection latency)" if index == 0 else None,
        )
    ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlabel("wall time since run start (s)")
    ax.set_title("Fault timeline")
    ax.grid(axis="x", alpha=0.3)
    _legend(ax, fontsize=7)


DRAWERS: dict[str, Callable[[Any, Mapping[str, Any]], None]] = {
    "accuracy_vs_time": accuracy_vs_time,
    "throughput": throughput,
    "time_split": time_split,
    "bytes_per_step": bytes_per_step,
    "staleness": staleness,
    "fault_timeline": fault_timeline,
}
assert set(DRAWERS) == set(PLOTS), "every plot of the report needs a drawer"


def draw_all(report: Mapping[str, Any], directory: str | Path) -> dict[str, Path]:
    """Draw every plot of ``report`` into ``directory``; returns plot name -> PNG path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {
        name: _save(directory / report["plots"][name], lambda ax, draw=DRAWERS[name]: draw(ax, report))
        for name in PLOTS
    }


# ----------------------------------------------------------------------------- the experiments' plots


def plot_accuracy(ax, runs: list[Run], x_index: int, xlabel: str, title: str) -> None:
    drawn = 0
    for run in runs:
        if run.evals:
            xs = [e[x_index] / (1e6 if x_index == 2 else 1) for e in run.evals]
            ax.plot(xs, [e[1] for e in run.evals], marker=".", label=run.name)
            drawn += 1
    if not drawn:
        _empty(ax, title, "no evaluation events in these runs")
        return
    target = next((r.summary.get("target_accuracy") for r in runs if r.summary.get("target_accuracy")), None)
    if target:
        ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax, drawn, fontsize=7)


def plot_time_to_target(ax, runs: list[Run]) -> None:
    groups = groups_of(runs)
    names = list(groups)
    if not any(r.summary.get("target_accuracy") for r in runs):
        _empty(
            ax, "Time to target accuracy", "no target accuracy set (training.target_accuracy)", nothing_happened=True
        )
        return
    for index, name in enumerate(names):
        times = [r.summary.get("time_to_target_s") for r in groups[name]]
        reached = [t for t in times if t is not None]
        if reached:
            mean = statistics.mean(reached)
            ax.bar(index, mean, color="#4c72b0", alpha=0.6)
            ax.errorbar(index, mean, yerr=[[mean - min(reached)], [max(reached) - mean]], color="black", capsize=4)
            ax.scatter([index] * len(reached), reached, color="black", s=12, zorder=3)
        missed = len(times) - len(reached)
        if missed:
            ax.text(index, 0, f"{missed} not\nreached", ha="center", va="bottom", fontsize=7, color="#c44e52")
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("seconds to target (mean, min-max, seeds)")
    ax.set_title("Time to target accuracy")
    ax.grid(axis="y", alpha=0.3)


def plot_bytes(ax, runs: list[Run]) -> None:
    names = [r.name for r in runs]
    sent = [r.summary.get("bytes_sent", 0) / 1e6 for r in runs]
    received = [r.summary.get("bytes_received", 0) / 1e6 for r in runs]
    positions = range(len(runs))
    ax.barh([p - 0.2 for p in positions], sent, height=0.4, label="sent (uplink)")
    ax.barh([p + 0.2 for p in positions], received, height=0.4, label="received (downlink)")
    ax.set_yticks(list(positions), names, fontsize=7)
    ax.set_xlabel("MB (serialized gRPC messages)")
    ax.set_title("Bytes per run")
    ax.grid(axis="x", alpha=0.3)
    _legend(ax, len(runs), fontsize=7)


def plot_staleness(ax, runs: list[Run]) -> None:
    drawn = 0
    for run in runs:
        histogram = {int(k): v for k, v in (run.summary.get("staleness_histogram") or {}).items()}
        if run.summary.get("aggregation_mode") != "async" or not histogram:
            continue
        total = sum(histogram.values())
        taus = sorted(histogram)
        ax.plot(taus, [histogram[t] / total for t in taus], marker="o", label=run.name)
        drawn += 1
    if not drawn:
        _empty(ax, "Staleness", "no async runs: sync pushes all have staleness 0", nothing_happened=True)
        return
    ax.set_xlabel("staleness tau (server versions)")
    ax.set_ylabel("fraction of pushes")
    ax.set_title("Staleness histograms (async runs)")
    ax.grid(alpha=0.3)
    _legend(ax, drawn, fontsize=7)


def plot_controller(ax, runs: list[Run]) -> None:
    drawn = 0
    for run in runs:
        if run.controller:
            ax.step(
                [t for t, _ in run.controller],
                [rho for _, rho in run.controller],
                where="post",
                marker=".",
                label=run.name,
            )
            drawn += 1
    if not drawn:
        _empty(
            ax,
            "Controller decisions",
            "no controller decisions in these runs\n(experiment.controller off)",
            nothing_happened=True,
        )
        return
    ax.set_xlabel("seconds of training")
    ax.set_ylabel("top-k fraction rho")
    ax.set_yscale("log")
    ax.set_title("Controller decisions over time")
    ax.grid(alpha=0.3)
    _legend(ax, drawn, fontsize=7)


RESULTS_DRAWERS: dict[str, Callable[[Any, list[Run]], None]] = {
    "accuracy_vs_time": lambda ax, runs: plot_accuracy(
        ax, runs, 0, "seconds of training", "Test accuracy vs wall time"
    ),
    "accuracy_vs_bytes": lambda ax, runs: plot_accuracy(
        ax, runs, 2, "MB moved by the workers (sent + received)", "Test accuracy vs bytes"
    ),
    "time_to_target": plot_time_to_target,
    "bytes_per_run": plot_bytes,
    "staleness": plot_staleness,
    "controller": plot_controller,
}
assert set(RESULTS_DRAWERS) == set(RESULTS_PLOTS), "every plot of the experiments needs a drawer"


def write_results(folders: list[Path], out: Path | None = None) -> list[Path]:
    """The plots and ``results.md`` of the finished runs in ``folders`` (run folders or folders of them), written
    to ``out`` (default: the first folder's ``plots/``); returns the files written. ``ValueError`` names a folder
    that is not one, or says that no run in them finished."""
    missing = [str(p) for p in folders if not p.is_dir()]
    if missing:
        raise ValueError(f"not a folder: {', '.join(missing)}")
    runs = find_runs(folders)
    if not runs:
        raise ValueError(f"no finished runs in {', '.join(map(str, folders))}")
    return _write_runs(runs, out if out is not None else folders[0] / PLOTS_FOLDER)


def write_results_under(root: Path) -> list[Path]:
    """The plots and ``results.md`` of everything in a results folder (:func:`src.reports.results.result_sets`):
    each matrix's in ``<matrix>/plots/``, the single runs' together in ``<root>/plots/``; returns the files
    written. ``ValueError`` says that ``root`` is no folder or holds no finished run."""
    where = "scripts/run_experiment.py and scripts/run_matrix.py write runs there"
    if not root.is_dir():
        raise ValueError(f"{root}: no such folder ({where})")
    sets = result_sets(root)
    if not sets:
        raise ValueError(f"{root}: no finished run in it ({where})")
    return [path for folder, runs in sets for path in _write_runs(runs, folder / PLOTS_FOLDER)]


def _write_runs(runs: list[Run], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = [
        _save(
            out / f"{name}.png",
            lambda ax, draw=RESULTS_DRAWERS[name]: draw(ax, runs),
            height=max(4.5, 0.35 * len(runs)) if name == "bytes_per_run" else 4.5,
        )
        for name in RESULTS_PLOTS
    ]
    table = out / "results.md"
    table.write_text(markdown_table(runs))
    return [*written, table]


# ----------------------------------------------------------------------------- a trace's timeline

# More colours than the cycle's ten: a trace has more span names than a plot has series.
_TRACE_COLORS = _COLORS + ["#333333", "#a6cee3", "#fb9a99", "#fdbf6f", "#cab2d6"]


def lanes(events: Iterable[dict[str, Any]]) -> list[tuple[str, list[tuple[dict[str, Any], int]]]]:
    """``[(lane name, [(span, depth), ...]), ...]``: one lane per (pid, tid), ordered by process then thread
    name; a span's depth is how many spans of its thread contain it."""
    events = list(events)
    processes = {
        e["pid"]: str(e["args"]["name"]) for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): str(e["args"]["name"])
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    by_thread: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for event in events:
        if event.get("ph") == "X":
            by_thread.setdefault((event["pid"], event["tid"]), []).append(event)
    result = []
    for key in sorted(by_thread, key=lambda k: (processes.get(k[0], str(k[0])), threads.get(k, str(k[1])))):
        placed, open_ends = [], []
        for span in sorted(by_thread[key], key=lambda s: (s["ts"], -s["dur"])):
            while open_ends and open_ends[-1] <= span["ts"]:
                open_ends.pop()
            placed.append((span, len(open_ends)))
            open_ends.append(span["ts"] + span["dur"])
        name = f"{processes.get(key[0], key[0])} / {threads.get(key, key[1])}"
        result.append((name, placed))
    return result


def draw_timeline(
    events: Iterable[dict[str, Any]],
    path: str | Path,
    *,
    start_s: float = 0.0,
    seconds: float | None = None,
    title: str = "Timeline",
) -> Path:
    """Draw the spans of ``events`` (a trace's, :func:`src.telemetry.tracing.read_trace`) into the PNG ``path``.

    Raises:
        ValueError: the window holds no span.
    """
    rows = lanes(events)
    spans = [span for _, placed in rows for span, _ in placed]
    if not spans:
        raise ValueError("the trace holds no spans")
    origin = min(s["ts"] for s in spans) / 1e6
    window_start = origin + start_s
    window_end = window_start + seconds if seconds is not None else max(s["ts"] + s["dur"] for s in spans) / 1e6
    visible = [
        (name, [(s, d) for s, d in placed if s["ts"] / 1e6 < window_end and (s["ts"] + s["dur"]) / 1e6 > window_start])
        for name, placed in rows
    ]
    visible = [(name, placed) for name, placed in visible if placed]
    if not visible:
        raise ValueError(f"no span between {start_s:g} s and {start_s + (seconds or 0):g} s of the trace")
    names = sorted({s["name"] for _, placed in visible for s, _ in placed})
    color = {name: _TRACE_COLORS[index % len(_TRACE_COLORS)] for index, name in enumerate(names)}
    heights = [max(d for _, d in placed) + 1 for _, placed in visible]

    def draw(ax) -> None:
        base, ticks = 0.0, []
        for (name, placed), height in zip(visible, heights):
            for span, depth in placed:
                begin = max(span["ts"] / 1e6, window_start) - window_start
                end = min((span["ts"] + span["dur"]) / 1e6, window_end) - window_start
                ax.barh(
                    base + depth + 0.4,
                    max(end - begin, 1e-6),
                    left=begin,
                    height=0.8,
                    color=color[span["name"]],
                    edgecolor="white",
                    linewidth=0.4,
                )  # white edges keep back-to-back spans apart
            ticks.append((base + height / 2, name))
            base += height + 0.25
            ax.axhline(base - 0.125, color="#ddd", linewidth=0.6)
        ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks], fontsize=8)
        ax.set_ylim(base, 0)  # first lane on top; nested spans below their parents
        ax.set_xlim(0, window_end - window_start)
        ax.set_xlabel(f"seconds (from {start_s:g} s after the trace's first span)")
        ax.set_title(title)
        ax.grid(axis="x", alpha=0.3)
        ax.legend(
            handles=[Patch(color=color[n], label=n) for n in names],
            fontsize=7,
            loc="upper left",
            bbox_to_anchor=(1.0, 1.0),
            frameon=False,
        )

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _save(path, draw, height=0.9 + 0.42 * sum(heights) + 0.25 * len(visible), width=13, dpi=110)
