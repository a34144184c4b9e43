"""The parameter server at the wire's limit, per transport: a push round trip against raw TCP and gRPC
echoes of the same bytes plus the optimizer step, one server's ceiling in pushes/s, and training
samples/s against DDP. ``scripts/bench_ps.py`` runs it; its ``--help`` says what each figure means.

Servers, clients and training runs are spawned processes (gRPC does not survive fork).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import secrets
import socket
import statistics
import struct
import tempfile
import threading
import time
from concurrent import futures
from typing import Any

from src.benchmarks.common import log
from src.transport.tcp_frames import RECEIVE_CHUNK_BYTES

ECHO_SERVICE = "bench.Echo"
NUM_TENSORS = 8
BATCH = 64
CEILING_MB = 4
_LENGTH = struct.Struct("<Q")
WHOLE_READS = 1 << 62
"""The echo as first measured: each read asks for all that is left of the message."""


def _model(size_mb: float):
    """``resnet18`` for >= 40 MB (the real layout), else 8 equal float32 tensors of ``size_mb`` in all."""
    import torch
    from torch import nn

    from src.training.data import dataset_info
    from src.training.models import build_model

    if size_mb >= 40:
        return build_model("resnet18", dataset_info("cifar10"))
    numel = int(size_mb * 2**20 / 4 / NUM_TENSORS)
    model = nn.Module()
    for index in range(NUM_TENSORS):
        model.register_parameter(f"tensor_{index}", nn.Parameter(torch.zeros(numel)))
    return model


def _config(tmp: str, transport: str, num_workers: int = 1):
    from src.config import load_config

    return load_config(
        overrides={
            "system.num_workers": num_workers,
            "system.aggregation_mode": "async",
            "system.async_correction": "none",
            "system.transport": transport,
            "training.checkpoint_interval": 10**9,
            "training.batch_size": BATCH,
            "training.num_epochs": 1000,
            "system.log_dir": f"{tmp}/logs",
            "system.checkpoint_dir": f"{tmp}/ckpt",
        }
    )


# ----------------------------------------------------------------------------- echo servers (the references)


def _raw_tcp_echo(listener: socket.socket, reply_size: list[int], chunk: int) -> None:
    """Thread: per exchange, read an 8-byte length and that many bytes into a preallocated buffer (at most
    ``chunk`` bytes a read), send back ``reply_size[0]`` bytes from a preallocated (random) buffer. No server
    work: the wire's cost."""
    from src.transport.tcp import tune_socket

    connection, _ = listener.accept()
    tune_socket(connection)
    header = bytearray(_LENGTH.size)
    incoming = bytearray(1)
    outgoing = b""
    with connection:
        while True:
            if _fill(connection, memoryview(header), chunk) is None:
                return
            (size,) = _LENGTH.unpack(header)
            if len(incoming) < size:
                incoming = bytearray(size)
            if _fill(connection, memoryview(incoming)[:size], chunk) is None:
                return
            if len(outgoing) != reply_size[0]:
                outgoing = os.urandom(reply_size[0])  # random: a zero buffer would read the kernel's zero page
            connection.sendall(outgoing)


def _stepping_tcp_echo(listener: socket.socket, model, reply_size: list[int]) -> None:
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
    header = bytearray(_LENGTH.size)
    incoming = bytearray(0)
    with connection:
        while True:
            if _fill(connection, memoryview(header), RECEIVE_CHUNK_BYTES) is None:
                return
            (size,) = _LENGTH.unpack(header)
            if len(incoming) != size:
                incoming = bytearray(size)
                offset = 0
                for param in params:
                    param.grad = torch.frombuffer(
                        incoming, dtype=torch.float32, count=param.numel(), offset=offset
                    ).view_as(param)
                    offset += param.numel() * 4
            if _fill(connection, memoryview(incoming), RECEIVE_CHUNK_BYTES) is None:
                return
            optimizer.step()
            padding = bytes(reply_size[0] - sum(reply.nbytes for reply in replies))
            send_frame(connection, b"", [*replies, padding])


def _fill(sock: socket.socket, view: memoryview, chunk: int):
    filled = 0
    while filled < len(view):
        count = sock.recv_into(view[filled:], min(len(view) - filled, chunk))
        if count == 0:
            return None
        filled += count
    return filled


