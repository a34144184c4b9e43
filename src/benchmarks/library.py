"""The library's overhead: a training step through torch_asgc against the same step made with the raw
protocol calls our own PS worker makes, both workers of one in-process server. ``scripts/bench_library.py``
runs it; its ``--help`` says what is compared.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from src import parameter_server_pb2 as pb
from src.compression import build_compressor
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.policy import CompressionPolicy
from src.config import load_config
from src.ps.worker.codec import encode_gradients, settle_push
from src.ps.worker.loading import load_reply
from src.training.data import dataset_info, load_dataset
from src.training.models import build_model
from src.transport.grpc import ParameterServerClient
from torch_asgc import DistributedModel, DistributedOptimizer, connect
from torch_asgc.server import ClientLoopServer

TOKEN = "bench-library-token-0123456789"
TARGET_RATIO = 1.10


class LibraryWorker:
    """Worker 0: a user's loop through torch_asgc (``DistributedModel`` and ``DistributedOptimizer``)."""

    def __init__(self, address: str, model_name: str, compressor):
        torch.manual_seed(0)
        self.net = build_model(model_name, dataset_info("mnist_5k"))
        self.client = connect(address, token=TOKEN, worker_id=0)
        self.model = DistributedModel(self.net, self.client)
        self.optimizer = DistributedOptimizer(
            torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.0),
            self.client,
            compression=compressor if compressor is not None else "none",
        )

    def block(self, batches) -> list[float]:
        """Seconds of each step over ``batches``."""
        times = []
        for images, labels in batches:
            started = time.perf_counter()
            self.optimizer.zero_grad()
            F.cross_entropy(self.model(images), labels).backward()
            self.optimizer.step()
            times.append(time.perf_counter() - started)
        return times


class ReferenceWorker:
    """Worker 1: the raw protocol calls our own PS worker makes per step, on the same model."""

    def __init__(self, address: str, model_name: str, compressor):
        torch.manual_seed(0)
        self.net = build_model(model_name, dataset_info("mnist_5k"))
        self.raw = ParameterServerClient(address, token=TOKEN, retries=0)
        registration = self.raw.register(1)
        self.caller = pb.Caller(worker_id=1, session=registration.session)
        self.named = [(n, p) for n, p in self.net.named_parameters() if p.requires_grad]
        self.params, self.names = [p for _, p in self.named], [n for n, _ in self.named]
        self.version = load_reply(self.params, [], self.raw.pull(self.caller))
        self.policy = CompressionPolicy(compressor) if compressor is not None else None
        self.feedback = ErrorFeedback() if compressor is not None else None
        self.request_id = 1

    def block(self, batches) -> list[float]:
        """Seconds of each step over ``batches``: encode, push, settle, load the reply."""
        times = []
        for step, (images, labels) in enumerate(batches):
            started = time.perf_counter()
            self.net.zero_grad(set_to_none=True)
            F.cross_entropy(self.net(images), labels).backward()
            payloads = encode_gradients(((n, p.grad) for n, p in self.named), self.policy, self.feedback, None, step)
            self.request_id += 1
            request = pb.PushRequest(
                caller=self.caller, base_version=self.version, request_id=self.request_id, num_samples=len(labels)
            )
            reply = self.raw.push(request, payloads, [])
            settle_push(self.feedback, self.names, accepted=reply.message.accepted)
            self.version = load_reply(self.params, [], reply)
            times.append(time.perf_counter() - started)
        return times


def _server(out: Path) -> ClientLoopServer:
    """The in-process server both workers push to (async, so neither waits for the other)."""
    config = load_config(
        overrides={
            "system.num_workers": 2,
            "system.aggregation_mode": "async",
            "system.server_address": "127.0.0.1:0",
            "system.log_dir": str(out / "logs"),
            "system.checkpoint_dir": str(out / "ckpt"),
            "training.checkpoint_interval": 100_000,
            "training.momentum": 0.0,
            "system.heartbeat_timeout": 3600.0,  # the raw reference worker sends no heartbeats
        }
    )
    return ClientLoopServer(config, token=TOKEN, tensorboard=False)


def measure(steps: int, rounds: int, model_name: str, compressor) -> dict:
    """Median step time of each worker over alternating blocks, after one warm-up block each."""
    server = _server(Path("/tmp") / f"bench_library_{os.getpid()}")
    port = server.start()
    address = f"127.0.0.1:{port}"
    train = load_dataset("mnist_5k", "train")
    batches = [train.batch(list(range(i, i + 64))) for i in range(0, 64 * steps, 64)]
    try:
        library = LibraryWorker(address, model_name, compressor)
        reference_worker = ReferenceWorker(address, model_name, compressor)
        ours, reference = [], []
        library.block(batches), reference_worker.block(batches)  # warm-up
        for _ in range(rounds):
            ours += library.block(batches)
            reference += reference_worker.block(batches)
        library.client.close()
        reference_worker.raw.close()
    finally:
        server.stop(grace=0)
    client = library.client
    ours_ms, reference_ms = 1000 * statistics.median(ours), 1000 * statistics.median(reference)
    return {
        "library_step_ms": round(ours_ms, 3),
        "reference_step_ms": round(reference_ms, 3),
        "ratio": round(ours_ms / reference_ms, 3),
        "within_target": ours_ms / reference_ms <= TARGET_RATIO,
        "push_bytes_per_step": int(client.transport.bytes_sent / max(1, client.totals["steps"])),
    }


def run_benchmark(steps: int, rounds: int, model_name: str) -> dict:
    """Both workers' median step times, uncompressed and with top-k 0.01, and their ratio."""
    torch.set_num_threads(1)
    results = {}
    for label, compressor in (("identity", None), ("topk_0.01", build_compressor("topk", ratio=0.01))):
        results[label] = measure(steps, rounds, model_name, compressor)
    return {
        "benchmark": "library step vs raw protocol step",
        "model": model_name,
        "batch_size": 64,
        "load_average": os.getloadavg()[0],
        "target_ratio": TARGET_RATIO,
        "results": results,
    }
