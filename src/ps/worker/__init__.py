"""The worker side of the parameter server: the step machine every worker carries, and what it is built from.

:class:`StepMachine` (:mod:`~src.ps.worker.machine`) is the protocol: what to send next and what a reply or a failed
call means; it speaks in exchanges of :class:`Call` (:mod:`~src.ps.worker.calls`). Around it: who the worker is to
the server (:mod:`~src.ps.worker.membership`), compression and error feedback (:mod:`~src.ps.worker.codec`), replies
into tensors (:mod:`~src.ps.worker.loading`), the gradients of handed batches (:mod:`~src.ps.worker.compute`), the
hooks of a streamed worker (:mod:`~src.ps.worker.streaming`), and the blocking drivers' connections
(:mod:`~src.ps.worker.connections`).
"""

from src.ps.worker.calls import Call, Exchange
from src.ps.worker.codec import PushCodec
from src.ps.worker.compute import WorkerCompute, check_layout, worker_log
from src.ps.worker.connections import Connections, Heartbeats
from src.ps.worker.loading import served_tensors
from src.ps.worker.machine import Rejoined, StepFigures, StepMachine
from src.ps.worker.membership import IncarnationRevoked, Membership, Rejoins
from src.ps.worker.streaming import PushStreams, StreamedModel

__all__ = [
    "Call",
    "Connections",
    "Exchange",
    "Heartbeats",
    "IncarnationRevoked",
    "Membership",
    "PushCodec",
    "PushStreams",
    "Rejoined",
    "Rejoins",
    "StepFigures",
    "StepMachine",
    "StreamedModel",
    "WorkerCompute",
    "check_layout",
    "served_tensors",
    "worker_log",
]
