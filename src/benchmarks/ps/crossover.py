"""When a sharded parameter server beats ring allreduce: virtual time against BytePS's formulas (``bench_ps.py
--crossover``).

For each link bandwidth B (every worker's uplink and downlink, every server shard's NIC, every DDP rank's link),
each worker count n and each shard count k, one short sync run in virtual time (the real cores and protocol
bytes, :mod:`src.virtual.run`; DDP: :mod:`src.virtual.ddp`) gives the seconds per step: the median virtual time
between consecutive updates. Beside it, the formulas, with M the exact bytes of one push (or pull) measured in
the run and c the cost model's compute seconds per step:

* ``ours_formula_s``: our sharded step, hold then commit then pull, each direction in turn:
  ``c + 2 max(M/B, n M/(k B))``;
* ``byteps_formula_s``: BytePS's rationale for a non-colocated PS, push and pull overlapped on full-duplex links
  (its pipelining of partitions): ``c + max(M/B, n M/(k B))``;
* ``allreduce_formula_s``: ring allreduce, ``c + 2 (n-1)/n M/B``.

``ratio_to_formula`` is the measured PS step over ``ours_formula_s`` (the server's own times, a few ms, are not in
the formula); ``ps_over_ddp`` the measured PS step over the measured DDP step (< 1: the PS wins). The model is
``wide_mlp`` (23 MB: the order of resnet18's 43 MB; every figure scales with M, the ratios do not), sliced in
1 MB pieces so 16 shards hold nearly equal bytes.

**Pipelined** (up to :data:`PIPELINED_MAX_WORKERS` workers, where a run's slice messages stay few enough to
simulate in seconds): the same run with ``system.streaming`` and ``system.pipelined_replies``
(:mod:`src.ps.state.slice_pipeline`): each shard steps a slice of :data:`PIPELINE_SLICE_BYTES` as soon as every
worker's values of it are in and sends it down at once, so the pull overlaps the push, as BytePS's formula
assumes. ``ps_pipelined_step_s`` beside ``byteps_formula_s`` (``pipelined_ratio_to_byteps``), and each
architecture's communication seconds a step (its step less the compute, ``c``): ``communication_over_ring`` is
the ring formula's over the pipelined PS's (the target: >= 1.8 at n = k = 16 on 1 Gbit/s, the formulas
1.875), ``communication_over_ddp`` the measured DDP's over it. The first update gap is left out of every arm's
step (a worker's first hold attaches its connections, and a follower's first round has no certificate to take
its workers from, so the first round is not pipelined; unpipelined, every gap is the same). Virtual time charges
a slice's step no seconds (the real server steps it on a connection's thread, outside the update's lock):
smaller slices cost the real server more per byte than they do here.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from src.benchmarks.common import log

MODEL = "wide_mlp"
BATCH = 8
STEPS = 3
COMPUTE_S = 0.01
SERVER_S = 0.0005
SLICE_BYTES = 1 << 20
PIPELINE_SLICE_BYTES = 16 << 10
"""A provisional slice in the pipelined arm: each shard's last slice crosses the link after the last byte of the push
(16 shards x 16 kB at 1 Gbit/s: 2 ms; the default 128 kB: 17 ms)."""
PIPELINED_MAX_WORKERS = 16


def _config(tmp: str, *, architecture: str, workers: int, shards: int, mbps: float, pipelined: bool = False):
    from src.config import load_config

    pipelining = {
        "system.streaming": True,
        "system.pipelined_replies": True,
        "system.pipeline_slice_bytes": PIPELINE_SLICE_BYTES,
    }
    return load_config(
        overrides={
            **(pipelining if pipelined else {}),
            "training.dataset": "mnist_5k",
            "training.model_architecture": MODEL,
            "training.batch_size": BATCH,
            "training.num_epochs": 1,
            "training.max_train_samples": workers * BATCH * STEPS,
            "training.max_test_samples": 64,
            "training.checkpoint_interval": 10**9,
            "training.eval_at_epoch_ends": False,
            "system.architecture": architecture,
            "system.num_workers": workers,
            "system.num_servers": shards,
            "system.shard_slice_bytes": SLICE_BYTES,
            "system.aggregation_mode": "sync",
            "system.clock": "virtual",
            "system.log_dir": f"{tmp}/logs",
            "system.checkpoint_dir": f"{tmp}/ckpt",
            "system.auth_token": "bench-crossover",
            "emulation.compute_s": COMPUTE_S,
            "emulation.compress_s": 0.0,  # dense pushes: nothing to compress
            "emulation.server_update_s": SERVER_S,
            "emulation.server_reply_s": SERVER_S,
            "emulation.uplink_mbps": mbps,
            "emulation.downlink_mbps": mbps,
            "emulation.server_mbps": mbps,
        }
    )


def _update_gaps(log_dir: Path) -> float:
    """The median virtual seconds between consecutive ``update`` events of shard 0, the first gap left out (see the
    module docstring)."""
    from src.metrics import read_events

    times = [e["time"] for e in read_events(log_dir / "server" / "events.jsonl", "update")]
    return statistics.median(b - a for a, b in list(zip(times, times[1:]))[1:])


def _push_bytes(log_dir: Path) -> int:
    """M: the bytes of one worker's push to every shard (its holds, as the worker counted them), median."""
    from src.metrics import read_events

    sizes = [e["push_bytes"] for e in read_events(log_dir / "worker_0" / "events.jsonl", "push")]
    return int(statistics.median(sizes))


