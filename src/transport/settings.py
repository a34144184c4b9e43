"""What both ends of every transport agree on before a call: the auth token, the TLS files, the address.

* **Auth.** Every call carries the run's token; the server refuses anything else before a handler runs. The token
  comes from ``system.auth_token``, else ``$DTS_AUTH_TOKEN`` (:func:`resolve_auth_token`); the local launcher makes
  a random one per run.
* **TLS.** ``system.tls_cert_file`` + ``tls_key_file`` make the server speak TLS (:func:`server_tls_files`); a client
  uses TLS when it has ``tls_ca_file`` (or, for a self-signed server, ``tls_cert_file``) to verify against
  (:func:`client_tls_roots`).
* **Addresses** are ``host:port`` (:func:`split_address`). A server's is its own: :func:`bound_socket` binds it
  without ``SO_REUSEPORT``, so a second server started for the same address stops with one line.

gRPC (:mod:`src.transport.grpc`) and binary frames on TCP (:mod:`src.transport.tcp`) read them alike.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from src.config import SetupError, SystemConfig

AUTH_TOKEN_ENV = "DTS_AUTH_TOKEN"


class AuthTokenMissing(SetupError):
    """No token was configured for a role that needs one."""


def resolve_auth_token(system: SystemConfig) -> str | None:
    """The configured token: ``system.auth_token``, else ``$DTS_AUTH_TOKEN``, else ``None``."""
    configured = system.auth_token.get_secret_value() if system.auth_token is not None else None
    return configured or os.environ.get(AUTH_TOKEN_ENV) or None


def require_auth_token(system: SystemConfig) -> str:
    """Like :func:`resolve_auth_token`, but a missing token is an error.

    Raises:
        AuthTokenMissing: neither the config nor the environment has one.
    """
    token = resolve_auth_token(system)
    if not token:
        raise AuthTokenMissing(f"no auth token: set system.auth_token in the config or ${AUTH_TOKEN_ENV}")
    return token


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; IPv6 hosts may be bracketed (``[::1]:50051``)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise SetupError(f"{what}: cannot read {path} ({exc.strerror})") from None


def server_tls_files(system: SystemConfig) -> tuple[bytes, bytes] | None:
    """The server's PEM certificate and key when ``tls_cert_file`` and ``tls_key_file`` are set, else ``None``.

    Raises:
        SetupError: only one of the two is set, or a file cannot be read.
    """
    if bool(system.tls_cert_file) != bool(system.tls_key_file):
        raise SetupError("system.tls_cert_file and system.tls_key_file: set both for TLS, or neither")
    if not system.tls_cert_file:
        return None
    return _read(system.tls_cert_file, "system.tls_cert_file"), _read(system.tls_key_file, "system.tls_key_file")


def client_tls_roots(system: SystemConfig) -> bytes | None:
    """The PEM a client verifies the server against: ``tls_ca_file``, else ``tls_cert_file``; ``None``: plaintext."""
    roots_file = system.tls_ca_file or system.tls_cert_file
    return _read(roots_file, "system.tls_ca_file") if roots_file else None


__all__ = [
    "AUTH_TOKEN_ENV",
    "AuthTokenMissing",
    "client_tls_roots",
    "require_auth_token",
    "resolve_auth_token",
    "server_tls_files",
    "split_address",
]


def bound_socket(address: str) -> socket.socket:
    """A TCP socket bound to a server's ``address`` (``host:port``; port 0: a free one), not yet listening.

    ``SO_REUSEADDR`` lets a restarted server take its port back from the connections its predecessor left in
    ``TIME_WAIT``; there is no ``SO_REUSEPORT``, so a port another live process listens on cannot be bound.

    Raises:
        SetupError: the address cannot be bound (the system's reason: in use, not a local address).
    """
    host, port = split_address(address)
    try:
        family, kind, proto, _, bound = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        bound_to = socket.socket(family, kind, proto)
    except OSError as exc:
        raise SetupError(f"system.server_address: cannot bind {address} ({exc.strerror or exc})") from None
    try:
        bound_to.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        bound_to.bind(bound)
    except OSError as exc:
        bound_to.close()
        raise SetupError(f"system.server_address: cannot bind {address} ({exc.strerror or exc})") from None
    return bound_to
