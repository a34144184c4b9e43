"""Virtual time: a parameter-server job in one process, where time is computed by a cost model, not measured.

``run_parameter_server_training.py --clock virtual`` (``system.clock: virtual``) runs the same job
as a real run: the real server core (:class:`~src.ps.server.core.ServerCore`: membership, the work plan,
the barrier and async apply, staleness, the controller, the downlink, de-dup, checkpoints, events,
the summary) and N simulated workers, each doing the real worker's step
(:class:`~src.ps.worker.machine.StepMachine`: its real gradient on its real batch at the parameters it
last received, error feedback, compression, rollback on rejection, local steps). Only *when* things
happen is simulated, by a discrete-event loop (:mod:`src.emulation.event_loop`) over the cost model
(:mod:`src.emulation.cost_model`): a worker's step takes its compute seconds, a message crosses the worker's
link and the server NIC (shared fairly by concurrent transfers) in its exact serialized bytes, the
server spends its per-push and per-reply seconds one task at a time. So a run gives the same
numbers on any machine under any load, and 64 workers fit on two cores: they take turns on one
compute model, each keeping only its parameter replica and its residuals.

The messages are the real protocol's bytes (:mod:`src.transport.wire`), so byte counts are exact and the core
cannot tell a simulated worker from a real one. :class:`VirtualRun` ties the pieces together: the
server process (:mod:`src.virtual.server`), the worker processes (:mod:`src.virtual.worker`) and the
launcher (:mod:`src.virtual.launcher`). The launcher's part is simulated too:
``--inject-fault`` kills (``kill``), stops (``hang``) or pauses (``pause=SECONDS``) a simulated worker
at its step, or kills the server at a version; the server detects silence by the virtual
heartbeats; a worker declared failed while it runs gets a heartbeat timeout to rejoin by itself (a
paused one does, as the real worker, :func:`src.ps.worker.membership.failed_call`), else it is hung and
killed (:class:`~src.common.supervisor.RejoinGrace`); a dead process is restarted after
``emulation.restart_s`` (budget ``system.max_restarts``), a restarted server resumes from its newest
checkpoint and the workers register with it again, exactly as :mod:`src.launch.ps` does for real
processes.

With ``system.num_servers`` = S > 1 (sync) the server is split into S shards as a real sharded run's
(:mod:`src.ps.shards.rounds`): shard 0 is the :class:`~src.virtual.server.VirtualServer` with the run's
:class:`~src.ps.shards.shard_zero.Sharding` (the placement, and the session key from the run's auth token, or a fresh
one per run: every simulated process uses it), the others :class:`~src.virtual.follower.VirtualFollower` objects, each
with its own NIC, its own CPU and its share of the server's times (:func:`~src.emulation.cost_model.shard_times`), over
one network with the workers' links (:mod:`src.virtual.network`). At the end the followers' parts are read as the
real shard 0 reads them (:func:`~src.ps.shards.final.collect_parts`), the whole model is written into
``parameter_server_final.pt`` (:func:`~src.ps.shards.final.write_whole_final`) and evaluated, and the summary gets its
final loss and accuracy and the ``placement``; each follower writes its part (``shard_K_final.pt``). Injected
faults and ``--resume`` are refused with S > 1 (a shard's recovery is not built yet).

With ``system.streaming`` each worker does the real streamed worker's step (:mod:`src.virtual.worker`): its compute
spread over the model's layers (:mod:`src.virtual.layers`), each gradient's part on its link as backward produces
it, the reply's tensors arriving while the next forward waits per layer (:mod:`src.emulation.overlap`); with
several server shards each gradient's slices stream to their shards as the holds, and the commit and the pulls
follow. Injected faults are refused with it in one line (:func:`streaming_refusal`; not built yet).

Outputs are a real run's (``summary.json`` with ``clock: virtual``, ``events.jsonl`` per role with
virtual times, TensorBoard, checkpoints, and with ``system.trace`` a ``trace.json`` per simulated
process whose spans are in virtual microseconds from 0: :mod:`src.virtual.timelines`), so the report,
plots and findings scripts read them as they are. Evaluations and checkpoints take no virtual time.
The summary lists in ``wall_time_fields`` the fields that are wall time (they differ between two runs
of the same config):
``wall_time_s`` (set-up and event loop), ``wall_loop_s`` (the event loop alone; the final evaluation
and checkpoint come after both) and ``wall_compute_s`` (the part of the loop spent computing the
workers' forward/backward passes: ``wall_loop_s / wall_compute_s`` is the driver's own overhead).
"""

from __future__ import annotations

import secrets
import time
from collections import Counter
from pathlib import Path
from typing import Any

