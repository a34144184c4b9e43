"""The standard gRPC health service on the parameter server, and the probe docker-compose.yml runs."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from src.transport.errors import CallError
from src.transport.grpc import SERVICE_NAME
from src.transport.healthcheck import check, probe_address
from tests.ps_fixtures import ROOT, ServedServer, make_self_signed_cert, ps_config

pytestmark = pytest.mark.timeout(120)


def probe(*args: str) -> subprocess.CompletedProcess:
    """``python -m src.transport.healthcheck ARGS`` as the container's healthcheck runs it (no token in its
    environment)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "src.transport.healthcheck", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_server_is_serving_to_a_probe_without_the_token_and_not_after_it_stops(tmp_path):
    served = ServedServer(ps_config(tmp_path), evaluate=False)
    try:
        assert check(served.address) == "SERVING" and check(served.address, service=SERVICE_NAME) == "SERVING"
        with grpc.insecure_channel(served.address) as channel, pytest.raises(grpc.RpcError) as unknown:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with served.client(token=None) as client, pytest.raises(CallError) as refused:
            client.status()  # the training service itself still wants the token
        assert refused.value.code == "UNAUTHENTICATED"
        healthy = probe("--address", served.address)
        assert (healthy.returncode, healthy.stdout.strip()) == (0, f"{served.address}: SERVING"), healthy.stderr
    finally:
        served.close()
    gone = probe("--address", served.address, "--timeout", "2")
    assert gone.returncode == 1 and gone.stderr.startswith(f"unhealthy: {served.address}: UNAVAILABLE"), gone.stderr


def test_the_probe_verifies_a_tls_server_and_finds_a_wildcard_bind_on_the_loopback(tmp_path):
    cert, key = make_self_signed_cert(tmp_path)  # valid for 127.0.0.1 and localhost
    config = ps_config(
        tmp_path, system__tls_cert_file=str(cert), system__tls_key_file=str(key), system__server_address="0.0.0.0:0"
    )
    served = ServedServer(config, evaluate=False)
    try:
        wildcard = f"0.0.0.0:{served.port}"
        assert probe_address(wildcard) == f"127.0.0.1:{served.port}"
        verified = probe("--address", wildcard, "--tls-ca", str(cert))
        assert verified.returncode == 0 and verified.stdout.strip().endswith(": SERVING"), verified.stderr
        plaintext = probe("--address", wildcard, "--timeout", "3")
        assert plaintext.returncode == 1 and plaintext.stderr.startswith("unhealthy:"), plaintext.stderr
    finally:
        served.close()
    assert (
        probe_address("[::]:50051") == "127.0.0.1:50051"
        and probe_address("parameter_server:50051") == "parameter_server:50051"
    )
