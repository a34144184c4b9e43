"""The references a push round trip is measured against, both ends of each: the raw TCP echo (what the wire
costs; also with whole-message reads, the anchor as first measured), the stepping echo (the least a server that
steps costs here), the plain gRPC bytes echo, and torch's own optimizer step (the work a server must do).

The server ends run as threads (and a gRPC server) inside the round trips' server process; the client ends
return (their connection, one exchange) for the round trips to time in turns with our push.
"""

from __future__ import annotations

import os
import secrets
import socket
import statistics
import struct
import time
from concurrent import futures

from src.transport.tcp_frames import RECEIVE_CHUNK_BYTES

ECHO_SERVICE = "bench.Echo"
LENGTH = struct.Struct("<Q")
WHOLE_READS = 1 << 62
"""The echo as first measured: each read asks for all that is left of the message."""


def fill(sock: socket.socket, view: memoryview, chunk: int):
    """Read into all of ``view``, at most ``chunk`` bytes a read: the bytes read, or None if the peer closed."""
    filled = 0
    while filled < len(view):
        count = sock.recv_into(view[filled:], min(len(view) - filled, chunk))
        if count == 0:
            return None
        filled += count
    return filled


# ----------------------------------------------------------------------------- server ends


def raw_tcp_echo(listener: socket.socket, reply_size: list[int], chunk: int) -> None:
    """Thread: per exchange, read an 8-byte length and that many bytes into a preallocated buffer (at most
    ``chunk`` bytes a read), send back ``reply_size[0]`` bytes from a preallocated (random) buffer. No server
    work: the wire's cost."""
    from src.transport.tcp import tune_socket

    connection, _ = listener.accept()
    tune_socket(connection)
    header = bytearray(LENGTH.size)
    incoming = bytearray(1)
    outgoing = b""
    with connection:
        while True:
            if fill(connection, memoryview(header), chunk) is None:
                return
            (size,) = LENGTH.unpack(header)
            if len(incoming) < size:
                incoming = bytearray(size)
            if fill(connection, memoryview(incoming)[:size], chunk) is None:
                return
            if len(outgoing) != reply_size[0]:
                outgoing = os.urandom(reply_size[0])  # random: a zero buffer would read the kernel's zero page
            connection.sendall(outgoing)


def stepping_tcp_echo(listener: socket.socket, model, reply_size: list[int]) -> None:
    """Thread: the least a push can cost a server that steps here. Per exchange, read the message into a
    preallocated buffer (at most 32 KB a read, as the raw echo), take its first bytes as float32 gradients
    of ``model``'s parameter shapes (views of the buffer, no copy), run torch's fused SGD-momentum step on
    a copy of the parameters with them and send the parameters back from their own memory (one gather
    write, padded to ``reply_size[0]``). No check, no protocol, no bookkeeping: the echo plus the step,
    with the step on tensors the transfers have just gone past, as a server's step is."""
    import torch

    from src.transport.tcp import tune_socket
    from src.transport.tcp_frames import send_frame
    from src.transport.wire import tensor_view

    params = [torch.nn.Parameter(param.detach().clone()) for param in model.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    replies = [tensor_view(param.data) for param in params]
    connection, _ = listener.accept()
    tune_socket(connection)
    header = bytearray(LENGTH.size)
    incoming = bytearray(0)
    with connection:
        while True:
            if fill(connection, memoryview(header), RECEIVE_CHUNK_BYTES) is None:
                return
            (size,) = LENGTH.unpack(header)
            if len(incoming) != size:
                incoming = bytearray(size)
                offset = 0
                for param in params:
                    param.grad = torch.frombuffer(
                        incoming, dtype=torch.float32, count=param.numel(), offset=offset
                    ).view_as(param)
                    offset += param.numel() * 4
            if fill(connection, memoryview(incoming), RECEIVE_CHUNK_BYTES) is None:
                return
            optimizer.step()
            padding = bytes(reply_size[0] - sum(reply.nbytes for reply in replies))
            send_frame(connection, b"", [*replies, padding])


def grpc_echo(state: dict):
    """A plain gRPC bytes echo (no protobuf, no server work) answering with ``state["reply"]``, whose size
    a first call sets: (the started server, its port)."""
    import grpc

    from src.transport.grpc import CLIENT_MAX_MESSAGE_BYTES, message_options

    def size(request: bytes, context) -> bytes:
        state["reply"] = os.urandom(int(request))
        return b""

    echo = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=message_options(CLIENT_MAX_MESSAGE_BYTES))
    echo.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                ECHO_SERVICE,
                {
                    "Size": grpc.unary_unary_rpc_method_handler(size),
                    "Exchange": grpc.unary_unary_rpc_method_handler(
                        lambda request, context: state["reply"]
                    ),  # bytes in, bytes out
                },
            )
        ]
    )
    port = echo.add_insecure_port("127.0.0.1:0")
    echo.start()
    return echo, port


def optimizer_step_ms(model) -> float:
    """Median ms of torch's fused SGD-momentum step on tensors of ``model``'s parameter shapes (the reference)."""
    import torch

    params = [torch.nn.Parameter(torch.zeros_like(p)) for p in model.parameters()]
    for param in params:
        param.grad = torch.full_like(param, 1e-6)
    optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)
    times = []
    for _ in range(25):
        started = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[5:]) * 1e3


# ----------------------------------------------------------------------------- client ends


def raw_echo(port: int, payload: bytes, reply_size: int, chunk: int):
    """A raw TCP echo of ``payload`` answered with ``reply_size`` bytes, both ends reading at most ``chunk``
    bytes a read: (its socket, one exchange)."""
    from src.transport.tcp import tune_socket

    raw = socket.create_connection(("127.0.0.1", port))
    tune_socket(raw)
    length = LENGTH.pack(len(payload))
    incoming = bytearray(reply_size)

    def exchange() -> None:
        raw.sendmsg([length, payload])
        fill(raw, memoryview(incoming), chunk)

    return raw, exchange


def gradient_payload(size: int, numel: int) -> bytes:
    """``size`` bytes for the stepping echo: ``numel`` float32 gradient values (1e-6: finite, not
    subnormal, as a real gradient's), then random bytes."""
    import numpy as np

    values = np.full(numel, 1e-6, dtype="<f4").tobytes()
    return values + secrets.token_bytes(size - len(values))


def grpc_exchange(port: int, payload: bytes, reply_bytes: int):
    """A plain gRPC echo service's exchange of ``payload`` for ``reply_bytes``: (its channel, one call)."""
    import grpc

    from src.transport.grpc import CLIENT_MAX_MESSAGE_BYTES, message_options

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=message_options(CLIENT_MAX_MESSAGE_BYTES))
    channel.unary_unary(f"/{ECHO_SERVICE}/Size")(str(reply_bytes).encode())
    exchange = channel.unary_unary(f"/{ECHO_SERVICE}/Exchange")
    return channel, lambda: exchange(payload)
