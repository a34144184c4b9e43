"""Timelines of the distributed runs (spans) and exposed communication, on real processes.

Claims: a 2-worker parameter-server run and a 2-rank DDP run with ``--trace`` write valid
trace-event JSON whose spans nest, with one span of each per-step kind per step of the summary, on
one clock across processes (a worker's push span holds the server's decode and apply of that very
push; the two ranks' exchanges of one bucket overlap in time); a virtual-time run writes the same
per-step spans on its virtual clock. Exposed communication: a PS worker's is its time blocked on
the reply, within 15% of an emulated 25 Mbit/s uplink's wait; a DDP backward pass's wait for a
slow exchange is measured as that wait; under a ``tc``-shaped link it grows as the link narrows;
the report shows it for every architecture.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from src.metrics import read_events
from src.reports.report import Run, build_report, report_blocks, to_markdown
from src.telemetry import tracing
from src.telemetry.exposed_comm import BackwardWait
from tests.netns_fixtures import remove_namespace, shape_egress
from tests.ps_fixtures import ROOT, ps_config
from tests.python_command import run_command
from tests.test_report import SUMMARY
from tests.test_tracing import assert_spans_nest, complete_events

pytestmark = [pytest.mark.alone, pytest.mark.timeout(300)]

UPLINK_MBPS = 25.0
DDP_RUNNER = str(ROOT / "run_ddp_training.py")
DDP_ARGS = (
    "--world-size 2 --dataset synthetic --num-samples 256 --batch-size 32 "
    "--num-epochs 1 --allreduce ring --eval-interval 2 --max-restarts 0"
).split()


def _closed_trace(path: Path) -> list[dict]:
    """The events of a trace a process closed cleanly: plain JSON, every event a dict."""
    events = json.loads(path.read_text())
    assert isinstance(events, list) and all(isinstance(e, dict) and "ph" in e for e in events), path
    assert_spans_nest(events)
    return events


def _counts(events: list[dict]) -> Counter:
    return Counter(e["name"] for e in complete_events(events))


def _inside(inner: dict, outer: dict, slack_us: float = 0.01) -> bool:
    return outer["ts"] - slack_us <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack_us


def _push_waits_s(logs: Path, worker: int) -> float:
    """Seconds worker ``worker``'s pushes waited on its emulated uplink: their exact bytes over the bandwidth."""
    return sum(
        8 * p["push_bytes"] / (UPLINK_MBPS * 1e6)
        for p in read_events(logs / f"worker_{worker}" / "events.jsonl", "push")
    )


# ----------------------------------------------------------------------------- parameter server


@pytest.fixture(scope="module")
def ps_run(tmp_path_factory):
    """2 async workers, an mlp (0.94 MB pushes), a 25 Mbit/s emulated uplink, --trace; (log folder, summary)."""
    from src.launch.ps import run_local

    tmp = tmp_path_factory.mktemp("ps_trace")
    config = ps_config(
        tmp,
        system__num_workers=2,
        system__trace=True,
        training__model_architecture="mlp",
        training__max_train_samples=128,
        training__eval_interval=4,
        training__checkpoint_interval=4,
        emulation__uplink_mbps=UPLINK_MBPS,
    )
    return tmp / "run" / "logs", run_local(config)


@pytest.mark.slow
def test_a_traced_ps_run_has_every_step_in_its_spans_on_one_clock(ps_run):
    logs, summary = ps_run
    server = _closed_trace(logs / "server" / tracing.TRACE_FILE)
    pushes = summary["pushes_applied"] + summary["pushes_rejected"]
    assert pushes == sum(w["steps"] for w in summary["workers"]) == 8
    counts = _counts(server)
    assert counts["serve_push"] == counts["decode"] == counts["apply"] == pushes
    assert counts["serve_pull"] == 2 and counts["reply"] == pushes + 2 and counts["barrier_wait"] == pushes + 2
    assert counts["evaluate"] == len(
        list(read_events(logs / "server" / "events.jsonl", "eval"))
    )  # versions 4, 8, final
    assert counts["checkpoint"] == len(list(read_events(logs / "server" / "events.jsonl", "checkpoint"))) + 1  # + final
    server_spans = complete_events(server)
    for span in (s for s in server_spans if s["name"] in ("decode", "apply", "reply")):  # inside its RPC's span
        assert any(_inside(span, rpc) for rpc in server_spans if rpc["name"] in ("serve_push", "serve_pull")), span

    traces = [server]
    for worker in summary["workers"]:
        k = worker["worker_id"]
        events = _closed_trace(logs / f"worker_{k}" / tracing.TRACE_FILE)
        traces.append(events)
        counts = _counts(events)
        assert (
            counts["step"] == counts["forward_backward"] == counts["compress"] == counts["push"] == worker["steps"]
        ), counts
        spans = complete_events(events)
        steps = [s for s in spans if s["name"] == "step"]
        assert [s["args"]["step"] for s in steps] == list(range(1, worker["steps"] + 1))
        for name in ("forward_backward", "compress", "push"):  # each inside its step
            assert all(any(_inside(s, step) for step in steps) for s in spans if s["name"] == name), name
        # One clock: the server decoded and applied each push while the worker's push span was open.
        for push in (s for s in spans if s["name"] == "push"):
            handled = [
                s
                for s in server_spans
                if s["name"] in ("decode", "apply")
                and s["args"] == {"worker": k, "request_id": push["args"]["request_id"]}
            ]
            assert len(handled) == 2 and all(_inside(s, push) for s in handled), (push, handled)
    merged = tracing.describe_trace(tracing.merge_traces(traces))
    assert sorted(p["name"] for p in merged["processes"]) == ["parameter server", "worker 0", "worker 1"]
    assert len({p["pid"] for p in merged["processes"]}) == 3


