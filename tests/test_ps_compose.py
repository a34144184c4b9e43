"""docker-compose.yml run for real: build the image, run the parameter server and two workers as containers.

The image is built on a base made locally (docker/build_local_base.sh: debootstrap, no registry),
never pulled; the containers mount the host's Python packages read-only (docker/compose.local.yml)
instead of installing torch into the image, and training_net is internal, so nothing leaves this
machine. Each run checks that the three services train mnist_5k to completion over training_net
and that the final checkpoint on the host volume evaluates to the accuracy the server reported.
The server's container turns healthy by its healthcheck (the standard gRPC health check,
``python -m src.transport.healthcheck``), which the test waits on, and the workers start on it
(``depends_on: condition: service_healthy``).
The plain run also checks that compose refuses to start without DTS_AUTH_TOKEN, that a container
with a wrong token is refused by the server, and that a worker killed mid-run is restarted by
docker and registers again; the TLS run (docker/compose.tls.yml), that the server's certificate
verifies for the name the workers dial. The sharded run (docker-compose.shards.yml and
docker/compose.shards.local.yml on top) runs two server shards as two containers and checks that
every container ends by itself and that the final checkpoint is the whole model.

Needs root, Docker (dockerd running), docker-compose and debootstrap; CI installs and starts them
(.ci/run) and sets DTS_REQUIRE_DOCKER=1, so there the test fails instead of skipping. The first run
on a machine makes the base image (about a minute of CPU); later runs reuse it and the built image.
"""

from __future__ import annotations

import hashlib
import importlib.util
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

from src.common.checkpoint import load_checkpoint
from src.metrics import read_events
from src.training.data import load_dataset
from tests.ps_fixtures import ROOT, make_self_signed_cert

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

BASE_IMAGE = "dts-local-base:bookworm-py311"  # the BASE_IMAGE build arg of docker/compose.local.yml
SERVICES = ("parameter_server", "worker_0", "worker_1")
TOKEN = "compose-test-token-0123456789"


def docker_unavailable() -> str | None:
    """Why this machine cannot run the test, or ``None``."""
    if os.geteuid() != 0:
        return "needs root (bind mounts, debootstrap)"
    for tool in ("docker", "docker-compose", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode != 0:
        return "the Docker engine is not running"
    if sys.version_info[:2] != (3, 11):
        return (
            f"the image's Python is 3.11; this Python is {sys.version_info[0]}.{sys.version_info[1]}, "
            "its packages would not load"
        )
    return None


@pytest.fixture(scope="module")
def local_base():
    """The local base image: made once per machine by docker/build_local_base.sh, never pulled."""
    reason = docker_unavailable()
    if reason is not None:
        if os.environ.get("DTS_REQUIRE_DOCKER") == "1":
            pytest.fail(f"DTS_REQUIRE_DOCKER=1 but {reason}")
        pytest.skip(reason)
    made = subprocess.run(
        ["bash", str(ROOT / "docker" / "build_local_base.sh"), BASE_IMAGE], capture_output=True, text=True, timeout=600
    )
    assert made.returncode == 0, made.stdout + made.stderr
    assert subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True, timeout=60).returncode == 0
    return BASE_IMAGE


