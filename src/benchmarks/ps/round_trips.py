"""One push round trip per transport and model size against its references: what our protocol step costs
beside the raw TCP echo of the same bytes plus torch's optimizer step (``limit_ratio``), the stepping echo,
the plain gRPC echo (gRPC), and the server's own work per push broken down (``server_ms``).

Our push and the echoes are timed in turns, so a slow spell of a shared machine slows all of them rather than
one. The server, its echoes and the reference step run in one spawned process.

**The per-shard row** (:func:`bench_shard_round_trip`, TCP): what one follower shard's link carries per sync step
of a sharded server, against the same references. One worker (this process), two shards (shard 0, a
:class:`~src.parameter_server.ParameterServer`, and follower shard 1, a
:class:`~src.ps.shards.follower_server.FollowerServer`, each in its own process, sync), the model :func:`shard_model_mb`
(8 tensors, 4 a shard: the follower's link carries the row's size, as one server's link does in the row of that size;
resnet18 from 20 MB, the follower about half). The worker's step (``src/worker.py``'s, identity gradients) makes its
calls one at a time, so that nothing else is on the wire while a timed one is: hold on shard 0, hold on the follower,
commit to shard 0, pull the follower (with the certificate), pull shard 0. ``shard_round_trip_ms`` is the median over
steps of the follower's two calls' times as the worker sees them, each from its request's first byte sent to its reply's
last byte in:

* the hold: the follower's slices up (``follower_bytes.hold``), decoded and checked as they arrive, held; an
  acknowledgement down (``ack``);
* the pull: the certificate up (``pull``); the follower applies the version (its optimizer step on its slices)
  and sends the slices down (``reply``).

Shard 0's calls (its own link's) are outside it. ``hold_ms`` and ``pull_ms`` are each call's own median. The
references run in the follower's process on its slices, with the same bytes: ``raw_tcp_echo_ms`` (the hold's
message up, the pull reply's down, no work), ``stepping_echo_ms`` (the same with torch's step on the follower's
slices between, from the pushed bytes) and ``optimizer_step_ms`` (that step warm). ``stepping_echo_ratio`` =
``stepping_echo_ms`` / ``shard_round_trip_ms``, ``target`` 0.85 from 4 MB (``None`` below);
``limit_ratio`` = (``raw_tcp_echo_ms`` + ``optimizer_step_ms``) / ``shard_round_trip_ms`` as in the one-server rows;
``server_ms`` the follower's own parts (:func:`~src.benchmarks.ps.common.instrument_follower`). The stepping echo
moves the same bytes in one exchange where the shard's link takes two (the protocol's hold, then the pull once
shard 0 has certified the version), and checks nothing: its ratio is the most a follower could reach.
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
from src.benchmarks.ps.common import (
    BATCH,
    instrument,
    instrument_follower,
    next_request,
    pusher,
    server_config,
    server_process,
    sized_model,
)
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
from src.benchmarks.ps.shards import SLICE_BYTES, serve_shard, shards_config
from src.transport.tcp_frames import RECEIVE_CHUNK_BYTES

SHARD_TARGET = 0.85
"""The per-shard row's target ``stepping_echo_ratio``, from :data:`SHARD_TARGET_FROM_MB` up."""
SHARD_TARGET_FROM_MB = 4


def _start_echoes(model, reply_size: list[int], *, whole_reads: bool) -> dict[str, int]:
    """Threads of this (server) process: the raw TCP echo (32 KB reads; ``whole_reads``: also the echo as first
    measured) and the stepping echo of ``model``'s parameters, each answering ``reply_size[0]`` bytes once it is
    set; their ports (``raw_port``, ``whole_reads_port``, ``stepping_port``)."""
    ports = {}
    echoes = (("raw_port", RECEIVE_CHUNK_BYTES), ("whole_reads_port", WHOLE_READS))
    for name, chunk in echoes if whole_reads else echoes[:1]:
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=raw_tcp_echo, args=(listener, reply_size, chunk), daemon=True).start()
        ports[name] = listener.getsockname()[1]
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=stepping_tcp_echo, args=(listener, model, reply_size), daemon=True).start()
    ports["stepping_port"] = listener.getsockname()[1]
    return ports


