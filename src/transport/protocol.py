"""The parameter server's calls as a worker (or a tool) makes them, whatever carries them: :class:`ProtocolClient`.

A transport's client (gRPC: :class:`src.transport.grpc.ParameterServerClient`; binary frames on TCP:
:class:`src.transport.tcp.TCPParameterServerClient`) sends one attempt of a call; this base builds the requests and
retries what failed in transport (:class:`~src.transport.errors.CallError` ``UNAVAILABLE``, ``DEADLINE_EXCEEDED``),
resending the same request: a push keeps its request id, which the server applies at most once.
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

from src import parameter_server_pb2 as pb
from src.transport.errors import CallError
from src.transport.stream import PushStream, ReplyBroken
from src.transport.wire import Outgoing, Received


class ProtocolClient:
    """The parameter server's calls as a worker (or a tool) makes them, whatever the transport.

    A subclass sends one attempt of a call (:meth:`_attempt`: the call's name, its request message
    or :class:`~src.transport.wire.Outgoing`, raising a :class:`~src.transport.errors.CallError` on failure); this class
    builds the requests and retries a call that failed in transport (``UNAVAILABLE``, ``DEADLINE_EXCEEDED``)
    ``retries`` times with backoff, resending the same request (a push keeps its request id, which the
    server applies at most once). Subclasses set ``retries`` and ``connect_timeout_s``.
    """

    retries: int
    connect_timeout_s: float

    def _attempt(self, name: str, request, *, timeout: float | None, wait_for_ready: bool):
        raise NotImplementedError

    def _call(
        self, name: str, request, *, timeout: float | None = None, wait_for_ready: bool = False, retry: bool = True
    ):
        attempt = 0
        while True:
            try:
                return self._attempt(name, request, timeout=timeout, wait_for_ready=wait_for_ready)
            except CallError as exc:
                if not retry or not exc.retryable or attempt >= self.retries:
                    raise
                attempt += 1
                time.sleep(min(0.2 * 2**attempt, 1.0))  # backoff before resending the same request (a restarted
                # server is found within a second of coming up: it waits one heartbeat timeout for its workers)

    def register(
        self,
        worker_id: int,
        last_request_id: int = 0,
        carried_batch_ids: Sequence[int] = (),
        *,
        timeout: float | None = None,
        any_worker_id: bool = False,
    ) -> pb.RegisterReply:
        """Join the run (again); waits up to ``timeout`` (default ``connect_timeout_s``) for the server.

        Args:
            last_request_id: the last push this process sent, if it lost its session (the reply says
                whether it was applied).
            any_worker_id: let the server pick a free worker id (the reply's ``worker_id``).
        """
        request = pb.RegisterRequest(
            worker_id=worker_id,
            last_request_id=last_request_id,
            carried_batch_ids=carried_batch_ids,
            pid=os.getpid(),
            any_worker_id=any_worker_id,
        )
        # wait_for_ready: reconnect with backoff until the server accepts or the deadline passes.
        return self._call(
            "Register", request, timeout=timeout or self.connect_timeout_s, wait_for_ready=True, retry=False
        )

    def initialize(
        self, request: pb.InitializeRequest, parameters: Sequence[Any], buffers: Sequence[Any]
    ) -> pb.InitializeReply:
        """Offer the model's layout (in ``request``) and initial values to a server that has no model yet."""
        return self._call("Initialize", Outgoing(request, {"parameters": parameters, "buffers": buffers}))

    def pull(
        self, caller: pb.Caller, *, certificate: bytes = b"", parameters_only: bool = False, final: bool = False
    ) -> Received:
        """The parameters at the newest version and this worker's next work (a :class:`~pb.PullReply` and views).
        A sharded server's shard: ``parameters_only`` (no work), after applying ``certificate``'s version
        (:mod:`src.ps.shards.rounds`); ``final``: shard 0 reading the part at the end of the run."""
        request = pb.PullRequest(caller=caller, certificate=certificate, parameters_only=parameters_only, final=final)
        return self._call("Pull", request)

    def push(
        self,
        request: pb.PushRequest,
        gradients: Sequence[Any] = (),
        buffers: Sequence[Any] = (),
        *,
        wait_for_ready: bool = False,
        timeout: float | None = None,
    ) -> Received:
        """Send one step; the reply (a :class:`~pb.PushReply` and views) carries the next parameters and work.

        A retry resends the same bytes (same request id), which the server applies at most once.
        """
        return self._call(
            "Push",
            Outgoing(request, {"gradients": gradients, "buffers": buffers}),
            wait_for_ready=wait_for_ready,
            timeout=timeout,
        )

    def push_streamed(self, stream: PushStream, *, timeout: float | None = None) -> Received:
        """Send a streamed push (``system.streaming``, :mod:`src.transport.stream`): each part as ``stream`` hands it
        over, then the push; the reply is taken as it arrives (its head and tensors go to ``stream``'s waiters).
        Returns the whole reply. A failure before the reply's head is retried as any call (the parts again, the
        same request id); after it, :class:`~src.transport.stream.ReplyBroken` (the push is settled).
        """
        attempt = 0
        while True:
            try:
                return self._attempt_streamed(stream, timeout=timeout)
            except CallError as exc:
                if stream.has_head:
                    stream.fail(exc)
                    raise ReplyBroken(f"the reply broke off after its head: {exc.message}") from None
                if not exc.retryable or attempt >= self.retries:
                    stream.fail(exc)
                    raise
                attempt += 1
                time.sleep(min(0.2 * 2**attempt, 1.0))
            except BaseException as exc:
                stream.fail(exc)
                raise

    def _attempt_streamed(self, stream: PushStream, *, timeout: float | None) -> Received:
        raise NotImplementedError(f"{type(self).__name__} does not stream pushes")

    def push_bytes(self, data: bytes, *, timeout: float | None = None) -> Received:
        """Send ``data`` as a Push message as it is, without a retry (tools and tests of the server's parser)."""
        return self._call("Push", data, timeout=timeout, retry=False)

    def heartbeat(self, caller: pb.Caller, stats: pb.WorkerStats, timeout: float) -> pb.HeartbeatReply:
        """One heartbeat (no retry: the next one follows soon)."""
        return self._call("Heartbeat", pb.HeartbeatRequest(caller=caller, stats=stats), timeout=timeout, retry=False)

    def finish(self, caller: pb.Caller, stats: pb.WorkerStats) -> pb.FinishReply:
        return self._call("Finish", pb.FinishRequest(caller=caller, stats=stats))

    def status(self, timeout: float | None = 10.0, wait_for_ready: bool = False) -> pb.StatusReply:
        return self._call("Status", pb.StatusRequest(), timeout=timeout, wait_for_ready=wait_for_ready)

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ProtocolClient"]
