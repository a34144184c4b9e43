"""A study of parameter-server configurations: each run several times, a table of final accuracy and staleness.

Each run is a real ``run_parameter_server_training.py`` job (server and worker processes, gRPC)
writing under the study's folder (never the repository); the table is built from each run's summary
JSON and the server's ``events.jsonl`` (staleness histogram of the pushes). Async runs are
timing-dependent, so every configuration runs several times and the table gives mean, min and max.

A configuration is a name and the runner's flags. A slow factor F > 1 runs the server and workers
as separate roles (the same runner, ``--role server`` / ``--role worker``) so that worker 0 can be
slowed for real: it is stopped (SIGSTOP) and continued (SIGCONT) in a duty cycle that leaves it a
fraction 1/F of the time (F=3: stopped 2/3 of every 60 ms). The command: ``scripts/async_study.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "run_parameter_server_training.py"
SPEC_ASYNC_TOPK = "--aggregation-mode async --compression-enabled --compression-type topk --compression-ratio 0.1"
SPEC_SYNC_TOPK = "--aggregation-mode sync --compression-enabled --compression-type topk --compression-ratio 0.1"


def preset(dataset: str, extra: str = "") -> list[tuple[str, str]]:
    """The spec's commands (2 and 4 workers, async with and without top-k) and their sync references."""
    configs = []
    for n in (2, 4):
        base = f"--workers {n} --dataset {dataset} --num-epochs 2 {extra}".strip()
        configs += [
            (f"sync  N={n}", f"{base} --aggregation-mode sync"),
            (f"async N={n}", f"{base} --aggregation-mode async"),
            (f"sync  N={n} topk 0.1", f"{base} {SPEC_SYNC_TOPK}"),
            (f"async N={n} topk 0.1", f"{base} {SPEC_ASYNC_TOPK}"),
        ]
    return configs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _duty_cycle(process: subprocess.Popen, factor: float, stop: threading.Event, period_s: float = 0.06) -> None:
    """Keep ``process`` running only 1/factor of the time until ``stop`` is set (or it exits)."""
    running_s = period_s / factor
    while not stop.is_set() and process.poll() is None:
        time.sleep(running_s)
        try:
            process.send_signal(signal.SIGSTOP)
            time.sleep(period_s - running_s)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)


def _run_roles(flags: list[str], out: Path, slow_factor: float, timeout_s: float) -> int:
    """Server and workers as separate role processes; worker 0 slowed by ``slow_factor``."""
    workers = int(flags[flags.index("--workers") + 1]) if "--workers" in flags else 2
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "DTS_AUTH_TOKEN": secrets.token_urlsafe(24), "OMP_NUM_THREADS": "1"}
    common = ["--checkpoint-dir", str(out / "ckpt"), "--log-dir", str(out / "logs"), "--server-address", address]
    processes: list[subprocess.Popen] = []
    stop = threading.Event()
    try:
        with open(out / "server.out", "w") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(RUNNER), *flags, *common, "--role", "server"],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        for k in range(workers):
            with open(out / f"worker_{k}.out", "w") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(RUNNER), "--role", "worker", "--worker-id", str(k), *common],
                        cwd=ROOT,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        slowed = threading.Thread(target=_duty_cycle, args=(processes[1], slow_factor, stop), daemon=True)
        slowed.start()
        return processes[0].wait(timeout_s)
    finally:
        stop.set()
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()


