"""Membership and work assignment of a parameter-server run: who is alive, and who trains on what.

Pure logic: no gRPC, no threads, no I/O. Time comes from an injectable clock, so failure detection
is tested without waiting. The parameter server (:mod:`src.parameter_server`) calls it with its lock
held and turns what it returns into replies and events.

**Membership** (:class:`Membership`). Each registration of a worker id is a new *incarnation* with a
random *session* secret; every later call must carry that session, so one worker cannot act as
another and a late message from a failed incarnation is refused. A worker counts as failed when it
has been silent (no heartbeat, no call) for ``heartbeat_timeout`` seconds, whether its process died
or hangs, or at once when a new incarnation of the same id registers.

**Work** (:class:`WorkPlan`). Each epoch's seeded permutation is split into the usual shards
(:func:`src.training.data.make_shards`: worker k owns positions k, k+N, ...) and each shard into batches: plain
lists of sample indices with an id, queued for their owner. The plan hands batches out, and a batch
is *done* only when an update containing it was applied. What a failed worker held (in flight, or
carried after a rejected push) and what it had queued goes back to the queues of the live workers
(fewest queued first), so every index of every epoch lands in exactly one applied update.

* **sync**: lock-step rounds. A round gives every ready live worker the next batch of its queue;
  the workers that got one are the round's barrier; the round after it starts once that barrier's
  update is applied. A worker that joins mid-epoch (rejoined, restarted) gets an even share of the
  batches left in the live workers' queues. Epoch e+1 starts only when every batch of epoch e is done, so without faults
  round i of all workers reads exactly positions ``i*N*b .. (i+1)*N*b`` of the permutation: the
  baseline's step i with batch ``N*b``.
* **async**: on demand. A worker takes from its own queue in the oldest epoch that still has
  unassigned batches; when its queue there is empty it takes from the longest queue of that epoch
  (work stealing), so a fast worker is never idle while a straggler holds work; then it moves to
  the next epoch. With one worker the order is exactly the baseline's.

:func:`check_coverage` audits a finished run from its events alone.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

from src.common.sessions import SessionSigner
from src.training.data import make_shards

MemberState = Literal["live", "awaited", "failed", "replaced", "finished"]


# ----------------------------------------------------------------------------- membership


@dataclass
class Member:
    """One incarnation of a worker."""

    worker_id: int
    incarnation: int
    session: bytes = field(repr=False)
    registered_at: float
    last_seen: float
    state: MemberState = "live"
    ready: bool = False
    """It has pulled its first parameters and work (sync rounds wait for ready workers)."""
    pid: int = 0
    """The worker's process id on its host, as it reported it."""


