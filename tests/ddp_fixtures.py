"""Helpers for the DDP tests: spawn real gloo ranks with a deadline, and always reap them.

A test's rank function runs in a spawned child as ``fn(rank, world_size, port, *args)``; it calls
:func:`join_group` to join a gloo group whose store the parent hosts on an OS-chosen port.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN_TIMEOUT_S = 240


def join_group(rank: int, world_size: int, port: int) -> None:
    """In a spawned rank: one intra-op thread (the tests share 2 cores) and a gloo group."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def spawn_ranks(fn, world_size: int, *args, timeout: float = SPAWN_TIMEOUT_S) -> None:
    """Run ``fn`` on ``world_size`` spawned ranks; raise if one fails or the deadline passes.

    Every child is terminated (then killed) and reaped before this returns, whatever happens.
    """
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.start_processes(fn, args=(world_size, store.port, *args), nprocs=world_size, join=False, start_method="spawn")
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


def free_port() -> int:
    """A port that was free a moment ago (only for tools that insist on a fixed port, e.g. torchrun's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