def _grpc_echo(state: dict):
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


# ----------------------------------------------------------------------------- the server's process


def _serve(transport: str, size_mb: float, token: str, report, stop) -> None:
    """Child process: a parameter server for the model of ``size_mb`` over ``transport``, the raw TCP echo
    and (gRPC) the gRPC echo; reports the reference optimizer step and, at the end, the server's timings."""
    import torch

    from src.parameter_server import ParameterServer
    from src.transport.grpc import reuse_freed_memory

    torch.set_num_threads(1)
    reuse_freed_memory()  # as run_server does
    with tempfile.TemporaryDirectory() as tmp:
        model = _model(size_mb)
        step_ms = _optimizer_step_ms(model)
        server = ParameterServer(
            _config(tmp, transport),
            token=token,
            model=model,
            evaluate=False,
            tensorboard=False,
            num_train_samples=BATCH * 1000,
        )  # 1000 batches per epoch, 1000 epochs: work for every push
        timings = _instrument(server.core)
        port = server.start()
        reply_size, raw_ports = [0], {}
        for name, chunk in (("raw_port", RECEIVE_CHUNK_BYTES), ("whole_reads_port", WHOLE_READS)):
            listener = socket.create_server(("127.0.0.1", 0))
            threading.Thread(target=_raw_tcp_echo, args=(listener, reply_size, chunk), daemon=True).start()
            raw_ports[name] = listener.getsockname()[1]
        listener = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=_stepping_tcp_echo, args=(listener, model, reply_size), daemon=True).start()
        raw_ports["stepping_port"] = listener.getsockname()[1]
        state = {"reply": b""}
        echo, echo_port = _grpc_echo(state) if transport == "grpc" else (None, None)
        report.send({"port": port, **raw_ports, "grpc_port": echo_port, "step_ms": step_ms})
        reply_size[0] = stop.recv()  # the reply size, once the client knows it
        stop.recv()
        report.send(timings)
        if echo is not None:
            echo.stop(0)
        server.stop(grace=0)


@contextlib.contextmanager
def _server_process(target, *args):
    """A spawned process running ``target(*args, report, stop)``: yields (its reports, our stop signals) and
    joins it after (killed if it has not exited within 30 s)."""
    context = multiprocessing.get_context("spawn")
    report, child_report = context.Pipe(duplex=False)
    stop_child, stop = context.Pipe(duplex=False)
    server = context.Process(target=target, args=(*args, child_report, stop_child))
    server.start()
    try:
        yield report, stop
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()


def _optimizer_step_ms(model) -> float:
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


def _instrument(core) -> dict[str, list[float]]:
    """Time the core's pieces per push: decode (of which while the push arrived: TCP), the optimizer step,
    building the reply, the locked part."""
    timings: dict[str, list[float]] = {
        "decode": [],
        "decode_while_receiving": [],
        "step": [],
        "reply": [],
        "locked": [],
    }
    early = [0.0]  # this push's gradients decoded as they arrived (src.parameter_server.push_splitter)
    layout, gradient = core.model.layout, core.model.layout.gradient

    def early_gradient(*args, **kwargs):
        started = time.perf_counter()
        try:
            return gradient(*args, **kwargs)
        finally:
            early[0] += time.perf_counter() - started

    layout.gradient = early_gradient

    def timed(owner, name: str, into: str):
        method = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                timings[into].append(time.perf_counter() - started)

        setattr(owner, name, wrapper)

    decode = core.decode

    def all_decoding(*args, **kwargs):  # the part left for handle_push, plus what was decoded on arrival
        on_arrival, started = early[0], time.perf_counter()
        try:
            return decode(*args, **kwargs)
        finally:
            timings["decode"].append(on_arrival + time.perf_counter() - started)
            timings["decode_while_receiving"].append(on_arrival)
            early[0] = 0.0

    core.decode = all_decoding
    timed(core.state, "step", "step")
    timed(core.replies, "serialize", "reply")
    apply_push, push_reply = core.apply_push, core.push_reply

    def locked_apply(*args, **kwargs):  # apply_push + push_reply run under one hold of the lock
        core._held_since = time.perf_counter()
        return apply_push(*args, **kwargs)

    def locked_reply(*args, **kwargs):
        try:
            return push_reply(*args, **kwargs)
        finally:
            timings["locked"].append(time.perf_counter() - core._held_since)

    core.apply_push, core.push_reply = locked_apply, locked_reply
    return timings