from src.common.supervisor import LaunchError
from src.config import Config, SetupError
from src.emulation.cost_model import CostModel
from src.emulation.event_loop import EventLoop
from src.ps.shards.final import collect_parts, reader_session, whole_model_summary
from src.ps.shards.shard_zero import Sharding
from src.trainer import load_splits, model_from_config
from src.virtual.calibration import with_measured_figures
from src.virtual.follower import VirtualFollower
from src.virtual.launcher import VirtualLauncher
from src.virtual.layers import GradientOrder, run_layers
from src.virtual.network import shard_links
from src.virtual.server import VirtualServer
from src.virtual.timelines import VirtualTimelines
from src.virtual.worker import VirtualWorker


def sharded_refusal(config: Config, resume: str | Path | None = None) -> str | None:
    """Why a virtual run of ``config`` with several server shards cannot be made yet, in one line (``None``: it can)."""
    if config.system.num_servers == 1:
        return None
    shards = f"system.num_servers = {config.system.num_servers}"
    if config.system.inject_faults:
        return f"system.inject_faults: not with {shards} in virtual time yet (a server shard's recovery is not built)"
    if resume is not None:
        return f"--resume: not with {shards} yet (each shard would resume from its own checkpoints)"
    return None


def streaming_refusal(config: Config) -> str | None:
    """Why a virtual run of ``config`` with ``system.streaming`` cannot be made yet, in one line (``None``: it can)."""
    system = config.system
    if not system.streaming:
        return None
    if system.inject_faults:
        return "system.inject_faults: not with system.streaming in virtual time yet (not built)"
    return None


def _run_token(config: Config) -> str:
    """The secret every simulated process of the run signs sessions and certificates with (never written anywhere)."""
    return config.system.auth_token.get_secret_value() if config.system.auth_token else secrets.token_hex(16)


