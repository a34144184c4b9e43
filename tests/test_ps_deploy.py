"""Deployment files of the parameter server: docker-compose.yml and its overrides, the Dockerfile, the entrypoint,
the PS configs.

Fast checks of their structure; test_ps_compose.py (slow) builds the image and runs the compose
cluster for real, and test_ps_multihost.py runs the same entrypoint across network namespaces.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import yaml

from src.config import load_config
from tests.ps_fixtures import ROOT

SPEC_CONFIGS = {
    "ps_sync_mnist.yaml": ("sync", 2, False),
    "ps_async_quantization.yaml": ("async", 2, True),
    "ps_sync_topk.yaml": ("sync", 2, True),
    "ps_sync_mnist_4workers.yaml": ("sync", 4, False),
    "ps_async_quantization_4workers.yaml": ("async", 4, True),
}


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def override(name: str) -> dict:
    return yaml.safe_load((ROOT / "docker" / name).read_text())


def test_compose_services_network_and_volumes(compose):
    services = compose["services"]
    assert set(services) == {"parameter_server", "worker_0", "worker_1"}
    assert "training_net" in compose["networks"]
    for name, service in services.items():
        assert service["networks"] == ["training_net"], name
        assert {"./checkpoints:/app/checkpoints", "./logs:/app/logs"} <= set(service["volumes"]), name
        assert service["build"] == {"context": ".", "dockerfile": "docker/Dockerfile"}, name
        # No fallback token: compose refuses to start without $DTS_AUTH_TOKEN (test_ps_compose.py runs it).
        assert service["environment"]["DTS_AUTH_TOKEN"].startswith("${DTS_AUTH_TOKEN:?"), name
        assert service["environment"]["DTS_PROCESSES_PER_HOST"] == "3", name
    server = services["parameter_server"]
    assert server["environment"]["DTS_ROLE"] == "server"
    assert server["environment"]["DTS_SERVER_ADDRESS"] == "0.0.0.0:50051"  # reachable on training_net
    assert "ports" not in server  # not published to the host
    assert server["command"][server["command"].index("--workers") + 1] == "2"
    for k in (0, 1):
        worker = services[f"worker_{k}"]
        assert worker["environment"]["DTS_ROLE"] == "worker"
        assert worker["environment"]["DTS_WORKER_ID"] == str(k)
        assert worker["environment"]["DTS_SERVER_ADDRESS"] == "parameter_server:50051"
        assert worker["depends_on"] == {"parameter_server": {"condition": "service_healthy"}}  # started once serving
        assert worker["restart"].startswith("on-failure"), "a failed worker is restarted and registers again"
    assert server["healthcheck"]["test"] == ["CMD", "python", "-m", "src.transport.healthcheck"]


def test_local_override_builds_on_the_local_base_and_stays_on_this_machine():
    local = override("compose.local.yml")
    assert local["networks"]["training_net"]["internal"] is True
    base_script = (ROOT / "docker" / "build_local_base.sh").read_text()
    for name, service in local["services"].items():
        assert service["build"]["args"]["INSTALL_REQUIREMENTS"] == "no", name
        assert f'image="${{1:-{service["build"]["args"]["BASE_IMAGE"]}}}"' in base_script, (
            name
        )  # the script makes that base
        packages = [
            volume for volume in service["volumes"] if volume.endswith(":/usr/local/lib/python3.11/dist-packages:ro")
        ]
        assert len(packages) == 1, name  # the host's packages, read-only
    # The same run as docker-compose.yml's, on the bundled mnist_5k (internal network: nothing to download).
    main_command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["parameter_server"]["command"]
    local_command = local["services"]["parameter_server"]["command"]
    dataset = main_command.index("--dataset") + 1
    assert local_command == main_command[:dataset] + ["mnist_5k"] + main_command[dataset + 1 :]


def test_tls_override_gives_the_key_to_the_server_only():
    tls = override("compose.tls.yml")
    server = tls["services"]["parameter_server"]
    assert server["environment"] == {"DTS_TLS_CERT": "certs/server.crt", "DTS_TLS_KEY": "certs/server.key"}
    for k in (0, 1):
        worker = tls["services"][f"worker_{k}"]
        assert worker["environment"] == {"DTS_TLS_CA": "certs/server.crt"}
        assert not any("server.key" in volume for volume in worker["volumes"])
    # Nor does a key (or local data) get into the image through the build context.
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {"certs", "data", "checkpoints", "logs", ".git"} <= set(ignored)


def test_dockerfile_runs_the_entrypoint_with_the_code():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}\n" in dockerfile  # users get the official image
    assert "ARG INSTALL_REQUIREMENTS=yes" in dockerfile
    assert 'ENTRYPOINT ["bash", "docker/entrypoint.sh"]' in dockerfile
    for copied in (
        "COPY src/ src/",
        "COPY run_*.py ./",
        "COPY docker/entrypoint.sh docker/entrypoint.sh",
        "requirements.txt",
    ):
        assert copied in dockerfile
    assert "EXPOSE 50051" in dockerfile


@pytest.mark.parametrize(
    "environment, message",
    [
        ({}, "DTS_ROLE must be 'server' or 'worker', got ''"),
        ({"DTS_ROLE": "coordinator"}, "DTS_ROLE must be 'server' or 'worker', got 'coordinator'"),
        ({"DTS_ROLE": "worker"}, "DTS_WORKER_ID must be set for DTS_ROLE=worker"),
    ],
)
def test_entrypoint_refuses_a_missing_role(environment, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTS_")} | environment
    result = subprocess.run(
        ["bash", str(ROOT / "docker" / "entrypoint.sh")], env=env, capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert message in result.stderr


@pytest.fixture
def fake_python(tmp_path):
    """A ``python`` on PATH that prints the arguments and thread count it was given (the entrypoint's output)."""
    (tmp_path / "python").write_text(
        '#!/bin/sh\necho "OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"\nfor a in "$@"; do echo "$a"; done\n'
    )
    (tmp_path / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTS_") and k != "OMP_NUM_THREADS"}
    return env | {"PATH": f"{tmp_path}:{os.environ['PATH']}"}


def run_entrypoint(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "docker" / "entrypoint.sh"), *args], env=env, capture_output=True, text=True, timeout=30
    )