def docker(*args: str, timeout: float = 60) -> str:
    """``docker ARGS``' stdout (the engine's CLI answers queries far faster than docker-compose)."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"docker {' '.join(args)}: {result.stderr}"
    return result.stdout


def inspect(kind: str, name: str) -> dict:
    return json.loads(docker(kind, "inspect", name))[0]


class Compose:
    """docker-compose on one project (a unique name) with the test's environment; :meth:`down` removes it all."""

    def __init__(self, project: str, files: list[str], environment: dict[str, str]):
        self.project = project
        self.network = f"{project}_training_net"
        self.prefix = ["docker-compose", "--ansi", "never", "-p", project, *[arg for f in files for arg in ("-f", f)]]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DTS_", "COMPOSE_"))} | environment
        self.services = SERVICES  # the project's services, for the logs

    def __call__(self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None):
        result = subprocess.run(
            [*self.prefix, *args], cwd=ROOT, env=env or self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"docker-compose {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def container(self, service: str) -> str:
        ids = docker(
            "ps",
            "-aq",
            "--filter",
            f"label=com.docker.compose.project={self.project}",
            "--filter",
            f"label=com.docker.compose.service={service}",
            "--filter",
            "label=com.docker.compose.oneoff=False",
        ).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def logs(self, *services: str) -> str:
        text = []
        for service in services or self.services:
            result = subprocess.run(
                ["docker", "logs", self.container(service)], capture_output=True, text=True, timeout=60
            )
            text.append(f"--- {service}\n{result.stdout}{result.stderr}")
        return "\n".join(text)

    def down(self) -> None:
        self("down", "--volumes", "--remove-orphans", "--timeout", "5", check=False, timeout=120)
        # Whatever down left behind (it failed, or a one-off container outlived it) goes too.
        label = f"label=com.docker.compose.project={self.project}"
        leftover = subprocess.run(
            ["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True, timeout=60
        ).stdout.split()
        if leftover:
            subprocess.run(["docker", "rm", "-f", *leftover], capture_output=True, timeout=120)
        if (
            subprocess.run(["docker", "network", "inspect", self.network], capture_output=True, timeout=60).returncode
            == 0
        ):
            subprocess.run(["docker", "network", "rm", self.network], capture_output=True, timeout=60)


def make_server_certificate(directory: Path) -> None:
    """docs/deployment.md's command for the compose cluster's self-signed certificate (name: parameter_server)."""
    directory.mkdir()
    make_self_signed_cert(directory, name="parameter_server", alt_names="DNS:parameter_server", days=365)


def wait_for_event(compose: Compose, events: Path, condition, what: str, deadline_s: float) -> None:
    """Poll the server's events.jsonl (on the host volume) until an event meets ``condition``."""
    server = compose.container("parameter_server")
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if events.is_file() and any(condition(event) for event in read_events(events)):
            return
        if not inspect("container", server)["State"]["Running"]:
            pytest.fail(f"the server stopped before {what}:\n{compose.logs()}")
        time.sleep(0.2)
    pytest.fail(f"no {what} within {deadline_s}s:\n{compose.logs()}")


def wait_until_healthy(compose: Compose, service: str, deadline_s: float) -> dict:
    """Poll the container's health (its healthcheck's verdict) until it is healthy; returns its inspect data."""
    container = compose.container(service)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        state = inspect("container", container)
        health = state["State"].get("Health")
        assert health is not None, f"{service} has no healthcheck"
        if health["Status"] == "healthy":
            return state
        if health["Status"] == "unhealthy" or not state["State"]["Running"]:
            pytest.fail(
                f"{service} is {health['Status']} (running: {state['State']['Running']}); last probes: "
                f"{[entry['Output'] for entry in health['Log'][-3:]]}\n{compose.logs()}"
            )
        time.sleep(0.5)
    pytest.fail(f"{service} not healthy within {deadline_s}s:\n{compose.logs()}")


def evaluate_checkpoint(path: Path, capsys) -> dict:
    """scripts/evaluate_checkpoint.py on ``path``, in this process (torch is loaded already)."""
    spec = importlib.util.spec_from_file_location("evaluate_checkpoint", ROOT / "scripts" / "evaluate_checkpoint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    assert module.main(["--checkpoint", str(path)]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _compose_project(tmp_path, output, tls, *, shards=False, services=SERVICES, test_override=None):
    """The compose project of the spec's cluster (plain or TLS; with ``shards``, the 2-shard cluster of
    docker-compose.shards.yml), writing its outputs under ``output``; ``test_override``: more of the test's own
    service settings."""
    files = ["docker-compose.yml", "docker/compose.local.yml"] + (["docker/compose.tls.yml"] if tls else [])
    if shards:
        files += ["docker-compose.shards.yml", "docker/compose.shards.local.yml"]
    environment = {
        "DTS_AUTH_TOKEN": TOKEN,
        "DTS_SITE_PACKAGES": sysconfig.get_paths()["purelib"],
        "DTS_COMPOSE_OUTPUT": str(output),
    }
    if tls:
        make_server_certificate(tmp_path / "certs")
        environment["DTS_TLS_DIR"] = str(tmp_path / "certs")
    # An image tag of this checkout's own, so that a run from another checkout on the same
    # machine cannot retag the image under this one's containers.
    image_override = tmp_path / "image.yml"
    image = f"dts-compose-test:{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}"
    settings = {service: {"image": image, **(test_override or {}).get(service, {})} for service in services}
    image_override.write_text(yaml.safe_dump({"services": settings}))
    files.append(str(image_override))
    compose = Compose(f"dtstest{os.getpid()}{'shards' if shards else 'tls' if tls else 'plain'}", files, environment)
    compose.services = services
    return compose


def _assert_no_token_starts_nothing(compose):
    """No token (unset or empty), no cluster: compose refuses before starting anything."""
    for without in (
        {k: v for k, v in compose.env.items() if k != "DTS_AUTH_TOKEN"},
        compose.env | {"DTS_AUTH_TOKEN": ""},
    ):
        refused = compose("up", "-d", "--no-build", check=False, env=without)
        assert refused.returncode != 0 and "set DTS_AUTH_TOKEN" in refused.stderr, refused.stderr
    assert not docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={compose.project}").split()


def _assert_tls_handshake(compose):
    """The server speaks TLS with a certificate valid for the name the workers dial (a plain Python client
    in a worker's container, so the handshake alone is checked)."""
    handshake = compose(
        *"run --rm --no-deps -T --entrypoint python worker_0 -c".split(),
        "import socket, ssl; context = ssl.create_default_context(cafile='certs/server.crt'); "
        "print(context.wrap_socket(socket.create_connection(('parameter_server', 50051), timeout=30), "
        "server_hostname='parameter_server').version())",
        check=False,
    )
    assert handshake.returncode == 0 and handshake.stdout.startswith("TLSv1."), handshake.stdout + handshake.stderr


def _assert_intruder_refused(compose):
    """A container on training_net with a wrong token: the server refuses it; the run goes on."""
    intruder = compose(*"run --rm --no-deps -T -e DTS_AUTH_TOKEN=not-the-token worker_1".split(), check=False)
    assert intruder.returncode == 1, intruder.stdout + intruder.stderr
    assert "parameter server call failed: UNAUTHENTICATED: missing or wrong auth token" in intruder.stderr, (
        intruder.stderr
    )
    assert TOKEN not in intruder.stdout + intruder.stderr


def _run_to_the_end(compose, server_events, kill_a_worker):
    """Start the workers (SIGKILL worker_0's process an eighth into the run if ``kill_a_worker``: docker
    restarts it, restart: on-failure, and it registers again); wait for every service to exit 0.
    Returns (container states, the network's description, the logs)."""
    compose("up", "-d", "--no-build", "--no-recreate")
    containers = {service: compose.container(service) for service in SERVICES}
    if kill_a_worker:
        wait_for_event(
            compose,
            server_events,
            lambda e: e["kind"] == "update" and e["version"] >= 8,
            "update 8",
            deadline_s=300,
        )
        os.kill(inspect("container", containers["worker_0"])["State"]["Pid"], signal.SIGKILL)
    # The server ends the run once every worker is done; then the workers have exited too.
    for service in SERVICES:
        waited = subprocess.run(["docker", "wait", containers[service]], capture_output=True, text=True, timeout=600)
        logs = compose.logs()
        assert waited.stdout.strip() == "0", f"{service} exited {waited.stdout.strip()}:\n{logs}"
    states = {service: inspect("container", container) for service, container in containers.items()}
    return states, inspect("network", compose.network), logs


def _assert_trained_model_on_the_host(output, capsys, tls):
    """The summary and the final checkpoint on the host volume: the trained model the server reported."""
    summary = json.loads((output / "logs" / "ps_cli" / "summary.json").read_text())
    assert (summary["dataset"], summary["num_workers"], summary["epochs"]) == ("mnist_5k", 2, 2)
    assert summary["final_accuracy"] > 0.8  # two epochs of mnist_5k reach ~94%
    # Every sample of both epochs in exactly one applied update, the killed worker's included.
    assert summary["samples_processed"] == 2 * len(load_dataset("mnist_5k", "train")), summary
    assert summary["worker_incarnations"] == (2 if tls else 3), summary
    final = output / "checkpoints" / "ps_cli" / "parameter_server_final.pt"
    checkpoint = load_checkpoint(final)
    assert (checkpoint["dataset"], checkpoint["epoch"], checkpoint["extra"]["version"]) == (
        "mnist_5k",
        2,
        summary["versions"],
    )
    # Same model and test split, evaluated on the host; only the thread count differs from the
    # container's, which may flip a prediction sitting on a tie: a few samples in 1000.
    assert evaluate_checkpoint(final, capsys)["accuracy"] == pytest.approx(summary["final_accuracy"], abs=0.005)


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_compose_cluster_trains_to_completion(local_base, tmp_path, capsys, tls):
    output = tmp_path / "out"
    compose = _compose_project(tmp_path, output, tls)
    server_events = output / "logs" / "ps_cli" / "server" / "events.jsonl"
    try:
        compose("build", "--force-rm", timeout=600)
        if not tls:
            _assert_no_token_starts_nothing(compose)
        compose("up", "-d", "--no-build", "parameter_server")
        server_state = wait_until_healthy(compose, "parameter_server", deadline_s=300)
        assert server_state["Config"]["Healthcheck"]["Test"][:4] == ["CMD", "python", "-m", "src.transport.healthcheck"]
        # Healthy means serving: its listening event is written as it starts to serve (right after).
        wait_for_event(compose, server_events, lambda e: e["kind"] == "listening", "listening event", deadline_s=30)
        server_ip = server_state["NetworkSettings"]["Networks"][compose.network]["IPAddress"]
        if tls:
            _assert_tls_handshake(compose)
        else:
            _assert_intruder_refused(compose)
        # Plain: a worker dies as in a crash (SIGKILL, exit 137) and docker restarts it.
        states, network, logs = _run_to_the_end(compose, server_events, kill_a_worker=not tls)
    finally:
        compose.down()

    assert [state["RestartCount"] for state in states.values()] == ([0, 0, 0] if tls else [0, 1, 0]), logs
    assert network["Internal"] is True  # no route off this machine
    assert not any(states["parameter_server"]["NetworkSettings"]["Ports"].values())  # 50051 not published
    assert "Final Accuracy:" in logs and "Checkpoint: checkpoints/ps_cli/parameter_server_final.pt" in logs

    # Workers reached the server over training_net from their containers' own addresses; the
    # restarted worker_0 joined again as a new incarnation.
    subnet = ipaddress.ip_network(network["IPAM"]["Config"][0]["Subnet"])
    joined = [e for e in read_events(server_events) if e["kind"] in ("register", "worker_rejoined")]
    assert sorted((e["kind"], e["worker"]) for e in joined) == [("register", 0), ("register", 1)] + (
        [] if tls else [("worker_rejoined", 0)]
    ), joined
    peers = {ipaddress.ip_address(e["peer"].removeprefix("ipv4:").rsplit(":", 1)[0]) for e in joined}
    assert all(peer in subnet and peer != ipaddress.ip_address(server_ip) for peer in peers), (peers, subnet, server_ip)
    for k in (0, 1):
        assert (output / "logs" / "ps_cli" / f"worker_{k}" / "events.jsonl").is_file()
    _assert_trained_model_on_the_host(output, capsys, tls)


# ----------------------------------------------------------------------------- two server shards

SHARDED_SERVICES = ("parameter_server", "parameter_server_1", "worker_0", "worker_1")
# The test's run (both shards take the same flags): 1 epoch of mnist_5k, 64 kB slices so that simple_cnn's larger
# tensors are cut across the shards; the outputs where docker-compose.shards.yml puts them.
SHARDED_COMMAND = [
    *"--workers 2 --dataset mnist_5k --num-epochs 1 --set system.shard_slice_bytes=65536".split(),
    *"--checkpoint-dir checkpoints/ps_shards --log-dir logs/ps_shards".split(),
    *"--resume-unfinished checkpoints/ps_shards".split(),
]
FOLLOWER_END_S = 60  # shard 1 ends by itself this soon after shard 0 (it polls shard 0 every second)


def test_compose_cluster_with_two_server_shards_trains_to_completion(local_base, tmp_path, capsys):
    """docker-compose.shards.yml on docker-compose.yml (and the local overrides): shard 0 and shard 1 as their own
    containers on training_net, both healthy before the workers start; every container exits 0 by itself (shard 1
    once shard 0 has ended the run), and the final checkpoint on the host volume is the whole model, evaluating to
    the accuracy shard 0 reported, with the placement of 2 shards in the summary."""
    from src.config import config_from_data
    from src.trainer import model_from_config

    output = tmp_path / "out"
    small_run = {"command": SHARDED_COMMAND}
    compose = _compose_project(
        tmp_path,
        output,
        False,
        shards=True,
        services=SHARDED_SERVICES,
        test_override={"parameter_server": small_run, "parameter_server_1": small_run},
    )
    try:
        compose("build", "--force-rm", timeout=600)
        compose("up", "-d", "--no-build")
        containers = {service: compose.container(service) for service in SHARDED_SERVICES}
        for shard in ("parameter_server", "parameter_server_1"):
            wait_until_healthy(compose, shard, deadline_s=300)
        exits = {}
        for service in ("parameter_server", "worker_0", "worker_1", "parameter_server_1"):
            timeout = FOLLOWER_END_S if service == "parameter_server_1" else 600
            try:
                waited = subprocess.run(
                    ["docker", "wait", containers[service]], capture_output=True, text=True, timeout=timeout
                )
                exits[service] = waited.stdout.strip()
            except subprocess.TimeoutExpired:
                exits[service] = f"still running after {timeout}s"
        logs = compose.logs()
        assert exits == dict.fromkeys(exits, "0"), f"{exits}\n{logs}"
        states = {service: inspect("container", container) for service, container in containers.items()}
        network = inspect("network", compose.network)
    finally:
        compose.down()

    assert [state["RestartCount"] for state in states.values()] == [0, 0, 0, 0], logs
    assert network["Internal"] is True
    assert "parameter-server shard 1: the run is over; its part of the model is in" in logs, logs
    assert "Checkpoint: checkpoints/ps_shards/parameter_server_final.pt" in logs
    # The workers reached both shards over training_net from their own containers' addresses.
    subnet = ipaddress.ip_network(network["IPAM"]["Config"][0]["Subnet"])
    logs_dir = output / "logs" / "ps_shards"
    registered = list(read_events(logs_dir / "server" / "events.jsonl", kind="register"))
    assert sorted(e["worker"] for e in registered) == [0, 1], registered
    assert all(ipaddress.ip_address(e["peer"].removeprefix("ipv4:").rsplit(":", 1)[0]) in subnet for e in registered)
    assert any(e["kind"] == "listening" for e in read_events(logs_dir / "server_1" / "events.jsonl"))

    summary = json.loads((logs_dir / "summary.json").read_text())
    num_train = len(load_dataset("mnist_5k", "train"))
    assert (summary["dataset"], summary["num_workers"], summary["samples_processed"]) == ("mnist_5k", 2, num_train)
    placement = summary["placement"]
    assert placement["num_shards"] == 2 and all(placement["slices_per_shard"]), placement
    assert any("#" in key for shard in placement["slices_per_shard"] for key in shard), "no tensor was cut"
    final = output / "checkpoints" / "ps_shards" / "parameter_server_final.pt"
    checkpoint = load_checkpoint(final)
    model = model_from_config(config_from_data(checkpoint["config"]))
    assert list(checkpoint["model_state_dict"]) == list(model.state_dict()), "not the whole model"
    assert (checkpoint["extra"]["num_servers"], checkpoint["extra"]["version"]) == (2, summary["versions"])
    assert summary["final_accuracy"] > 0.5  # one epoch of mnist_5k
    # Evaluated on the host: the accuracy shard 0 reported (threads differ: a tie may flip, a few in 1000).
    assert evaluate_checkpoint(final, capsys)["accuracy"] == pytest.approx(summary["final_accuracy"], abs=0.005)


def test_a_shard_container_killed_mid_run_comes_back_and_the_run_ends_as_one_model(local_base, tmp_path):
    """The 2-shard cluster, 2 epochs: shard 1's process is SIGKILLed from the host past version 20. Its restart
    policy starts it again with --resume-unfinished; shard 0 notices it went away, ends with an error and is
    started again too; both go back to the newest version they have checkpointed (every 10), the workers register
    again, and the run ends with every sample of both epochs in exactly one applied update and every version of
    shard 1 made of shard 0's pushes."""
    from src.coordinator import check_coverage, check_shards

    output = tmp_path / "out"
    run = {
        "command": [
            *SHARDED_COMMAND,
            *"--num-epochs 2 --checkpoint-interval 10 --heartbeat-interval 0.5 --heartbeat-timeout 3".split(),
            *"--set emulation.step_delay_s=0.05".split(),
        ]
    }
    compose = _compose_project(
        tmp_path,
        output,
        False,
        shards=True,
        services=SHARDED_SERVICES,
        test_override={"parameter_server": run, "parameter_server_1": run},
    )
    logs_dir = output / "logs" / "ps_shards"

    def follower_version() -> int:
        path = logs_dir / "server_1" / "events.jsonl"
        return max((e["version"] for e in read_events(path, kind="update")), default=0) if path.is_file() else 0

    try:
        compose("build", "--force-rm", timeout=600)
        compose("up", "-d", "--no-build")
        containers = {service: compose.container(service) for service in SHARDED_SERVICES}
        deadline = time.monotonic() + 300
        while follower_version() < 20:
            assert time.monotonic() < deadline, f"shard 1 did not reach version 20\n{compose.logs()}"
            time.sleep(0.2)
        os.kill(inspect("container", containers["parameter_server_1"])["State"]["Pid"], signal.SIGKILL)
        for worker in ("worker_0", "worker_1"):
            waited = subprocess.run(["docker", "wait", containers[worker]], capture_output=True, text=True, timeout=600)
            assert waited.stdout.strip() == "0", compose.logs()
        deadline = time.monotonic() + FOLLOWER_END_S
        while any(inspect("container", containers[s])["State"]["Running"] for s in SHARDED_SERVICES[:2]):
            assert time.monotonic() < deadline, f"the shards did not end\n{compose.logs()}"
            time.sleep(0.5)
        states = {service: inspect("container", container)["State"] for service, container in containers.items()}
        restarts = {s: inspect("container", containers[s])["RestartCount"] for s in SHARDED_SERVICES[:2]}
        logs = compose.logs()
    finally:
        compose.down()

    assert all(state["ExitCode"] == 0 for state in states.values()), (states, logs)
    assert restarts["parameter_server"] >= 1 and restarts["parameter_server_1"] >= 1, (restarts, logs)
    events = list(read_events(logs_dir / "server" / "events.jsonl"))
    [recovered] = [e for e in events if e["kind"] == "server_recovered"]
    assert recovered["version"] % 10 == 0 and 10 <= recovered["version"] <= 30, recovered
    follower = list(read_events(logs_dir / "server_1" / "events.jsonl"))
    assert [e["version"] for e in follower if e["kind"] == "shard_recovered"][-1] == recovered["version"]
    num_train = len(load_dataset("mnist_5k", "train"))
    coverage = check_coverage(events, num_train, 2)
    assert coverage["ok"] and coverage["voided"] == recovered["versions_lost"], coverage
    summary = json.loads((logs_dir / "summary.json").read_text())
    shards = check_shards(events, {1: follower})
    assert shards["ok"] and shards["versions"] == summary["versions"], shards
    assert summary["samples_processed"] == 2 * num_train and summary["final_accuracy"] > 0.8
