"""A worker's connections to every server shard, and the step machine's calls made on them, blocking.

The process worker (:mod:`src.worker`) and the library's client (:mod:`src.torch_asgc.client`) carry the step
machine's exchanges (:mod:`src.ps.worker.machine`) the same way: :meth:`Connections.run` makes each call on the
client of its shard (:func:`src.transport.clients.make_client`: gRPC or TCP), the calls yielded together at once on
one thread per shard, and hands the replies back (:func:`src.ps.worker.calls.run_blocking`). A step's push is
carried and settled the same way for both (:meth:`Connections.push_step`; streamed: :meth:`Connections.close_push`).

:class:`Heartbeats` says "alive" every ``system.heartbeat_interval`` from a thread of its own
(:meth:`Connections.start_heartbeats`).

A streamed push (``system.streaming``, :mod:`src.transport.stream`) is one :class:`~src.transport.stream.PushStream`
per shard, opened before backward (:meth:`Connections.open_streams`) on that shard's push thread: its parts go as
backward hands the gradients over. The machine's streamed Push closes it with the push's message, and its reply is the
reply's head; the tensors behind it go on arriving on the push thread (into the model, through the stream's
``on_large``) while the next step computes. A push given up before its message (:meth:`Connections.give_up`) leaves
the residuals and the rounding generator as they were before its parts.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import Any, Callable, Sequence

from src import parameter_server_pb2 as pb
from src.ps.worker.calls import FINISH, INITIALIZE, PULL, PUSH, REGISTER, Call, Exchange, T, run_blocking
from src.ps.worker.codec import PushCodec
from src.ps.worker.machine import Rejoined, StepFigures, StepMachine
from src.ps.worker.membership import Membership
from src.ps.worker.streaming import PushStreams, StreamedModel
from src.telemetry import tracing
from src.transport.errors import CallError
from src.transport.stream import PushStream
from src.transport.wire import Outgoing, Received, chunk_size


class Connections:
    """One client per server shard, shard 0 (the server) first (see the module docstring).

    Args:
        clients: the connections, in shard order.
        name: the threads' name prefix.
    """

    def __init__(self, clients: Sequence[Any], *, name: str):
        self.clients = list(clients)
        self.name = name
        self.pool = (
            ThreadPoolExecutor(len(self.clients), thread_name_prefix=f"{name}-shard") if len(clients) > 1 else None
        )
        self.streams: list[PushStream] = []  # the streamed push of the step now (one stream per shard)
        self.stream_calls: list[Future] = []  # their calls (each ends when its reply is all in, or failed)
        self._push_threads: list[ThreadPoolExecutor] = []
        self.traffic: list[tuple[int, int]] = []  # (sent, received) of each call of the last run
        self.unclosed: set[int] = set()  # the shards whose stream of the streamed push now takes parts still
        self.heartbeats: Heartbeats | None = None

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.clients)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.clients)

    def run(self, exchange: Exchange[T]) -> T:
        """Carry ``exchange`` to its outcome (raises what it raises); :attr:`traffic` counts its calls' bytes."""
        self.traffic: list[tuple[int, int]] = []
        return run_blocking(exchange, self.perform, self.pool)

    def push_step(
        self,
        machine: StepMachine,
        request: pb.PushRequest,
        payloads: Sequence[Sequence[Any]],
        buffers: Sequence[Any],
        times: tuple[float, float, float],
        *,
        traced: bool = False,
    ) -> Received | Rejoined:
        """Push ``payloads`` (each shard's) with ``request`` and ``buffers``, wait for the reply and settle it with
        :meth:`figures` (``times``: the step's gradient and compression seconds, and when compression ended: its
        communication seconds run from there); the outcome (:class:`~src.ps.worker.machine.Rejoined`: the push was
        lost with a session, and the registration settled it). ``traced``: the push is a span of the process's trace.
        """
        gradient_s, compression_s, compressed = times
        with tracing.span("push", request_id=request.request_id) if traced else nullcontext():
            outcome = self.run(machine.push(request, payloads, buffers))  # blocked on the reply: exposed
        if not isinstance(outcome, Rejoined):
            figures = self.figures(gradient_s, compression_s, time.perf_counter() - compressed, payloads)
            with tracing.span("settle") if traced else nullcontext():  # mostly the reply's tensors into the model
                machine.settle(outcome, figures)
        return outcome

    def close_push(
        self,
        machine: StepMachine,
        streamed: StreamedModel,
        push: PushStreams,
        request: pb.PushRequest,
        buffers: Sequence[Any],
        times: tuple[float, float, float],
        *,
        traced: bool = False,
    ) -> tuple[Received | Rejoined, float]:
        """Close ``push`` (:meth:`open_push`, every gradient handed over) with ``request`` (each shard's hold) and
        ``buffers``, wait for the reply's head (a sharded server's: the commit's reply and the pulls) and settle it
        with :meth:`streamed_figures` (``times``: the step's gradient seconds, when backward ended, and the seconds the
        forwards waited for the last reply's tensors, exposed as the wait for the head is); the outcome (as
        :meth:`push_step`'s), and when it was in. The next forward waits for the reply's tensors, module by module (a
        sharded server's pulls, or a pull after registering again, brought every one). ``traced``: the wait for the
        head is a span of the process's trace."""
        gradient_s, computed, waited_s = times
        with tracing.span("reply_wait", request_id=request.request_id) if traced else nullcontext():
            outcome = self.run(machine.push(request, [], buffers, streamed=True))  # exposed: nothing left to compute
        head_in = time.perf_counter()
        if machine.placement is None and not isinstance(outcome, Rejoined):
            streamed.expect(push.generation)  # the next forward waits for the reply's tensors, module by module
        else:
            streamed.loaded()  # the pulls brought every tensor
        if not isinstance(outcome, Rejoined):
            machine.settle(outcome, self.streamed_figures(gradient_s, head_in - computed + waited_s))
        return outcome, head_in

    def figures(
        self, gradient_s: float, compression_s: float, communication_s: float, payloads: Sequence[Sequence[Any]]
    ) -> StepFigures:
        """The step just pushed, as :meth:`StepMachine.settle <src.ps.worker.machine.StepMachine.settle>` counts it:
        the driver's seconds, the bytes of each shard's ``payloads`` and those the push's calls moved (:attr:`traffic`;
        a streamed push's: its stream's, every part)."""
        payload_bytes = sum(chunk_size(payload) for shard in payloads for payload in shard)
        return self._figures(gradient_s, compression_s, communication_s, payload_bytes)

    def streamed_figures(self, gradient_s: float, communication_s: float) -> StepFigures:
        """:meth:`figures` of the streamed push just closed: its parts' bytes, and the seconds they took to encode
        (its compression time), as its streams counted them."""
        payload_bytes = sum(chunk_size(payload) for stream in self.streams for _, payload in stream.encoded)
        encode_s = sum(stream.encode_s for stream in self.streams)
        return self._figures(gradient_s, encode_s, communication_s, payload_bytes)

    def _figures(self, gradient_s: float, compression_s: float, communication_s: float, payload_bytes: int):
        seconds = (gradient_s, compression_s, communication_s)
        return StepFigures.of(seconds, payload_bytes, self.traffic, (self.bytes_sent, self.bytes_received))

    def stats(self, machine: StepMachine | None, total_time_s: float, emulated_delay_s: float = 0.0) -> pb.WorkerStats:
        """What this process reports with heartbeats and at Finish: ``machine``'s totals (``None``: not yet built)
        with the bytes these connections moved."""
        if machine is None:
            return pb.WorkerStats(total_time_s=total_time_s)
        return machine.stats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            total_time_s=total_time_s,
            emulated_delay_s=emulated_delay_s,
        )

    def start_heartbeats(self, membership: Membership, stats: Callable[[], Any], interval: float, name: str) -> None:
        """Say "alive" to shard 0 every ``interval`` seconds, as ``membership``'s caller with ``stats()``, from a
        thread named ``name`` (:class:`Heartbeats`), until :meth:`close`."""
        shard_0 = self.clients[0]
        beat = lambda: shard_0.heartbeat(membership.caller, stats(), timeout=interval * 2)  # noqa: E731
        self.heartbeats = Heartbeats(beat, interval, name=name)
        self.heartbeats.start()

    def perform(self, call: Call) -> Any:
        """Make ``call`` on its shard's client; its reply. Its bytes go into :attr:`traffic`.

        Raises:
            CallError: the call failed.
        """
        if call.method == PUSH and call.streamed:
            stream = self.streams[call.shard]
            try:
                return self._close_stream(call.shard, call.message, call.tensors.get("buffers", ()))
            finally:
                self.traffic.append((stream.sent_bytes, stream.reply_bytes))
        client = self.clients[call.shard]
        sent, received = client.bytes_sent, client.bytes_received
        try:
            return self._call(client, call)
        finally:
            self.traffic.append((client.bytes_sent - sent, client.bytes_received - received))

    @staticmethod
    def _call(client: Any, call: Call) -> Any:
        message, tensors = call.message, call.tensors
        if call.method == PUSH:
            return client.push(message, tensors.get("gradients", ()), tensors.get("buffers", ()))
        if call.method == PULL:
            return client.pull(message.caller, certificate=message.certificate, parameters_only=message.parameters_only)
        if call.method == REGISTER:
            return client.register(
                message.worker_id,
                message.last_request_id,
                list(message.carried_batch_ids),
                any_worker_id=message.any_worker_id,
            )
        if call.method == FINISH:
            return client.finish(message.caller, message.stats)
        if call.method == INITIALIZE:
            return client.initialize(message, tensors["parameters"], tensors["buffers"])
        raise ValueError(f"unknown call {call.method!r}")

    # ------------------------------------------------------------------------- streamed pushes

    def open_streams(
        self,
        encode: Callable[[int, int], Any],
        on_large: Callable[[str, int, memoryview], Any],
        *,
        pieced: bool,
        on_end: Callable[[PushStream, Future], None] | None = None,
    ) -> list[PushStream]:
        """Open a streamed push to every shard: shard ``k``'s parts are ``encode(k, position)``, encoded on its push
        thread as backward hands them over; every reply's tensors go to ``on_large`` as they arrive; ``pieced``: large
        parts in pieces (for a server that steps slices as they arrive: ``system.pipelined_replies``). ``on_end(stream,
        call)`` runs on the push thread when a stream's call has ended. A shard's streamed push starts once its
        previous one's reply is all in."""
        if not self._push_threads:
            self._push_threads = [
                ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-push{f'-shard-{k}' if k else ''}")
                for k in range(len(self.clients))
            ]
        self.streams = [PushStream(lambda index, k=k: encode(k, index), on_large) for k in range(len(self.clients))]
        self.stream_calls = []
        self.unclosed = set(range(len(self.streams)))
        for k, stream in enumerate(self.streams):
            stream.pieced = pieced
            call = self._push_threads[k].submit(self.clients[k].push_streamed, stream)
            if on_end is not None:
                call.add_done_callback(lambda done, stream=stream: on_end(stream, done))
            self.stream_calls.append(call)
        return self.streams

    def open_push(
        self,
        machine: StepMachine,
        streamed: StreamedModel,
        gradient_of: Callable[[int], Any],
        names: Sequence[str],
        *,
        generation: int,
        pieced: bool,
        traced: bool = False,
    ) -> PushStreams:
        """Open a streamed push to every shard (:meth:`open_streams`) whose parts are ``machine``'s
        (:meth:`StepMachine.encode_part <src.ps.worker.machine.StepMachine.encode_part>`, cut from ``gradient_of(i)``,
        the gradient of tensor ``i`` of ``names``), its reply's tensors going into ``streamed`` as reply
        ``generation`` (broken off after its head: the forward waiting for them raises); ``traced``: each part's
        encoding and the push in flight are spans of the process's trace."""

        def encode(shard: int, position: int) -> Any:  # on the shard's push thread, while backward goes on
            with tracing.span("compress", shard=shard, part=position) if traced else nullcontext():
                return machine.encode_part(shard, position, gradient_of)

        def ended(stream: PushStream, call: Future) -> None:  # the reply is in, or the call failed
            if traced and stream.first_sent is not None:  # the push in flight, hidden or not (reply_wait: what was not)
                tracing.record("push", stream.first_sent, time.perf_counter(), step=machine.totals["steps"] + 1)
            if call.exception() is not None:
                streamed.reply_broken(generation, call.exception())

        generator_state = machine.codec.generator.get_state()  # before any part: restored if the push is given up
        streams = self.open_streams(encode, streamed.on_large(generation), pieced=pieced, on_end=ended)
        slices = machine.codec.slices_of(names)
        return PushStreams(streams, slices, generation=generation, generator_state=generator_state)

    def give_up(self, push: PushStreams, streamed: StreamedModel, codec: PushCodec, error: BaseException) -> None:
        """Give up ``push`` (:meth:`open_push`) before its message: the server drops its parts; the residuals its parts
        updated and the rounding generator go back to where they were, as if nothing had been encoded."""
        self.abort_streams(error)  # returns once nothing more is encoded for it
        streamed.end_backward()  # the push is no longer fed
        codec.give_up(push.encoded_keys(codec.keys), push.generator_state)

    def _close_stream(self, shard: int, message: Any, buffers: Sequence[Any]) -> Received:
        """Close shard ``shard``'s streamed push with ``message`` (which carries the seconds its parts took to
        encode) and ``buffers``; its reply's head, once in.

        Raises:
            CallError: the push failed before its head (its call has ended by then: nothing more is encoded).
        """
        stream = self.streams[shard]
        self.unclosed.discard(shard)

        def encoding_seconds() -> None:  # on the push thread, every part encoded
            message.metrics.compression_time_s = stream.encode_s

        stream.close(Outgoing(message, {"buffers": list(buffers)}), before_send=encoding_seconds)
        try:
            return Received(stream.wait_head(), {})
        except CallError:
            wait([self.stream_calls[shard]])
            raise

    def abort_streams(self, error: BaseException) -> None:
        """Give up the streamed push before its message (the servers drop its parts); returns once every stream's
        call has ended, so nothing more is encoded for it."""
        for stream in self.streams:
            stream.abort(error)
        self.unclosed = set()
        self.wait_streams()

    def wait_streams(self) -> None:
        """Wait until the streamed push's calls have ended: its replies all in, or failed."""
        wait(self.stream_calls)

    def end_streams(self, error: BaseException) -> None:
        """Before Finish: a streamed push still taking parts is given up with ``error``, and the last reply's tensors
        are waited for (so the totals count every byte)."""
        if self.unclosed:
            self.abort_streams(error)
        self.wait_streams()

    def close(self) -> None:
        """Close every shard's client, the threads, and shard 0's client once the heartbeats stopped."""
        for client in self.clients[1:]:
            client.close()
        for pool in [self.pool, *self._push_threads]:
            if pool is not None:
                pool.shutdown()
        if self.heartbeats is not None:
            self.heartbeats.stop_and_close(self.clients[0].close)
        else:
            self.clients[0].close()


class Heartbeats(threading.Thread):
    """Calls ``beat()`` (one heartbeat call) every ``interval`` seconds until :meth:`stop`.

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
            except CallError:
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


__all__ = ["Connections", "Heartbeats"]
