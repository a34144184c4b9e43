"""The summary block of docs/findings.md: each claim (the spec's F1-F12, F13 on sharded servers, F14 on the controller's
links) beside what was measured.

One row per claim (a finding measured under two setups has a row for each): the finding, what the spec
reports, what the records give (mean [95% interval] over seeds), the target this project set, and whether
it is met (:func:`src.findings.format.verdict`). Each ``_*_rows`` step reads one finding's figures
(:func:`src.findings.figures.compute`) and gives its rows, none when the finding was not measured.
"""

from __future__ import annotations

import re
from typing import Any

from src.findings.format import fmt, points, table, verdict

Row = list[str]


def _f1_rows(f1: dict[str, Any]) -> list[Row]:
    """Plain async against sync under stragglers, at 3 and 16 workers."""
    rows = []
    for workers in ("3", "16"):
        if workers in f1:
            s = f1[workers]["async_plain"]
            rows.append(
                [
                    f"F1 ({workers} workers)",
                    "plain async 10-16x faster than sync",
                    f"plain async {fmt(s['throughput_ratio'], 2, 'x')} the samples/s; "
                    f"ideal {fmt(s['ideal_ratio'], 2, 'x')}; "
                    f"fraction {fmt(s['fraction_of_ideal'], 3)}",
                    ">= 0.9 of the ideal; 10x where the ideal allows",
                    f"0.9 of ideal: {verdict(s['fraction_of_ideal'], 0.9)}; "
                    f"10x: {verdict(s['throughput_ratio'], 10.0)}",
                ]
            )
    return rows


def _f2_f5_rows(f2: dict[str, Any]) -> list[Row]:
    """Top-k 0.25 + error feedback against dense: bytes and accuracy, under each optimizer."""
    if "sgd" not in f2 or "topk25_ef" not in f2["sgd"]:
        return []
    rows = []
    for optimizer in ("sgd", "momentum"):
        arm = f2[optimizer]["topk25_ef"]
        difference = arm["accuracy_difference"]
        within = "yes" if difference["low"] is not None and difference["high"] >= 0 else "no"
        rows.append(
            [
                f"F2/F5 ({'plain SGD' if optimizer == 'sgd' else 'momentum 0.9'})",
                "top-k + EF: <= 50% of the bytes, +0.64 pts",
                f"top-k 0.25 + EF: {fmt(arm['bytes_ratio'], 3)} of the bytes, {points(difference)}",
                "<= 50% of the bytes, accuracy within the interval of dense",
                f"bytes: {verdict(arm['bytes_ratio'], 0.5, above=False)}; accuracy not below dense: {within}",
            ]
        )
    return rows


def _f3_rows(f3: dict[str, Any]) -> list[Row]:
    """Staleness control against plain async: more bytes and slower, the applied staleness bounded."""
    if not f3:
        return []
    high = next(iter(f3["time_to_target_ratio"]))
    staleness = f3["applied_max_staleness"]
    return [
        [
            "F3 (staleness control)",
            "insurance, not speed: more bytes, slower; applied staleness <= S_max",
            f"bytes {fmt(f3['bytes_ratio'], 4, 'x')} of plain async's; largest applied staleness "
            f"{fmt(staleness['bounded'], 0)} against {fmt(staleness['plain'], 0)}; "
            f"time to {float(high):g} {fmt(f3['time_to_target_ratio'][high], 2, 'x')} of plain's; final accuracy "
            f"{points(f3['final_accuracy_difference'])}",
            "-",
            f"more bytes: {verdict(f3['bytes_ratio'], 1.0)}; slower: {verdict(f3['time_to_target_ratio'][high], 1.0)}",
        ]
    ]


def _f4_f6_rows(f2: dict[str, Any]) -> list[Row]:
    """Top-k without error feedback costs accuracy (F4) and error feedback recovers it (F6), per optimizer."""
    rows = []
    for optimizer, label in (("sgd", "plain SGD"), ("momentum", "momentum 0.9")):
        arms = f2.get(optimizer, {})
        if "topk25" not in arms:
            continue
        rows.append(
            [
                f"F4 ({label})",
                "top-k without EF costs accuracy (-0.55 pts Fashion-MNIST, -1.18 CIFAR-10)",
                f"top-k 0.25 without EF: {points(arms['topk25']['accuracy_difference'])}; 0.01: "
                f"{points(arms['topk1']['accuracy_difference'])}",
                "-",
                f"costs accuracy: {verdict(arms['topk25']['accuracy_difference'], 0.0, above=False)}",
            ]
        )
        rows.append(
            [
                f"F6 ({label})",
                "EF recovers ~1.82 pts (CIFAR-10), ~0.6 (Fashion-MNIST)",
                f"at rho 0.25: {points(arms['ef_recovers']['25'])}; 0.01: {points(arms['ef_recovers']['1'])}",
                "-",
                f"recovers: {verdict(arms['ef_recovers']['25'], 0.0)}",
            ]
        )
    return rows


