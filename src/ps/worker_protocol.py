"""The worker's side of the parameter-server protocol, whoever owns the training loop.

Shared by our own :class:`src.worker.Worker` (the server hands it batches) and the client library
:mod:`src.torch_asgc` (the user's loop owns the data): the pieces of a step that do not depend on
where the gradient came from.

* :class:`PushCodec`: a worker's compression state (policy, error-feedback residuals, the
  stochastic-rounding generator) and what a step does with it: encode, then settle the verdict.
* :func:`encode_gradients`: per parameter, ``ErrorFeedback.compensate -> policy.compress ->
  ErrorFeedback.update``; the payloads are the exact bytes that go on the wire.
* :func:`settle_push`: after the reply, commit the residuals (accepted) or roll them back (rejected:
  the whole compensated gradient goes back into the residual, so no gradient mass is lost).
* :func:`settle_lost_push`: the reply was lost with the server's session; on re-registering the
  server says whether the push was applied: commit, or (not applied) discard when its samples will
  be computed again, roll back when they will not.
* :func:`served_tensors`: the module's tensors the server holds (trainable parameters, float buffers).
* :func:`count_push`: a settled push into a worker's running totals.
* :func:`controlled_policy`: the top-k Active Fraction the adaptive controller sent in a reply.
* :func:`load_reply`: put a pull or push reply's parameters (dense, or downlink deltas) and buffers
  into the local tensors.
* :func:`failed_call` / :func:`check_session_lost` and :class:`Rejoins`: what a failed call means:
  the server lost this session (it restarted: register again), or it revoked this incarnation
  (declared it failed while the process was alive: a partition, a long pause; rejoin as a new
  incarnation, at most ``system.max_rejoins`` times, then stop), or neither (the caller's error).
* :class:`Heartbeats`: the thread that says "alive" every ``heartbeat_interval``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Iterable, Literal, Sequence

import grpc
import torch

from src.common.seeds import derive_seed
from src.compression import IDENTITY, TopKCompressor, decompress
from src.compressors.error_feedback import ErrorFeedback
from src.compressors.policy import CompressionPolicy
from src.transport.grpc import Received, copy_bytes_into

logger = logging.getLogger(__name__)

LOST_SESSION_CODES = frozenset({"NOT_FOUND", "UNAVAILABLE"})
"""Status codes of a call the server could not place: it restarted (or is restarting): register again."""
REVOKED_CODE = "ABORTED"
"""Status code of a call from an incarnation the server declared failed or replaced."""

Failure = Literal["lost", "revoked"]
"""What a failed call means for the worker (see :func:`failed_call`)."""


class IncarnationRevoked(RuntimeError):
    """The server declared this incarnation failed (silent too long, or replaced) and this process may not
    rejoin (no :class:`Rejoins` budget, or it is spent): this process must stop."""


class Rejoins:
    """A worker process's budget of rejoins after its incarnation was revoked (``system.max_rejoins``).

    A process the server declared failed while it was alive (it was partitioned away, paused, or hung
    for a while) is otherwise healthy: it registers again as a new incarnation and goes on. The
    budget keeps a process that keeps being declared failed (a flapping link) from rejoining forever.
    """

    def __init__(self, worker_id: int | None, max_rejoins: int):
        self.worker_id = worker_id
        self.max_rejoins = max_rejoins
        self.used = 0

    def spend(self, reason: str) -> None:
        """One rejoin after the revocation ``reason`` (the server's message, which names the worker).

        Raises:
            IncarnationRevoked: the budget is spent (the message says so, and why the incarnation ended).
        """
        if self.used >= self.max_rejoins:
            spent = (
                f"rejoined {self.used} time{'s' if self.used != 1 else ''} already"
                if self.max_rejoins
                else "rejoining is off"
            )
            raise IncarnationRevoked(f"{reason}; {spent} (system.max_rejoins={self.max_rejoins}): this process stops")
        self.used += 1
        logger.warning("%s; rejoining as a new incarnation (rejoin %d/%d)", reason, self.used, self.max_rejoins)


def failed_call(code: str, message: str, worker_id: int | None, rejoins: Rejoins | None) -> Failure | None:
    """What a call that failed with status ``code`` (gRPC's name) means for a worker.

    Returns ``"lost"``: the server lost this session (it restarted): register again, the pushes it
    had applied are known by request id; ``"revoked"``: the server declared this incarnation failed
    while the process lived: register again as a new incarnation (one rejoin spent), the work it
    held was handed to others; ``None``: neither (the caller raises its own error).

    Raises:
        IncarnationRevoked: revoked, and no rejoin is left (or ``rejoins`` is ``None``).
    """
    if code == REVOKED_CODE:
        if rejoins is None:
            raise IncarnationRevoked(f"worker {worker_id}: {message}")
        rejoins.spend(message)
        return "revoked"
    if code in LOST_SESSION_CODES:
        return "lost"
    return None


def check_session_lost(exc: grpc.RpcError, worker_id: int | None, rejoins: Rejoins | None = None) -> Failure:
    """:func:`failed_call` for a gRPC error: what it means, or ``exc`` itself raised for any other failure.

    Raises:
        IncarnationRevoked: the server declared this incarnation failed, and it may not rejoin.
        grpc.RpcError: ``exc`` itself, for any other failure.
    """
    failure = failed_call(exc.code().name, exc.details(), worker_id, rejoins)
    if failure is None:
        raise exc
    return failure


def served_tensors(
    module: torch.nn.Module,
) -> tuple[list[tuple[str, torch.nn.Parameter]], list[tuple[str, torch.Tensor]]]:
    """What the server holds of ``module``: its trainable parameters (``named_parameters()`` order) and its
    floating-point buffers (batch-norm statistics), named."""
    return (
        [(n, p) for n, p in module.named_parameters() if p.requires_grad],
        [(n, b) for n, b in module.named_buffers() if b.is_floating_point()],
    )


def worker_generator_seed(training_seed: int, worker_id: int) -> int:
    """Seed of worker ``worker_id``'s stochastic rounding (quantization)."""
    return derive_seed(training_seed, worker_id)


def encode_gradients(
    named_gradients: Iterable[tuple[str, torch.Tensor]],
    policy: CompressionPolicy | None,
    feedback: ErrorFeedback | None,
    generator: torch.Generator | None,
    step: int,
) -> list[bytes]:
    """One payload per parameter: compensated by ``feedback`` (if any), compressed by ``policy`` (identity if none).

    Without either, each payload is the identity payload in parts (:meth:`IdentityCompressor.parts`: its header
    and a view of the gradient itself, sent without a copy), so the gradients must not change until the push is
    sent; :func:`src.transport.wire.chunk_size` gives any payload's size.
    """
    if policy is None and feedback is None:
        return [IDENTITY.parts(gradient) for _, gradient in named_gradients]
    payloads = []
    for name, gradient in named_gradients:
        compensated = feedback.compensate(name, gradient) if feedback is not None else gradient
        payload = (
            policy.compress(compensated, step, generator) if policy is not None else IDENTITY.compress(compensated)
        )
        if feedback is not None:
            feedback.update(name, compensated, payload)
        payloads.append(payload)
    return payloads


def controlled_policy(policy: CompressionPolicy | None, control: Any) -> CompressionPolicy | None:
    """``policy`` with the top-k Active Fraction the adaptive controller sets in a reply's ``control``.

    Unchanged when the reply sets none (``compression_ratio`` 0), when the policy does not compress
    with top-k, or when the ratio is already the policy's. Used from the worker's next step.
    """
    rho = control.compression_ratio
    if (
        policy is None
        or rho <= 0
        or not isinstance(policy.compressor, TopKCompressor)
        or policy.compressor.ratio == rho
    ):
        return policy
    return dataclasses.replace(policy, compressor=dataclasses.replace(policy.compressor, ratio=rho))


def settle_push(feedback: ErrorFeedback | None, names: Iterable[str], *, accepted: bool) -> None:
    """After a push's reply: commit its residuals, or roll them back when it was rejected."""
    if feedback is not None:
        for name in names:
            (feedback.commit if accepted else feedback.rollback)(name)


def settle_lost_push(feedback: ErrorFeedback | None, names: Iterable[str], *, applied: bool, redone: bool) -> None:
    """After a push whose reply was lost: ``applied`` commits; otherwise ``redone`` (its samples will be
    computed again) discards it, else it is rolled back into the residual (its gradient goes with the next push)."""
    if feedback is not None:
        for name in names:
            (feedback.commit if applied else feedback.discard if redone else feedback.rollback)(name)


class PushCodec:
    """One worker's way from gradients to push payloads, and back from the push's verdict.

    Holds the compression ``policy`` (``None``: identity payloads), the error-feedback residuals
    (``feedback``) and the generator of quantization's stochastic rounding; both the PS worker
    (:class:`src.ps.worker_step.WorkerStep`) and the library's
    :class:`~torch_asgc.optim.DistributedOptimizer` push through one.

    Args:
        system: the run's system config (whether the server can reject a push).
        policy: the compression policy the worker pushes with.
        error_feedback: keep what compression leaves out for the next gradient.
        seed: the training seed the rounding generator derives from, with ``worker_id``.
        worker_id: the worker's id.
        names: the trainable parameters' names, in push order.
    """

    def __init__(
        self,
        system: Any,
        policy: CompressionPolicy | None,
        *,
        error_feedback: bool,
        seed: int,
        worker_id: int,
        names: Sequence[str],
    ):
        self.policy = policy
        # Error feedback also holds a rejected push's gradient when compression is off (identity payloads).
        rejections_possible = system.aggregation_mode == "async" and system.staleness_policy in ("hard", "both")
        self.feedback = ErrorFeedback() if (policy is not None and error_feedback) or rejections_possible else None
        self.generator = torch.Generator().manual_seed(worker_generator_seed(seed, worker_id))
        self.names = list(names)

    def encode(self, named_gradients: Iterable[tuple[str, torch.Tensor]], step: int) -> list[bytes]:
        """The push's payloads (:func:`encode_gradients`); the residuals wait for :meth:`settle`."""
        return encode_gradients(named_gradients, self.policy, self.feedback, self.generator, step)

    def settle(self, *, accepted: bool) -> None:
        """The reply's verdict: :func:`settle_push`."""
        settle_push(self.feedback, self.names, accepted=accepted)

    def settle_lost(self, *, applied: bool, redone: bool) -> None:
        """The reply was lost, the registration says whether it was ``applied``: :func:`settle_lost_push`."""
        settle_lost_push(self.feedback, self.names, applied=applied, redone=redone)


def count_push(
    totals: dict[str, Any],
    *,
    accepted: bool,
    samples: int,
    gradient_time_s: float,
    compression_time_s: float,
    communication_time_s: float,
    payload_bytes: int,
    dense_bytes: int,
) -> None:
    """Add one settled push to a worker's running ``totals`` (steps, samples, rejections, times, bytes)."""
    totals["steps"] += 1
    totals["samples"] += samples
    totals["pushes_rejected"] += 0 if accepted else 1
    totals["gradient_time_s"] += gradient_time_s
    totals["compression_time_s"] += compression_time_s
    totals["communication_time_s"] += communication_time_s
    totals["payload_bytes"] += payload_bytes
    totals["dense_bytes"] += dense_bytes


def load_reply(params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor], reply: Received) -> int:
    """Put the parameters of a pull or push reply into ``params`` (dense values, or deltas to add) and its
    buffers into ``buffers``; returns its version.

    Raises:
        ValueError: the reply holds a different number of tensors, or a tensor of another size.
    """
    deltas = reply.large.get("parameter_deltas") or []
    sent_params, sent_buffers = deltas or reply.large["parameters"], reply.large["buffers"]
    if len(sent_params) != len(params) or len(sent_buffers) != len(buffers):
        raise ValueError(
            f"server sent {len(sent_params)} parameters and {len(sent_buffers)} buffers, "
            f"the local model has {len(params)} and {len(buffers)}"
        )
    field = "parameter_deltas" if deltas else "parameters"
    for index, (param, data) in enumerate(zip(params, sent_params)):
        load_reply_tensor(field, index, param, data)
    for index, (buffer, data) in enumerate(zip(buffers, sent_buffers)):
        load_reply_tensor("buffers", index, buffer, data)
    return reply.message.version


def load_reply_tensor(field: str, index: int, target: torch.Tensor, data) -> None:
    """One tensor of a reply into ``target``: a parameter's or a buffer's values, or a compressed downlink's delta
    added (the server's replica does the same). A whole reply (:func:`load_reply`) or a streamed one, tensor by tensor
    as it arrives (:mod:`src.ps.worker_stream`).

    Raises:
        ValueError: ``data`` is not a tensor of ``target``'s size.
    """
    if field == "parameter_deltas":
        with torch.no_grad():
            target.add_(decompress(data, device=target.device).view_as(target).to(target.dtype))
    else:
        copy_bytes_into(target.data, data, f"{'buffer' if field == 'buffers' else 'parameter'} {index}")


class Heartbeats(threading.Thread):
    """Calls ``beat()`` (one heartbeat RPC) every ``interval`` seconds until :meth:`stop`.

    A failed heartbeat is ignored: the training loop's own calls find out what is wrong and act on it.
    """

    def __init__(self, beat: Callable[[], object], interval: float, *, name: str = "worker-heartbeat"):
        super().__init__(name=name, daemon=True)
        self.beat = beat
        self.interval = interval
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.beat()
            except grpc.RpcError:
                pass
            except ValueError:  # the channel was closed under a last beat: the owner is shutting down
                if not self.stopped.is_set():
                    raise

    def stop(self) -> None:
        self.stopped.set()

    def stop_and_close(self, close_channel: Callable[[], None]) -> None:
        """Stop, close the channel (a beat in flight is cancelled), and wait until the thread has ended.

        The wait is what matters: a beat still inside gRPC's C core when the interpreter exits is torn
        down there and the process aborts ("terminate called without an active exception", SIGABRT),
        so a worker that trained to the end would exit 134 instead of 0.
        """
        self.stop()
        close_channel()
        if self.is_alive():
            self.join()


__all__ = [
    "Heartbeats",
    "IncarnationRevoked",
    "PushCodec",
    "Rejoins",
    "check_session_lost",
    "count_push",
    "encode_gradients",
    "failed_call",
    "load_reply",
    "served_tensors",
    "settle_lost_push",
    "settle_push",
    "worker_generator_seed",
]
