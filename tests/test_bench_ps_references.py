"""The references ``scripts/bench_ps.py`` measures our round trip against do what they say: the
stepping echo takes the pushed bytes as the gradients, steps as torch's SGD does and sends back the
stepped parameters (a reference that skipped the step would be a limit no server could reach). The
per-shard row (``shard_round_trips``) measures a follower shard's link for real and says so in its fields."""

import socket
import threading

import numpy as np
import pytest
import torch
from torch import nn

from src.benchmarks import suite
from src.benchmarks.ps.references import LENGTH, fill, gradient_payload, stepping_tcp_echo
from src.benchmarks.ps.round_trips import SHARD_TARGET, bench_shard_round_trip, shard_target
from src.transport.tcp_frames import HEADER_BYTES


def test_the_stepping_echo_replies_with_the_parameters_torchs_sgd_makes_of_the_pushed_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3))
    numel = sum(p.numel() for p in model.parameters())
    push_size, reply_size = numel * 4 + 13, numel * 4 + 9
    listener = socket.create_server(("127.0.0.1", 0))
    server = threading.Thread(target=stepping_tcp_echo, args=(listener, model, [reply_size]), daemon=True)
    server.start()
    payload = gradient_payload(push_size, numel)
    assert len(payload) == push_size
    connection = socket.create_connection(listener.getsockname())
    reference = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    optimizer = torch.optim.SGD(reference, lr=0.01, momentum=0.9)
    replies = []
    for _ in range(3):
        connection.sendall(LENGTH.pack(push_size) + payload)
        reply = bytearray(reply_size)
        assert fill(connection, memoryview(reply), 32 * 1024) == reply_size
        replies.append(bytes(reply))
        for param in reference:
            param.grad = torch.full_like(param, 1e-6)
        optimizer.step()
        expected = np.concatenate([p.detach().numpy().ravel() for p in reference])
        got = np.frombuffer(replies[-1][: numel * 4], dtype="<f4")
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-7)
    assert replies[0] != replies[1] != replies[2]  # it stepped each time
    assert all(len(reply) == reply_size for reply in replies)
    connection.close()
    server.join(10)
    assert not server.is_alive()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_per_shard_row_times_a_followers_hold_and_pull_beside_the_stepping_echo_of_their_bytes():
    repeats = 3
    row = bench_shard_round_trip(0.25, repeats)  # shard 0 and the follower: processes of their own, over TCP
    assert row["transport"] == "tcp"
    assert row["model_mb"] == 0.5 and row["shard_mb"] == 0.25  # 8 tensors, 4 a shard: the follower carries 0.25 MB
    carried, slices = row["follower_bytes"], 0.25 * 2**20
    assert slices < carried["hold"] - HEADER_BYTES < slices + 1024  # the slices up, as identity payloads
    assert slices < carried["reply"] - HEADER_BYTES < slices + 1024  # and back down, stepped
    assert carried["ack"] < 64 and carried["pull"] < 256  # the acknowledgement and the pull carry no tensor
    # the round trip is the follower's two calls: each sample's sum outweighs either call's time
    assert row["shard_round_trip_ms"] > max(row["hold_ms"], row["pull_ms"]) > 0
    assert row["raw_tcp_echo_ms"] > 0 and row["stepping_echo_ms"] > 0 and row["optimizer_step_ms"] > 0
    assert row["stepping_echo_ratio"] == pytest.approx(row["stepping_echo_ms"] / row["shard_round_trip_ms"], abs=2e-3)
    assert row["target"] is None  # below 4 MB: no target
    server = row["server_ms"]  # measured inside the follower: it decoded the hold as it arrived and stepped once a pull
    assert {"decode", "decode_while_receiving", "hold", "step", "reply", "pull"} <= set(server)
    assert server["decode_while_receiving"] > 0 and server["pull"] >= server["step"] > 0
    [tabled] = suite.figures_ps({"shard_round_trips": [row]})  # bench_all's table: beside its reference and target
    assert (tabled["ours"], tabled["reference"], tabled["ratio"]) == (
        row["shard_round_trip_ms"],
        row["stepping_echo_ms"],
        row["stepping_echo_ratio"],
    )
    assert tabled["target"] is None and tabled["meets_target"] is None and "per-shard" in tabled["figure"]
    assert suite.figures_ps({"shard_round_trips": [{**row, "target": 0.85}]})[0]["meets_target"] is (
        row["stepping_echo_ratio"] >= 0.85
    )


def test_the_per_shard_target_holds_from_4_mb():
    assert [shard_target(size) for size in (1, 3.9, 4, 16, 45)] == [
        None,
        None,
        SHARD_TARGET,
        SHARD_TARGET,
        SHARD_TARGET,
    ]
    assert SHARD_TARGET == 0.85
