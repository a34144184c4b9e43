"""Virtual time: a parameter-server job in one process, where time is computed by a cost model, not measured.

``run_parameter_server_training.py --clock virtual`` (``system.clock: virtual``) runs the same job
as a real run: the real server core (:class:`~src.ps_core.ServerCore`: membership, the work plan,
the barrier and async apply, staleness, the controller, the downlink, de-dup, checkpoints, events,
the summary) and N simulated workers, each doing the real worker's step
(:class:`~src.worker_step.WorkerStep`: its real gradient on its real batch at the parameters it
last received, error feedback, compression, rollback on rejection, local steps). Only *when* things
happen is simulated, by a discrete-event loop (:mod:`src.event_loop`) over the cost model
(:mod:`src.cost_model`): a worker's step takes its compute seconds, a message crosses the worker's
link and the server NIC (shared fairly by concurrent transfers) in its exact serialized bytes, the
server spends its per-push and per-reply seconds one task at a time. So a run gives the same
numbers on any machine under any load, and 64 workers fit on two cores: they take turns on one
compute model, each keeping only its parameter replica and its residuals.

The messages are the real protocol's bytes (:mod:`src.wire`), so byte counts are exact and the core
cannot tell a simulated worker from a real one. The launcher's part is simulated too:
``--inject-fault`` kills (``kill``), stops (``hang``) or pauses (``pause=SECONDS``) a simulated worker
at its step, or kills the server at a version; the server detects silence by the virtual
heartbeats; a worker declared failed while it runs gets a heartbeat timeout to rejoin by itself (a
paused one does, as the real worker, :func:`src.worker_protocol.failed_call`), else it is hung and
killed (:class:`~src.supervisor.RejoinGrace`); a dead process is restarted after
``emulation.restart_s`` (budget ``system.max_restarts``), a restarted server resumes from its newest
checkpoint and the workers register with it again, exactly as :mod:`src.ps_launcher` does for real
processes.

Outputs are a real run's (``summary.json`` with ``clock: virtual``, ``events.jsonl`` per role with
virtual times, TensorBoard, checkpoints, and with ``system.trace`` a ``trace.json`` per simulated
process whose spans are in virtual microseconds from 0: :class:`VirtualTimelines`), so the report, plots and findings scripts read them as
they are. Evaluations and checkpoints take no virtual time. The summary lists in
``wall_time_fields`` the fields that are wall time (they differ between two runs of the same config):
``wall_time_s`` (set-up and event loop), ``wall_loop_s`` (the event loop alone; the final evaluation
and checkpoint come after both) and ``wall_compute_s`` (the part of the loop spent computing the
workers' forward/backward passes: ``wall_loop_s / wall_compute_s`` is the driver's own overhead).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from src import parameter_server_pb2 as pb
from src.aggregation import RequestLog
from src.checkpoint import unfinished_run_checkpoint
from src.config import Config, SetupError
from src.coordinator import Member
from src.cost_model import CostModel
from src.data import load_dataset
from src.event_loop import EventLoop, SerialServer, SharedLink
from src.faults import FaultInjector, FaultSpec
from src.metrics import EventLog, MetricsLogger
from src.parameter_server import MONITOR_PERIOD_S, planned_work, test_set_for
from src.ps_core import ServerCore
from src.ps_refusals import PushRefused, Refused
from src.supervisor import LaunchError, RejoinGrace, rejoin_grace_s
from src.tracing import TRACE_FILE, Tracer
from src.trainer import model_from_config
from src.wire import Outgoing, serialize, split
from src.worker_protocol import Failure, IncarnationRevoked, Rejoins, failed_call
from src.worker_step import WorkerStep, check_layout

MODEL_STATE = ("parameters", "buffers")


class ServerKilled(BaseException):
    """The simulated server process was killed by an injected fault: whatever it was doing stops."""


@dataclass(eq=False)
class Call:
    """One call of a worker process that the server has not answered yet."""

    worker: "VirtualWorker"
    process: int
    on_reply: Callable[[bytes], None]
    on_error: Callable[[str, str], None]


@dataclass(eq=False)
class Waiter:
    """A Pull or Push parked at the server until its worker's work is there (the sync barrier, or none left)."""

    call: Call
    member: Member
    push: tuple[int, pb.PushReply] | None = None  # (request id, verdict) for a push
    parked_at: float = 0.0  # virtual seconds


