"""Helpers for the DDP tests: start real gloo ranks with a deadline, and always reap them.

A test's rank function runs in a child process as ``fn(rank, world_size, port, *args)``, forked from the
framework's forkserver with torch imported (:mod:`src.common.child_processes`) and given the test's
environment as it is when the ranks start; it calls
:func:`join_group` to join a gloo group whose store the parent hosts on an OS-chosen port.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from src.common.child_processes import START_METHOD, use_forkserver
from src.ddp_trainer import leave_rank_process

SPAWN_TIMEOUT_S = 240


def join_group(rank: int, world_size: int, port: int) -> None:
    """In a spawned rank: one intra-op thread (the tests share 2 cores) and a gloo group."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def _rank_entry(rank: int, environment: dict, fn, *args) -> None:
    os.environ.clear()
    os.environ.update(environment)  # the test's, not the forkserver's (frozen when it started)
    fn(rank, *args)
    # Succeeded: leave without interpreter shutdown, where torch's lingering gloo threads can
    # abort the process (see src.ddp_trainer.leave_rank_process).
    atexit.register(leave_rank_process, 0)


def spawn_ranks(fn, world_size: int, *args, timeout: float = SPAWN_TIMEOUT_S) -> None:
    """Run ``fn`` on ``world_size`` ranks; raise if one fails or the deadline passes.

    Every child is terminated (then killed) and reaped before this returns, whatever happens.
    """
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    use_forkserver()
    context = mp.start_processes(
        _rank_entry,
        args=(dict(os.environ), fn, world_size, store.port, *args),
        nprocs=world_size,
        join=False,
        start_method=START_METHOD,
    )
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"ranks still running after {timeout:.0f}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


# struct tcp_info (linux/tcp.h): u64 tcpi_bytes_received at byte 128 (Linux >= 4.1), u64
# tcpi_bytes_sent and tcpi_bytes_retrans at bytes 200 and 208 (Linux >= 4.19). The kernel counts
# the payload bytes of every TCP segment, so these are what really crossed the wire, whatever the
# code above it believes. Retransmitted bytes (rare even on loopback) are taken out of "sent".
_TCP_INFO_SIZE = 232
_TCP_BYTES_RECEIVED_AT = 128
_TCP_BYTES_SENT_AT = 200
_TCP_BYTES_RETRANS_AT = 208


def _tcp_counts() -> tuple[int, int, int]:
    """(sent, received, still queued to send) over this process's TCP sockets."""
    sent = received = queued = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            duplicate = socket.socket(fileno=os.dup(int(name)))
        except OSError:  # closed since the listing (e.g. the listing's own descriptor)
            continue
        with duplicate:
            if duplicate.family not in (socket.AF_INET, socket.AF_INET6) or duplicate.type != socket.SOCK_STREAM:
                continue
            try:
                info = duplicate.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_SIZE)
                outq = fcntl.ioctl(duplicate.fileno(), termios.TIOCOUTQ, b"\0" * 4)  # SIOCOUTQ: not yet sent or acked
            except OSError:  # a listening socket, or one being torn down
                continue
            if len(info) < _TCP_BYTES_RETRANS_AT + 8:
                raise RuntimeError(
                    f"kernel's tcp_info is {len(info)} bytes: too old to count bytes sent (needs Linux >= 4.19)"
                )
            (received_now,) = struct.unpack_from("<Q", info, _TCP_BYTES_RECEIVED_AT)
            sent_now, retransmitted = struct.unpack_from("<QQ", info, _TCP_BYTES_SENT_AT)
            sent += sent_now - retransmitted
            received += received_now
            queued += struct.unpack("<i", outq)[0]
    return sent, received, queued


def tcp_bytes(settle_s: float = 10.0) -> tuple[int, int]:
    """``(sent, received)``: TCP payload bytes over all of this process's TCP sockets, from the kernel.

    gloo's traffic goes through TCP sockets between the ranks, so the difference of two readings
    around a collective is what that collective put on the wire, counted by the kernel and not by
    the code under test (plus gloo's own framing, a few hundred bytes per collective). The store's
    socket is counted too; it is quiet while tensors are exchanged.

    A send completes for gloo once its bytes are in the socket's buffer, which the kernel may still
    be transmitting (a slow receiver): each reading first waits, up to ``settle_s``, until no
    socket has bytes queued, so bytes written before a reading are counted before it. Take both
    readings while every peer is still connected: a socket a peer closed in between disappears
    with its counts.
    """
    deadline = time.monotonic() + settle_s
    while True:
        sent, received, queued = _tcp_counts()
        if queued == 0 or time.monotonic() >= deadline:
            return sent, received
        time.sleep(0.001)  # polling interval of the condition above


