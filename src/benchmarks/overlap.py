"""The measuring stick of communication hidden behind compute: how much of its time a parameter-server worker and a DDP
rank spend waiting on the network, on the same tc-shaped links, with today's non-overlapped PS worker as the reference.

The set-up: three hosts, each a network namespace joined by a veth pair to one bridge
(:class:`~src.benchmarks.ps.netns.Hosts`): ``server``, ``worker_0`` and ``worker_1``. Each worker's link is shaped
by ``tc`` tbf to ``mbps`` both ways (on its own end: what it sends; on the bridge's end: what it receives). The
server's link is not shaped: the issue's server sits *in* the router, where the workers' links meet, so what limits
a worker's traffic is its own link and nothing else. A shaped server link would instead be one more bottleneck that
carries both workers' models (2 each way per step), which is a single-homed server behind a switch, not a router;
that case is the sharding bench's (``shards_netns`` in ``scripts/bench_ps.py``).

Two arms, the same model (``simple_cnn``), data (``mnist_5k``), batch per worker, epochs, seed and transport
settings, one after the other on the same hosts:

* ``ps``: ``run_parameter_server_training.py --role server`` in ``server``, ``--role worker --worker-id K`` in
  ``worker_K``, sync; each step a worker pushes one model's gradients up its link and receives one model's
  parameters down it.
* ``ddp``: ``run_ddp_training.py`` as rank K in ``worker_K`` (``RANK``, ``WORLD_SIZE=2``, ``MASTER_ADDR`` = rank 0's
  host, ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as the local launcher sets them on this machine, which gives each rank one
  intra-op thread; ``GLOO_SOCKET_IFNAME`` its host's link); the backend's built-in allreduce, which overlaps the
  backward pass. A 2-rank ring allreduce sends one model and receives one model per rank per step: the same bytes
  on each link as the PS (a rank's bytes cross its own link and then its peer's, both shaped to ``mbps``: in
  series, so still ``mbps``).

Every process is started as its host would start it, with ``$DTS_AUTH_TOKEN`` and ``OMP_NUM_THREADS=1`` (every
host shares this machine's cores); evaluation runs only at the end, outside the training clock.

The fields of each arm:

* ``samples_processed``, ``train_time_s``, ``samples_per_s``: from the run's ``summary.json``. The training clock
  is each architecture's own (PS: the server's, from the first work handed out to the last update applied; DDP:
  the slowest rank's training epochs).
* ``exposed_communication_s``: summed over the workers (ranks); ``exposed_per_worker_s`` each one's
  (:mod:`src.telemetry.exposed_comm`: PS, the whole push round trip; DDP, the wait at the end of backward).
* ``exposed_fraction``: ``exposed_communication_s / (workers x train_time_s)``: the share of the workers' (ranks')
  training time spent waiting on the network with nothing to compute, the same definition for both arms (and the
  report's ``exposed_share_of_train_time``).
* ``bytes_per_step_per_link``: ``up`` (what a worker or rank sends per step, one link's one direction) and
  ``down`` (what it receives), each the mean over the workers; ``accounting`` says how they were counted (PS:
  from the serialized messages, ``down`` over the steps' replies and the worker's first pull of the model; DDP's
  built-in allreduce: estimated as ``2(N-1)/N`` x the gradient bytes, whose traffic cannot be seen from Python).
* ``link_s_per_step``: the time those bytes take on a link at ``mbps``, as the protocol uses it: PS, up then down
  (the reply waits for the push); DDP, both at once (a ring step sends and receives together).
* ``compute_s_per_step`` (PS only): a worker's forward and backward per step (``gradient_time_s / steps``);
  ``communication_s_per_step`` (PS only): its measured push round trip per step.

And of the run: ``ps_over_ddp`` (samples/s), ``exposed_fraction`` of both side by side, ``communication_over_compute``
(PS: link time per step over compute per step; the issue asks for links "so that communication is about as long as
compute", about 1), and ``targets``: the three, each with the reference it is measured against (today's
worker: this run's PS arm, or ``reference``'s, an earlier run of this bench) and, where a reference from another run
is given, whether it is met.

Sizing (the defaults): simple_cnn is 1.69 MB of float32, and a worker's forward and backward at batch 256 on one
thread took 0.3 to 0.4 s on this 2-core machine when the first reference was measured (80 Mbit/s then:
``docs/overlap_reference.json``) and takes 0.12 to 0.13 s now. At 200 Mbit/s a PS step's model up and model down
take 0.135 s on the link, about as long as the compute, as the issue asks (``communication_over_compute`` reports
it for each run). Links carry jumbo frames (``--mtu``, :data:`DEFAULT_MTU`). 6 epochs of mnist_5k (4,000 samples:
8 steps of 2 x 256 an epoch) as in the issue; the three arms take about 2 minutes here.

With ``streaming`` (``--streaming``) the run has three arms: the PS without streaming first (``ps_unstreamed``,
today's worker: the targets' reference), then with it (``ps``), then DDP. With ``pipelined`` (``--pipelined-replies``)
as well, four: the streamed arm becomes ``ps_streamed`` and ``ps`` is the streamed PS whose server sends each slice
back as soon as it is stepped (:mod:`src.ps.state.slice_pipeline`).

With ``trace_dir`` (``--trace-dir``) every process of every arm writes its timeline, and the JSON's
``exposed_split_s_per_step`` splits each streamed PS arm's and DDP's exposed seconds per worker-step at the moment
every worker's gradients were ready (:mod:`src.telemetry.peer_wait`): ``waiting_for_peers_s`` before it (the
barrier or the collective waiting for the slowest worker), ``after_all_ready_s`` after it (what the communication
itself left exposed).

Needs root and iproute2 (``ip``, ``tc``); without them the JSON says why it did not run. Every namespace and link is
removed in a ``finally``, with any process left in them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from src.benchmarks.common import log
from src.benchmarks.ps.netns import Hosts, unavailable
from src.telemetry import peer_wait

ROOT = Path(__file__).resolve().parents[2]
PS_RUNNER = ROOT / "run_parameter_server_training.py"
DDP_RUNNER = ROOT / "run_ddp_training.py"
NUM_WORKERS = 2
WORKERS = [f"worker_{k}" for k in range(NUM_WORKERS)]
ROLES = ["server", *WORKERS]
PS_PORT = 50091
DDP_PORT = 29591
TEST_SAMPLES = 128
"""Test samples of the final evaluation (outside the training clock; kept short)."""
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
DEFAULT_MBPS = 200.0
DEFAULT_MTU = 9000
"""Jumbo frames, as datacenter links carry them. This machine's two cores also process every packet of every
link; at 1500 bytes that per-packet work, done while a streamed worker computes, slowed its forward and backward
by about 40% (a third of the 2-core machine), where jumbo frames cost it 6%: the bench would measure the
emulation's packets more than the overlap. Both arms and the reference run on the same links."""
DEFAULT_EPOCHS = 6
DEFAULT_BATCH_SIZE = 256
ISSUE = 34
EXPOSED_FALL = 0.5
"""Target: the PS worker's exposed fraction falls by at least this much from the reference."""
SPEED_UP = 1.3
"""Target: the PS's samples/s rises to at least this times the reference."""


