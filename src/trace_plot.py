"""A picture of a (merged) trace: its spans as a timeline, one lane per process and thread (headless matplotlib).

Perfetto and ``chrome://tracing`` are the tools to explore a trace; this draws a still image of one
for documents and machines without a browser (``scripts/plot_trace.py``; docs/observability.md's
screenshot). Each thread is a lane, named ``process / thread``; a span is a bar from its start to
its end, nested spans drawn below the span that holds them (one row per depth), colored by name.
``start_s`` / ``seconds`` cut a window (seconds from the trace's first span) to see single steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import matplotlib

matplotlib.use("Agg")  # headless: no display on CI or servers

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

_COLORS = plt.rcParams["axes.prop_cycle"].by_key()["color"] + ["#333333", "#a6cee3", "#fb9a99", "#fdbf6f", "#cab2d6"]


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
    """Draw the spans of ``events`` (a trace's, :func:`src.tracing.read_trace`) into the PNG ``path``.

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
    color = {name: _COLORS[index % len(_COLORS)] for index, name in enumerate(names)}
    heights = [max(d for _, d in placed) + 1 for _, placed in visible]
    figure, ax = plt.subplots(figsize=(13, 0.9 + 0.42 * sum(heights) + 0.25 * len(visible)), dpi=110)
    try:
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
        figure.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png")
    finally:
        plt.close(figure)
    return path