class VirtualRun:
    """One virtual-time job: the server process, the simulated workers and launcher, and the event loop.

    Args:
        config: the run's config (``emulation`` holds the cost model's figures).
        resume: continue the server from this checkpoint (file or folder).
        tensorboard: TensorBoard scalars beside the events (off for benchmarks).

    Raises:
        SetupError: a figure the cost model needs is missing (names the field and the calibration command), or a
            sharded run asks for what is not built for it yet (:func:`sharded_refusal`).
    """

    def __init__(self, config: Config, *, resume: str | Path | None = None, tensorboard: bool = True):
        refusal = sharded_refusal(config, resume) or streaming_refusal(config)
        if refusal is not None:
            raise SetupError(refusal)
        self.config = config
        self.cost = CostModel(config)
        self.loop = EventLoop()
        self.clock = self.loop.clock
        self.tensorboard = tensorboard
        self.resume = resume
        self.train_set, self.test_set = load_splits(config)
        self.compute_wall_s = 0.0  # wall seconds spent computing the workers' gradients (the benchmark's reference)
        self.timelines = VirtualTimelines(config, self.clock)
        self.compute_model = model_from_config(config)  # every simulated worker computes in it, in turn
        self.compute_model.train()
        self.layers = self.gradient_order = None
        if config.system.streaming:  # the layers a streamed step spreads over, the order backward hands them over
            self.layers = run_layers(self.compute_model, self.train_set.images[0], config)
            self.gradient_order = GradientOrder(self.compute_model)
        self.workers = [VirtualWorker(self, k) for k in range(config.system.num_workers)]
        self.launcher = VirtualLauncher(config, self.loop, self.cost.restart_s, self.workers)
        num_shards = config.system.num_servers
        self.sharding = (
            Sharding.of_run(self.compute_model, config.system, _run_token(config)) if num_shards > 1 else None
        )
        self.placement = self.sharding.placement if self.sharding is not None else None
        self.shard_times = self.cost.shard_times(self.placement.bytes_per_shard()) if self.placement else []
        links = shard_links(self.loop, self.cost, num_shards) if self.sharding is not None else [None]
        self.server = VirtualServer(
            config,
            self.cost,
            self.loop,
            self.timelines,
            self.launcher,
            num_train_samples=len(self.train_set),
            test_set=self.test_set,
            tensorboard=tensorboard,
            sharding=self.sharding,
            links=links[0],
            times=self.shard_times[0] if self.shard_times else None,
        )
        self.followers = [
            VirtualFollower(
                config,
                self.cost,
                self.loop,
                self.timelines,
                sharding=self.sharding,
                shard=k,
                links=links[k],
                times=self.shard_times[k],
            )
            for k in range(1, num_shards)
        ]
        self.shards = [self.server, *self.followers]
        """Every server shard, shard 0 (the server) first (one: an unsharded run)."""

    def run(self, summary_json: str | Path | None = None) -> dict[str, Any]:
        """Simulate the job to its end; returns the run summary (also written, as a real run's).

        Raises:
            LaunchError: the run cannot finish (every worker's restart budget spent, the server's too).
        """
        started = time.perf_counter()
        server = self.server
        try:
            server.start(resume=self.resume, faults=True)
            for worker in self.workers:
                worker.start(faults=True)
            looping = time.perf_counter()
            finished = self.loop.run(until=lambda: server.core is not None and server.core.done.is_set())
            if not finished:
                raise LaunchError(
                    f"the virtual run stalled at virtual time {self.clock.now:.3f} s with nothing left to "
                    f"happen (every process dead or waiting)"
                )
            if server.core.fatal is not None:
                raise server.core.fatal
            # The last Finish replies are still on their way: deliver them (the worker then writes its
            # run_end and gradient ledger), as a real launcher waits for its workers to exit.
            self.loop.run(until=lambda: not any(w.finishing for w in self.workers))
            looped = time.perf_counter()
            summary = server.core.finalize(
                summary_json,
                downlink_delay_s=self._downlink_delays(),
                extra={
                    "wall_time_s": looped - started,
                    "wall_loop_s": looped - looping,
                    "wall_compute_s": self.compute_wall_s,
                    "wall_time_fields": ["wall_time_s", "wall_loop_s", "wall_compute_s"],
                    "cost_model": self.cost.describe(self.shard_times),
                    "virtual_events": self.loop.processed,
                },
            )
            return self._whole_model(summary, summary_json) if self.followers else summary
        finally:
            for worker in self.workers:
                worker.close_log()
            if server.core is not None:
                server.core.close()
            for follower in self.followers:
                follower.close()
            self.launcher.close()
            self.timelines.close()

    def _whole_model(self, summary: dict[str, Any], summary_json: str | Path | None) -> dict[str, Any]:
        """A sharded run is over: shard 0 reads the followers' parts as the real one does (a parameters-only pull
        with the last certificate, under a session it signs for worker 0's newest incarnation), puts the whole model
        into the final checkpoint and evaluates it, and says so in the summary (written again) with every shard's
        load (``shards``: bytes in and out, exact; ``update_s``: the virtual seconds of update work the cost model
        charged it, where a real run reports its optimizer's wall seconds); each follower writes its part. None of it
        takes virtual time."""
        core, placement, config = self.server.core, self.placement, self.config
        caller, certificate, version = reader_session(core)
        parts = collect_parts([f.part_reader() for f in self.followers], caller, certificate, version, placement)
        for follower in self.followers:
            follower.stop()
        return whole_model_summary(
            summary,
            core=core,
            model=model_from_config(config),  # the names and shapes the parts go back into
            placement=placement,
            parts=parts,
            loads=[s.load for s in self.shards],
            test_set=self.test_set,
            summary_path=summary_json or Path(config.system.log_dir) / "summary.json",
        )

    def _downlink_delays(self) -> dict[int, float]:
        """Seconds each worker's replies spent on its emulated downlink (workers with one), from every shard."""
        delays: Counter[int] = Counter()
        for shard in self.shards:
            delays.update(shard.downlink_delay_s)
        return {k: delays[k] for k, w in enumerate(self.cost.workers) if w.conditions.downlink is not None}


def run_virtual(
    config: Config,
    *,
    summary_json: str | Path | None = None,
    resume: str | Path | None = None,
    tensorboard: bool = True,
) -> dict[str, Any]:
    """Run a parameter-server job in virtual time (see the module docstring); returns the run summary.

    The cost-model figures the config lacks are measured on this machine first, and said on stderr
    (:func:`~src.virtual.calibration.with_measured_figures`); the summary's ``cost_model.measured_here`` names them.

    Raises:
        SetupError: the config lacks ``emulation.restart_s`` for its faults, or is not a parameter-server run, or a
            sharded run asks for what is not built for it yet (:func:`sharded_refusal`).
        LaunchError: the run cannot finish.
    """
    if config.system.architecture != "parameter_server":
        raise SetupError(f"system.clock: virtual runs a parameter-server job here, not {config.system.architecture}")
    refusal = sharded_refusal(config, resume) or streaming_refusal(config)  # before any figure is measured
    if refusal is not None:
        raise SetupError(refusal)
    config, measured = with_measured_figures(config, server=True)
    run = VirtualRun(config, resume=resume, tensorboard=tensorboard)
    run.cost.measured_here = measured
    return run.run(summary_json)