def settings(
    mbps: float,
    epochs: int,
    batch_size: int,
    *,
    max_train_samples: int | None = None,
    transport: str = "grpc",
    seed: int = 0,
    mtu: int | None = DEFAULT_MTU,
) -> dict[str, Any]:
    """What both arms share, checked (a run of the bench and its reference compare only at equal settings).
    ``mtu``: every link's (``None``: the kernel's 1500; :data:`DEFAULT_MTU` is the bench's).

    Raises:
        ValueError: a rate, count, MTU or transport out of range.
    """
    if not mbps > 0:
        raise ValueError(f"mbps must be > 0, got {mbps}")
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch size must be >= 1, got {epochs} and {batch_size}")
    if max_train_samples is not None and max_train_samples < batch_size * NUM_WORKERS:
        raise ValueError(f"max_train_samples must be >= one step's samples ({batch_size * NUM_WORKERS})")
    if transport not in ("grpc", "tcp"):
        raise ValueError(f"transport must be grpc or tcp, got {transport!r}")
    if mtu is not None and not 576 <= mtu <= 65535:
        raise ValueError(f"mtu must be in [576, 65535], got {mtu}")
    return {
        "link_mbps": mbps,
        "epochs": epochs,
        "batch_size": batch_size,
        "workers": NUM_WORKERS,
        "max_train_samples": max_train_samples,
        "transport": transport,
        "seed": seed,
        "model": "simple_cnn",
        "dataset": "mnist_5k",
        **({"mtu": mtu} if mtu is not None else {}),
    }


