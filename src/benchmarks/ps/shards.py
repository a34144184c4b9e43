"""Several server shards on loopback: aggregate pushes/s and GB/s into S = 1 and S = 2 server shards from 4 light
clients, sync mode, on the ~4 MB model (8 tensors of 0.5 MB: 4 whole tensors per shard at S = 2), per transport.

Each client is a thread of one client process with no compute, doing what a worker of such a run does per step
(``src/worker.py``), with identity-coded zero gradients:

* one server (S = 1, the reference): the unsharded server's one call, a push whose reply carries the new parameters
  and the next work;
* S = 2: the sharded step, each of its three steps sent to every shard at once from one thread per shard: hold the
  shard's slices on every shard, commit to shard 0 (its reply: the verdict, the next work, the certificate), pull
  every shard's slices (the followers' with the certificate);
* one shard taking that three-call step (S = 1 given a one-shard placement), which tells the step's own cost
  from what splitting the model across two server processes changes.

Shard 0 (:class:`~src.parameter_server.ParameterServer`) and the follower
(:class:`~src.ps.shards.follower_server.FollowerServer`) each run in a spawned process of their own, the clients in
another. The clients start together after one warm-up step each and stop together (sync: every client's k-th
step is in the same version, so all of them do the same number). Each row: pushes/s (client steps per second,
all clients), GB/s the clients sent (``in``) and sent plus received (``total``), and each shard's own share,
counted by the shard (the bytes of its Push and Pull messages) between the start and the end of the timed steps.
``ratio_to_one_server``: S = 2's pushes/s over one server's, from the same run of the bench;
``ratio_to_one_shard_same_step``: over the one shard taking the three-call step.
"""

from __future__ import annotations

import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from src.benchmarks.common import log
from src.benchmarks.ps.common import BATCH, next_request, server_config, sized_model
from src.common.child_processes import process_context

SHARDS_MB = 4
SHARD_CLIENTS = 4
CASES = ((1, False), (1, True), (2, True))
"""(shards, sharded step): one server taking the plain push (what a one-server run's worker does: the reference),
one shard taking the sharded three-call step (the step's own cost), two shards."""
SLICE_BYTES = 4 << 20  # the default (BytePS's 4 MB): the model's 0.5 MB tensors go whole


def shards_config(tmp: str, transport: str, num_servers: int, num_workers: int):
    """Every shard's config: the benchmarked server's (:func:`~src.benchmarks.ps.common.server_config`), sync (a
    sharded run's only mode), ``num_servers`` shards with the default 4 MB slices (the model's 0.5 MB tensors go
    whole)."""
    return server_config(
        tmp,
        transport,
        num_workers,
        **{
            "system.num_servers": num_servers,
            "system.aggregation_mode": "sync",
            "system.shard_slice_bytes": SLICE_BYTES,
        },
    )


def serve_shard(
    transport: str,
    num_servers: int,
    sharded: bool,
    shard: int,
    num_clients: int,
    token: str,
    model_mb: float,
    report,
    control,
) -> None:
    """Server process: shard ``shard`` of ``num_servers`` (0: the parameter server; ``sharded``: taking the sharded
    step even when it is the only shard) of the model of ``model_mb`` (:func:`~src.benchmarks.ps.common.sized_model`)
    on a free loopback port; reports its port, then its load (bytes in and out, optimizer seconds) each time it is
    asked, until told to stop (the round trips' per-shard row runs its shard 0 here too)."""
    import torch

    from src.common.memory import reuse_freed_memory

    torch.set_num_threads(1)
    reuse_freed_memory()  # as run_server does
    with tempfile.TemporaryDirectory() as tmp:
        config = shards_config(tmp, transport, num_servers, num_clients)
        model = sized_model(model_mb)
        if shard == 0:
            from src.parameter_server import ParameterServer
            from src.ps.shards.shard_zero import Sharding

            server = ParameterServer(
                config,
                token=token,
                model=model,
                evaluate=False,
                tensorboard=False,
                num_train_samples=BATCH * 1000,
                sharding=Sharding.of_run(model, config.system, token) if sharded else None,
            )  # num_servers > 1 makes its own Sharding; one shard taking the sharded step is given one

            def load() -> dict:
                with server._load_lock:
                    bytes_in, bytes_out = server.load.bytes_in, server.load.bytes_out
                return {"bytes_in": bytes_in, "bytes_out": bytes_out, "update_s": server.core.updates.step_s}

            def stop() -> None:
                server.stop(grace=0)
        else:
            from src.ps.shards.follower_server import FollowerServer

            server = FollowerServer(config, shard=shard, address="127.0.0.1:0", token=token, model=model)

            def load() -> dict:
                with server.core.lock:
                    held = server.core.load
                    return {"bytes_in": held.bytes_in, "bytes_out": held.bytes_out, "update_s": held.update_s}

            def stop() -> None:
                server.stop(grace=0)

        report.send(server.start())
        while control.recv() == "load":
            report.send(load())
        stop()


