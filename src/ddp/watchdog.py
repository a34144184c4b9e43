"""Hung-rank detection for DDP: every rank beats a heartbeat into the job's store and watches its peers'.

A rank that stops (SIGSTOP, Ctrl-Z, a frozen VM, a process stuck holding the GIL) never reaches its
next collective, and its peers wait in theirs: with gloo's default timeout of 30 minutes the whole job
hangs. Two guards end such an attempt, and the elastic agent then restarts the group from its newest
checkpoint (:mod:`src.launch.ddp`, :class:`src.ddp.job.JobRecord`), both set by one number,
``system.collective_timeout_s`` (T, ``--collective-timeout``):

1. **Heartbeats** (:class:`HangWatchdog`). A thread in each rank writes a counter to
   ``heartbeat/<rank>`` in the elastic agent's store (under the attempt's own prefix) every
   ``T / 10`` seconds (at most 1 s) and reads every other rank's. A peer whose counter has not moved
   for T seconds, timed on the reader's own clock (no clocks need to agree), is hung: the reader
   logs ``rank_hung`` (rank, pid, host, seconds silent), prints one line and ends its own process
   with :data:`HUNG_PEER_EXIT` (75), which fails the attempt. A hung peer on the same host that is
   *stopped* (state ``T`` in ``/proc``: SIGSTOP, Ctrl-Z) is SIGKILLed first: a stopped process cannot
   act on the agent's SIGTERM, and the agent would wait 30 s before its own SIGKILL. Detection takes
   T plus at most one interval.
2. **The collective timeout.** The process group waits at most T for a collective during training
   (gloo: the collective raises; nccl: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` tears the process
   down). This ends an attempt whose ranks all beat but one never joins the collective the others
   are in. When a collective times out, :meth:`HangWatchdog.collective_failed` looks for the peer
   that went silent and handles it as above, so the attempt ends the same way whichever guard
   fires first.

A slow rank is never hung: its heartbeat thread beats whatever its steps cost, and its peers wait
for it inside a collective for one of its steps, which must stay under T. Keep T well above the
longest step, evaluation or checkpoint write of a healthy rank (the default, 60 s, is generous for
the models here).

The watchdog reads and writes a store only; it knows nothing of training (tests drive it with a
plain ``TCPStore`` and a fake clock).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

HUNG_PEER_EXIT = 75
"""Exit status of a rank that ended its attempt because a peer was hung (EX_TEMPFAIL: try again)."""
DONE = "done"
"""Heartbeat value of a rank that finished training: it is no longer watched."""
MAX_INTERVAL_S = 1.0


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats (and between looks at the peers') for hang timeout ``timeout_s``."""
    return min(MAX_INTERVAL_S, timeout_s / 10)


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` in ``/proc`` (``R``, ``S``, ``T`` for stopped, ...), or ``None`` if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ')'
            return stat.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


@dataclass(frozen=True)
class HungPeer:
    """A peer judged hung, and what was done about it."""

    rank: int
    silent_s: float
    pid: int | None
    host: str | None
    killed: bool
    """SIGKILLed by the detecting rank (stopped, on its host)."""
    detected_by: str
    """``heartbeat`` (silent for the timeout) or ``collective timeout`` (a collective with it failed)."""

    def describe(self, timeout_s: float) -> str:
        where = f" (pid {self.pid} on {self.host})" if self.pid is not None else ""
        what = "killed it (stopped: it could not act on the agent's SIGTERM) and " if self.killed else ""
        return (
            f"rank {self.rank}{where} sent no heartbeat for {self.silent_s:.1f}s (--collective-timeout {timeout_s:g}, "
            f"noticed by {self.detected_by}): hung; {what}failing this attempt "
            f"so the group restarts from its newest checkpoint"
        )


class HangWatchdog:
    """This rank's heartbeat, and its watch over every other rank's.

    Args:
        store: a store every rank of this attempt shares (keys ``heartbeat/<rank>`` are written there).
        rank, world_size: this rank and the group's size.
        timeout_s: T, seconds of silence after which a peer is hung.
        leave: ends this process with a status once a peer is hung (default ``os._exit``).
        clock, sleep: time source and wait (tests pass fakes).
        host: this machine's name (compared with the peers' to know whether a pid can be signalled).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        *,
        leave: Callable[[int], Any] = os._exit,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        host: str | None = None,
    ):
        self.store = store
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.interval_s = heartbeat_interval(timeout_s)
        self.host = host or socket.gethostname()
        self._leave, self._clock = leave, clock
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._count = 0
        self._lock = threading.Lock()
        self._reporters: list[Callable[..., Any]] = []
        now = clock()
        # per peer: (last value read, when it was first read with that value, on our clock)
        self._seen: dict[int, tuple[str | None, float]] = {
            peer: (None, now) for peer in range(world_size) if peer != rank
        }
        self._thread: threading.Thread | None = None
        self.hung: HungPeer | None = None
        self.beat()

    # -- the heartbeat --------------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"heartbeat/{rank}"

    def beat(self) -> None:
        """Write this rank's next heartbeat."""
        self._count += 1
        self.store.set(self._key(self.rank), f"{self._count} {os.getpid()} {self.host}")

    def start(self) -> "HangWatchdog":
        """Beat and watch on a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, *, finished: bool = False) -> None:
        """Stop the thread; ``finished``: this rank is done training, so peers stop watching it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if finished:
            try:
                self.store.set(self._key(self.rank), DONE)
            except Exception:  # the store may be gone already (the agent tearing down): nothing to tell
                pass

    def report_to(self, reporter: Callable[..., Any]) -> None:
        """Also call ``reporter("rank_hung", **fields)`` when a peer is hung (e.g. ``MetricsLogger.event``)."""
        with self._lock:
            self._reporters.append(reporter)

    def forget(self, reporter: Callable[..., Any]) -> None:
        with self._lock:
            if reporter in self._reporters:
                self._reporters.remove(reporter)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sleep(self.interval_s)
            if self._stop.is_set() or self.check() is not None:
                return

    def check(self) -> HungPeer | None:
        """One round of the thread: beat, look at the peers, handle a hung one (this process then ends)."""
        try:
            self.beat()
            silent = self.look()
        except Exception:  # the store unreachable for now: nothing can be judged this round
            self._blind()
            return None
        return self._handle(silent, "heartbeat") if silent is not None else None

    # -- watching the peers ---------------------------------------------------------------

    def _blind(self) -> None:
        # While we could not read the store we saw nothing: nobody's silence counts from before.
        now = self._clock()
        self._seen = {peer: (value, now) for peer, (value, _) in self._seen.items()}

    def _read(self, peer: int) -> str | None:
        key = self._key(peer)
        return self.store.get(key).decode() if self.store.check([key]) else None

    def look(self) -> tuple[int, float, str | None] | None:
        """Read every watched peer's heartbeat; the first one silent for the timeout, as (rank, silent s, value)."""
        now = self._clock()
        for peer, (value, since) in list(self._seen.items()):
            current = self._read(peer)
            if current == DONE:
                del self._seen[peer]
            elif current != value:
                self._seen[peer] = (current, now)
            elif now - since >= self.timeout_s:
                return peer, now - since, value
        return None

    def collective_failed(self) -> HungPeer | None:
        """A collective failed (timed out): if a peer went silent, handle it as hung (this process then ends).

        A peer silent for two intervals or more, while the collective waited T for it, is the one
        that hung; without one (or when that peer's process on this host is gone: it died, which the
        agent sees by itself) the failure is something else and the caller raises it as usual.
        """
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        try:
            now = self._clock()
            silent = None
            for peer, (value, since) in self._seen.items():
                current = self._read(peer)
                if current != DONE and current == value and now - since >= 2 * self.interval_s:
                    if silent is None or now - since > silent[1]:
                        silent = (peer, now - since, value)
        except Exception:
            return None
        if silent is None or self._gone(silent[2]):
            return None
        return self._handle(silent, "collective timeout")

    def _gone(self, heartbeat: str | None) -> bool:
        """Whether the process of ``heartbeat`` ran on this host and no longer exists."""
        if not heartbeat:
            return False
        _, pid, host = heartbeat.split(" ", 2)
        return host == self.host and process_state(int(pid)) in (None, "Z")

    def _handle(self, silent: tuple[int, float, str | None], detected_by: str) -> HungPeer:
        peer, silent_s, value = silent
        pid, host = None, None
        if value:
            _, pid_text, host = value.split(" ", 2)
            pid = int(pid_text)
        killed = False
        if pid is not None and host == self.host and process_state(pid) == "T":
            try:
                os.kill(pid, signal.SIGKILL)
                killed = True
            except ProcessLookupError:  # gone meanwhile
                pass
        self.hung = HungPeer(peer, round(silent_s, 3), pid, host, killed, detected_by)
        fields = {
            "hung_rank": peer,
            "by_rank": self.rank,
            "timeout_s": self.timeout_s,
            **{k: v for k, v in asdict(self.hung).items() if k != "rank"},
        }
        with self._lock:
            reporters = list(self._reporters)
        for reporter in reporters:
            try:
                reporter("rank_hung", **fields)
            except Exception:  # a closed log must not keep the attempt alive
                pass
        print(f"rank {self.rank}: {self.hung.describe(self.timeout_s)}", file=sys.stderr, flush=True)
        self._leave(HUNG_PEER_EXIT)
        return self.hung
