"""Virtual time against a real streamed run (issue 34 item 4): the same sync experiment run for real across network
namespaces, each worker's link shaped by ``tc`` to 80 Mbit/s, unstreamed, streamed and streamed with pipelined replies,
and in virtual time with the cost model calibrated here and the links at the tc rate.

The real runs are ``scripts/bench_overlap.py``'s PS arms (:mod:`src.benchmarks.overlap`): the server in an unshaped
namespace (the router), each worker in its own, its link limited both ways by a ``tbf`` qdisc on its two ends, every
process with one intra-op thread, over TCP. The virtual runs are the configs the real servers ran (from their final
checkpoints) with ``uplink_mbps`` = ``downlink_mbps`` = the tc rate, the server's times measured here
(:func:`src.virtual.calibration.calibrate`), and each worker's ``compute_s`` the seconds its real counterpart's
forward and backward took per step in that run (its ``gradient_time_s`` over its steps; the streamed worker's
excludes its forward's waits). What is compared is then the overlap itself, not the compute's calibration: on this
2-core machine a streamed worker computes ~20% slower than an unstreamed one while its parts and the reply cross the
links (the bench's own figures, ``docs/overlap_streamed_tcp.json``: 0.125 s against 0.151 s a step), contention for
the cores that virtual time does not model.

Compared, per arm: samples/s and each worker's exposed communication (``communication_time_s``: the push round trip
unstreamed; from the end of backward to the reply's head plus the next forward's waits streamed), virtual / real;
held within 15% for the streamed arm, the pipelined arm's step within 15% and its exposed seconds within 25% or 30 ms
a step (:data:`PIPELINED_EXPOSED_BOUND`), and the same versions and accuracy for all.

``python -m pytest -q -s -n 0 tests/test_virtual_streaming_fidelity.py`` prints the record
(``docs/virtual_time.md``, "Streaming"; ``docs/virtual_pipelined_fidelity.json``).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from src.benchmarks import overlap
from src.benchmarks.ps import netns
from src.common.checkpoint import load_checkpoint
from src.config import validate_config
from src.metrics import read_events
from src.studies.fidelity import with_clock
from src.telemetry.tracing import read_trace
from src.virtual.calibration import calibrate
from src.virtual.run import run_virtual

pytestmark = pytest.mark.timeout(600)

MBPS = 80.0
EPOCHS, BATCH_SIZE, SAMPLES = 4, 256, 2048
"""16 sync steps of 2 x 256 per arm (simple_cnn, 1.69 MB each way per step and worker: 0.17 s on an 80 Mbit/s link
against 0.13-0.3 s of compute at batch 256 on one thread): 6-10 s of training per arm for real. The real run's first
step is slower (the first forward and backward, the connections), which the model charges as any other: over 8 steps
that put the virtual run 15-20% ahead in samples/s where the steps after it agreed within 5%."""
BOUND = 0.15
PIPELINED_EXPOSED_BOUND = 0.25
PIPELINED_EXPOSED_UNMODELLED_S = 0.03
"""The pipelined arm's exposed seconds: virtual time leans low there, by what it does not model of a pipelined step:
the server's slice steps (20 a round, 0.36 ms each: 7 ms), TCP's ~3% below the line rate on the uplink the step is
bound by (about 5 ms), and three processes' scheduling on two cores. Against 0.12-0.14 s exposed a step (the AVX-512
machine: 0.83-0.96 of the real seconds in five runs) that is within :data:`PIPELINED_EXPOSED_BOUND`; on a faster AVX2
machine (2 cores, AMD EPYC) the real step exposes only 0.04-0.085 s, and the same milliseconds are 0.60-0.97 of it (ten
runs, before and after the worker's step machine alike), 8-22 ms a step. So the virtual seconds must be within
:data:`PIPELINED_EXPOSED_BOUND` of the real ones, or within :data:`PIPELINED_EXPOSED_UNMODELLED_S` of them. Its step
is held to :data:`BOUND` as the others'."""
ARMS = ("unstreamed", "streamed", "pipelined")
"""Today's worker, the streamed one (``--streaming``), and streamed with pipelined replies (``--pipelined-replies``:
the server's provisional slices, :mod:`src.virtual.sink` in virtual time)."""


def step_s(events: Path) -> float:
    """The median seconds between the server's consecutive updates (in its ``events``): a sync step once the run is
    going."""
    times = [e["time"] for e in read_events(events, "update")]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


EXPOSED_SPANS = {
    "unstreamed": ("push", {"push"}),
    "streamed": ("reply_wait", {"reply_wait", "parameter_wait"}),
    "pipelined": ("reply_wait", {"reply_wait", "parameter_wait"}),
}
"""Per arm, the worker spans that are its exposed communication (the first one's name: one per step): unstreamed, the
push blocked on its reply; streamed, the wait for the reply's head and the forward's waits for parameters (its
``push`` spans are the push thread's, hidden or not)."""


def steady_exposed_s(logs: Path, arm: str) -> float:
    """Each worker's exposed seconds per step after its first (from the traces of the workers under ``logs``: the
    first step's wait holds the other worker's warm-up at the barrier), averaged over the workers."""
    per_step, names = EXPOSED_SPANS[arm][0], EXPOSED_SPANS[arm][1]
    figures = []
    for trace in sorted(logs.glob("worker_*/**/trace.json")):
        spans = sorted((e["ts"], e["dur"], e["name"]) for e in read_trace(trace) if e.get("name") in names)
        steps = [span for span in spans if span[2] == per_step]
        figures.append((sum(d for _, d, _ in spans) - steps[0][1]) / (len(steps) - 1) / 1e6)
    assert len(figures) == 2, f"worker traces under {logs}: {figures}"
    return statistics.mean(figures)


def steady_compute_s(logs: Path) -> dict[int, float]:
    """Each worker's median seconds of forward and backward per step after its first (from its trace under ``logs``:
    its ``forward_backward`` spans less the forward's waits for parameters inside them): what its steps computed once
    the run was going, on this machine as loaded then."""
    medians = {}
    for trace in sorted(logs.glob("worker_*/**/trace.json")):
        worker = int(trace.relative_to(logs).parts[0].split("_")[1])
        events = read_trace(trace)
        waits = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "parameter_wait"]
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "forward_backward")
        seconds = [
            (end - start - sum(b - a for a, b in waits if start <= a and b <= end)) / 1e6 for start, end in steps
        ]
        medians[worker] = statistics.median(seconds[1:])
    return medians