class _Client:
    """One light client's connections (one per shard) and its protocol step (see the module docstring)."""

    def __init__(self, transport: str, addresses: list[str], sharded: bool, token: str, worker_id: int):
        import torch

        from src import parameter_server_pb2 as pb
        from src.compression import IDENTITY
        from src.ps.shards.parts import model_placement
        from src.transport.clients import make_client

        self.pb = pb
        self.connections = [make_client(address, transport=transport, token=token) for address in addresses]
        registration = self.connections[0].register(worker_id)
        self.caller = pb.Caller(worker_id=worker_id, session=registration.session)
        shards = len(addresses)
        if not sharded:
            self.payloads = [[IDENTITY.compress(torch.zeros(tuple(s.shape))) for s in registration.parameter_specs]]
        else:  # each shard's slices, as every process of the run places them (src/ps/shards/placement.py)
            placement = model_placement(sized_model(SHARDS_MB), shards, SLICE_BYTES)
            self.payloads = [
                [IDENTITY.compress(torch.zeros(piece.numel)) for piece in placement.on_shard(k)] for k in range(shards)
            ]
        self.calls = ThreadPoolExecutor(max_workers=shards) if sharded else None
        self.request_id = secrets.randbits(40)  # a random start, as the library's client does
        self.reply = self.connections[0].pull(self.caller).message  # the first work (waits for every client)
        if self.calls is not None:
            self._check_versions(self.reply.version, self._pull_followers(b"", first=1))
        self.steps = 0

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in self.connections)

    @property
    def bytes_received(self) -> int:
        return sum(c.bytes_received for c in self.connections)

    def _request(self):
        self.request_id += 1
        return next_request(self.caller, self.reply, self.request_id)

    def _pull_followers(self, certificate: bytes, *, first: int) -> list[int]:
        pulls = [
            self.calls.submit(
                self.connections[k].pull, self.caller, certificate=certificate if k else b"", parameters_only=True
            )
            for k in range(first, len(self.connections))
        ]
        return [pull.result().message.version for pull in pulls]

    @staticmethod
    def _check_versions(version: int, versions: list[int]) -> None:
        if any(v != version for v in versions):
            raise RuntimeError(f"the shards answered at versions {versions}, shard 0 at {version}")

    def step(self) -> None:
        """One step: the unsharded push, or hold on every shard, commit to shard 0, pull every shard."""
        request = self._request()
        if self.calls is None:
            self.reply = self.connections[0].push(request, self.payloads[0]).message
        else:
            request.hold = True
            acks = [
                self.calls.submit(connection.push, request, self.payloads[k])
                for k, connection in enumerate(self.connections)
            ]
            for ack in acks:
                ack.result()
            commit = self.pb.PushRequest()
            commit.CopyFrom(request)
            commit.hold, commit.commit = False, True
            reply = self.connections[0].push(commit).message
            if not reply.accepted:
                raise RuntimeError(f"shard 0 refused the commit of request {request.request_id}")
            self._check_versions(reply.version, self._pull_followers(reply.certificate, first=0))
            self.reply = reply
        self.steps += 1

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        if self.calls is not None:
            self.calls.shutdown()


