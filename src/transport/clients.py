"""Choosing a transport: ``system.transport`` (or an address that names it) -> the client of that transport.

The gRPC client (:mod:`src.transport.grpc`) and the TCP one (:mod:`src.transport.tcp`, built on the
former's protocol calls) sit below this module, so neither needs to import the other's chooser.
"""

from __future__ import annotations

from typing import Any

from src.config import SetupError
from src.transport.grpc import ParameterServerClient
from src.transport.tcp import TCPParameterServerClient

TRANSPORTS = ("grpc", "tcp")


def make_client(address: str, *, transport: str = "grpc", **kwargs: Any):
    """A client of the parameter server at ``address`` over ``transport`` (``system.transport``).

    Both clients have the same calls, byte counters, uplink emulation and retries, and fail with a
    :class:`~src.transport.errors.CallError` carrying the same status codes
    (:class:`~src.transport.grpc.ParameterServerClient` for gRPC, :class:`src.transport.tcp.TCPParameterServerClient`
    for TCP). ``kwargs``: as the clients take (``token``, ``system``, ``connect_timeout_s``, ``retries``, ``uplink``).

    Raises:
        SetupError: an unknown transport.
    """
    if transport == "tcp":
        return TCPParameterServerClient(address, **kwargs)
    if transport == "grpc":
        return ParameterServerClient(address, **kwargs)
    raise SetupError(f"system.transport: must be one of {', '.join(TRANSPORTS)}, got {transport!r}")


def transport_of(address: str, transport: str | None) -> tuple[str, str]:
    """``(host:port, transport)`` of an address that may name its transport (``tcp://host:port``,
    ``grpc://host:port``); a plain ``host:port`` uses ``transport`` (default gRPC).

    Raises:
        SetupError: an unknown scheme, or a scheme and a ``transport`` that disagree.
    """
    scheme, separator, rest = address.partition("://")
    if not separator:
        return address, transport or "grpc"
    if scheme not in TRANSPORTS:
        raise SetupError(
            f"address {address!r}: unknown transport {scheme!r} (use {' or '.join(f'{t}://' for t in TRANSPORTS)})"
        )
    if transport is not None and transport != scheme:
        raise SetupError(f"address {address!r} names transport {scheme!r}, but transport={transport!r}")
    return rest, scheme
