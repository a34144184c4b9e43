"""The references ``scripts/bench_ps.py`` measures our round trip against do what they say: the
stepping echo takes the pushed bytes as the gradients, steps as torch's SGD does and sends back the
stepped parameters (a reference that skipped the step would be a limit no server could reach)."""

import socket
import threading

import numpy as np
import torch
from torch import nn

from src.benchmarks.ps.references import LENGTH, fill, gradient_payload, stepping_tcp_echo


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
