"""Where a parameter-server worker's work comes from: the server's plan of the dataset, or the worker's own loop.

The server's core (:mod:`src.ps.server.core`) runs the same protocol either way (membership, the sync
barrier, async apply, staleness, de-dup, checkpoints); what differs is small and lives here, behind
:class:`WorkSource`:

* :class:`PlannedWork` (``run_parameter_server_training.py``): the server owns the data order. Its
  :class:`~src.coordinator.WorkPlan` hands out batches of sample indices; a push must cover exactly
  the batches its worker holds; a failed worker's batches go to the others; the run is over when
  every batch of every epoch is in an applied update.
* :class:`ClientWork` (:mod:`src.torch_asgc.server`): each worker trains on its own data in its own
  loop. A reply's work is empty ("train on your next batch"), a push lists no batches and says how
  many samples its gradient covers, a worker may leave whenever its loop ends, and the run is over
  when every worker id has registered and none is live any more. A push with no gradients and
  ``num_samples`` 0 is a *skipped* step (an AMP overflow).

A work source never waits and never locks: the core calls it with its lock held.
"""

from __future__ import annotations

from typing import Any, Iterable

from src import parameter_server_pb2 as pb
from src.coordinator import Batch, Membership, WorkPlan


class WorkRefused(Exception):
    """A push whose batches do not fit the work source (the core refuses it with INVALID_ARGUMENT)."""

    def __init__(self, message: str, *, code: str = "INVALID_ARGUMENT"):
        super().__init__(message)
        self.code = code
        self.message = message


class WorkSource:
    """What the core asks about work (see the module docstring); one instance per server."""

    owns_data: bool = False
    """True when the workers bring their own batches (:class:`ClientWork`)."""

    def message(self, batches: list[Batch] | None, finished: bool) -> pb.Work:
        """The Work a reply carries: ``batches`` to train on (``None``: none new), or ``finished``."""
        raise NotImplementedError

    def start_round(self, ready: list[int], live: list[int]) -> dict[int, list[Batch]]:
        """sync: the work of each worker in the next barrier (``{}``: nobody can start one now)."""
        raise NotImplementedError

    def next_for(self, worker: int, live: list[int]) -> list[Batch] | None:
        """async: ``worker``'s next batches; ``[]`` means push what it carries; ``None``: nothing now."""
        raise NotImplementedError

    def check_covers(self, worker: int, request: pb.PushRequest) -> None:
        """Raise :class:`WorkRefused` unless the push covers what ``worker`` must push."""
        raise NotImplementedError

    def claim(self, worker: int, batch_ids: Iterable[int]) -> list[int]:
        """A re-registered ``worker`` still carries these batches; returns ids that were not found."""
        return []

    def applied(self, worker: int) -> tuple[list[Batch], list[int]]:
        """``worker``'s push is in an applied update: the batches it covered and the epochs now done."""
        return [], []

    def release(self, worker: int, live: list[int]) -> dict[int, list[Batch]]:
        """``worker`` failed: hand what it held to ``live`` workers; returns ``{recipient: batches}``."""
        return {}

    def finished(self) -> bool:
        """Every piece of work is done (replies then say ``finished``)."""
        return False

    def finish_refused(self) -> str | None:
        """Why a worker may not Finish now (``None``: it may)."""
        return None

    def over(self, members: Membership) -> bool:
        """The run is over: nothing left to do and no live or awaited worker."""
        raise NotImplementedError

    def epochs_done(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class PlannedWork(WorkSource):
    """The dataset's :class:`~src.coordinator.WorkPlan`: the server decides who trains on which samples."""

    def __init__(self, plan: WorkPlan):
        self.plan = plan

    def message(self, batches: list[Batch] | None, finished: bool) -> pb.Work:
        """New batches to train on; none and not finished means: push what error feedback carries."""
        return pb.Work(
            finished=finished,
            flush=not finished and not batches,
            batches=[pb.Batch(batch_id=b.batch_id, epoch=b.epoch, indices=b.indices) for b in batches or ()],
        )

    def start_round(self, ready: list[int], live: list[int]) -> dict[int, list[Batch]]:
        return self.plan.start_round(ready, live)

    def next_for(self, worker: int, live: list[int]) -> list[Batch] | None:
        batches = self.plan.next_for(worker, live)
        if batches:
            return batches
        if self.plan.holding(worker):
            return []  # only carried (rejected) batches: flush them
        return None

    def check_covers(self, worker: int, request: pb.PushRequest) -> None:
        held = self.plan.holding(worker)
        expected = sorted(b.batch_id for b in held)
        if not held:
            raise WorkRefused(
                f"push from worker {worker}, which holds no work (pushes only answer work handed out)",
                code="FAILED_PRECONDITION",
            )
        if sorted(request.batch_ids) != expected:
            raise WorkRefused(
                f"push from worker {worker} covers batches {sorted(request.batch_ids)}, but it holds {expected}"
            )
        samples = sum(len(b.indices) for b in held)
        if request.num_samples != samples:
            raise WorkRefused(
                f"push from worker {worker}: num_samples {request.num_samples}, but its batches hold {samples} samples"
            )

    def claim(self, worker: int, batch_ids: Iterable[int]) -> list[int]:
        return self.plan.claim(worker, batch_ids)

    def applied(self, worker: int) -> tuple[list[Batch], list[int]]:
        return self.plan.applied(worker)

    def release(self, worker: int, live: list[int]) -> dict[int, list[Batch]]:
        return self.plan.release(worker, live)

    def finished(self) -> bool:
        return self.plan.finished()

    def finish_refused(self) -> str | None:
        if self.plan.finished():
            return None
        return f"the run is not finished (epochs done {self.plan.epochs_done()}/{self.plan.num_epochs})"

    def over(self, members: Membership) -> bool:
        # an awaited worker (a restarted server's, not registered again yet) is settled first: it registers,
        # or it is failed, which tells the launcher of a process that hung while the server was down
        return self.plan.finished() and not members.live() and not members.awaited()

    def epochs_done(self) -> int:
        return self.plan.epochs_done()

    def state_dict(self) -> dict[str, Any]:
        return self.plan.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan.load_state_dict(state)


class ClientWork(WorkSource):
    """The workers' own loops: every reply says "train on your next batch" (see the module docstring)."""

    owns_data = True

    def __init__(self, num_workers: int):
        self.num_workers = num_workers

    def message(self, batches: list[Batch] | None, finished: bool) -> pb.Work:
        return pb.Work(finished=finished)  # empty: train on your own next batch

    def start_round(self, ready: list[int], live: list[int]) -> dict[int, list[Batch]]:
        return {worker: [] for worker in ready}  # every ready live worker is in the barrier

    def next_for(self, worker: int, live: list[int]) -> list[Batch] | None:
        return []

    def check_covers(self, worker: int, request: pb.PushRequest) -> None:
        if request.batch_ids:
            raise WorkRefused(
                f"push from worker {worker} lists batch ids, but on this server the workers own "
                f"their data (batch_ids must be empty)"
            )

    def over(self, members: Membership) -> bool:
        return len(members.current) == self.num_workers and not members.live() and not members.awaited()
