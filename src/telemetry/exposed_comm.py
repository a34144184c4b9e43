"""Exposed communication: the part of a step's communication that computation did not hide.

A step's gradient exchange costs training time only where nothing else runs meanwhile; that part,
not the exchange's full length, is what compression can win back (horovod#1800). Every distributed
run summary records it as ``exposed_communication_s`` (per worker or rank, and summed over them),
and the report's time split shows it for every architecture. What it is, measured, per architecture:

* **Parameter server** (:func:`exposed_communication`): a worker sends its push and then waits for
  the reply, which carries its next parameters and work; it computes nothing in between. So the whole
  push round trip is exposed, and ``exposed_communication_s`` *is* the worker's measured
  ``communication_time_s``: from the end of compression to the reply in hand (the uplink transfer,
  the server's decode and apply, in sync mode the wait at the barrier for the other workers, the
  reply's build and transfer). An emulated uplink's wait is inside it.
* **Parameter server, streaming** (``system.streaming``, :mod:`src.ps.worker.streaming`): the push leaves in
  parts during backward and the reply arrives during the next forward, so only the waits are exposed, and
  the worker's ``communication_time_s`` counts exactly them: from the end of backward (its last gradient
  handed over) to the reply's head in hand (span ``reply_wait``: the parts still on the wire, the server, the
  barrier), plus each wait of the next forward for a layer's parameters (span ``parameter_wait``). The push
  in flight as a whole is the span ``push`` on the push's own thread. So ``exposed_communication_s`` is
  ``communication_time_s`` for both workers, measured as DDP's is: from the last gradient to going on.
* **DDP** (:class:`BackwardWait`): DDP starts each bucket's exchange as soon as the bucket's
  gradients are computed, while the backward pass goes on with the next buckets, and the backward
  call returns only once every bucket's exchange is done. The exposed part is that wait at the end of
  backward: from the moment the last parameter's gradient is accumulated (a post-accumulate-grad
  hook on every parameter, which fires just before DDP's own hook on the same gradient) to the return
  of ``backward()``. It is measured the same way for every exchange (the built-in C++ allreduce,
  whose traffic Python cannot see, the ring hook, the compression hooks, where compressing and
  decompressing the last buckets counts as exchange) and includes waiting for a slower rank to
  reach the collective, as the parameter server's barrier wait does. Not in it: what the exchange
  threads take from the backward pass by sharing its cores (the backward pass is slower, not
  blocked). On CUDA the readings are host times: a gradient counts as computed when its kernels are
  queued, so the figure is a lower bound there.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from torch import nn

from src.telemetry import tracing


def exposed_communication(worker: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter-server worker's totals with ``exposed_communication_s`` (= its ``communication_time_s``)."""
    return {**worker, "exposed_communication_s": worker["communication_time_s"]}


class BackwardWait:
    """How long each DDP backward pass waited for the gradient exchange after its last gradient.

    Use: call :meth:`backward_started` just before ``loss.backward()`` and :meth:`backward_ended`
    with a ``time.perf_counter()`` reading just after it; that returns the step's exposed seconds
    (and records them as span ``exchange_wait`` when tracing), and :attr:`total_s` sums them.

    Args:
        module: the model DDP wraps (its trainable parameters get a post-accumulate-grad hook).
    """

    def __init__(self, module: nn.Module):
        self.total_s = 0.0
        self.last_ready: float | None = None
        """``perf_counter`` when this step's latest gradient was accumulated (``None``: none yet)."""
        self._handles = [
            p.register_post_accumulate_grad_hook(self._ready) for p in module.parameters() if p.requires_grad
        ]

    def _ready(self, _parameter: nn.Parameter) -> None:
        self.last_ready = time.perf_counter()  # runs on the autograd thread: one float store, no lock needed

    def backward_started(self) -> None:
        self.last_ready = None

    def backward_ended(self, ended: float) -> float:
        """The step's exposed seconds, also added to :attr:`total_s` (0 when no gradient was computed)."""
        if self.last_ready is None:
            return 0.0
        waited = max(0.0, ended - self.last_ready)
        self.total_s += waited
        tracing.record("exchange_wait", min(self.last_ready, ended), ended)
        return waited

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