def figures(summary: dict, events: Path) -> dict:
    workers = summary["workers"]
    steps = sum(w["steps"] for w in workers)
    return {
        "step_s": round(step_s(events), 4),
        "samples_per_s": round(summary["samples_processed"] / summary["train_time_s"], 1),
        "train_time_s": round(summary["train_time_s"], 3),
        "exposed_s_per_step": round(sum(w["communication_time_s"] for w in workers) / steps, 4),
        "compute_s_per_step": round(sum(w["gradient_time_s"] for w in workers) / steps, 4),  # the first step's too
        "versions": summary["versions"],
        "final_accuracy": summary["final_accuracy"],
    }


def real_arm(hosts, run: dict, folder: Path, port: int, *, streaming: bool, pipelined: bool) -> tuple[dict, dict]:
    """One real PS arm; its summary and the config its server ran."""
    folder.mkdir()
    commands = overlap.ps_commands(hosts, run, port, streaming=streaming, pipelined=pipelined, trace=True)
    overlap.run_processes(hosts, commands, folder, 300.0)
    summary = json.loads((folder / "server" / "logs" / "summary.json").read_text())
    return summary, load_checkpoint(summary["checkpoint_path"])["config"]


@pytest.mark.slow
@pytest.mark.alone  # namespaces, and real runs' seconds
def test_virtual_time_matches_a_real_streamed_run_behind_tc_shaped_worker_links(tmp_path):
    why = netns.unavailable()
    if why is not None:
        pytest.skip(why)  # CI runs as root with iproute2
    run = overlap.settings(MBPS, EPOCHS, BATCH_SIZE, max_train_samples=SAMPLES, transport="tcp")
    real = {}
    with netns.Hosts(overlap.ROLES, overlap.WORKERS, MBPS, mtu=run.get("mtu")) as hosts:
        for k, arm in enumerate(ARMS):
            streaming, pipelined = arm != "unstreamed", arm == "pipelined"
            port = overlap.PS_PORT + k
            real[arm] = real_arm(hosts, run, tmp_path / f"real_{arm}", port, streaming=streaming, pipelined=pipelined)
    configs = {arm: validate_config(config) for arm, (_, config) in real.items()}
    assert configs["streamed"].system.streaming and not configs["unstreamed"].system.streaming
    assert configs["pipelined"].system.pipelined_replies and not configs["streamed"].system.pipelined_replies
    calibration = calibrate(configs["unstreamed"], concurrent=2, steps=10)
    links = {"uplink_mbps": MBPS, "downlink_mbps": MBPS}
    record = {
        "setup": overlap.describe(run) + "; virtual: the links at the tc rate, calibrated here (2 processes)",
        "calibration": calibration["emulation"],
    }
    for arm, config in configs.items():
        summary = real[arm][0]
        measured = {k: {"compute_s": s} for k, s in steady_compute_s(tmp_path / f"real_{arm}").items()}
        virtual = run_virtual(
            with_clock(
                config, "virtual", {**calibration["emulation"], **links, "workers": measured}, tmp_path / f"v_{arm}"
            ),
            tensorboard=False,
        )
        ours = figures(virtual, tmp_path / f"v_{arm}" / "logs" / "server" / "events.jsonl")
        theirs = figures(summary, tmp_path / f"real_{arm}" / "server" / "logs" / "server" / "events.jsonl")
        record[arm] = {
            "real": theirs,
            "virtual": ours,
            "samples_per_s_ratio": round(ours["samples_per_s"] / theirs["samples_per_s"], 3),
            "exposed_ratio": round(ours["exposed_s_per_step"] / theirs["exposed_s_per_step"], 3),
            "step_ratio": round(ours["step_s"] / theirs["step_s"], 3),
        }
        steady = {
            "real": round(steady_exposed_s(tmp_path / f"real_{arm}", arm), 4),
            "virtual": round(steady_exposed_s(tmp_path / f"v_{arm}" / "logs", arm), 4),
        }
        record[arm] |= {
            "steady_exposed_s_per_step": steady,
            "steady_exposed_ratio": round(steady["virtual"] / steady["real"], 3),
        }
    for arm in ("streamed", "pipelined"):  # what streaming (and pipelining) hid, per step once the run is going
        record[f"steady_exposed_fall_{arm}"] = {
            side: round(
                1
                - record[arm]["steady_exposed_s_per_step"][side]
                / record["unstreamed"]["steady_exposed_s_per_step"][side],
                3,
            )
            for side in ("real", "virtual")
        }
    print(json.dumps(record, indent=1))

    assert record["streamed"]["steady_exposed_ratio"] == pytest.approx(1.0, abs=BOUND), record
    pipelined = record["pipelined"]["steady_exposed_s_per_step"]
    assert (
        record["pipelined"]["steady_exposed_ratio"] == pytest.approx(1.0, abs=PIPELINED_EXPOSED_BOUND)
        or abs(pipelined["virtual"] - pipelined["real"]) <= PIPELINED_EXPOSED_UNMODELLED_S
    ), record
    for arm in ("streamed", "pipelined"):
        assert record[arm]["step_ratio"] == pytest.approx(1.0, abs=BOUND), record
    for arm in ARMS:
        assert record[arm]["real"]["versions"] == record[arm]["virtual"]["versions"] == EPOCHS * SAMPLES // 512
        assert abs(record[arm]["real"]["final_accuracy"] - record[arm]["virtual"]["final_accuracy"]) <= 0.01, record