def _shard_clients(
    transport: str, addresses: list[str], sharded: bool, token: str, num_clients: int, seconds: float, control
) -> None:
    """Client process: ``num_clients`` threads, each a :class:`_Client`; one warm-up step each, then (told ``go``)
    steps for ``seconds``; all of them stop after the same step (see :func:`_timed_steps`)."""
    from src.common.memory import reuse_freed_memory

    reuse_freed_memory()
    clients: list[_Client] = [None] * num_clients  # type: ignore[list-item]
    errors: list[BaseException] = []
    warmed = threading.Barrier(num_clients + 1)
    go = threading.Event()
    window = {"until": None, "stop_after": None, "ends": [0.0] * num_clients}
    lock = threading.Lock()

    def run(index: int) -> None:
        try:
            clients[index] = _Client(
                transport, addresses, sharded, token, index
            )  # every client registers before any step
            clients[index].step()  # warm-up
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)
            warmed.abort()
            return
        try:
            warmed.wait()
        except threading.BrokenBarrierError:
            return
        go.wait()
        try:
            _timed_steps(clients[index], index, window, lock)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(num_clients)]
    for thread in threads:
        thread.start()
    try:
        warmed.wait()
    except threading.BrokenBarrierError:
        control.send({"error": repr(errors[0]) if errors else "a client failed to start"})
        return
    before = sum(c.bytes_sent for c in clients), sum(c.bytes_received for c in clients)
    control.send("ready")
    control.recv()  # go: the servers' loads are read
    started = time.perf_counter()
    window["until"] = started + seconds
    go.set()
    for thread in threads:
        thread.join(seconds + 120)
    if errors or any(thread.is_alive() for thread in threads):
        control.send({"error": repr(errors[0]) if errors else "a client did not stop"})
        return
    elapsed = max(window["ends"]) - started
    steps = [c.steps - 1 for c in clients]  # less the warm-up
    if len(set(steps)) != 1:
        control.send({"error": f"the clients stopped after different numbers of steps: {steps}"})
        return
    control.send(
        {
            "pushes": sum(steps),
            "steps_per_client": steps,
            "seconds": elapsed,
            "bytes_in": sum(c.bytes_sent for c in clients) - before[0],
            "bytes_out": sum(c.bytes_received for c in clients) - before[1],
        }
    )
    for client in clients:
        client.close()


def _timed_steps(client: _Client, index: int, window: dict, lock: threading.Lock) -> None:
    """Step until the window's end, all clients the same number of steps: the first client to finish a step past
    the end says every client stops after the next one (no client can have begun the one after it: that step
    needs this client's commit of the next, made after saying so)."""
    while True:
        client.step()
        now = time.perf_counter()
        window["ends"][index] = now
        with lock:
            if window["stop_after"] is None and now >= window["until"]:
                window["stop_after"] = client.steps + 1
            if window["stop_after"] is not None and client.steps >= window["stop_after"]:
                return


