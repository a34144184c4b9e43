"""Run parameter-server configurations several times and tabulate final accuracy and staleness.

Each run is a real ``run_parameter_server_training.py`` job (server and worker processes, gRPC)
writing under ``--out`` (never the repository); the table is built from each run's summary JSON and
the server's ``events.jsonl`` (staleness histogram of the pushes). Async runs are timing-dependent,
so every configuration runs ``--repeats`` times and the table gives mean, min and max.

A configuration is a name and the runner's flags. ``--slow-worker F`` runs the server and workers
as separate roles (the same runner, ``--role server`` / ``--role worker``) so that worker 0 can be
slowed for real: it is stopped (SIGSTOP) and continued (SIGCONT) in a duty cycle that leaves it a
fraction 1/F of the time (F=3: stopped 2/3 of every 60 ms).

    python scripts/async_study.py --out /tmp/study --repeats 3 \\
        --config "sync2=--workers 2 --aggregation-mode sync" \\
        --config "async2=--workers 2 --aggregation-mode async"
    python scripts/async_study.py --out /tmp/study --preset mnist_5k --repeats 3 > table.md

Prints a Markdown table; ``<out>/results.json`` keeps every run's figures.
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parent.parent
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for every run's logs and checkpoints (not the repo)")
    parser.add_argument(
        "--config", action="append", default=[], metavar="NAME=FLAGS", help="a configuration, repeatable"
    )
    parser.add_argument(
        "--preset", help="the spec's commands on this dataset (mnist_5k, mnist), sync and async, N=2 and 4"
    )
    parser.add_argument("--extra", default="", help="flags added to every preset configuration")
    parser.add_argument("--only", help="run only preset configurations whose name starts with this (sync, async)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slow-worker", type=float, default=1.0, metavar="F", help="slow worker 0 F times (F > 1)")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    args = parser.parse_args()
    configs = [tuple(text.split("=", 1)) for text in args.config]
    if args.preset:
        configs += [c for c in preset(args.preset, args.extra) if not args.only or c[0].startswith(args.only)]
    if not configs:
        parser.error("give --config NAME=FLAGS or --preset DATASET")
    out = Path(args.out)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else []
    for repeat in range(args.repeats):
        for index, (name, flags) in enumerate(configs):
            run_dir = out / f"{index:02d}_{repeat}_{secrets.token_hex(3)}"
            result = run_one(name.strip(), flags, run_dir, slow_factor=args.slow_worker, timeout_s=args.timeout_s)
            results.append(result)
            results_path.parent.mkdir(parents=True, exist_ok=True)
            results_path.write_text(json.dumps(results, indent=1))
            print(
                json.dumps(
                    {
                        k: result.get(k)
                        for k in ("name", "rc", "final_accuracy", "mean_staleness", "wall_s", "load_before")
                    }
                ),
                file=sys.stderr,
                flush=True,
            )
    print(table([r for r in results if r["name"] in {c[0].strip() for c in configs}]))


if __name__ == "__main__":
    main()