def _serve(transport: str, size_mb: float, token: str, report, stop) -> None:
    """Child process: a parameter server for the model of ``size_mb`` over ``transport``, the raw TCP echo
    and (gRPC) the gRPC echo; reports the reference optimizer step and, at the end, the server's timings."""
    import torch

    from src.common.memory import reuse_freed_memory
    from src.parameter_server import ParameterServer

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
        reply_size = [0]
        raw_ports = _start_echoes(model, reply_size, whole_reads=True)
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
    """Median seconds of each of ``calls``, timed in turns (one of each per repeat); a call that returns a float
    is timed by it (the seconds of its own part that count: the per-shard row's step)."""
    for call in calls:
        call()  # warm-up: connection, first allocation of big buffers
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, into in zip(calls, times):
            started = time.perf_counter()
            own = call()
            into.append(own if isinstance(own, float) else time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def _server_ms(timings: dict[str, list[float]], repeats: int) -> dict[str, float]:
    """Median ms of each timed part of the server's, over the last ``repeats`` calls (the timed ones)."""
    return {name: round(statistics.median(values[-repeats:]) * 1e3, 3) for name, values in timings.items() if values}


def _round_trip_entry(
    transport: str, size_mb: float, repeats: int, measured: dict[str, Any], medians: list[float]
) -> dict:
    """The figures of one transport and size: our round trip, the echoes, the limit ratios, the server's parts."""
    framing, reply_bytes = measured["framing"], measured["reply_bytes"]
    ps_ms, raw_ms, stepping_ms = medians[0] * 1e3, medians[1] * 1e3, medians[3] * 1e3
    step_ms = measured["ports"]["step_ms"]
    server_ms = _server_ms(measured["timings"], repeats)
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


# ----------------------------------------------------------------------------- one shard's link, two shards


def _serve_follower(model_mb: float, token: str, report, stop) -> None:
    """Child process: follower shard 1 of 2 (:class:`~src.ps.shards.follower_server.FollowerServer`, TCP, sync) of the
    model of ``model_mb``, the raw TCP echo and the stepping echo of its slices; reports torch's step on its slices and,
    at the end, its timings (:func:`~src.benchmarks.ps.common.instrument_follower`)."""
    import torch

    from src.common.memory import reuse_freed_memory
    from src.ps.shards.follower_server import FollowerServer
    from src.ps.shards.parts import shard_module

    torch.set_num_threads(1)
    reuse_freed_memory()  # as run_server does
    with tempfile.TemporaryDirectory() as tmp:
        model = sized_model(model_mb)
        server = FollowerServer(
            shards_config(tmp, "tcp", 2, 1), shard=1, address="127.0.0.1:0", token=token, model=model
        )
        timings = instrument_follower(server.core)
        port = server.start()
        part = shard_module(model, server.placement, 1)
        reply_size = [0]
        ports = _start_echoes(part, reply_size, whole_reads=False)
        report.send({"port": port, **ports, "step_ms": optimizer_step_ms(part)})
        reply_size[0] = stop.recv()  # the pull reply's size, once the client knows it
        stop.recv()
        report.send(timings)
        server.stop(grace=0)


class _ShardStepper:
    """One worker's sync step on 2 shards over TCP (``src/worker.py``'s, with identity gradients), its calls one
    at a time: hold on shard 0, hold on the follower, commit to shard 0, pull the follower (with the certificate),
    pull shard 0. Calling it steps once and returns the seconds of the follower's two calls (hold + pull)."""

    def __init__(self, shard_0, follower, model_mb: float):
        import torch

        from src import parameter_server_pb2 as pb
        from src.compression import IDENTITY
        from src.ps.shards.parts import model_placement

        self.shard_0, self.follower = shard_0, follower
        registration = shard_0.register(0)
        self.caller = pb.Caller(worker_id=0, session=registration.session)
        placement = model_placement(sized_model(model_mb), 2, SLICE_BYTES)  # as every process of the run places it
        self.model_bytes = sum(placement.bytes_per_shard())
        self.follower_numel = sum(piece.numel for piece in placement.on_shard(1))
        self.payloads = [
            [IDENTITY.compress(torch.full((piece.numel,), 1e-6)) for piece in placement.on_shard(k)] for k in range(2)
        ]
        self.request_id = secrets.randbits(40)  # a random start, as the library's client does
        self.reply = shard_0.pull(self.caller).message  # the first work
        follower.pull(self.caller, parameters_only=True)
        self.parts: dict[str, list[float]] = {"hold": [], "pull": []}
        self.follower_bytes: dict[str, int] = {}
        """The follower's link in the last step: ``hold`` (up), ``ack`` (down), ``pull`` (up), ``reply`` (down)."""

    def _timed(self, name: str, call):
        """``call()`` to the follower: its result; its seconds go into :attr:`parts` under ``name``, its bytes into
        :attr:`follower_bytes`: up under ``name``, down under ``ack`` (the hold's) or ``reply`` (the pull's)."""
        sent, received = self.follower.bytes_sent, self.follower.bytes_received
        started = time.perf_counter()
        result = call()
        self.parts[name].append(time.perf_counter() - started)
        self.follower_bytes[name] = self.follower.bytes_sent - sent
        self.follower_bytes["ack" if name == "hold" else "reply"] = self.follower.bytes_received - received
        return result

    def __call__(self) -> float:
        from src.ps.worker.machine import commit, holds

        self.request_id += 1
        version = self.reply.version
        request = next_request(self.caller, self.reply, self.request_id)
        held = holds(request, [version, version])
        ack_0 = self.shard_0.push(held[0], self.payloads[0]).message
        ack = self._timed("hold", lambda: self.follower.push(held[1], self.payloads[1]).message)
        reply = self.shard_0.push(commit(request, [ack_0, ack], version, "sync")).message
        if not reply.accepted:
            raise RuntimeError(f"shard 0 refused the commit of request {request.request_id}: {reply.reason}")
        pulled = self._timed(
            "pull", lambda: self.follower.pull(self.caller, certificate=reply.certificate, parameters_only=True)
        )
        self.shard_0.pull(self.caller, parameters_only=True)
        if pulled.message.version != reply.version:
            raise RuntimeError(f"the follower answered at version {pulled.message.version}, shard 0 at {reply.version}")
        self.reply = reply
        return self.parts["hold"][-1] + self.parts["pull"][-1]


def shard_target(size_mb: float) -> float | None:
    """The per-shard row's target ``stepping_echo_ratio`` at ``size_mb`` (``None``: none at that size)."""
    return SHARD_TARGET if size_mb >= SHARD_TARGET_FROM_MB else None


def shard_model_mb(size_mb: float) -> float:
    """The model of the per-shard row at ``size_mb``: 8 tensors of ``2 * size_mb`` (4 a shard: the follower's link
    carries ``size_mb``, as one server's at that size) below 20 MB; resnet18 from there (the follower about half)."""
    return size_mb if size_mb >= 40 else 2 * size_mb


def bench_shard_round_trip(size_mb: float, repeats: int) -> dict:
    """The per-shard row at ``size_mb`` over TCP: one sync worker, 2 shards; the follower's hold + pull against the
    raw TCP echo and the stepping echo of the same bytes (see the module docstring), timed in turns."""
    from src.transport.clients import make_client
    from src.transport.tcp_frames import HEADER_BYTES

    token = secrets.token_urlsafe(16)
    model_mb = shard_model_mb(size_mb)
    with (
        server_process(serve_shard, "tcp", 2, True, 0, 1, token, model_mb) as (shard_report, shard_control),
        server_process(_serve_follower, model_mb, token) as (report, stop),
    ):
        shard_port, ports = shard_report.recv(), report.recv()
        shard_0 = make_client(f"127.0.0.1:{shard_port}", transport="tcp", token=token)
        follower = make_client(f"127.0.0.1:{ports['port']}", transport="tcp", token=token)
        step = _ShardStepper(shard_0, follower, model_mb)
        step()
        carried = dict(step.follower_bytes)
        push_bytes, reply_bytes = carried["hold"] - HEADER_BYTES, carried["reply"] - HEADER_BYTES
        stop.send(reply_bytes)  # the echoes move the hold's message up and the pull reply's down
        raw, raw_exchange = raw_echo(
            ports["raw_port"], secrets.token_bytes(push_bytes), reply_bytes, RECEIVE_CHUNK_BYTES
        )
        stepping, stepping_exchange = raw_echo(
            ports["stepping_port"], gradient_payload(push_bytes, step.follower_numel), reply_bytes, RECEIVE_CHUNK_BYTES
        )
        medians = _median_times([step, raw_exchange, stepping_exchange], repeats)
        for connection in (shard_0, follower, raw, stepping):
            connection.close()
        stop.send(None)
        timings = report.recv()
        shard_control.send(None)
    round_trip_ms, raw_ms, stepping_ms = (m * 1e3 for m in medians)
    step_ms = ports["step_ms"]
    entry = {
        "transport": "tcp",
        "model_mb": round(step.model_bytes / 2**20, 2),
        "shard_mb": round(step.follower_numel * 4 / 2**20, 2),
        "follower_bytes": carried,
        "shard_round_trip_ms": round(round_trip_ms, 3),
        "hold_ms": round(statistics.median(step.parts["hold"][-repeats:]) * 1e3, 3),
        "pull_ms": round(statistics.median(step.parts["pull"][-repeats:]) * 1e3, 3),
        "raw_tcp_echo_ms": round(raw_ms, 3),
        "optimizer_step_ms": round(step_ms, 3),
        "limit_ratio": round((raw_ms + step_ms) / round_trip_ms, 3),
        "stepping_echo_ms": round(stepping_ms, 3),
        "stepping_echo_ratio": round(stepping_ms / round_trip_ms, 3),
        "target": shard_target(size_mb),
        "server_ms": _server_ms(timings, repeats),
    }
    log(
        f"per-shard round trip tcp {entry['shard_mb']} MB of {entry['model_mb']}: {entry['shard_round_trip_ms']} ms "
        f"(hold {entry['hold_ms']}, pull {entry['pull_ms']}), stepping echo {entry['stepping_echo_ms']} ms, "
        f"ratio {entry['stepping_echo_ratio']}"
    )
    return entry
