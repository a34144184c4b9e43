"""One push round trip per transport and model size against its references: what our protocol step costs
beside the raw TCP echo of the same bytes plus torch's optimizer step (``limit_ratio``), the stepping echo,
the plain gRPC echo (gRPC), and the server's own work per push broken down (``server_ms``).

Our push and the echoes are timed in turns, so a slow spell of a shared machine slows all of them rather than
one. The server, its echoes and the reference step run in one spawned process.
"""

from __future__ import annotations

import math
import secrets
import socket
import statistics
import tempfile
import threading
import time
from typing import Any

from src.benchmarks.common import log
from src.benchmarks.ps.common import BATCH, instrument, pusher, server_config, server_process, sized_model
from src.benchmarks.ps.references import (
    WHOLE_READS,
    gradient_payload,
    grpc_echo,
    grpc_exchange,
    optimizer_step_ms,
    raw_echo,
    raw_tcp_echo,
    stepping_tcp_echo,
)
from src.transport.tcp_frames import RECEIVE_CHUNK_BYTES


def _serve(transport: str, size_mb: float, token: str, report, stop) -> None:
    """Child process: a parameter server for the model of ``size_mb`` over ``transport``, the raw TCP echo
    and (gRPC) the gRPC echo; reports the reference optimizer step and, at the end, the server's timings."""
    import torch

    from src.parameter_server import ParameterServer
    from src.transport.grpc import reuse_freed_memory

    torch.set_num_threads(1)
    reuse_freed_memory()  # as run_server does
    with tempfile.TemporaryDirectory() as tmp:
        model = sized_model(size_mb)
        step_ms = optimizer_step_ms(model)
        server = ParameterServer(
            server_config(tmp, transport),
            token=token,
            model=model,
            evaluate=False,
            tensorboard=False,
            num_train_samples=BATCH * 1000,
        )  # 1000 batches per epoch, 1000 epochs: work for every push
        timings = instrument(server.core)
        port = server.start()
        reply_size, raw_ports = [0], {}
        for name, chunk in (("raw_port", RECEIVE_CHUNK_BYTES), ("whole_reads_port", WHOLE_READS)):
            listener = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=raw_tcp_echo, args=(listener, reply_size, chunk), daemon=True).start()
            raw_ports[name] = listener.getsockname()[1]
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=stepping_tcp_echo, args=(listener, model, reply_size), daemon=True).start()
        raw_ports["stepping_port"] = listener.getsockname()[1]
        state = {"reply": b""}
        echo, echo_port = grpc_echo(state) if transport == "grpc" else (None, None)
        report.send({"port": port, **raw_ports, "grpc_port": echo_port, "step_ms": step_ms})
        reply_size[0] = stop.recv()  # the reply size, once the client knows it
        stop.recv()
        report.send(timings)
        if echo is not None:
            echo.stop(0)
        server.stop(grace=0)


def _median_times(calls, repeats: int) -> list[float]:
    """Median seconds of each of ``calls``, timed in turns (one of each per repeat)."""
    for call in calls:
        call()  # warm-up: connection, first allocation of big buffers
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, into in zip(calls, times):
            started = time.perf_counter()
            call()
            into.append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def _round_trip_entry(
    transport: str, size_mb: float, repeats: int, measured: dict[str, Any], medians: list[float]
) -> dict:
    """The figures of one transport and size: our round trip, the echoes, the limit ratios, the server's parts."""
    framing, reply_bytes = measured["framing"], measured["reply_bytes"]
    ps_ms, raw_ms, stepping_ms = medians[0] * 1e3, medians[1] * 1e3, medians[3] * 1e3
    step_ms = measured["ports"]["step_ms"]
    server_ms = {
        name: round(statistics.median(values[-repeats:]) * 1e3, 3)
        for name, values in measured["timings"].items()
        if values
    }
    entry = {
        "transport": transport,
        "model_mb": round((reply_bytes - framing) / 2**20, 2),
        "push_bytes": measured["push_bytes"],
        "reply_bytes": reply_bytes,
        "ps_round_trip_ms": round(ps_ms, 3),
        "raw_tcp_echo_ms": round(raw_ms, 3),
        "raw_tcp_echo_whole_reads_ms": round(medians[2] * 1e3, 3),
        "optimizer_step_ms": round(step_ms, 3),
        "limit_ratio": round((raw_ms + step_ms) / ps_ms, 3),
        "stepping_echo_ms": round(stepping_ms, 3),
        "stepping_echo_ratio": round(stepping_ms / ps_ms, 3),
        "stepping_echo_limit_ratio": round((raw_ms + step_ms) / stepping_ms, 3),
        "server_ms": server_ms,
    }
    if transport == "tcp":
        entry["target_limit_ratio"] = 0.6 if size_mb < 2 else 0.8
    else:
        grpc_ms = medians[4] * 1e3
        entry.update(
            grpc_echo_ms=round(grpc_ms, 3),
            grpc_limit_ratio=round((grpc_ms + step_ms) / ps_ms, 3),
            target_grpc_limit_ratio=0.8,
        )
    return entry


def bench_round_trips(transport: str, size_mb: float, repeats: int) -> dict:
    """Our push round trip against a raw TCP echo (and a plain gRPC echo) of the same bytes, alternating."""
    from src.transport.clients import make_client
    from src.transport.tcp_frames import HEADER_BYTES

    token = secrets.token_urlsafe(16)
    with server_process(_serve, transport, size_mb, token) as (report, stop):
        ports = report.recv()
        client = make_client(f"127.0.0.1:{ports['port']}", transport=transport, token=token)
        registration = client.register(0)
        step = pusher(client, registration)
        numel = sum(math.prod(spec.shape) for spec in registration.parameter_specs)
        sent, received = client.bytes_sent, client.bytes_received
        step()
        push_bytes, reply_bytes = client.bytes_sent - sent, client.bytes_received - received
        framing = HEADER_BYTES if transport == "tcp" else 0
        stop.send(reply_bytes - framing)  # the echoes move the same message bytes
        payload = secrets.token_bytes(push_bytes - framing)
        raw, raw_exchange = raw_echo(ports["raw_port"], payload, reply_bytes - framing, RECEIVE_CHUNK_BYTES)
        whole, whole_exchange = raw_echo(ports["whole_reads_port"], payload, reply_bytes - framing, WHOLE_READS)
        stepping, stepping_exchange = raw_echo(
            ports["stepping_port"],
            gradient_payload(len(payload), numel),
            reply_bytes - framing,
            RECEIVE_CHUNK_BYTES,
        )
        calls = [step, raw_exchange, whole_exchange, stepping_exchange]
        channel = None
        if ports["grpc_port"] is not None:
            channel, grpc_call = grpc_exchange(ports["grpc_port"], payload, reply_bytes)
            calls.append(grpc_call)
        medians = _median_times(calls, repeats)
        client.close()
        raw.close()
        whole.close()
        stepping.close()
        if channel is not None:
            channel.close()
        stop.send(None)
        timings = report.recv()
    measured = {
        "ports": ports,
        "timings": timings,
        "push_bytes": push_bytes,
        "reply_bytes": reply_bytes,
        "framing": framing,
    }
    entry = _round_trip_entry(transport, size_mb, repeats, measured, medians)
    log(
        f"round trip {transport} {entry['model_mb']} MB: {entry['ps_round_trip_ms']} ms, "
        f"raw TCP echo {entry['raw_tcp_echo_ms']} ms, "
        f"step {entry['optimizer_step_ms']} ms, limit ratio {entry['limit_ratio']}"
    )
    return entry