class VirtualTimelines:
    """``system.trace`` on the virtual clock: one ``trace.json`` per simulated process, as a real run's.

    The server's (``server/trace.json``) has its serial CPU's tasks (``apply``: a push's
    ``server_update_s``, ``reply``: ``server_reply_s``) on one thread and each worker's parked calls
    (``barrier_wait``) on a thread of their own; each worker's (``worker_<k>/trace.json``) has
    ``step`` > ``forward_backward``, ``compress``, ``push``. Spans are written with the times the
    simulation decided (:meth:`src.tracing.Tracer.complete`), so they are the cost model's, not the
    machine's; the processes get made-up pids (1: server, 2 + k: worker k).
    """

    SERVER_PID, CPU_THREAD = 1, 1

    def __init__(self, config: Config, clock):
        self.enabled = config.system.trace
        self.log_dir = Path(config.system.log_dir)
        self.clock = clock
        self._tracers: dict[int, Tracer] = {}

    def _tracer(self, pid: int) -> Tracer:
        tracer = self._tracers.get(pid)
        if tracer is None:
            role, name = (
                ("server", "parameter server") if pid == self.SERVER_PID else (f"worker_{pid - 2}", f"worker {pid - 2}")
            )
            tracer = self._tracers[pid] = Tracer(
                self.log_dir / role / TRACE_FILE, f"{name} (virtual time)", pid=pid, clock=lambda: self.clock.now
            )
        return tracer

    def server(self, name: str, start_s: float, *, calls_of: int | None = None, **args: Any) -> None:
        """A server span from ``start_s`` to now: on the CPU thread, or on the thread of worker ``calls_of``'s calls."""
        if self.enabled:
            tid, thread = (
                (self.CPU_THREAD, "cpu") if calls_of is None else (2 + calls_of, f"calls of worker {calls_of}")
            )
            self._tracer(self.SERVER_PID).complete(
                name, start_s * 1e6, self.clock.now * 1e6, args or None, tid=tid, thread_name=thread
            )

    def worker(self, worker: int, name: str, start_s: float, end_s: float | None = None, **args: Any) -> None:
        """A span of worker ``worker`` from ``start_s`` to ``end_s`` (default: now)."""
        if self.enabled:
            end_s = self.clock.now if end_s is None else end_s
            self._tracer(2 + worker).complete(name, start_s * 1e6, end_s * 1e6, args or None, tid=1, thread_name="main")

    def close(self) -> None:
        for tracer in self._tracers.values():
            tracer.close()