@pytest.mark.slow
def test_ps_exposed_communication_is_the_workers_time_blocked_on_the_reply(ps_run, tmp_path):
    """One worker: nothing but its own push is in the round trip, so it is the uplink's wait and a little more."""
    from src.launch.ps import run_local

    config = ps_config(
        tmp_path, training__model_architecture="mlp", training__max_train_samples=96, emulation__uplink_mbps=UPLINK_MBPS
    )
    summary = run_local(config)
    (worker,) = summary["workers"]
    assert worker["steps"] == 6
    waited = _push_waits_s(tmp_path / "run" / "logs", 0)  # ~0.3 s a push
    assert waited <= worker["exposed_communication_s"] <= 1.15 * waited, (worker["exposed_communication_s"], waited)
    assert worker["exposed_communication_s"] == worker["communication_time_s"] == summary["exposed_communication_s"]
    # Two workers: each one's waits are a floor of its exposed time (the rest: the server, the other
    # worker's last step).
    logs, two = ps_run
    for worker in two["workers"]:
        assert worker["exposed_communication_s"] >= _push_waits_s(logs, worker["worker_id"])
    assert two["exposed_communication_s"] == pytest.approx(sum(w["exposed_communication_s"] for w in two["workers"]))


@pytest.mark.slow
def test_a_virtual_run_writes_the_same_step_spans_on_its_virtual_clock(tmp_path):
    from src.virtual.run import run_virtual
    from tests.test_virtual_time import virtual_config

    config = virtual_config(
        tmp_path,
        "virtual",
        system__num_workers=2,
        system__aggregation_mode="sync",
        training__max_train_samples=128,
        system__trace=True,
    )
    summary = run_virtual(config, tensorboard=False)
    logs = tmp_path / "virtual" / "logs"
    server = _closed_trace(logs / "server" / tracing.TRACE_FILE)
    assert _counts(server)["apply"] == summary["pushes_applied"] == 8
    for worker in summary["workers"]:
        events = _closed_trace(logs / f"worker_{worker['worker_id']}" / tracing.TRACE_FILE)
        counts = _counts(events)
        assert (
            counts["step"] == counts["forward_backward"] == counts["compress"] == counts["push"] == worker["steps"] == 4
        )
        spans = complete_events(events)
        # the cost model's seconds, in virtual microseconds from 0
        assert all(s["dur"] == pytest.approx(0.02e6) for s in spans if s["name"] == "forward_backward")
        assert sum(s["dur"] for s in spans if s["name"] == "push") / 1e6 == pytest.approx(
            worker["exposed_communication_s"]
        )
        assert max(s["ts"] + s["dur"] for s in spans) / 1e6 <= summary["total_time_s"] + 1e-9


def test_a_restarted_process_keeps_its_predecessors_trace(tmp_path):
    path = tmp_path / "worker_0" / tracing.TRACE_FILE
    for restart in (False, True, True):
        with tracing.trace_to(path, "worker 0", restart=restart):
            with tracing.span("step"):
                pass
    found = tracing.find_traces(tmp_path)
    assert [p.name for p in found] == ["trace.1.json", "trace.2.json", "trace.json"]
    names = [next(e["args"]["name"] for e in tracing.read_trace(p) if e["name"] == "process_name") for p in found]
    assert names == ["worker 0 (restart 1)", "worker 0 (restart 2)", "worker 0"]
    with tracing.trace_to(path, "a new run", restart=False):  # not a restart: the file is the new process's
        pass
    assert [e["args"]["name"] for e in tracing.read_trace(path) if e["ph"] == "M"] == ["a new run"]


# ----------------------------------------------------------------------------- DDP


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}


