"""Several server shards on several hosts, link-bound: samples/s of a short sync run of the runner across network
namespaces with 1 and with 2 server shards, each server's link limited by ``tc`` (a token bucket on both of its
ends), the workers' links not, and the ratio 2 shards / 1 shard.

The hosts: one namespace per server shard and per worker, each joined by a veth pair to a bridge in a "switch"
namespace of its own (10.79.0.0/24), so every byte between two hosts crosses the sender's link and the receiver's.
A server's link is shaped both ways: a ``tbf`` qdisc on its own end (what it sends: the pulls' replies) and on the
bridge's end (what it receives: the workers' pushes). Every process is ``run_parameter_server_training.py`` started
as one host would start it (``--role server [--shard K --shard-addresses A0,A1]``, ``--role worker --worker-id N``),
with ``$DTS_AUTH_TOKEN``; ``OMP_NUM_THREADS=1`` in each, as the local launcher gives each process its share of a
machine's cores (they all share this one's).

Why the ratio can reach 2: with n workers and a model of M bytes, one server's link carries n*M bytes in and n*M out
per step, and with k shards each link carries n*M/k. A step's pushes go in before its pulls come out (hold, commit,
pull), so the links' time is about 2*n*M*8 / (k*B) per step at B bit/s; what is not link time (the workers' compute,
the protocol, the servers' work, all on the same cores here) does not shrink with k. ``link_s`` (each run's bytes
over its shards' links, pushes and pulls one after the other; ``link_overlapped_s`` each direction alone) is the
formula's time; ``not_halved_s`` = 2*T2 - T1 is the part of the time that 2 shards did not halve (with T1 = L + C
and T2 = L/2 + C: C, the same in both runs), so that the ratio is 2 - C/T2.

With ``pipelined``, two more 2-shard runs, streamed (``--streaming``) and streamed with pipelined replies
(``--pipelined-replies``: each shard steps a slice as soon as both workers' values of it are in and sends it down
during the holds, :mod:`src.ps.state.slice_pipeline`), in turns with the others: ``pipelined_over_streamed`` is their
samples/s ratio. On the shaped links a step's pushes and pulls then cross at once (``link_overlapped_s``), so the
link-bound time can fall toward half.

With ``virtual``, each arm's last run is also run in virtual time (:func:`src.studies.fidelity.compare_with_real`:
its config from its final checkpoint, the cost model calibrated here, each shard's NIC at ``server_mbps`` = the tc
rate): ``virtual`` holds, per arm, samples/s and the steady step (:func:`steady_step_s`) both ways and their ratios
virtual / real, how faithful virtual time is on the setting each arm stands for.

``followers_exit``: each follower's exit status (0), or how it ended otherwise and its last lines: a follower ends
by itself once shard 0 has said the run is done and gone; the figures are from shard 0's summary, which it writes
after reading every follower's part.

Needs root and iproute2 (``ip``, ``tc``); without them the section says why it did not run. Every namespace and
link made here is removed in a ``finally``, with any process left in it.
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

from src.benchmarks.common import log

ROOT = Path(__file__).resolve().parents[3]
RUNNER = ROOT / "run_parameter_server_training.py"
SUBNET = "10.79.0"
PORT = 50071
NUM_WORKERS = 2
RUN_TIMEOUT_S = 300.0
FOLLOWER_GRACE_S = 30.0


def unavailable() -> str | None:
    """Why namespaces cannot be made here (``None``: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found)"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def shape_egress(namespace: str, device: str, mbps: float) -> None:
    """A token bucket of ``mbps`` Mbit/s on ``device``'s egress in ``namespace`` (``tc qdisc ... tbf``)."""
    command = (
        f"ip netns exec {namespace} tc qdisc replace dev {device} root tbf rate {mbps:g}mbit burst 32kb latency 400ms"
    )
    done = subprocess.run(command.split(), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{command}: {done.stderr.strip()}")


def remove_namespace(name: str) -> None:
    """Kill every process left in namespace ``name``, then delete it (with the veth ends inside); no error if gone."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


class Hosts:
    """Hosts as namespaces on one bridge (see the module docstring); a context manager that removes them all.

    Args:
        roles: each host's role name (``"server_0"``, ``"worker_1"``...); host ``i`` gets ``10.79.0.{i + 1}``.
        shaped: the roles whose link is limited, both ways, to ``mbps``.
        mbps: the shaped links' rate, Mbit/s.
        mtu: every link's MTU (default: the kernel's, 1500); 9000 is a datacenter's jumbo frames.
    """

    def __init__(self, roles: list[str], shaped: list[str], mbps: float, *, mtu: int | None = None):
        self.prefix = f"dtb{os.getpid() % 100000}"
        self.switch = f"{self.prefix}x"
        self.namespaces = {role: f"{self.prefix}n{i}" for i, role in enumerate(roles)}
        self.ips = {role: f"{SUBNET}.{i + 1}" for i, role in enumerate(roles)}
        self.shaped, self.mbps, self.mtu = list(shaped), mbps, mtu
        self._created: list[str] = []
        self._links: list[str] = []

    def __enter__(self) -> Hosts:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for namespace in (self.switch, *self.namespaces.values()):
            _ip("netns", "add", namespace)
            self._created.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (role, namespace) in enumerate(self.namespaces.items()):
            port, host = f"{self.prefix}p{i}", f"{self.prefix}h{i}"
            _ip("link", "add", port, "type", "veth", "peer", "name", host)
            self._links.append(port)
            _ip("link", "set", port, "netns", self.switch)
            _ip("link", "set", host, "netns", namespace)
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            if self.mtu is not None:
                _ip("-n", self.switch, "link", "set", port, "mtu", str(self.mtu))
                _ip("-n", namespace, "link", "set", host, "mtu", str(self.mtu))
            _ip("-n", namespace, "addr", "add", f"{self.ips[role]}/24", "dev", host)
            _ip("-n", namespace, "link", "set", host, "up")
            if role in self.shaped:
                shape_egress(namespace, host, self.mbps)  # what this host sends
                shape_egress(self.switch, port, self.mbps)  # what it receives: the bridge's egress towards it

    def close(self) -> None:
        for namespace in self._created:
            remove_namespace(namespace)  # takes the veth ends inside with it
        for link in self._links:  # left in the root namespace only if moving it failed
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self._created, self._links = [], []

    def start(self, role: str, args: list[str], output, token: str) -> subprocess.Popen:
        """The runner in ``role``'s namespace with ``args``, its output into ``output``, in a session of its own."""
        env = {**os.environ, "DTS_AUTH_TOKEN": token, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[role], sys.executable, str(RUNNER), *args],
            cwd=ROOT,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _is_follower(role: str) -> bool:
    return role.startswith("server_") and role != "server_0"


