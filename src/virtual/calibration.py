"""Measure a virtual-time run's cost-model figures on this machine (``scripts/calibrate.py`` prints them).

Each figure is measured on the code a real run executes, so a virtual run of a config models this
machine running that config:

* ``compute_s``: the worker's forward/backward of one batch (:meth:`src.ps.worker.compute.WorkerCompute.compute`),
  median over steps after a warm-up; with ``concurrent`` > 1, measured in that many processes at
  once (what N workers on this machine's cores see: they share the cores).
* ``compress_s``: the worker's error feedback and compression of one push
  (:meth:`~src.ps.worker.codec.PushCodec.encode`, with the config's compression).
* ``server_update_s``: the server core's work per push: parse, admit, decode and apply
  (:class:`src.ps.server.core.ServerCore`, async, one worker).
* ``server_reply_s``: the core's work per reply (the next work, the parameters, serialized), plus
  the transport's own time per round trip: a real push over the run's transport (``system.transport``) on
  loopback minus the core's work, so a virtual run's server time holds everything a real round trip costs
  beyond the links.

``scripts/calibrate.py --layers`` also measures how a step's compute spreads over the model's layers
(:func:`measure_layers`: hooks on the real step's forward and backward) beside the proxy a streamed virtual run uses
(:func:`src.virtual.layers.layer_profile`), to see how far the proxy is from this machine.

A virtual run whose config lacks some of these figures measures them first (:func:`with_measured_figures`:
the same measurements, the missing ones only) and says what it measured, rather than stopping at the first
missing one. ``restart_s`` (a run with faults) is not measured: it is refused at once, with every other
missing figure named in the same line.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from src import parameter_server_pb2 as pb
from src.config import Config, SetupError, config_from_data, read_config_file
from src.emulation.cost_model import CALIBRATE, missing_figures
from src.metrics import MetricsLogger
from src.trainer import model_from_config
from src.training.data import load_dataset
from src.transport.wire import Outgoing, serialize, split

WARMUP_STEPS = 3


def _worker_step(config: Config, log_dir: str):
    """A worker's compute and push codec, as a real worker builds them: ``(step, train_set, log)``."""
    t = config.training
    train_set = load_dataset(
        t.dataset, "train", data_dir=t.data_dir, max_samples=t.max_train_samples, num_samples=t.num_samples, seed=t.seed
    )
    model = model_from_config(config)
    model.train()
    log = MetricsLogger(log_dir, tensorboard=False)
    return _Step(config, model, train_set, log), train_set, log


class _Step:
    """One worker's step as the calibration times it: its compute (:class:`~src.ps.worker.compute.WorkerCompute`),
    then its encoding (:class:`~src.ps.worker.codec.PushCodec`, one server's payloads)."""

    def __init__(self, config: Config, model: torch.nn.Module, train_set, log: MetricsLogger):
        from src.compressors.policy import policy_from_config
        from src.ps.worker import PushCodec, WorkerCompute

        system = config.system
        self.model = model
        self.computing = WorkerCompute(config, 0, model=model, train_set=train_set, device=torch.device("cpu"), log=log)
        self.codec = PushCodec(
            system,
            policy_from_config(system),
            error_feedback=system.error_feedback,
            seed=config.training.seed,
            worker_id=0,
            names=self.computing.names,
        )

    def compute(self, batches: list[pb.Batch]) -> tuple[float, int, int]:
        return self.computing.compute(batches, 0, 1)

    def encode(self, batches: list[pb.Batch]) -> list:
        return self.codec.encode(self.computing.gradients(batches), 0)[0]

    def buffers_to_send(self, batches: list[pb.Batch]) -> list:
        return self.computing.buffers_to_send(batches)


def _batches(config: Config, train_set, count: int) -> list[pb.Batch]:
    size = config.training.batch_size
    return [
        pb.Batch(batch_id=i + 1, epoch=0, indices=[(i * size + j) % len(train_set) for j in range(size)])
        for i in range(count)
    ]


