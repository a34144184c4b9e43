"""A parameter-server worker: pull -> batch from its shard -> forward/backward -> compress -> push.

The worker learns the run from the server at registration (its shard, the config's training and
compression settings, the model layout and the current parameters), so a worker on another host
needs only the server address and the auth token; its own config keeps only what is local to its
machine (:data:`LOCAL_FIELDS`: data folder, device, log folder, address, TLS files).

Per step: the batch is step ``i`` of its shard (:meth:`src.data.Shard.batches`); a worker whose
shard ran out takes an empty step (``num_samples=0``, no tensors) so the sync barrier never waits
for it. Each parameter's gradient goes through error feedback (``compensate``), the compression
policy (configured compressor after ``system.warmup_steps``, identity for tensors it would not
shrink) and ``update``; the payloads go into the push unchanged. A push turned away by the server
(``accepted=false``) rolls the residuals back, so no gradient mass is lost.

Measured per worker: gradient time (forward/backward), compression time, communication time (push
and pull calls, including waiting at the sync barrier), bytes sent and received (the serialized
gRPC messages, :class:`~src.ps_transport.ParameterServerClient`), samples, loss and accuracy.
Events and TensorBoard scalars go to ``<log_dir>/worker_<k>``; the totals go to the server when
the worker finishes, which puts them in the run summary.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import torch

from src import parameter_server_pb2 as pb
from src.compression import IDENTITY, CompressionPolicy, ErrorFeedback, policy_from_config
from src.config import Config, validate_config
from src.data import load_dataset, make_shards, steps_per_epoch
from src.metrics import LOG_EVERY_STEPS, MetricsLogger
from src.ps_transport import ParameterServerClient, Received, copy_bytes_into, require_auth_token, tensor_view
from src.trainer import forward_backward, model_from_config, resolve_device

LOCAL_FIELDS = (
    "training.data_dir", "training.device",
    "system.log_dir", "system.checkpoint_dir", "system.server_address",
    "system.tls_cert_file", "system.tls_key_file", "system.tls_ca_file",
)
"""Fields a worker takes from its own config; everything else comes from the server."""


class ServerEndedRun(RuntimeError):
    """The server stopped before this worker took all its steps."""


def merge_run_config(local: Config, run_config_json: str) -> Config:
    """The server's run config with this worker's :data:`LOCAL_FIELDS` put back."""
    merged = json.loads(run_config_json)
    mine = local.to_dict()
    for dotted in LOCAL_FIELDS:
        section, field = dotted.split(".")
        merged[section][field] = mine[section][field]
    return validate_config(merged)


class Worker:
    """One worker of a parameter-server run; :meth:`run` trains until its shard is done.

    Args:
        config: this worker's config (its :data:`LOCAL_FIELDS` are used; the rest comes from the server).
        worker_id: ``0..num_workers-1``; it is also the shard the worker reads.
        address: the server's ``host:port`` (default ``system.server_address``).
        token: the run's auth token (default :func:`~src.ps_transport.require_auth_token`).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.
        connect_timeout_s: how long to wait for the server at registration.
    """

    def __init__(
        self,
        config: Config,
        worker_id: int,
        *,
        address: str | None = None,
        token: str | None = None,
        tensorboard: bool = True,
        connect_timeout_s: float = 300.0,
    ):
        self.local_config = config
        self.worker_id = worker_id
        self.address = address or config.system.server_address
        self.token = token or require_auth_token(config.system)
        self.tensorboard = tensorboard
        self.connect_timeout_s = connect_timeout_s

    def run(self) -> dict[str, Any]:
        """Register, train every step of every epoch, finish; returns this worker's totals.

        Raises:
            grpc.RpcError: the server refused a call (bad auth, bad push) or went away for good.
            ServerEndedRun: the server stopped the run early.
            ValueError: the local model does not match the server's layout.
        """
        client = ParameterServerClient(self.address, token=self.token, system=self.local_config.system,
                                       connect_timeout_s=self.connect_timeout_s)
        try:
            return self._train(client)
        finally:
            client.close()

    def _train(self, client: ParameterServerClient) -> dict[str, Any]:
        started = time.perf_counter()
        received = client.register(self.worker_id)
        registration = received.message
        config = merge_run_config(self.local_config, registration.run_config_json)
        t, system = config.training, config.system
        device = resolve_device(t.device)
        model = model_from_config(config).to(device)
        named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        buffers = [b for _, b in model.named_buffers() if b.is_floating_point()]
        local_layout = [(n, list(p.shape)) for n, p in named_params]
        server_layout = [(s.name, list(s.shape)) for s in registration.parameter_specs]
        if local_layout != server_layout:
            raise ValueError(f"worker {self.worker_id}: the local {t.model_architecture} does not match the server's parameters")
        params = [p for _, p in named_params]
        dense_bytes_per_step = 4 * sum(p.numel() for p in params)  # what identity payloads would carry
        self._load(params, buffers, received)
        version = registration.version

        policy = policy_from_config(system)
        feedback = ErrorFeedback() if policy is not None and system.error_feedback else None
        generator = torch.Generator().manual_seed(t.seed * 1_000_003 + self.worker_id)  # stochastic rounding
        train_set = load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples,
                                 num_samples=t.num_samples, seed=t.seed)
        num_workers, rank = registration.shard.num_shards, registration.shard.rank
        num_steps = steps_per_epoch(len(train_set), num_workers, t.batch_size)
        request_id = secrets.randbits(62)  # random start: ids of a restarted worker do not collide with its old ones
        totals = dict(samples=0, steps=0, gradient_time_s=0.0, compression_time_s=0.0, communication_time_s=0.0,
                      pushes_rejected=0, payload_bytes=0, dense_bytes=0)
        print(f"worker {self.worker_id}: registered with {self.address} at version {version} "
              f"(shard {rank}/{num_workers}, {num_steps} steps per epoch, {system.aggregation_mode})", flush=True)

        with MetricsLogger(Path(system.log_dir) / f"worker_{self.worker_id}", tensorboard=self.tensorboard,
                           role="worker", worker=self.worker_id) as log:
            log.event("run_start", address=self.address, version=version, steps_per_epoch=num_steps)
            model.train()
            for epoch in range(t.num_epochs):
                batches = list(make_shards(len(train_set), num_workers, epoch, t.seed)[rank].batches(t.batch_size))
                epoch_loss = epoch_correct = epoch_samples = 0
                for step in range(num_steps):
                    indices = batches[step] if step < len(batches) else []
                    step_started = time.perf_counter()
                    loss, correct = 0.0, 0
                    if indices:
                        images, labels = train_set.batch(indices)
                        model.zero_grad(set_to_none=True)
                        loss, correct = forward_backward(model, images.to(device), labels.to(device))
                    computed = time.perf_counter()
                    payloads = self._compress(named_params, policy, feedback, generator, totals["steps"]) if indices else []
                    compressed = time.perf_counter()

                    last_step = step == num_steps - 1
                    request_id += 1
                    request = pb.PushRequest(
                        worker_id=self.worker_id, base_version=version, request_id=request_id, num_samples=len(indices),
                        metrics=pb.StepMetrics(epoch=epoch, step=step, loss=loss, correct=correct, last_in_epoch=last_step),
                    )
                    sent_before = client.bytes_sent
                    reply = client.push(request, payloads, [tensor_view(b) for b in buffers] if indices else [])
                    push_bytes = client.bytes_sent - sent_before
                    if feedback is not None and indices:
                        for name, _ in named_params:
                            (feedback.commit if reply.accepted else feedback.rollback)(name)
                    if not reply.accepted:
                        totals["pushes_rejected"] += 1
                    if not (last_step and epoch == t.num_epochs - 1):  # nothing to pull after the last push
                        # sync: wait for this version's barrier; async: anything at least as new as our push's result.
                        wanted = version + 1 if system.aggregation_mode == "sync" else reply.version
                        pulled = client.pull(self.worker_id, wanted)
                        if pulled.message.finished:
                            raise ServerEndedRun(f"worker {self.worker_id}: the server ended the run at version "
                                                 f"{pulled.message.version} before epoch {epoch + 1} step {step + 1} was done")
                        self._load(params, buffers, pulled)
                        version = pulled.message.version
                    finished = time.perf_counter()

                    payload_bytes = sum(len(p) for p in payloads)
                    totals["steps"] += 1
                    totals["samples"] += len(indices)
                    totals["gradient_time_s"] += computed - step_started
                    totals["compression_time_s"] += compressed - computed
                    totals["communication_time_s"] += finished - compressed
                    totals["payload_bytes"] += payload_bytes
                    totals["dense_bytes"] += dense_bytes_per_step if indices else 0
                    epoch_loss += loss * len(indices)
                    epoch_correct += correct
                    epoch_samples += len(indices)
                    log.event("push", epoch=epoch, step=step, num_samples=len(indices), payload_bytes=payload_bytes,
                              push_bytes=push_bytes, accepted=reply.accepted, staleness=reply.staleness, version=version)
                    if totals["steps"] % LOG_EVERY_STEPS == 0 or last_step:
                        log.scalars("train", totals["steps"], {
                            "loss": loss,
                            "accuracy": correct / len(indices) if indices else 0.0,
                            "throughput": len(indices) / (finished - step_started),
                            "gradient_time_s": computed - step_started,
                            "compression_time_s": compressed - computed,
                            "communication_time_s": finished - compressed,
                            "samples_processed": totals["samples"],
                            "bytes_sent": client.bytes_sent,
                            "bytes_received": client.bytes_received,
                            "compression_ratio": totals["dense_bytes"] / max(totals["payload_bytes"], 1),
                            "staleness": reply.staleness,
                        }, epoch=epoch)
                print(f"worker {self.worker_id}: epoch {epoch + 1}/{t.num_epochs} done, train loss "
                      f"{epoch_loss / max(epoch_samples, 1):.4f}, version {version}", flush=True)

            stats = pb.WorkerStats(
                samples=totals["samples"], steps=totals["steps"],
                bytes_sent=client.bytes_sent, bytes_received=client.bytes_received,
                gradient_time_s=totals["gradient_time_s"], compression_time_s=totals["compression_time_s"],
                communication_time_s=totals["communication_time_s"], total_time_s=time.perf_counter() - started,
                train_loss=epoch_loss / max(epoch_samples, 1), train_accuracy=epoch_correct / max(epoch_samples, 1),
                pushes_rejected=totals["pushes_rejected"],
            )
            result = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
            log.event("run_end", **result)
            client.finish(self.worker_id, stats)
        return {"worker_id": self.worker_id, **result}

    @staticmethod
    def _compress(named_params, policy: CompressionPolicy | None, feedback: ErrorFeedback | None,
                  generator: torch.Generator, step: int) -> list[bytes]:
        payloads = []
        for name, param in named_params:
            gradient = param.grad if param.grad is not None else torch.zeros_like(param)
            if policy is None:
                payloads.append(IDENTITY.compress(gradient))
                continue
            compensated = feedback.compensate(name, gradient) if feedback is not None else gradient
            payload = policy.compress(compensated, step, generator)
            if feedback is not None:
                feedback.update(name, compensated, payload)
            payloads.append(payload)
        return payloads

    @staticmethod
    def _load(params: list[torch.Tensor], buffers: list[torch.Tensor], reply: Received) -> None:
        """Copy the parameters and buffers of a register or pull reply into the local model."""
        sent_params, sent_buffers = reply.large["parameters"], reply.large["buffers"]
        if len(sent_params) != len(params) or len(sent_buffers) != len(buffers):
            raise ValueError(f"server sent {len(sent_params)} parameters and {len(sent_buffers)} buffers, "
                             f"the local model has {len(params)} and {len(buffers)}")
        for index, (param, data) in enumerate(zip(params, sent_params)):
            copy_bytes_into(param.data, data, f"parameter {index}")
        for index, (buffer, data) in enumerate(zip(buffers, sent_buffers)):
            copy_bytes_into(buffer, data, f"buffer {index}")