def test_entrypoint_passes_tls_files_and_a_share_of_the_cores(fake_python):
    server = run_entrypoint(
        fake_python
        | {
            "DTS_ROLE": "server",
            "DTS_TLS_CERT": "certs/server.crt",
            "DTS_TLS_KEY": "certs/server.key",
            "DTS_PROCESSES_PER_HOST": "3",
        },
        "--workers",
        "2",
    )
    assert server.returncode == 0, server.stderr
    lines = server.stdout.split()
    assert lines[0] == f"OMP_NUM_THREADS={max(1, len(os.sched_getaffinity(0)) // 3)}"
    assert (
        lines[1:]
        == (
            "run_parameter_server_training.py --role server --server-address 0.0.0.0:50051 "
            "--tls-cert certs/server.crt --tls-key certs/server.key --workers 2"
        ).split()
    )
    worker = run_entrypoint(
        fake_python
        | {
            "DTS_ROLE": "worker",
            "DTS_WORKER_ID": "1",
            "DTS_TLS_CA": "certs/server.crt",
            "OMP_NUM_THREADS": "7",
            "DTS_PROCESSES_PER_HOST": "3",
        }
    )
    assert (
        worker.stdout.split()
        == (
            "OMP_NUM_THREADS=7 run_parameter_server_training.py --role worker --worker-id 1 "
            "--server-address parameter_server:50051 --tls-ca certs/server.crt"
        ).split()
    )
    plain = run_entrypoint(fake_python | {"DTS_ROLE": "worker", "DTS_WORKER_ID": "0"})
    assert (
        plain.stdout.split()
        == (
            "OMP_NUM_THREADS=unset run_parameter_server_training.py --role worker --worker-id "
            "0 --server-address parameter_server:50051"
        ).split()
    )


def test_entrypoint_refuses_a_bad_process_count(fake_python):
    result = run_entrypoint(fake_python | {"DTS_ROLE": "server", "DTS_PROCESSES_PER_HOST": "three"})
    assert result.returncode == 2
    assert "DTS_PROCESSES_PER_HOST must be a positive integer, got 'three'" in result.stderr