def _f8_f10_rows(f8: dict[str, Any]) -> list[Row]:
    """Top-k + EF against dense async at 250 Mbit/s (F8/F9), and across the link regimes (F10)."""
    links = f8.get("links", {})
    rows = []
    if "250" in links:
        link = links["250"]
        low = str(f8["thresholds"][0])
        rows.append(
            [
                "F8/F9 (250 Mbit/s)",
                "top-k + EF 1.98x faster to target than dense async",
                f"{fmt(link['time_to_target_speedup'][low], 2, 'x')} to {float(low):g} "
                f"(ceiling {fmt(link['per_step_ceiling'], 2, 'x')})",
                ">= 1.98x, or >= 0.9 of the per-step ceiling where that is lower",
                f"1.98x: {verdict(link['time_to_target_speedup'][low], 1.98)}; 0.9 of the ceiling: "
                f"{verdict(link['fraction_of_ceiling'][low], 0.9)}",
            ]
        )
    if "lan" in links and "25" in links:
        low = str(f8["thresholds"][0])
        lan, narrow = links["lan"], links["25"]
        rows.append(
            [
                "F10 (link regimes)",
                "compression pays only when the link is the bottleneck",
                f"top-k 0.25 + EF over dense, time to {float(low):g}: "
                f"10 Gbit/s {fmt(lan['time_to_target_speedup'][low], 2, 'x')}, "
                f"250 Mbit/s {fmt(links['250']['time_to_target_speedup'][low], 2, 'x')}, "
                f"25 Mbit/s {fmt(narrow['time_to_target_speedup'][low], 2, 'x')}",
                "-",
                f"no gain at 10 Gbit/s: {verdict(lan['time_to_target_speedup'][low], 1.0, above=False)}",
            ]
        )
    return rows


def _controller_rows(f11: dict[str, Any]) -> list[Row]:
    """The controller's path (F7), against dense (F9), its persistence (F12), against the best fixed rho (F11)."""
    if not f11 or f11["best_fixed"] is None:
        return []
    low = str(f11["thresholds"][0])
    best = f11["best_fixed"]
    c, p = f11["controller"], f11["persistence"]
    dense, fixed = f11["vs"]["dense"], f11["vs"][best]
    return [
        [
            "F7 (the controller's path)",
            "rho 0.25 -> 0.05 (its floor), no false instability trips",
            f"final rho {fmt(c['final_rho'], 3)}; floor reached in {c['reached_floor']} runs after "
            f"{fmt(c['evaluations_to_floor'], 1)} evaluations; "
            f"{fmt(c['compress_less'], 2)} compress-less decisions a run",
            "-",
            "-",
        ],
        [
            "F9 (adaptive vs dense async)",
            "2.6x faster to finish, 3x to 0.80, than plain async",
            f"time to {float(low):g}: {fmt(dense['time_to_target_speedup'][low], 2, 'x')} sooner than dense",
            "-",
            f"faster: {verdict(dense['time_to_target_speedup'][low], 1.0)}",
        ],
        [
            "F12 (persistence)",
            "never engaged after the rebound fix",
            f"engaged in {p['engaged_runs']} of {p['runs']} runs",
            "-",
            "-",
        ],
        [
            "F11 (controller, link 250 -> 25 Mbit/s)",
            "3.65x-9x compression; beats the best fixed policy on bytes",
            f"vs best fixed ({best}): {fmt(fixed['time_to_target_speedup'][low], 2, 'x')} to {float(low):g}, "
            f"{fmt(fixed['bytes_ratio'], 3)} of its bytes; vs dense: "
            f"{fmt(dense['time_to_target_speedup'][low], 2, 'x')}, {fmt(dense['bytes_ratio'], 3)} of its bytes",
            "against the best fixed rho and dense, with intervals",
            f"faster than the best fixed: {verdict(fixed['time_to_target_speedup'][low], 1.0)}; "
            f"than dense: {verdict(dense['time_to_target_speedup'][low], 1.0)}",
        ],
    ]