class MembershipError(Exception):
    """A call whose caller is not a live member; ``kind`` says why.

    * ``unknown``: no such session here (the server restarted, or the worker never registered):
      the worker should register again.
    * ``revoked``: this incarnation was failed or replaced: it is over (the process may register
      again as a new incarnation, :mod:`src.ps.worker.membership`, or stop).
    * ``finished``: this incarnation has finished.
    """

    def __init__(self, kind: Literal["unknown", "revoked", "finished"], message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


class Membership:
    """Registrations, sessions and heartbeats of ``num_workers`` worker ids.

    Args:
        num_workers: worker ids are ``0 .. num_workers-1``.
        heartbeat_timeout_s: silence after which a live incarnation is failed by :meth:`expire`.
        clock: monotonic seconds (injectable for tests).
        first_incarnation: incarnations are numbered from here (a resumed server continues its count).
        session_bytes: random bytes for a session (injectable for tests).
        signer: sign sessions with the run's key instead (shard 0 of a sharded server:
            :mod:`src.ps.shards.sessions` checks them on the other shards).
    """

    def __init__(
        self,
        num_workers: int,
        heartbeat_timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        first_incarnation: int = 1,
        session_bytes: Callable[[int], bytes] = secrets.token_bytes,
        signer: SessionSigner | None = None,
    ):
        self.num_workers = num_workers
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        self.next_incarnation = first_incarnation
        self._session_bytes = session_bytes
        self.signer = signer
        self.current: dict[int, Member] = {}
        """The newest incarnation of each worker id that ever registered."""
        self.history: list[Member] = []

    def register(self, worker_id: int, pid: int = 0) -> tuple[Member, Member | None]:
        """A new incarnation of ``worker_id``; returns it and the live incarnation it replaced, if any.

        Raises:
            ValueError: ``worker_id`` out of range.
        """
        if not 0 <= worker_id < self.num_workers:
            raise ValueError(
                f"worker_id {worker_id} is out of range 0..{self.num_workers - 1} "
                f"(system.num_workers={self.num_workers})"
            )
        replaced = self.current.get(worker_id)
        if replaced is not None and replaced.state == "live":
            replaced.state = "replaced"
        else:
            replaced = None
        now = self.clock()
        member = Member(
            worker_id, self.next_incarnation, self._session(worker_id, self.next_incarnation), now, now, pid=pid
        )
        self.next_incarnation += 1
        self.current[worker_id] = member
        self.history.append(member)
        return member, replaced

    def await_(self, worker_id: int, incarnation: int, pid: int) -> Member:
        """A worker that was live when a restarted server's checkpoint was written (state ``awaited``).

        It is not live (no work, no barrier) until it registers again, which replaces it silently; if it
        stays silent for the heartbeat timeout, :meth:`expire` fails it like any silent member (a process
        that hung while the server was down is detected by the restarted server), and it joins the history,
        so a registration after that is a rejoin.
        """
        now = self.clock()
        member = Member(
            worker_id, incarnation, self._session(worker_id, incarnation), now, now, state="awaited", pid=pid
        )
        self.current[worker_id] = member
        return member

    def _session(self, worker_id: int, incarnation: int) -> bytes:
        """A new session secret: random, or signed (checkable by every shard of a sharded server)."""
        return self.signer.issue(worker_id, incarnation) if self.signer is not None else self._session_bytes(16)

    def awaited(self) -> list[int]:
        """Ids of workers a restarted server still waits for, ascending."""
        return sorted(w for w, m in self.current.items() if m.state == "awaited")

    def check(self, worker_id: int, session: bytes) -> Member:
        """The live member making a call with ``session``, marked as seen.

        Raises:
            MembershipError: not a live member (see its ``kind``).
        """
        member = self.current.get(worker_id)
        if member is None:
            raise MembershipError("unknown", f"worker {worker_id} is not registered here (register again)")
        if not hmac.compare_digest(member.session, session):  # constant time: sessions are secrets
            older = next(
                (m for m in self.history if m.worker_id == worker_id and hmac.compare_digest(m.session, session)), None
            )
            if older is None:
                raise MembershipError("unknown", f"worker {worker_id}: unknown session (register again)")
            raise MembershipError(
                "revoked",
                f"worker {worker_id} incarnation {older.incarnation} was {older.state} "
                f"(incarnation {member.incarnation} is current)",
            )
        if member.state == "finished":
            raise MembershipError("finished", f"worker {worker_id} incarnation {member.incarnation} has finished")
        if member.state != "live":
            raise MembershipError(
                "revoked", f"worker {worker_id} incarnation {member.incarnation} was declared {member.state}"
            )
        member.last_seen = self.clock()
        return member

    def verify(self, member: Member) -> None:
        """Raise :class:`MembershipError` if ``member`` is no longer the live incarnation (not a sign of life)."""
        if self.current.get(member.worker_id) is not member or member.state != "live":
            raise MembershipError(
                "revoked" if member.state != "finished" else "finished",
                f"worker {member.worker_id} incarnation {member.incarnation} was declared {member.state}",
            )

    def expire(self) -> list[tuple[Member, float]]:
        """Fail every live member silent for longer than the timeout; returns them with their silence (s)."""
        now = self.clock()
        failed = []
        for member in self.current.values():
            silence = now - member.last_seen
            if member.state in ("live", "awaited") and silence > self.heartbeat_timeout_s:
                if member.state == "awaited":
                    self.history.append(member)
                member.state = "failed"
                failed.append((member, silence))
        return failed

    def fail(self, member: Member) -> None:
        """Declare ``member`` failed (e.g. its process is known to be gone)."""
        if member.state == "live":
            member.state = "failed"

    def finish(self, member: Member) -> None:
        member.state = "finished"

    def live(self) -> list[int]:
        """Ids of workers whose current incarnation is live, ascending."""
        return sorted(w for w, m in self.current.items() if m.state == "live")

    def ready(self) -> list[int]:
        """Ids of live workers that have pulled their first work, ascending."""
        return sorted(w for w, m in self.current.items() if m.state == "live" and m.ready)


# ----------------------------------------------------------------------------- work


@dataclass(frozen=True)
class Batch:
    """One step's samples: positions of the dataset, with a run-wide id and its epoch."""

    batch_id: int
    epoch: int
    indices: tuple[int, ...]


class _Epoch:
    """Queues, holders and progress of one epoch.

    ``queued`` counts the batches in the queues (kept by every method that adds or takes one): a
    server polls for work far more often than work changes hands, with many workers and epochs.
    """

    def __init__(self, epoch: int, queues: dict[int, deque[Batch]], total: int):
        self.epoch = epoch
        self.queues = queues
        self.total = total
        self.done = 0
        self.queued = sum(len(q) for q in queues.values())

    def unassigned(self) -> int:
        return self.queued


class WorkPlan:
    """Batches of every epoch, who holds which, and which are done (see the module docstring).

    Args:
        num_samples: training-set size.
        num_workers: configured workers (shards per epoch).
        batch_size: samples per batch (per worker per step).
        num_epochs: epochs to train.
        seed: data-order seed (:func:`src.training.data.epoch_permutation`).
        mode: ``sync`` (rounds) or ``async`` (on demand, with stealing).
        batches_per_step: batches handed out at once (local steps).
    """

    def __init__(
        self,
        num_samples: int,
        num_workers: int,
        batch_size: int,
        num_epochs: int,
        seed: int,
        mode: Literal["sync", "async"],
        *,
        batches_per_step: int = 1,
    ):
        self.num_samples, self.num_workers, self.batch_size = num_samples, num_workers, batch_size
        self.num_epochs, self.seed, self.mode, self.batches_per_step = num_epochs, seed, mode, batches_per_step
        self.epochs: dict[int, _Epoch] = {}
        self.held: dict[int, list[Batch]] = {}
        """Batches handed to a worker and not yet in an applied update (in flight, or carried after a rejection)."""
        self._next_batch_id = 1

    # ---------------------------------------------------------------- epochs

    def _create_epoch(self, epoch: int, live: list[int]) -> _Epoch:
        queues: dict[int, deque[Batch]] = {w: deque() for w in range(self.num_workers)}
        for shard in make_shards(self.num_samples, self.num_workers, epoch, self.seed):
            for indices in shard.batches(self.batch_size):
                queues[shard.owner].append(Batch(self._next_batch_id, epoch, tuple(indices)))
                self._next_batch_id += 1
        state = _Epoch(epoch, queues, sum(len(q) for q in queues.values()))
        self.epochs[epoch] = state
        if self.mode == "sync":  # rounds serve only live workers (async steals from any queue instead)
            self._rebalance(state, live)
        return state

    def _open_epoch(self, live: list[int]) -> _Epoch | None:
        """The oldest epoch with unassigned batches, creating the next one when every older one is handed out.

        sync creates epoch e+1 only once every batch of epoch e is done (rounds never mix epochs).
        """
        for epoch in sorted(self.epochs):
            if self.epochs[epoch].unassigned():
                return self.epochs[epoch]
        upcoming = max(self.epochs, default=-1) + 1
        if upcoming >= self.num_epochs or (self.mode == "sync" and self.epochs_done() < upcoming):
            return None
        return self._create_epoch(upcoming, live)

    def epochs_done(self) -> int:
        """How many leading epochs have every batch done."""
        count = 0
        while count in self.epochs and self.epochs[count].done == self.epochs[count].total:
            count += 1
        return count

    def finished(self) -> bool:
        """Every batch of every epoch is done."""
        return self.epochs_done() >= self.num_epochs

    # ---------------------------------------------------------------- handing out

    def _take(self, worker: int, live: list[int]) -> list[Batch]:
        """Up to ``batches_per_step`` batches for ``worker`` (none if nothing is unassigned now)."""
        taken: list[Batch] = []
        while len(taken) < self.batches_per_step:
            epoch = self._open_epoch(live)
            if epoch is None or (self.mode == "sync" and taken and taken[-1].epoch != epoch.epoch):
                break
            queues = epoch.queues
            if queues[worker]:
                taken.append(queues[worker].popleft())
            elif self.mode == "sync":
                break
            else:
                orphaned = [w for w in queues if queues[w] and w not in live]
                if orphaned:  # a failed worker's queue: nobody else will take it, so from the front
                    taken.append(queues[orphaned[0]].popleft())
                else:  # steal from the tail of the longest queue: its owner keeps its next batches
                    taken.append(queues[max(queues, key=lambda w: len(queues[w]))].pop())
            epoch.queued -= 1
        self.held.setdefault(worker, []).extend(taken)
        return taken

    def start_round(self, ready: list[int], live: list[int]) -> dict[int, list[Batch]]:
        """sync: hand the next batch to every ready worker that has one; returns ``{worker: batches}``.

        Call when no round is open (at the start, and after each applied round). Batches queued for
        workers that are not live are first moved to live ones. An empty result means the run is
        finished, or no ready worker has work (wait for a worker to become ready).
        """
        for epoch in self.epochs.values():
            self._rebalance(epoch, live)
            self._level(epoch, live)
        handed: dict[int, list[Batch]] = {}
        for worker in ready:
            batches = self._take(worker, live)
            if batches:
                handed[worker] = batches
        return handed

    def next_for(self, worker: int, live: list[int]) -> list[Batch]:
        """async: the worker's next batches; empty when nothing is unassigned right now."""
        return self._take(worker, live)

    def holding(self, worker: int) -> list[Batch]:
        """What ``worker`` holds: the batches its next push must cover."""
        return list(self.held.get(worker, ()))

    # ---------------------------------------------------------------- outcomes

    def applied(self, worker: int) -> tuple[list[Batch], list[int]]:
        """Everything ``worker`` held is in an applied update; returns those batches and the epochs now done."""
        done_before = self.epochs_done()
        batches = self.held.pop(worker, [])
        for batch in batches:
            self.epochs[batch.epoch].done += 1
        return batches, list(range(done_before, self.epochs_done()))

    def release(self, worker: int, live: list[int]) -> dict[int, list[Batch]]:
        """``worker`` failed: what it held and had queued goes to the other ``live`` workers' queues.

        Returns ``{recipient: batches}`` (recipient ``worker`` itself when nobody else is live: the
        batches wait in its queue for a replacement, or for a live worker to take them over).
        """
        moved = self.held.pop(worker, [])
        for epoch in self.epochs.values():
            moved.extend(epoch.queues[worker])
            epoch.queued -= len(epoch.queues[worker])
            epoch.queues[worker].clear()
        others = [w for w in live if w != worker]
        recipients: dict[int, list[Batch]] = {}
        for batch in sorted(moved, key=lambda b: b.batch_id):
            epoch = self.epochs[batch.epoch]
            queues = epoch.queues
            target = min(others, key=lambda w: (len(queues[w]), w)) if others else worker
            queues[target].append(batch)
            epoch.queued += 1
            recipients.setdefault(target, []).append(batch)
        for queue in (q for e in self.epochs.values() for q in e.queues.values()):
            if len(queue) > 1:  # keep each queue in batch order: older work first
                ordered = sorted(queue, key=lambda b: b.batch_id)
                queue.clear()
                queue.extend(ordered)
        return recipients

    def claim(self, worker: int, batch_ids: Iterable[int]) -> list[int]:
        """Make ``worker`` hold these batches again (it carries their gradients); returns ids not found queued."""
        wanted = set(batch_ids)
        for epoch in self.epochs.values():
            for queue in epoch.queues.values():
                found = [b for b in queue if b.batch_id in wanted]
                for batch in found:
                    queue.remove(batch)
                    epoch.queued -= 1
                    self.held.setdefault(worker, []).append(batch)
                    wanted.discard(batch.batch_id)
        return sorted(wanted)

    def _rebalance(self, epoch: _Epoch, live: list[int]) -> None:
        """Move the queues of owners that are not live to the live workers (fewest queued first)."""
        if not live:
            return
        for owner in [w for w in epoch.queues if w not in live and epoch.queues[w]]:
            while epoch.queues[owner]:
                batch = epoch.queues[owner].popleft()
                epoch.queues[min(live, key=lambda w: (len(epoch.queues[w]), w))].append(batch)

    def _level(self, epoch: _Epoch, live: list[int]) -> None:
        """sync: even out the live workers' queues, from the tail of the longest one.

        A worker that joins mid-epoch (it rejoined, or was restarted, after its queue went to the
        others) gets its share of what is left instead of waiting for the next epoch. The queues of a
        run without faults differ by at most one batch (uneven shards) and are left as they are.
        """
        queues = epoch.queues
        changed = set()
        while len(live) > 1:
            longest = max(live, key=lambda w: (len(queues[w]), -w))
            shortest = min(live, key=lambda w: (len(queues[w]), w))
            if len(queues[longest]) - len(queues[shortest]) <= 1:
                break
            queues[shortest].append(queues[longest].pop())
            changed.add(shortest)
        for worker in changed:  # older work first
            ordered = sorted(queues[worker], key=lambda b: b.batch_id)
            queues[worker].clear()
            queues[worker].extend(ordered)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Progress and every batch not yet done, with its owner (a held batch goes back to its holder)."""
        pending = []
        for epoch in self.epochs.values():
            for owner, queue in epoch.queues.items():
                pending.extend([owner, b.batch_id, b.epoch, list(b.indices)] for b in queue)
        for worker, batches in self.held.items():
            pending.extend([worker, b.batch_id, b.epoch, list(b.indices)] for b in batches)
        return {
            "epochs": {str(e): [s.total, s.done] for e, s in self.epochs.items()},
            "pending": pending,
            "next_batch_id": self._next_batch_id,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: nothing is held, every pending batch is queued for its owner."""
        self.epochs = {}
        for key, (total, done) in state["epochs"].items():
            epoch = int(key)
            self.epochs[epoch] = _Epoch(epoch, {w: deque() for w in range(self.num_workers)}, total)
            self.epochs[epoch].done = done
        for owner, batch_id, epoch, indices in sorted(state["pending"], key=lambda p: p[1]):
            self.epochs[epoch].queues[owner].append(Batch(batch_id, epoch, tuple(indices)))
            self.epochs[epoch].queued += 1
        self._next_batch_id = state["next_batch_id"]
        self.held = {}


# ----------------------------------------------------------------------------- audit


def check_coverage(events: Iterable[dict[str, Any]], num_samples: int, num_epochs: int) -> dict[str, Any]:
    """Audit a run from its server events: is every index of every epoch in exactly one applied update?

    Reads ``update`` events (``version``, ``samples``: ``[[epoch, [indices...]], ...]``, ``requests``:
    ``[[worker, request_id], ...]``) and ``server_recovered`` events (``version``: the checkpoint it
    resumed from), whose arrival voids the updates logged after that version by the server that died.

    Returns:
        ``{"ok", "missing", "duplicated", "unexpected", "requests_applied_twice", "updates", "voided",
        "examples"}``: per-problem counts and a few examples of each.
    """
    updates: list[dict[str, Any]] = []
    voided = 0
    for event in events:
        if event.get("kind") == "update":
            updates.append(event)
        elif event.get("kind") == "server_recovered":
            kept = [u for u in updates if u["version"] <= event["version"]]
            voided += len(updates) - len(kept)
            updates = kept
    applied = [(u["version"], epoch, indices) for u in updates for epoch, indices in u["samples"]]
    request_counts: dict[tuple[int, int], int] = {}
    for update in updates:
        for worker, request_id in update.get("requests", []):
            request_counts[(worker, request_id)] = request_counts.get((worker, request_id), 0) + 1
    twice = sorted(key for key, count in request_counts.items() if count > 1)
    seen: dict[tuple[int, int], int] = {}
    for _, epoch, indices in applied:
        for index in indices:
            seen[(epoch, index)] = seen.get((epoch, index), 0) + 1
    expected = {(e, i) for e in range(num_epochs) for i in range(num_samples)}
    missing = sorted(expected - seen.keys())
    duplicated = sorted(key for key, count in seen.items() if count > 1)
    extra = sorted(seen.keys() - expected)
    return {
        "ok": not missing and not duplicated and not extra and not twice,
        "missing": len(missing),
        "duplicated": len(duplicated),
        "unexpected": len(extra),
        "requests_applied_twice": len(twice),
        "examples": {"missing": missing[:5], "duplicated": duplicated[:5], "unexpected": extra[:5]},
        "updates": len(updates),
        "voided": voided,
    }


def applied_history(events: Iterable[dict[str, Any]], recovered: str = "server_recovered") -> dict[int, list]:
    """The versions a server (or a shard) holds at the end of its event log, each with the pushes it was made of
    (``update`` events' ``requests``, sorted), the versions past each ``recovered`` event's version voided."""
    versions: dict[int, list] = {}
    for event in events:
        if event.get("kind") == recovered:
            versions = {v: pushes for v, pushes in versions.items() if v <= event["version"]}
        elif event.get("kind") == "update":
            versions[event["version"]] = sorted(tuple(pair) for pair in event.get("requests", []))
    return versions


def check_shards(server_events: Iterable[dict[str, Any]], followers: dict[int, Iterable[dict[str, Any]]]) -> dict:
    """Audit a sharded run: does every follower shard hold every version shard 0 holds, each made of the same
    pushes (:func:`applied_history`; a follower's recoveries are its ``shard_recovered`` events)? Then what
    :func:`check_coverage` says of shard 0 holds on every shard: each sample of each epoch in exactly one applied
    update. ``followers``: each follower's events, by shard.

    Returns:
        ``{"ok", "versions", "shards": {shard: {"versions", "missing", "extra", "differ"}}}``, the last three a
        few versions each.
    """
    reference = applied_history(server_events)
    shards = {}
    for shard, events in sorted(followers.items()):
        held = applied_history(events, "shard_recovered")
        shards[shard] = {
            "versions": len(held),
            "missing": sorted(reference.keys() - held.keys())[:5],
            "extra": sorted(held.keys() - reference.keys())[:5],
            "differ": sorted(v for v in reference.keys() & held.keys() if reference[v] != held[v])[:5],
        }
    ok = all(not (s["missing"] or s["extra"] or s["differ"]) for s in shards.values())
    return {"ok": ok, "versions": len(reference), "shards": shards}