def test_entrypoint_passes_the_shard_settings(fake_python):
    """DTS_SHARD_ADDRESSES and DTS_SHARD become --shard-addresses and --shard; a shard binds every interface on its
    own entry's port unless DTS_SERVER_ADDRESS says otherwise, and a worker reaches shard 0 at the list's first entry
    (the runner's default) unless DTS_SERVER_ADDRESS names it."""
    shards = {"DTS_SHARD_ADDRESSES": "ps0:50051,ps1.example:50052"}
    follower = run_entrypoint(fake_python | shards | {"DTS_ROLE": "server", "DTS_SHARD": "1"}, "--workers", "2")
    assert follower.returncode == 0, follower.stderr
    assert (
        follower.stdout.split()
        == (
            "OMP_NUM_THREADS=unset run_parameter_server_training.py --role server --server-address 0.0.0.0:50052 "
            "--shard-addresses ps0:50051,ps1.example:50052 --shard 1 --workers 2"
        ).split()
    )
    first = run_entrypoint(
        fake_python | shards | {"DTS_ROLE": "server", "DTS_SERVER_ADDRESS": "10.0.0.1:50051", "DTS_TRANSPORT": "tcp"}
    )
    assert (
        first.stdout.split()
        == (
            "OMP_NUM_THREADS=unset run_parameter_server_training.py --role server --server-address 10.0.0.1:50051 "
            "--shard-addresses ps0:50051,ps1.example:50052 --shard 0 --transport tcp"
        ).split()
    )
    worker = run_entrypoint(fake_python | shards | {"DTS_ROLE": "worker", "DTS_WORKER_ID": "1"})
    assert (
        worker.stdout.split()
        == (
            "OMP_NUM_THREADS=unset run_parameter_server_training.py --role worker --worker-id 1 "
            "--shard-addresses ps0:50051,ps1.example:50052"
        ).split()
    )
    named = run_entrypoint(
        fake_python
        | {"DTS_SHARD_ADDRESSES": "[fd00::1]:50051,[fd00::2]:50051"}
        | {"DTS_ROLE": "worker", "DTS_WORKER_ID": "0", "DTS_SERVER_ADDRESS": "[fd00::1]:50051"}
    )
    assert (
        named.stdout.split()
        == (
            "OMP_NUM_THREADS=unset run_parameter_server_training.py --role worker --worker-id 0 "
            "--server-address [fd00::1]:50051 --shard-addresses [fd00::1]:50051,[fd00::2]:50051"
        ).split()
    )


@pytest.mark.parametrize(
    "environment, message",
    [
        (
            {"DTS_ROLE": "server", "DTS_SHARD": "1"},
            "DTS_SHARD needs DTS_SHARD_ADDRESSES (every shard's host:port, shard 0 first)",
        ),
        (
            {"DTS_ROLE": "server", "DTS_SHARD": "2", "DTS_SHARD_ADDRESSES": "a:1,b:2"},
            "DTS_SHARD must be one of 0..1 (an entry of DTS_SHARD_ADDRESSES), got '2'",
        ),
        (
            {"DTS_ROLE": "server", "DTS_SHARD": "one", "DTS_SHARD_ADDRESSES": "a:1,b:2"},
            "DTS_SHARD must be one of 0..1 (an entry of DTS_SHARD_ADDRESSES), got 'one'",
        ),
        (
            {"DTS_ROLE": "server", "DTS_SHARD_ADDRESSES": "a:1,b"},
            "DTS_SHARD_ADDRESSES must be host:port entries separated by commas, shard 0 first, got 'a:1,b'",
        ),
        (
            {"DTS_ROLE": "server", "DTS_SHARD_ADDRESSES": "a:1,b:2,"},
            "DTS_SHARD_ADDRESSES must be host:port entries separated by commas, shard 0 first, got 'a:1,b:2,'",
        ),
        (
            {"DTS_ROLE": "worker", "DTS_WORKER_ID": "0", "DTS_SHARD_ADDRESSES": "a:1, b:2"},
            "DTS_SHARD_ADDRESSES must be host:port entries separated by commas, shard 0 first, got 'a:1, b:2'",
        ),
        (
            {"DTS_ROLE": "worker", "DTS_WORKER_ID": "0", "DTS_SHARD": "0", "DTS_SHARD_ADDRESSES": "a:1,b:2"},
            "DTS_SHARD is for DTS_ROLE=server (a worker connects to every shard of DTS_SHARD_ADDRESSES)",
        ),
    ],
    ids=["no-addresses", "past-the-list", "not-a-number", "no-port", "trailing-comma", "a-space", "on-a-worker"],
)
def test_entrypoint_refuses_bad_shard_settings(fake_python, environment, message):
    result = run_entrypoint(fake_python | environment)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [f"entrypoint: {message}"]
    assert result.stdout == ""  # nothing was started


@pytest.fixture(scope="module")
def sharded_compose(compose):
    """docker-compose.yml with docker-compose.shards.yml on top, merged as compose merges override files."""
    return merge_compose(compose, yaml.safe_load((ROOT / "docker-compose.shards.yml").read_text()))


def merge_compose(base: dict, override: dict) -> dict:
    """``override`` on ``base`` as docker-compose merges a later -f file: mappings merged key by key (environment,
    depends_on, build), anything else (command, restart, lists) replaced; volumes by their container path."""
    merged = dict(base)
    for key, value in override.items():
        if key == "volumes" and key in merged:
            by_target = {mount_target(entry): entry for entry in [*merged[key], *value]}
            merged[key] = list(by_target.values())
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_compose(merged[key], value)
        else:
            merged[key] = value
    return merged