# ----------------------------------------------------------------------------- round trips


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


def _pusher(client, registration):
    """A function doing one protocol step (push identity gradients, take the reply's next work) on ``client``."""
    import torch

    from src import parameter_server_pb2 as pb
    from src.compression import IDENTITY
    from src.transport.grpc import tensor_view

    caller = pb.Caller(worker_id=registration.worker_id, session=registration.session)
    gradients = [IDENTITY.compress(torch.full(tuple(spec.shape), 1e-6)) for spec in registration.parameter_specs]
    buffers = [tensor_view(torch.zeros(tuple(spec.shape))) for spec in registration.buffer_specs]
    # a random start, as the library's client does: a new process's ids must not collide with an earlier one's
    state = {"reply": client.pull(caller).message, "request_id": secrets.randbits(40)}

    def step() -> None:
        state["request_id"] += 1
        batches = state["reply"].work.batches
        request = pb.PushRequest(
            caller=caller,
            base_version=state["reply"].version,
            request_id=state["request_id"],
            num_samples=sum(len(b.indices) for b in batches) or BATCH,
            batch_ids=[b.batch_id for b in batches],
        )
        state["reply"] = client.push(request, gradients, buffers).message

    return step


def _raw_echo(port: int, payload: bytes, reply_size: int, chunk: int):
    """A raw TCP echo of ``payload`` answered with ``reply_size`` bytes, both ends reading at most ``chunk``
    bytes a read: (its socket, one exchange)."""
    from src.transport.tcp import tune_socket

    raw = socket.create_connection(("127.0.0.1", port))
    tune_socket(raw)
    length = _LENGTH.pack(len(payload))
    incoming = bytearray(reply_size)

    def raw_echo() -> None:
        raw.sendmsg([length, payload])
        _fill(raw, memoryview(incoming), chunk)

    return raw, raw_echo


def _gradient_payload(size: int, numel: int) -> bytes:
    """``size`` bytes for the stepping echo: ``numel`` float32 gradient values (1e-6: finite, not
    subnormal, as a real gradient's), then random bytes."""
    import numpy as np

    values = np.full(numel, 1e-6, dtype="<f4").tobytes()
    return values + secrets.token_bytes(size - len(values))


def _grpc_exchange(port: int, payload: bytes, reply_bytes: int):
    """A plain gRPC echo service's exchange of ``payload`` for ``reply_bytes``: (its channel, one call)."""
    import grpc

    from src.transport.grpc import CLIENT_MAX_MESSAGE_BYTES, message_options

    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=message_options(CLIENT_MAX_MESSAGE_BYTES))
    channel.unary_unary(f"/{ECHO_SERVICE}/Size")(str(reply_bytes).encode())
    exchange = channel.unary_unary(f"/{ECHO_SERVICE}/Exchange")
    return channel, lambda: exchange(payload)


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
    with _server_process(_serve, transport, size_mb, token) as (report, stop):
        ports = report.recv()
        client = make_client(f"127.0.0.1:{ports['port']}", transport=transport, token=token)
        registration = client.register(0)
        step = _pusher(client, registration)
        numel = sum(math.prod(spec.shape) for spec in registration.parameter_specs)
        sent, received = client.bytes_sent, client.bytes_received
        step()
        push_bytes, reply_bytes = client.bytes_sent - sent, client.bytes_received - received
        framing = HEADER_BYTES if transport == "tcp" else 0
        stop.send(reply_bytes - framing)  # the echoes move the same message bytes
        payload = secrets.token_bytes(push_bytes - framing)
        raw, raw_echo = _raw_echo(ports["raw_port"], payload, reply_bytes - framing, RECEIVE_CHUNK_BYTES)
        whole, whole_echo = _raw_echo(ports["whole_reads_port"], payload, reply_bytes - framing, WHOLE_READS)
        stepping, stepping_echo = _raw_echo(
            ports["stepping_port"],
            _gradient_payload(len(payload), numel),
            reply_bytes - framing,
            RECEIVE_CHUNK_BYTES,
        )
        calls = [step, raw_echo, whole_echo, stepping_echo]
        channel = None
        if ports["grpc_port"] is not None:
            channel, grpc_echo = _grpc_exchange(ports["grpc_port"], payload, reply_bytes)
            calls.append(grpc_echo)
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