def describe(run: dict[str, Any]) -> str:
    """The set-up in one sentence."""
    samples = "all" if run["max_train_samples"] is None else f"{run['max_train_samples']}"
    return (
        f"{run['model']} on {run['dataset']} ({samples} training samples), {run['epochs']} epoch(s), batch "
        f"{run['batch_size']} per worker, {run['workers']} workers, seed {run['seed']}; each worker in a network "
        f"namespace, its link shaped by tc tbf to {run['link_mbps']:g} Mbit/s both ways"
        f"{', MTU ' + str(run['mtu']) if run.get('mtu') else ''}; PS: sync over "
        f"{run['transport']}, the server in an unshaped namespace (the router); DDP: {run['workers']} ranks, gloo's "
        "built-in allreduce; OMP_NUM_THREADS=1 per process"
    )


# ----------------------------------------------------------------------------- the processes


def _shared_args(run: dict[str, Any]) -> list[str]:
    limit = [] if run["max_train_samples"] is None else ["--max-train-samples", str(run["max_train_samples"])]
    return [
        *("--dataset", run["dataset"], "--model", run["model"], "--num-epochs", str(run["epochs"])),
        *("--batch-size", str(run["batch_size"]), "--seed", str(run["seed"])),
        *("--max-test-samples", str(TEST_SAMPLES), *limit),
        *("--set", "training.eval_at_epoch_ends=false"),  # evaluated at the end only, outside the clock
    ]


def ps_commands(
    hosts: Hosts,
    run: dict[str, Any],
    port: int,
    *,
    streaming: bool = False,
    pipelined: bool = False,
    trace: bool = False,
) -> dict[str, tuple[Path, list[str], dict[str, str]]]:
    """Each host's (script, arguments, environment) of the PS arm (logs and checkpoints are added per host);
    ``streaming``: the workers communicate while they compute (``--streaming``); ``pipelined``: the server
    sends each slice back as soon as it is stepped (``--pipelined-replies``); ``trace``: every process writes its
    timeline (``--trace``)."""
    address = ["--server-address", f"{hosts.ips['server']}:{port}", "--transport", run["transport"]]
    server = [
        *("--role", "server", "--workers", str(NUM_WORKERS), "--aggregation-mode", "sync"),
        *address,
        *_shared_args(run),
        *("--checkpoint-interval", "100000"),
        *(["--streaming"] if streaming else []),
        *(["--pipelined-replies"] if pipelined else []),
        *(["--trace"] if trace else []),
    ]
    commands = {"server": (PS_RUNNER, server, {})}
    for k, role in enumerate(WORKERS):
        traced = ["--trace"] if trace else []
        commands[role] = (PS_RUNNER, ["--role", "worker", "--worker-id", str(k), *address, *traced], {})
    return commands


def ddp_commands(
    hosts: Hosts, run: dict[str, Any], port: int, *, trace: bool = False
) -> dict[str, tuple[Path, list[str], dict[str, str]]]:
    """Each host's (script, arguments, environment) of the DDP arm: rank K on ``worker_K`` (``trace``: each rank
    writes its timeline)."""
    args = [*("--world-size", str(NUM_WORKERS)), *_shared_args(run), *("--checkpoint-interval", "100000")]
    args += ["--trace"] if trace else []
    commands = {}
    for rank, role in enumerate(WORKERS):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(NUM_WORKERS),
            "MASTER_ADDR": hosts.ips[WORKERS[0]],
            "MASTER_PORT": str(port),
            # as the local launcher sets them for ranks that share one machine's cores: one intra-op thread each
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(NUM_WORKERS),
            "GLOO_SOCKET_IFNAME": link_device(hosts.namespaces[role]),
        }
        commands[role] = (DDP_RUNNER, args, env)
    return commands