def _f13_rows(f13: dict[str, Any]) -> list[Row]:
    """Sync PS with k = n shards and async PS with one server against ring allreduce, with and without a straggler."""
    vs = f13.get("vs_ddp", {}) if f13 else {}
    sync = next((name for name in ("sync_k8", "sync_k4", "sync_k2", "sync_k1") if name in vs), None)
    if sync is None or "async_k1" not in vs:
        return []
    shards = f13["arms"][sync]["shards"]
    asyncs = [(name, f13["arms"][name]["straggler_s"]) for name in vs if f13["arms"][name]["kind"] == "async"]
    slowest, slowest_s = max(asyncs, key=lambda pair: pair[1])
    by_straggler = ", ".join(
        f"{'no straggler' if seconds == 0 else f'+{seconds:g} s'} {fmt(vs[name]['time_per_sample_ratio'], 2, 'x')}"
        for name, seconds in asyncs
    )
    piped = f"{sync}_pipelined" if f"{sync}_pipelined" in vs else None
    with_pipelining = (
        f"; pipelined replies: {fmt(vs[piped]['time_per_sample_ratio'], 2, 'x')} (formulas "
        f"{fmt(vs[piped]['formula_ratio'], 2, 'x')})"
        if piped
        else ""
    )
    verdicts = f"sync PS beats ring: {verdict(vs[sync]['time_per_sample_ratio'], 1.0, above=False)}"
    if piped:
        verdicts += f", with pipelined replies: {verdict(vs[piped]['time_per_sample_ratio'], 1.0, above=False)}"
    return [
        [
            "F13 (sharded PS vs ring allreduce)",
            "F13: when does a sharded PS beat ring allreduce (BytePS: with k = n shards)?",
            f"time per sample, PS / DDP at {f13['workers']} workers, {f13['link_mbps']:g} Mbit/s: sync PS, "
            f"k = {shards}: {fmt(vs[sync]['time_per_sample_ratio'], 2, 'x')} (formulas "
            f"{fmt(vs[sync]['formula_ratio'], 2, 'x')}){with_pipelining}; async PS, 1 server: {by_straggler}",
            "-",
            f"{verdicts}; async PS with a +{slowest_s:g} s straggler: "
            f"{verdict(vs[slowest]['time_per_sample_ratio'], 1.0, above=False)}",
        ]
    ]


def _f14_rows(f14: dict[str, Any]) -> list[Row]:
    """F14: the controller against the best fixed compression on four links."""
    if not f14:
        return []
    met, cells = f14["cells_met"]
    failed = [
        f"{link} to {t}"
        for link, cell in f14["links"].items()
        for t, target in cell["targets"].items()
        if "controller" in target
        and not (all(target["controller"]["met"].values()) and target.get("vs_dense", {}).get("met", True))
    ]
    return [
        [
            "F14 (controller on four links)",
            "F14: no later than the best fixed compression, in as many seeds, with <= 1.2x its bytes, on every "
            "link; within 5% of dense at 10 Gbit/s",
            f"every target met in {met} of {cells} link-and-target cells"
            + (f"; not in: {', '.join(failed)}" if failed else ""),
            "all cells",
            f"all cells: {'yes' if met == cells else 'no'}",
        ]
    ]


def summary_table(figures: dict[str, Any]) -> list[str]:
    """The summary block's lines: every claim's row, in the order F1 ... F13."""
    f2 = figures["F2_F4_F5_F6"]
    rows = _f1_rows(figures["F1"]) + _f2_f5_rows(f2) + _f3_rows(figures["F3"]) + _f4_f6_rows(f2)
    rows += _f8_f10_rows(figures["F8_F9_F10"]) + _controller_rows(figures["F7_F11_F12"])
    rows += _f13_rows(figures.get("F13", {})) + _f14_rows(figures.get("F14", {}))
    rows.sort(key=lambda row: int(re.match(r"F(\d+)", row[0]).group(1)))  # F1 ... F13 (stable within one)
    return table(["finding", "spec", "measured here (mean [95% interval] over seeds)", "target", "met"], rows)