def _wait(process: subprocess.Popen, deadline: float) -> int | None:
    """``process``'s exit code, or ``None`` if it is still running at ``deadline`` (monotonic)."""
    try:
        return process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def run_across_hosts(hosts: Hosts, num_servers: int, folder: Path, settings: dict, port: int, token: str) -> dict:
    """One sync run across ``hosts``: ``num_servers`` shards on ``server_0..``, the workers on ``worker_0..``, each
    process's logs and checkpoints under ``folder/ROLE``; shard 0's summary, with ``followers_exit``. ``settings``:
    ``samples``, ``batch_size``, ``slice_bytes``, ``transport``, and ``flags``: more of the runner's for the shards
    (streaming), ``worker_flags`` for the workers (``--trace``).

    Raises:
        RuntimeError: shard 0 or a worker did not end with 0 (with every process's last output).
    """
    addresses = [f"{hosts.ips[f'server_{k}']}:{port}" for k in range(num_servers)]
    run = [
        *("--workers", str(NUM_WORKERS), "--dataset", "mnist_5k", "--model", "simple_cnn", "--num-epochs", "1"),
        *("--max-train-samples", str(settings["samples"]), "--max-test-samples", "128"),
        *("--batch-size", str(settings["batch_size"]), "--transport", settings["transport"]),
        *("--checkpoint-interval", "100000", "--aggregation-mode", "sync"),
        *("--set", f"system.shard_slice_bytes={settings['slice_bytes']}"),
        *("--set", "training.eval_at_epoch_ends=false"),  # evaluated at the end only, outside the clock
        *settings.get("flags", ()),
    ]
    where = ["--shard-addresses", ",".join(addresses)] if num_servers > 1 else ["--server-address", addresses[0]]
    roles = {}
    for k in range(num_servers):
        shard = ["--shard", str(k)] if num_servers > 1 else []
        roles[f"server_{k}"] = ["--role", "server", *shard, *where, *run]
    for k in range(NUM_WORKERS):
        worker = ["--role", "worker", "--worker-id", str(k), *where, "--transport", settings["transport"]]
        roles[f"worker_{k}"] = [*worker, *settings.get("worker_flags", ())]
    processes, outputs, followers = {}, {}, {}
    try:
        for role, args in roles.items():
            own = folder / role
            outputs[role] = open(folder / f"{role}.out", "w+")
            folders = ["--log-dir", str(own / "logs"), "--checkpoint-dir", str(own / "ckpt")]
            processes[role] = hosts.start(role, [*args, *folders], outputs[role], token)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        codes = {role: _wait(process, deadline) for role, process in processes.items() if not _is_follower(role)}
        # a follower ends by itself once shard 0 has said the run is done and gone (src/launch/ps.py)
        deadline = time.monotonic() + FOLLOWER_GRACE_S
        followers = {role: _wait(process, deadline) for role, process in processes.items() if _is_follower(role)}
        tails = {}
        for role, handle in outputs.items():
            handle.seek(0)
            tails[role] = handle.read()[-1500:]
        if any(code != 0 for code in codes.values()):
            raise RuntimeError(f"a run with {num_servers} shard(s) failed (exit codes {codes}): {tails}")
    finally:
        for process in processes.values():
            if process.poll() is None:
                _kill_group(process)
        for handle in outputs.values():
            handle.close()
    summary = json.loads((folder / "server_0" / "logs" / "summary.json").read_text())
    summary["followers_exit"] = {
        role: code
        if code == 0
        else {
            "exit": code if code is not None else f"still running {FOLLOWER_GRACE_S:.0f} s after shard 0 ended: killed",
            "output": tails[role].strip().splitlines()[-3:],
        }
        for role, code in followers.items()
    }
    return summary