class VirtualRun:
    """One virtual-time job: the server core, the simulated workers and launcher, and the event loop.

    Args:
        config: the run's config (``emulation`` holds the cost model's figures).
        resume: continue the server from this checkpoint (file or folder).
        tensorboard: TensorBoard scalars beside the events (off for benchmarks).

    Raises:
        SetupError: a figure the cost model needs is missing (names the field and the calibration command).
    """

    def __init__(self, config: Config, *, resume: str | Path | None = None, tensorboard: bool = True):
        self.config = config
        t, system = config.training, config.system
        self.cost = CostModel(config)
        self.loop = EventLoop()
        self.clock = self.loop.clock
        self.tensorboard = tensorboard
        self.resume = resume
        self.train_set = load_dataset(
            t.dataset,
            "train",
            data_dir=t.data_dir,
            max_samples=t.max_train_samples,
            num_samples=t.num_samples,
            seed=t.seed,
        )
        self.test_set = test_set_for(config)
        self.nic_in = SharedLink(self.loop, self.cost.server_bps)
        self.nic_out = SharedLink(self.loop, self.cost.server_bps)
        self.cpu = SerialServer(self.loop)
        self.core: ServerCore | None = None
        self.server_running = False
        self.server_epoch = 0  # one per server process: a call sent to an earlier one fails
        self.open_calls: set[Call] = set()
        self.waiting: dict[int, Waiter] = {}
        self.held_for_server: list[Callable[[], None]] = []  # registrations waiting for a server to come up
        self.downlink_delay_s: Counter[int] = Counter()
        self.restarts: Counter[str] = Counter()
        self.compute_wall_s = 0.0  # wall seconds spent computing the workers' gradients (the benchmark's reference)
        self.timelines = VirtualTimelines(config, self.clock)
        self.launcher_log = EventLog(Path(system.log_dir) / "launcher" / "events.jsonl", clock=self.clock.time)
        self.revoked = RejoinGrace(rejoin_grace_s(system))  # workers failed while alive: hung, or rejoining
        self.compute_model = model_from_config(config)  # every simulated worker computes in it, in turn
        self.compute_model.train()
        self.workers = [VirtualWorker(self, k) for k in range(system.num_workers)]

    # ------------------------------------------------------------------------- the run

    def run(self, summary_json: str | Path | None = None) -> dict[str, Any]:
        """Simulate the job to its end; returns the run summary (also written, as a real run's).

        Raises:
            LaunchError: the run cannot finish (every worker's restart budget spent, the server's too).
        """
        started = time.perf_counter()
        try:
            self._start_server(resume=self.resume, faults=True)
            for worker in self.workers:
                worker.start(faults=True)
            looping = time.perf_counter()
            finished = self.loop.run(until=lambda: self.core is not None and self.core.done.is_set())
            if not finished:
                raise LaunchError(
                    f"the virtual run stalled at virtual time {self.clock.now:.3f} s with nothing left to "
                    f"happen (every process dead or waiting)"
                )
            if self.core.fatal is not None:
                raise self.core.fatal
            # The last Finish replies are still on their way: deliver them (the worker then writes its
            # run_end and gradient ledger), as a real launcher waits for its workers to exit.
            self.loop.run(until=lambda: not any(w.finishing for w in self.workers))
            looped = time.perf_counter()
            return self.core.finalize(
                summary_json,
                downlink_delay_s=self._downlink_delays(),
                extra={
                    "wall_time_s": looped - started,
                    "wall_loop_s": looped - looping,
                    "wall_compute_s": self.compute_wall_s,
                    "wall_time_fields": ["wall_time_s", "wall_loop_s", "wall_compute_s"],
                    "cost_model": self.cost.describe(),
                    "virtual_events": self.loop.processed,
                },
            )
        finally:
            for worker in self.workers:
                worker.close_log()
            if self.core is not None:
                self.core.close()
            self.launcher_log.close()
            self.timelines.close()

    def _downlink_delays(self) -> dict[int, float]:
        """Seconds each worker's replies spent on its emulated downlink (workers with one)."""
        return {
            k: self.downlink_delay_s[k] for k, w in enumerate(self.cost.workers) if w.conditions.downlink is not None
        }

    # ------------------------------------------------------------------------- the server process

    def _start_server(self, *, resume: str | Path | None, faults: bool) -> None:
        self.core = ServerCore(
            self.config,
            work=planned_work(self.config, len(self.train_set)),
            model=model_from_config(self.config),
            test_set=self.test_set,
            tensorboard=self.tensorboard,
            resume=resume,
            faults=faults,
            fire_fault=self._server_fault,
            clock=self.clock,
        )
        self.core.model.serving = True
        self.server_running = True
        self.server_epoch += 1
        self.core.log.event("listening", address="virtual", port=0)
        self._monitor(self.server_epoch)
        held, self.held_for_server = self.held_for_server, []
        for deliver in held:
            deliver()

    def _monitor(self, epoch: int) -> None:
        """Failure detection every :data:`MONITOR_PERIOD_S`, as the real server's monitor thread."""
        if epoch != self.server_epoch or not self.server_running or self.core.done.is_set():
            return
        self._serve(lambda: self._publish(self.core.expire()))
        self.loop.after(MONITOR_PERIOD_S, lambda: self._monitor(epoch))

    def _server_fault(self, fault: FaultSpec) -> None:
        raise ServerKilled(str(fault))

    def _server_died(self, reason: str) -> None:
        """The server process is gone: its open calls fail; the launcher restarts it from its newest checkpoint."""
        self.core.log.close()
        self.server_running = False
        self.cpu.reset()
        self.waiting.clear()
        for call in list(self.open_calls):
            self._fail(call, "UNAVAILABLE", "the parameter server went away")
        attempt = self._spend_restart("server")
        if attempt is None:
            raise LaunchError(
                f"parameter server {reason}; its restart budget (system.max_restarts="
                f"{self.config.system.max_restarts}) is spent"
            )
        checkpoint = unfinished_run_checkpoint(self.config.system.checkpoint_dir, "parameter_server")
        self.launcher_log.write(
            "server_restarted", attempt=attempt, exit=reason, resumed_from=str(checkpoint) if checkpoint else None
        )
        self.loop.after(self.cost.restart_s, lambda: self._start_server(resume=checkpoint, faults=False))

    def _serve(self, action: Callable[[], None]) -> None:
        """Run one server action (lock held), then let waiting calls whose work is now there go on."""
        try:
            with self.core.lock:
                action()
                self._wake()
        except ServerKilled as killed:
            self._server_died(f"killed by SIGKILL ({killed})")

    # ------------------------------------------------------------------------- messages

    def call(
        self,
        worker: "VirtualWorker",
        data: bytes,
        handle: Callable[[Call, bytes], None],
        on_reply: Callable[[bytes], None],
        on_error: Callable[[str, str], None],
        *,
        wait_for_server: bool = False,
    ) -> None:
        """Send ``data`` from ``worker`` over its uplink and the server NIC; the server ``handle``\\ s it on arrival.

        ``wait_for_server``: a server that is down takes the call when it is up again (gRPC's
        ``wait_for_ready``, which registration uses); otherwise the call fails UNAVAILABLE.
        """
        costs = self.cost.workers[worker.worker_id]
        call = Call(worker, worker.process, on_reply, on_error)
        epoch = self.server_epoch
        sent_at = self.clock.now
        worker.bytes_sent += len(data)

        def arrived() -> None:
            worker.uplink_delay_s += self.clock.now - sent_at
            if self.server_running and (epoch == self.server_epoch or wait_for_server):
                self.open_calls.add(call)
                self._serve(lambda: handle(call, data))
            elif wait_for_server:
                self.held_for_server.append(
                    lambda: (self.open_calls.add(call), self._serve(lambda: handle(call, data)))
                )
            else:
                self._deliver(call, lambda: call.on_error("UNAVAILABLE", "the parameter server is not reachable"))

        self.nic_in.send(
            8 * len(data),
            self.cost.uplink_bps(worker.worker_id, sent_at),
            lambda: self.loop.after(costs.uplink_latency_s, arrived),
        )

    def _reply(self, call: Call, data: bytes) -> None:
        """Send the server's reply back over the server NIC and the worker's downlink."""
        self.open_calls.discard(call)
        worker = call.worker
        costs = self.cost.workers[worker.worker_id]
        sent_at = self.clock.now

        def arrived() -> None:
            self.downlink_delay_s[worker.worker_id] += self.clock.now - sent_at
            if worker.reachable(call.process):
                worker.bytes_received += len(data)
                call.on_reply(data)

        self.nic_out.send(8 * len(data), costs.downlink_bps, lambda: self.loop.after(costs.downlink_latency_s, arrived))

    def _fail(self, call: Call, code: str, message: str) -> None:
        """The call ends with an error status (a small message: its latency only)."""
        self.open_calls.discard(call)
        costs = self.cost.workers[call.worker.worker_id]
        self.loop.after(costs.downlink_latency_s, lambda: self._deliver(call, lambda: call.on_error(code, message)))

    @staticmethod
    def _deliver(call: Call, callback: Callable[[], None]) -> None:
        if call.worker.reachable(call.process):
            callback()

    # ------------------------------------------------------------------------- the server's side of each call

    def serve_register(self, call: Call, data: bytes) -> None:
        try:
            reply, events = self.core.register(
                pb.RegisterRequest.FromString(data), f"virtual:worker-{call.worker.worker_id}"
            )
        except Refused as refused:
            self._fail(call, refused.code, refused.message)
            return
        self._reply(call, reply.SerializeToString())
        self._publish(events)

    def serve_pull(self, call: Call, data: bytes) -> None:
        try:
            member = self.core.begin_pull(pb.PullRequest.FromString(data).caller)
        except Refused as refused:
            self._fail(call, refused.code, refused.message)
            return
        self.waiting[member.worker_id] = Waiter(call, member, parked_at=self.clock.now)

    def serve_push(self, call: Call, data: bytes) -> None:
        """The push takes ``server_update_s`` of the server's time; its reply follows it at once when its work is there."""

        def take() -> None:
            self.timelines.server("apply", self.clock.now - self.cost.server_update_s, worker=call.worker.worker_id)
            self._serve(lambda: self._take_push(call, data))

        self.cpu.submit(self.cost.server_update_s, take)

    def _take_push(self, call: Call, data: bytes) -> None:
        core = self.core
        try:
            received = split(data, pb.PushRequest, ("gradients", "buffers"))
        except ValueError as exc:
            refused = PushRefused("INVALID_ARGUMENT", f"push: {exc}")
            core.refused(None, 0, refused)
            self._fail(call, refused.code, refused.message)
            return
        request = received.message
        worker_id, request_id = request.caller.worker_id, request.request_id
        try:
            admitted = core.begin_push(request.caller, request)
            if admitted is RequestLog.IN_PROGRESS:
                raise RuntimeError(f"worker {worker_id}: a second copy of push {request_id} while the first is handled")
            if isinstance(admitted, bytes):
                self._reply(call, admitted)  # a retry: answer again, apply nothing
                return
            try:
                verdict = core.apply_push(admitted, request, core.decode(worker_id, received))
            except Refused:
                core.abandon(worker_id, request_id)
                raise
        except Refused as refused:
            if isinstance(refused, PushRefused):
                core.refused(worker_id, request_id, refused)
            self._fail(call, refused.code, refused.message)
            return
        self.waiting[worker_id] = Waiter(call, admitted, (request_id, verdict), parked_at=self.clock.now)
        self._wake(first=worker_id)

    def serve_heartbeat(self, call: Call, data: bytes) -> None:
        request = pb.HeartbeatRequest.FromString(data)
        try:
            self._reply(call, self.core.heartbeat(request.caller, request.stats).SerializeToString())
        except Refused as refused:
            self._fail(call, refused.code, refused.message)

    def serve_finish(self, call: Call, data: bytes) -> None:
        request = pb.FinishRequest.FromString(data)
        try:
            self._reply(call, self.core.finish(request.caller, request.stats).SerializeToString())
        except Refused as refused:
            self._fail(call, refused.code, refused.message)

    def _wake(self, first: int | None = None) -> None:
        """Every parked call whose work is there now gets its reply built (``server_reply_s`` each, in worker
        order; ``first``'s right away: the real server builds it under the same lock as the push)."""
        core = self.core
        for worker_id in sorted(self.waiting, key=lambda w: (w != first, w)):
            waiter = self.waiting[worker_id]
            try:
                work = core.poll_work(waiter.member)
            except Refused as refused:
                del self.waiting[worker_id]
                if waiter.push is not None:
                    core.abandon(worker_id, waiter.push[0])
                self._fail(waiter.call, refused.code, refused.message)
                continue
            if work is None:
                continue
            del self.waiting[worker_id]
            self.timelines.server("barrier_wait", waiter.parked_at, calls_of=worker_id, worker=worker_id)
            self.cpu.submit(
                self.cost.server_reply_s,
                lambda w=waiter, work=work: self._serve(lambda: self._build_reply(w, work)),
                first=worker_id == first,
            )

    def _build_reply(self, waiter: Waiter, work) -> None:
        self.timelines.server("reply", self.clock.now - self.cost.server_reply_s, worker=waiter.member.worker_id)
        if waiter.push is None:
            data = self.core.pull_reply(waiter.member, work)
        else:
            request_id, verdict = waiter.push
            data = self.core.push_reply(waiter.member, request_id, verdict, work)
        self._reply(waiter.call, data)

    # ------------------------------------------------------------------------- the launcher's part

    def _publish(self, events: list) -> None:
        """A worker the server declared failed while its process still runs gets its grace to rejoin; after it, a
        process that did not is hung and killed (:class:`~src.supervisor.RejoinGrace`, as :mod:`src.ps_launcher`)."""
        for kind, fields in events:
            worker = self.workers[fields["worker"]]
            if kind == "worker_failed" and worker.alive and worker.pid == fields["pid"]:
                self.revoked.failed(worker.worker_id, worker.pid, self.clock.now)
                self.loop.after(self.revoked.grace_s, self._kill_hung)
            elif kind == "worker_rejoined" and worker.worker_id in self.revoked.waiting:
                self.revoked.rejoined(worker.worker_id, fields["pid"])
                if worker.worker_id not in self.revoked.waiting:
                    self.launcher_log.write(
                        "worker_rejoined_by_itself",
                        worker=worker.worker_id,
                        pid=fields["pid"],
                        incarnation=fields["incarnation"],
                    )

    def _kill_hung(self) -> None:
        for worker_id, pid in self.revoked.due(self.clock.now):
            worker = self.workers[worker_id]
            if worker.alive and worker.pid == pid:
                self.launcher_log.write(
                    "worker_killed",
                    worker=worker_id,
                    pid=pid,
                    reason="declared failed by the server while its process was alive, and it did not rejoin (hung)",
                )
                worker.end("killed by SIGKILL")

    def _spend_restart(self, name: str) -> int | None:
        used = self.restarts[name]
        if used >= self.config.system.max_restarts:
            return None
        self.restarts[name] = used + 1
        return used + 1

    def process_ended(self, worker: "VirtualWorker", exit_description: str) -> None:
        """A worker process ended abnormally: restart it after ``restart_s``, or go on without it."""
        attempt = self._spend_restart(f"worker-{worker.worker_id}")
        if attempt is None:
            self.launcher_log.write("worker_abandoned", worker=worker.worker_id, exit=exit_description)
            if not any(w.alive for w in self.workers):
                raise LaunchError(
                    f"every worker has failed and the restart budgets (system.max_restarts="
                    f"{self.config.system.max_restarts}) are spent"
                )
            return
        self.launcher_log.write("worker_restarted", worker=worker.worker_id, attempt=attempt, exit=exit_description)
        self.loop.after(self.cost.restart_s, lambda: worker.start(faults=False))


