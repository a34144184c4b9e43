"""Each finding's Markdown block of docs/findings.md, written from the figures of :func:`src.findings.figures.compute`.

:func:`render` gives ``{block name: Markdown}``: one block per finding (its tables and A/A lines), the
real-clock confirmations, the matrices' provenance and the summary (:mod:`src.findings.summary`).
"""

from __future__ import annotations

from typing import Any, Callable

from src.findings.controller_links import CONTROLLERS, FIXED, LINKS
from src.findings.figures import COMPRESSION_ARMS
from src.findings.format import fmt, points, table
from src.findings.summary import summary_table


def _render_f1(f: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for workers, level in f.items():
        low, high = level["thresholds"]
        lines += [
            f"**{workers} workers** ({level['seeds']} seeds; sync: {fmt(level['sync_throughput'], 0)} samples/s, "
            f"final accuracy {fmt(level['sync_final_accuracy'], 3)}):",
            "",
        ]
        rows = []
        for setup, label in (
            ("async_plain", "plain async (the spec's)"),
            ("async_lookahead", "async, lookahead (ours)"),
        ):
            s = level[setup]
            to_high = s["samples_to_target"][str(high)]
            rows.append(
                [
                    label,
                    fmt(s["throughput_ratio"], 2, "x"),
                    fmt(s["ideal_ratio"], 2, "x"),
                    fmt(s["fraction_of_ideal"], 3),
                    fmt(s["time_to_target_speedup"][str(low)], 2, "x"),
                    fmt(s["time_to_target_speedup"][str(high)], 2, "x"),
                    f"{fmt(to_high['async'], 0)} ({to_high['reached']['async']})"
                    f" vs {fmt(to_high['sync'], 0)} ({to_high['reached']['sync']})",
                    fmt(s["auc_difference"], 3),
                    points(s["final_accuracy_difference"]),
                ]
            )
        lines += table(
            [
                "async",
                "samples/s over sync",
                "ideal ratio",
                "fraction of ideal",
                f"time to {low:g}: sync/async",
                f"time to {high:g}: sync/async",
                f"samples to {high:g}: async vs sync (reached)",
                "area under accuracy-time, async - sync",
                "final accuracy, async - sync",
            ],
            rows,
        )
        lines += [
            "",
            f"A/A (sync repeated): samples/s ratio {fmt(level['aa']['throughput_ratio'], 3, 'x')}, final accuracy "
            f"{points(level['aa']['final_accuracy_difference'])}.",
            "",
        ]
    return lines


def _render_f3(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    rows = [
        [
            "applied staleness, largest",
            fmt(f["applied_max_staleness"]["plain"], 1),
            fmt(f["applied_max_staleness"]["bounded"], 1),
        ],
        ["pushes rejected", "0", fmt(f["pushes_rejected"], 1)],
        ["final accuracy", fmt(f["final_accuracy"]["plain"], 3), fmt(f["final_accuracy"]["bounded"], 3)],
    ]
    for t, ratio in f["time_to_target_ratio"].items():
        rows.append(
            [
                f"time to {float(t):g} (reached)",
                f"1 ({f['reached'][t]['plain']})",
                f"{fmt(ratio, 2, 'x')} of plain's ({f['reached'][t]['bounded']})",
            ]
        )
    lines = table(["", "plain async", "soft weight + hard bound S_max = 4"], rows)
    return lines + [
        "",
        f"Bounded over plain ({f['seeds']} seeds, paired): bytes sent {fmt(f['bytes_ratio'], 4, 'x')}, "
        f"final accuracy {points(f['final_accuracy_difference'])}, area under accuracy-time "
        f"{fmt(f['auc_difference'], 3)}.",
    ]


ARM_LABELS = {
    "topk25": "top-k 0.25",
    "topk25_ef": "top-k 0.25 + EF",
    "topk10": "top-k 0.1",
    "topk10_ef": "top-k 0.1 + EF",
    "topk1": "top-k 0.01",
    "topk1_ef": "top-k 0.01 + EF",
    "topk1_ef_warmup": "top-k 0.01 + EF + warm-up",
}


def _render_f2(f: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for optimizer, label in (
        ("sgd", "plain SGD, plain async (the spec's)"),
        ("momentum", "momentum 0.9, lookahead (ours)"),
    ):
        if optimizer not in f:
            continue
        arms = f[optimizer]
        lines += [
            f"**{label}** ({f['seeds']} seeds; dense: final accuracy {fmt(arms['dense']['final_accuracy'], 3)}):",
            "",
        ]
        rows = [
            [
                ARM_LABELS[arm],
                fmt(arms[arm]["bytes_ratio"], 3),
                fmt(arms[arm]["final_accuracy"], 3),
                points(arms[arm]["accuracy_difference"]),
            ]
            for arm in COMPRESSION_ARMS
            if arm in arms
        ]
        rows.append(
            ["dense again (A/A)", fmt(arms["aa"]["bytes_ratio"], 3), "", points(arms["aa"]["accuracy_difference"])]
        )
        lines += table(["compression", "bytes sent, of dense", "final accuracy", "accuracy - dense"], rows)
        recovered = ", ".join(
            f"rho 0.{rho if rho != '1' else '01'}: {points(value)}" for rho, value in arms["ef_recovers"].items()
        )
        lines += [
            "",
            f"Error feedback recovers (EF - no EF, paired): {recovered}; the warm-up adds "
            f"{points(arms['warmup_adds'])} to top-k 0.01 + EF.",
            "",
        ]
    return lines


def _render_f8(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    low, high = f["thresholds"]
    rows = []
    for value in f["links"].values():
        rows.append(
            [
                value["link"],
                f"{value['rho']:g}",
                fmt(value["bytes_ratio"], 3),
                f"{fmt(value['per_step_s']['dense'], 3)} / {fmt(value['per_step_s']['compressed'], 3)}",
                fmt(value["per_step_ceiling"], 2, "x"),
                fmt(value["throughput_ratio"], 2, "x"),
                f"{fmt(value['time_to_target_speedup'][str(low)], 2, 'x')} "
                f"({value['reached'][str(low)]['compressed']})",
                f"{fmt(value['time_to_target_speedup'][str(high)], 2, 'x')} "
                f"({value['reached'][str(high)]['compressed']})",
                fmt(value["fraction_of_ceiling"][str(low)], 2),
                points(value["accuracy_difference"]),
            ]
        )
    lines = table(
        [
            "uplink",
            "rho",
            "bytes, of dense",
            "s per push: dense / top-k",
            "per-step ceiling",
            "samples/s, top-k over dense",
            f"time to {low:g}: dense / top-k (reached)",
            f"time to {high:g}: dense / top-k (reached)",
            f"fraction of the ceiling (to {low:g})",
            "final accuracy, top-k - dense",
        ],
        rows,
    )
    return lines + [
        "",
        f"A/A (250 Mbit/s dense repeated, {f['seeds']} seeds): time to {low:g} ratio "
        f"{fmt(f['aa']['time_to_target_ratio'], 3, 'x')}, "
        f"final accuracy {points(f['aa']['final_accuracy_difference'])}.",
    ]


def _render_f11(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    low, high = f["thresholds"]
    labels = {
        "dense": "dense",
        "rho25": "fixed 0.25",
        "rho10": "fixed 0.1",
        "rho5": "fixed 0.05",
        "rho1": "fixed 0.01",
        "controller": "controller (link; 0.25, floor 0.05)",
        "controller_persistent": "controller + persistence 2",
        "controller_rebound": "old controller (rebound)",
    }
    rows = []
    for name, label in labels.items():
        if name not in f["arms"]:
            continue
        arm = f["arms"][name]
        rows.append(
            [
                label + (" (best fixed)" if name == f["best_fixed"] else ""),
                f"{fmt(arm['time_to_target_s'][str(low)], 2)} ({arm['reached'][str(low)]})",
                f"{fmt(arm['time_to_target_s'][str(high)], 2)} ({arm['reached'][str(high)]})",
                fmt(arm["bytes_mb"], 0),
                fmt(arm["final_accuracy"], 3),
                fmt(arm["train_time_s"], 1),
            ]
        )
    lines = table(
        ["arm", f"s to {low:g} (reached)", f"s to {high:g} (reached)", "MB sent", "final accuracy", "train s"], rows
    )
    lines += ["", "The controller against each (paired by seed; speed-up = the other's time / the controller's):", ""]
    vs = []
    for name in ("dense", "rho25", "rho10", "rho5", "rho1"):
        value = f["vs"][name]
        vs.append(
            [
                labels[name],
                fmt(value["time_to_target_speedup"][str(low)], 2, "x"),
                fmt(value["time_to_target_speedup"][str(high)], 2, "x"),
                fmt(value["bytes_ratio"], 3),
                points(value["accuracy_difference"]),
                fmt(value["auc_difference"], 3),
            ]
        )
    lines += table(
        [
            "against",
            f"speed-up to {low:g}",
            f"speed-up to {high:g}",
            "controller's bytes, of its",
            "accuracy, controller - it",
            "area under accuracy-time, controller - it",
        ],
        vs,
    )
    c, p = f["controller"], f["persistence"]
    lines += [
        "",
        f"The controller's path: {fmt(c['compress_more'], 1)} compress-more and {fmt(c['compress_less'], 1)} "
        f"compress-less decisions a run, at its floor ({f['floor']:g}) after {fmt(c['evaluations_to_floor'], 1)} "
        f"evaluations ({c['reached_floor']} runs reached it), final rho {fmt(c['final_rho'], 3)}.",
        "",
        f"Persistence (F12): held a rebound in {p['engaged_runs']} of {p['runs']} runs "
        f"({fmt(p['held'], 2)} holds a run), {fmt(p['compress_less'], 2)} compress-less decisions a run; against "
        f"the controller without it: time to {low:g} ratio {fmt(p['time_to_target_ratio'], 3, 'x')}, bytes "
        f"{fmt(p['bytes_ratio'], 3, 'x')}, final accuracy {points(p['final_accuracy_difference'])}.",
        "",
        f"A/A (fixed 0.25 repeated): time to {low:g} ratio {fmt(f['aa']['time_to_target_ratio'], 3, 'x')}, "
        f"final accuracy {points(f['aa']['final_accuracy_difference'])}.",
    ]
    return lines


def _f13_label(arm: dict[str, Any]) -> str:
    if arm["kind"] == "ddp":
        return "DDP (ring allreduce)"
    if arm["kind"] == "sync":
        return f"sync PS, k = {arm['shards']}" + (", pipelined replies" if arm.get("pipelined") else "")
    return f"async PS, {arm['shards']} server" + ("s" if arm["shards"] > 1 else "")


def _render_f13(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    low, high = f["thresholds"]
    straggler = lambda arm: f"+{arm['straggler_s']:g} s" if arm["straggler_s"] else "none"  # noqa: E731
    rows = []
    for name, arm in f["arms"].items():
        rows.append(
            [
                _f13_label(arm),
                straggler(arm),
                str(arm["samples_per_step"]),
                fmt(arm["step_s"], 3),
                fmt(arm["formula_s"], 3),
                fmt(arm["step_over_formula"], 2),
                fmt(arm["byteps_formula_s"], 3),
                fmt(arm["throughput"], 0),
                f"{fmt(arm['time_to_target_s'][str(low)], 1)} ({arm['reached'][str(low)]})",
                f"{fmt(arm['time_to_target_s'][str(high)], 1)} ({arm['reached'][str(high)]})",
                fmt(arm["samples_to_target"][str(high)], 0),
                fmt(arm["final_accuracy"], 3),
            ]
        )
    lines = table(
        [
            "arm",
            "straggler",
            "samples a step",
            "s per step",
            "formula (ours), s",
            "measured / formula",
            "BytePS formula, s",
            "samples/s",
            f"s to {low:g} (reached)",
            f"s to {high:g} (reached)",
            f"samples to {high:g}",
            "final accuracy",
        ],
        rows,
    )
    lines += ["", "Against DDP under the same straggler (paired by seed; < 1: the parameter server is faster):", ""]
    vs = []
    for name, value in f["vs_ddp"].items():
        arm = f["arms"][name]
        vs.append(
            [
                _f13_label(arm),
                straggler(arm),
                fmt(value["time_per_sample_ratio"], 2, "x"),
                fmt(value["formula_ratio"], 2, "x"),
                fmt(value["time_to_target_ratio"][str(low)], 2, "x"),
                fmt(value["time_to_target_ratio"][str(high)], 2, "x"),
                points(value["final_accuracy_difference"]),
            ]
        )
    lines += table(
        [
            "parameter server",
            "straggler",
            "time per sample, PS / DDP",
            "by the formulas",
            f"time to {low:g}, PS / DDP",
            f"time to {high:g}, PS / DDP",
            "final accuracy, PS - DDP",
        ],
        vs,
    )
    same = ", ".join(f"{name} {count}" for name, count in f["same_update"].items())
    return lines + [
        "",
        f"Sharded sync runs ending on the one-server run's model (their curves read from it): {same or 'none'}.",
        "",
        f"A/A (DDP repeated, {f['seeds']} seeds): samples/s ratio {fmt(f['aa']['throughput_ratio'], 3, 'x')}, "
        f"time to {low:g} ratio {fmt(f['aa']['time_to_target_ratio'], 3, 'x')}, "
        f"final accuracy {points(f['aa']['final_accuracy_difference'])}.",
    ]


def _render_f14(f: dict[str, Any]) -> list[str]:
    if not f:
        return ["(not measured)"]
    low, high = f["thresholds"]
    arms = {**FIXED, **CONTROLLERS}
    rows = []
    for arm, label in arms.items():
        row = [label]
        for cell in f["links"].values():
            a = cell["arms"][arm]
            row.append(
                " / ".join(f"{fmt(a['time_to_target_s'][str(t)], 2)} ({a['reached'][str(t)]})" for t in (low, high))
            )
        rows.append(row)
    lines = [f"Seconds (virtual) to {low:g} / to {high:g}, (seeds reaching it), {f['seeds']} seeds:", ""]
    lines += table(["arm", *LINKS.values()], rows)
    lines += ["", "Each link and target against its best fixed arm (the most seeds reaching it, then the soonest):", ""]
    verdicts = []
    for link, cell in f["links"].items():
        for t in (low, high):
            target = cell["targets"][str(t)]
            best = target["best"]
            if best is None:
                verdicts.append([LINKS[link], f"{t:g}", "none reaches it", "-", "-", "-", "-", "-"])
                continue
            b, c, r = cell["arms"][best], target["controller"], target["rebound"]
            met = c["met"]
            judged = [f"time: {_yes(met['time'])}", f"seeds: {_yes(met['seeds'])}", f"bytes: {_yes(met['bytes'])}"]
            if "vs_dense" in target:
                v = target["vs_dense"]
                judged.append(f"within 5% of dense: {_yes(v['met'])} ({fmt(v['time_ratio'], 3, 'x')})")
            verdicts.append(
                [
                    LINKS[link],
                    f"{t:g}",
                    f"{FIXED[best]}: {fmt(b['time_to_target_s'][str(t)], 2)} ({target['best_reached']}/{f['seeds']})",
                    f"{fmt(cell['arms']['controller']['time_to_target_s'][str(t)], 2)} ({c['reached']}/{f['seeds']})",
                    fmt(c["time_ratio"], 3, "x"),
                    fmt(c["bytes_ratio"], 3, "x"),
                    f"{fmt(r['time_ratio'], 3, 'x')} ({r['reached']}/{f['seeds']})",
                    "; ".join(judged),
                ]
            )
    lines += table(
        [
            "link",
            "target",
            "best fixed arm: s (seeds)",
            "controller: s (seeds)",
            "time, controller / best",
            "bytes to target, controller / best",
            "old controller / best (seeds)",
            "met",
        ],
        verdicts,
    )
    met, cells = f["cells_met"]
    lines += [
        "",
        f"Cells where the controller meets every target: {met} of {cells}. A/A (fixed 0.05 repeated, link drop): "
        f"time to {low:g} ratio {fmt(f['aa']['time_to_target_ratio'], 3, 'x')}, final accuracy "
        f"{points(f['aa']['final_accuracy_difference'])}.",
    ]
    return lines


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _render_realtime(r: dict[str, Any]) -> list[str]:
    rows = []
    if "F1" in r:
        f = r["F1"]
        rows += [
            [
                "F1, 3 workers, one +0.3 s: plain async samples/s over sync",
                fmt(f["throughput_ratio"]["virtual"], 2, "x"),
                fmt(f["throughput_ratio"]["real"], 2, "x"),
            ],
            ["F1: sync samples/s", fmt(f["sync_throughput"]["virtual"], 0), fmt(f["sync_throughput"]["real"], 0)],
            [
                "F1: plain async samples/s",
                fmt(f["async_throughput"]["virtual"], 0),
                fmt(f["async_throughput"]["real"], 0),
            ],
            [
                f"F1: time to {f['threshold']:g}, sync / async "
                f"(real: reached sync {f['reached']['real']['sync']}, async {f['reached']['real']['async']})",
                fmt(f["time_to_target_speedup"]["virtual"], 2, "x"),
                fmt(f["time_to_target_speedup"]["real"], 2, "x"),
            ],
        ]
    if "F8" in r:
        f = r["F8"]
        rows += [
            [
                "F8, 250 Mbit/s: per-step ceiling, dense / top-k 0.25",
                fmt(f["per_step_ceiling"]["virtual"], 2, "x"),
                fmt(f["per_step_ceiling"]["real"], 2, "x"),
            ],
            [
                "F8: samples/s, top-k 0.25 over dense",
                fmt(f["throughput_ratio"]["virtual"], 2, "x"),
                fmt(f["throughput_ratio"]["real"], 2, "x"),
            ],
            [
                f"F8: time to {f['threshold']:g}, dense / top-k "
                f"(real: reached dense {f['reached']['real']['dense']}, top-k {f['reached']['real']['compressed']})",
                fmt(f["time_to_target_speedup"]["virtual"], 2, "x"),
                fmt(f["time_to_target_speedup"]["real"], 2, "x"),
            ],
        ]
    if not rows:
        return ["(not measured)"]
    seeds = r.get("F1", r.get("F8"))
    return table(
        ["figure", f"virtual time ({seeds['virtual_seeds']} seeds)", f"real time ({seeds['seeds']} seeds)"], rows
    )


def _render_provenance(p: dict[str, Any]) -> list[str]:
    rows = [
        [
            name,
            str(v["runs"]),
            str(v["configurations"]),
            str(v["seeds"]),
            ", ".join(v["clocks"]),
            "; ".join(v["kernels"]) or "-",
            ", ".join(v["commits"]) + (" (changes)" if v["dirty"] else ""),
            "-" if v["load_1min"] is None else f"{v['load_1min'][0]:.2f}-{v['load_1min'][1]:.2f}",
            f"{v['wall_s'] / 60:.1f}",
        ]
        for name, v in p.items()
    ]
    return table(
        ["matrix", "runs", "configurations", "seeds", "clock", "CPU kernels", "commit", "load (1 min)", "wall minutes"],
        rows,
    )


RENDERERS: dict[str, Callable[[Any], list[str]]] = {
    "F1": _render_f1,
    "F3": _render_f3,
    "F2_F4_F5_F6": _render_f2,
    "F8_F9_F10": _render_f8,
    "F7_F11_F12": _render_f11,
    "F13": _render_f13,
    "F14": _render_f14,
    "realtime": _render_realtime,
    "provenance": _render_provenance,
}


def render(figures: dict[str, Any]) -> dict[str, str]:
    """``{block name: Markdown}`` of every block of docs/findings.md."""
    blocks = {name: "\n".join(RENDERERS[name](figures[name])) for name in RENDERERS}
    blocks["summary"] = "\n".join(summary_table(figures))
    return blocks