def _ddp(logs: Path, extra: list[str] = (), prefix: list[str] = ()) -> dict:
    done = run_command(
        [
            *prefix,
            sys.executable,
            DDP_RUNNER,
            *DDP_ARGS,
            *extra,
            "--log-dir",
            str(logs),
            "--checkpoint-dir",
            str(logs / "ckpt"),
        ],
        cwd=ROOT,
        env=_clean_env(),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((logs / "summary.json").read_text())


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """2 ranks, the ring hook, 4 steps, --trace; (log folder, summary)."""
    logs = tmp_path_factory.mktemp("ddp_trace") / "logs"
    return logs, _ddp(logs, ["--trace", "--set", "training.checkpoint_interval_steps=3"])


@pytest.mark.slow
def test_a_traced_ddp_run_has_every_step_in_its_spans_on_one_clock(ddp_run):
    logs, summary = ddp_run
    steps = summary["steps"]
    assert steps == 4
    exchanges = {}
    for rank in (0, 1):
        events = _closed_trace(logs / f"rank_{rank}" / tracing.TRACE_FILE)
        counts = _counts(events)
        assert (
            counts["step"] == counts["forward_backward"] == counts["optimizer_step"] == counts["exchange_wait"] == steps
        )
        assert counts["evaluate"] == len(list(read_events(logs / "events.jsonl", "eval")))  # steps 2, 4 (epoch end)
        assert counts["checkpoint"] == len(list(read_events(logs / "events.jsonl", "checkpoint"))) + 1  # + ddp_final.pt
        spans = complete_events(events)
        step_spans = [s for s in spans if s["name"] == "step"]
        assert [s["args"]["step"] for s in step_spans] == list(range(1, steps + 1))
        for name in ("forward_backward", "optimizer_step"):
            assert all(any(_inside(s, step) for step in step_spans) for s in spans if s["name"] == name), name
        backward = [s for s in spans if s["name"] == "forward_backward"]
        waits = [s for s in spans if s["name"] == "exchange_wait"]
        assert all(any(_inside(w, b) for b in backward) for w in waits)  # the wait is the end of the backward pass
        rank_summary = json.loads((logs / f"ddp_rank_{rank}.json").read_text())
        assert sum(w["dur"] for w in waits) / 1e6 == pytest.approx(
            rank_summary["exposed_communication_s"], rel=1e-3, abs=1e-5
        )
        hooks = [s for s in spans if s["name"] == "hook_exchange"]
        assert {s["args"]["step"] for s in hooks} == set(range(steps))  # the hook's step counter starts at 0
        assert {s["tid"] for s in hooks}.isdisjoint({s["tid"] for s in backward})  # on the hook's own thread
        exchanges[rank] = {(s["args"]["step"], s["args"]["bucket"]): s for s in hooks}
    # One clock: a ring exchange needs both ranks at once, so the two ranks' spans of each bucket overlap.
    assert exchanges[0].keys() == exchanges[1].keys()
    for key, first in exchanges[0].items():
        second = exchanges[1][key]
        assert first["ts"] < second["ts"] + second["dur"] and second["ts"] < first["ts"] + first["dur"], key
    ranks = [json.loads((logs / f"ddp_rank_{r}.json").read_text()) for r in (0, 1)]
    assert summary["exposed_communication_s"] == pytest.approx(sum(r["exposed_communication_s"] for r in ranks))


def _slow_exchange(seconds: float):
    """A comm hook whose exchange finishes ``seconds`` after DDP hands it the bucket (on its own thread)."""

    def hook(state, bucket):  # no annotations: DDP checks them, and postponed ones are strings
        future = torch.futures.Future()
        buffer = bucket.buffer()

        def finish() -> None:
            time.sleep(seconds)  # the emulated exchange: a link this slow
            future.set_result(buffer)

        threading.Thread(target=finish, daemon=True).start()
        return future

    return hook


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_backward_pass_wait_for_a_slow_exchange_is_what_ddp_exposes(single_rank_group):
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))

    def exposed(hook) -> list[float]:
        module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        model = DistributedDataParallel(module)
        if hook is not None:
            model.register_comm_hook(None, hook)
        wait = BackwardWait(module)
        waited = []
        for _ in range(3):
            model.zero_grad()
            loss = F.cross_entropy(model(x), y)
            wait.backward_started()
            loss.backward()
            waited.append(wait.backward_ended(time.perf_counter()))
        wait.close()
        assert wait.total_s == pytest.approx(sum(waited))
        return waited

    slow = exposed(_slow_exchange(0.25))
    immediate = exposed(None)  # the built-in allreduce of one rank: next to nothing
    assert all(0.25 <= w < 0.25 + 1.0 for w in slow), slow  # the whole wait, and not the forward/backward too
    assert max(immediate) < 0.1 and sum(slow) - sum(immediate) == pytest.approx(0.75, rel=0.5)