# ----------------------------------------------------------------------------- one server's ceiling


def _ceiling_server(transport: str, num_workers: int, token: str, report, stop) -> None:
    import torch

    from src.transport.grpc import reuse_freed_memory
    from torch_asgc.server import ClientLoopServer

    torch.set_num_threads(1)
    reuse_freed_memory()
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(tmp, transport, num_workers)
        server = ClientLoopServer(config, token=token, model=_model(CEILING_MB), tensorboard=False)
        timings = _instrument(server.core)
        report.send(server.start())
        stop.recv()
        report.send(timings["locked"])
        server.stop(grace=0)


def _ceiling_clients(transport: str, address: str, token: str, num_clients: int, seconds: float, report) -> None:
    """Client process: ``num_clients`` threads pushing as fast as the server answers, for ``seconds``."""
    from src.transport.clients import make_client
    from src.transport.grpc import reuse_freed_memory

    reuse_freed_memory()
    clients = [make_client(address, transport=transport, token=token) for _ in range(num_clients)]
    steps = [_pusher(client, client.register(k)) for k, client in enumerate(clients)]
    for step in steps:
        step()  # warm-up
    counts = [0] * num_clients
    started = time.perf_counter()
    until = started + seconds
    bytes_before = sum(c.bytes_sent for c in clients), sum(c.bytes_received for c in clients)

    def run(index: int) -> None:
        while time.perf_counter() < until:
            steps[index]()
            counts[index] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    sent = sum(c.bytes_sent for c in clients) - bytes_before[0]
    received = sum(c.bytes_received for c in clients) - bytes_before[1]
    for client in clients:
        client.close()
    report.send({"pushes": sum(counts), "seconds": elapsed, "bytes_in": sent, "bytes_out": received})


def bench_ceiling(transport: str, clients: list[int], seconds: float) -> dict:
    context = multiprocessing.get_context("spawn")
    token = secrets.token_urlsafe(16)
    rows = []
    with _server_process(_ceiling_server, transport, max(clients), token) as (report, stop):
        address = f"127.0.0.1:{report.recv()}"
        for count in clients:
            results, child = context.Pipe(duplex=False)
            process = context.Process(target=_ceiling_clients, args=(transport, address, token, count, seconds, child))
            process.start()
            measured = results.recv()
            process.join(60)
            rate = measured["pushes"] / measured["seconds"]
            rows.append(
                {
                    "clients": count,
                    "pushes_per_s": round(rate, 1),
                    "gb_per_s_in": round(measured["bytes_in"] / measured["seconds"] / 1e9, 3),
                    "gb_per_s_total": round(
                        (measured["bytes_in"] + measured["bytes_out"]) / measured["seconds"] / 1e9, 3
                    ),
                }
            )
            log(
                f"ceiling {transport} {count} clients: {rows[-1]['pushes_per_s']} pushes/s, "
                f"{rows[-1]['gb_per_s_total']} GB/s"
            )
        stop.send(None)
        locked = report.recv()
    best = max(row["pushes_per_s"] for row in rows)
    serial_ms = statistics.median(locked) * 1e3 if locked else None
    return {
        "transport": transport,
        "model_mb": CEILING_MB,
        "mode": "async",
        "rows": rows,
        "best_pushes_per_s": best,
        "saturated_at_clients": next(row["clients"] for row in rows if row["pushes_per_s"] >= 0.9 * best),
        "serial_ms_per_push": round(serial_ms, 3) if serial_ms else None,
        "serial_bound_pushes_per_s": round(1e3 / serial_ms, 1) if serial_ms else None,
    }


# ----------------------------------------------------------------------------- training against DDP