def mount_target(volume: str) -> str:
    """The container path of a short volume entry ``SOURCE:TARGET[:MODE]`` (SOURCE may hold ``${VAR:-x}``)."""
    parts = volume.rsplit(":", 2)
    return parts[-2] if parts[-1] in ("ro", "rw") else parts[-1]


def test_shards_override_runs_two_server_shards(compose, sharded_compose):
    """parameter_server is shard 0, parameter_server_1 shard 1 (the same run's flags, its own container on
    training_net, with a healthcheck); the workers get both addresses and start once both shards are healthy.
    Both shards restart on failure and resume an unfinished run from the shards' folder (they go back together:
    src/ps/shards/recovery.py). docker-compose.yml itself is unchanged: test_compose_services_network_and_volumes."""
    services = sharded_compose["services"]
    assert set(services) == {"parameter_server", "parameter_server_1", "worker_0", "worker_1"}
    addresses = "parameter_server:50051,parameter_server_1:50051"
    for k, name in enumerate(("parameter_server", "parameter_server_1")):
        server = services[name]
        environment = server["environment"]
        assert (environment["DTS_ROLE"], environment["DTS_SHARD"]) == ("server", str(k)), name
        assert environment["DTS_SHARD_ADDRESSES"] == addresses, name
        assert environment["DTS_SERVER_ADDRESS"] == "0.0.0.0:50051", name
        assert environment["DTS_AUTH_TOKEN"].startswith("${DTS_AUTH_TOKEN:?"), name
        assert environment["DTS_TRANSPORT"] == "${DTS_TRANSPORT:-grpc}", name
        assert environment["DTS_PROCESSES_PER_HOST"] == "4", name
        assert server["restart"] == "on-failure:5", name
        resume = server["command"].index("--resume-unfinished")
        assert server["command"][resume + 1] == "checkpoints/ps_shards", name
        assert server["healthcheck"]["test"] == ["CMD", "python", "-m", "src.transport.healthcheck"], name
        assert server["networks"] == ["training_net"] and "ports" not in server, name
        assert {"./checkpoints:/app/checkpoints", "./logs:/app/logs"} <= set(server["volumes"]), name
        assert server["build"] == {"context": ".", "dockerfile": "docker/Dockerfile"}, name
        assert server["image"] == compose["services"]["parameter_server"]["image"], name
    assert services["parameter_server"]["command"] == services["parameter_server_1"]["command"]
    command = services["parameter_server"]["command"]
    assert command[command.index("--workers") + 1] == "2"
    for k in (0, 1):
        worker = services[f"worker_{k}"]
        assert worker["environment"]["DTS_SHARD_ADDRESSES"] == addresses
        assert "DTS_SHARD" not in worker["environment"]
        assert worker["depends_on"] == {
            "parameter_server": {"condition": "service_healthy"},
            "parameter_server_1": {"condition": "service_healthy"},
        }
        assert worker["command"] == ["--log-dir", command[command.index("--log-dir") + 1]]


def test_shards_local_override_builds_the_second_shard_on_the_local_base(sharded_compose):
    """docker/compose.shards.local.yml does for parameter_server_1 what compose.local.yml does for the others, and
    runs the same sharded run on the bundled mnist_5k."""
    local = merge_compose(sharded_compose, override("compose.local.yml"))
    local = merge_compose(local, override("compose.shards.local.yml"))
    plain_local = override("compose.local.yml")["services"]["parameter_server"]
    for name in ("parameter_server", "parameter_server_1"):
        server = local["services"][name]
        assert server["build"]["args"] == plain_local["build"]["args"], name
        assert server["image"] == plain_local["image"], name
        assert sorted(server["volumes"]) == sorted(plain_local["volumes"]), name
        command = sharded_compose["services"]["parameter_server"]["command"]
        dataset = command.index("--dataset") + 1
        assert server["command"] == command[:dataset] + ["mnist_5k"] + command[dataset + 1 :], name


@pytest.mark.parametrize("name", sorted(SPEC_CONFIGS))
def test_spec_configs_validate(name):
    mode, workers, compressed = SPEC_CONFIGS[name]
    config = load_config(ROOT / "configs" / name)
    assert config.system.architecture == "parameter_server"
    assert (config.system.aggregation_mode, config.system.num_workers, config.system.compression_enabled) == (
        mode,
        workers,
        compressed,
    )
    assert config.training.dataset == "mnist"
