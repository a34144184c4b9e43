"""Health probe of a parameter server: the standard gRPC health check, exit 0 when it is SERVING.

    python -m src.transport.healthcheck                                  # $DTS_SERVER_ADDRESS or 127.0.0.1:50051
    python -m src.transport.healthcheck --address 10.0.0.5:50051
    python -m src.transport.healthcheck --tls-ca certs/server.crt --server-name parameter_server
    python -m src.transport.healthcheck --transport tcp    # a server with system.transport tcp ($DTS_TRANSPORT)

Over the TCP transport (:mod:`src.transport.tcp_frames`) the probe is one HEALTH frame, answered without the
token with ``SERVING`` as well.

docker-compose.yml runs it as the server container's healthcheck, and the workers start once it
passes (``depends_on: condition: service_healthy``). The health service answers without the run's
auth token (:mod:`src.transport.grpc`), so the probe needs none. It imports gRPC only (no torch): a
probe every few seconds costs a fraction of a second. Any standard client works too (``grpcurl
-plaintext HOST:PORT grpc.health.v1.Health/Check``, Kubernetes' ``grpc`` probes).

A wildcard bind address (``0.0.0.0:50051``, what the server container binds) is probed on the
loopback. TLS: ``--tls-ca`` (default ``$DTS_TLS_CA``, else the server's own ``$DTS_TLS_CERT``) is the
certificate to verify the server against, ``--server-name`` the name its certificate is valid for.

Exit status: 0 SERVING; 1 anything else (not reachable, NOT_SERVING, unknown service), with one line
saying what.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from src.transport.errors import CallError

DEFAULT_ADDRESS = "127.0.0.1:50051"


def probe_address(address: str) -> str:
    """Where to probe a server bound to ``address``: wildcard hosts become the loopback."""
    host, _, port = address.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"{host}:{port}"


def check(
    address: str,
    *,
    service: str = "",
    timeout_s: float = 5.0,
    tls_ca: str | None = None,
    server_name: str | None = None,
) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``...) of ``service`` at ``address``.

    Raises:
        CallError: the server did not answer (not up, wrong TLS, unknown service: ``NOT_FOUND``).
    """
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    if tls_ca:
        with open(tls_ca, "rb") as handle:
            channel = grpc.secure_channel(
                address, grpc.ssl_channel_credentials(root_certificates=handle.read()), options
            )
    else:
        channel = grpc.insecure_channel(address, options)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            raise CallError(exc.code().name, exc.details()) from exc
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def check_tcp(
    address: str, *, timeout_s: float = 5.0, tls_ca: str | None = None, server_name: str | None = None
) -> str:
    """``SERVING`` from a TCP-transport server at ``address`` (see :func:`src.transport.tcp_frames.health_check`).

    Raises:
        CallError: the server did not answer.
    """
    import ssl

    from src.transport.tcp_frames import health_check

    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=tls_ca) if tls_ca else None
    return health_check(host.strip("[]"), int(port), timeout_s=timeout_s, context=context, server_name=server_name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m src.transport.healthcheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("DTS_SERVER_ADDRESS", DEFAULT_ADDRESS),
        help="host:port of the server (default $DTS_SERVER_ADDRESS, else 127.0.0.1:50051)",
    )
    parser.add_argument("--service", default="", help="service name to ask about (default '': the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer (default 5)")
    parser.add_argument(
        "--tls-ca",
        default=os.environ.get("DTS_TLS_CA") or os.environ.get("DTS_TLS_CERT") or None,
        help="PEM to verify the server's certificate against (default $DTS_TLS_CA, else $DTS_TLS_CERT); "
        "without one the probe speaks plaintext",
    )
    parser.add_argument("--server-name", help="the name the server's certificate is valid for (TLS)")
    parser.add_argument(
        "--transport",
        choices=("grpc", "tcp"),
        default=os.environ.get("DTS_TRANSPORT") or "grpc",
        help="the server's system.transport (default $DTS_TRANSPORT, else grpc)",
    )
    args = parser.parse_args(argv)
    address = probe_address(args.address)
    try:
        if args.transport == "tcp":
            status = check_tcp(address, timeout_s=args.timeout, tls_ca=args.tls_ca, server_name=args.server_name)
        else:
            status = check(
                address, service=args.service, timeout_s=args.timeout, tls_ca=args.tls_ca, server_name=args.server_name
            )
    except CallError as exc:
        print(f"unhealthy: {address}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"unhealthy: cannot read --tls-ca {args.tls_ca}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