def link_device(namespace: str) -> str:
    """The name of the one link (not ``lo``) in ``namespace``: the host's end of its veth pair."""
    listed = subprocess.run(
        ["ip", "-n", namespace, "-o", "link", "show"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in listed.splitlines() if line.strip()]
    links = [name for name in names if name != "lo"]
    if len(links) != 1:
        raise RuntimeError(f"namespace {namespace}: expected one link besides lo, found {links}")
    return links[0]


def run_processes(
    hosts: Hosts, commands: dict[str, tuple[Path, list[str], dict[str, str]]], folder: Path, timeout_s: float
) -> None:
    """Start every command in its host's namespace (its logs and checkpoints under ``folder/ROLE``, its output in
    ``folder/ROLE.out``) and wait for all of them to end, within ``timeout_s`` in all.

    Raises:
        RuntimeError: a process ended with a non-zero status or did not end in time (with every process's last
            output); every process still running is killed first.
    """
    token = os.urandom(16).hex()
    base = {key: value for key, value in os.environ.items() if key not in TORCHRUN_KEYS}
    base.update({"DTS_AUTH_TOKEN": token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    processes: dict[str, subprocess.Popen] = {}
    outputs = {}
    try:
        for role, (script, args, env) in commands.items():
            own = folder / role
            outputs[role] = open(folder / f"{role}.out", "w+")
            where = ["--log-dir", str(own / "logs"), "--checkpoint-dir", str(own / "ckpt")]
            processes[role] = subprocess.Popen(
                ["ip", "netns", "exec", hosts.namespaces[role], sys.executable, str(script), *args, *where],
                cwd=ROOT,
                env={**base, **env},
                stdout=outputs[role],
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        codes = {}
        for role, process in processes.items():
            try:
                codes[role] = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[role] = f"still running after {timeout_s:.0f} s: killed"
        if any(code != 0 for code in codes.values()):
            tails = {}
            for role, handle in outputs.items():
                handle.seek(0)
                tails[role] = handle.read()[-1500:]
            raise RuntimeError(f"a run failed (exit codes {codes}): {tails}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                process.wait()
        for handle in outputs.values():
            handle.close()


def exposed_split(trace_dir: Path, arm: str) -> dict[str, Any] | None:
    """An arm's exposed communication split at the moment every worker's gradients were ready
    (:func:`src.telemetry.peer_wait.split_exposed`), from the traces :func:`keep_traces` kept for it; ``None``
    without them."""
    traces = sorted(path for path in (Path(trace_dir) / arm).rglob("trace.json") if "server" not in path.parts)
    if len(traces) != NUM_WORKERS:
        return None
    ready, waits = [], []
    for path in traces:
        events = json.loads(path.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        spans: dict[str, list[tuple[float, float]]] = {}
        for event in events:
            if event.get("ph") == "X":
                spans.setdefault(event["name"], []).append((event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6))
        for intervals in spans.values():
            intervals.sort()
        if arm == "ddp":
            steps = peer_wait.ddp_steps(spans.get("exchange_wait", []))
        else:
            steps = peer_wait.ps_steps(
                spans.get("forward_backward", []), spans.get("reply_wait", []), spans.get("parameter_wait", [])
            )
        ready.append(steps[0])
        waits.append(steps[1])
    split = peer_wait.split_exposed(ready, waits)
    return {key: round(value, 5) if isinstance(value, float) else value for key, value in split.items()}


def keep_traces(folder: Path, trace_dir: Path | None, arm: str) -> None:
    """Copy every ``trace.json`` an arm's processes wrote under ``folder`` to ``trace_dir/arm`` (same paths)."""
    if trace_dir is None:
        return
    for trace in folder.rglob("trace.json"):
        target = Path(trace_dir) / arm / trace.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(trace, target)


# ----------------------------------------------------------------------------- the figures (pure)


def _per_step_link_seconds(nbytes: float, mbps: float) -> float:
    return nbytes * 8 / (mbps * 1e6)


def ps_arm(summary: dict[str, Any], mbps: float) -> dict[str, Any]:
    """The PS arm's figures from the server's ``summary.json`` (see the module docstring)."""
    workers = summary["workers"]
    count, seconds = len(workers), summary["train_time_s"]
    exposed = [w["exposed_communication_s"] for w in workers]
    up = sum(w["bytes_sent"] / w["steps"] for w in workers) / count
    # a worker receives the model once at its start (its first pull) and once in each push's reply
    down = sum(w["bytes_received"] / (w["steps"] + 1) for w in workers) / count
    return {
        "samples_processed": summary["samples_processed"],
        "train_time_s": round(seconds, 3),
        "samples_per_s": round(summary["samples_processed"] / seconds, 1),
        "steps_per_worker": [w["steps"] for w in workers],
        "exposed_communication_s": round(sum(exposed), 3),
        "exposed_per_worker_s": [round(e, 3) for e in exposed],
        "exposed_fraction": round(sum(exposed) / (count * seconds), 4),
        "bytes_per_step_per_link": {"up": round(up), "down": round(down), "accounting": "counted (serialized)"},
        "link_s_per_step": round(_per_step_link_seconds(up + down, mbps), 4),  # the reply waits for the push
        "compute_s_per_step": round(sum(w["gradient_time_s"] / w["steps"] for w in workers) / count, 4),
        "communication_s_per_step": round(sum(w["communication_time_s"] / w["steps"] for w in workers) / count, 4),
        "final_accuracy": summary.get("final_accuracy"),
    }


def ddp_arm(summary: dict[str, Any], ranks: list[dict[str, Any]], mbps: float) -> dict[str, Any]:
    """The DDP arm's figures from rank 0's ``summary.json`` and every rank's ``ddp_rank_<r>.json``."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    count, seconds = len(ranks), summary["train_time_s"]
    steps = summary["steps_this_run"]
    exposed = [r["exposed_communication_s"] for r in ranks]
    up = sum(r["bytes_sent"] for r in ranks) / (count * steps)
    down = sum(r["bytes_received"] for r in ranks) / (count * steps)
    return {
        "samples_processed": summary["samples_processed"],
        "train_time_s": round(seconds, 3),
        "samples_per_s": round(summary["samples_processed"] / seconds, 1),
        "steps_per_rank": steps,
        "exposed_communication_s": round(sum(exposed), 3),
        "exposed_per_worker_s": [round(e, 3) for e in exposed],
        "exposed_fraction": round(sum(exposed) / (count * seconds), 4),
        "bytes_per_step_per_link": {"up": round(up), "down": round(down), "accounting": summary["bytes_accounting"]},
        "link_s_per_step": round(_per_step_link_seconds(max(up, down), mbps), 4),  # a ring step sends and receives
        "final_accuracy": summary.get("final_accuracy"),
    }


def check_reference(reference: Any, run: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``reference`` is ``None`` or this bench's JSON measured with ``run``'s settings."""
    if reference is None:
        return
    if not isinstance(reference, dict) or not isinstance(reference.get("ps"), dict) or "settings" not in reference:
        raise ValueError("the reference is not a JSON of scripts/bench_overlap.py (no 'ps' or 'settings')")
    if reference["settings"] != run:
        raise ValueError(f"the reference was measured with other settings: {reference['settings']} vs {run}")


def targets(
    ps: dict[str, Any],
    ddp: dict[str, Any],
    reference: dict[str, Any] | None = None,
    unstreamed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The targets. ``reference``: an earlier run of this bench (its JSON) whose PS arm is today's worker;
    else ``unstreamed``: this run's PS arm without streaming (a streamed run's own reference); neither: this run's
    PS arm is the reference, so only the third target can be judged."""
    base = reference["ps"] if reference is not None else unstreamed if unstreamed is not None else ps
    fraction, speed = base["exposed_fraction"], base["samples_per_s"]
    judged = reference is not None or unstreamed is not None
    return {
        "issue": ISSUE,
        "reference": "the PS arm of the reference run"
        if reference is not None
        else "this run's PS arm without streaming (ps_unstreamed)"
        if unstreamed is not None
        else "this run's PS arm (today's worker: no overlap)",
        "exposed_fraction_falls": {
            "target": f"PS exposed fraction falls >= {EXPOSED_FALL:.0%} from {fraction:.3f}",
            "reference": fraction,
            "at_most": round(fraction * (1 - EXPOSED_FALL), 4),
            "measured": ps["exposed_fraction"],
            "met": ps["exposed_fraction"] <= fraction * (1 - EXPOSED_FALL) if judged else None,
        },
        "samples_per_s_rises": {
            "target": f"PS samples/s >= {SPEED_UP:g} x {speed:g}",
            "reference": speed,
            "at_least": round(speed * SPEED_UP, 1),
            "measured": ps["samples_per_s"],
            "met": ps["samples_per_s"] >= speed * SPEED_UP if judged else None,
        },
        "ps_exposed_at_most_ddps": {
            "target": "PS exposed fraction <= DDP's (same links, same model)",
            "ps": ps["exposed_fraction"],
            "ddp": ddp["exposed_fraction"],
            "met": ps["exposed_fraction"] <= ddp["exposed_fraction"],
        },
    }


def summarize(
    run: dict[str, Any],
    ps_summary: dict[str, Any],
    ddp_summary: dict[str, Any],
    ddp_ranks: list[dict[str, Any]],
    reference: dict[str, Any] | None = None,
    unstreamed_summary: dict[str, Any] | None = None,
    streamed_summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The bench's JSON from the arms' summaries (``run``: :func:`settings`; ``reference``: see :func:`targets`).
    ``unstreamed_summary``: ``ps_summary`` is a streamed run's, and this is the same run's PS arm without streaming
    (``ps_unstreamed``, the targets' reference unless ``reference`` is given). ``streamed_summary``: ``ps_summary``
    is a pipelined run's (``system.pipelined_replies``), and this is the same run's streamed arm without it
    (``ps_streamed``).

    Raises:
        ValueError: ``reference`` is not this bench's JSON, or was measured with other settings.
    """
    check_reference(reference, run)
    mbps = run["link_mbps"]
    ps, ddp = ps_arm(ps_summary, mbps), ddp_arm(ddp_summary, ddp_ranks, mbps)
    unstreamed = ps_arm(unstreamed_summary, mbps) if unstreamed_summary is not None else None
    result = {
        "setup": describe(run),
        "settings": run,
        "ps": {**ps, "streaming": unstreamed is not None},
        **({"ps_unstreamed": unstreamed} if unstreamed is not None else {}),
        "ddp": ddp,
        "ps_over_ddp": round(ps["samples_per_s"] / ddp["samples_per_s"], 3),
        "exposed_fraction": {"ps": ps["exposed_fraction"], "ddp": ddp["exposed_fraction"]},
        "communication_over_compute": round(ps["link_s_per_step"] / ps["compute_s_per_step"], 2),
        "targets": targets(ps, ddp, reference, unstreamed),
    }
    if unstreamed is not None:
        result["exposed_fraction"]["ps_unstreamed"] = unstreamed["exposed_fraction"]
        result["streamed_over_unstreamed"] = round(ps["samples_per_s"] / unstreamed["samples_per_s"], 3)
    if "pipelined_replies" in ps_summary:
        result["ps"]["pipelined_replies"] = ps_summary["pipelined_replies"]
    if streamed_summary is not None:
        streamed = ps_arm(streamed_summary, mbps)
        result["ps_streamed"] = {**streamed, "streaming": True}
        result["exposed_fraction"]["ps_streamed"] = streamed["exposed_fraction"]
        result["pipelined_over_streamed"] = round(ps["samples_per_s"] / streamed["samples_per_s"], 3)
    return result


# ----------------------------------------------------------------------------- the bench


def bench_overlap(
    mbps: float,
    epochs: int,
    batch_size: int,
    *,
    max_train_samples: int | None = None,
    transport: str = "grpc",
    seed: int = 0,
    reference: dict[str, Any] | None = None,
    timeout_s: float = 600.0,
    streaming: bool = False,
    pipelined: bool = False,
    trace_dir: Path | None = None,
    mtu: int | None = DEFAULT_MTU,
) -> dict[str, Any]:
    """Both arms on the same hosts (PS first, then DDP) and their figures; where namespaces cannot be made, why not.
    ``streaming``: the PS arm streams, and the same run first measures it without (``ps_unstreamed``).
    ``pipelined`` (with ``streaming``): the PS arm's server also sends each slice back as soon as it is
    stepped (``--pipelined-replies``), and the same run measures the streamed arm without it too (``ps_streamed``).
    ``trace_dir``: the PS runs are traced (``--trace``), and each arm's processes' ``trace.json`` files are kept under
    ``trace_dir/<arm>/<host>/`` (``scripts/plot_trace.py`` draws a folder of them as one timeline).

    Raises:
        ValueError: bad settings or reference (before anything starts).
        RuntimeError: an arm's process failed or did not end within ``timeout_s``.
    """
    run = settings(
        mbps, epochs, batch_size, max_train_samples=max_train_samples, transport=transport, seed=seed, mtu=mtu
    )
    check_reference(reference, run)
    if pipelined and not streaming:
        raise ValueError("pipelined replies need streaming (--streaming)")
    why = unavailable()
    if why is not None:
        log(f"overlap: skipped ({why})")
        return {"skipped": why, "setup": describe(run), "settings": run}
    with tempfile.TemporaryDirectory() as tmp, Hosts(ROLES, WORKERS, mbps, mtu=mtu) as hosts:
        ps_folder, ddp_folder = Path(tmp) / "ps", Path(tmp) / "ddp"
        ps_folder.mkdir()
        ddp_folder.mkdir()
        log(f"overlap: PS arm, sync, 2 workers at {mbps:g} Mbit/s")
        trace = trace_dir is not None
        run_processes(hosts, ps_commands(hosts, run, PS_PORT, trace=trace), ps_folder, timeout_s)
        keep_traces(ps_folder, trace_dir, "ps_unstreamed" if streaming else "ps")
        ps_summary = json.loads((ps_folder / "server" / "logs" / "summary.json").read_text())
        unstreamed_summary = streamed_summary = None
        if streaming:
            streamed_folder = Path(tmp) / "ps_streamed"
            streamed_folder.mkdir()
            log(f"overlap: PS arm streaming, sync, 2 workers at {mbps:g} Mbit/s")
            commands = ps_commands(hosts, run, PS_PORT + 1, streaming=True, trace=trace)
            run_processes(hosts, commands, streamed_folder, timeout_s)
            keep_traces(streamed_folder, trace_dir, "ps_streamed" if pipelined else "ps")
            unstreamed_summary = ps_summary
            ps_summary = json.loads((streamed_folder / "server" / "logs" / "summary.json").read_text())
        if pipelined:
            pipelined_folder = Path(tmp) / "ps_pipelined"
            pipelined_folder.mkdir()
            log(f"overlap: PS arm streaming with pipelined replies, sync, 2 workers at {mbps:g} Mbit/s")
            commands = ps_commands(hosts, run, PS_PORT + 2, streaming=True, pipelined=True, trace=trace)
            run_processes(hosts, commands, pipelined_folder, timeout_s)
            keep_traces(pipelined_folder, trace_dir, "ps")
            streamed_summary = ps_summary
            ps_summary = json.loads((pipelined_folder / "server" / "logs" / "summary.json").read_text())
        log(f"overlap: DDP arm, 2 ranks at {mbps:g} Mbit/s")
        run_processes(hosts, ddp_commands(hosts, run, DDP_PORT, trace=trace), ddp_folder, timeout_s)
        keep_traces(ddp_folder, trace_dir, "ddp")
        ddp_summary = json.loads((ddp_folder / WORKERS[0] / "logs" / "summary.json").read_text())
        ranks = [
            json.loads((ddp_folder / role / "logs" / f"ddp_rank_{k}.json").read_text())
            for k, role in enumerate(WORKERS)
        ]
    result = summarize(run, ps_summary, ddp_summary, ranks, reference, unstreamed_summary, streamed_summary)
    if trace_dir is not None:  # each arm's exposed time: waiting for the slowest worker, and after it
        arms = ["ps", "ddp", *(["ps_streamed"] if pipelined else [])]
        result["exposed_split_s_per_step"] = {arm: exposed_split(trace_dir, arm) for arm in arms}
    log(
        f"overlap: PS {result['ps']['samples_per_s']} samples/s, exposed {result['ps']['exposed_fraction']}; "
        f"DDP {result['ddp']['samples_per_s']} samples/s, exposed {result['ddp']['exposed_fraction']}; "
        f"PS/DDP {result['ps_over_ddp']}"
    )
    return result
