"""What the round trips and the ceiling share: the model of a given size, the server's config, a server in a
spawned process, the server core timed per push, and a client's protocol step (a push of identity gradients).
"""

from __future__ import annotations

import contextlib
import secrets
import time

from src.common.child_processes import process_context

NUM_TENSORS = 8
BATCH = 64


def sized_model(size_mb: float):
    """``resnet18`` for >= 40 MB (the real layout), else 8 equal float32 tensors of ``size_mb`` in all."""
    import torch
    from torch import nn

    from src.training.data import dataset_info
    from src.training.models import build_model

    if size_mb >= 40:
        return build_model("resnet18", dataset_info("cifar10"))
    numel = int(size_mb * 2**20 / 4 / NUM_TENSORS)
    model = nn.Module()
    for index in range(NUM_TENSORS):
        model.register_parameter(f"tensor_{index}", nn.Parameter(torch.zeros(numel)))
    return model


def server_config(tmp: str, transport: str, num_workers: int = 1, **overrides):
    """The benchmarked server's config: async with no correction (the plain optimizer), 1000 epochs (work for
    every push), no checkpoint; its folders under ``tmp``; ``overrides``: dotted fields on top."""
    from src.config import load_config

    return load_config(
        overrides={
            "system.num_workers": num_workers,
            "system.aggregation_mode": "async",
            "system.async_correction": "none",
            "system.transport": transport,
            "training.checkpoint_interval": 10**9,
            "training.batch_size": BATCH,
            "training.num_epochs": 1000,
            "system.log_dir": f"{tmp}/logs",
            "system.checkpoint_dir": f"{tmp}/ckpt",
            **overrides,
        }
    )


@contextlib.contextmanager
def server_process(target, *args):
    """A spawned process running ``target(*args, report, stop)``: yields (its reports, our stop signals) and
    joins it after (killed if it has not exited within 30 s)."""
    context = process_context()
    report, child_report = context.Pipe(duplex=False)
    stop_child, stop = context.Pipe(duplex=False)
    server = context.Process(target=target, args=(*args, child_report, stop_child))
    server.start()
    try:
        yield report, stop
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()


def _timed(owner, name: str, into: list[float]) -> None:
    """Wrap ``owner.name`` so that each call's seconds go into ``into``."""
    method = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def _instrument_decode_step_reply(core) -> dict[str, list[float]]:
    """Time what a server core and a follower's share per push: decode (of which while the push arrived: TCP;
    ``core.model.layout.gradient`` is what decodes an arriving gradient), the optimizer step, building the reply."""
    timings: dict[str, list[float]] = {"decode": [], "decode_while_receiving": [], "step": [], "reply": []}
    early = [0.0]  # this push's gradients decoded as they arrived (push_splitter)
    layout, gradient = core.model.layout, core.model.layout.gradient

    def early_gradient(*args, **kwargs):
        started = time.perf_counter()
        try:
            return gradient(*args, **kwargs)
        finally:
            early[0] += time.perf_counter() - started

    layout.gradient = early_gradient
    decode = core.decode

    def all_decoding(*args, **kwargs):  # the part left for handle_push, plus what was decoded on arrival
        on_arrival, started = early[0], time.perf_counter()
        try:
            return decode(*args, **kwargs)
        finally:
            timings["decode"].append(on_arrival + time.perf_counter() - started)
            timings["decode_while_receiving"].append(on_arrival)
            early[0] = 0.0

    core.decode = all_decoding
    _timed(core.model.state, "step", timings["step"])
    _timed(core.model.replies, "serialize", timings["reply"])
    return timings


def instrument(core) -> dict[str, list[float]]:
    """Time a server core's pieces per push: decode (of which while the push arrived: TCP), the optimizer step,
    building the reply, the locked part."""
    timings = _instrument_decode_step_reply(core)
    timings["locked"] = []
    apply_push, push_reply = core.apply_push, core.push_reply

    def locked_apply(*args, **kwargs):  # apply_push + push_reply run under one hold of the lock
        core._held_since = time.perf_counter()
        return apply_push(*args, **kwargs)

    def locked_reply(*args, **kwargs):
        try:
            return push_reply(*args, **kwargs)
        finally:
            timings["locked"].append(time.perf_counter() - core._held_since)

    core.apply_push, core.push_reply = locked_apply, locked_reply
    return timings


def instrument_follower(core) -> dict[str, list[float]]:
    """Time a follower shard's pieces per step (:class:`~src.ps.shards.follower.FollowerCore`): the hold's decode (of
    which while it arrived), its hold (under the lock), the optimizer step, building the reply, and the whole pull
    (under the lock: applying the certified version, then the reply)."""
    timings = _instrument_decode_step_reply(core)
    timings["hold"], timings["pull"] = [], []
    _timed(core, "hold", timings["hold"])
    _timed(core, "pull", timings["pull"])
    return timings


def next_request(caller, reply, request_id: int):
    """The push of a protocol step after ``reply`` (its version and work), as request ``request_id``."""
    from src import parameter_server_pb2 as pb

    batches = reply.work.batches
    return pb.PushRequest(
        caller=caller,
        base_version=reply.version,
        request_id=request_id,
        num_samples=sum(len(b.indices) for b in batches) or BATCH,
        batch_ids=[b.batch_id for b in batches],
    )


def pusher(client, registration):
    """A function doing one protocol step (push identity gradients, take the reply's next work) on ``client``."""
    import torch

    from src import parameter_server_pb2 as pb
    from src.compression import IDENTITY
    from src.transport.wire import tensor_view

    caller = pb.Caller(worker_id=registration.worker_id, session=registration.session)
    gradients = [IDENTITY.compress(torch.full(tuple(spec.shape), 1e-6)) for spec in registration.parameter_specs]
    buffers = [tensor_view(torch.zeros(tuple(spec.shape))) for spec in registration.buffer_specs]
    # a random start, as the library's client does: a new process's ids must not collide with an earlier one's
    state = {"reply": client.pull(caller).message, "request_id": secrets.randbits(40)}

    def step() -> None:
        state["request_id"] += 1
        request = next_request(caller, state["reply"], state["request_id"])
        state["reply"] = client.push(request, gradients, buffers).message

    return step
