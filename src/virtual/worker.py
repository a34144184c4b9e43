"""A simulated worker process of a virtual-time run: the real worker's step machine, driven by events.

:class:`VirtualWorker` carries the step machine that :class:`src.worker.Worker` carries
(:class:`~src.ps.worker.machine.StepMachine`: register, pull, push, settle, rejoin, finish, whole or streamed, on one
server or on every shard of a sharded one) and computes the real worker's gradients
(:class:`~src.ps.worker.compute.WorkerCompute`) on its real batches; only its timing comes from the cost model: the
step's compute seconds, then ``compress_s``, then the calls of each exchange, each message on the worker's links
(:mod:`src.virtual.network`) to the simulated server shard it goes to (:class:`~src.virtual.server.VirtualServer`,
:class:`~src.virtual.follower.VirtualFollower`): the real protocol's bytes. Injected faults kill, stop (``hang``) or
pause it at a step; a failed call means what the machine says it means (register again, or exit 1 for the launcher to
restart it).

With ``system.streaming`` it takes the real streamed worker's step, timed by :mod:`src.emulation.overlap` over the
model's layers (:mod:`src.virtual.layers`): the step's compute seconds spread over the layers; the forward waits,
layer by layer, for the tensors of the reply it computes from; backward hands each gradient over as its layer's
segment ends (in the order the real worker's hooks record), and its part (each shard's slices of it) goes on the
worker's connection to that shard as soon as it is encoded, the parts one after another; the push's message (each
shard's hold) follows after backward. The reply comes down in pieces: its head settles the step and starts the next,
its tensors arrive behind it. The step's exposed communication (``communication_time_s``, as the real streamed worker
reports it) is from the end of backward to the reply's head (a sharded server's: to the pulls' end) plus the forward's
waits. The arithmetic is the unstreamed step's: only when the bytes travel changes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from src import parameter_server_pb2 as pb
from src.common.faults import FaultInjector, FaultSpec
from src.common.seeds import derive_seed
from src.common.supervisor import LaunchError
from src.emulation.overlap import FifoLink, ForwardPass, ready_offsets, shard_encode_times, split_step
from src.metrics import MetricsLogger
from src.ps.worker import (
    Call,
    Exchange,
    IncarnationRevoked,
    Membership,
    Rejoined,
    Rejoins,
    StepFigures,
    StepMachine,
    WorkerCompute,
    check_layout,
    worker_log,
)
from src.ps.worker.calls import FINISH, PULL, PUSH, REGISTER, run_callbacks
from src.transport.errors import CallError
from src.transport.stream import SliceStage, part_pieces, part_size
from src.transport.wire import Outgoing, Received, chunk_size, serialize, split
from src.virtual.layers import reply_pieces
from src.virtual.wiring import ShardCalls, WorkerRun

MODEL_STATE = ("parameters", "buffers")
REPLY_FIELDS = MODEL_STATE + ("parameter_deltas",)


@dataclass
class Push:
    """The push of the step now: what its calls need, and when its messages went (virtual seconds)."""

    key: tuple = ()  # the servers' key for a streamed push's parts
    buffers: list = field(default_factory=list)
    sent_at: float = 0.0  # its first message onto the link (streamed: its message after the parts)
    hold_s: list[float] = field(default_factory=list)  # streamed, per shard: the seconds its parts took to encode
    traffic: list[tuple[int, int]] = field(default_factory=list)  # (sent, received) of each of its calls


class VirtualWorker:
    """A simulated worker process: the real worker's step machine (:class:`src.worker.Worker`'s) driven by events.

    Its parameter replica (what the server last sent it) outlives its processes: a restarted process pulls into the
    same tensors.
    """

    def __init__(self, run: WorkerRun, worker_id: int):
        self.run = run
        self.worker_id = worker_id
        self.config = run.config
        self.process = 0
        self.alive = False
        self.hung = False
        self.pause_s: float | None = None  # a pause fault: how long until the stopped process runs again
        self.beating = 0  # the heartbeat chain that is current (a resumed process starts a new one)
        self.finishing = False  # a Finish is on its way
        self.compress_s = run.cost.compress_s
        """What compressing the latest push cost (none for a push that went uncompressed)."""
        model = run.compute_model
        self.replica = (
            [torch.zeros_like(p) for p in model.parameters() if p.requires_grad],
            [torch.zeros_like(b) for b in model.buffers() if b.is_floating_point()],
        )
        self.membership = Membership(worker_id)
        self.machine: StepMachine | None = None
        self.compute: WorkerCompute | None = None
        self.log: MetricsLogger | None = None
        self.bytes_sent = self.bytes_received = 0
        self.uplink_delay_s = self.compute_extra_s = 0.0
        self.started_at = 0.0
        self.step_started = 0.0  # virtual seconds: when the step now computing was handed its work
        self.push = Push()
        # system.streaming: the reply tensors the next forward needs that have not arrived, the forward in progress,
        # the worker's connection to each server shard (parts, then the push's message, one after another on each;
        # the connections share the worker's link), streamed pushes so far, and what to do once the last reply's
        # tail is in (None: it is in)
        self.arriving: set = set()
        self.forward: ForwardPass | None = None
        self.uplinks: list[FifoLink] = []  # made when a process starts (the run's shards exist by then)
        self.pushes = 0
        self.after_tail: Callable[[], None] | None = None
        self.tail_pending = False
        # system.pipelined_replies: the provisional slices each connection brought this step, until the reply that
        # names them (made with the connections)
        self.stages: list[SliceStage] = []

    @property
    def pid(self) -> int:
        """A process id unique to this worker's process number (what registration reports)."""
        return (self.worker_id + 1) * 10_000 + self.process

    @property
    def targets(self) -> list[ShardCalls]:
        """Every server shard, shard 0 (the server) first; one server: it alone."""
        return self.run.shards or [self.run.server]

    def reachable(self, process: int) -> bool:
        """Whether a message for ``process`` still reaches a running, unstopped process."""
        return self.alive and not self.hung and self.process == process

    def _now(self) -> float:
        return self.run.clock.now

    # ------------------------------------------------------------------------- life

    def start(self, *, faults: bool) -> None:
        """A new process of this worker: register, then pull and train."""
        self.process += 1
        self.alive, self.hung, self.pause_s = True, False, None
        self.membership = Membership(self.worker_id, Rejoins(self.worker_id, self.config.system.max_rejoins))
        self.machine = None
        self.bytes_sent = self.bytes_received = 0
        self.uplink_delay_s = self.compute_extra_s = 0.0
        self.started_at = self._now()
        self.arriving, self.forward = set(), None  # a new process: nothing in flight
        count = len(self.targets)  # new connections to every server shard: their lines up, their slices down
        self.uplinks = [FifoLink() for _ in range(count)]
        self.stages = [SliceStage() for _ in range(count)]
        self.tail_pending, self.after_tail = False, None
        self.faults = FaultInjector(self.config.system.inject_faults, "worker", self.worker_id, enabled=faults)
        self._run(self.membership.register(), self._first_registration)

    def end(self, exit_description: str | None) -> None:
        """This process ends (``None``: it finished; otherwise how it died, for the launcher)."""
        if not self.alive:
            return
        self.alive = self.finishing = False
        self.close_log()
        if exit_description is not None:
            self.run.launcher.process_ended(self, exit_description)

    def close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def _fault(self, fault: FaultSpec) -> None:
        if fault.action == "kill":
            self.end("killed by SIGKILL")
        else:  # SIGSTOP: no more steps, no more heartbeats; the server will declare it failed
            self.hung = True
            self.pause_s = fault.seconds  # pause: it runs again that much later (hang: never)

    def _resumed(self, process: int, go_on: Callable[[], None]) -> None:
        """SIGCONT after a pause: the process goes on where it stopped, heartbeats again (if it still exists)."""
        if not (self.alive and self.process == process):
            return  # the launcher killed it meanwhile
        self.hung, self.pause_s = False, None
        self._heartbeat(process, self._new_heartbeat_chain())
        go_on()

    # ------------------------------------------------------------------------- exchanges on events

    def _run(
        self, exchange: Exchange, done: Callable[[Any], None], start: Callable[[Callable[[], None]], None] | None = None
    ) -> None:
        """Carry ``exchange`` on the event loop (:func:`~src.ps.worker.calls.run_callbacks`), ``done(outcome)`` once
        it returns. The first round's messages are made now (its push's payloads may be views of the gradient the
        shared compute model holds now) and sent by ``start(send)`` (default: at once), each only while this process
        runs. A call the machine does not recover from is the run's error; a revoked incarnation with no rejoin left
        exits 1 (the launcher restarts it)."""
        process = self.process

        def message(call: Call) -> Callable[[Callable[[Any], None]], None]:
            send = self._message(call)
            return lambda reply: send(reply) if self.reachable(process) else None

        run_callbacks(exchange, message, done, start=start, failed=self._failed)

    def _failed(self, error: Exception) -> None:
        if isinstance(error, IncarnationRevoked):
            self.end("exited with status 1")
        elif isinstance(error, CallError):
            raise LaunchError(f"worker {self.worker_id}: parameter server call failed: {error}") from None
        else:
            raise error

    def _message(self, call: Call) -> Callable[[Callable[[Any], None]], None]:
        """``call``'s message, made now; what sends it and hands its reply (or its :class:`CallError`) on."""
        target, message = self.targets[call.shard], call.message
        if call.method == PUSH and call.streamed:
            return partial(self._close_stream, call)
        if call.method == REGISTER:
            message.pid = self.pid
            handle, parse = target.serve_register, lambda data: (pb.RegisterReply.FromString(data), 0)
        elif call.method == FINISH:
            handle, parse = target.serve_finish, lambda data: (pb.FinishReply.FromString(data), 0)
        elif call.method == PULL:
            handle, parse = target.serve_pull, partial(self._pulled_reply, call.shard, message.parameters_only)
        else:  # a push, or a hold, or a commit
            handle, parse = target.serve_push, lambda data: (split(data, pb.PushReply, REPLY_FIELDS), 0)
        if call.method == PUSH:
            data = serialize(Outgoing(message, {name: list(values) for name, values in call.tensors.items()}))
        else:
            data = message.SerializeToString()
        push, wait = self.push, call.method == REGISTER

        def send(reply: Callable[[Any], None]) -> None:
            def replied(reply_data: bytes) -> None:
                received, staged = parse(reply_data)
                push.traffic.append((len(data), len(reply_data) + staged))
                reply(received)

            target.call(
                self,
                data,
                handle,
                replied,
                lambda code, text: reply(CallError(code, text)),
                wait_for_server=wait,
            )

        return send

    def _pulled_reply(self, shard: int, parameters_only: bool, data: bytes) -> tuple[Received, int]:
        """A pull's reply, and the bytes of the provisional slices it takes: a shard's slices (``parameters_only``)
        take those its connection brought (``system.pipelined_replies``: the hold's), as the real client does."""
        received = split(data, pb.PullReply, MODEL_STATE)
        if not parameters_only:
            return received, 0
        return received, self.stages[shard].fill(received)

    # ------------------------------------------------------------------------- registration, heartbeats

    def _first_registration(self, registration: pb.RegisterReply) -> None:
        run, config, system = self.run, self.config, self.config.system
        check_layout(self.worker_id, config, run.compute_model, registration, run.placement)
        self.log = worker_log(config, self.worker_id, tensorboard=run.tensorboard, clock=run.clock.time)
        compute = self.compute = WorkerCompute(
            config, self.worker_id, model=run.compute_model, train_set=run.train_set, device=torch.device("cpu"),
            log=self.log, replica=self.replica, faults=self.faults, fire_fault=self._fault,
        )  # fmt: skip
        seed = random.Random(derive_seed(config.training.seed, self.worker_id, self.process))  # its request ids
        self.machine = compute.step_machine(
            self.membership, system, placement=run.placement, stats=self._stats, request_ids=seed.getrandbits(62) or 1
        )
        self._heartbeat(self.process, self._new_heartbeat_chain())
        self._run(self.machine.start("virtual"), self._pulled)

    def _new_heartbeat_chain(self) -> int:
        self.beating += 1
        return self.beating

    def _heartbeat(self, process: int, chain: int) -> None:
        """Every ``heartbeat_interval`` from the first registration on, while the process runs (not when stopped)."""
        if not self.reachable(process) or chain != self.beating:
            return
        if self.machine is not None:  # a failed heartbeat is ignored, as the real worker's
            request = pb.HeartbeatRequest(caller=self.membership.caller, stats=self._stats())
            server = self.run.server
            server.call(self, request.SerializeToString(), server.serve_heartbeat, lambda _: None, lambda *_: None)
        self.run.loop.after(self.config.system.heartbeat_interval, lambda: self._heartbeat(process, chain))

    def _stats(self) -> pb.WorkerStats:
        return self.machine.stats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            total_time_s=self._now() - self.started_at,
            emulated_delay_s=self.compute_extra_s + self.uplink_delay_s,
        )

    # ------------------------------------------------------------------------- training

    def _work(self, received: Received) -> None:
        """A reply arrived: finish, or compute the handed batches (their compute seconds from now)."""
        if received.message.work.finished:
            if self.tail_pending:  # the last reply's tensors are still arriving: finish once they are in
                self.after_tail = self._finish
            else:
                self._finish()
            return
        batches = list(received.message.work.batches)
        samples = sum(len(b.indices) for b in batches)
        step_s, extra_s = self.run.cost.step_s(self.worker_id, samples) if batches else (0.0, 0.0)
        if self.config.system.streaming:
            self._step_streamed(batches, step_s, extra_s)
            return
        process = self.process
        self.step_started = self._now()
        self.run.loop.after(step_s, lambda: self._computed(process, batches, step_s, extra_s))

    def _rejoined(self, rejoined: Rejoined) -> None:
        """A call was lost with a session: the machine registered again and pulled every tensor."""
        self._pulled(rejoined.work)

    def _pulled(self, received: Received) -> None:
        self.arriving = set()  # every tensor loaded: the next forward waits for none
        self._work(received)

    def _computed(self, process: int, batches: list[pb.Batch], step_s: float, extra_s: float) -> None:
        """The step's compute time has passed: its real gradient and payloads, then the push after ``compress_s``."""
        if not self.reachable(process):
            return
        machine, compute, run = self.machine, self.compute, self.run
        computing = time.perf_counter()
        loss, correct, _ = compute.compute(batches, machine.version, machine.totals["steps"] + 1)
        run.compute_wall_s += time.perf_counter() - computing
        self.compute_extra_s += extra_s
        run.timelines.worker(self.worker_id, "forward_backward", self._now() - step_s, step=machine.totals["steps"] + 1)
        compute.reach_step(machine.totals["steps"] + 1)
        if not (self.alive and self.process == process) or (self.hung and self.pause_s is None):
            return  # the fault killed or stopped this process before it sent anything
        # Encoded now, while the shared compute model holds this worker's gradient (a real paused process encodes
        # once it runs again: the same payloads, since nothing they are made of changes meanwhile).
        payloads = machine.encode(compute.gradients(batches))
        payload_bytes = sum(chunk_size(p) for shard in payloads for p in shard)
        compress_s = self.compress_s = run.cost.push_compress_s(payload_bytes, machine.dense_bytes_per_step)
        request = machine.request(
            batches, loss=loss, correct=correct, gradient_time_s=step_s, compression_time_s=compress_s
        )
        push = self.push = Push()
        step_started = self.step_started

        def start(send: Callable[[], None]) -> None:
            def go() -> None:
                push.sent_at = self._now()
                run.timelines.worker(self.worker_id, "compress", push.sent_at - compress_s)
                send()

            if self.hung:  # paused: the process goes on (compresses, pushes) once it runs again
                run.loop.after(self.pause_s, lambda: self._resumed(process, lambda: run.loop.after(compress_s, go)))
            else:
                run.loop.after(compress_s, go)

        def pushed(outcome: Received | Rejoined) -> None:
            if isinstance(outcome, Rejoined):
                self._rejoined(outcome)
                return
            figures = (step_s, compress_s, self._now() - push.sent_at, payload_bytes)
            self._settle(outcome, figures, 0, (step_started, push.sent_at, request.request_id))

        self._run(machine.push(request, payloads, compute.buffers_to_send(batches)), pushed, start)

    def _settle(self, reply: Received, figures: tuple, part_bytes: int, spans: tuple[float, float, int]) -> None:
        """Settle the step's reply (``figures``: its compute, compression and communication seconds and its payload
        bytes; ``part_bytes``: a streamed push's parts), draw its spans (``spans``: when the step started and its push
        went, its request id) and take the reply's work."""
        step_started, sent_at, request_id = spans
        traffic, totals = [(part_bytes, 0), *self.push.traffic], (self.bytes_sent, self.bytes_received)
        self.machine.settle(reply, StepFigures.of(figures[:3], figures[3], traffic, totals))
        timelines = self.run.timelines
        timelines.worker(self.worker_id, "push", sent_at, request_id=request_id)
        timelines.worker(self.worker_id, "step", step_started, step=self.machine.totals["steps"])
        self._work(reply)

    def _finish(self) -> None:
        self.finishing = True

        def finished(rejoined: Rejoined | None) -> None:
            self.finishing = False
            if rejoined is not None:
                self._rejoined(rejoined)
                return
            self.compute.end_run(self.machine, self.config.system.log_dir)
            self.end(None)

        self._run(self.machine.finish(self._stats), finished)

    # ------------------------------------------------------------------------- a streamed step (system.streaming)

    def _step_streamed(self, batches: list[pb.Batch], step_s: float, extra_s: float) -> None:
        """The real streamed worker's step on ``batches`` (``step_s``: its compute seconds, ``extra_s`` of them an
        emulated straggler's), from now: the forward layer by layer as the reply's tensors arrive, backward handing
        each gradient's parts to the links, the push's message after it, the step settled when the reply's head is in
        (see the module docstring)."""
        run, machine, compute, process = self.run, self.machine, self.compute, self.process
        # The real gradient and parts now (the shared compute model holds this worker's gradient only now), in the
        # order the real worker's hooks hand them over; only when they travel is simulated below.
        computing = time.perf_counter()
        run.gradient_order.begin()
        loss, correct, _ = compute.compute(batches, machine.version, machine.totals["steps"] + 1)
        handed = run.gradient_order.end()
        # (gradient, shard, its position there, its share of the gradient): one part a gradient, or one a slice
        shares = machine.codec.shares_of(compute.names, [p.numel() for p in compute.params])
        units = [(index, k, position, share) for index in handed for k, position, share in shares[index]]
        gradient_of = partial(compute.gradient, batches=batches)
        parts = [(k, position, machine.encode_part(k, position, gradient_of)) for _, k, position, _ in units]
        run.compute_wall_s += time.perf_counter() - computing
        self.compute_extra_s += extra_s
        layers = run.layers
        split_s = split_step(step_s - extra_s, layers.weights)
        backward_s = [b for _, b in split_s]
        offsets = ready_offsets(backward_s, layers.layer_of)
        dense = sum(layers.param_bytes) or 1
        compress_s = run.cost.compress_s
        self.pushes += 1
        push = self.push = Push(key=(self.worker_id, process, self.pushes), buffers=compute.buffers_to_send(batches))
        for stage in self.stages:  # provisional slices of an earlier push do not count
            stage.clear()
        started = self.step_started = self._now()
        first_sent: list[float] = []

        def send_part(k: int, position: int, payload) -> None:
            if not self.reachable(process):
                return
            body = b"".join(part_pieces(position, payload))
            if not first_sent:
                first_sent.append(self._now())
            self.uplinks[k].put(lambda free: self.targets[k].send_part(self, push.key, body, free))

        def forward_done(waited_s: float) -> None:
            if not self.reachable(process):
                return
            backward_started = self._now()
            ready = [backward_started + offsets[index] for index, _, _, _ in units]
            seconds = [compress_s * layers.param_bytes[index] * share / dense for index, _, _, share in units]
            # each connection's parts are encoded on its push's one thread
            encoded, push.hold_s = shard_encode_times(ready, seconds, [k for _, k, _, _ in units], len(self.targets))
            for (k, position, payload), at in zip(parts, encoded):
                run.loop.at(at, lambda k=k, position=position, payload=payload: send_part(k, position, payload))
            computed = backward_started + sum(backward_s) + extra_s
            close_at = max([computed, *encoded])
            streamed = (batches, loss, correct, parts, started, first_sent)
            run.loop.at(computed, lambda: self._computed_streamed(process, streamed, waited_s, close_at))

        def waited(start: float, end: float) -> None:  # the real worker's forward pre-hook span
            run.timelines.worker(self.worker_id, "parameter_wait", start, end)

        self.forward = ForwardPass(run.loop, [f for f, _ in split_s], layers.needs, self.arriving, forward_done, waited)
        self.forward.start()

    def provisional(self, body: bytes, shard: int = 0) -> None:
        """A provisional slice arrived from server shard ``shard`` (``system.pipelined_replies``:
        :mod:`src.virtual.sink`): kept until the reply that names it, as the real client keeps it."""
        self.stages[shard].add(body)

    def _computed_streamed(self, process: int, streamed: tuple, waited_s: float, close_at: float) -> None:
        """Backward (and an emulated straggler's extra seconds) is over: the push's message (each shard's hold), once
        every part is encoded, after the parts on the link; the step settles when the reply's head is in (a sharded
        run's: the commit's reply, once the pulls brought every slice)."""
        if not self.reachable(process):
            return
        run, machine, push = self.run, self.machine, self.push
        batches, loss, correct, parts, started, first_sent = streamed
        computed = self._now()
        run.timelines.worker(self.worker_id, "forward_backward", started, step=machine.totals["steps"] + 1)
        self.compute.reach_step(machine.totals["steps"] + 1)
        if not self.reachable(process) or self.hung:
            return  # faults are refused with streaming in virtual time (src.virtual.run): a kill before the push
        gradient_time_s = computed - started - waited_s
        request = machine.request(
            batches, loss=loss, correct=correct, gradient_time_s=gradient_time_s, compression_time_s=run.cost.compress_s
        )
        part_bytes = sum(part_size(payload) for _, _, payload in parts)
        payload_bytes = sum(chunk_size(payload) for _, _, payload in parts)

        def pushed(outcome: Received | Rejoined) -> None:
            if isinstance(outcome, Rejoined):
                self._rejoined(outcome)
                return
            if run.placement is not None:
                self.arriving, self.tail_pending = set(), False  # the pulls brought every slice
            now = self._now()
            figures = (gradient_time_s, run.cost.compress_s, now - computed + waited_s, payload_bytes)
            run.timelines.worker(self.worker_id, "reply_wait", computed, now, request_id=request.request_id)
            spans = (started, first_sent[0] if first_sent else computed, request.request_id)
            self._settle(outcome, figures, part_bytes, spans)

        def start(send: Callable[[], None]) -> None:
            run.loop.at(close_at, lambda: self.reachable(process) and send())

        self._run(machine.push(request, [], push.buffers, streamed=True), pushed, start)

    def _close_stream(self, call: Call, reply: Callable[[Any], None]) -> None:
        """A streamed push's message (one server's push, or a shard's hold) after its parts on the worker's connection
        to that shard; its reply's head hands the step on (one server's: its tensors arrive behind it, each in when
        its last byte is; the forward waits for them)."""
        shard, message, push = call.shard, call.message, self.push
        if self.run.placement is not None:
            message.metrics.compression_time_s = push.hold_s[shard]
        data = serialize(Outgoing(message, {"buffers": list(call.tensors.get("buffers", ()))}))
        target = self.targets[shard]

        def acknowledged(ack: bytes) -> None:  # a shard's hold: the ack is its whole reply
            push.traffic.append((len(data), len(ack)))
            reply(split(ack, pb.PushReply, ()))

        def on_pieces(reply_data: bytes) -> list[tuple[int, Callable[[], None]]]:
            head, ends, received = reply_pieces(reply_data, pb.PushReply, REPLY_FIELDS)
            # system.pipelined_replies: the tensors the reply leaves out came as slices before it
            loaded = {("parameters", index) for index in received.message.provisional}
            ends = [(end, key) for end, key in ends if key not in loaded]
            arriving = {key for _, key in ends}

            def tensor_in(key) -> None:
                arriving.discard(key)
                if self.forward is not None and self.forward.missing is arriving:
                    self.forward.arrived()

            def head_in() -> None:
                staged = self.stages[0].fill(received)
                self.arriving, self.tail_pending = arriving, True
                push.traffic.append((len(data), len(reply_data) + staged))
                reply(received)

            return [(head, head_in)] + [(end, lambda key=key: tensor_in(key)) for end, key in ends]

        def whole(_reply_data: bytes) -> None:
            self.tail_pending = False
            after, self.after_tail = self.after_tail, None
            if after is not None:
                after()

        def failed(code: str, text: str) -> None:
            reply(CallError(code, text))

        handle = target.serve_streamed_push(push.key)
        if self.run.placement is None:
            send = partial(target.call, self, data, handle, whole, failed, pieces=on_pieces)
        else:
            send = partial(target.call, self, data, handle, acknowledged, failed)
        self.uplinks[shard].put(lambda free: send(sent=free))