def steady_step_s(log_dir: Path) -> float:
    """The median seconds between shard 0's consecutive updates (in ``log_dir``'s ``server/events.jsonl``): a sync
    step once the run is going (the first step's warm-up left out)."""
    import statistics

    from src.metrics import read_events

    times = [e["time"] for e in read_events(Path(log_dir) / "server" / "events.jsonl", "update")]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def in_virtual_time(summary: dict, folder: Path, mbps: float) -> dict:
    """A real run across namespaces (shard 0's ``summary``) again in virtual time under ``folder``, calibrated here,
    each shard's NIC at ``mbps`` each way: samples/s and the steady step of both, and virtual / real."""
    from src.common.checkpoint import load_checkpoint
    from src.config import validate_config
    from src.studies.fidelity import compare_with_real

    config = validate_config(load_checkpoint(summary["checkpoint_path"])["config"])
    result = compare_with_real(config, summary, folder, setting={"server_mbps": mbps})
    real_step, virtual_step = steady_step_s(config.system.log_dir), steady_step_s(folder / "logs")
    (real,), (virtual,) = result["real"], result["virtual"]
    return {
        "samples_per_s": {
            "real": round(real["throughput_samples_per_s"], 1),
            "virtual": round(virtual["throughput_samples_per_s"], 1),
        },
        "samples_per_s_ratio": round(result["throughput_samples_per_s_ratio"], 3),
        "step_s": {"real": round(real_step, 4), "virtual": round(virtual_step, 4)},
        "step_ratio": round(virtual_step / real_step, 3),
        "calibration": {k: round(v, 5) for k, v in result["calibration"]["emulation"].items()},
        **(
            {"pipelined_replies": result["virtual_summary"]["pipelined_replies"]}
            if "pipelined_replies" in result["virtual_summary"]
            else {}
        ),
    }


def _entry(summary: dict, num_servers: int, mbps: float) -> dict:
    """One run's figures: samples/s, and the time its bytes take on the shards' shaped links: ``link_s`` with the
    pushes and the pulls one after the other (a step's hold, commit, pull), ``link_overlapped_s`` if they went at
    once (each direction alone)."""
    samples, seconds = summary["samples_processed"], summary["train_time_s"]
    sent, received = summary["bytes_sent"], summary["bytes_received"]  # the workers': all through server links
    per_link = 8 / (num_servers * mbps * 1e6)
    link_s = (sent + received) * per_link
    return {
        "servers": num_servers,
        "samples_processed": samples,
        "train_time_s": round(seconds, 2),
        "samples_per_s": round(samples / seconds, 1),
        "bytes_sent": sent,
        "bytes_received": received,
        "link_s": round(link_s, 2),
        "link_overlapped_s": round(max(sent, received) * per_link, 2),
        "link_share": round(link_s / seconds, 3),
        "shard_imbalance": summary.get("shard_imbalance"),  # the busiest shard's bytes over the mean (1: even)
        "final_accuracy": summary.get("final_accuracy"),
        "followers_exit": summary["followers_exit"],
        **({"pipelined_replies": summary["pipelined_replies"]} if "pipelined_replies" in summary else {}),
    }


