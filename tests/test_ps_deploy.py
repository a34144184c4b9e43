"""Deployment files of the parameter server: docker-compose.yml, the Dockerfile, the entrypoint, the PS configs.

There is no Docker engine on CI, so the compose file is checked for the structure the spec asks for;
the multi-host test (test_ps_multihost.py) runs the same entrypoint for real.
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


def test_compose_services_network_and_volumes(compose):
    services = compose["services"]
    assert set(services) == {"parameter_server", "worker_0", "worker_1"}
    assert "training_net" in compose["networks"]
    for name, service in services.items():
        assert service["networks"] == ["training_net"], name
        assert {"./checkpoints:/app/checkpoints", "./logs:/app/logs"} <= set(service["volumes"]), name
        assert service["build"] == {"context": ".", "dockerfile": "docker/Dockerfile"}, name
        assert "DTS_AUTH_TOKEN" in service["environment"], name
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
        assert worker["depends_on"] == ["parameter_server"]


def test_dockerfile_runs_the_entrypoint_with_the_code():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["bash", "docker/entrypoint.sh"]' in dockerfile
    for copied in ("COPY src/ src/", "COPY run_*.py ./", "COPY docker/entrypoint.sh docker/entrypoint.sh", "requirements.txt"):
        assert copied in dockerfile
    assert "EXPOSE 50051" in dockerfile


@pytest.mark.parametrize("environment, message", [
    ({}, "DTS_ROLE must be 'server' or 'worker', got ''"),
    ({"DTS_ROLE": "coordinator"}, "DTS_ROLE must be 'server' or 'worker', got 'coordinator'"),
    ({"DTS_ROLE": "worker"}, "DTS_WORKER_ID must be set for DTS_ROLE=worker"),
])
def test_entrypoint_refuses_a_missing_role(environment, message):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTS_")} | environment
    result = subprocess.run(["bash", str(ROOT / "docker" / "entrypoint.sh")], env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert message in result.stderr


@pytest.mark.parametrize("name", sorted(SPEC_CONFIGS))
def test_spec_configs_validate(name):
    mode, workers, compressed = SPEC_CONFIGS[name]
    config = load_config(ROOT / "configs" / name)
    assert config.system.architecture == "parameter_server"
    assert (config.system.aggregation_mode, config.system.num_workers, config.system.compression_enabled) == (mode, workers, compressed)
    assert config.training.dataset == "mnist"
