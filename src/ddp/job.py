"""What every attempt of one elastic DDP job shares: the newest checkpoint, the fatal error, the restart count.

A restarted attempt (the elastic agent restarts the group after a rank died) continues from the
newest checkpoint this job wrote, kept in the agent's store by :class:`JobRecord`; an expected
error (:data:`EXPECTED_ERRORS`) is recorded there too, so later attempts stop at once instead of
repeating a run that cannot succeed.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from src.common.checkpoint import CheckpointError
from src.common.supervisor import LaunchError
from src.config import SetupError
from src.training.data import DatasetUnavailableError

#: Errors a rank reports as one line (anything else is a bug and keeps its traceback). They cannot
#: succeed on a retry, so the first attempt's is recorded and later attempts stop at once.
EXPECTED_ERRORS = (DatasetUnavailableError, CheckpointError, SetupError, LaunchError)


class JobRecord:
    """What every attempt of one elastic job shares: the newest checkpoint it wrote, and a fatal error.

    The elastic agent (torchrun, or :mod:`src.launch.ddp`) hosts one TCPStore for the whole job
    and hands its address to every attempt as ``MASTER_ADDR``/``MASTER_PORT`` (with
    ``TORCHELASTIC_USE_AGENT_STORE=True``). Keys written there outlive a failed attempt, and a new
    job gets a new store, so a restarted attempt finds this job's checkpoint and never an older
    job's left in the same folder. Without an agent store (ranks started some other way, or store
    sharing switched off) nothing is recorded and a restart starts over from ``--resume``.
    """

    _PREFIX = "dts_ddp/"
    _NEWEST_CHECKPOINT = "newest_checkpoint"
    _FATAL = "fatal_error"

    def __init__(self, store: dist.Store | None = None):
        self.store = store

    @classmethod
    def from_environment(cls) -> "JobRecord":
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            return cls(None)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
        )
        return cls(store)

    def _get(self, key: str) -> str | None:
        if self.store is None or not self.store.check([self._PREFIX + key]):
            return None
        return self.store.get(self._PREFIX + key).decode()

    def _set(self, key: str, value: str) -> None:
        if self.store is not None:
            self.store.set(self._PREFIX + key, value)
            # A store's set does not wait for the server; a read on the same connection does, so
            # the value is in the store (for the next attempt) before this returns.
            self.store.get(self._PREFIX + key)

    def newest_checkpoint(self) -> str | None:
        return self._get(self._NEWEST_CHECKPOINT)

    def checkpoint_written(self, path: str | Path) -> None:
        self._set(self._NEWEST_CHECKPOINT, str(path))

    def fatal_error(self) -> str | None:
        return self._get(self._FATAL)

    def record_fatal(self, message: str) -> None:
        self._set(self._FATAL, message)


def int_env(name: str) -> int | None:
    """An integer environment variable (``TORCHELASTIC_RESTART_COUNT``, ...); ``None`` when unset or not a number."""
    value = os.environ.get(name)
    return int(value) if value is not None and value.lstrip("-").isdigit() else None