def measure_worker(config: Config, *, steps: int = 20) -> dict[str, float]:
    """Median seconds of one worker step's compute and of its compression (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        step, train_set, log = _worker_step(config, tmp)
        compute, compress = [], []
        for batch in _batches(config, train_set, steps + WARMUP_STEPS):
            started = time.perf_counter()
            step.compute([batch])
            computed = time.perf_counter()
            step.encode([batch])
            compress.append(time.perf_counter() - computed)
            compute.append(computed - started)
        log.close()
    return {
        "compute_s": statistics.median(compute[WARMUP_STEPS:]),
        "compress_s": statistics.median(compress[WARMUP_STEPS:]),
    }


def measure_layers(config: Config, *, steps: int = 20) -> dict[str, Any]:
    """Each layer's share of a worker step (forward, backward), measured: each one's median over steps of the seconds
    from one layer's forward pre-hook to the next's (the last layer's to the end of forward, the loss included), and in
    backward from one layer's gradients being whole (the real worker's post-accumulate-grad hooks) to the next's
    (the first from backward's start), over their sum; beside the proxy's shares
    (:func:`src.virtual.layers.layer_profile`). Measured in one process, as :func:`measure_worker` (``layers``: the
    layers' module names, in forward order)."""
    from src.virtual.layers import layer_profile, served_tensors

    with tempfile.TemporaryDirectory() as tmp:
        step, train_set, log = _worker_step(config, tmp)
        model = step.model
        profile = layer_profile(model, train_set.batch([0])[0][0], config.training.batch_size)
        params, _ = served_tensors(model)
        modules = dict(model.named_modules())
        marks: dict[str, float] = {}

        def mark(key: str, *, first: bool = True) -> None:  # a hook's: returns nothing (a value would replace input)
            if not first or key not in marks:
                marks[key] = time.perf_counter()

        handles = [
            modules[name].register_forward_pre_hook(lambda _m, _a, n=number: mark(f"f{n}"))
            for number, name in enumerate(profile.names)
        ]
        handles += [
            p.register_post_accumulate_grad_hook(lambda _p, n=profile.layer_of[i]: mark(f"b{n}", first=False))
            for i, p in enumerate(params)
            if profile.layer_of[i] >= 0
        ]
        handles.append(model.register_forward_hook(lambda *_: mark("forward_end")))
        shares = []
        for batch in _batches(config, train_set, steps + WARMUP_STEPS):
            marks.clear()
            step.compute([batch])
            ended = time.perf_counter()
            count = len(profile.names)
            forward = [marks[f"f{n + 1}"] if n + 1 < count else marks["forward_end"] for n in range(count)]
            forward = [end - marks[f"f{n}"] for n, end in enumerate(forward)]
            done = [marks.get(f"b{n}", ended) for n in range(count)]  # backward: the last layer's first
            backward = [done[n] - (done[n + 1] if n + 1 < count else marks["forward_end"]) for n in range(count)]
            shares.append(list(zip(forward, backward)))
        for handle in handles:
            handle.remove()
        log.close()
    seconds = [
        [statistics.median(s[n][k] for s in shares[WARMUP_STEPS:]) for k in (0, 1)] for n in range(len(profile.names))
    ]
    total = sum(f + b for f, b in seconds)  # the shares of a median step: they sum to 1
    measured = [(f / total, b / total) for f, b in seconds]
    return {
        "layers": list(profile.names),
        "measured": [[round(f, 4), round(b, 4)] for f, b in measured],
        "proxy": [[round(f, 4), round(b, 4)] for f, b in profile.fractions()],
    }


def _concurrent_worker(config_json: str, steps: int, report) -> None:
    import json

    from src.config import validate_config

    torch.set_num_threads(1)
    report.send(measure_worker(validate_config(json.loads(config_json)), steps=steps))


def measure_worker_concurrently(config: Config, processes: int, *, steps: int = 20) -> dict[str, float]:
    """:func:`measure_worker` in ``processes`` processes at once (one thread each); the median of their figures."""
    from src.common.child_processes import process_context

    context = process_context()
    pipes, children = [], []
    for _ in range(processes):
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_concurrent_worker, args=(config.model_dump_json(), steps, send))
        child.start()
        pipes.append(receive)
        children.append(child)
    results = [pipe.recv() for pipe in pipes]
    for child in children:
        child.join()
    return {name: statistics.median(r[name] for r in results) for name in results[0]}


def _server_config(config: Config, tmp: str) -> Config:
    """One worker, async, one server on a free loopback port, work for every push, nothing written that is not
    needed.

    One server even for a sharded run: ``server_update_s`` and ``server_reply_s`` are one server's times, which a
    virtual run with S shards gives each shard its byte share of (:func:`~src.emulation.cost_model.shard_times`).
    """
    from src.config import validate_config

    data = config.to_dict()
    data["system"].update(
        num_workers=1,
        num_servers=1,
        shard_addresses=[],
        server_address="127.0.0.1:0",
        aggregation_mode="async",
        pipelined_replies=False,  # sync's only; an async server's times are the same without it
        inject_faults=[],
        adaptive_compression=False,
        staleness_policy="none",
        log_dir=f"{tmp}/logs",
        checkpoint_dir=f"{tmp}/ckpt",
        auth_token="calibration",
        clock="real",
    )
    data["training"].update(checkpoint_interval=10**9, num_epochs=1000, eval_interval=0)
    data["emulation"] = {}
    return validate_config(data)


def _register_with_core(core) -> pb.Caller:
    """Worker 0 registered with the core and its first pull answered: the caller its pushes name."""
    with core.lock:
        registration, _ = core.register(pb.RegisterRequest(worker_id=0), "calibration")
        caller = pb.Caller(worker_id=0, session=registration.session)
        member = core.begin_pull(caller)
        core.pull_reply(member, core.poll_work(member))
    return caller


def _time_core_push(core, caller: pb.Caller, request_id: int, payloads, buffers) -> tuple[float, float]:
    """Seconds the core alone spends on one push (parse, admit, decode, apply) and on its reply."""
    with core.lock:
        held = core.work.plan.holding(0)
        request = pb.PushRequest(
            caller=caller,
            base_version=core.version,
            request_id=request_id,
            num_samples=sum(len(b.indices) for b in held),
            batch_ids=[b.batch_id for b in held],
        )
        data = serialize(Outgoing(request, {"gradients": payloads, "buffers": buffers}))
        started = time.perf_counter()
        split_request = split(data, pb.PushRequest, ("gradients", "buffers"))
        admitted = core.begin_push(caller, split_request.message)
        verdict = core.apply_push(admitted, split_request.message, core.decode(0, split_request))
        applied = time.perf_counter()
        core.push_reply(admitted, request_id, verdict, core.poll_work(admitted))
        return applied - started, time.perf_counter() - applied


def _time_round_trip(client, caller: pb.Caller, received, request_id: int, payloads, buffers):
    """One real push of the work ``received`` holds: (the reply, the round trip's seconds)."""
    work = received.message.work
    request = pb.PushRequest(
        caller=caller,
        base_version=received.message.version,
        request_id=request_id,
        num_samples=sum(len(b.indices) for b in work.batches),
        batch_ids=[b.batch_id for b in work.batches],
    )
    started = time.perf_counter()
    reply = client.push(request, payloads, buffers)
    return reply, time.perf_counter() - started


def _server_figures(update: list[float], reply: list[float], trips: list[float]) -> dict[str, float]:
    """The medians after the warm-up, the server's share of a round trip split into update and reply."""
    core_update = statistics.median(update[WARMUP_STEPS:])
    core_reply = statistics.median(reply[WARMUP_STEPS:])
    round_trip = statistics.median(trips[WARMUP_STEPS:])
    server_update = min(core_update, round_trip)  # a round trip holds the update: never more than all of it
    return {
        "server_update_s": server_update,
        "server_reply_s": max(core_reply, round_trip - server_update),
        "core_update_s": core_update,
        "core_reply_s": core_reply,
        "round_trip_s": round_trip,
    }


def measure_server(config: Config, *, pushes: int = 30) -> dict[str, float]:
    """Median seconds of the server core's work per push and per reply, and of a real round trip over the run's
    transport.

    The core alone and the real round trips alternate push by push, so a load that comes and goes
    on the machine weighs on both alike.
    """
    from src.parameter_server import ParameterServer, planned_work
    from src.ps.server.core import ServerCore
    from src.transport.clients import make_client

    with tempfile.TemporaryDirectory() as tmp:
        run = _server_config(config, tmp)
        step, train_set, log = _worker_step(run, f"{tmp}/worker")
        batch = _batches(run, train_set, 1)[0]
        step.compute([batch])
        payloads = step.encode([batch])
        buffers = step.buffers_to_send([batch])
        batch_size = run.training.batch_size
        core = ServerCore(run, work=planned_work(run, batch_size), model=model_from_config(run), tensorboard=False)
        server = ParameterServer(
            run, token="calibration", evaluate=False, tensorboard=False, num_train_samples=batch_size
        )
        address = f"127.0.0.1:{server.start()}"
        client = make_client(address, transport=run.system.transport, token="calibration")
        update, reply, trips = [], [], []
        try:
            core_caller = _register_with_core(core)
            registration = client.register(0)
            caller = pb.Caller(worker_id=0, session=registration.session)
            received = client.pull(caller)
            for request_id in range(1, pushes + WARMUP_STEPS + 1):
                # The core alone: the work a push and its reply cost the server.
                update_s, reply_s = _time_core_push(core, core_caller, request_id, payloads, buffers)
                update.append(update_s)
                reply.append(reply_s)
                # A real server and client on loopback, over the run's transport: the whole round trip.
                received, trip_s = _time_round_trip(client, caller, received, request_id, payloads, buffers)
                trips.append(trip_s)
        finally:
            client.close()
            server.stop(grace=0)
            core.close()
            log.close()
    return _server_figures(update, reply, trips)


def calibration_config(
    path: str | Path | None,
    *,
    overrides: dict[str, Any] | None = None,
    assignments: dict[str, Any] | None = None,
) -> Config:
    """The config a calibration measures: a run's config file (or an experiment or matrix file, whose
    run sections are its base), then ``overrides`` (dotted fields, ``None`` ignored) and ``assignments``.

    Raises:
        ConfigError: the file or a field is invalid (each problem names it).
    """
    data = read_config_file(path) if path else {}
    for section in ("experiment", "matrix"):
        data.pop(section, None)
    return config_from_data(data, overrides=overrides, assignments=assignments)


def calibrate(config: Config, *, concurrent: int = 1, steps: int = 20, server: bool = True) -> dict[str, Any]:
    """Every figure of the cost model for ``config`` on this machine (see the module docstring)."""
    worker = (
        measure_worker_concurrently(config, concurrent, steps=steps)
        if concurrent > 1
        else measure_worker(config, steps=steps)
    )
    figures: dict[str, Any] = {"compute_s": worker["compute_s"]}
    if config.system.compression_enabled:
        figures["compress_s"] = worker["compress_s"]
    details = {"compress_s_measured": worker["compress_s"], "concurrent": concurrent}
    if server:
        measured = measure_server(config, pushes=steps)
        figures["server_update_s"] = measured["server_update_s"]
        figures["server_reply_s"] = measured["server_reply_s"]
        details.update(
            core_update_s=measured["core_update_s"],
            core_reply_s=measured["core_reply_s"],
            round_trip_s=measured["round_trip_s"],
        )
    return {"emulation": figures, "measured": details}


def as_yaml(result: dict[str, Any], config: Config, config_path: str | Path | None) -> str:
    """The figures as ``emulation:`` lines to paste into a config, with what they were measured on."""
    t = config.training
    lines = [
        f"# measured by scripts/calibrate.py on {t.model_architecture}, {t.dataset}, batch {t.batch_size}"
        f"{' (' + str(config_path) + ')' if config_path else ''}; "
        f"{result['measured']['concurrent']} process(es) at once",
        "emulation:",
    ]
    lines += [f"  {name}: {value:.6g}" for name, value in result["emulation"].items()]
    return "\n".join(lines)


def with_measured_figures(
    config: Config, *, server: bool, say: Callable[[str], None] | None = None, steps: int = 20
) -> tuple[Config, dict[str, float]]:
    """``config`` with the cost-model figures it lacks (:func:`~src.emulation.cost_model.missing_figures`)
    measured on this machine (as :func:`calibrate` measures them, one process), and those figures; ``say`` (default:
    a line on stderr) is told what is measured, and what came of it.

    Raises:
        SetupError: ``emulation.restart_s`` is missing from a run with faults (it is not measured here).
    """
    missing = missing_figures(config, server=server)
    if not missing:
        return config, {}
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    if "restart_s" in missing:
        others = ", ".join(f"emulation.{name}" for name in missing if name != "restart_s")
        raise SetupError(
            "emulation.restart_s: a virtual-time run with faults needs it (the seconds a faulted process takes to "
            "start again), and it is not measured here"
            + (f"; {others} are missing too: `{CALIBRATE}` measures them" if others else "")
        )
    say(
        f"virtual time: {', '.join('emulation.' + name for name in missing)} not in the config; measuring "
        f"{'it' if len(missing) == 1 else 'them'} on this machine, as `{CALIBRATE}` does"
    )
    started = time.perf_counter()
    measured: dict[str, float] = {}
    if "compute_s" in missing or "compress_s" in missing:
        worker = measure_worker(config, steps=steps)
        measured.update({name: worker[name] for name in ("compute_s", "compress_s") if name in missing})
    if "server_update_s" in missing or "server_reply_s" in missing:
        figures = measure_server(config, pushes=steps)
        measured.update({name: figures[name] for name in ("server_update_s", "server_reply_s") if name in missing})
    say(
        f"virtual time: measured in {time.perf_counter() - started:.1f} s: "
        + ", ".join(f"{name}={value:.6g}" for name, value in measured.items())
        + " (put them in the config's emulation section to run with the same figures again)"
    )
    emulation = config.emulation.model_copy(update=measured)
    return config.model_copy(update={"emulation": emulation}), measured
