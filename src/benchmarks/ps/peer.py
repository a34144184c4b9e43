"""Our sync PS against the one a PyTorch user would write in an afternoon: training samples/s, like for like.

Per model, in turns (the order flips every repeat), each arm trains the same job: a 2-worker sync run on
mnist_5k, the same batches in the same order, evaluated only at its end. The arms are our PS over gRPC and over
TCP, each unstreamed and streamed, TCP streamed with pipelined replies, TCP with the model on 2 server shards (the
peer's one server against our two, the same bytes per worker), every one started as the local launcher
starts it (:func:`src.launch.ps.run_local`), and the peer (:mod:`src.benchmarks.ps.rpc_peer`:
torch.distributed.rpc in the tutorial's design, TensorPipe on TCP). Every arm computes the same updates, so each
one's final loss and accuracy must equal the peer's to the last digit: ``same_updates`` says whether they did.
``ratio_to_peer`` = the arm's median samples/s / the peer's.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

from src.benchmarks.common import log

ARMS: dict[str, dict[str, Any]] = {
    "ours_grpc": {"system.transport": "grpc"},
    "ours_grpc_streamed": {"system.transport": "grpc", "system.streaming": True},
    "ours_tcp": {"system.transport": "tcp"},
    "ours_tcp_streamed": {"system.transport": "tcp", "system.streaming": True},
    "ours_tcp_streamed_pipelined": {
        "system.transport": "tcp",
        "system.streaming": True,
        "system.pipelined_replies": True,
    },
    "ours_tcp_2_shards": {"system.transport": "tcp", "system.num_servers": 2},
    "torch_rpc_peer": {},
}
"""Each arm's settings on top of the common job; the last is the reference."""

PEER = "torch_rpc_peer"
TARGETS = {"simple_cnn": {"ours_tcp": 1.3, "ours_grpc": 1.2}, "wide_mlp": {"ours_tcp": 1.2, "ours_grpc": 1.0}}
"""Issue 55's targets: an arm's samples/s over the peer's, per model."""


def training_job(model: str, num_epochs: int, batch_size: int) -> dict[str, Any]:
    """The config overrides of the job every arm trains: 2 workers, sync, mnist_5k, evaluated only at its end."""
    return {
        "training.dataset": "mnist_5k",
        "training.model_architecture": model,
        "training.num_epochs": num_epochs,
        "training.batch_size": batch_size,
        "training.momentum": 0.9,
        "training.checkpoint_interval": 10**6,
        "training.eval_at_epoch_ends": False,
        "system.num_workers": 2,
        "system.aggregation_mode": "sync",
    }


def _run(arm: str, job: dict[str, Any], folder: str) -> dict[str, Any]:
    from src.benchmarks.ps.rpc_peer import run_rpc_peer
    from src.config import load_config
    from src.launch.ps import run_local

    if arm == PEER:
        return run_rpc_peer(job)
    overrides = {**job, **ARMS[arm], "system.log_dir": f"{folder}/logs", "system.checkpoint_dir": f"{folder}/ckpt"}
    return run_local(load_config(overrides=overrides))


def bench_model(model: str, num_epochs: int, batch_size: int, repeats: int, arms: list[str]) -> dict[str, Any]:
    """Every arm of ``arms`` (the peer included) ``repeats`` times in turns on ``model``: medians and ratios."""
    from src.common.supervisor import stdout_to_stderr

    job = training_job(model, num_epochs, batch_size)
    measured: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():
        for repeat in range(repeats):
            for arm in arms if repeat % 2 == 0 else arms[::-1]:
                summary = _run(arm, job, f"{tmp}/{arm}_{repeat}")
                measured[arm].append(summary)
                log(f"{model} {arm} (run {repeat + 1}): {summary['throughput_samples_per_s']:.1f} samples/s")
    peer = measured[PEER]
    peer_rate = statistics.median(s["throughput_samples_per_s"] for s in peer)
    rows: dict[str, Any] = {}
    for arm, summaries in measured.items():
        rates = [s["throughput_samples_per_s"] for s in summaries]
        rate = statistics.median(rates)
        outcome = {(s["final_loss"], s["final_accuracy"]) for s in summaries}
        rows[arm] = {
            "samples_per_s": round(rate, 1),
            "runs": [round(r, 1) for r in rates],
            "ratio_to_peer": round(rate / peer_rate, 3),
            "final_loss": summaries[0]["final_loss"],
            "final_accuracy": summaries[0]["final_accuracy"],
            "same_updates": outcome == {(peer[0]["final_loss"], peer[0]["final_accuracy"])},
        }
        if arm in TARGETS.get(model, {}):
            rows[arm]["target_ratio_to_peer"] = TARGETS[model][arm]
    return {
        "model": model,
        "epochs": num_epochs,
        "batch_size_per_worker": batch_size,
        "samples": peer[0]["samples_processed"],
        "arms": rows,
    }