def _ps_run(workers: int, shards: int, mbps: float, pipelined: bool = False) -> tuple[float, int]:
    """One virtual sync PS run: its seconds per step and M."""
    from src.virtual.run import run_virtual

    with tempfile.TemporaryDirectory() as tmp:
        config = _config(
            tmp, architecture="parameter_server", workers=workers, shards=shards, mbps=mbps, pipelined=pipelined
        )
        run_virtual(config, tensorboard=False)
        return _update_gaps(Path(tmp) / "logs"), _push_bytes(Path(tmp) / "logs")


def ps_step(workers: int, shards: int, mbps: float, *, pipelined: bool = False) -> dict[str, Any]:
    """One virtual sync PS run: its seconds per step, M, and the formulas; with ``pipelined``, the pipelined run's
    too."""
    step, model_bytes = _ps_run(workers, shards, mbps)
    link = model_bytes * 8 / (mbps * 1e6)
    server = workers * model_bytes * 8 / (shards * mbps * 1e6)
    ours = COMPUTE_S + 2 * max(link, server)
    row = {
        "workers": workers,
        "shards": shards,
        "mbps": mbps,
        "push_bytes": model_bytes,
        "ps_step_s": round(step, 6),
        "ours_formula_s": round(ours, 6),
        "ratio_to_formula": round(step / ours, 4),
        "byteps_formula_s": round(COMPUTE_S + max(link, server), 6),
    }
    if pipelined:
        piped, _ = _ps_run(workers, shards, mbps, pipelined=True)
        row["ps_pipelined_step_s"] = round(piped, 6)
        row["pipelined_ratio_to_byteps"] = round(piped / row["byteps_formula_s"], 4)
    return row


def ddp_step(workers: int, mbps: float) -> dict[str, Any]:
    """One virtual DDP run (ring allreduce): its seconds per step and the ring formula."""
    import json

    from src.virtual.ddp import run_virtual_ddp

    with tempfile.TemporaryDirectory() as tmp:
        config = _config(tmp, architecture="ddp", workers=workers, shards=1, mbps=mbps)
        summary = run_virtual_ddp(config, summary_json=f"{tmp}/summary.json", tensorboard=False)
        summary = json.loads(Path(f"{tmp}/summary.json").read_text()) if not summary else summary
    steps = summary.get("steps") or summary.get("versions")
    step = summary["train_time_s"] / steps
    return {"workers": workers, "mbps": mbps, "ddp_step_s": round(step, 6)}


