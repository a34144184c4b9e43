"""Exposed communication split in two: waiting for the slowest peer, and what came after every peer was ready.

A sync step's exposed communication (:mod:`src.telemetry.exposed_comm`) includes, for every worker but the slowest,
the time until the slowest one's gradients are ready: a parameter server's barrier waits for the last push, a DDP
allreduce for the last rank. That part is set by how unequal the workers' compute is (on a machine whose cores the
workers share with each other, a server and the network stack, it is most of it), not by the communication. What
comes after the last worker's gradients are ready (the last bytes on the wire, the server's step, the reply's head,
a forward waiting for a layer) is what the communication itself leaves exposed.

:func:`split_exposed` splits each worker's waits of each step at that moment, the same way for both architectures,
from their traces (``system.trace``):

* **Parameter server, streamed** (:mod:`src.ps.worker.streaming`): a step's gradients are ready when its
  ``forward_backward`` span ends; its waits are its ``reply_wait`` span and the ``parameter_wait`` spans of the
  next forward.
* **DDP** (:class:`~src.telemetry.exposed_comm.BackwardWait`): a step's gradients are ready when its last gradient
  is (the start of its ``exchange_wait`` span); its wait is that span.

Pure: the bench (:mod:`src.benchmarks.overlap`) reads the traces and hands the spans over.
"""

from __future__ import annotations

from typing import Sequence

Interval = tuple[float, float]


def split_exposed(
    ready: Sequence[Sequence[float]], waits: Sequence[Sequence[Sequence[Interval]]]
) -> dict[str, float | int]:
    """``ready[w][k]``: when worker ``w``'s step ``k`` had its gradients; ``waits[w][k]``: the intervals it waited on
    the network for that step. Returns the mean per worker-step (seconds) of the waits before every worker's step
    ``k`` was ready (``waiting_for_peers_s``) and after (``after_all_ready_s``), and the steps counted (the ones
    every worker has).
    """
    steps = min(min(len(r) for r in ready), min(len(w) for w in waits))
    workers = len(ready)
    peers = after = 0.0
    for k in range(steps):
        last = max(ready[w][k] for w in range(workers))
        for w in range(workers):
            for start, end in waits[w][k]:
                before = max(0.0, min(end, last) - start)
                peers += before
                after += (end - start) - before
    count = max(1, steps * workers)
    return {"waiting_for_peers_s": peers / count, "after_all_ready_s": after / count, "steps": steps}


def ps_steps(
    forward_backward: Sequence[Interval], reply_wait: Sequence[Interval], parameter_wait: Sequence[Interval]
) -> tuple[list[float], list[list[Interval]]]:
    """A streamed parameter-server worker's ``(ready, waits)`` per step from its spans (each list in time order): a
    step's ``parameter_wait`` spans are those inside the next ``forward_backward`` (the forward waiting for the
    reply of this step)."""
    ready = [end for _, end in forward_backward]
    waits: list[list[Interval]] = [[] for _ in forward_backward]
    for k, interval in enumerate(reply_wait[: len(waits)]):
        waits[k].append(interval)
    for start, end in parameter_wait:
        step = next((k - 1 for k, (a, b) in enumerate(forward_backward) if a <= start <= b), None)
        if step is not None and step >= 0:
            waits[step].append((start, end))
    return ready, waits


def ddp_steps(exchange_wait: Sequence[Interval]) -> tuple[list[float], list[list[Interval]]]:
    """A DDP rank's ``(ready, waits)`` per step from its ``exchange_wait`` spans (in time order)."""
    return [start for start, _ in exchange_wait], [[interval] for interval in exchange_wait]