PROFILED_SPANS = {
    "worker": ("step", "forward_backward", "compress", "send", "await_reply", "receive", "settle"),
    "server": ("receive", "serve_push", "barrier_wait", "average", "optimizer_step", "send"),
}
"""The spans of our TCP run a step's profile gives, per process (the worker's and the server's TCP transport and
core name them: :mod:`src.telemetry.tracing`)."""


_CALL_SPANS = ("send", "await_reply", "receive")
"""A worker's spans of any call (pulls and heartbeats too): the profile keeps those of its pushes."""


def _step_spans(events: list[dict[str, Any]], role: str) -> list[dict[str, Any]]:
    """The complete spans of a trace, a worker's calls only where they are within one of its pushes."""
    spans = [e for e in events if e.get("ph") == "X"]
    if role != "worker":
        return spans
    pushes = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in spans if e["name"] == "push"]

    def in_push(event: dict[str, Any]) -> bool:
        return any(t == event["tid"] and a <= event["ts"] <= b for t, a, b in pushes)

    return [e for e in spans if e["name"] not in _CALL_SPANS or in_push(e)]


def profile_step(model: str, num_epochs: int, batch_size: int) -> dict[str, Any]:
    """Where a step's milliseconds go, ours (TCP, unstreamed, traced) beside the peer's: the median of each span
    (ours: over both workers' steps and their pushes' calls, or the server's calls) or phase (the peer's), one run
    of each."""
    from src.benchmarks.ps.rpc_peer import run_rpc_peer
    from src.common.supervisor import stdout_to_stderr
    from src.config import load_config
    from src.launch.ps import run_local
    from src.telemetry.tracing import read_trace

    job = training_job(model, num_epochs, batch_size)
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():
        overrides = {**job, **ARMS["ours_tcp"], "system.trace": True, "system.log_dir": f"{tmp}/logs"}
        ours = run_local(load_config(overrides={**overrides, "system.checkpoint_dir": f"{tmp}/ckpt"}))
        spans: dict[str, dict[str, list[float]]] = {
            role: {name: [] for name in names} for role, names in PROFILED_SPANS.items()
        }
        for trace in sorted(os.listdir(f"{tmp}/logs")):
            role = "server" if trace == "server" else "worker" if trace.startswith("worker_") else None
            if role is None or not os.path.exists(f"{tmp}/logs/{trace}/trace.json"):
                continue
            for event in _step_spans(read_trace(f"{tmp}/logs/{trace}/trace.json"), role):
                if event["name"] in spans[role]:
                    spans[role][event["name"]].append(event["dur"] / 1000)
        peer = run_rpc_peer(job)
    return {
        "model": model,
        "ours_tcp": {
            "samples_per_s": round(ours["throughput_samples_per_s"], 1),
            **{
                role: {n: round(statistics.median(v), 2) for n, v in named.items() if v}
                for role, named in spans.items()
            },
        },
        "torch_rpc_peer": {"samples_per_s": round(peer["throughput_samples_per_s"], 1), **peer["phases_ms"]},
    }


def bench_against_rpc_peer(
    models: list[str], epochs: dict[str, int], batch_size: int, repeats: int, arms: list[str] | None = None
) -> dict[str, Any]:
    """:func:`bench_model` per model, with the machine's load around them."""
    arms = list(arms or ARMS)
    if PEER not in arms:
        arms.append(PEER)
    result: dict[str, Any] = {"machine": f"{os.cpu_count()} CPUs", "load_average_before": os.getloadavg()[0]}
    result["models"] = [bench_model(m, epochs[m], batch_size, repeats, arms) for m in models]
    result["load_average_after"] = os.getloadavg()[0]
    result["setup"] = (
        f"2 workers (trainers), sync, mnist_5k, batch {batch_size} per worker, momentum 0.9, CPU, one compute "
        "thread per process, loopback; evaluated only at the run's end; median of "
        f"{repeats} runs in turns; the peer: torch.distributed.rpc, TensorPipe on TCP (uv transport, basic channel)"
    )
    return result