def bench_crossover(
    workers: list[int],
    shards: list[int],
    links_mbps: list[float],
    plot: str | Path | None = None,
    *,
    pipelined_max_workers: int = PIPELINED_MAX_WORKERS,
) -> dict[str, Any]:
    """Every (link, n, k) PS run and every (link, n) DDP run, and the pipelined PS run up to
    ``pipelined_max_workers`` workers; the crossover per link and n (the fewest shards whose PS step beats DDP's:
    measured, pipelined, and by BytePS's formula); a plot if ``plot`` names a PNG."""
    rows, ddp = [], {}
    for mbps in links_mbps:
        for n in workers:
            ddp[(mbps, n)] = ddp_step(n, mbps)["ddp_step_s"]
            for k in shards:
                row = ps_step(n, k, mbps, pipelined=n <= pipelined_max_workers)
                row["ddp_step_s"] = ddp[(mbps, n)]
                ring = 2 * (n - 1) / n * row["push_bytes"] * 8 / (mbps * 1e6)
                row["allreduce_formula_s"] = round(COMPUTE_S + ring, 6)
                row["ps_over_ddp"] = round(row["ps_step_s"] / row["ddp_step_s"], 4)
                pipelined = row.get("ps_pipelined_step_s")
                if pipelined is not None:  # each one's communication seconds a step, over the pipelined PS's
                    row["pipelined_over_ddp"] = round(pipelined / row["ddp_step_s"], 4)
                    row["communication_over_ring"] = round(ring / (pipelined - COMPUTE_S), 4)
                    row["communication_over_ddp"] = round((row["ddp_step_s"] - COMPUTE_S) / (pipelined - COMPUTE_S), 4)
                rows.append(row)
                log(
                    f"crossover {mbps:g} Mbit/s n={n} k={k}: PS {row['ps_step_s']:.3f} s "
                    f"(ours {row['ours_formula_s']:.3f}, BytePS {row['byteps_formula_s']:.3f}), "
                    + (f"pipelined {pipelined:.3f} s, " if pipelined is not None else "")
                    + f"DDP {row['ddp_step_s']:.3f} s"
                )
    crossover = []
    for mbps in links_mbps:
        for n in workers:
            mine = [r for r in rows if r["mbps"] == mbps and r["workers"] == n]
            crossover.append(
                {
                    "mbps": mbps,
                    "workers": n,
                    "fewest_shards_beating_ddp": next((r["shards"] for r in mine if r["ps_over_ddp"] < 1), None),
                    "fewest_shards_beating_ddp_byteps": next(
                        (r["shards"] for r in mine if r["byteps_formula_s"] < r["allreduce_formula_s"]), None
                    ),
                    "fewest_shards_beating_ddp_pipelined": next(
                        (r["shards"] for r in mine if r.get("pipelined_over_ddp", 2) < 1), None
                    )
                    if n <= pipelined_max_workers
                    else "not measured",
                }
            )
    pipelined = [r for r in rows if "ps_pipelined_step_s" in r]
    result = {
        "model": MODEL,
        "compute_s": COMPUTE_S,
        "pipeline_slice_bytes": PIPELINE_SLICE_BYTES,
        "rows": rows,
        "crossover": crossover,
        "max_ratio_to_formula_deviation": round(max(abs(r["ratio_to_formula"] - 1) for r in rows), 4),
    }
    if pipelined:
        result["max_pipelined_ratio_to_byteps_deviation"] = round(
            max(abs(r["pipelined_ratio_to_byteps"] - 1) for r in pipelined), 4
        )
        target = [r for r in pipelined if r["workers"] == r["shards"] == 16 and r["mbps"] == 1000]
        if target:  # the ring's communication over the PS's, >= 1.8 (the formulas: 1.875)
            result["target_n16_k16_1gbit"] = {
                key: target[0][key]
                for key in ("communication_over_ring", "communication_over_ddp", "pipelined_over_ddp")
            }
    if plot is not None:
        result["plot"] = str(draw(rows, links_mbps, Path(plot)))
    return result


def draw(rows: list[dict[str, Any]], links_mbps: list[float], path: Path) -> Path:
    """Seconds per step against workers, one panel per link: the PS per shard count, DDP, the pipelined PS and
    BytePS's PS formula (dashed) for the most shards."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(links_mbps), figsize=(6 * len(links_mbps), 4.5), squeeze=False)
    for ax, mbps in zip(axes[0], links_mbps):
        mine = [r for r in rows if r["mbps"] == mbps]
        workers = sorted({r["workers"] for r in mine})
        for k in sorted({r["shards"] for r in mine}):
            ax.plot(
                workers,
                [next(r["ps_step_s"] for r in mine if r["workers"] == n and r["shards"] == k) for n in workers],
                marker="o",
                label=f"PS, {k} shard{'s' if k > 1 else ''}",
            )
        ax.plot(
            workers,
            [next(r["ddp_step_s"] for r in mine if r["workers"] == n) for n in workers],
            color="black",
            linewidth=2.5,
            label="ring allreduce (DDP)",
        )
        most = max(r["shards"] for r in mine)
        piped = sorted({r["workers"] for r in mine if "ps_pipelined_step_s" in r})
        if piped:
            ax.plot(
                piped,
                [
                    next(r["ps_pipelined_step_s"] for r in mine if r["workers"] == n and r["shards"] == most)
                    for n in piped
                ],
                marker="s",
                color="tab:brown",
                linewidth=2,
                label=f"PS, {most} shards, pipelined replies",
            )
        ax.plot(
            workers,
            [next(r["byteps_formula_s"] for r in mine if r["workers"] == n and r["shards"] == most) for n in workers],
            linestyle="--",
            color="gray",
            label=f"BytePS formula, {most} shards (overlapped)",
        )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("seconds per step (virtual)")
        ax.set_title(f"{mbps / 1000:g} Gbit/s links, {MODEL}")
        ax.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