class StepBytes:
    """Per training step of a rank: the bytes its comm hook counted, and the bytes the kernel saw it send.

    :meth:`wrap` goes into ``DDPTrainer(comm_hook=...)``: each step's window opens when the model's
    forward starts (the last forward before a step is its training forward; evaluation's traffic
    falls before it) and closes after ``CommHook.end_step``, so it holds the step's gradient
    exchange and nothing else.
    """

    def __init__(self, factory):
        self.factory = factory
        self.steps: list[dict[str, int]] = []

    def wrap(self, module):
        hook = self.factory(module)
        opened: dict[str, int] = {}

        def open_window(*_):
            opened["claimed"], opened["sent"] = hook.stats.total_sent, tcp_bytes()[0]

        module.register_forward_pre_hook(open_window)
        end_step = hook.end_step

        def close_window():
            end_step()
            self.steps.append(
                {"claimed": hook.stats.total_sent - opened["claimed"], "measured": tcp_bytes()[0] - opened["sent"]}
            )

        hook.end_step = close_window
        return hook


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (exited, or a zombie nobody has reaped yet)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("State:"):
                    return "Z" in line.split()[1]
    except FileNotFoundError:
        return True
    return not os.path.exists(f"/proc/{pid}")


@dataclass
class NodeResult:
    """How one process of :func:`run_together` ended, with everything it printed."""

    returncode: int
    killed: bool
    """Still running at the deadline (or after a peer failed), so :func:`run_together` killed it."""
    stdout: str
    stderr: str

    def describe(self, name: str) -> str:
        how = "killed by the test" if self.killed else f"exit {self.returncode}"
        return f"--- {name}: {how}\n[stdout]\n{self.stdout[-3000:]}\n[stderr]\n{self.stderr[-6000:]}"


def run_together(
    commands: list[list[str]],
    *,
    cwd: Path,
    env: dict | None = None,
    timeout: float = SPAWN_TIMEOUT_S,
    peer_grace_s: float = 60.0,
) -> list[NodeResult]:
    """Run ``commands`` side by side (e.g. the nodes of one torchrun job) and return each one's outcome.

    Outputs go to files, so no pipe fills up and every process's output is kept whatever the order
    they end in. When one process fails, the others get ``peer_grace_s`` to end on their own (a
    peer blocked in a collective with the dead one never would), then everything left is killed:
    a failure shows up at once, with every process's output, instead of after ``timeout``.
    Each command runs in its own session and its whole process group is killed.
    """
    logs = [(cwd / f".node_{index}.out", cwd / f".node_{index}.err") for index in range(len(commands))]
    processes, killed = [], set()
    try:
        for command, (out, err) in zip(commands, logs):
            with open(out, "w") as stdout, open(err, "w") as stderr:
                processes.append(
                    subprocess.Popen(command, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
                )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            codes = [process.poll() for process in processes]
            if all(code is not None for code in codes):
                break
            if any(code not in (None, 0) for code in codes):
                deadline = min(deadline, time.monotonic() + peer_grace_s)
            time.sleep(0.2)  # polling interval of the condition above
    finally:
        for process in processes:
            if process.poll() is None:
                killed.add(process.pid)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            else:  # the launcher is gone; its session may still hold children
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return [
        NodeResult(process.returncode, process.pid in killed, out.read_text(), err.read_text())
        for process, (out, err) in zip(processes, logs)
    ]


def torchrun_command(store_port: int, *, nnodes: int = 1, nproc: int = 1) -> list[str]:
    """``python -m torch.distributed.run`` joining the c10d rendezvous store a test holds on ``store_port``.

    The test holds the store (on a port the OS picked, so none is probed and then bound by someone else)
    and every node joins it as a client (``is_host=0``); a fresh rendezvous id per call keeps concurrent
    runs apart. Append torchrun's own flags, then the script and its arguments."""
    return [
        sys.executable,
        *("-m torch.distributed.run --rdzv-backend c10d --rdzv-conf is_host=0".split()),
        *("--nnodes", str(nnodes), "--nproc-per-node", str(nproc)),
        *("--rdzv-endpoint", f"127.0.0.1:{store_port}", "--rdzv-id", f"test_job_{uuid.uuid4().hex}"),
    ]
