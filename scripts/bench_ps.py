"""Benchmark the parameter server's transport and training throughput; prints one JSON object last.

    python scripts/bench_ps.py --output bench_ps.json   # all of it (~1 min on 2 cores)
    python scripts/bench_ps.py --skip-training          # only the round trips
    python scripts/bench_ps.py --sizes-mb 1 4 --repeats 20

The training runs' progress goes to stderr, the JSON to stdout; ``--output`` also writes it to a file.

Round trips: for models of ~1, 4, 16 MB (8 float32 tensors) and a resnet18 (~45 MB), one step of
the protocol (one RPC: a push of identity payloads, every gradient uncompressed, whose reply carries
the new parameters and the next work) against a raw gRPC bytes echo of the same shape: one call
carrying plain ``bytes`` of the push's size and returning ``bytes`` of the reply's size (no protobuf,
no server work; the server returns a ready bytes object). The server runs in its own process, in
async mode with one worker, so each push is decoded, checked and applied with SGD + momentum before
the reply is encoded.

``ratio`` = echo time / PS time (1.0 = as fast as gRPC moves the bytes); targets: >= 0.7 at 1 MB,
>= 0.8 from 4 MB. ``server_compute_ms`` is the server's own work per push (decompress, checks,
optimizer step, encoding the new parameters),
measured inside the server; ``transport_ratio`` = echo / (PS - server compute) isolates what the
protocol adds on top of gRPC. Median of ``--repeats`` after one warm-up; PS and echo round trips
alternate, so a slow spell of a shared machine slows both rather than one.

Training: samples/s of 2-worker sync and async runs (processes, as ``run_parameter_server_training.py``
starts them) on mnist_5k next to the baseline trainer with the same per-step batch (target: sync
>= 0.85 of the baseline). Every throughput counts from the first training step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import statistics
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ECHO_SERVICE = "bench.Echo"
NUM_TENSORS = 8


def _model(size_mb: float):
    """``resnet18`` for 45 MB (the real layout), else 8 equal float32 tensors of ``size_mb`` in all."""
    import torch
    from torch import nn

    from src.data import dataset_info
    from src.models import build_model

    if size_mb >= 40:
        return build_model("resnet18", dataset_info("cifar10"))
    numel = int(size_mb * 2**20 / 4 / NUM_TENSORS)
    model = nn.Module()
    for index in range(NUM_TENSORS):
        model.register_parameter(f"tensor_{index}", nn.Parameter(torch.zeros(numel)))
    return model


BATCH = 64


def _config(tmp: str):
    from src.config import load_config

    return load_config(overrides={
        "system.num_workers": 1, "system.aggregation_mode": "async", "training.checkpoint_interval": 10**9,
        "training.batch_size": BATCH, "training.num_epochs": 1000,
        "system.log_dir": f"{tmp}/logs", "system.checkpoint_dir": f"{tmp}/ckpt",
    })


def _serve(size_mb: float, token: str, report, stop) -> None:
    """Child process: a parameter server for the model of ``size_mb`` and a raw bytes echo server."""
    import grpc
    import torch

    from src.parameter_server import ParameterServer
    from src.ps_transport import CLIENT_MAX_MESSAGE_BYTES, message_options, reuse_freed_memory

    torch.set_num_threads(1)
    reuse_freed_memory()  # as run_server does
    with tempfile.TemporaryDirectory() as tmp:
        server = ParameterServer(_config(tmp), token=token, model=_model(size_mb), evaluate=False, tensorboard=False,
                                 num_train_samples=BATCH)  # one batch per epoch, 1000 epochs: work for every push
        # Instrumentation: the server's own work per round trip = decode + apply + encode the reply.
        compute: list[float] = []
        for name in ("decode", "_apply_now", "_reply_bytes"):
            setattr(server.core, name, _timed(getattr(server.core, name), compute))
        port = server.start()
        # Random bytes, not bytes(n): a zero-filled buffer reads from the kernel's shared zero page.
        state = {"reply": b""}

        def size(request: bytes, context) -> bytes:
            state["reply"] = os.urandom(int(request))  # what each exchange returns
            return b""

        echo = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=message_options(CLIENT_MAX_MESSAGE_BYTES))
        echo.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(ECHO_SERVICE, {
            "Size": grpc.unary_unary_rpc_method_handler(size),
            "Exchange": grpc.unary_unary_rpc_method_handler(lambda request, context: state["reply"]),  # bytes in, bytes out
        })])
        echo_port = echo.add_insecure_port("127.0.0.1:0")
        echo.start()
        report.send((port, echo_port))
        stop.recv()
        report.send([sum(compute[i:i + 3]) for i in range(0, len(compute) - 2, 3)])
        echo.stop(0)
        server.stop(grace=0)


def _timed(method, into: list[float]):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    return timed


def _median_times(calls, repeats: int) -> list[float]:
    """Median seconds of each of ``calls``, timed in turns (one of each per repeat), so that a slow
    spell of a shared machine hits all of them alike rather than whichever ran during it."""
    for call in calls:
        call()  # warm-up: connection, first allocation of big buffers
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, into in zip(calls, times):
            started = time.perf_counter()
            call()
            into.append(time.perf_counter() - started)
    return [statistics.median(t) for t in times]


def bench_round_trips(size_mb: float, repeats: int) -> dict:
    import grpc
    import torch

    from src import parameter_server_pb2 as pb
    from src.compression import IDENTITY
    from src.ps_transport import CLIENT_MAX_MESSAGE_BYTES, ParameterServerClient, message_options, tensor_view

    context = multiprocessing.get_context("spawn")
    token = secrets.token_urlsafe(16)
    report, child_report = context.Pipe(duplex=False)
    stop_child, stop = context.Pipe(duplex=False)
    server = context.Process(target=_serve, args=(size_mb, token, child_report, stop_child))
    server.start()
    try:
        port, echo_port = report.recv()
        client = ParameterServerClient(f"127.0.0.1:{port}", token=token)
        registration = client.register(0)
        caller = pb.Caller(worker_id=0, session=registration.session)
        gradients = [IDENTITY.compress(torch.full(tuple(spec.shape), 1e-6)) for spec in registration.parameter_specs]
        buffers = [tensor_view(torch.zeros(tuple(spec.shape))) for spec in registration.buffer_specs]
        state = {"reply": client.pull(caller).message, "request_id": 0}

        def step() -> None:
            state["request_id"] += 1
            batches = state["reply"].work.batches
            request = pb.PushRequest(caller=caller, base_version=state["reply"].version, request_id=state["request_id"],
                                     num_samples=sum(len(b.indices) for b in batches), batch_ids=[b.batch_id for b in batches])
            state["reply"] = client.push(request, gradients, buffers).message

        sent, received = client.bytes_sent, client.bytes_received
        step()
        push_bytes, reply_bytes = client.bytes_sent - sent, client.bytes_received - received

        channel = grpc.insecure_channel(f"127.0.0.1:{echo_port}", options=message_options(CLIENT_MAX_MESSAGE_BYTES))
        channel.unary_unary(f"/{ECHO_SERVICE}/Size")(str(reply_bytes).encode())
        exchange = channel.unary_unary(f"/{ECHO_SERVICE}/Exchange")
        payload = secrets.token_bytes(push_bytes)

        def echo() -> None:
            exchange(payload)

        ps_time, echo_time = _median_times([step, echo], repeats)
        client.close()
        channel.close()
        stop.send(None)
        compute_times = report.recv()
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()
    server_compute = statistics.median(compute_times[-repeats:])
    return {
        "model_mb": round(reply_bytes / 2**20, 2),
        "push_bytes": push_bytes,
        "reply_bytes": reply_bytes,
        "target_ratio": 0.7 if reply_bytes < 2 * 2**20 else 0.8,
        "ps_round_trip_ms": round(ps_time * 1e3, 2),
        "echo_round_trip_ms": round(echo_time * 1e3, 2),
        "ratio": round(echo_time / ps_time, 3),
        "server_compute_ms": round(server_compute * 1e3, 2),
        "transport_ratio": round(echo_time / max(ps_time - server_compute, 1e-9), 3),
    }


def bench_training(num_epochs: int, batch_size: int) -> dict:
    from src.config import load_config
    from src.ps_launcher import run_local
    from src.supervisor import stdout_to_stderr
    from src.trainer import BaselineTrainer

    results = {}
    with tempfile.TemporaryDirectory() as tmp, stdout_to_stderr():
        common = {"training.dataset": "mnist_5k", "training.num_epochs": num_epochs, "training.batch_size": batch_size,
                  "training.checkpoint_interval": 10**6}
        for mode in ("sync", "async"):
            config = load_config(overrides={**common, "system.num_workers": 2, "system.aggregation_mode": mode,
                                            "training.momentum": 0.9 if mode == "sync" else 0.5,
                                            "system.log_dir": f"{tmp}/{mode}/logs", "system.checkpoint_dir": f"{tmp}/{mode}/ckpt"})
            summary = run_local(config)
            results[f"ps_{mode}_2_workers"] = {
                "samples_per_s": round(summary["throughput_samples_per_s"], 1),
                "final_accuracy": summary["final_accuracy"],
                "communication_time_s": round(summary["communication_time_s"], 2),
                "gradient_time_s": round(summary["gradient_time_s"], 2),
            }
        baseline = BaselineTrainer(load_config(overrides={
            **common, "system.architecture": "baseline", "system.num_workers": 1,
            "system.log_dir": f"{tmp}/baseline/logs", "system.checkpoint_dir": f"{tmp}/baseline/ckpt"}))
        summary = baseline.run()
        results["baseline"] = {"samples_per_s": round(summary["throughput_samples_per_s"], 1),
                               "final_accuracy": summary["final_accuracy"]}
    for mode in ("sync", "async"):
        results[f"ps_{mode}_2_workers"]["ratio_to_baseline"] = round(
            results[f"ps_{mode}_2_workers"]["samples_per_s"] / results["baseline"]["samples_per_s"], 3)
    results["ps_sync_2_workers"]["target_ratio"] = 0.85
    results["setup"] = f"mnist_5k, {num_epochs} epoch(s), batch {batch_size} per worker/step, simple_cnn, CPU"
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 45], help="model sizes (>= 40 means resnet18)")
    parser.add_argument("--repeats", type=int, default=20, help="timed round trips per size (median reported)")
    parser.add_argument("--skip-training", action="store_true", help="only the round-trip part")
    parser.add_argument("--num-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    from src.ps_transport import reuse_freed_memory

    reuse_freed_memory()  # the client side, as run_worker does (the echo client shares this process)
    result = {"machine": f"{os.cpu_count()} CPUs", "round_trips": [bench_round_trips(size, args.repeats) for size in args.sizes_mb]}
    if not args.skip_training:
        result["training"] = bench_training(args.num_epochs, args.batch_size)
    text = json.dumps(result, indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