def bench_shards_netns(
    mbps: float,
    *,
    transport: str = "tcp",
    samples: int = 512,
    batch_size: int = 16,
    slice_bytes: int = 65536,
    repeats: int = 1,
    pipelined: bool = False,
    virtual: bool = False,
    trace_dir: str | None = None,
) -> dict:
    """A sync run with 1 shard and one with 2 (``repeats`` times each, in turns), each server's link shaped to
    ``mbps`` both ways; samples/s and the ratio; with ``pipelined``, 2-shard runs streamed and streamed with
    pipelined replies too; with ``virtual``, each arm's last run in virtual time too (see the module docstring);
    or, where namespaces cannot be made, why not. ``trace_dir``: every process traced (``--trace``), and each arm's
    last run's traces kept there (``ARM/real/ROLE/trace.json``; with ``virtual``, ``ARM/virtual/...`` too)."""
    why = unavailable()
    setup = (
        f"simple_cnn on mnist_5k, {samples} samples, 1 epoch, batch {batch_size} per worker, {NUM_WORKERS} workers, "
        f"sync, {transport}, system.shard_slice_bytes={slice_bytes}; each server shard in its own namespace, its "
        f"link shaped by tc tbf to {mbps:g} Mbit/s both ways; each worker in its own, its link not shaped; "
        "OMP_NUM_THREADS=1 per process"
    )
    if why is not None:
        log(f"shards across namespaces: skipped ({why})")
        return {"skipped": why, "setup": setup}
    settings = {"samples": samples, "batch_size": batch_size, "slice_bytes": slice_bytes, "transport": transport}
    traced = ["--trace"] if trace_dir else []
    settings["worker_flags"] = traced
    token = os.urandom(16).hex()
    roles = ["server_0", "server_1", *(f"worker_{k}" for k in range(NUM_WORKERS))]
    arms: dict[str, tuple[int, list[str]]] = {"1": (1, []), "2": (2, [])}
    if pipelined:
        arms["2_streamed"] = (2, ["--streaming"])
        arms["2_pipelined"] = (2, ["--streaming", "--pipelined-replies"])
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    fidelity: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, Hosts(roles, ["server_0", "server_1"], mbps) as hosts:
        for repeat in range(repeats):
            for number, arm in enumerate(list(arms) if repeat % 2 == 0 else list(arms)[::-1]):
                servers, flags = arms[arm]
                folder = Path(tmp) / f"s{arm}_{repeat}"
                folder.mkdir()
                port = PORT + len(arms) * repeat + number
                run = {**settings, "flags": [*flags, *traced]}
                summary = run_across_hosts(hosts, servers, folder, run, port, token)
                runs[arm].append(_entry(summary, servers, mbps))
                row = runs[arm][-1]
                log(
                    f"shards across namespaces, {servers} shard(s){' ' + ' '.join(flags) if flags else ''} at "
                    f"{mbps:g} Mbit/s: {row['samples_per_s']} samples/s ({row['train_time_s']} s, links "
                    f"{row['link_s']} s)"
                )
                for role, ended in row["followers_exit"].items():
                    if ended != 0:
                        log(f"shards across namespaces: {role} did not end cleanly after shard 0: {ended}")
                if virtual and repeat == repeats - 1:
                    fidelity[arm] = in_virtual_time(summary, folder / "virtual", mbps)
                    log(f"  in virtual time: {fidelity[arm]['samples_per_s']} samples/s, {fidelity[arm]['step_s']} s")
                if trace_dir and repeat == repeats - 1:
                    _keep_traces(folder, Path(trace_dir) / arm)
    one, two = (_median_run(runs[k]) for k in ("1", "2"))
    not_halved = 2 * two["train_time_s"] - one["train_time_s"]  # T1 = L + C, T2 = L/2 + C: C = 2 T2 - T1
    versions = samples / (batch_size * NUM_WORKERS)
    result = {
        "setup": setup,
        "link_mbps": mbps,
        "one_shard": one,
        "two_shards": two,
        "runs_samples_per_s": {arm: [row["samples_per_s"] for row in rows] for arm, rows in runs.items()},
        "ratio": round(two["samples_per_s"] / one["samples_per_s"], 3),
        "target_ratio": 1.8,
        "not_halved_s": round(not_halved, 2),
        "not_halved_ms_per_version": round(not_halved / versions * 1e3, 1),
    }
    if pipelined:
        streamed, piped = _median_run(runs["2_streamed"]), _median_run(runs["2_pipelined"])
        result["two_shards_streamed"], result["two_shards_pipelined"] = streamed, piped
        result["pipelined_over_streamed"] = round(piped["samples_per_s"] / streamed["samples_per_s"], 3)
    if virtual:
        result["virtual"] = fidelity
    return result


def _keep_traces(folder: Path, into: Path) -> None:
    """Copy every trace.json of a run's ``folder`` (``ROLE/logs/...``; its virtual run's ``virtual/logs/...``) to
    ``into/real/ROLE/`` (``into/virtual/ROLE/``)."""
    for trace in sorted(folder.glob("*/logs/**/trace.json")):
        first = trace.relative_to(folder).parts[0]
        side, role = ("virtual", trace.parent.name) if first == "virtual" else ("real", first)
        target = into / side / role
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(trace, target / "trace.json")


def _median_run(rows: list[dict]) -> dict:
    """The run of median samples/s (the first of the two middle ones for an even count)."""
    ordered = sorted(rows, key=lambda row: row["samples_per_s"])
    return ordered[(len(ordered) - 1) // 2]