class VirtualWorker:
    """A simulated worker process: the real worker's protocol (:class:`src.worker.Worker`) driven by events.

    Its parameter replica (what the server last sent it) outlives its processes: a restarted process
    pulls into the same tensors.
    """

    def __init__(self, run: VirtualRun, worker_id: int):
        self.run = run
        self.worker_id = worker_id
        self.config = run.config
        self.process = 0
        self.alive = False
        self.hung = False
        self.pause_s: float | None = None  # a pause fault: how long until the stopped process runs again
        self.beating = 0  # the heartbeat chain that is current (a resumed process starts a new one)
        self.rejoins = Rejoins(worker_id, run.config.system.max_rejoins)
        self.last_failure: Failure | None = None
        self.finishing = False  # a Finish is on its way
        model = run.compute_model
        self.replica = (
            [torch.zeros_like(p) for p in model.parameters() if p.requires_grad],
            [torch.zeros_like(b) for b in model.buffers() if b.is_floating_point()],
        )
        self.step: WorkerStep | None = None
        self.log: MetricsLogger | None = None
        self.caller = pb.Caller(worker_id=worker_id)
        self.incarnation = 0
        self.bytes_sent = self.bytes_received = 0
        self.uplink_delay_s = self.compute_extra_s = 0.0
        self.started_at = 0.0
        self.step_started = 0.0  # virtual seconds: when the step now computing was handed its work

    @property
    def pid(self) -> int:
        """A process id unique to this worker's process number (what registration reports)."""
        return (self.worker_id + 1) * 10_000 + self.process

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
        self.rejoins = Rejoins(self.worker_id, self.config.system.max_rejoins)  # a new process: a new budget
        self.step = None
        self.caller = pb.Caller(worker_id=self.worker_id)
        self.bytes_sent = self.bytes_received = 0
        self.uplink_delay_s = self.compute_extra_s = 0.0
        self.started_at = self._now()
        self.faults = FaultInjector(self.config.system.inject_faults, "worker", self.worker_id, enabled=faults)
        self._register(0, [], self._first_registration)

    def end(self, exit_description: str | None) -> None:
        """This process ends (``None``: it finished; otherwise how it died, for the launcher)."""
        if not self.alive:
            return
        self.alive = self.finishing = False
        self.close_log()
        if exit_description is not None:
            self.run.process_ended(self, exit_description)

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

    # ------------------------------------------------------------------------- calls

    def _call(self, data: bytes, handle, on_reply, on_error=None, *, wait_for_server: bool = False) -> None:
        self.run.call(self, data, handle, on_reply, on_error or self._failed, wait_for_server=wait_for_server)

    def _failed(self, code: str, message: str) -> None:
        """A call failed for a reason the real worker does not recover from."""
        raise LaunchError(f"worker {self.worker_id}: parameter server call failed: {code}: {message}")

    def _after_failure(self, code: str, message: str, then: Callable[[], None], *, in_flight: int = 0) -> None:
        """A call failed: register again after a lost session or a revoked incarnation and go on with ``then``
        (settling the push ``in_flight``, its request id), as the real worker; a revoked worker whose
        rejoin budget is spent exits 1; any other failure is the run's error."""
        try:
            failure = failed_call(code, message, self.worker_id, self.rejoins)
        except IncarnationRevoked:
            self.end("exited with status 1")  # the launcher restarts it
            return
        if failure is None:
            self._failed(code, message)
            return
        step = self.step
        self.last_failure = failure
        if failure == "revoked":
            step.begin_incarnation(self._stats())

        def registered(registration: pb.RegisterReply) -> None:
            applied = bool(in_flight) and registration.last_request_applied
            step.rejoined(failure, in_flight=bool(in_flight), applied=applied)
            then()

        self._register(in_flight, step.carried_to_register(failure), registered)

    def _register(
        self, last_request_id: int, carried: list[pb.Batch], then: Callable[[pb.RegisterReply], None]
    ) -> None:
        request = pb.RegisterRequest(
            worker_id=self.worker_id,
            last_request_id=last_request_id,
            carried_batch_ids=[b.batch_id for b in carried],
            pid=self.pid,
        )

        def registered(data: bytes) -> None:
            registration = pb.RegisterReply.FromString(data)
            self.caller = pb.Caller(worker_id=self.worker_id, session=registration.session)
            self.incarnation = registration.incarnation
            then(registration)

        self._call(request.SerializeToString(), self.run.serve_register, registered, wait_for_server=True)

    def _first_registration(self, registration: pb.RegisterReply) -> None:
        run, config = self.run, self.config
        check_layout(self.worker_id, config, run.compute_model, registration)
        self.log = MetricsLogger(
            Path(config.system.log_dir) / f"worker_{self.worker_id}",
            tensorboard=run.tensorboard and "tensorboard" in config.metrics.trackers,
            role="worker",
            worker=self.worker_id,
            clock=run.clock.time,
        )
        seed = random.Random(config.training.seed * 1_000_003 + self.worker_id * 1_009 + self.process)
        self.step = WorkerStep(
            config,
            self.worker_id,
            model=run.compute_model,
            train_set=run.train_set,
            device=torch.device("cpu"),
            log=self.log,
            replica=self.replica,
            faults=self.faults,
            fire_fault=self._fault,
            request_ids=seed.getrandbits(62) or 1,
        )
        self._heartbeat(self.process, self._new_heartbeat_chain())
        self._pull(first=True)

    def _new_heartbeat_chain(self) -> int:
        self.beating += 1
        return self.beating

    def _heartbeat(self, process: int, chain: int) -> None:
        """Every ``heartbeat_interval`` from the first registration on, while the process runs (not when stopped)."""
        if not self.reachable(process) or chain != self.beating:
            return
        if self.step is not None:
            request = pb.HeartbeatRequest(caller=self.caller, stats=self._stats())
            self._call(
                request.SerializeToString(), self.run.serve_heartbeat, lambda data: None, lambda code, message: None
            )  # a failed heartbeat is ignored, as the real worker's
        self.run.loop.after(self.config.system.heartbeat_interval, lambda: self._heartbeat(process, chain))

    def _stats(self) -> pb.WorkerStats:
        return self.step.stats(
            bytes_sent=self.bytes_sent,
            bytes_received=self.bytes_received,
            total_time_s=self._now() - self.started_at,
            emulated_delay_s=self.compute_extra_s + self.uplink_delay_s,
        )

    # ------------------------------------------------------------------------- training

    def _pull(self, *, first: bool = False) -> None:
        def pulled(data: bytes) -> None:
            received = split(data, pb.PullReply, MODEL_STATE)
            self.step.load(received)
            if first:
                self.log.event("run_start", address="virtual", incarnation=self.incarnation, version=self.step.version)
            else:
                self.log.event(
                    "rejoined", incarnation=self.incarnation, version=self.step.version, after=self.last_failure
                )
            self._work(received)

        request = pb.PullRequest(caller=self.caller)
        self._call(
            request.SerializeToString(),
            self.run.serve_pull,
            pulled,
            lambda code, message: self._after_failure(code, message, lambda: self._pull(first=first)),
        )

    def _work(self, received) -> None:
        """A reply arrived: finish, or compute the handed batches (their compute seconds from now)."""
        if received.message.work.finished:
            self._finish()
            return
        batches = list(received.message.work.batches)
        step_s, extra_s = (
            self.run.cost.step_s(self.worker_id, sum(len(b.indices) for b in batches)) if batches else (0.0, 0.0)
        )
        process = self.process
        self.step_started = self._now()
        self.run.loop.after(step_s, lambda: self._computed(process, batches, step_s, extra_s))

    def _computed(self, process: int, batches: list[pb.Batch], step_s: float, extra_s: float) -> None:
        """The step's compute time has passed: its real gradient and payloads, then the push after ``compress_s``."""
        if not self.reachable(process):
            return
        step = self.step
        computing = time.perf_counter()
        loss, correct, samples = step.compute(batches)
        self.run.compute_wall_s += time.perf_counter() - computing
        self.compute_extra_s += extra_s
        self.run.timelines.worker(
            self.worker_id, "forward_backward", self._now() - step_s, step=step.totals["steps"] + 1
        )
        step.reach_step()
        if not (self.alive and self.process == process) or (self.hung and self.pause_s is None):
            return  # the fault killed or stopped this process before it sent anything
        # Encoded now, while the shared compute model holds this worker's gradient (a real paused process
        # encodes once it runs again: the same payloads, since nothing they are made of changes meanwhile).
        payloads = step.encode(batches)
        compress_s = self.run.cost.compress_s
        request = step.request(
            self.caller, batches, loss, correct, gradient_time_s=step_s, compression_time_s=compress_s
        )
        data = serialize(Outgoing(request, {"gradients": payloads, "buffers": step.buffers_to_send(batches)}))
        payload_bytes = sum(len(p) for p in payloads)
        del payloads
        step_started = self.step_started

        def send() -> None:
            if not self.reachable(process):
                return
            sent_at = self._now()
            received_before = self.bytes_received
            self.run.timelines.worker(self.worker_id, "compress", sent_at - compress_s)

            def replied(reply_data: bytes) -> None:
                reply = split(reply_data, pb.PushReply, MODEL_STATE + ("parameter_deltas",))
                step.settle(
                    reply,
                    batches,
                    request,
                    payload_bytes=payload_bytes,
                    loss=loss,
                    correct=correct,
                    samples=samples,
                    gradient_time_s=step_s,
                    compression_time_s=compress_s,
                    communication_time_s=self._now() - sent_at,
                    push_bytes=len(data),
                    reply_bytes=self.bytes_received - received_before,
                    bytes_sent=self.bytes_sent,
                    bytes_received=self.bytes_received,
                )
                timelines = self.run.timelines
                timelines.worker(self.worker_id, "push", sent_at, request_id=request.request_id)
                timelines.worker(self.worker_id, "step", step_started, step=step.totals["steps"])
                self._work(reply)

            def failed(code: str, message: str) -> None:
                self._after_failure(code, message, self._pull, in_flight=request.request_id)

            self._call(data, self.run.serve_push, replied, failed)

        if self.hung:  # paused: the process goes on (compresses, pushes) once it runs again
            self.run.loop.after(
                self.pause_s, lambda: self._resumed(process, lambda: self.run.loop.after(compress_s, send))
            )
        else:
            self.run.loop.after(compress_s, send)

    def _finish(self) -> None:
        stats = self._stats()
        self.finishing = True

        def finished(data: bytes) -> None:
            self.finishing = False
            result = {field.name: getattr(stats, field.name) for field in pb.WorkerStats.DESCRIPTOR.fields}
            self.step.write_ledger(self.config.system.log_dir)
            self.log.event("run_end", incarnation=self.incarnation, **result)
            self.end(None)

        request = pb.FinishRequest(caller=self.caller, stats=stats)

        def failed(code: str, message: str) -> None:
            self.finishing = False
            self._after_failure(code, message, self._pull)

        self._call(request.SerializeToString(), self.run.serve_finish, finished, failed)


def run_virtual(
    config: Config,
    *,
    summary_json: str | Path | None = None,
    resume: str | Path | None = None,
    tensorboard: bool = True,
) -> dict[str, Any]:
    """Run a parameter-server job in virtual time (see the module docstring); returns the run summary.

    Raises:
        SetupError: the config lacks a figure the cost model needs, or is not a parameter-server run.
        LaunchError: the run cannot finish.
    """
    if config.system.architecture != "parameter_server":
        raise SetupError(f"system.clock: virtual runs a parameter-server job here, not {config.system.architecture}")
    return VirtualRun(config, resume=resume, tensorboard=tensorboard).run(summary_json)