def bench_training(num_epochs: int, batch_size: int, transports: list[str], repeats: int) -> dict:
    """Each run ``repeats`` times, in turns (the order flips every repeat); samples/s are medians."""
    from src.common.supervisor import stdout_to_stderr
    from src.config import load_config
    from src.launch.ddp import run_local as run_ddp
    from src.launch.ps import run_local

    common = {
        "training.dataset": "mnist_5k",
        "training.num_epochs": num_epochs,
        "training.batch_size": batch_size,
        "training.checkpoint_interval": 10**6,
        # no evaluation inside either training clock: DDP pauses its clock to evaluate, the PS evaluates on a
        # thread beside its workers, which on a machine they share takes their CPU (~5% of these runs)
        "training.eval_at_epoch_ends": False,
        "system.num_workers": 2,
    }
    runs = {f"ps_sync_2_workers{'' if t == 'tcp' else '_' + t}": ("sync", t) for t in transports}
    runs["ps_async_2_workers"] = ("async", transports[-1])
    runs["ddp_2_ranks"] = ("ddp", None)
    measured: dict[str, list[dict]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():
        for repeat in range(repeats):
            for name in list(runs) if repeat % 2 == 0 else list(runs)[::-1]:
                mode, transport = runs[name]
                folders = {
                    "system.log_dir": f"{tmp}/{name}_{repeat}/logs",
                    "system.checkpoint_dir": f"{tmp}/{name}_{repeat}/ckpt",
                }
                if mode == "ddp":
                    summary = run_ddp(
                        load_config(
                            overrides={**common, **folders, "system.architecture": "ddp", "training.momentum": 0.9}
                        )
                    )
                else:
                    summary = run_local(
                        load_config(
                            overrides={
                                **common,
                                **folders,
                                "system.aggregation_mode": mode,
                                "system.transport": transport,
                                "training.momentum": 0.9 if mode == "sync" else 0.5,
                            }
                        )
                    )
                measured[name].append(summary)
                log(f"training {name} (run {repeat + 1}): {summary['throughput_samples_per_s']:.1f} samples/s")
    results = {}
    for name, summaries in measured.items():
        rates = [s["throughput_samples_per_s"] for s in summaries]
        results[name] = {
            "samples_per_s": round(statistics.median(rates), 1),
            "runs": [round(r, 1) for r in rates],
            "final_accuracy": summaries[0]["final_accuracy"],
        }
        if runs[name][1] is not None:
            results[name].update(
                transport=runs[name][1],
                communication_time_s=round(statistics.median(s["communication_time_s"] for s in summaries), 2),
                gradient_time_s=round(statistics.median(s["gradient_time_s"] for s in summaries), 2),
            )
    ddp = results["ddp_2_ranks"]["samples_per_s"]
    for name, run in results.items():
        if name.startswith("ps_"):
            run["ratio_to_ddp"] = round(run["samples_per_s"] / ddp, 3)
    if "ps_sync_2_workers" in results:
        results["ps_sync_2_workers"]["target_ratio_to_ddp"] = 0.9
    results["setup"] = (
        f"mnist_5k, {num_epochs} epoch(s), batch {batch_size} per worker/rank, simple_cnn, CPU, momentum 0.9 "
        f"(sync, DDP), evaluated only at the run's end (training.eval_at_epoch_ends false), median of {repeats} "
        "runs in turns"
    )
    return results


def run_benchmark(
    transports: list[str],
    sizes_mb: list[float],
    repeats: int,
    ceiling_clients: list[int],
    ceiling_seconds: float,
    num_epochs: int,
    training_repeats: int,
    batch_size: int,
    *,
    round_trips: bool = True,
    ceiling: bool = True,
    training: bool = True,
) -> dict:
    """The sections asked for (``round_trips``, ``ceiling``, ``training``) with the machine's load around them."""
    from src.transport.grpc import reuse_freed_memory

    reuse_freed_memory()  # the client side, as run_worker does (the echo clients share this process)
    result: dict = {"machine": f"{os.cpu_count()} CPUs", "load_average_before": os.getloadavg()[0]}
    if round_trips:
        result["round_trips"] = [
            bench_round_trips(transport, size, repeats) for size in sizes_mb for transport in transports
        ]
    if ceiling:
        result["ceiling"] = [bench_ceiling(transport, ceiling_clients, ceiling_seconds) for transport in transports]
    if training:
        result["training"] = bench_training(num_epochs, batch_size, transports, training_repeats)
    result["load_average_after"] = os.getloadavg()[0]
    return result