def _measure(transport: str, num_servers: int, sharded: bool, num_clients: int, seconds: float) -> dict:
    """One case: ``num_servers`` shard processes and the client process; the clients' figures and each shard's."""
    context = process_context()
    token = secrets.token_urlsafe(16)
    servers, pipes = [], []
    try:
        for shard in range(num_servers):
            report, child_report = context.Pipe(duplex=False)
            child_control, control = context.Pipe(duplex=False)
            process = context.Process(
                target=serve_shard,
                args=(
                    transport,
                    num_servers,
                    sharded,
                    shard,
                    num_clients,
                    token,
                    SHARDS_MB,
                    child_report,
                    child_control,
                ),
            )
            process.start()
            servers.append(process)
            pipes.append((report, control))
        addresses = [f"127.0.0.1:{report.recv()}" for report, _ in pipes]

        def loads() -> list[dict]:
            for _, control in pipes:
                control.send("load")
            return [report.recv() for report, _ in pipes]

        here, there = context.Pipe()
        clients = context.Process(
            target=_shard_clients, args=(transport, addresses, sharded, token, num_clients, seconds, there)
        )
        clients.start()
        ready = here.recv()
        if ready != "ready":
            raise RuntimeError(f"shards {transport} S={num_servers}: {ready['error']}")
        before = loads()
        here.send("go")
        measured = here.recv()
        if "error" in measured:
            raise RuntimeError(f"shards {transport} S={num_servers}: {measured['error']}")
        after = loads()
        clients.join(60)
    finally:
        for _, control in pipes:
            try:
                control.send(None)
            except (BrokenPipeError, OSError):
                pass
        for process in servers:
            process.join(30)
            if process.is_alive():
                process.kill()
    seconds_ = measured["seconds"]
    pushes = measured["pushes"]
    shards = []
    for shard, (start, end) in enumerate(zip(before, after)):
        bytes_in, bytes_out = end["bytes_in"] - start["bytes_in"], end["bytes_out"] - start["bytes_out"]
        shards.append(
            {
                "shard": shard,
                "role": "shard 0 (parameter server)" if shard == 0 else "follower",
                "bytes_in_per_push": round(bytes_in / pushes),
                "bytes_out_per_push": round(bytes_out / pushes),
                "gb_per_s_in": round(bytes_in / seconds_ / 1e9, 3),
                "gb_per_s_total": round((bytes_in + bytes_out) / seconds_ / 1e9, 3),
                "update_ms_per_version": round((end["update_s"] - start["update_s"]) / (pushes / num_clients) * 1e3, 3),
            }
        )
    return {
        "servers": num_servers,
        "step": "hold + commit + pull" if sharded else "push",
        "clients": num_clients,
        "steps_per_client": measured["steps_per_client"][0],
        "seconds": round(seconds_, 2),
        "pushes_per_s": round(pushes / seconds_, 1),
        "gb_per_s_in": round(measured["bytes_in"] / seconds_ / 1e9, 3),
        "gb_per_s_total": round((measured["bytes_in"] + measured["bytes_out"]) / seconds_ / 1e9, 3),
        "shards": shards,
    }


def bench_shards(transport: str, seconds: float, repeats: int = 3, num_clients: int = SHARD_CLIENTS) -> dict:
    """The cases of :data:`CASES` over ``transport``, ``num_clients`` light clients each, ``seconds`` of timed steps
    each, ``repeats`` times in turns (the order flips every repeat), each case's row its run of median pushes/s;
    2 shards' pushes/s over one server's (``ratio_to_one_server``) and over one shard taking the same three-call
    step (``ratio_to_one_shard_same_step``: what the split buys, the step's cost aside)."""
    runs: dict[tuple[int, bool], list[dict]] = {case: [] for case in CASES}
    for repeat in range(repeats):
        for servers, sharded in CASES if repeat % 2 == 0 else CASES[::-1]:
            row = _measure(transport, servers, sharded, num_clients, seconds)
            runs[servers, sharded].append(row)
            log(
                f"shards {transport} S={servers} ({row['step']}, run {repeat + 1}): {row['pushes_per_s']} pushes/s, "
                f"{row['gb_per_s_in']} GB/s in, {row['gb_per_s_total']} GB/s in+out"
            )
    rows = []
    for case in CASES:
        ordered = sorted(runs[case], key=lambda row: row["pushes_per_s"])
        median = ordered[(len(ordered) - 1) // 2]
        rows.append({**median, "runs_pushes_per_s": [row["pushes_per_s"] for row in runs[case]]})
    one, one_sharded, two = (row["pushes_per_s"] for row in rows)
    return {
        "transport": transport,
        "model_mb": SHARDS_MB,
        "mode": "sync",
        "repeats": repeats,
        "rows": rows,
        "ratio_to_one_server": round(two / one, 3) if one else None,
        "ratio_to_one_shard_same_step": round(two / one_sharded, 3) if one_sharded else None,
    }
