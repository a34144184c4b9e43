"""The shards of a sharded server across hosts go back together: who notices a shard start again, and to which
version they all go back.

A sync version is made of the same pushes on every shard (:mod:`src.ps.shards.rounds`), and every shard
checkpoints at the same versions (version 0 at its start, then every ``training.checkpoint_interval``), so the
shards of a run always share a recent version. When one shard dies, every shard goes back to the newest version
all of them have checkpointed, and the versions past it are voided on all of them and redone. A local run's
launcher does it by restarting every shard (:mod:`src.launch.ps`). Across hosts, where each shard is restarted
by its own supervisor (compose's restart policy, a Slurm requeue, an operator), the shards do it themselves:

* **Noticing.** Every server process has a random ``instance`` in its Status. Shard 0 watches each follower
  (:class:`ShardWatch`): a follower that answers with another instance (it started again) or does not answer for
  ``system.heartbeat_timeout`` ends shard 0's run with an error. A follower watches shard 0 the same way
  (:func:`src.launch.ps_roles.wait_for_run_end`). A process that ends so exits non-zero, so its supervisor starts it
  again with ``--resume`` (or ``--resume-unfinished``) and the run's checkpoint folder.
* **Agreeing.** A follower started again with ``--resume`` restores nothing yet and answers calls
  ``UNAVAILABLE`` (clients retry), its Status listing its checkpoints' versions and no version (-1). Shard 0
  started again with ``--resume`` reads every follower's list (:func:`choose_version`, waiting for every one of
  them to be starting again), takes :func:`common_version` and resumes from its own checkpoint of it; its Status
  says ``resume_version``, which each follower waits for (:func:`wait_for_resume_version`) and goes back to.
  The workers see a server restart: they register again and redo what was voided.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

from src import parameter_server_pb2 as pb
from src.transport.errors import CallError

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often a shard looks at another one."""


def common_version(*versions: Sequence[int]) -> int:
    """The newest version in every list (each shard's checkpoints).

    Raises:
        ValueError: the lists share no version.
    """
    shared = set(versions[0]).intersection(*map(set, versions[1:]))
    if not shared:
        raise ValueError(f"the shards have no checkpointed version in common: {[sorted(v) for v in versions]}")
    return max(shared)


def status_or_none(client: Any) -> pb.StatusReply | None:
    """``client``'s server's Status, or ``None`` if it does not answer within 5 s."""
    try:
        return client.status(timeout=5)
    except CallError:
        return None


def choose_version(own: Sequence[int], followers: Sequence[Any], timeout_s: float) -> tuple[int, list[bytes]]:
    """Shard 0 starting again: wait until every follower (a client of each) answers as starting again (version
    -1); the newest version every shard has checkpointed, and the followers' instances it was chosen with.

    Raises:
        TimeoutError: a follower did not answer as starting again within ``timeout_s``.
        ValueError: the shards share no checkpointed version.
    """
    deadline = time.monotonic() + timeout_s
    lists: list[Sequence[int]] = []
    instances: list[bytes] = []
    for shard, client in enumerate(followers, start=1):
        while True:
            status = status_or_none(client)
            if status is not None and status.version == -1:
                lists.append(list(status.checkpoints))
                instances.append(status.instance)
                break
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"shard {shard} did not answer as starting again (--resume) within {timeout_s:.0f} s: every "
                    f"shard of the run must start again to go back to a common version"
                )
            time.sleep(POLL_S)
    return common_version(own, *lists), instances


def wait_for_resume_version(shard_0: Any, instance: bytes, timeout_s: float) -> int | None:
    """A follower starting again (``instance``: its own): the version shard 0 chose with it for every shard, once
    its Status says it; ``None``: shard 0 started afresh (it serves at version 0 and chose none).

    Raises:
        TimeoutError: shard 0 did not answer within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        status = status_or_none(shard_0)
        if status is not None and status.HasField("resume_version") and instance in status.agreed_instances:
            return status.resume_version
        if status is not None and status.instance and status.version == 0:
            return None
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"shard 0 did not say which version the shards go back to within {timeout_s:.0f} s (start it "
                f"again with --resume and the run's checkpoint folder)"
            )
        time.sleep(POLL_S)


class ShardWatch(threading.Thread):
    """Shard 0 watching its followers (a client of each): ``on_lost(message)`` once one starts again (another
    instance) or has not answered for ``timeout_s``."""

    def __init__(self, followers: Sequence[Any], timeout_s: float, on_lost: Callable[[str], None]):
        super().__init__(name="shard-watch", daemon=True)
        self.followers = list(followers)
        self.timeout_s = timeout_s
        self.on_lost = on_lost
        self.stopped = threading.Event()

    def run(self) -> None:
        instances: dict[int, bytes] = {}
        answered = {shard: time.monotonic() for shard in range(1, len(self.followers) + 1)}
        while not self.stopped.wait(POLL_S):
            for shard, client in enumerate(self.followers, start=1):
                status = status_or_none(client)
                now = time.monotonic()
                if status is None:
                    if now - answered[shard] > self.timeout_s:
                        return self._lost(f"shard {shard} has not answered for {self.timeout_s:.1f} s")
                    continue
                answered[shard] = now
                if instances.setdefault(shard, status.instance) != status.instance:
                    return self._lost(f"shard {shard} started again")

    def _lost(self, what: str) -> None:
        logger.error("%s: every shard goes back to a common checkpoint (start them again with --resume)", what)
        self.on_lost(f"{what}: the shards of a sharded run go back together (start every shard again with --resume)")

    def stop(self) -> None:
        self.stopped.set()