@pytest.fixture
def shaped_loopback():
    """A network namespace whose loopback (MTU 1500, as an Ethernet link) a test can shape with ``tc``."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("network namespaces and tc need root and iproute2 (CI runs as root)")
    name = f"dtspans{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=30)
    try:
        subprocess.run(
            ["ip", "-n", name, "link", "set", "lo", "mtu", "1500", "up"], check=True, capture_output=True, timeout=30
        )
        yield name
    finally:
        remove_namespace(name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_exposed_communication_grows_as_a_tc_shaped_link_narrows(ddp_run, shaped_loopback, tmp_path):
    """Both ranks in one namespace, their ring traffic through its loopback shaped by a token bucket to 25 Mbit/s."""
    _, unshaped = ddp_run
    mbps = 25
    shape_egress(shaped_loopback, "lo", mbps)
    shaped = _ddp(tmp_path / "shaped", prefix=["ip", "netns", "exec", shaped_loopback])
    assert shaped["bytes_sent"] == unshaped["bytes_sent"] and shaped["steps"] == unshaped["steps"]  # the same exchange
    rank_steps = 2 * shaped["steps"]
    # Both ranks' bytes pass the one shaped loopback; the backward pass left after the first of the two
    # buckets is ready lasts milliseconds, so nearly all of the transfer is waited for.
    transfer_s = 8 * shaped["bytes_sent"] / shaped["steps"] / (mbps * 1e6)  # ~1.1 s a step
    exposed, before = shaped["exposed_communication_s"] / rank_steps, unshaped["exposed_communication_s"] / rank_steps
    assert exposed >= 0.6 * transfer_s and exposed > before + 0.5 * transfer_s, (exposed, before, transfer_s)


# ----------------------------------------------------------------------------- the picture


@pytest.mark.slow
def test_a_trace_is_drawn_one_lane_per_thread_with_nested_spans_below_their_parents(ddp_run, tmp_path, capsys):
    from src.reports.plots import draw_timeline, lanes

    logs, summary = ddp_run
    events = tracing.merge_traces(tracing.read_trace(p) for p in tracing.find_traces(logs))
    drawn = lanes(events)
    assert [name for name, _ in drawn] == [
        "rank 0 / MainThread",
        "rank 0 / comm-hook_0",
        "rank 1 / MainThread",
        "rank 1 / comm-hook_0",
    ]
    main = dict(drawn)["rank 0 / MainThread"]
    depths = {span["name"]: depth for span, depth in main}
    assert (depths["step"], depths["forward_backward"], depths["exchange_wait"]) == (0, 1, 2)
    assert sum(1 for span, _ in main if span["name"] == "step") == summary["steps"]
    picture = draw_timeline(events, tmp_path / "timeline.png", start_s=0.0, seconds=1.0)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from scripts import plot_trace  # a script: scripts/ is a namespace package under the repository root

    with pytest.raises(SystemExit) as exit_info:
        plot_trace.main([str(tmp_path / "absent.json"), "--output", str(tmp_path / "x.png")])
    assert exit_info.value.code == 2 and "absent.json: no such file or folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plot_trace.main([str(logs), "--output", str(tmp_path / "x.png"), "--start", "1000"])
    assert "no span between 1000 s" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the report


@pytest.mark.slow
def test_the_report_shows_exposed_communication_for_every_architecture(ps_run, ddp_run):
    (_, ps), (ddp_logs, ddp) = ps_run, ddp_run
    ranks = [json.loads((ddp_logs / f"ddp_rank_{r}.json").read_text()) for r in (0, 1)]
    report = build_report(
        [Run(SUMMARY, "baseline.json"), Run(ps, "ps.json", workers=ps["workers"]), Run(ddp, "ddp.json", ranks=ranks)]
    )
    splits = {r["architecture"]: r["time_split"] for r in report["runs"]}
    assert splits["baseline"]["exposed_communication_s"] == 0.0
    assert splits["parameter_server"]["exposed_communication_s"] == pytest.approx(ps["exposed_communication_s"] / 2)
    assert splits["ddp"]["exposed_communication_s"] == pytest.approx(ddp["exposed_communication_s"] / 2)
    assert splits["ddp"]["exposed_share_of_train_time"] == pytest.approx(
        ddp["exposed_communication_s"] / 2 / ddp["train_time_s"]
    )
    table = to_markdown(report_blocks(report, "plots")).split("## Where the time goes")[1].split("##")[0]
    rows = [
        line for line in table.splitlines() if line.startswith("| ") and "exposed" not in line and "---" not in line
    ]
    assert len(rows) == 3 and all("% of train time" in row for row in rows), rows