def run_one(name: str, flags_text: str, out: Path, *, slow_factor: float, timeout_s: float) -> dict:
    """One run of the runner with ``flags_text`` under ``out``: its exit status, time and figures."""
    out.mkdir(parents=True, exist_ok=True)
    flags = shlex.split(flags_text)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    if slow_factor > 1:
        rc = _run_roles(flags, out, slow_factor, timeout_s)
    else:
        with open(out / "run.out", "w") as log:
            rc = subprocess.run(
                [
                    sys.executable,
                    str(RUNNER),
                    *flags,
                    "--checkpoint-dir",
                    str(out / "ckpt"),
                    "--log-dir",
                    str(out / "logs"),
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
            ).returncode
    result = {
        "name": name,
        "flags": flags_text,
        "rc": rc,
        "wall_s": round(time.perf_counter() - started, 1),
        "load_before": load_before,
        "slow_factor": slow_factor,
    }
    summary_path = out / "logs" / "summary.json"
    if rc == 0 and summary_path.exists():
        summary = json.loads(summary_path.read_text())
        result.update(
            {
                k: summary.get(k)
                for k in (
                    "final_accuracy",
                    "final_loss",
                    "mean_staleness",
                    "max_staleness",
                    "pushes_applied",
                    "pushes_rejected",
                    "versions",
                    "train_time_s",
                )
            }
        )
        events = out / "logs" / "server" / "events.jsonl"
        pushes = [json.loads(line) for line in events.read_text().splitlines() if '"kind": "push"' in line]
        histogram = Counter(e["staleness"] for e in pushes if e.get("num_samples", 1) > 0)
        result["staleness_histogram"] = dict(sorted(histogram.items()))
    return result


def table(results: list[dict]) -> str:
    """The Markdown table of ``results``, one row per configuration over its runs."""
    rows = [
        "| configuration | runs | accuracy mean | min | max | mean staleness | staleness histogram (all runs) |",
        "|---|---|---|---|---|---|---|",
    ]
    by_name: dict[str, list[dict]] = {}
    for r in results:
        by_name.setdefault(r["name"], []).append(r)
    for name, runs in by_name.items():
        good = [r for r in runs if r.get("final_accuracy") is not None]
        if not good:
            rows.append(f"| {name} | 0/{len(runs)} | failed | | | | |")
            continue
        accuracies = [100 * r["final_accuracy"] for r in good]
        histogram: Counter = Counter()
        for r in good:
            histogram.update({int(k): v for k, v in r["staleness_histogram"].items()})
        staleness = statistics.mean(r["mean_staleness"] for r in good)
        shown = ", ".join(f"{k}: {v}" for k, v in sorted(histogram.items()))
        rows.append(
            f"| {name} | {len(good)}/{len(runs)} | {statistics.mean(accuracies):.2f} | {min(accuracies):.2f} | "
            f"{max(accuracies):.2f} | {staleness:.2f} | {shown} |"
        )
    return "\n".join(rows)


def study_configs(
    named_flags: list[str], preset_dataset: str | None, extra: str = "", only: str | None = None
) -> list[tuple[str, str]]:
    """The configurations to run: each ``NAME=FLAGS`` text, then the preset's whose name starts with ``only``."""
    configs = [tuple(text.split("=", 1)) for text in named_flags]
    if preset_dataset:
        configs += [c for c in preset(preset_dataset, extra) if not only or c[0].startswith(only)]
    return configs


def run_study(
    configs: list[tuple[str, str]],
    out: Path,
    *,
    repeats: int,
    slow_factor: float,
    timeout_s: float,
    progress: TextIO | None = None,
) -> str:
    """Run every configuration ``repeats`` times under ``out``; returns the Markdown table of their runs.

    Every run's figures are appended to ``<out>/results.json`` as it finishes (earlier studies in the
    same folder stay, so a study can be extended), and a line of them is written to ``progress``.
    """
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    for repeat in range(repeats):
        for index, (name, flags) in enumerate(configs):
            run_dir = out / f"{index:02d}_{repeat}_{secrets.token_hex(3)}"
            result = run_one(name.strip(), flags, run_dir, slow_factor=slow_factor, timeout_s=timeout_s)
            results.append(result)
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1))
            if progress is not None:
                shown = {
                    k: result.get(k)
                    for k in ("name", "rc", "final_accuracy", "mean_staleness", "wall_s", "load_before")
                }
                print(json.dumps(shown), file=progress, flush=True)
    return table([r for r in results if r["name"] in {c[0].strip() for c in configs}])
