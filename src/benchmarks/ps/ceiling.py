"""One server's ceiling: pushes/s and GB/s into one server on a ~4 MB model, async mode, from a few counts of
light clients (threads of one client process, no compute: a push, its reply, the next push), per transport;
the fewest clients that saturate it, and the time each push holds the core's lock (the serial bound).

The server and the clients run in spawned processes of their own.
"""

from __future__ import annotations

import secrets
import statistics
import tempfile
import threading
import time

from src.benchmarks.common import log
from src.benchmarks.ps.common import instrument, pusher, server_config, server_process, sized_model
from src.common.child_processes import process_context

CEILING_MB = 4


def _ceiling_server(transport: str, num_workers: int, token: str, report, stop) -> None:
    """Server process: a ``ClientLoopServer`` for ``num_workers`` clients on the ~4 MB model; reports its port,
    then, once stopped, the locked time of every push."""
    import torch

    from src.common.memory import reuse_freed_memory
    from torch_asgc.server import ClientLoopServer

    torch.set_num_threads(1)
    reuse_freed_memory()
    with tempfile.TemporaryDirectory() as tmp:
        config = server_config(tmp, transport, num_workers)
        server = ClientLoopServer(config, token=token, model=sized_model(CEILING_MB), tensorboard=False)
        timings = instrument(server.core)
        report.send(server.start())
        stop.recv()
        report.send(timings["locked"])
        server.stop(grace=0)


def _ceiling_clients(transport: str, address: str, token: str, num_clients: int, seconds: float, report) -> None:
    """Client process: ``num_clients`` threads pushing as fast as the server answers, for ``seconds``."""
    from src.common.memory import reuse_freed_memory
    from src.transport.clients import make_client

    reuse_freed_memory()
    clients = [make_client(address, transport=transport, token=token) for _ in range(num_clients)]
    steps = [pusher(client, client.register(k)) for k, client in enumerate(clients)]
    for step in steps:
        step()  # warm-up
    counts = [0] * num_clients
    started = time.perf_counter()
    until = started + seconds
    bytes_before = sum(c.bytes_sent for c in clients), sum(c.bytes_received for c in clients)

    def run(index: int) -> None:
        while time.perf_counter() < until:
            steps[index]()
            counts[index] += 1

    threads = [threading.Thread(target=run, args=(k,)) for k in range(num_clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    sent = sum(c.bytes_sent for c in clients) - bytes_before[0]
    received = sum(c.bytes_received for c in clients) - bytes_before[1]
    for client in clients:
        client.close()
    report.send({"pushes": sum(counts), "seconds": elapsed, "bytes_in": sent, "bytes_out": received})


def bench_ceiling(transport: str, clients: list[int], seconds: float) -> dict:
    """One server over ``transport``, pushed into by each count of ``clients`` in turn for ``seconds``."""
    context = process_context()
    token = secrets.token_urlsafe(16)
    rows = []
    with server_process(_ceiling_server, transport, max(clients), token) as (report, stop):
        address = f"127.0.0.1:{report.recv()}"
        for count in clients:
            results, child = context.Pipe(duplex=False)
            process = context.Process(target=_ceiling_clients, args=(transport, address, token, count, seconds, child))
            process.start()
            measured = results.recv()
            process.join(60)
            rate = measured["pushes"] / measured["seconds"]
            rows.append(
                {
                    "clients": count,
                    "pushes_per_s": round(rate, 1),
                    "gb_per_s_in": round(measured["bytes_in"] / measured["seconds"] / 1e9, 3),
                    "gb_per_s_total": round(
                        (measured["bytes_in"] + measured["bytes_out"]) / measured["seconds"] / 1e9, 3
                    ),
                }
            )
            log(
                f"ceiling {transport} {count} clients: {rows[-1]['pushes_per_s']} pushes/s, "
                f"{rows[-1]['gb_per_s_total']} GB/s"
            )
        stop.send(None)
        locked = report.recv()
    best = max(row["pushes_per_s"] for row in rows)
    serial_ms = statistics.median(locked) * 1e3 if locked else None
    return {
        "transport": transport,
        "model_mb": CEILING_MB,
        "mode": "async",
        "rows": rows,
        "best_pushes_per_s": best,
        "saturated_at_clients": next(row["clients"] for row in rows if row["pushes_per_s"] >= 0.9 * best),
        "serial_ms_per_push": round(serial_ms, 3) if serial_ms else None,
        "serial_bound_pushes_per_s": round(1e3 / serial_ms, 1) if serial_ms else None,
    }
