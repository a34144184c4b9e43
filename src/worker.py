"""A parameter-server worker: register -> pull -> (train on the handed batches -> push) until finished.

The worker learns the run from the server at registration (the config's training and compression
settings and the model layout), so a worker on another host needs only the server address and the
auth token; its own config keeps only what is local to its machine (:data:`LOCAL_FIELDS`).

Per step: the server hands the worker batches (sample indices) with the parameters to train on;
the worker computes the gradient (with ``system.local_steps`` = H > 1 it takes H local SGD steps,
one per batch, and pushes the sum of their gradients), puts each parameter's gradient through
error feedback (``compensate``) and the compression policy, and pushes. The push's reply carries
the verdict, the next parameters and the next batches: one RPC per step. A push turned away by the
staleness policy rolls the residuals back (no gradient mass is lost) and its batches are carried
into the next push, which lists them too.

Staying alive: a background thread sends a heartbeat every ``system.heartbeat_interval`` with the
worker's running totals. If the server loses this worker's session (it restarted from a checkpoint),
the worker registers again (gRPC's ``wait_for_ready`` waits out the restart), learns whether its
last push was applied (commit, or discard: its samples will be redone) and goes on. If the server
declared this incarnation failed (it was silent too long, or a newer one registered), the process
stops with :class:`IncarnationRevoked`.

Emulation (:mod:`src.netem`, the run config's ``emulation`` section, learnt from the server): a
slowed worker waits after each forward/backward (counted as gradient time), and a narrow uplink
makes every message wait its transfer time in the client before it is sent (counted as
communication time); ``emulated_delay_s`` in the totals is the sum of both waits.

Measured per worker: gradient time (forward/backward), compression time, communication time (the
push round trip, including waiting at the sync barrier), bytes sent and received (the serialized
gRPC messages, :class:`~src.ps_transport.ParameterServerClient`), samples, loss and accuracy.
Events and TensorBoard scalars go to ``<log_dir>/worker_<k>``; the totals go to the server with each
heartbeat and at Finish, which puts them in the run summary.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import grpc
import torch

from src import parameter_server_pb2 as pb
from src.compression import ErrorFeedback, policy_from_config
from src.config import Config, SetupError, validate_config
from src.data import load_dataset
from src.faults import FaultInjector
from src.metrics import LOG_EVERY_STEPS, MetricsLogger
from src.netem import ComputeDelay, conditions_for, link_or_none, worker_seed
from src.ps_transport import ParameterServerClient, Received, require_auth_token, tensor_view
from src.trainer import forward_backward, model_from_config, resolve_device
from src.worker_protocol import (  # noqa: F401  (IncarnationRevoked: part of this module's interface)
    Heartbeats, IncarnationRevoked, check_session_lost, controlled_policy, encode_gradients, load_reply, settle_lost_push,
    settle_push,
)

LOCAL_FIELDS = (
    "training.data_dir", "training.device",
    "system.log_dir", "system.checkpoint_dir", "system.server_address", "system.inject_faults",
    "system.tls_cert_file", "system.tls_key_file", "system.tls_ca_file",
)
"""Fields a worker takes from its own config; everything else comes from the server."""


class ServerEndedRun(RuntimeError):
    """The server stopped before this worker was told the run is finished."""


def merge_run_config(local: Config, run_config_json: str) -> Config:
    """The server's run config with this worker's :data:`LOCAL_FIELDS` put back."""
    merged = json.loads(run_config_json)
    mine = local.to_dict()
    for dotted in LOCAL_FIELDS:
        section, field = dotted.split(".")
        merged[section][field] = mine[section][field]
    return validate_config(merged)


class Worker:
    """One worker of a parameter-server run; :meth:`run` trains until the server says the run is finished.

    Args:
        config: this worker's config (its :data:`LOCAL_FIELDS` are used; the rest comes from the server).
        worker_id: ``0..num_workers-1``; it is also the shard the worker reads first.
        address: the server's ``host:port`` (default ``system.server_address``).
        token: the run's auth token (default :func:`~src.ps_transport.require_auth_token`).
        tensorboard: also write TensorBoard scalars next to ``events.jsonl``.
        connect_timeout_s: how long to wait for the server at (re-)registration.
        faults: fire this worker's ``system.inject_faults`` (``False`` for a restarted worker).
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
        faults: bool = True,
    ):
        self.local_config = config
        self.worker_id = worker_id
        self.address = address or config.system.server_address
        self.token = token or require_auth_token(config.system)
        self.tensorboard = tensorboard
        self.connect_timeout_s = connect_timeout_s
        self.faults = FaultInjector(config.system.inject_faults, "worker", worker_id, enabled=faults)
        self.client: ParameterServerClient | None = None
        self.caller = pb.Caller(worker_id=worker_id)
        self.incarnation = 0
        self.totals: dict[str, Any] = dict(samples=0, steps=0, gradient_time_s=0.0, compression_time_s=0.0,
                                           communication_time_s=0.0, pushes_rejected=0, payload_bytes=0, dense_bytes=0,
                                           train_loss=0.0, train_accuracy=0.0)
        self._started = time.perf_counter()
        self.compute_delay: ComputeDelay | None = None  # emulation, set once the run config is known

    def emulated_delay_s(self) -> float:
        """Seconds this process waited for emulated compute and uplink (:mod:`src.netem`)."""
        uplink = self.client.uplink if self.client is not None else None
        return (self.compute_delay.delay_s if self.compute_delay else 0.0) + (uplink.delay_s if uplink else 0.0)

    def stats(self) -> pb.WorkerStats:
        """This process's running totals (read by the heartbeat thread too)."""
        t = self.totals
        client = self.client
        return pb.WorkerStats(
            samples=t["samples"], steps=t["steps"],
            bytes_sent=client.bytes_sent if client else 0, bytes_received=client.bytes_received if client else 0,
            gradient_time_s=t["gradient_time_s"], compression_time_s=t["compression_time_s"],
            communication_time_s=t["communication_time_s"], total_time_s=time.perf_counter() - self._started,
            train_loss=t["train_loss"], train_accuracy=t["train_accuracy"], pushes_rejected=t["pushes_rejected"],
            payload_bytes=t["payload_bytes"], dense_bytes=t["dense_bytes"], emulated_delay_s=self.emulated_delay_s(),
        )

    def run(self) -> dict[str, Any]:
        """Register, train on whatever the server hands out until it says finished, finish; returns the totals.

        Raises:
            grpc.RpcError: the server refused a call (bad auth, bad push) or went away for good.
            IncarnationRevoked: the server declared this incarnation failed.
            ValueError: the local model does not match the server's layout.
        """
        self.client = ParameterServerClient(self.address, token=self.token, system=self.local_config.system,
                                            connect_timeout_s=self.connect_timeout_s)
        heartbeats = None
        try:
            registration = self._register(0)
            config = merge_run_config(self.local_config, registration.run_config_json)
            conditions = conditions_for(config.emulation, self.worker_id)
            self.client.uplink = link_or_none(conditions.uplink)
            self.compute_delay = ComputeDelay(conditions, worker_seed(config.training.seed, self.worker_id))
            interval = config.system.heartbeat_interval
            heartbeats = Heartbeats(lambda: self.client.heartbeat(self.caller, self.stats(), timeout=interval * 2), interval,
                                    name=f"worker-{self.worker_id}-heartbeat")
            heartbeats.start()
            return self._train(config, registration)
        finally:
            if heartbeats is not None:
                heartbeats.stopped.set()
            self.client.close()

    def _register(self, last_request_id: int, carried: list[pb.Batch] = ()) -> pb.RegisterReply:
        registration = self.client.register(self.worker_id, last_request_id, [b.batch_id for b in carried])
        self.caller = pb.Caller(worker_id=self.worker_id, session=registration.session)
        self.incarnation = registration.incarnation
        return registration

    def _train(self, config: Config, registration: pb.RegisterReply) -> dict[str, Any]:
        t, system = config.training, config.system
        device = resolve_device(t.device)
        model = model_from_config(config).to(device)
        named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        buffers = [b for _, b in model.named_buffers() if b.is_floating_point()]
        local_layout = [(n, list(p.shape)) for n, p in named_params]
        server_layout = [(s.name, list(s.shape)) for s in registration.parameter_specs]
        if local_layout != server_layout:
            raise SetupError(f"worker {self.worker_id}: the local {t.model_architecture} does not match the server's parameters")
        params = [p for _, p in named_params]
        names = [n for n, _ in named_params]
        dense_bytes_per_step = 4 * sum(p.numel() for p in params)  # what identity payloads would carry
        policy = policy_from_config(system)
        # Error feedback also holds a rejected push's gradient when compression is off (identity payloads).
        rejections_possible = system.aggregation_mode == "async" and system.staleness_policy in ("hard", "both")
        feedback = ErrorFeedback() if (policy is not None and system.error_feedback) or rejections_possible else None
        generator = torch.Generator().manual_seed(t.seed * 1_000_003 + self.worker_id)  # stochastic rounding
        train_set = load_dataset(t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples,
                                 num_samples=t.num_samples, seed=t.seed)
        request_id = secrets.randbits(62) or 1  # random start: a restarted worker's ids do not collide with old ones
        carried: list[pb.Batch] = []  # batches whose rejected gradient waits in the error feedback
        totals = self.totals
        epoch_loss = epoch_correct = epoch_samples = 0
        # system.gradient_ledger: the sum of every gradient computed (before error feedback), float64
        ledger = [torch.zeros(p.shape, dtype=torch.float64) for p in params] if system.gradient_ledger else None

        with MetricsLogger(Path(system.log_dir) / f"worker_{self.worker_id}", tensorboard=self.tensorboard,
                           role="worker", worker=self.worker_id) as log:
            received = self._pull(carried)
            version = load_reply(params, buffers, received)
            log.event("run_start", address=self.address, incarnation=self.incarnation, version=version)
            policy = self._follow_control(policy, received, log, 1)
            print(f"worker {self.worker_id}: registered with {self.address} as incarnation {self.incarnation} at "
                  f"version {version} ({system.aggregation_mode})", flush=True)
            model.train()
            while True:
                if received.message.work.finished:
                    stats = self.stats()
                    try:
                        self.client.finish(self.caller, stats)
                        break
                    except grpc.RpcError as exc:  # the server restarted before it finished the run: go on
                        self._check_session_lost(exc)
                        self._register(0, carried)
                        received = self._pull(carried)
                        version = load_reply(params, buffers, received)
                        log.event("rejoined", incarnation=self.incarnation, version=version)
                        continue
                work = received.message.work
                batches = list(work.batches)
                step_started = time.perf_counter()
                loss, correct, samples = self._compute(model, params, train_set, batches, t.learning_rate, device)
                if batches:
                    self.compute_delay.after_step(time.perf_counter() - step_started)  # emulated straggler
                computed = time.perf_counter()
                if ledger is not None and batches:
                    for total, p in zip(ledger, params):
                        if p.grad is not None:
                            total.add_(p.grad.to(torch.float64))
                self.faults.reached(totals["steps"] + 1, announce=lambda fault: log.event("fault_injected", fault=str(fault)))
                payloads = encode_gradients(
                    ((name, torch.zeros_like(p) if not batches or p.grad is None else p.grad) for name, p in named_params),
                    policy, feedback, generator, totals["steps"])  # no batches: a flush of what error feedback carries
                compressed = time.perf_counter()

                request_id += 1
                covered = carried + batches
                request = pb.PushRequest(
                    caller=self.caller, base_version=version, request_id=request_id,
                    num_samples=sum(len(b.indices) for b in covered), batch_ids=[b.batch_id for b in covered],
                    metrics=pb.StepMetrics(epoch=batches[-1].epoch if batches else 0, step=totals["steps"], loss=loss,
                                           correct=correct, gradient_time_s=computed - step_started,
                                           compression_time_s=compressed - computed,
                                           communication_time_s=totals.get("last_communication_s", 0.0)),
                )
                sent_before, received_before = self.client.bytes_sent, self.client.bytes_received
                reply = self._push(request, payloads, [tensor_view(b) for b in buffers] if batches else [], feedback,
                                   named_params, carried)
                push_bytes = self.client.bytes_sent - sent_before
                reply_bytes = self.client.bytes_received - received_before
                if not isinstance(reply, Received):  # lost with the server's session: registered again
                    if reply:  # ... but it was applied, carried batches included
                        carried = []
                    received = self._pull(carried)
                    version = load_reply(params, buffers, received)
                    log.event("rejoined", incarnation=self.incarnation, version=version)
                    continue
                accepted = reply.message.accepted
                settle_push(feedback, names, accepted=accepted)
                carried = [] if accepted else covered
                if not accepted:
                    totals["pushes_rejected"] += 1
                received = reply
                version = load_reply(params, buffers, received)
                finished = time.perf_counter()

                payload_bytes = sum(len(p) for p in payloads)
                totals["steps"] += 1
                policy = self._follow_control(policy, received, log, totals["steps"] + 1)  # from the next push on
                totals["samples"] += samples
                totals["gradient_time_s"] += computed - step_started
                totals["compression_time_s"] += compressed - computed
                totals["communication_time_s"] += finished - compressed
                totals["last_communication_s"] = finished - compressed
                totals["payload_bytes"] += payload_bytes
                totals["dense_bytes"] += dense_bytes_per_step
                epoch_loss += loss * samples
                epoch_correct += correct
                epoch_samples += samples
                totals["train_loss"] = epoch_loss / max(epoch_samples, 1)
                totals["train_accuracy"] = epoch_correct / max(epoch_samples, 1)
                log.event("push", step=totals["steps"], num_samples=samples, batch_ids=list(request.batch_ids),
                          payload_bytes=payload_bytes, push_bytes=push_bytes, reply_bytes=reply_bytes, accepted=accepted,
                          staleness=reply.message.staleness, version=version)
                if totals["steps"] % LOG_EVERY_STEPS == 0 or received.message.work.finished:
                    log.scalars("train", totals["steps"], {
                        "loss": loss,
                        "accuracy": correct / samples if samples else 0.0,
                        "throughput": samples / (finished - step_started),
                        "gradient_time_s": computed - step_started,
                        "compression_time_s": compressed - computed,
                        "communication_time_s": finished - compressed,
                        "samples_processed": totals["samples"],
                        "bytes_sent": self.client.bytes_sent,
                        "bytes_received": self.client.bytes_received,
                        "compression_ratio": totals["dense_bytes"] / max(totals["payload_bytes"], 1),
                        "staleness": reply.message.staleness,
                    })

            result = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
            if ledger is not None:
                residuals = {n: (feedback.residual(n) if feedback is not None and feedback.residual(n) is not None
                                 else torch.zeros(p.shape)).to(torch.float64) for n, p in named_params}
                torch.save({"computed": dict(zip(names, ledger)), "residuals": residuals},
                           Path(system.log_dir) / f"worker_{self.worker_id}" / "gradient_ledger.pt")
            log.event("run_end", incarnation=self.incarnation, **result)
        print(f"worker {self.worker_id}: finished at version {version}: {totals['samples']} samples in "
              f"{totals['steps']} steps", flush=True)
        return {"worker_id": self.worker_id, "incarnation": self.incarnation, **result}

    @staticmethod
    def _follow_control(policy, received: Received, log: MetricsLogger, step: int):
        """The policy with the adaptive controller's top-k Active Fraction from ``received``, from the next step."""
        updated = controlled_policy(policy, received.message.control)
        if updated is not policy:
            log.event("control_applied", step=step, compression_ratio=updated.compressor.ratio,
                      previous_compression_ratio=policy.compressor.ratio, max_staleness=received.message.control.max_staleness)
        return updated

    def _push(self, request: pb.PushRequest, payloads: list[bytes], buffers: list, feedback: ErrorFeedback | None,
              named_params, carried: list[pb.Batch]) -> Received | bool:
        """Push; on a lost session register again. Returns the reply, or (the reply lost) whether the push was applied.

        Raises:
            IncarnationRevoked: the server declared this incarnation failed.
        """
        try:
            return self.client.push(request, payloads, buffers)
        except grpc.RpcError as exc:
            self._check_session_lost(exc)
        # The server restarted (our session is unknown there) or is restarting: join again and ask
        # whether the push made it into an update before the server's checkpoint.
        print(f"worker {self.worker_id}: lost the server's session; registering again", flush=True)
        registration = self._register(request.request_id, carried)
        # applied: keep what it left in the residual; lost: its samples will be computed again
        settle_lost_push(feedback, [name for name, _ in named_params], applied=registration.last_request_applied, redone=True)
        return registration.last_request_applied

    def _check_session_lost(self, exc: grpc.RpcError) -> None:
        """See :func:`src.worker_protocol.check_session_lost`."""
        check_session_lost(exc, self.worker_id)

    def _pull(self, carried: list[pb.Batch]) -> Received:
        """Pull the parameters and work, registering again while the server has lost this session."""
        while True:
            try:
                return self.client.pull(self.caller)
            except grpc.RpcError as exc:
                self._check_session_lost(exc)
                print(f"worker {self.worker_id}: lost the server's session; registering again", flush=True)
                self._register(0, carried)

    @staticmethod
    def _compute(model, params, train_set, batches: list[pb.Batch], learning_rate: float,
                 device) -> tuple[float, int, int]:
        """Gradients of the handed batches into ``param.grad`` (summed; local SGD steps between them).

        Returns the mean loss, the correct count and the samples.
        """
        if not batches:
            return 0.0, 0, 0
        summed: list[torch.Tensor] | None = None
        total_loss, total_correct, total_samples = 0.0, 0, 0
        for index, batch in enumerate(batches):
            images, labels = train_set.batch(list(batch.indices))
            model.zero_grad(set_to_none=True)
            loss, correct = forward_backward(model, images.to(device), labels.to(device))
            total_loss += loss * len(batch.indices)
            total_correct += correct
            total_samples += len(batch.indices)
            if len(batches) == 1:
                break
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            summed = [g.clone() for g in grads] if summed is None else [s.add_(g) for s, g in zip(summed, grads)]
            if index + 1 < len(batches):
                with torch.no_grad():
                    for p, g in zip(params, grads):
                        p.add_(g, alpha=-learning_rate)  # a local plain-SGD step
        if summed is not None:
            for p, s in zip(params, summed):
                p.grad = s
        return total_loss / max(total_samples, 1), total_correct, total_samples
