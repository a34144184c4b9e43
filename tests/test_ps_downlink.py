"""Compressed downlink: a push reply carries a compressed delta; the worker's copy tracks the server's within
the bound."""

from __future__ import annotations

import pytest
import torch

from src.compression import IDENTITY, decompress
from src.transport.wire import copy_bytes_into
from tests.ps_fixtures import ServedServer, ps_config

pytestmark = pytest.mark.timeout(120)


def local_copy(worker, reply, held: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """What a worker holds after ``reply``: dense values, or its copy plus each delta."""
    deltas = reply.large.get("parameter_deltas")
    if deltas:
        return [h + decompress(p).view_as(h) for h, p in zip(held, deltas)]
    copies = [torch.empty(tuple(s.shape)) for s in worker.registration.parameter_specs]
    for copy, data in zip(copies, reply.large["parameters"]):
        copy_bytes_into(copy, data)
    return copies


def drive(tmp_path, steps: int, **fields):
    """One async worker pushing random gradients; yields (reply was dense, worker copy,
    what the server sends (its parameters, or their lookahead point), replica)."""
    config = ps_config(tmp_path, training__max_train_samples=16 * (steps + 1), training__batch_size=16, **fields)
    served = ServedServer(config, evaluate=False)
    worker = served.worker(0)
    generator = torch.Generator().manual_seed(0)
    try:
        held = local_copy(worker, worker.reply, None)
        for _ in range(steps):
            gradients = [
                IDENTITY.compress(0.005 * torch.randn(tuple(s.shape), generator=generator))
                for s in worker.registration.parameter_specs
            ]
            reply = worker.push(worker.request(gradients=gradients))
            held = local_copy(worker, reply, held)
            replica = served.server.downlink.replica(0)
            yield (
                not reply.large.get("parameter_deltas"),
                held,
                [p.detach().clone() for p in served.server.state.sent()],
                None if replica is None else [r.clone() for r in replica],
            )
    finally:
        worker.close()
        served.close()


def relative_distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(sum(torch.sum((x - y) ** 2) for x, y in zip(a, b)) ** 0.5 / sum(torch.sum(x**2) for x in a) ** 0.5)


def test_dense_downlink_is_the_servers_parameters_bit_for_bit(tmp_path):
    for dense, held, server, replica in drive(tmp_path, 6):
        assert dense and replica is None
        assert all(torch.equal(h, s) for h, s in zip(held, server))


@pytest.mark.parametrize("kind", ["topk", "quantization"])
def test_compressed_downlink_stays_within_its_bound_and_refreshes(tmp_path, kind):
    bound, interval = 0.2, 8
    dense_replies = 0
    for index, (dense, held, server, replica) in enumerate(
        drive(
            tmp_path,
            20,
            system__downlink_compression=kind,
            system__downlink_ratio=0.1,
            system__downlink_drift_bound=bound,
            system__downlink_refresh_interval=interval,
        )
    ):
        dense_replies += dense
        assert all(torch.equal(h, r) for h, r in zip(held, replica))  # the worker holds exactly the server's replica
        assert relative_distance(server, held) <= bound + 1e-6
        if dense:
            assert all(torch.equal(h, s) for h, s in zip(held, server))
    assert 20 // interval <= dense_replies < 20  # periodic refreshes, and deltas in between
