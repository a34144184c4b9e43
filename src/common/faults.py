"""Fault injection as a feature: which process to hurt, how, and when, for watching a failure survived.

A fault is written ``ACTION:TARGET@TRIGGER=N`` and given with ``--inject-fault`` (repeatable) or in the
config as ``system.inject_faults`` (a list of the same strings)::

    kill:worker=1@step=40      SIGKILL worker 1 when it reaches its 40th step
    hang:worker=0@step=30      SIGSTOP worker 0 at its 30th step (it stays stopped: a hung process)
    pause=8:worker=0@step=30   SIGSTOP worker 0 at its 30th step and SIGCONT it 8 s later (a pause that ends)
    kill:server@version=150    SIGKILL the parameter server when its version reaches 150
    kill:rank=1@step=20        SIGKILL DDP rank 1 at its 20th step

Actions: ``kill`` (a real SIGKILL), ``hang`` (a real SIGSTOP) and ``pause=SECONDS`` (a real SIGSTOP,
then a real SIGCONT from a helper process that many seconds later; workers only: a worker silent for
longer than ``system.heartbeat_timeout`` is declared failed while alive, and rejoins when it
continues). Targets: ``worker=K`` and ``server`` (parameter server), ``rank=R`` (DDP). Triggers:
``step`` (a worker's or rank's own training steps, counted from 1 within its incarnation) and
``version`` (the server's version).

A fault fires in the first incarnation of its target only: a worker restarted after a kill, a
server resumed from its checkpoint, or a DDP group restarted by the elastic agent does not fire the
same fault again (the launcher hands faults only to first incarnations; DDP ranks check
``TORCHELASTIC_RESTART_COUNT``). The process signals itself: the signal is as real as one sent by
``kill -9`` from a shell, and fires at an exact, reproducible point.

Parsing is pure (:func:`parse_fault`); :meth:`FaultInjector.reached` is the one call a training
loop makes per step or version.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterable, Literal

logger = logging.getLogger(__name__)

ACTIONS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "pause": signal.SIGSTOP}
_TARGET_TRIGGERS = {"worker": ("step",), "server": ("version",), "rank": ("step",)}
_FORMAT = (
    "ACTION:TARGET@TRIGGER=N, e.g. kill:worker=1@step=40, hang:worker=0@step=30, pause=8:worker=0@step=30, "
    "kill:server@version=150, kill:rank=1@step=20"
)
_PATTERN = re.compile(
    r"^(?P<action>\w+)(?:=(?P<seconds>[^:]*))?:(?P<target>\w+)(?:=(?P<index>-?\d+))?"
    r"@(?P<trigger>\w+)=(?P<at>-?\d+)$"
)


@dataclass(frozen=True)
class FaultSpec:
    """One fault: ``action`` the process ``target`` (number ``index``) when ``trigger`` reaches ``at``."""

    action: Literal["kill", "hang", "pause"]
    target: Literal["worker", "server", "rank"]
    index: int | None
    trigger: Literal["step", "version"]
    at: int
    seconds: float | None = None
    """How long a ``pause`` lasts (``None`` for the other actions)."""

    def __str__(self) -> str:
        who = self.target if self.index is None else f"{self.target}={self.index}"
        action = self.action if self.seconds is None else f"{self.action}={self.seconds:g}"
        return f"{action}:{who}@{self.trigger}={self.at}"

    def targets(self, target: str, index: int | None = None) -> bool:
        """Whether this fault is aimed at ``target`` number ``index`` (``None`` for the server)."""
        return self.target == target and self.index == index


def parse_fault(text: str) -> FaultSpec:
    """Parse one fault string.

    Raises:
        ValueError: the string is not of the form :data:`_FORMAT`, naming what is wrong.
    """
    match = _PATTERN.match(text.strip())
    if match is None:
        raise ValueError(f"fault {text!r}: expected {_FORMAT}")
    action, seconds, target, index, trigger, at = match.group("action", "seconds", "target", "index", "trigger", "at")
    if action not in ACTIONS:
        raise ValueError(f"fault {text!r}: unknown action {action!r} (known: {', '.join(ACTIONS)})")
    duration = _pause_seconds(text, action, seconds, target)
    if target not in _TARGET_TRIGGERS:
        raise ValueError(f"fault {text!r}: unknown target {target!r} (known: worker=K, server, rank=R)")
    if target == "server" and index is not None:
        raise ValueError(f"fault {text!r}: the server takes no number (write kill:server@version=N)")
    if target != "server" and index is None:
        raise ValueError(f"fault {text!r}: say which {target}, e.g. {target}=1")
    if index is not None and int(index) < 0:
        raise ValueError(f"fault {text!r}: {target} number must be >= 0")
    if trigger not in _TARGET_TRIGGERS[target]:
        raise ValueError(f"fault {text!r}: a {target} fault fires at {_TARGET_TRIGGERS[target][0]}=N, not {trigger}")
    if int(at) < 1:
        raise ValueError(f"fault {text!r}: {trigger} must be >= 1")
    return FaultSpec(action, target, None if index is None else int(index), trigger, int(at), duration)  # type: ignore[arg-type]


def _pause_seconds(text: str, action: str, seconds: str | None, target: str) -> float | None:
    """The duration of a ``pause=SECONDS`` (the only action that takes one)."""
    if action != "pause":
        if seconds is not None:
            raise ValueError(f"fault {text!r}: only pause takes a duration (pause=SECONDS:...)")
        return None
    if target != "worker":
        raise ValueError(f"fault {text!r}: pause is for workers (pause=SECONDS:worker=K@step=N)")
    try:
        duration = float(seconds) if seconds is not None else math.nan
    except ValueError:
        duration = math.nan
    if not (math.isfinite(duration) and duration > 0):
        raise ValueError(f"fault {text!r}: pause needs its duration in seconds > 0, e.g. pause=8:worker=0@step=30")
    return duration


def parse_faults(texts: Iterable[str]) -> list[FaultSpec]:
    """Parse every string (see :func:`parse_fault`)."""
    return [parse_fault(text) for text in texts]


class FaultInjector:
    """The faults aimed at one process, fired by :meth:`reached` as its counter passes them.

    Args:
        faults: every fault of the run (strings or specs); only those aimed at ``target``/``index`` are kept.
        target: ``worker``, ``server`` or ``rank``.
        index: the worker id or rank (``None`` for the server).
        enabled: ``False`` for a restarted incarnation, which fires nothing.
    """

    def __init__(
        self, faults: Iterable[str | FaultSpec], target: str, index: int | None = None, *, enabled: bool = True
    ):
        specs = [parse_fault(f) if isinstance(f, str) else f for f in faults]
        self.pending = sorted((f for f in specs if enabled and f.targets(target, index)), key=lambda f: f.at)

    def __bool__(self) -> bool:
        return bool(self.pending)

    def due(self, count: int) -> FaultSpec | None:
        """The first pending fault whose trigger ``count`` has reached, removed from the pending list."""
        if self.pending and count >= self.pending[0].at:
            return self.pending.pop(0)
        return None

    def reached(
        self,
        count: int,
        announce: Callable[[FaultSpec], None] | None = None,
        fire: Callable[[FaultSpec], None] | None = None,
    ) -> None:
        """Call with the step (or version) just reached; signals this process if a fault is due.

        Args:
            announce: called with the fault just before the signal (e.g. to write a ``fault_injected``
                event: the moment of failure, against which detection latency is measured).
            fire: what the fault does instead of signalling this process (the virtual-time driver
                kills or hangs a simulated process; :mod:`src.virtual.run`).
        """
        fault = self.due(count)
        if fault is not None:
            if announce is not None:
                announce(fault)
            if fire is not None:
                fire(fault)
                return
            logger.warning("fault injection: %s (pid %d)", fault, os.getpid())  # flushed before the signal
            if fault.seconds is not None:  # pause: a helper process sends the SIGCONT (a stopped process cannot)
                subprocess.Popen(
                    ["/bin/sh", "-c", f"sleep {fault.seconds:g}; kill -CONT {os.getpid()}"],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            os.kill(os.getpid(), ACTIONS[fault.action])
